"""Sync and asyncio clients against a loopback servicer: what goes on the wire, and cancellation."""

import pytest
from _client_fakes import LoopbackServer, Script

from lmserve.client import AsyncClient, ChatMessage, Client, SamplingParams


def test_requests_carry_input_params_id_and_bearer_token():
    with LoopbackServer() as srv, Client(srv.target, token="s3cret") as client:
        result = client.generate([ChatMessage("user", "hi")], SamplingParams(max_new_tokens=7), seed=5,
                                 request_id="abc")
        method, request = srv.servicer.requests[-1]
        metadata = srv.servicer.metadata[-1]
    assert method == "Generate"
    assert request.request_id == "abc" and result.request_id == "abc"
    assert [(m.role, m.content) for m in request.messages.messages] == [("user", "hi")]
    assert request.params.max_new_tokens == 7 and request.params.seed == 5
    assert metadata["authorization"] == "Bearer s3cret"
    assert result.usage.completion_tokens == len(result.token_ids)


def test_no_token_means_no_authorization_metadata():
    with LoopbackServer() as srv, Client(srv.target) as client:
        client.model_info()
        assert "authorization" not in srv.servicer.metadata[-1]


def test_stream_validates_eagerly():
    with LoopbackServer() as srv, Client(srv.target) as client:
        with pytest.raises(TypeError):
            client.stream(b"bytes")
        assert srv.servicer.requests == []


def test_closing_a_sync_stream_early_cancels_the_server_call():
    with LoopbackServer(Script(stream_forever=True)) as srv, Client(srv.target) as client:
        stream = client.stream("x")
        first = [next(stream) for _ in range(5)]
        stream.close()
        assert srv.servicer.cancelled.wait(timeout=10)
    assert [c.text for c in first[:3]] == ["Hel", "lo", " world"]


async def test_closing_an_async_stream_early_cancels_the_server_call():
    with LoopbackServer(Script(stream_forever=True)) as srv:
        async with AsyncClient(srv.target) as client:
            stream = client.stream("x")
            async for chunk in stream:
                if chunk.text == ".":
                    break
            await stream.aclose()
            assert srv.servicer.cancelled.wait(timeout=10)


@pytest.mark.parametrize("status", ["SERVING", "NOT_SERVING"])
def test_health_reports_the_server_status(status):
    with LoopbackServer(health_status=status) as srv, Client(srv.target) as client:
        assert client.health() == status


async def test_async_surface_matches_sync():
    with LoopbackServer() as srv:
        with Client(srv.target) as sync_client:
            expected = (sync_client.generate("x"), sync_client.tokenize("ab"), sync_client.model_info(),
                        sync_client.health())
        async with AsyncClient(srv.target) as client:
            got = (await client.generate("x"), await client.tokenize("ab"), await client.model_info(),
                   await client.health())
    assert got == expected


def test_tls_settings_are_checked():
    with pytest.raises(ValueError):
        Client("localhost:1", client_cert="cert.pem")  # key missing
    with pytest.raises(OSError):
        Client("localhost:1", ca_file="/nonexistent/ca.pem")
