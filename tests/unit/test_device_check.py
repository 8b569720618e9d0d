"""`make cuda-check` (deploy/cuda-check/) dry-run on the CPU, and the pieces it reads its results with.

The dry run is the script a GPU host runs, with --device cpu and a tiny shape: run.sh (lmserve already
installed here, so nothing is installed), random weights written from a tokenizer-only GGUF, the CUDA test
files collected and run (they skip: no GPU here), the engine benchmark in this process with its per-step
statistics and weight-stream bound, a report and a summary under $OUT."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmserve.server.bench.engine_bench import Deadline, StepLog, steps_between

ROOT = Path(__file__).resolve().parents[2]


def _check_module():
    spec = importlib.util.spec_from_file_location("cuda_check", ROOT / "deploy" / "cuda-check" / "check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check = _check_module()


def test_the_tokenizer_only_gguf_holds_every_tokenizer_field_and_no_tensor(smollm2_gguf_path, tmp_path):
    from lmserve.server.bench.model_shapes import _tokenizer_fields, write_tokenizer_gguf

    path = write_tokenizer_gguf(smollm2_gguf_path, tmp_path / "tok.gguf")
    assert path.stat().st_size < 3 << 20 < smollm2_gguf_path.stat().st_size  # small enough to carry
    assert _tokenizer_fields(path) == _tokenizer_fields(smollm2_gguf_path)


def test_dry_run_of_the_cuda_check_on_the_cpu(smollm2_gguf_path, tmp_path):
    from lmserve.server.bench.model_shapes import write_tokenizer_gguf

    files, out = tmp_path / "files", tmp_path / "out"
    (files / "wheels").mkdir(parents=True)  # nothing to install here: lmserve is installed
    write_tokenizer_gguf(smollm2_gguf_path, files / check.TOKENIZER)
    env = {**os.environ, "OUT": str(out), "CUDA_CHECK_PYTHON": sys.executable, "CUDA_CHECK_FILES": str(files)}
    t0 = time.monotonic()
    done = subprocess.run(["sh", str(ROOT / "deploy" / "cuda-check" / "run.sh"), "--device", "cpu", "--shape", "tiny",
                           "--concurrency", "1", "3", "--max-new-tokens", "6", "--work", str(tmp_path / "work"),
                           "--skip", "hf", "grpc", "http", "prefill", "--budget", "600"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary = json.loads((out / "cuda-check.json").read_text())
    assert summary["ok"] and summary["seconds_left"] < 600 - (time.monotonic() - t0) + 5
    tests = summary["phases"]["tests"]
    assert {"tests/unit/test_cuda_model.py", "tests/integration/test_cuda_metrics.py"} <= set(tests["files"])
    counts = tests["counts"]
    assert counts["tests"] > 0 and counts["skipped"] == counts["tests"] and tests["exit_status"] == 0  # no GPU here
    assert (tmp_path / "work" / "tiny-random-bf16" / "config.json").is_file()

    (report_path,) = [p for p in out.glob("*-tiny.json") if p.name != "cuda-check.json"]
    assert summary["phases"]["bench"]["report"] == str(report_path)
    report = json.loads(report_path.read_text())
    assert [r["concurrency"] for r in report["engine"]] == [1, 3]
    for row in report["engine"]:
        c, steps = row["concurrency"], row["steps"]
        assert row["output_tokens_per_s"] > 0 and row["itl_p50_ms"] > 0
        # all c prompts fit one prefill step (token budget 512), then at most 5 decode steps give the other
        # tokens (fewer where speculation's drafts are accepted: verifying rows count as rows)
        assert steps["all_decoding_from_step"] == 2 and steps["by_kind"]["prefill"]["steps"] == 1
        assert 1 <= steps["by_kind"]["decode"]["steps"] <= 5 and steps["by_kind"]["decode"]["rows_mean"] >= c
        assert steps["steps_per_token"] == pytest.approx(steps["steps"] / (6 * c)) and steps["steps"] <= 6
        assert 1 <= steps["kv_pages_held_max"] <= steps["kv_pages_capacity"]
    for bound in report["weight_stream"].values():
        assert bound["gb_per_s"] > 0 and bound["bound_tok_s_c1"] > 0 and bound["decode_c1_share_of_bound"] > 0
    targets = summary["phases"]["bench"]["targets"]
    assert targets["throughput_rises_with_concurrency"]["value"] is not None


def test_the_cuda_tests_are_the_cuda_files_and_the_marked_tests(tmp_path):
    for name, text in {"unit/test_cuda_model.py": "", "unit/test_paged_attention_cuda.py": "",
                       "unit/test_paged.py": "@pytest.mark.cuda\ndef test_x(): pass\n",
                       "unit/test_pool.py": "pytestmark = [pytest.mark.cuda]\n",
                       "unit/test_cpu.py": "# not pytest.mark.cuda, a mention\n",
                       "integration/test_cuda_metrics.py": ""}.items():
        (tmp_path / "tests" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "tests" / name).write_text(text)
    whole, marked = check.cuda_test_selection(tmp_path)
    assert [p.relative_to(tmp_path).as_posix() for p in whole] == [
        "tests/integration/test_cuda_metrics.py", "tests/unit/test_cuda_model.py", "tests/unit/test_paged_attention_cuda.py"]
    assert [p.relative_to(tmp_path).as_posix() for p in marked] == ["tests/unit/test_paged.py", "tests/unit/test_pool.py"]
    whole, _ = check.cuda_test_selection()
    assert ROOT / "tests" / "unit" / "test_cuda_model.py" in whole and Path(__file__) not in whole


def test_a_wave_predicted_past_the_time_limit_is_skipped():
    assert Deadline(None).skip(128, (64, 1e6)) is None
    d = Deadline(100.0)
    assert d.skip(1, None) is None
    assert d.skip(64, (32, 20.0)) is None  # 20 s x 2 x 1.5 = 60 s < 100 s
    assert "predicted 120 s" in d.skip(64, (32, 40.0))
    assert d.share(0.5).left() == pytest.approx(50.0, abs=1.0)
    assert "reached" in Deadline(-1.0).skip(1, None)
    part = Deadline(100.0).share(0.0)  # a section whose share is spent (a slow start, say)
    assert part.skip(1, None) is None  # still gives its first number while the run has time
    assert "reached" in part.skip(8, (1, 0.1))


def test_targets_read_from_a_report():
    report = {"engine": [{"concurrency": 1, "output_tokens_per_s": 400.0}, {"concurrency": 64, "output_tokens_per_s": 12_000.0},
                         {"concurrency": 128, "skipped": "time"}],
              "grpc": {"rows": [{"concurrency": 64, "output_tokens_per_s": 10_000.0}]},
              "weight_stream": {"memory": {"decode_c1_share_of_bound": 0.75}}}
    t = check.targets(report)
    assert t["c1_decode_share_of_memory_bound"] == {"value": 0.75, "met": True}
    assert t["c64_engine_tok_s"]["met"] and not t["c64_grpc_over_engine"]["met"]  # 0.83x < 0.9x
    assert t["throughput_rises_with_concurrency"] == {"value": True, "met": True}


def test_served_steps_by_kind_come_from_two_scrapes():
    before = {"decode": {"steps": 10, "seconds": 0.1}, "mixed": {"steps": 2, "seconds": 0.05, "prefill_tokens": 100}}
    after = {"decode": {"steps": 40, "seconds": 0.4}, "mixed": {"steps": 4, "seconds": 0.13, "prefill_tokens": 300},
             "prefill": {"steps": 0, "seconds": 0.0, "prefill_tokens": 0}}
    got = steps_between(before, after, tokens=64)
    assert got["steps"] == 32 and got["steps_per_token"] == 0.5 and set(got["by_kind"]) == {"decode", "mixed"}
    assert got["by_kind"]["decode"]["ms_mean"] == pytest.approx(10.0)
    assert got["by_kind"]["mixed"] == pytest.approx({"steps": 2, "ms_mean": 40.0, "prefill_tokens_mean": 100.0})


def test_the_step_log_summarises_a_wave_by_kind():
    from types import SimpleNamespace as NS

    kv = NS(pages_used=0, kv_pages=100)
    log = StepLog(NS(scheduler=NS(kv=kv)))

    def step(decode, prefill, ms, pages):
        kv.pages_used = pages
        log.on_step(ms / 1e3, NS(decode=[0] * decode, prefill=[NS(length=n) for n in prefill], drafts=()))

    step(0, [30, 20], 9.0, 4)
    step(2, [40], 12.0, 7)
    for _ in range(3):
        step(3, [], 2.0, 8)
    s = log.summary(3, tokens=12)
    assert s["steps"] == 5 and s["all_decoding_from_step"] == 3 and s["steps_per_token"] == 5 / 12
    assert s["by_kind"]["prefill"] == pytest.approx({"steps": 1, "rows_mean": 0, "prefill_tokens_mean": 50,
                                                     "ms_mean": 9.0, "ms_p50": 9.0, "ms_max": 9.0})
    assert s["by_kind"]["mixed"]["rows_mean"] == 2 and s["by_kind"]["decode"]["ms_p50"] == pytest.approx(2.0)
    assert s["kv_pages_held_max"] == 8 and s["kv_pages_capacity"] == 100
