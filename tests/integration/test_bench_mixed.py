"""`lmserve bench mixed` against the shared trained-model server: idle baseline, streams, long
prompts under load; the report and the server's step metrics agree that long prompts were prefilled
in steps shared with decoding streams."""

import json
import subprocess
import sys


def test_mixed_workload_reports_itl_during_prefill_and_ttft(server, tmp_path):
    before = server.metrics()
    out = tmp_path / "mixed.json"
    proc = subprocess.run([sys.executable, "-m", "lmserve.client.cli", "bench", "mixed", "--target", server.target,
                           "--streams", "3", "--stream-tokens", "100", "--long-tokens", "100", "--long-prompts", "2",
                           "--idle-runs", "1", "--gap", "0.3", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ITL p99 during prefill / steady p50" in proc.stdout
    report = json.loads(out.read_text())
    assert len(report["idle_ttft"]) == 1 and len(report["load_ttft"]) == 2 and not report["errors"]
    assert all(a < b for a, b in report["windows"])
    s = report["summary"]
    assert s["steady_itl"]["count"] > 0 and s["prefill_itl"]["count"] > 0
    assert s["ttft_load_over_idle"] > 0 and s["itl_p99_during_prefill_over_steady_p50"] > 0
    after = server.metrics()
    mixed = after.total("lmserve_step_duration_seconds_count", kind="mixed") - before.total(
        "lmserve_step_duration_seconds_count", kind="mixed")
    assert mixed >= 2  # the long prompts were prefilled in steps that also decoded the streams
    assert after.total("lmserve_step_prefill_tokens_sum", kind="mixed") > before.total(
        "lmserve_step_prefill_tokens_sum", kind="mixed")
