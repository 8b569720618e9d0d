"""The HTTP edge's lifecycle: a disconnect cancels and frees KV, a full queue is 429, SIGTERM drains,
and slow or idle clients cannot hold the server (header/body timeouts, a cap on connections)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import socket

import httpx
import openai
import pytest
from _server import HOST, UNREACHABLE, wait_until

CAP = 8  # HTTP connections of the tight server
LONG = {"max_tokens": 80, "ignore_eos": True, "temperature": 0}


def model_of(srv) -> str:
    return httpx.get(f"{srv.http_url}/models", timeout=30).json()["data"][0]["id"]


def test_a_client_that_disconnects_mid_stream_cancels_and_frees_its_kv(server):
    model = model_of(server)

    def scenario():
        with httpx.stream("POST", f"{server.http_url}/completions", timeout=60,
                          json={"model": model, "prompt": "The baker", "stream": True, **LONG,
                                "max_tokens": 100}) as r:
            assert r.status_code == 200, r.read()
            lines = r.iter_lines()
            got = [line for line, _ in zip(lines, range(3)) if line.startswith("data: ")]
        return got  # leaving the block closes the connection mid-stream

    before, after, got = server.until_cancelled(scenario)
    assert got and all(json.loads(line[6:])["choices"][0]["finish_reason"] is None for line in got)
    assert after.total("lmserve_requests_total", status="cancelled", protocol="http") == before.total(
        "lmserve_requests_total", status="cancelled", protocol="http") + 1
    assert after.get("lmserve_kv_slots_used") == 0 and after.get("lmserve_running_requests") == 0


@pytest.fixture(scope="module")
def tight(start_module_server, trained_model_dir):
    """One slot, one queue place, short read and keep-alive timeouts, at most CAP HTTP connections; no
    speculation, so a long stream holds the slot for one step a token (the trained model's repeating
    text would let drafts finish it early)."""
    return start_module_server(trained_model_dir, threads=1, max_batch=1, max_queue=1, http_read_timeout=1,
                               http_keep_alive_timeout=1, http_max_connections=CAP, speculation="off")


async def test_a_full_queue_is_a_429(tight):
    """One request decodes, the queue holds one: of a burst of five more, those beyond the queue get 429."""
    model = model_of(tight)
    async with httpx.AsyncClient(timeout=60) as http:
        body = {"model": model, "prompt": "The baker", "stream": True, **LONG, "max_tokens": 110}
        async with http.stream("POST", f"{tight.http_url}/completions", json=body) as running:
            lines = running.aiter_lines()
            assert (await anext(lines)).startswith("data: ")  # it holds the only slot for ~110 steps
            async with openai.AsyncOpenAI(base_url=tight.http_url, api_key="x", max_retries=0, timeout=60) as client:
                results = await asyncio.gather(*(client.completions.create(
                    model=model, prompt="The fox", max_tokens=2) for _ in range(5)), return_exceptions=True)
            assert [line async for line in lines if line][-1] == "data: [DONE]"
    refused = [r for r in results if isinstance(r, Exception)]
    assert refused and len(refused) >= 5 - 1 - 1  # at most the queue's one, and one more if the slot freed
    for err in refused:
        assert isinstance(err, openai.RateLimitError), repr(err)
        assert err.status_code == 429 and "overloaded" in err.body["message"]
        assert err.response.headers["retry-after"]
    assert all(r.usage.completion_tokens == 2 for r in results if not isinstance(r, Exception))


def test_headers_that_never_finish_lose_the_connection(tight):
    with socket.create_connection((HOST, tight.http_port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        assert s.recv(1024) == b""  # closed by the server after --http-read-timeout (the timeout here: 30 s)


def test_an_idle_keep_alive_connection_is_closed_after_its_timeout(tight):
    with socket.create_connection((HOST, tight.http_port), timeout=4) as s:  # uvicorn's own default is 5 s
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = b""
        while b"\r\n\r\n" not in reply:
            reply += s.recv(4096)
        assert reply.startswith(b"HTTP/1.1 200") and b"connection: close" not in reply.lower()
        while chunk := s.recv(4096):  # the body, then the server's close after --http-keep-alive-timeout (1 s)
            reply += chunk


def test_a_body_that_never_finishes_is_a_408(tight):
    with socket.create_connection((HOST, tight.http_port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"model\":")
        head = _whole_response(s)  # headers and body may arrive in separate segments
    assert head.startswith("HTTP/1.1 408"), head
    assert "http-read-timeout" in head


def _whole_response(s: socket.socket) -> str:
    """One HTTP response read off a raw socket: its headers, then content-length bytes of body (or up
    to the server's close)."""
    reply = b""
    while b"\r\n\r\n" not in reply and (chunk := s.recv(4096)):
        reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    length = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
    while length and len(body) < int(length.group(1)) and (chunk := s.recv(4096)):
        body += chunk
    return (head + b"\r\n\r\n" + body).decode(errors="replace")


def test_connections_beyond_the_cap_are_refused_with_503(tight):
    idle = [socket.create_connection((HOST, tight.http_port), timeout=30) for _ in range(CAP)]
    try:
        with httpx.Client(timeout=30) as http:
            refused = http.get(f"{tight.http_url}/models")
        assert refused.status_code == 503
    finally:
        for s in idle:
            s.close()

    def served():
        try:
            return httpx.get(f"{tight.http_url}/models", timeout=30).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(served, 30, 0.1, "the closed connections to be counted out")


async def test_sigterm_drains_http_streams(start_server, trained_model_dir):
    server = start_server(trained_model_dir, threads=1, max_batch=1, grace_period=60)
    model = model_of(server)
    streams = 4
    async with httpx.AsyncClient(timeout=120) as http:
        body = {"model": model, "prompt": "The baker", "stream": True, "stream_options": {"include_usage": True},
                **LONG}
        async with contextlib.AsyncExitStack() as stack:
            responses = [await stack.enter_async_context(http.stream("POST", f"{server.http_url}/completions",
                                                                     json=body)) for _ in range(streams)]
            assert all(r.status_code == 200 for r in responses)  # all admitted (one decodes, the others wait)
            server.signal(signal.SIGTERM)
            refused = await http.post(f"{server.http_url}/completions", json={"model": model, "prompt": "Hi",
                                                                              "max_tokens": 2})
            ready = await http.get(f"{server.http_url.removesuffix('/v1')}/ready")
            alive = await http.get(f"{server.http_url.removesuffix('/v1')}/health")
            bodies = await asyncio.gather(*(r.aread() for r in responses))
    assert refused.status_code == 503 and "draining" in refused.json()["error"]["message"]
    assert ready.status_code == 503 and ready.json() == {"status": "draining"}
    assert alive.status_code == 200
    texts = set()
    for raw in bodies:
        events = [e for e in raw.decode().split("\n\n") if e.strip()]
        assert events[-1] == "data: [DONE]"
        usage = json.loads(events[-2][6:])["usage"]
        assert usage["completion_tokens"] == LONG["max_tokens"]  # every stream in flight ran to its end
        texts.add("".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-2]))
    assert len(texts) == 1  # greedy, the same prompt: the same text, whatever waited
    assert await asyncio.to_thread(server.wait, 60) == 0
    assert server.health() == UNREACHABLE
    drained = re.search(r"draining: (\d+) call\(s\) in flight", server.log)
    assert drained and int(drained.group(1)) == streams, server.log_tail()
    assert "Traceback" not in server.log


