"""Every CPU, not only this one: the instruction-set-dependent tests held to AVX2 on a wider machine, and
a CPU the native kernels do not know served on the torch paths.

A process plays a narrower CPU with three settings: the native build compiled for it
($LMSERVE_NATIVE_MARCH, native/build.py), and torch's own kernels held to it (ATEN_CPU_CAPABILITY for
ATen's vectorized kernels, ONEDNN_MAX_CPU_ISA for oneDNN's GEMMs, which then refuse bfloat16 weights as
on a real AVX2 CPU). Every choice the Python side makes by capability asks the built library or torch,
so nothing else needs telling.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

UNIT = Path(__file__).parent
REPO = UNIT.parents[1]
AVX2_ONLY = {"LMSERVE_NATIVE_MARCH": "x86-64-v3", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
# the modules whose outcome depends on the instruction set: kernels, the native step, invariance, families
ISA_MODULES = ("test_prompt_attention.py", "test_decode_attention.py", "test_fused_ops.py", "test_native_step.py",
               "test_kv_int8.py", "test_engine_prefix.py", "test_model_families.py")


def _cpu_flags() -> set[str]:
    try:
        line = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(line.split(":", 1)[1].split())


def _env(extra: dict[str, str]) -> dict[str, str]:
    paths = [str(REPO / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, **extra, "PYTHONPATH": os.pathsep.join(paths)}


def test_the_instruction_set_dependent_tests_pass_held_to_avx2(tmp_path):
    """On an AVX-512 or AMX machine, the kernel, native-step, invariance and family tests again in a
    process held to AVX2 (a real AVX2 CPU runs them in the suite itself)."""
    flags = _cpu_flags()
    if "avx2" not in flags:
        pytest.skip("this CPU has no AVX2: nothing narrower to hold it to")
    if "avx512f" not in flags:
        pytest.skip("this CPU is AVX2-only: the whole suite already runs at AVX2 here")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           "--basetemp", str(tmp_path / "run"), *[str(UNIT / m) for m in ISA_MODULES]],
                          cwd=REPO, env=_env(AVX2_ONLY), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_a_cpu_the_kernels_do_not_know_serves_every_mode_on_torch(trained_model_dir, training_prompts, tmp_path):
    """x86-64-v2 (no AVX2): the native build is skipped with its reason, and the memorizing model still
    reproduces its corpus greedily in float32, bfloat16 and bfloat16+int8, cold and after a prefix hit."""
    pairs = training_prompts[:3]
    done = subprocess.run([sys.executable, str(UNIT / "torch_path_run.py"), str(trained_model_dir),
                           str(tmp_path / "cache"), json.dumps(pairs)],
                          cwd=REPO, env=_env({"LMSERVE_NATIVE_MARCH": "x86-64-v2"}), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert not seen["library"] and "no AVX2" in seen["why"], seen["why"]
    assert set(seen["modes"]) == {"float32+none", "bfloat16+none", "bfloat16+int8"}
    for mode, got in seen["modes"].items():
        assert got["attention"] == "sdpa", mode
        assert not any(k.startswith("native") for k in got["kernels"]), (mode, got["kernels"])
        for t in got["texts"]:
            assert t["cold"] == t["again"] == t["want"], (mode, t)
            cold_end, again_end, eos = t["ends"]
            assert cold_end == again_end and cold_end[0] in eos, (mode, t)
