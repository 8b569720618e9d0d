"""The host-ceiling benchmark end to end (`lmserve bench host-ceiling`, server/bench/host_ceiling.py): the real engine and both edges
around its zero-cost stand-in model, engine phase, gRPC and HTTP phases, a tiny run. It checks that the tool
runs and that its report is consistent with what was asked (every request completed, each with its
tokens), not how fast anything was. Nothing here depends on how a stream's chunks were merged: a fast
stream may arrive as one message, which leaves no gap to measure, so an ITL may be absent (None)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_host_ceiling_reports_every_phase(smollm2_gguf_path, tmp_path):
    out = tmp_path / "host_ceiling.json"
    proc = subprocess.run([sys.executable, "-m", "lmserve.client.cli", "bench", "host-ceiling", "--model", str(smollm2_gguf_path),
                           "--concurrency", "1", "4", "--max-new-tokens", "8", "--waves", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [r["concurrency"] for r in report["engine"]] == [1, 4]
    assert [r["tokens"] for r in report["engine"]] == [8, 32]
    for row in report["engine"]:
        assert row["tok_per_s"] > 0 and row["steps"] >= 8 and set(row["host_ms_per_step"]) >= {"schedule", "sample"}
    for row in report["engine"] + report["grpc"] + report["http"]:
        assert row["itl_p50_ms"] is None or row["itl_p50_ms"] >= 0
    assert [(r["concurrency"], r["completed"], r["failed"], r["tokens"]) for r in report["grpc"]] \
        == [(1, 1, 0, 8), (4, 4, 0, 32)]
    assert all(r["tok_per_s"] > 0 for r in report["grpc"])
    assert [(r["concurrency"], r["completed"], r["failed"], r["tokens"]) for r in report["http"]] \
        == [(1, 1, 0, 8), (4, 4, 0, 32)]
    assert all(r["tok_per_s"] > 0 and r["ttft_p50_ms"] is not None for r in report["http"])
    assert [r["concurrency"] for r in report["http_vs_grpc"]] == [1, 4]
    assert all(r["http_over_grpc_tok_per_s"] > 0 for r in report["http_vs_grpc"])
    assert report["benchmark"] == "host-ceiling" and report["machine"]["slug"]


def test_beside_a_base_checkout_both_take_turns_and_the_ratios_are_theirs(smollm2_gguf_path, tmp_path):
    """--base: one pass from each checkout per round (here this checkout against itself), the report holding
    every pass and, per part and concurrency, the medians and this / base of each round's pair."""
    from lmserve.client.bench.harness import ROOT

    out = tmp_path / "beside.json"
    proc = subprocess.run([sys.executable, "-m", "lmserve.client.cli", "bench", "host-ceiling", "--model", str(smollm2_gguf_path),
                           "--base", str(ROOT), "--concurrency", "2", "--max-new-tokens", "8", "--rounds", "2",
                           "--skip", "grpc", "http", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["base"]["checkout"] == str(ROOT) and len(report["base"]["commit"]) == 40
    assert [len(report["passes"][side]) for side in ("base", "this")] == [2, 2]
    assert all(list(p) == ["engine", "load_average"] and p["engine"][0]["tokens"] == 16
               for side in ("base", "this") for p in report["passes"][side])
    (row,) = report["this_vs_base"]["engine"]
    pairs = [t["engine"][0]["tok_per_s"] / b["engine"][0]["tok_per_s"]
             for t, b in zip(report["passes"]["this"], report["passes"]["base"])]
    assert row["concurrency"] == 2 and row["this_over_base_rounds"] == pairs
    assert row["this_over_base"] == sum(pairs) / 2  # the median of two
    assert "grpc" not in report["this_vs_base"]
