"""TLS and mutual TLS from the SDK to a loopback server, with certificates made by openssl."""

import shutil
import subprocess

import grpc
import pytest
from _client_fakes import LoopbackServer

from lmserve.client import Client, errors

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")

EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", *EC, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=lmserve test CA",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign", cwd=d)
    for name, ext in (("server", "subjectAltName=DNS:localhost,IP:127.0.0.1"), ("client", "extendedKeyUsage=clientAuth")):
        _openssl("req", *EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)
    return d


def _server_credentials(pki, require_client_auth):
    return grpc.ssl_server_credentials(
        [((pki / "server.key").read_bytes(), (pki / "server.pem").read_bytes())],
        root_certificates=(pki / "ca.pem").read_bytes(),
        require_client_auth=require_client_auth,
    )


def test_tls_with_ca_file(pki):
    with LoopbackServer(server_credentials=_server_credentials(pki, False)) as srv:
        with Client(srv.localhost_target, ca_file=str(pki / "ca.pem")) as client:
            assert client.generate("x").text == "Hello world"


def test_plaintext_client_cannot_talk_to_tls_server(pki):
    with LoopbackServer(server_credentials=_server_credentials(pki, False)) as srv:
        with Client(srv.localhost_target, max_retries=0, timeout=10) as client:
            with pytest.raises(errors.UnavailableError):
                client.model_info()


def test_mutual_tls(pki):
    with LoopbackServer(server_credentials=_server_credentials(pki, True)) as srv:
        with Client(srv.localhost_target, ca_file=str(pki / "ca.pem"), client_cert=str(pki / "client.pem"),
                    client_key=str(pki / "client.key")) as client:
            assert client.health() == "SERVING"
        with Client(srv.localhost_target, ca_file=str(pki / "ca.pem"), max_retries=0, timeout=10) as client:
            with pytest.raises(errors.UnavailableError):  # no client certificate: handshake refused
                client.model_info()
