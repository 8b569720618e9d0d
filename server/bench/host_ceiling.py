"""Host-path ceiling: the real engine, tokenizer, sampler and both edges (gRPC, OpenAI HTTP) around a zero-cost model.

    lmserve bench host-ceiling [--concurrency 1 8 64] [--rounds 2]

The model's forward is replaced by a stand-in that returns ready-made logits [N, V] (views of a
bank of rows whose argmax walks through real text, so the detokenizer does real work): what is
left is everything a GPU does not hide, i.e. scheduling, building the step's inputs, sampling,
output processing and delivery, then gRPC or HTTP. Reported per concurrency: tokens/s engine-only
(the asyncio API) and through gRPC and the HTTP API (`lmserve bench load`'s clients on this machine, one
server, the two edges alternating round by round so that a busy machine weighs on both alike), the
ITL at c=1, and the engine's host time per step split by phase. A benchmark, not a test: run it on a
quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

from . import engine_wave, served

BANK_ROWS = 512
FLAGS = {"model": "smollm2", "models_dir": None, "concurrency": [1, 8, 64], "max_new_tokens": 256, "threads": 1,
         "rounds": 1, "skip": ("engine", "grpc", "http")}


def add_arguments(p) -> None:
    p.add_argument("--waves", type=int, default=2, help="measured requests per concurrency slot through an edge")
    p.add_argument("--base", type=Path, default=None,
                   help="another checkout (git worktree add /tmp/base <rev>) measured beside this one: each round "
                        "runs this benchmark once from each checkout, in turns; the report holds both and the ratios")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the stand-in server (bench_edges)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--http-port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--metrics-port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--max-batch", type=int, default=64, help=argparse.SUPPRESS)


class StandInModel:
    """Callable like LlamaForCausalLM.forward; returns views of a fixed logits bank, no compute.

    Row r of the bank peaks at text_ids[r % len(text_ids)]; successive calls (and successive rows of
    one call) walk through the bank, so each sequence gets varying, real-text tokens."""

    uses_fused_ops = False  # what the startup line asks of a model
    native_step = None
    lora = None  # no adapter slots: every row is the base model's

    def __init__(self, vocab_size: int, text_ids: list[int], max_rows: int, bank: torch.Tensor | None = None):
        if bank is None:
            gen = torch.Generator().manual_seed(0)
            bank = torch.randn(BANK_ROWS + max_rows, vocab_size, generator=gen)  # [R, V]
            peaks = torch.tensor([text_ids[r % len(text_ids)] for r in range(bank.shape[0])])
            bank[torch.arange(bank.shape[0]), peaks] = 30.0
        self.bank = bank
        self.out = None  # views of the bank (the sampler must not write into them), or two buffers copied into
        self.copy_seconds = 0.0  # thread CPU time spent copying rows into them: the model's part of a step
        self.calls = 0

    def with_fresh_logits(self) -> "StandInModel":
        """The same bank, each call's rows copied into one of two buffers (as a model writes its logits), for
        requests whose sampler writes into the logits in place: a constraint's mask or a logit bias would
        otherwise stay in the bank, reach the rows of later calls and requests, and (a row masked twice over)
        end them with an error. The copies' CPU time is kept in copy_seconds, for a benchmark to take out."""
        other = StandInModel(self.bank.shape[1], [], 0, bank=self.bank)
        other.out = [torch.empty(self.bank.shape[0] - BANK_ROWS, self.bank.shape[1]) for _ in range(2)]
        return other

    def weight_bytes(self) -> int:
        return 0

    def forward_segments(self, segments, cache, logits_index, lora=None):
        self.calls += 1
        start = (self.calls * 7) % BANK_ROWS
        rows = self.bank[start: start + logits_index.shape[0]]  # [n, V]
        if self.out is None:
            return rows
        t0 = time.thread_time()
        out = self.out[self.calls % 2][: rows.shape[0]]
        out.copy_(rows)
        self.copy_seconds += time.thread_time() - t0
        return out


