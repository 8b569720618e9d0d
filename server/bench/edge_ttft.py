"""Time to first token through gRPC and through the OpenAI HTTP API of one real server, at c=1.

    lmserve bench edge-ttft [--rounds 4] [--requests 12]

One `lmserve serve` process (the real model, no prefix cache) serves both edges; the load generator sends
the same short chat prompts through each, the edges alternating round by round so that a busy machine
weighs on both alike. Reported per edge and round: TTFT p50 and mean (client side, request sent -> first text), and
the median over rounds of HTTP minus gRPC. A benchmark, not a test.
"""

from __future__ import annotations

from lmserve.client.bench.harness import MODEL

from . import served

FLAGS = {**MODEL, "dtype": "float32", "threads": 2, "requests": 12, "rounds": 4, "max_new_tokens": 8}


def add_arguments(p) -> None:
    p.add_argument("--startup-timeout", type=float, default=600, help="seconds the server may take to serve")


def run(args) -> dict:
    from lmserve.client.bench.load import wave
    from lmserve.client.bench.prompts import synthetic_workload

    # no prefix cache: every round sends the same prompts, and a hit would favour whichever edge came later
    flags = ["--model", args.model, "--max-batch", "4", "--threads", str(args.threads), "--dtype", args.dtype,
             "--quantization", args.quantization, "--compile", "false", "--prefix-cache", "false",
             *(["--models-dir", args.models_dir] if args.models_dir else []),
             *(["--device", args.device] if args.device else [])]
    items = synthetic_workload()[::3]  # the short questions: a TTFT of a few ms, so 1 ms shows
    rounds = {"grpc": [], "http": []}
    with served.lmserve(flags, startup_timeout=args.startup_timeout) as server:
        for r in range(args.rounds):
            order = ("grpc", "http") if r % 2 == 0 else ("http", "grpc")  # neither edge always goes first
            for edge in order:
                where, api = (server.grpc_target, "lmserve") if edge == "grpc" else (server.http_url, "openai")
                _, agg = wave(where, 1, args.requests, args.max_new_tokens, api=api, items=items, warmup=2,
                              timeout=120)
                rounds[edge].append({"round": r, "completed": agg.completed, "failed": agg.failed,
                                     "ttft_p50_ms": 1e3 * agg.ttft.p50, "ttft_mean_ms": 1e3 * agg.ttft.mean,
                                     "e2e_p50_ms": 1e3 * agg.e2e.p50})
                print(f"round {r} {edge}: TTFT p50 {1e3 * agg.ttft.p50:.2f} ms, mean {1e3 * agg.ttft.mean:.2f} ms",
                      flush=True)
    diffs = sorted(h["ttft_p50_ms"] - g["ttft_p50_ms"] for g, h in zip(rounds["grpc"], rounds["http"]))
    report = {"rounds": rounds, "http_minus_grpc_ttft_p50_ms_median": diffs[len(diffs) // 2],
              "http_minus_grpc_ttft_p50_ms": diffs}
    print(f"HTTP - gRPC TTFT p50, median over rounds: {report['http_minus_grpc_ttft_p50_ms_median']:+.2f} ms "
          f"(rounds: {', '.join(f'{d:+.2f}' for d in diffs)})")
    return report
