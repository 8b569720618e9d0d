"""Two lmserve replicas behind nginx configured from deploy/nginx/nginx.conf, all on loopback.

The load generator (`lmserve bench load`) streams through nginx; the replicas' own /metrics are the
oracle for where calls ran. Then one replica gets SIGTERM mid-load: every request must still
finish (in-flight streams drain; new calls get UNAVAILABLE, which the SDK retries onto the
other replica through nginx).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import pytest
from _procs import Nginx, render_nginx_conf
from _repo import DEPLOY, replica_pair, server_harness, trained_model

# The SIGTERM test needs calls in flight on the doomed replica when the signal lands, and the trained
# model streams 100 tokens in ~20-40 ms: with room for 8 at once, a replica now and then held none
# between the client's requests (a fresh-clone run drained with 0 calls). Room for two makes the others
# wait their turn, in flight (4-7 at the signal in five runs); speculation off keeps a step per token.
SERVER_FLAGS = dict(threads=1, max_batch=2, grace_period=20, speculation="off")


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    """Short prompts the trained model knows (it has no chat template), one JSON object a line."""
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": prefix}) + "\n" for prefix, _ in trained_model.prompt_continuations((2, 5))))
    return path


@pytest.fixture(scope="module")
def replicas(trained_model_dir, tmp_path_factory):
    """Two servers of the trained model, started (and stopped) side by side. Shared by this module's
    tests; the SIGTERM test, which ends one of them, runs last."""
    with replica_pair(trained_model_dir, tmp_path_factory.mktemp("replica-logs"), **SERVER_FLAGS) as servers:
        yield servers


def shipped_conf() -> str:
    return (DEPLOY / "nginx" / "nginx.conf").read_text()


def make_nginx(nginx_bin: str, backends: list[str], workdir) -> Nginx:
    workdir.mkdir()
    port = server_harness.free_port()
    return Nginx(nginx_bin, render_nginx_conf(shipped_conf(), backends, port, workdir), workdir, port)


@pytest.fixture
def nginx(nginx_bin, replicas, tmp_path):
    proc = make_nginx(nginx_bin, [r.target for r in replicas], tmp_path / "nginx")
    checked = proc.check()
    assert checked.returncode == 0, f"nginx -t rejected the rendered config:\n{checked.stderr}"
    proc.start()
    yield proc
    proc.stop()


def bench_cmd(target: str, prompts, out, *, requests: int, max_new_tokens: int, max_retries: int) -> list[str]:
    return [sys.executable, "-m", "lmserve.client.cli", "bench", "load", "--target", target, "--prompts", str(prompts),
            "--concurrency", "8", "--requests", str(requests), "--max-new-tokens", str(max_new_tokens),
            "--ignore-eos", "--max-retries", str(max_retries), "--no-progress", "--out", str(out)]


def finished_requests(server) -> float:
    """Requests the server finished so far, by its own /metrics."""
    return server.metrics().total("lmserve_requests_total")


def test_shipped_config_passes_nginx_t_with_only_addresses_swapped(nginx_bin, tmp_path):
    backends = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
    proc = make_nginx(nginx_bin, backends, tmp_path / "nginx")
    checked = proc.check()
    assert checked.returncode == 0, checked.stderr
    shipped, rendered = shipped_conf(), proc.conf.read_text()
    for directive in ("grpc_pass grpc://lmserve_backends;", "grpc_read_timeout 600s;", "grpc_send_timeout 600s;",
                      "grpc_next_upstream error timeout", "keepalive 32;"):
        assert directive in shipped and directive in rendered
    assert [line.split()[1] for line in rendered.splitlines() if line.strip().startswith("server 127.")] == backends * 2


def test_bench_through_nginx_spreads_calls_over_both_replicas(nginx, replicas, prompts_file, tmp_path):
    before = [finished_requests(r) for r in replicas]
    out = tmp_path / "bench.json"
    proc = subprocess.run(bench_cmd(nginx.target, prompts_file, out, requests=40, max_new_tokens=16, max_retries=0),
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(out.read_text())["summary"]
    assert (summary["completed"], summary["failed"]) == (40, 0), summary["errors"]
    assert summary["output_tokens"] == 40 * 16  # --ignore-eos: every stream ran to max_new_tokens

    per_replica = [finished_requests(r) - b for r, b in zip(replicas, before)]
    assert all(n > 0 for n in per_replica), f"a replica served nothing: {per_replica}"
    assert sum(per_replica) == 40, f"replicas finished {per_replica} requests for 40 sent"
    upstreams = {line.split("upstream=")[1].split()[0] for line in nginx.access_lines() if "upstream=" in line}
    assert {r.target for r in replicas} <= upstreams


def test_sigterm_on_one_replica_loses_no_request(nginx, replicas, prompts_file, tmp_path):
    doomed, survivor = replicas
    out = tmp_path / "bench.json"
    # Streams long enough (~100 tokens, most of the trained model's 128-token context) and a load long
    # enough (~4 calls at each replica at a time, two decoding and the others waiting, for a few
    # seconds) that the doomed replica holds calls when it handles the signal, even on a busy machine:
    # it is sent once the doomed replica has finished a few requests (the load is under way) and is
    # decoding, far from the load's tail.
    total, tokens = 160, 100
    survivor_before, doomed_before = finished_requests(survivor), finished_requests(doomed)
    bench = subprocess.Popen(bench_cmd(nginx.target, prompts_file, out, requests=total, max_new_tokens=tokens, max_retries=10),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def mid_load() -> bool:
        # decoding with a call waiting behind its batch too: its in-flight calls take at least two
        # requests' time to end, far longer than the signal takes to land (with only running calls
        # checked, a run on a loaded machine saw them all end first: "draining: 0 call(s)")
        m = doomed.metrics()
        return (m.get("lmserve_running_requests") > 0 and m.get("lmserve_waiting_requests") > 0
                and m.total("lmserve_requests_total") >= doomed_before + 8) or bench.poll() is not None

    try:
        server_harness.wait_until(mid_load, timeout=60, interval=0.02, what="the doomed replica to be decoding mid-load")
        assert bench.poll() is None, "the load finished before the replica could be stopped"
        doomed.signal(signal.SIGTERM)
        _, stderr = bench.communicate(timeout=180)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait(10)
    assert bench.returncode == 0, stderr

    assert doomed.wait(timeout=30) == 0, doomed.log_tail()
    assert "grace period over" not in doomed.log, "in-flight calls were still running when the drain ended"
    report = json.loads(out.read_text())
    summary = report["summary"]
    # Every failure here reached the client: a status the SDK would not retry (e.g. CANCELLED sent by
    # a server that is shutting down), or a retryable one after all retries.
    assert summary["failed"] == 0, f"errors after retries: {summary['errors']}\n{nginx.log()}\n{doomed.log_tail()}"
    assert summary["completed"] == total
    assert all(len(r["events"]) > 0 and r["error"] is None for r in report["requests"])
    assert summary["output_tokens"] == total * tokens, "a stream was cut short"
    # The doomed replica was busy when the drain began (its own count), the survivor took over.
    draining = re.search(r"draining: (\d+) call", doomed.log)
    assert draining and int(draining.group(1)) > 0, doomed.log_tail()
    assert finished_requests(survivor) > survivor_before
    assert survivor.health() == "SERVING"
    # And the failover paths ran: calls the draining replica refused (UNAVAILABLE, retried by the SDK)
    # or could no longer connect to (retried by nginx on the other upstream).
    refused = [line for line in nginx.access_lines() if f"upstream={doomed.target} " in line and "grpc_status=14" in line]
    rerouted = [line for line in nginx.access_lines() if f"upstream={doomed.target}, {survivor.target}" in line]
    assert refused or rerouted, "no call met the draining replica: the test did not exercise failover"
