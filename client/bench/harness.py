"""The one harness behind ``lmserve bench NAME``: the flags benchmarks share, the report's stamp (date,
git revision, machine, torch version, settings) and where the report goes.

Imports no torch: a client-only install runs the client benchmarks. A report of a benchmark that
runs on this machine goes to reports/<benchmark>/<machine>.json by default, so reports/ holds the
latest run per benchmark and machine and git holds the history.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..cli_args import CliUsageError
from .registry import BENCHMARKS, Benchmark

ROOT = Path(__file__).resolve().parents[2]  # the source checkout (site-packages once installed: no git there)

# The flags benchmarks share: each means the same wherever it is taken. A benchmark names the ones it
# takes, with its defaults, in its module's FLAGS.
SHARED: dict[str, dict[str, Any]] = {
    "model": dict(help="catalog name, .gguf file or Hugging Face directory"),
    "models_dir": dict(help="where catalog models are found or pulled (default: as the server finds them)"),
    "dtype": dict(help="auto, float32, bfloat16 or float16 (auto: measured, as the server chooses)"),
    "quantization": dict(help="auto, none, int8, int4 or kquant (auto: measured, as the server chooses)"),
    "device": dict(help="cpu, cuda or cuda:N (default: cuda when available)"),
    "threads": dict(type=int, help="torch threads, in this process and in any server it starts (default: torch's)"),
    "concurrency": dict(type=int, nargs="+", help="requests in flight: one measurement each"),
    "max_new_tokens": dict(type=int, help="tokens each request generates"),
    "rounds": dict(type=int, help="rounds in which the compared candidates take turns (medians reported)"),
    "requests": dict(type=int, help="measured requests per round"),
    "skip": dict(nargs="*", help="parts to leave out"),
}
# the flags that say which model a benchmark serves, with the server's defaults
MODEL = {"model": "smollm2", "models_dir": None, "dtype": "auto", "quantization": "auto", "device": None}


def build_parser(bench: Benchmark, module) -> argparse.ArgumentParser:
    """`lmserve bench NAME`'s parser: the shared flags the benchmark takes, its own, --out and --note."""
    p = argparse.ArgumentParser(prog=f"lmserve bench {bench.name}", description=module.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in module.FLAGS.items():
        kwargs = dict(SHARED[name])
        if name == "skip":  # its default names the parts that may be skipped
            kwargs.update(choices=default, default=[], help=f"parts to leave out: {', '.join(default)}")
        else:
            kwargs["default"] = default
            if default is not None:
                kwargs["help"] += f" (default: {' '.join(map(str, default)) if isinstance(default, list) else default})"
        p.add_argument("--" + name.replace("_", "-"), **kwargs)
    if hasattr(module, "add_arguments"):
        module.add_arguments(p)
    where = "none: printed only" if bench.client else f"reports/{bench.name}/<machine>.json"
    p.add_argument("--out", type=Path, default=None, help=f"the JSON report's path (default: {where})")
    p.add_argument("--note", default="", help="a line the report keeps (e.g. what else ran on the machine)")
    return p


def lscpu() -> dict[str, str]:
    """CPU model name, family, count, flags and L3 size as lscpu reports them ({} where lscpu is missing).
    Kernels that win on one CPU lose on another, so a number without these means little."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    keys = ("Model name", "CPU family", "CPU(s)", "Flags", "L3 cache")
    return {k: fields[k].strip() for k in keys if k in fields}


def _mib(size: str) -> int | None:
    """lscpu's cache size ("105 MiB (1 instance)", "32768K") in MiB."""
    m = re.match(r"\s*([\d.]+)\s*([KMG])", size or "")
    return round(float(m.group(1)) * {"K": 1 / 1024, "M": 1, "G": 1024}[m.group(2)]) if m else None


def machine_slug(model: str, flags: str, l3: str = "", family: str = "") -> str:
    """A short name for a CPU from what lscpu says: its family, what its kernels use, and its last-level
    cache (xeon-amx-105m, epyc-zen5-32m, ...). Two VMs with the same ISA but another cache size (the
    105 MiB and the 480 MiB Xeons) are different machines to a kernel. Report paths key on it."""
    words = re.findall(r"[a-z0-9]+", re.sub(r"\((r|tm)\)", "", model.lower()))
    f = set(flags.split())
    if "epyc" in words or "ryzen" in words:
        zen = ("zen5" if "avx512_vp2intersect" in f or family == "26" else "zen4" if "avx512f" in f
               else "zen3" if "vaes" in f else "zen")
        name = f"{'epyc' if 'epyc' in words else 'ryzen'}-{zen}"
    elif "xeon" in words or "intel" in words:
        isa = "amx" if "amx_tile" in f else "avx512" if "avx512f" in f else "avx2" if "avx2" in f else ""
        name = "-".join(filter(None, ("xeon" if "xeon" in words else "intel", isa)))
    else:
        name = "-".join(w for w in words if w not in ("cpu", "processor", "with", "graphics"))[:32].strip("-")
    mib = _mib(l3)
    return "-".join(filter(None, (name or platform.machine() or "unknown", f"{mib}m" if mib else "")))


def machine(device: str | None = None) -> dict[str, Any]:
    """The machine a report was measured on: the CPU as lscpu names it, with its slug; and the GPU
    where the benchmark ran on one (a benchmark that never imported torch ran on none)."""
    cpu = lscpu()
    out = {"slug": machine_slug(cpu.get("Model name", ""), cpu.get("Flags", ""), cpu.get("L3 cache", ""),
                                cpu.get("CPU family", "")),
           "cpu": cpu.get("Model name"), "cpus": os.cpu_count(), "l3": cpu.get("L3 cache"), "flags": cpu.get("Flags", "")}
    torch = sys.modules.get("torch")
    if torch is not None and str(device or "cuda").startswith("cuda") and torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
        out["slug"] = "cuda-" + "-".join(w for w in re.findall(r"[a-z0-9]+", out["gpu"].lower()) if w != "nvidia")
    return out


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def revision() -> dict[str, Any]:
    """lmserve's version, the git commit the code ran from and whether tracked files differed from it
    (commit and dirty are None outside a checkout, as in an installed wheel)."""
    from lmserve import __version__

    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"version": __version__, "commit": commit, "dirty": bool(status) if status is not None else None}


