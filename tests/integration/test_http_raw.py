"""The HTTP edge byte by byte: SSE as `curl -N` sees it, malformed bodies, paths, probes, request ids."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess

import httpx
import pytest
from _server import HOST


@pytest.fixture(scope="module")
def base(server) -> str:
    return server.http_url.removesuffix("/v1")


@pytest.fixture(scope="module")
def model_id(base) -> str:
    return httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]


def events_of(raw: str) -> list[str]:
    """The `data:` payloads of an SSE body, in order."""
    out = []
    for block in raw.split("\n\n"):
        if block.strip():
            (line,) = block.strip().splitlines()
            assert line.startswith("data: "), line
            out.append(line[len("data: "):])
    return out


def error_of(response: httpx.Response) -> dict:
    assert response.headers["content-type"].startswith("application/json")
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_streams_the_events_the_sdk_reads(base, model_id):
    body = {"model": model_id, "messages": [{"role": "user", "content": "The baker"}], "max_tokens": 12,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    out = subprocess.run(["curl", "-sN", "--max-time", "60", "-H", "Content-Type: application/json", "-d",
                          json.dumps(body), f"{base}/v1/chat/completions"], capture_output=True, text=True, check=True)
    events = events_of(out.stdout)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    whole = httpx.post(f"{base}/v1/chat/completions", json={**body, "stream": False, "stream_options": None},
                       timeout=60).json()
    assert text == whole["choices"][0]["message"]["content"]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}


def test_a_stream_is_sse_unbuffered_with_the_request_id(base, model_id):
    with httpx.stream("POST", f"{base}/v1/completions", headers={"x-request-id": "my-id-1"}, timeout=60,
                      json={"model": model_id, "prompt": "The fox", "max_tokens": 4, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-accel-buffering"] == "no" and r.headers["cache-control"] == "no-cache"
        assert r.headers["x-request-id"] == "my-id-1"
        events = events_of(r.read().decode())
    assert events[-1] == "[DONE]" and json.loads(events[0])["id"] == "cmpl-my-id-1"


@pytest.mark.parametrize("body, param, words", [
    (b"{not json", "body", "not valid JSON"),
    (b'{"model": "m", "prompt": "\xff\xfe"}', "body", "UTF-8"),
    (b"[" * 30_000 + b"]" * 30_000, "body", "nested too deeply"),
    (b'"just a string"', "body", "JSON object"),
    (b'{"model": "M", "prompt": "x", "temperature": NaN}', "body", "NaN"),
    (b'{"prompt": "x"}', "model", "required"),
])
def test_malformed_bodies_are_clear_400s(base, body, param, words):
    r = httpx.post(f"{base}/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == param and words in err["message"], err


@pytest.mark.parametrize("field, value, param", [
    ("max_tokens", "ten", "max_tokens"),
    ("max_tokens", True, "max_tokens"),
    ("temperature", "hot", "temperature"),
    ("stop", 5, "stop"),
    ("stop", ["ok", 5], "stop[1]"),
    ("seed", 1.5, "seed"),
    ("stream", "yes", "stream"),
    ("prompt", {"a": 1}, "prompt"),
    ("prompt", ["one", "two"], "prompt"),
    ("prompt", "", "prompt"),
    ("stream_options", {"include_usage": True}, "stream_options"),
])
def test_wrong_types_name_the_field(base, model_id, field, value, param):
    body = {"model": model_id, "prompt": "The baker", "max_tokens": 3, field: value}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == param


def test_token_id_prompts_and_their_limits(base, model_id, server):
    ids = httpx.post(f"{base}/v1/completions", json={"model": model_id, "prompt": [5, 6, 7], "max_tokens": 2,
                                                     "temperature": 0}, timeout=30)
    assert ids.status_code == 200 and ids.json()["usage"]["prompt_tokens"] == 3
    bad = httpx.post(f"{base}/v1/completions", json={"model": model_id, "prompt": [10**9], "max_tokens": 2},
                     timeout=30)
    assert bad.status_code == 400 and error_of(bad)["param"] == "prompt"


def test_unknown_paths_and_methods(base):
    r = httpx.get(f"{base}/v2/everything", timeout=10)
    assert r.status_code == 404 and error_of(r)["type"] == "not_found_error"
    r = httpx.get(f"{base}/v1/chat/completions", timeout=10)
    assert r.status_code == 405 and error_of(r)


def test_probes(base):
    assert httpx.get(f"{base}/health", timeout=10).json() == {"status": "ok"}
    assert httpx.get(f"{base}/ready", timeout=10).status_code == 200


def test_a_bad_request_id_is_refused(base, model_id):
    r = httpx.post(f"{base}/v1/completions", headers={"x-request-id": "x" * 300}, timeout=30,
                   json={"model": model_id, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 400 and error_of(r)["param"] == "x-request-id"


def test_a_declared_oversized_body_is_refused_before_it_is_read(base, trained_server_flags):
    limit = trained_server_flags["max_receive_message_bytes"]
    with socket.create_connection((HOST, int(base.rsplit(":", 1)[1])), timeout=30) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {limit * 4}\r\n\r\n".encode())
        head = s.recv(4096).decode(errors="replace")
    assert head.startswith("HTTP/1.1 413"), head


def test_a_chunked_oversized_body_is_refused(base, trained_server_flags):
    limit = trained_server_flags["max_receive_message_bytes"]

    def parts():
        for _ in range(limit // 4096 + 2):
            yield b"x" * 4096

    r = httpx.post(f"{base}/v1/completions", content=parts(), timeout=30)
    assert r.status_code == 413 and error_of(r)["type"] == "invalid_request_error"
