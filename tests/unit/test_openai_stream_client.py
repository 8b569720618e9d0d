"""The load generator's OpenAI-compatible streaming client against a server that dies mid-response: the
caller gets UNAVAILABLE naming the closed connection, not a parsing error of the chunked body; and
against one that closes idle keep-alive connections (llama.cpp's server does after 5 s): no request fails."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from lmserve.client.errors import LmserveError
from lmserve.client.openai_stream import OpenAIStreamClient
from lmserve.client.types import SamplingParams


async def _dying_server(reader, writer, cut: bytes):
    await reader.readuntil(b"\r\n\r\n")  # the request line and headers (the body is read no further)
    event = b'data: {"choices": [{"text": "hi"}]}\n\n'
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                 + b"%x\r\n" % len(event) + event + b"\r\n" + cut)
    await writer.drain()
    writer.close()


@pytest.mark.parametrize("cut", [b"", b"2", b"25\r\ndata: {\"cho"], ids=["after-a-chunk", "in-a-size", "in-a-chunk"])
async def test_a_stream_cut_mid_response_is_unavailable(cut):
    server = await asyncio.start_server(lambda r, w: _dying_server(r, w, cut), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        client = OpenAIStreamClient(f"http://127.0.0.1:{port}/v1", model="m")
        texts = []
        with pytest.raises(LmserveError) as info:
            async for chunk in client.stream("hello", SamplingParams(max_new_tokens=4), timeout=30):
                texts.append(chunk.text)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert "closed the connection mid-response" in str(info.value)
    assert texts == ["hi"]


class _KeepAliveServer:
    """Answers every request on a connection with one complete stream and keeps the connection open, until
    close_idle() closes every connection between requests, as a server's keep-alive timeout does; with
    `announce` False the closes reach no client before its next request (a close in flight)."""

    def __init__(self):
        self.writers, self.connections = [], 0

    async def handle(self, reader, writer):
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                await reader.readexactly(length)
                body = b'data: {"choices": [{"text": "hi"}]}\n\ndata: [DONE]\n\n'
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n"
                             % len(body) + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    def close_idle(self):
        for w in self.writers:
            w.close()
        self.writers = []


async def _texts(client, n):
    async def one():
        return "".join([c.text async for c in client.stream("hello", SamplingParams(max_new_tokens=4), timeout=30)])
    return await asyncio.gather(*(one() for _ in range(n)))


@pytest.mark.parametrize("seen", [True, False], ids=["close-seen", "close-in-flight"])
async def test_requests_after_the_server_closed_idle_connections_take_new_ones(seen, monkeypatch):
    """Three connections left idle; the server closes them all. The next three requests get their answers:
    a connection whose close the client has seen is dropped before use, and one whose close it has not
    seen yet fails its request's first attempt, which goes again on a new connection (not on another idle
    one, closed with it)."""
    srv = _KeepAliveServer()
    server = await asyncio.start_server(srv.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        client = OpenAIStreamClient(f"http://127.0.0.1:{port}/v1", model="m")
        assert await _texts(client, 3) == ["hi"] * 3
        assert srv.connections == 3 and len(client._idle) == 3
        srv.close_idle()
        await asyncio.sleep(0.2)  # the closes reach the client's sockets
        if not seen:  # as if each close were still on its way: the connection looks open when taken
            monkeypatch.setattr(asyncio.StreamReader, "at_eof", lambda self: False)
        assert await _texts(client, 3) == ["hi"] * 3
        assert srv.connections == 6
        await client.close()
