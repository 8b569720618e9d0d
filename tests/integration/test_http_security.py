"""The HTTP edge under the same TLS certificate and bearer tokens as gRPC (certificates from the openssl CLI)."""

from __future__ import annotations

import ssl

import anthropic
import httpx
import openai
import pytest
from test_security import TOKENS, creds, make_ca, make_leaf

from lmserve.client import Client


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("http-pki")
    make_ca(d, "ca")
    make_leaf(d, "server", "ca", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth")
    (d / "tokens.txt").write_text("\n".join(TOKENS) + "\n")
    return d


@pytest.fixture(scope="module")
def tls_server(start_module_server, trained_model_dir, pki):
    return start_module_server(trained_model_dir, credentials=creds(pki), threads=1, metrics_port=None,
                               tls_cert=pki / "server.pem", tls_key=pki / "server.key",
                               auth_tokens_file=pki / "tokens.txt")


def sdk(server, pki, token):
    return openai.OpenAI(base_url=server.http_url, api_key=token, max_retries=0, timeout=60,
                         http_client=httpx.Client(verify=trusting(pki)))


def trusting(pki) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(pki / "ca.pem"))


def test_https_with_a_token_is_served_like_grpc(tls_server, pki):
    assert tls_server.http_url.startswith("https://")
    with sdk(tls_server, pki, TOKENS[1]) as client:
        model = client.models.list().data[0].id
        res = client.completions.create(model=model, prompt="The baker", max_tokens=6, temperature=0)
    with Client(tls_server.target, ca_file=str(pki / "ca.pem"), token=TOKENS[0], timeout=30) as grpc_client:
        want = grpc_client.generate("The baker", max_new_tokens=6)
    assert res.choices[0].text == want.text


def test_a_request_without_a_token_is_a_401(tls_server, pki):
    with httpx.Client(verify=trusting(pki), timeout=30) as http:
        r = http.post(f"{tls_server.http_url}/completions", json={"model": "m", "prompt": "hi"})
        basic = http.get(f"{tls_server.http_url}/models", headers={"authorization": f"Basic {TOKENS[0]}"})
    assert r.status_code == basic.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("token", ["wrong-token", TOKENS[0] + "x"])
def test_a_wrong_token_is_a_401(tls_server, pki, token):
    with sdk(tls_server, pki, token) as client:
        with pytest.raises(openai.AuthenticationError) as err:
            client.models.list()
    assert err.value.status_code == 401 and err.value.body["type"] == "authentication_error"
    assert err.value.response.headers["www-authenticate"] == "Bearer"


def test_anthropic_clients_authenticate_with_x_api_key(tls_server, pki):
    def claude(token: str) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=tls_server.http_url.removesuffix("/v1"), api_key=token, max_retries=0,
                                   timeout=60, http_client=anthropic.DefaultHttpxClient(verify=trusting(pki)))

    with claude(TOKENS[1]) as client:
        model = client.models.list().data[0].id
        assert client.messages.count_tokens(model=model, messages=[{"role": "user", "content": "hi"}]).input_tokens
    with claude("wrong-token") as client, pytest.raises(anthropic.AuthenticationError) as err:
        client.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "authentication_error"


def test_probes_need_no_token(tls_server, pki):
    with httpx.Client(verify=trusting(pki), timeout=30) as http:
        base = tls_server.http_url.removesuffix("/v1")
        assert http.get(f"{base}/ready").status_code == 200
        assert http.get(f"{base}/health").status_code == 200
        assert http.get(f"{base}/v1/models").status_code == 401


def test_plaintext_http_is_not_served_on_the_tls_port(tls_server):
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{tls_server.http_port}/ready", timeout=10)
