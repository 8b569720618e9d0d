"""lmserve bench load end to end against a loopback servicer (closed and open loop)."""

import asyncio
import json
import sys

import grpc
import pytest
from _client_fakes import Failure, LoopbackServer, Script

from lmserve.client import cli
from lmserve.client.bench import load as bench


def test_closed_loop_counts_requests_tokens_and_writes_report(tmp_path, capsys):
    out = tmp_path / "report.json"
    with LoopbackServer() as srv:
        code = cli.main(["bench", "load", "-t", srv.target, "--requests", "7", "--concurrency", "3", "--warmup", "2",
                         "--no-progress", "--out", str(out), "--max-new-tokens", "3"])
        served = srv.servicer.attempts["GenerateStream"]
        max_new = {r.params.max_new_tokens for m, r in srv.servicer.requests if m == "GenerateStream"}
    assert code == 0
    assert served == 9  # warmup requests are sent but not measured
    assert max_new == {3}
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert summary["completed"] == 7 and summary["failed"] == 0
    assert summary["output_tokens"] == 7 * 3  # the fake streams 3 one-token chunks
    assert summary["ttft"]["count"] == 7 and summary["itl"]["count"] == 7 * 2
    assert len(report["requests"]) == 7
    assert report["settings"]["concurrency"] == 3 and "token" not in report["settings"]
    assert report["effective"]["requests"] == 7 and report["effective"]["warmup"] == 2
    assert report["model"]["model_name"] == "fake" and report["benchmark"] == "load"
    assert "TTFT" in capsys.readouterr().out


def test_open_loop_with_prompt_file_and_error_counting(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a", "max_new_tokens": 5}\n\n{"messages": [{"role": "user", "content": "b"}]}\n')
    script = Script(fail_first=[Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")] * 2)
    with LoopbackServer(script) as srv:
        config = bench.BenchConfig(concurrency=None, rate=200.0, requests=6, duration=None, warmup=0,
                                   max_new_tokens=16, temperature=0.0, seed=1, ignore_eos=False, timeout=30)
        run = asyncio.run(bench.run_bench(srv.target, config, bench.load_prompts(prompts),
                                          client_options={"max_retries": 0}, progress=False))
        sent = [r for m, r in srv.servicer.requests if m == "GenerateStream"]
    assert len(run.records) == 6
    assert sorted(r.error for r in run.records if not r.ok) == ["RESOURCE_EXHAUSTED"] * 2
    inputs = {r.WhichOneof("input") for r in sent}
    assert inputs == {"prompt", "messages"}
    assert {r.params.max_new_tokens for r in sent if r.WhichOneof("input") == "prompt"} == {5}
    assert {r.params.max_new_tokens for r in sent if r.WhichOneof("input") == "messages"} == {16}
    assert sorted(r.params.seed for r in sent) == list(range(1, 7))  # request i gets seed SEED+i


def test_duration_bound_stops_issuing(capsys):
    with LoopbackServer() as srv:
        assert cli.main(["bench", "load", "-t", srv.target, "--duration", "0.3", "--concurrency", "2", "--no-progress"]) == 0
    assert "completed" in capsys.readouterr().out


def test_synthetic_workload_has_varied_lengths():
    lengths = sorted(len(item.prompt[-1].content) for item in bench.synthetic_workload())
    assert lengths[-1] > 5 * lengths[0]
    assert all(item.prompt[0].role == "system" for item in bench.synthetic_workload())


def test_bad_prompt_file_is_a_usage_error(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    assert cli.main(["bench", "load", "--prompts", str(bad), "-t", "127.0.0.1:1", "--no-progress"]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--concurrency", "0"], ["--rate", "-1"], ["--requests", "0"]])
def test_invalid_load_settings_exit_2(flags):
    assert cli.main(["bench", "load", *flags, "-t", "127.0.0.1:1", "--no-progress"]) == 2


def test_plot_without_matplotlib_prints_a_note(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    png = tmp_path / "plot.png"
    with LoopbackServer() as srv:
        assert cli.main(["bench", "load", "-t", srv.target, "--requests", "2", "--no-progress", "--plot", str(png)]) == 0
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert not png.exists()


def test_plot_with_matplotlib_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plot.png"
    with LoopbackServer() as srv:
        assert cli.main(["bench", "load", "-t", srv.target, "--requests", "4", "--no-progress", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_repeat_workload_sends_the_prompts_whose_answers_repeat_them(tmp_path):
    """--workload repeat: the built-in code-editing, quoting and document-QA prompts, each carrying the
    text its answer is to repeat."""
    from lmserve.client.bench.prompts import CODE, DOCUMENT, PASSAGE

    with LoopbackServer() as srv:
        code = cli.main(["bench", "load", "-t", srv.target, "--requests", "3", "--workload", "repeat", "--no-progress",
                         "--max-new-tokens", "2"])
        sent = [r.messages.messages[-1].content for m, r in srv.servicer.requests if m == "GenerateStream"]
    assert code == 0 and len(sent) == 3
    assert sorted(text for text in (CODE, PASSAGE, DOCUMENT) if any(text in s for s in sent)) == sorted([CODE, PASSAGE, DOCUMENT])