def stand_in_loaded(model: str, models_dir: str | None, max_rows: int):
    """A LoadedModel with the checkpoint's config and tokenizer and the stand-in as its model
    (no weights are read)."""
    from lmserve.model.checkpoints.catalog import resolve_model
    from lmserve.model.config import ModelConfig
    from lmserve.model.checkpoints.gguf_reader import read_directory
    from lmserve.model.loader import LoadedModel
    from lmserve.model.text.tokenizer import Tokenizer

    path = resolve_model(model, models_dir=models_dir)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        meta, _ = read_directory(buf)
        tok = Tokenizer.from_gguf_fields(meta)
        cfg = ModelConfig.from_gguf(meta)
    from lmserve.model.tuning.quality import text_ids

    # real prose (the held-out text, shipped with the package), so the detokenizer does real work
    ids = [i for i in text_ids(tok) if i not in tok.special_ids and i not in tok.eos_ids]
    stand_in = StandInModel(cfg.vocab_size, ids, max_rows)
    return LoadedModel(model=stand_in, tokenizer=tok, config=cfg, source=path, dtype=torch.float32,
                       device=torch.device("cpu"))


def engine_settings(max_batch: int):
    from lmserve.server.engine import EngineSettings

    return EngineSettings(max_batch=max_batch, max_model_len=1024)


# ---------------------------------------------------------------- engine alone


def bench_engine(loaded, concurrencies, max_new: int) -> list[dict]:
    from lmserve.server.engine import Engine

    rows = []
    engine = Engine(loaded, engine_settings(max(concurrencies))).start()
    try:
        for c in concurrencies:
            ids = engine_wave.chat_prompts(loaded.tokenizer, c)
            engine_wave.greedy(engine, ids, max_new)  # warm-up
            before = engine.phase_times.copy()
            w = engine_wave.greedy(engine, ids, max_new)
            per_step = engine.phase_times.per_step_ms(since=before)
            tokens, seconds = w.tokens, w.seconds
            gaps = sorted(g for s in w.streams for g in s.gaps())
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

    # the startup lines served.lmserve reads the ports from, as `lmserve serve` logs them
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = ServerSettings(port=args.port, metrics_port=args.metrics_port, http_port=args.http_port,
                              engine=engine_settings(args.max_batch))

    async def main() -> int:
        return await StandInServer(settings).run_until_signal()

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
    from lmserve.client.bench.load import wave

    stand_in = (sys.executable, "-m", "lmserve.client.cli", "bench", "host-ceiling", "--serve")
    flags = ["--max-batch", str(max(args.concurrency)), "--model", args.model,
             *(["--models-dir", args.models_dir] if args.models_dir else [])]
    rows: dict[str, list[dict]] = {edge: [] for edge in edges}
    with served.lmserve(flags, http="http" in edges, command=stand_in, startup_timeout=120) as s:
        server = psutil.Process(s.pid)
        targets = {"grpc": (s.grpc_target, "lmserve"), "http": (s.http_url, "openai")}
        for c in args.concurrency:
            rounds: dict[str, list] = {edge: [] for edge in edges}
            cpu: dict[str, list] = {edge: [] for edge in edges}  # (server, client) CPU ms per token
            for _ in range(args.rounds):
                for edge in edges:
                    where, api = targets[edge]
                    server_cpu, client_cpu = _cpu_seconds(server), time.process_time()
                    _, agg = wave(where, c, c * args.waves, args.max_new_tokens, api=api, warmup=c, seed=None,
                                  timeout=120)
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


# ---------------------------------------------------------------- beside another checkout

# where each import package of the distribution lives in a checkout (pyproject's package-dir)
PACKAGE_DIRS = {"client": "client", "model": "model", "server": "server", "v1": "proto/lmserve/v1"}


def _import_root(checkout: Path, into: Path) -> Path:
    """A folder whose `lmserve` package is the checkout's code (its folders linked under their import
    names), for PYTHONPATH: the checkout runs in this interpreter and venv, without a venv of its own."""
    pkg = into / "lmserve"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text((checkout / "proto" / "lmserve" / "__init__.py").read_text())
    for name, folder in PACKAGE_DIRS.items():
        (pkg / name).symlink_to(checkout.resolve() / folder, target_is_directory=True)
    return into


