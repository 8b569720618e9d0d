"""Bearer tokens in the SDK and CLI: never in a repr, a warning (once) when one would travel
unencrypted to another machine, and --token-file so a token need not sit in the process list."""

from __future__ import annotations

import warnings

import pytest
from _client_fakes import LoopbackServer

from lmserve.client import AsyncClient, Client, PlaintextTokenWarning, cli
from lmserve.client._channel import Connection, is_loopback_target

SECRET = "s3cret-token-value"


@pytest.mark.parametrize("target,loopback", [
    ("localhost:50051", True), ("127.0.0.1:1", True), ("127.8.9.10:5", True), ("[::1]:50051", True),
    ("dns:///localhost:443", True), ("ipv4:127.0.0.1:1,127.0.0.2:2", True), ("unix:/run/lmserve.sock", True),
    ("api.localhost:80", True), ("localhost", True),
    ("10.0.0.5:50051", False), ("llm.example.com:443", False), ("dns:///llm.example.com", False),
    ("ipv4:127.0.0.1:1,10.0.0.1:2", False), ("[2001:db8::1]:50051", False), ("localhost.evil.com:1", False),
])
def test_loopback_targets(target, loopback):
    assert is_loopback_target(target) is loopback


def test_a_token_never_shows_in_reprs():
    conn = Connection(target="localhost:1", token=SECRET)
    assert SECRET not in repr(conn) and conn.metadata() == (("authorization", f"Bearer {SECRET}"),)
    with Client("localhost:1", token=SECRET) as client:
        assert SECRET not in repr(client) and SECRET not in repr(client.connection)


def test_plaintext_to_another_host_warns_once_per_target():
    with pytest.warns(PlaintextTokenWarning, match="without TLS to 10.11.12.13:50051"):
        Client("10.11.12.13:50051", token=SECRET).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any further warning would fail the test
        Client("10.11.12.13:50051", token=SECRET).close()  # the same target: already told
        Client("10.11.12.14:50051").close()  # no token: nothing to leak
        Client("10.11.12.15:50051", token=SECRET, tls=True).close()  # encrypted
        Client("localhost:50051", token=SECRET).close()  # this machine
    with pytest.warns(PlaintextTokenWarning) as record:
        Connection(target="llm.example.com:80", token=SECRET)  # what both clients build first
    assert SECRET not in str(record[0].message)


async def test_the_async_client_warns_too():
    with pytest.warns(PlaintextTokenWarning):
        client = AsyncClient("llm2.example.com:80", token=SECRET)
    assert SECRET not in repr(client)
    await client.close()


def test_token_file_feeds_the_bearer_token(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LMSERVE_TOKEN", raising=False)
    path = tmp_path / "token"
    path.write_text("\n  file-token  \n# trailing\n")
    args = cli.build_parser().parse_args(["info", "--token-file", str(path), "-t", "localhost:1"])
    assert cli.client_kwargs(args)["token"] == "file-token"
    with LoopbackServer() as srv:
        assert cli.main(["info", "--token-file", str(path), "-t", srv.target]) == 0
        assert srv.servicer.metadata[-1]["authorization"] == "Bearer file-token"
    (tmp_path / "empty").write_text("\n \n")
    assert cli.main(["info", "--token-file", str(tmp_path / "empty"), "-t", "localhost:1"]) == 2
    assert "holds no token" in capsys.readouterr().err
    assert cli.main(["info", "--token-file", str(tmp_path / "missing"), "-t", "localhost:1"]) == 2
    assert cli.main(["info", "--token", "x", "--token-file", str(path), "-t", "localhost:1"]) == 2
    assert "not both" in capsys.readouterr().err
    monkeypatch.setenv("LMSERVE_TOKEN_FILE", str(path))
    assert cli.client_kwargs(cli.build_parser().parse_args(["info"]))["token"] == "file-token"
