"""TLS, mutual TLS and bearer tokens on a real server, with certificates made by the openssl CLI.

Two servers: TLS with --auth-tokens-file (tokens travel encrypted), and mutual TLS.
"""

from __future__ import annotations

import shutil
import subprocess

import grpc
import pytest
from _server import UNREACHABLE
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lmserve.client import Client, UnauthenticatedError, UnavailableError
from lmserve.v1 import lmserve_pb2 as pb
from lmserve.v1 import lmserve_pb2_grpc as pb_grpc

if shutil.which("openssl") is None:  # pragma: no cover - the CI image has it
    pytest.fail("the openssl command is needed to make test certificates", pytrace=False)

TOKENS = ("s3cret-token-one", "another-token-two")
EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
SMALL = pb.GenerateRequest(prompt="The baker", params=pb.SamplingParams(max_new_tokens=3))


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(d, name):
    openssl("req", "-x509", *EC, "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2",
            "-subj", f"/CN=lmserve {name}", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign", cwd=d)


def make_leaf(d, name, ca, ext):
    openssl("req", *EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    (d / f"{name}.ext").write_text(ext + "\n")
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    make_ca(d, "ca")
    make_ca(d, "other-ca")
    make_leaf(d, "server", "ca", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth")
    make_leaf(d, "client", "ca", "extendedKeyUsage=clientAuth")
    make_leaf(d, "stranger", "other-ca", "extendedKeyUsage=clientAuth")
    (d / "tokens.txt").write_text("# bearer tokens\n" + "\n".join(TOKENS) + "\n\n")
    return d


def creds(pki, ca="ca", client=None) -> grpc.ChannelCredentials:
    chain = key = None
    if client:
        chain, key = (pki / f"{client}.pem").read_bytes(), (pki / f"{client}.key").read_bytes()
    return grpc.ssl_channel_credentials((pki / f"{ca}.pem").read_bytes(), private_key=key, certificate_chain=chain)


@pytest.fixture(scope="module")
def servers(start_module_server, trained_model_dir, pki):
    """Both servers start together (their start-up overlaps), then both must be SERVING."""
    tls = start_module_server(trained_model_dir, credentials=creds(pki), wait=False, threads=1, metrics_port=None,
                              tls_cert=pki / "server.pem", tls_key=pki / "server.key",
                              auth_tokens_file=pki / "tokens.txt")
    mtls = start_module_server(trained_model_dir, credentials=creds(pki, client="client"), wait=False, threads=1,
                               metrics_port=None, tls_cert=pki / "server.pem", tls_key=pki / "server.key",
                               tls_client_ca=pki / "ca.pem")
    tls.wait_ready()
    mtls.wait_ready()
    return tls, mtls


@pytest.fixture(scope="module")
def tls_server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def mtls_server(servers):
    return servers[1]


def bearer(token):
    return (("authorization", f"Bearer {token}"),)


def health(channel, service=""):
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)


# ---- TLS --------------------------------------------------------------------------------------

def test_tls_client_with_the_ca_and_a_token_is_served(tls_server):
    with tls_server.channel() as ch:
        res = pb_grpc.TextGenerationStub(ch).Generate(SMALL, metadata=bearer(TOKENS[1]), timeout=30)
    assert res.usage.completion_tokens >= 1


def test_plaintext_client_cannot_talk_to_the_tls_server(tls_server):
    with tls_server.channel(credentials=None) as ch:
        with pytest.raises(grpc.RpcError) as info:
            health(ch)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_client_that_does_not_trust_the_servers_ca_refuses_it(tls_server, pki):
    with tls_server.channel(credentials=creds(pki, ca="other-ca")) as ch:
        with pytest.raises(grpc.RpcError) as info:
            health(ch)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_localhost_name_matches_the_certificate(tls_server, pki):
    with Client(f"localhost:{tls_server.port}", ca_file=str(pki / "ca.pem"), token=TOKENS[0], timeout=30) as client:
        assert client.health() == "SERVING"
        assert client.generate("The baker", max_new_tokens=2).usage.completion_tokens >= 1


# ---- bearer tokens ----------------------------------------------------------------------------

RPCS = {
    "Generate": lambda stub, md: stub.Generate(SMALL, metadata=md, timeout=30),
    "GenerateStream": lambda stub, md: list(stub.GenerateStream(SMALL, metadata=md, timeout=30)),
    "Tokenize": lambda stub, md: stub.Tokenize(pb.TokenizeRequest(text="hi"), metadata=md, timeout=30),
    "GetModelInfo": lambda stub, md: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md, timeout=30),
}
BAD_METADATA = {
    "no token": (),
    "wrong token": bearer("not-a-token"),
    "token prefix": bearer(TOKENS[0][:-1]),
    "no scheme": (("authorization", TOKENS[0]),),
    "basic scheme": (("authorization", f"Basic {TOKENS[0]}"),),
    "empty bearer": (("authorization", "Bearer "),),
}


@pytest.mark.parametrize("rpc", list(RPCS))
@pytest.mark.parametrize("case", list(BAD_METADATA))
def test_calls_without_a_valid_token_are_unauthenticated(tls_server, rpc, case):
    with tls_server.channel() as ch:
        with pytest.raises(grpc.RpcError) as info:
            RPCS[rpc](pb_grpc.TextGenerationStub(ch), BAD_METADATA[case])
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert TOKENS[0] not in info.value.details()


@pytest.mark.parametrize("token", TOKENS)
def test_every_listed_token_works(tls_server, token):
    with tls_server.channel() as ch:
        stub = pb_grpc.TextGenerationStub(ch)
        for call in RPCS.values():
            call(stub, bearer(token))
        assert list(stub.Tokenize(pb.TokenizeRequest(text="hi"), metadata=(("authorization", f"bearer {token}"),),
                                  timeout=30).token_ids)  # the scheme is case-insensitive


def test_health_needs_no_token(tls_server):
    with tls_server.channel() as ch:
        for service in ("", "lmserve.v1.TextGeneration"):
            assert health(ch, service).status == health_pb2.HealthCheckResponse.SERVING


def test_sdk_maps_a_missing_token_to_unauthenticated_error(tls_server, pki):
    with Client(tls_server.target, ca_file=str(pki / "ca.pem"), timeout=30) as client:
        with pytest.raises(UnauthenticatedError):
            client.generate("The baker", max_new_tokens=2)
        assert client.health() == "SERVING"


# ---- mutual TLS -------------------------------------------------------------------------------

def test_mtls_client_with_a_certificate_is_served(mtls_server):
    with mtls_server.channel() as ch:
        res = pb_grpc.TextGenerationStub(ch).Generate(SMALL, timeout=30)
    assert res.usage.completion_tokens >= 1


@pytest.mark.parametrize("client", [None, "stranger"], ids=["no client certificate", "certificate of another CA"])
def test_mtls_rejects_clients_without_a_trusted_certificate(mtls_server, pki, client):
    with mtls_server.channel(credentials=creds(pki, client=client)) as ch:
        with pytest.raises(grpc.RpcError) as info:
            health(ch)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert mtls_server.health() == "SERVING"  # a refused handshake leaves the server healthy


def test_sdk_over_mtls(mtls_server, pki):
    with Client(mtls_server.target, ca_file=str(pki / "ca.pem"), client_cert=str(pki / "client.pem"),
                client_key=str(pki / "client.key"), timeout=30) as client:
        assert client.generate("The baker", max_new_tokens=2).usage.completion_tokens >= 1
    with Client(mtls_server.target, ca_file=str(pki / "ca.pem"), max_retries=0, timeout=10) as client:
        with pytest.raises(UnavailableError):
            client.model_info()


def test_servers_stop_cleanly(servers):
    for srv in servers:
        assert srv.stop() == 0
        assert srv.health() == UNREACHABLE
        assert "Traceback" not in srv.log
