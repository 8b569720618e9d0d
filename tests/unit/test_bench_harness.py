"""`lmserve bench`: every registered benchmark answers --help with the shared flags it declares, the
report's stamp says where and from what it was measured, and client benchmarks run without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

from lmserve.client import cli
from lmserve.client.bench import harness
from lmserve.client.bench.registry import BENCHMARKS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_each_benchmark_answers_help_with_its_flags(name, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["bench", name, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: lmserve bench {name} ")
    module = __import__(BENCHMARKS[name].module, fromlist=["FLAGS"])
    for flag in [*module.FLAGS, "out", "note"]:
        assert "--" + flag.replace("_", "-") in out, flag


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_every_flag_a_benchmark_reads_is_one_its_parser_defines(name):
    """`args.X` read anywhere in the module (not called: a list named args has methods) is a flag of
    `lmserve bench NAME`; a module that loads the model the shared flags name takes all of them."""
    import ast
    import importlib
    import inspect

    bench = BENCHMARKS[name]
    module = importlib.import_module(bench.module)
    dests = {a.dest for a in harness.build_parser(bench, module)._actions}
    tree = ast.parse(inspect.getsource(module))
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    read = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == "args" and id(n) not in called}
    assert read <= dests, sorted(read - dests)
    if "load_from_arguments(" in inspect.getsource(module):
        assert set(harness.MODEL) <= dests


def test_bench_help_lists_every_benchmark_with_its_line(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    lines = capsys.readouterr().out.splitlines()
    for b in BENCHMARKS.values():
        assert any(line.split() == [b.name, *b.summary.split()] for line in lines), b.name


def test_bench_without_a_name_names_them_all(capsys):
    assert cli.main(["bench"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lmserve: error: name a benchmark: lmserve bench {load,mixed,")
    assert all(name in err for name in BENCHMARKS)


def test_report_stamps_date_revision_machine_torch_and_settings(tmp_path):
    before = datetime.now(timezone.utc).replace(microsecond=0)
    stamped = harness.report("engine", {"concurrency": [1, 8], "note": "quiet"}, {"rows": [1.5]})
    after = datetime.now(timezone.utc)
    path = tmp_path / "r" / "engine.json"
    harness.write_report(path, stamped)
    got = json.loads(path.read_text())

    assert got["benchmark"] == "engine" and got["rows"] == [1.5]
    assert got["settings"] == {"concurrency": [1, 8], "note": "quiet"}
    assert before <= datetime.fromisoformat(got["date"]) <= after
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert got["revision"]["commit"] == head
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=True).stdout.strip() != ""
    assert got["revision"]["dirty"] is dirty
    import lmserve
    import torch

    assert got["revision"]["version"] == lmserve.__version__
    assert got["torch"] == torch.__version__
    cpu = harness.lscpu()
    assert got["machine"]["cpu"] == cpu["Model name"] and got["machine"]["flags"] == cpu["Flags"]
    assert got["machine"]["slug"] == harness.machine_slug(cpu["Model name"], cpu["Flags"], cpu.get("L3 cache", ""),
                                                           cpu.get("CPU family", ""))


@pytest.mark.parametrize("model, flags, l3, family, slug", [
    ("Intel(R) Xeon(R) Processor", "fpu avx2 avx512f amx_bf16 amx_tile", "105 MiB (1 instance)", "6", "xeon-amx-105m"),
    ("Intel(R) Xeon(R) Processor", "fpu avx2 avx512f amx_bf16 amx_tile", "480 MiB (1 instance)", "6", "xeon-amx-480m"),
    ("Intel(R) Xeon(R) Platinum 8280 CPU @ 2.70GHz", "avx2 avx512f avx512_vnni", "38.5 MiB", "", "xeon-avx512-38m"),
    ("AMD EPYC", "avx2 avx512f avx512_bf16 avx512_vnni", "32 MiB (1 instance)", "25", "epyc-zen4-32m"),
    ("AMD EPYC", "avx512f avx512_vp2intersect avx_vnni", "32 MiB (1 instance)", "", "epyc-zen5-32m"),
    ("AMD EPYC 7763 64-Core Processor", "avx2 vaes", "32768K", "25", "epyc-zen3-32m"),
    ("Neoverse-V2", "fp asimd sve2", "", "", "neoverse-v2"),
])
def test_machine_slug_names_the_family_what_its_kernels_use_and_its_cache(model, flags, l3, family, slug):
    assert harness.machine_slug(model, flags, l3, family) == slug


def test_a_client_benchmark_runs_without_torch_and_a_server_one_says_what_to_install(tmp_path):
    out = tmp_path / "load.json"
    code = f"""
import sys
sys.modules["torch"] = None  # import torch fails, as in the client-only wheel
from _client_fakes import LoopbackServer
from lmserve.client import cli
with LoopbackServer() as srv:
    assert cli.main(["bench", "load", "-t", srv.target, "--requests", "2", "--no-progress", "--out", {str(out)!r}]) == 0
assert cli.main(["bench", "engine"]) == 2
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=ROOT / "tests" / "unit")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["summary"]["completed"] == 2
    assert "`lmserve bench engine` runs lmserve's server code on this machine and needs torch: install the " \
           "server extra (pip install 'lmserve[server]')" in proc.stderr
