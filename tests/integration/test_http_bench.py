"""`lmserve bench load --api openai --url ...` drives the HTTP API with the same workloads and report as gRPC."""

from __future__ import annotations

import json
import subprocess
import sys


def bench(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmserve.client.cli", "bench", "load", "--no-progress", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


def test_bench_over_the_openai_api_agrees_with_the_server(server, training_prompts, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"prompt": p} for p, _ in training_prompts[:3]] + [{"messages": [{"role": "user", "content": "The fox"}]}]
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "report.json"
    before = server.wait_idle()
    proc = bench("--api", "openai", "--url", server.http_url, "--requests", 8, "--concurrency", 4,
                 "--max-new-tokens", 16, "--ignore-eos", "--prompts", prompts, "--out", out)
    assert proc.returncode == 0, proc.stderr
    after = server.wait_idle()
    summary = json.loads(out.read_text())["summary"]
    assert (summary["completed"], summary["failed"]) == (8, 0), summary["errors"]
    assert summary["output_tokens"] == 8 * 16  # counted per piece, then matched to the server's usage
    assert after.total("lmserve_requests_total", protocol="http") - before.total(
        "lmserve_requests_total", protocol="http") == 8
    assert after.total("lmserve_prompt_tokens_total") - before.total("lmserve_prompt_tokens_total") == \
        summary["prompt_tokens"]
    assert summary["ttft"]["count"] == 8


def test_bench_names_http_errors_like_grpc_ones(server, tmp_path):
    out = tmp_path / "report.json"
    proc = bench("--api", "openai", "--url", server.http_url, "--model", "no-such-model", "--requests", 2,
                 "--max-new-tokens", 4, "--out", out)
    assert proc.returncode == 1  # nothing completed
    assert json.loads(out.read_text())["summary"]["errors"] == {"NOT_FOUND": 2}


def test_openai_api_needs_a_url():
    proc = bench("--api", "openai", "--requests", 1)
    assert proc.returncode == 2 and "--url" in proc.stderr