def _one_pass(args, env: dict) -> dict:
    """One run of this benchmark (one round, every concurrency and part) in a process of its own."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "pass.json"
        cmd = [sys.executable, "-m", "lmserve.client.cli", "bench", "host-ceiling", "--rounds", "1", "--out", str(out),
               "--model", args.model, "--concurrency", *map(str, args.concurrency), "--threads", str(args.threads),
               "--max-new-tokens", str(args.max_new_tokens), "--waves", str(args.waves),
               *(["--models-dir", args.models_dir] if args.models_dir else []), "--skip", *args.skip]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"a pass failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}")
        report = json.loads(out.read_text())
    return {part: report[part] for part in ("engine", "grpc", "http") if part in report}


def _ratios(base: list[dict], this: list[dict]) -> dict:
    """Per part and concurrency: each side's median tok/s (and server CPU per token through an edge), and
    this / base of the rounds paired (each round ran both), their median and spread."""
    out = {}
    for part in (p for p in ("engine", "grpc", "http") if p in this[0]):
        rows = []
        for i, c in enumerate(r["concurrency"] for r in this[0][part]):
            b = [p[part][i] for p in base]
            t = [p[part][i] for p in this]
            paired = [x["tok_per_s"] / y["tok_per_s"] for x, y in zip(t, b) if x["tok_per_s"] and y["tok_per_s"]]
            row = {"concurrency": c, "base_tok_per_s": statistics.median(x["tok_per_s"] for x in b),
                   "this_tok_per_s": statistics.median(x["tok_per_s"] for x in t),
                   "this_over_base": statistics.median(paired), "this_over_base_rounds": paired}
            if "server_cpu_ms_per_token" in t[0]:
                row["base_server_cpu_ms_per_token"] = statistics.median(x["server_cpu_ms_per_token"] for x in b)
                row["this_server_cpu_ms_per_token"] = statistics.median(x["server_cpu_ms_per_token"] for x in t)
            if "host_ms_per_step" in t[0]:
                row["base_host_ms_per_step"] = {k: statistics.median(x["host_ms_per_step"][k] for x in b)
                                                for k in b[0]["host_ms_per_step"]}
                row["this_host_ms_per_step"] = {k: statistics.median(x["host_ms_per_step"][k] for x in t)
                                                for k in t[0]["host_ms_per_step"]}
            rows.append(row)
            print(f"{part} c={c}: base {row['base_tok_per_s']:,.0f} tok/s, this {row['this_tok_per_s']:,.0f} tok/s, "
                  f"this/base {row['this_over_base']:.2f}x (rounds " + ", ".join(f"{r:.2f}" for r in paired) + ")",
                  flush=True)
        out[part] = rows
    return out


def beside_base(args) -> dict:
    """This checkout and args.base, one pass each per round, taking turns (machine.taking_turns)."""
    from .machine import taking_turns

    base_commit = subprocess.run(["git", "-C", str(args.base), "rev-parse", "HEAD"], capture_output=True,
                                 text=True).stdout.strip() or None
    passes: dict[str, list[dict]] = {"base": [], "this": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = _import_root(args.base, Path(tmp))
        envs = {"this": dict(os.environ),
                "base": {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH"))))}}
        for r in range(args.rounds):
            for side in taking_turns(("base", "this"), r):
                load = os.getloadavg()[0]
                passes[side].append({**_one_pass(args, envs[side]), "load_average": load})
                print(f"round {r + 1}: {side} done (load average {load:.1f} at its start)", flush=True)
    return {"model_stand_in_for": args.model, "base": {"checkout": str(args.base), "commit": base_commit},
            "passes": passes, "this_vs_base": _ratios(passes["base"], passes["this"])}


def run(args) -> dict | None:
    torch.set_num_threads(args.threads)
    if args.serve:
        serve_stand_in(args)
        return None
    if args.base is not None:
        return beside_base(args)
    report = {"model_stand_in_for": args.model}
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
    return report
