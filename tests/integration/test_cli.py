"""The ``lmserve`` command, run as a subprocess against the shared trained server.

Oracles: the training corpus, an independent sentencepiece tokenizer, config.json, the raw gRPC
stub (chat), and the server's /metrics for what ``lmserve bench load`` sent.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lmserve.v1 import lmserve_pb2 as pb
from lmserve.v1 import lmserve_pb2_grpc as pb_grpc

REPORT_KEYS = {"benchmark", "date", "revision", "machine", "torch", "settings", "load_average", "effective",
               "model", "summary", "requests"}
SUMMARY_KEYS = {"duration", "completed", "failed", "errors", "prompt_tokens", "output_tokens", "request_throughput",
                "output_token_throughput", "ttft", "tpot", "itl", "e2e"}
PERCENTILE_KEYS = {"count", "mean", "min", "max", "p50", "p90", "p99"}


def lmserve_command() -> list[str]:
    """The installed console script beside this interpreter, else the module it runs."""
    script = Path(sys.executable).with_name("lmserve")
    return [str(script)] if script.exists() else [sys.executable, "-m", "lmserve.client.cli"]


def lmserve(*args: str, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMSERVE_")}
    return subprocess.run([*lmserve_command(), *map(str, args)], input=stdin, capture_output=True, text=True,
                          env=env, timeout=timeout)


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr.strip().splitlines()


def test_generate_prints_the_memorized_continuation(server, training_prompts):
    prefix, continuation = training_prompts[4]
    proc = lmserve("generate", prefix, "--max-new-tokens", 100, "-t", server.target, "--stats")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == continuation + "\n"
    (stats,) = error_lines(proc)
    assert stats.startswith("[eos] prompt ")


def test_generate_json_is_the_full_result(server, training_prompts, sp):
    prefix, continuation = training_prompts[7]
    proc = lmserve("generate", prefix, "--max-new-tokens", 100, "--json", "--request-id", "cli-1", "-t", server.target)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["text"] == continuation and result["finish_reason"] == "eos" and result["request_id"] == "cli-1"
    usage = result["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (1 + len(sp.encode(prefix)), len(result["token_ids"]))
    assert 0 <= usage["cached_prompt_tokens"] < usage["prompt_tokens"]  # a prefix other tests sent may be cached
    assert sp.decode(result["token_ids"]).strip() == continuation.strip()
    timing = result["timing"]
    assert 0 <= timing["queue_seconds"] <= timing["time_to_first_token_seconds"] <= timing["total_seconds"]


def test_generate_with_a_prediction_or_opted_out_prints_the_same_text(server, training_prompts, tmp_path):
    prefix, continuation = training_prompts[4]
    predicted = tmp_path / "prediction.txt"
    predicted.write_text(continuation, encoding="utf-8")
    for flags in (["--prediction", predicted], ["--no-speculation"]):
        proc = lmserve("generate", prefix, "--max-new-tokens", 100, "-t", server.target, "--json", *flags)
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout)
        assert result["text"] == continuation
        assert result["usage"]["accepted_draft_tokens"] <= result["usage"]["draft_tokens"]
    proc = lmserve("generate", prefix, "-t", server.target, "--prediction", tmp_path / "missing.txt")
    assert proc.returncode == 2 and "--prediction: cannot read" in proc.stderr


def test_generate_chat_sends_the_prompt_as_messages(server):
    with server.channel() as channel:  # what the same conversation gives through the raw stub
        expected = pb_grpc.TextGenerationStub(channel).Generate(pb.GenerateRequest(
            messages=pb.ChatMessages(messages=[pb.ChatMessage(role="system", content="Be brief."),
                                               pb.ChatMessage(role="user", content="Who keeps the lighthouse?")]),
            params=pb.SamplingParams(max_new_tokens=12, ignore_eos=True)), timeout=60)
        plain = pb_grpc.TextGenerationStub(channel).Generate(pb.GenerateRequest(
            messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Who keeps the lighthouse?")]),
            params=pb.SamplingParams(max_new_tokens=12, ignore_eos=True)), timeout=60)
    proc = lmserve("generate", "Who keeps the lighthouse?", "--system", "Be brief.", "--max-new-tokens", 12,
                   "--ignore-eos", "--json", "-t", server.target)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["token_ids"] == list(expected.token_ids) and result["usage"]["prompt_tokens"] == \
        expected.usage.prompt_tokens
    proc = lmserve("generate", "Who keeps the lighthouse?", "--chat", "--max-new-tokens", 12, "--ignore-eos",
                   "-t", server.target)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == plain.text + "\n"


def test_generate_reads_the_prompt_from_stdin(server, training_prompts):
    prefix, continuation = training_prompts[1]
    proc = lmserve("generate", "--max-new-tokens", 100, "-t", server.target, stdin=prefix)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == continuation + "\n"


def test_tokenize_matches_sentencepiece(server, sp):
    text = "The baker woke long before sunrise."
    proc = lmserve("tokenize", text, "--json", "-t", server.target)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["token_ids"] == [sp.bos_id(), *sp.encode(text)]
    proc = lmserve("tokenize", text, "-t", server.target)
    assert proc.stdout.split() == [str(t) for t in out["token_ids"]]


def test_info_describes_the_checkpoint(server, trained_model_dir, trained_server_flags):
    cfg = json.loads((trained_model_dir / "config.json").read_text())
    proc = lmserve("info", "--json", "-t", server.target)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["vocab_size"] == cfg["vocab_size"] and info["context_length"] == cfg["max_position_embeddings"]
    assert info["max_batch_size"] == trained_server_flags["max_batch"] and info["architecture"] == "llama"
    proc = lmserve("info", "-t", server.target)
    assert proc.returncode == 0
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines())
    assert lines["vocab_size"] == str(cfg["vocab_size"]) and lines.keys() == info.keys()
    assert info["speculation"].startswith(("ngram (", "off (")) and lines["speculation"] == info["speculation"]


def test_health_exit_codes(server):
    proc = lmserve("health", "-t", server.target)
    assert (proc.returncode, proc.stdout.strip()) == (0, "SERVING")
    proc = lmserve("health", "--service", "lmserve.v1.TextGeneration", "-t", server.target)
    assert (proc.returncode, proc.stdout.strip()) == (0, "SERVING")
    with socket.socket() as unlistened:  # bound but not listening: nothing can answer on it while held
        unlistened.bind(("127.0.0.1", 0))
        down = lmserve("health", "-t", f"127.0.0.1:{unlistened.getsockname()[1]}", "--timeout", "5")
    assert down.returncode == 1 and down.stdout == ""
    (line,) = error_lines(down)
    assert line.startswith("lmserve: UNAVAILABLE") or line.startswith("lmserve: DEADLINE_EXCEEDED"), line


def test_bench_writes_a_report_that_agrees_with_the_server(server, training_prompts, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p, _ in training_prompts))
    report_path, plot_path = tmp_path / "report.json", tmp_path / "bench.png"
    before = server.wait_idle()
    proc = lmserve("bench", "load", "--requests", 8, "--concurrency", 4, "--max-new-tokens", 16, "--ignore-eos",
                   "--prompts", prompts, "--seed", 1, "--out", report_path, "--plot", plot_path,
                   "--no-progress", "-t", server.target, timeout=300)
    assert proc.returncode == 0, proc.stderr
    after = server.wait_idle()
    assert "requests: 8 completed, 0 failed" in proc.stdout

    report = json.loads(report_path.read_text())
    assert set(report) == REPORT_KEYS
    summary = report["summary"]
    assert set(summary) == SUMMARY_KEYS
    assert (summary["completed"], summary["failed"], summary["errors"]) == (8, 0, {})
    assert summary["output_tokens"] == 8 * 16
    for name in ("ttft", "tpot", "e2e", "itl"):
        assert set(summary[name]) == PERCENTILE_KEYS
        s = summary[name]
        assert s["min"] <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"]
    first_message_tokens = sum(r["events"][0][1] for r in report["requests"])
    assert summary["ttft"]["count"] == summary["e2e"]["count"] == 8
    assert summary["itl"]["count"] == 8 * 16 - first_message_tokens  # one gap per token after the first
    assert len(report["requests"]) == 8
    assert all(r["error"] is None and sum(n for _, n in r["events"]) == 16 for r in report["requests"])
    assert report["settings"]["concurrency"] == 4 and report["effective"]["requests"] == 8
    assert "token" not in report["settings"]
    assert report["model"]["vocab_size"] > 0 and report["revision"]["version"]
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    def delta(sample):
        return after.total(sample) - before.total(sample)

    assert delta("lmserve_requests_total") == 8
    assert delta("lmserve_generated_tokens_total") == summary["output_tokens"]
    assert delta("lmserve_prompt_tokens_total") == summary["prompt_tokens"]


@pytest.mark.parametrize("args, start", [
    (["bench", "load", "--concurrency", "0"], "lmserve: error: --concurrency must be >= 1"),
    (["bench", "load", "--requests", "0"], "lmserve: error: --requests must be >= 1"),
    (["generate", "hi", "--client-cert", "c.pem"], "lmserve: error: client_cert and client_key"),
], ids=["concurrency", "requests", "half-mtls"])
def test_bad_value_exits_2_with_one_line(server, args, start):
    proc = lmserve(*args, "-t", server.target)
    assert proc.returncode == 2
    (line,) = error_lines(proc)
    assert line.startswith(start), line


def test_unparsable_flag_exits_2_with_one_error_line():
    proc = lmserve("generate", "hi", "--temperature", "warm")
    assert proc.returncode == 2 and proc.stdout == ""
    lines = error_lines(proc)
    errors = [line for line in lines if ": error: " in line]
    assert errors == [lines[-1]] and "--temperature" in errors[0] and "'warm'" in errors[0]


def test_server_rejection_exits_2_naming_the_field(server):
    proc = lmserve("generate", "hi", "--temperature", "-1", "--max-new-tokens", 4, "-t", server.target)
    assert proc.returncode == 2 and proc.stdout == ""
    first, *rest = error_lines(proc)
    assert first.startswith("lmserve: INVALID_ARGUMENT:")
    assert [line.split(":")[0].strip() for line in rest] == ["params.temperature"]


@pytest.mark.parametrize("config, named", [
    ({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"}, "architecture ['Gemma2ForCausalLM'] is not supported"),
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     "rope_scaling type 'yarn' is not supported"),
], ids=["architecture", "rope-scaling"])
def test_serve_refuses_a_model_it_cannot_run_in_one_line(tmp_path, config, named):
    """The load fails naming what is not implemented; the server closes its listeners and exits 1 with that
    one line (no traceback from the event loop on the way out)."""
    shape = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 100,
             "intermediate_size": 128}
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({**shape, **config}))
    proc = lmserve("serve", "--model", tmp_path / "model", "--port", 0, "--http-port", 0, "--metrics-port", 0,
                   "--cache-dir", tmp_path / "cache")
    assert proc.returncode == 1
    lines = error_lines(proc)
    assert lines[-1].startswith(f"lmserve serve: {named}"), proc.stderr
    assert not any("Error" in line for line in lines), proc.stderr
