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


def write_report(path, report: dict) -> None:
    """A benchmark's JSON report at `path` (its folder made if missing), one trailing newline."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


__all__ = ["lscpu", "write_report"]
