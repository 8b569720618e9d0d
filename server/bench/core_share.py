"""Decode speed while other processes keep cores busy: steps that go to one thread (--adaptive-threads)
beside steps that keep every thread.

    lmserve bench core-share --model FILE [--busy 1] [--rounds 2]

One process, one model. Each round runs four configurations taking turns: adaptive threads on and off,
each on a quiet machine and with `--busy` neighbouring processes (each a torch process decoding-like
on its own OpenMP threads: small matrix products without end, each a short parallel region; started
before the configuration and stopped after it). Each configuration is a fresh engine (speculation off,
so every step is one token) that decodes `--max-new-tokens` greedy tokens for `--concurrency`
requests after a warm-up; the report has the decode rate (tokens after each stream's first over the
time after the last first one), the inter-token gaps' p50 and p99, the times steps went to one
thread, and whether the tokens equal the quiet fixed-thread run's (they must). A benchmark, not a
test: the quiet rows need a quiet machine.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

from lmserve.client.bench.harness import MODEL
from lmserve.client.bench.stats import percentile

from . import engine_wave
from .machine import load_from_arguments, taking_turns

FLAGS = {**MODEL, "rounds": 2}
# a neighbour as they come on a shared host: another process decoding on its own OpenMP threads (a second
# replica), a stream of small matrix products, each a short parallel region ending in a join
BUSY_LOOP = ("import torch\nw = torch.randn(1024, 1024)\na = torch.randn(4, 1024)\n"
             "while True:\n    a = torch.tanh(a @ w)")


def add_arguments(p) -> None:
    p.add_argument("--busy", type=int, default=1, help="neighbouring torch processes in the busy configurations")
    p.add_argument("--concurrency", type=int, default=1, help="requests decoding at once")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens each request decodes")


def measure(loaded, prompt: list[int], adaptive: bool, busy: int, concurrency: int, max_new: int) -> dict:
    from ..engine import Engine, EngineSettings

    spinners = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(busy)]
    try:
        engine = Engine(loaded, EngineSettings(max_batch=concurrency, max_model_len=len(prompt) + max_new + 8,
                                               prefix_cache=False, speculation="off",
                                               adaptive_threads=adaptive)).start()
        try:
            engine_wave.greedy(engine, [prompt], 8)  # warm-up: kernels primed, first-step costs paid
            w = engine_wave.greedy(engine, [prompt] * concurrency, max_new)
            reductions = engine.cores.reductions if engine.cores is not None else 0
        finally:
            engine.shutdown()
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    gaps = [g for s in w.streams for g in s.gaps()]
    return {"decode_tok_s": w.decode_rate(), "itl_p50_ms": 1e3 * percentile(gaps, 50),
            "itl_p99_ms": 1e3 * percentile(gaps, 99), "reductions": reductions,
            "tokens": [s.token_ids for s in w.streams]}


def run(args) -> dict:
    import torch

    loaded = load_from_arguments(args)
    if torch.get_num_threads() < 2:
        raise SystemExit("core-share needs at least 2 threads (--threads, or a machine with 2 cores)")
    prompt = engine_wave.chat_prompts(loaded.tokenizer, 1)[0]
    configs = [(adaptive, busy) for busy in (0, args.busy) for adaptive in (True, False)]
    runs: dict[tuple, list[dict]] = {c: [] for c in configs}
    for r in range(args.rounds):
        for adaptive, busy in taking_turns(configs, r):
            m = measure(loaded, prompt, adaptive, busy, args.concurrency, args.max_new_tokens)
            runs[(adaptive, busy)].append(m)
            print(json.dumps({"round": r, "adaptive_threads": adaptive, "busy": busy,
                              **{k: round(v, 2) for k, v in m.items() if k != "tokens"}}), flush=True)
    reference = runs[(False, 0)][0]["tokens"]
    rows = []
    for adaptive, busy in configs:
        ms = runs[(adaptive, busy)]
        rows.append({"adaptive_threads": adaptive, "busy_processes": busy,
                     "decode_tok_s": round(statistics.median(m["decode_tok_s"] for m in ms), 1),
                     "itl_p50_ms": round(statistics.median(m["itl_p50_ms"] for m in ms), 1),
                     "itl_p99_ms": round(statistics.median(m["itl_p99_ms"] for m in ms), 1),
                     "rounds_tok_s": [round(m["decode_tok_s"], 1) for m in ms],
                     "reductions": [m["reductions"] for m in ms],
                     "identical_tokens": all(m["tokens"] == reference for m in ms)})
    rate = {(r["adaptive_threads"], r["busy_processes"]): r["decode_tok_s"] for r in rows}
    return {"mode": loaded.mode, "kernels": loaded.kernels, "threads": torch.get_num_threads(),
            "concurrency": args.concurrency, "prompt_tokens": len(prompt), "rows": rows,
            "busy_adaptive_over_fixed": round(rate[(True, args.busy)] / rate[(False, args.busy)], 2),
            "quiet_adaptive_over_fixed": round(rate[(True, 0)] / rate[(False, 0)], 2)}
