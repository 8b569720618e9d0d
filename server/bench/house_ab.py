"""This checkout's speed beside another checkout's (the base), the two taking turns in one run.

    git worktree add /tmp/ab-base 6e631cb && make -C /tmp/ab-base venv
    lmserve bench house-ab --base /tmp/ab-base --models-dir .cache/models

6e631cb is the commit before the house refactors (rooms, one harness, the KV manager). Each side runs
its own code from its own checkout and venv, with a cache folder of its own (XDG_CACHE_HOME), started
once unmeasured per mode so that both time a cached plan. In every round and mode each side in turn
(the order flips each round): its server, one greedy chat wave per concurrency through this checkout's
gRPC client (output tokens/s; TTFT p50), stopped; then its own engine benchmark (engine section only)
in a process of its own. Each round's numbers keep the load average at their start.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from lmserve.client.bench.harness import ROOT

from . import served
from .machine import taking_turns

FLAGS = {"models_dir": None, "concurrency": [1, 32], "max_new_tokens": 128, "rounds": 3, "skip": ("server", "engine")}
ENGINE_ONLY = ["--skip", "other-loop", "hf", "grpc", "kernels", "quality", "prefill"]


def add_arguments(p) -> None:
    p.add_argument("--base", type=Path, required=True, help="the other checkout (with its .venv made)")
    p.add_argument("--modes", nargs="+", default=["auto", "float32"], help="--dtype of each served mode")
    p.add_argument("--cache-root", type=Path, default=None,
                   help="where each side's cache folder goes (default: a new temporary folder)")


def _side(name: str, checkout: Path, cache: Path) -> dict:
    python = str(checkout / ".venv" / "bin" / "python") if name == "base" else sys.executable
    # the engine benchmark's entry as that checkout has it: the harness, or the module of its own
    harness = (checkout / "client" / "bench" / "registry.py").exists()
    engine = ["-m", "lmserve.client.cli", "bench", "engine"] if harness else ["-m", "lmserve.server.bench.engine_bench"]
    return {"name": name, "checkout": checkout, "python": python, "engine": engine,
            "env": {"XDG_CACHE_HOME": str(cache / name)}}


def _serve_flags(args, dtype: str) -> list[str]:
    return ["--dtype", dtype, *(["--models-dir", str(args.models_dir)] if args.models_dir else [])]


def _served_round(side: dict, args, dtype: str) -> dict:
    from lmserve.client.bench.load import wave

    out = {}
    cmd = (side["python"], "-m", "lmserve.client.cli", "serve")
    with served.lmserve(_serve_flags(args, dtype), http=False, command=cmd, env=side["env"]) as s:
        out["ready_seconds"] = round(s.ready_seconds, 1)
        for i, c in enumerate(args.concurrency):
            run, agg = wave(s.grpc_target, c, max(c, 3), args.max_new_tokens, warmup=1 if i == 0 else 0)
            if run.model is not None:  # the mode served: auto's choice, which each side measured on its own
                out["mode"] = "+".join(filter(None, (run.model.dtype, run.model.quantization)))
                out["kv_cache"] = run.model.kv_cache_dtype
            if agg.failed:
                raise RuntimeError(f"{side['name']}: {agg.failed} requests failed: {agg.errors}")
            out[f"c{c}"] = {"tokens_per_s": round(agg.output_token_throughput, 2),
                            "ttft_p50_ms": round(1000 * agg.ttft.p50, 1)}
    return out


def _engine_round(side: dict, args, dtype: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "engine.json"
        cmd = [side["python"], *side["engine"], *ENGINE_ONLY, "--dtype", dtype, "--out", str(out),
               "--concurrency", *map(str, args.concurrency), "--max-new-tokens", str(args.max_new_tokens),
               *(["--models-dir", str(args.models_dir)] if args.models_dir else [])]
        done = subprocess.run(cmd, cwd=side["checkout"], env={**os.environ, **side["env"]},
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{side['name']}'s engine benchmark failed:\n{done.stderr[-2000:]}")
        report = json.loads(out.read_text())
    return {f"c{row['concurrency']}": {"tokens_per_s": round(row["output_tokens_per_s"], 2)}
            for row in report["engine"]} | {"mode": report.get("served", {}).get("mode")}


def _summary(rounds: list[dict]) -> dict:
    """Each side's best and median of every number across the rounds, and main/base ratios of both
    (TTFT: base over main, so that above 1 means main is faster everywhere)."""
    out: dict = {}
    for r in rounds:
        for part in ("served", "engine"):
            for key, values in r.get(part, {}).items():
                if not isinstance(values, dict):
                    continue
                for metric, v in values.items():
                    out.setdefault(f"{part} {key} {metric}", {}).setdefault(r["side"], []).append(v)
    table = {}
    for name, by_side in out.items():
        lower_better = name.endswith("_ms")
        best = min if lower_better else max
        row = {}
        for side, values in by_side.items():
            row[side] = {"best": best(values), "median": statistics.median(values)}
        if {"base", "main"} <= row.keys():
            for stat in ("best", "median"):
                b, m = row["base"][stat], row["main"][stat]
                row[f"ratio_{stat}"] = round(b / m if lower_better else m / b, 3)
        table[name] = row
    return table


def run(args) -> dict:
    cache = args.cache_root or Path(tempfile.mkdtemp(prefix="house-ab-"))
    sides = [_side("base", args.base.resolve(), cache), _side("main", ROOT, cache)]
    results: dict = {"sides": {s["name"]: {"checkout": str(s["checkout"]), "revision": subprocess.run(
        ["git", "-C", str(s["checkout"]), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()}
        for s in sides}, "modes": {}}
    for dtype in args.modes:
        cold = {}
        for side in sides:  # once unmeasured: each side measures and caches its plan
            with served.lmserve(_serve_flags(args, dtype), http=False, env=side["env"],
                                command=(side["python"], "-m", "lmserve.client.cli", "serve")) as s:
                cold[side["name"]] = round(s.ready_seconds, 1)
        rounds = []
        for i in range(args.rounds):
            for side in taking_turns(sides, i):
                r = {"round": i, "side": side["name"], "load_average": os.getloadavg()[0]}
                if "server" not in args.skip:
                    r["served"] = _served_round(side, args, dtype)
                if "engine" not in args.skip:
                    r["engine"] = _engine_round(side, args, dtype)
                print(json.dumps(r), flush=True)
                rounds.append(r)
        results["modes"][dtype] = {"cold_ready_seconds": cold, "rounds": rounds, "summary": _summary(rounds)}
        for name, row in results["modes"][dtype]["summary"].items():
            print(f"{dtype:8s} {name:28s} " + "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return results