def torch_version() -> str | None:
    """The installed torch's version, read from its metadata: nothing is imported."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed flags as the report keeps them (a bearer token never)."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in ("token",)}


def report(name: str, settings: dict[str, Any], results: dict[str, Any], device: str | None = None) -> dict[str, Any]:
    """A benchmark's results under the stamp every report carries."""
    return {"benchmark": name, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "revision": revision(), "machine": machine(device), "torch": torch_version(),
            "settings": settings, **results}


def write_report(path: str | Path, stamped: dict[str, Any]) -> None:
    """The JSON report at `path` (its folder made if missing), one trailing newline."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stamped, indent=1, default=str) + "\n")


def run(name: str, argv: list[str]) -> int:
    """Parses the benchmark's flags, runs it, stamps its results and writes them; the exit status."""
    bench = BENCHMARKS[name]
    if not bench.client and importlib.util.find_spec("torch") is None:  # the server benchmarks' first need
        clients = ", ".join(b.name for b in BENCHMARKS.values() if b.client)
        raise CliUsageError(f"`lmserve bench {name}` runs lmserve's server code on this machine and needs torch: "
                            f"install the server extra (pip install 'lmserve[server]'); the client benchmarks "
                            f"({clients}) run without it")
    module = importlib.import_module(bench.module)
    args = build_parser(bench, module).parse_args(argv)
    load_at_start = os.getloadavg()
    results = module.run(args)
    if results is None:  # nothing measured (a helper mode such as printing an old report)
        return 0
    stamped = report(name, settings_of(args), results, getattr(args, "device", None))
    # a load average near the CPU count means other work shared the machine
    stamped["load_average"] = {"start": load_at_start, "end": os.getloadavg()}
    out = args.out if args.out or bench.client else Path("reports", name, stamped["machine"]["slug"] + ".json")
    if out:
        write_report(out, stamped)
        print(f"report written to {out}")
    return 0 if getattr(module, "succeeded", lambda _: True)(results) else 1
