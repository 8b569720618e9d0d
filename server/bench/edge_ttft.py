"""Time to first token through gRPC and through the OpenAI HTTP API of one real server, at c=1.

    python -m lmserve.server.bench.edge_ttft --out reports/edge_ttft.json

One `lmserve serve` process (the real model, no prefix cache) serves both edges; `lmserve bench` sends
the same short chat prompts through each, the edges alternating round by round so that a busy machine weighs on both
alike. Reported per edge and round: TTFT p50 and mean (client side, request sent -> first text), and
the median over rounds of HTTP minus gRPC. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from datetime import datetime, timezone

from . import served
from .machine import lscpu, write_report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--models-dir", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=12, help="requests per edge and round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from lmserve.client.bench import BenchConfig, run_bench, synthetic_workload
    from lmserve.client.bench_stats import aggregate

    # no prefix cache: every round sends the same prompts, and a hit would favour whichever edge came later
    flags = ["--model", args.model, "--max-batch", "4", "--threads", str(args.threads), "--dtype", args.dtype,
             "--compile", "false", "--prefix-cache", "false",
             *(["--models-dir", args.models_dir] if args.models_dir else [])]
    cfg = BenchConfig(concurrency=1, rate=None, requests=args.requests, duration=None, warmup=2,
                      max_new_tokens=args.max_new_tokens, temperature=0.0, seed=0, ignore_eos=True, timeout=120)
    items = synthetic_workload()[::3]  # the short questions: a TTFT of a few ms, so 1 ms shows
    rounds = {"grpc": [], "http": []}
    with served.lmserve(flags, args.startup_timeout) as server:
        target, url, log = server.grpc_target, server.http_url, server.log
        for r in range(args.rounds):
            order = ("grpc", "http") if r % 2 == 0 else ("http", "grpc")  # neither edge always goes first
            for edge in order:
                where, api = (target, "lmserve") if edge == "grpc" else (url, "openai")
                run = asyncio.run(run_bench(where, cfg, items, progress=False, api=api))
                agg = aggregate(run.records, run.duration)
                rounds[edge].append({"round": r, "completed": agg.completed, "failed": agg.failed,
                                     "ttft_p50_ms": 1e3 * agg.ttft.p50, "ttft_mean_ms": 1e3 * agg.ttft.mean,
                                     "e2e_p50_ms": 1e3 * agg.e2e.p50})
                print(f"round {r} {edge}: TTFT p50 {1e3 * agg.ttft.p50:.2f} ms, mean {1e3 * agg.ttft.mean:.2f} ms",
                      flush=True)
    diffs = sorted(h["ttft_p50_ms"] - g["ttft_p50_ms"] for g, h in zip(rounds["grpc"], rounds["http"]))
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu": lscpu(),
              "cpus": os.cpu_count(), "model": args.model, "dtype": args.dtype, "threads": args.threads,
              "requests_per_round": args.requests, "max_new_tokens": args.max_new_tokens, "rounds": rounds,
              "http_minus_grpc_ttft_p50_ms_median": diffs[len(diffs) // 2], "http_minus_grpc_ttft_p50_ms": diffs}
    print(f"HTTP - gRPC TTFT p50, median over rounds: {report['http_minus_grpc_ttft_p50_ms_median']:+.2f} ms "
          f"(rounds: {', '.join(f'{d:+.2f}' for d in diffs)})")
    if args.out:
        write_report(args.out, report)
    log.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
