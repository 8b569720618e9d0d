"""Host-path ceiling: the real engine, tokenizer, sampler and both edges (gRPC, OpenAI HTTP) around a zero-cost model.

    python -m lmserve.server.bench.host_ceiling --out reports/host_ceiling.json

The model's forward is replaced by a stand-in that returns ready-made logits [N, V] (views of a
bank of rows whose argmax walks through real text, so the detokenizer does real work): what is
left is everything a GPU does not hide, i.e. scheduling, building the step's inputs, sampling,
output processing and delivery, then gRPC or HTTP. Reported per concurrency: tokens/s engine-only
(the asyncio API) and through gRPC and the HTTP API (`lmserve bench`'s clients on this machine, one
server, the two edges alternating round by round so that a busy machine weighs on both alike), the
ITL at c=1, and the engine's host time per step split by phase. A benchmark, not a test: run it on a
quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import psutil
import torch

from .machine import lscpu, write_report

BANK_ROWS = 512
DEFAULT_CONCURRENCY = (1, 8, 64)


class StandInModel:
    """Callable like LlamaForCausalLM.forward; returns views of a fixed logits bank, no compute.

    Row r of the bank peaks at text_ids[r % len(text_ids)]; successive calls (and successive rows of
    one call) walk through the bank, so each sequence gets varying, real-text tokens."""

    uses_fused_ops = False  # what the startup line asks of a model
    native_step = None

    def __init__(self, vocab_size: int, text_ids: list[int], max_rows: int):
        gen = torch.Generator().manual_seed(0)
        self.bank = torch.randn(BANK_ROWS + max_rows, vocab_size, generator=gen)  # [R, V]
        peaks = torch.tensor([text_ids[r % len(text_ids)] for r in range(self.bank.shape[0])])
        self.bank[torch.arange(self.bank.shape[0]), peaks] = 30.0
        self.calls = 0

    def weight_bytes(self) -> int:
        return 0

    def forward_segments(self, segments, cache, logits_index):
        self.calls += 1
        start = (self.calls * 7) % BANK_ROWS
        return self.bank[start: start + logits_index.shape[0]]  # [n, V]


def stand_in_loaded(model: str, models_dir: str | None, max_rows: int):
    """A LoadedModel with the checkpoint's config and tokenizer and the stand-in as its model
    (no weights are read)."""
    from lmserve.model.catalog import resolve_model
    from lmserve.model.config import ModelConfig
    from lmserve.model.gguf_reader import read_directory
    from lmserve.model.loader import LoadedModel
    from lmserve.model.tokenizer import Tokenizer

    path = resolve_model(model, models_dir=models_dir)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        meta, _ = read_directory(buf)
        tok = Tokenizer.from_gguf_fields(meta)
        cfg = ModelConfig.from_gguf(meta)
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")[:8000]
    ids = [i for i in tok.encode(text) if i not in tok.special_ids and i not in tok.eos_ids]
    stand_in = StandInModel(cfg.vocab_size, ids, max_rows)
    return LoadedModel(model=stand_in, tokenizer=tok, config=cfg, source=path, dtype=torch.float32,
                       device=torch.device("cpu"))


def engine_settings(max_batch: int):
    from lmserve.server.engine import EngineSettings

    return EngineSettings(max_batch=max_batch, max_model_len=1024)


def prompts(tok, n: int) -> list[list[int]]:
    from lmserve.client.bench import synthetic_workload

    items = synthetic_workload()
    return [tok.encode(tok.apply_chat_template([{"role": m.role, "content": m.content}
                                                for m in items[i % len(items)].prompt])) for i in range(n)]


# ---------------------------------------------------------------- engine alone


def bench_engine(loaded, concurrencies, max_new: int) -> list[dict]:
    from lmserve.server.engine import Engine, Request, SamplingParams

    rows = []
    engine = Engine(loaded, engine_settings(max(concurrencies))).start()
    try:
        for c in concurrencies:
            ids = prompts(loaded.tokenizer, c)

            async def wave():
                gaps: list[float] = []

                async def one(p):
                    n, last = 0, None
                    async for ch in engine.generate(Request(p, SamplingParams(max_new_tokens=max_new, ignore_eos=True))):
                        now = time.perf_counter()
                        if last is not None and ch.token_ids:
                            gaps.append((now - last) / len(ch.token_ids))
                        last = now
                        n += len(ch.token_ids)
                    return n

                t0 = time.perf_counter()
                counts = await asyncio.gather(*(one(p) for p in ids))
                return sum(counts), time.perf_counter() - t0, gaps

            asyncio.run(wave())  # warm-up
            before = engine.phase_times.copy()
            tokens, seconds, gaps = asyncio.run(wave())
            per_step = engine.phase_times.per_step_ms(since=before)
            gaps.sort()
            rows.append({"concurrency": c, "tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds,
                         "itl_p50_ms": 1e3 * gaps[len(gaps) // 2] if gaps else None,
                         "steps": engine.phase_times.steps - before.steps, "host_ms_per_step": per_step})
            print(f"engine c={c}: {tokens / seconds:,.0f} tok/s, per step "
                  + ", ".join(f"{k} {v:.3f}" for k, v in per_step.items()) + " ms", flush=True)
    finally:
        engine.shutdown()
    return rows


# ---------------------------------------------------------------- through gRPC and HTTP


def serve_stand_in(args) -> int:
    """The server (gRPC, health, the HTTP API when --http-port is set) over an engine with the stand-in model."""
    import logging

    from lmserve.server.app import Server
    from lmserve.server.config import ServerSettings
    from lmserve.server.engine import Engine
    from lmserve.server.metrics import Metrics

    class StandInServer(Server):
        def _load(self):
            loaded = stand_in_loaded(args.model, args.models_dir, args.max_batch)
            engine = Engine(loaded, self.settings.engine)
            return engine.start(), Metrics(engine, "stand-in")

    logging.basicConfig(level="WARNING")
    settings = ServerSettings(port=0, metrics_port=0, http_port=args.http_port, engine=engine_settings(args.max_batch))

    async def main() -> int:
        server = StandInServer(settings)  # bound to free ports here; the parent reads them from our stdout
        print(f"port {server.port} http {server.http_port or 0}", flush=True)
        return await server.run_until_signal()

    return asyncio.run(main())


def _ms(value: float | None) -> str:
    """A latency for the progress line; None when no gap was measured (a stream's chunks all arrived merged)."""
    return "n/a" if value is None else f"{value:.3f} ms"


def _median(values: list[float | None]) -> float | None:
    present = sorted(v for v in values if v is not None)
    return present[len(present) // 2] if present else None


def bench_edges(args, edges: list[str]) -> dict[str, list[dict]]:
    """`lmserve bench` through each edge of one stand-in server; per concurrency the edges alternate
    for --rounds rounds, and each row holds the median of its rounds."""
    from lmserve.client import Client, UnavailableError
    from lmserve.client.bench import BenchConfig, run_bench, synthetic_workload
    from lmserve.client.bench_stats import aggregate

    cmd = [sys.executable, "-m", "lmserve.server.bench.host_ceiling", "--serve",
           "--http-port", "-1" if "http" in edges else "0", "--max-batch", str(max(args.concurrency)),
           "--model", args.model]
    if args.models_dir:
        cmd += ["--models-dir", args.models_dir]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    server = psutil.Process(proc.pid)
    rows: dict[str, list[dict]] = {edge: [] for edge in edges}
    try:
        line = proc.stdout.readline()  # "port N http M" once bound, before the stand-in model loads
        if not line.startswith("port "):
            raise RuntimeError(f"the stand-in server did not start (it printed {line!r})")
        target, http_port = f"127.0.0.1:{int(line.split()[1])}", int(line.split()[3])
        with Client(target) as client:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if client.health() == "SERVING":
                        break
                except UnavailableError:  # not listening yet
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the stand-in server did not become ready")
                time.sleep(0.2)
        targets = {"grpc": (target, "lmserve"), "http": (f"http://127.0.0.1:{http_port}/v1", "openai")}
        for c in args.concurrency:
            cfg = BenchConfig(concurrency=c, rate=None, requests=c * args.waves, duration=None, warmup=c,
                              max_new_tokens=args.max_new_tokens, temperature=0.0, seed=None, ignore_eos=True,
                              timeout=120)
            rounds: dict[str, list] = {edge: [] for edge in edges}
            cpu: dict[str, list] = {edge: [] for edge in edges}  # (server, client) CPU ms per token
            for _ in range(args.rounds):
                for edge in edges:
                    where, api = targets[edge]
                    server_cpu, client_cpu = _cpu_seconds(server), time.process_time()
                    run = asyncio.run(run_bench(where, cfg, synthetic_workload(), progress=False, api=api))
                    agg = aggregate(run.records, run.duration)
                    rounds[edge].append(agg)
                    tokens = max(1, agg.output_tokens)
                    cpu[edge].append((1e3 * (_cpu_seconds(server) - server_cpu) / tokens,
                                      1e3 * (time.process_time() - client_cpu) / tokens))
            for edge in edges:
                aggs = rounds[edge]
                row = {"concurrency": c, "rounds": len(aggs), "completed": sum(a.completed for a in aggs),
                       "failed": sum(a.failed for a in aggs), "tokens": sum(a.output_tokens for a in aggs),
                       "tok_per_s": _median([a.output_token_throughput for a in aggs]),
                       "tok_per_s_rounds": [a.output_token_throughput for a in aggs],
                       "ttft_p50_ms": _median([1e3 * a.ttft.p50 if a.ttft else None for a in aggs]),
                       "itl_p50_ms": _median([1e3 * a.itl.p50 if a.itl else None for a in aggs]),
                       "itl_p99_ms": _median([1e3 * a.itl.p99 if a.itl else None for a in aggs]),
                       # CPU time per token, server process and bench client: what a busy machine's
                       # wall-clock numbers cannot show (warm-up requests included, so a little high)
                       "server_cpu_ms_per_token": _median([c[0] for c in cpu[edge]]),
                       "client_cpu_ms_per_token": _median([c[1] for c in cpu[edge]])}
                rows[edge].append(row)
                print(f"{edge} c={c}: {row['tok_per_s']:,.0f} tok/s, TTFT p50 {_ms(row['ttft_p50_ms'])}, "
                      f"ITL p50 {_ms(row['itl_p50_ms'])}, server CPU {row['server_cpu_ms_per_token']:.3f} ms/token, "
                      f"client CPU {row['client_cpu_ms_per_token']:.3f} ms/token", flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
        proc.stdout.close()
    return rows


def _cpu_seconds(process) -> float:
    t = process.cpu_times()
    return t.user + t.system


def edge_ratios(report: dict) -> list[dict]:
    """HTTP against gRPC per concurrency: throughput ratio, TTFT difference, server CPU per token ratio."""
    out = []
    for g, h in zip(report.get("grpc", []), report.get("http", [])):
        out.append({"concurrency": g["concurrency"],
                    "http_over_grpc_tok_per_s": h["tok_per_s"] / g["tok_per_s"] if g["tok_per_s"] else None,
                    "http_over_grpc_server_cpu_per_token": h["server_cpu_ms_per_token"] / g["server_cpu_ms_per_token"]
                    if g["server_cpu_ms_per_token"] else None,
                    "http_minus_grpc_ttft_p50_ms": (h["ttft_p50_ms"] - g["ttft_p50_ms"])
                    if None not in (h["ttft_p50_ms"], g["ttft_p50_ms"]) else None})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="checkpoint whose config and tokenizer are used")
    ap.add_argument("--models-dir", default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=list(DEFAULT_CONCURRENCY))
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--waves", type=int, default=2, help="measured requests per concurrency slot through gRPC")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the stand-in does no math)")
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds of the edges per concurrency")
    ap.add_argument("--skip", nargs="*", default=[], choices=["engine", "grpc", "http"])
    ap.add_argument("--out", default=None, help="JSON report path")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--http-port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--max-batch", type=int, default=64, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.serve:
        return serve_stand_in(args)

    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu": lscpu(),
              "cpus": os.cpu_count(), "torch": torch.__version__, "max_new_tokens": args.max_new_tokens,
              "concurrency": args.concurrency, "model_stand_in_for": args.model}
    if "engine" not in args.skip:
        loaded = stand_in_loaded(args.model, args.models_dir, max(args.concurrency))
        report["engine"] = bench_engine(loaded, args.concurrency, args.max_new_tokens)
    edges = [e for e in ("grpc", "http") if e not in args.skip]
    if edges:
        report.update(bench_edges(args, edges))
    if len(edges) == 2:
        report["http_vs_grpc"] = edge_ratios(report)
        for r in report["http_vs_grpc"]:
            print(f"c={r['concurrency']}: HTTP/gRPC throughput {r['http_over_grpc_tok_per_s']:.2f}x, "
                  f"server CPU per token {r['http_over_grpc_server_cpu_per_token']:.2f}x, "
                  f"TTFT p50 HTTP-gRPC {r['http_minus_grpc_ttft_p50_ms']:+.2f} ms", flush=True)
    if args.out:
        write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
