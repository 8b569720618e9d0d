"""The OpenAI HTTP API through nginx configured from deploy/nginx/nginx.conf, two replicas on loopback.

SSE passes unbuffered; a conversation key (X-Conversation-Id, or OpenAI's `user`) keeps a
conversation on one replica, whose prefix cache the second turn then hits; a draining replica's
keys move to the other one without a failed request. The replicas' /metrics are the oracle for
where requests ran.
"""

from __future__ import annotations

import json
import signal

import httpx
import pytest
from _procs import Nginx, render_nginx_conf
from _repo import DEPLOY, replica_pair, server_harness

SERVER_FLAGS = dict(threads=1, max_batch=8, grace_period=30)
KEYS = [f"conversation-{i}" for i in range(4)]


@pytest.fixture(scope="module")
def replicas(trained_model_dir, tmp_path_factory):
    with replica_pair(trained_model_dir, tmp_path_factory.mktemp("http-replica-logs"), **SERVER_FLAGS) as servers:
        yield servers


@pytest.fixture(scope="module")
def nginx(nginx_bin, replicas, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("nginx-http")
    grpc_port, http_port = server_harness.free_port(), server_harness.free_port()
    conf = render_nginx_conf((DEPLOY / "nginx" / "nginx.conf").read_text(), [r.target for r in replicas], grpc_port,
                             workdir, http_backends=[f"{server_harness.HOST}:{r.http_port}" for r in replicas],
                             http_port=http_port)
    proc = Nginx(nginx_bin, conf, workdir, grpc_port)
    checked = proc.check()
    assert checked.returncode == 0, checked.stderr
    proc.start()
    proc.http_url = f"http://{server_harness.HOST}:{http_port}/v1"
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def model_id(replicas) -> str:
    return httpx.get(f"{replicas[0].http_url}/models", timeout=30).json()["data"][0]["id"]


def served(replicas) -> list[float]:
    return [r.metrics().total("lmserve_requests_total", protocol="http") for r in replicas]


def which_replica(replicas, before: list[float]) -> int:
    after = served(replicas)
    moved = [i for i, (a, b) in enumerate(zip(after, before)) if a != b]
    assert len(moved) == 1 and after[moved[0]] - before[moved[0]] == 1, (before, after)
    return moved[0]


def test_the_shipped_config_names_both_upstreams_and_sse_settings():
    shipped = (DEPLOY / "nginx" / "nginx.conf").read_text()
    for directive in ("hash $conversation_key consistent;", "proxy_buffering off;", "proxy_http_version 1.1;",
                      "listen 8000;", "proxy_next_upstream error timeout http_502 http_503"):
        assert directive in shipped, directive


def test_a_stream_passes_through_unbuffered_and_a_disconnect_cancels_it(nginx, replicas, model_id):
    body = {"model": model_id, "prompt": "The baker", "max_tokens": 100, "ignore_eos": True, "temperature": 0,
            "stream": True}
    headers = {"x-conversation-id": "stream-test"}
    before = served(replicas)
    with httpx.stream("POST", f"{nginx.http_url}/completions", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    home = which_replica(replicas, before)
    assert events[-1] == "data: [DONE]"
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    direct = httpx.post(f"{replicas[home].http_url}/completions", json={**body, "stream": False}, timeout=120).json()
    assert text == direct["choices"][0]["text"]

    def first_event_then_leave():
        with httpx.stream("POST", f"{nginx.http_url}/completions", json=body, headers=headers, timeout=120) as r:
            return next(line for line in r.iter_lines() if line)

    # a buffering proxy would pass the first event only once the request had ended, and never be cancelled
    _, _, first = replicas[home].until_cancelled(first_event_then_leave)
    assert first.startswith("data: ")


@pytest.mark.parametrize("how", ["header", "user"])
def test_a_conversations_second_turn_lands_on_its_replica_and_hits_the_cache(nginx, replicas, model_id, how):
    for key in KEYS:
        def send(prompt: str) -> dict:
            body = {"model": model_id, "prompt": prompt, "max_tokens": 24, "temperature": 0}
            headers = {}
            if how == "header":
                headers["x-conversation-id"] = key
            else:
                body["user"] = key
            r = httpx.post(f"{nginx.http_url}/completions", json=body, headers=headers, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()

        first_prompt = f"{key}: The lighthouse keeper climbed the spiral stairs"
        before = served(replicas)
        first = send(first_prompt)
        home = which_replica(replicas, before)
        hits_before = replicas[home].metrics().get("lmserve_prefix_cache_hit_tokens_total")
        before = served(replicas)
        second = send(first_prompt + first["choices"][0]["text"] + " And then")
        assert which_replica(replicas, before) == home, f"{key}: the second turn went to another replica"
        hits = replicas[home].metrics().get("lmserve_prefix_cache_hit_tokens_total") - hits_before
        assert hits >= first["usage"]["prompt_tokens"] // 2, (key, hits, first["usage"])
        assert second["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"]


def test_a_draining_replicas_conversations_move_without_a_failure(nginx, replicas, model_id):
    """Runs last: it stops one replica."""
    key = KEYS[0]
    headers = {"x-conversation-id": key}
    small = {"model": model_id, "prompt": "The fox", "max_tokens": 4, "temperature": 0}
    before = served(replicas)
    assert httpx.post(f"{nginx.http_url}/completions", json=small, headers=headers, timeout=60).status_code == 200
    home = which_replica(replicas, before)
    doomed, survivor = replicas[home], replicas[1 - home]
    long = {"model": model_id, "prompt": "The baker", "max_tokens": 100, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"{nginx.http_url}/completions", json=long, headers=headers) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line).startswith("data: ")  # running on the doomed replica
            doomed.signal(signal.SIGTERM)
            server_harness.wait_until(lambda: _not_ready(doomed), 30, 0.05, "draining")
            survivor_before = survivor.metrics().total("lmserve_requests_total", protocol="http")
            moved = http.post(f"{nginx.http_url}/completions", json=small, headers=headers)
            rest = [line for line in lines if line]
    assert moved.status_code == 200, moved.text  # the draining replica's 503 was retried on the survivor
    assert survivor.metrics().total("lmserve_requests_total", protocol="http") == survivor_before + 1
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"  # the stream ran to its end
    assert doomed.wait(timeout=60) == 0, doomed.log_tail()
    assert "grace period over" not in doomed.log


def _not_ready(replica) -> bool:
    """Draining (/ready answers 503) or already gone: the stream above may have been generated whole
    before the signal (the client reads it later), and a replica with nothing in flight exits at once."""
    try:
        return httpx.get(f"{replica.http_url.removesuffix('/v1')}/ready", timeout=5).status_code == 503
    except httpx.ConnectError:
        return True
