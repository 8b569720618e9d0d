"""What every benchmark report records about the machine it ran on: the CPU as lscpu names it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path


def lscpu() -> dict:
    """CPU model name, count, flags and L3 size as lscpu reports them ({} where lscpu is missing).
    Kernels that win on one CPU lose on another, so a number without these means little."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {k: fields[k].strip() for k in ("Model name", "CPU(s)", "Flags", "L3 cache") if k in fields}


def last_level_cache_bytes(default: int = 32 << 20) -> int:
    """The largest CPU cache's size in bytes as sysfs gives it for CPU 0 (`default` where it gives none).
    A benchmark that means to read from memory must first read past this: it ranged from 32 MiB (the
    EPYCs) to 480 MiB (a Xeon VM) on the machines seen so far."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        try:
            n = int(text.rstrip("KMG"))
        except ValueError:
            continue
        sizes.append(n << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0))
    return max(sizes, default=default)


def taking_turns(items, round_index: int) -> list:
    """`items` in the order a benchmark round runs them: as given in even rounds, reversed in odd ones. On
    the 2-core VMs a pass run right after another ran ~10% faster, so no candidate may always go second."""
    items = list(items)
    return items if round_index % 2 == 0 else items[::-1]


def model_arguments(ap) -> None:
    """The flags every in-process benchmark takes to load its model: --model, --models-dir, --dtype,
    --quantization (as `lmserve serve` names them)."""
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--models-dir", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")


def load_from_arguments(args):
    """The model model_arguments' flags name, loaded (precision chosen as the server chooses it)."""
    from lmserve.model.loader import load_model

    return load_model(args.model, dtype=args.dtype, quantization=args.quantization, models_dir=args.models_dir)


def write_report(path, report: dict) -> None:
    """A benchmark's JSON report at `path` (its folder made if missing), one trailing newline."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


__all__ = ["last_level_cache_bytes", "lscpu", "load_from_arguments", "model_arguments", "taking_turns", "write_report"]
