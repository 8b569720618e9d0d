"""The load generator's OpenAI-compatible streaming client against a server that dies mid-response: the
caller gets UNAVAILABLE naming the closed connection, not a parsing error of the chunked body."""

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
