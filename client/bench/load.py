"""Streaming load on a running lmserve server, or (``--api openai --url ...``) on any OpenAI-compatible
server (lmserve's HTTP API, llama.cpp's server, vLLM, ...).

    lmserve bench load -t localhost:50051 --concurrency 8 --requests 100

Closed loop (``--concurrency N`` workers, each sends its next request when the previous
one ends) or open loop (``--rate R``: Poisson arrivals at R requests/s, optionally capped
at ``--concurrency`` in flight). Every request streams through :class:`AsyncClient` (gRPC) or
:class:`~lmserve.client.openai_stream.OpenAIStreamClient` (HTTP, SSE), with the same workloads
and report; the statistics are computed by :mod:`lmserve.client.bench.stats`. The server's
own benchmarks send their waves of requests through :func:`wave`.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from ..aio import AsyncClient
from ..cli_args import CliUsageError, add_connection_args, client_kwargs
from ..errors import LmserveError
from ..types import ModelInfo, SamplingParams
from . import prefix
from .prompts import WorkItem, flatten_chat, load_prompts, repeating_workload, synthetic_workload
from .request import timed_request
from .stats import Aggregate, RequestRecord, aggregate, ecdf, token_timeline

__all__ = ["BenchConfig", "BenchRun", "WorkItem", "run_bench", "wave", "synthetic_workload", "load_prompts",
           "flatten_chat"]
DEFAULT_REQUESTS = 50


@dataclass(frozen=True)
class BenchRun:
    """Raw outcome of a run: measured records, wall duration, and the server's model info."""

    records: list[RequestRecord]
    duration: float
    model: ModelInfo | None


# ---------------------------------------------------------------- run


@dataclass(frozen=True)
class BenchConfig:
    """Validated ``lmserve bench load`` settings."""

    concurrency: int | None
    rate: float | None
    requests: int | None
    duration: float | None
    warmup: int
    max_new_tokens: int
    temperature: float
    seed: int | None
    ignore_eos: bool
    timeout: float | None

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.concurrency < 1:
            raise CliUsageError("--concurrency must be >= 1")
        if self.rate is not None and self.rate <= 0:
            raise CliUsageError("--rate must be > 0")
        if self.requests is not None and self.requests < 1:
            raise CliUsageError("--requests must be >= 1")
        if self.duration is not None and self.duration <= 0:
            raise CliUsageError("--duration must be > 0")
        if self.warmup < 0:
            raise CliUsageError("--warmup must be >= 0")

    def params(self, index: int, item: WorkItem) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=item.max_new_tokens or self.max_new_tokens,
            temperature=self.temperature,
            seed=None if self.seed is None else self.seed + index,
            ignore_eos=self.ignore_eos,
        )


class _Jobs:
    """Hands out (index, item) until the request count or the duration is spent."""

    def __init__(self, items: list[WorkItem], count: int | None, duration: float | None, first: int = 0) -> None:
        self._items, self._count, self._duration = items, count, duration
        self._next = first
        self._issued = 0
        self._start = time.perf_counter()

    def take(self) -> tuple[int, WorkItem] | None:
        if self._count is not None and self._issued >= self._count:
            return None
        if self._duration is not None and time.perf_counter() - self._start >= self._duration:
            return None
        index = self._next
        self._next += 1
        self._issued += 1
        return index, self._items[index % len(self._items)]


async def _closed_loop(jobs: _Jobs, concurrency: int, send) -> list[RequestRecord]:
    records: list[RequestRecord] = []

    async def worker() -> None:
        while (job := jobs.take()) is not None:
            records.append(await send(*job))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records


async def _open_loop(jobs: _Jobs, rate: float, concurrency: int | None, send, rng: random.Random) -> list[RequestRecord]:
    limit = asyncio.Semaphore(concurrency) if concurrency else None

    async def limited(index: int, item: WorkItem) -> RequestRecord:
        if limit is None:
            return await send(index, item)
        async with limit:
            return await send(index, item)

    tasks = []
    while (job := jobs.take()) is not None:
        tasks.append(asyncio.create_task(limited(*job)))
        await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


APIS = ("lmserve", "openai")


def open_client(target: str, client_options: dict[str, Any] | None = None, api: str = "lmserve",
                model: str | None = None):
    """The streaming client of `api`: lmserve's gRPC AsyncClient for a host:port target, or an
    OpenAIStreamClient for a base URL (http://host:port/v1)."""
    opts = dict(client_options or {})
    if api == "openai":
        from ..openai_stream import OpenAIStreamClient

        return OpenAIStreamClient(target, token=opts.get("token"), model=model, ca_file=opts.get("ca_file"),
                                  timeout=opts.get("timeout"))
    return AsyncClient(target, **opts)


async def run_bench(target: str, config: BenchConfig, items: list[WorkItem], *,
                    client_options: dict[str, Any] | None = None, progress: bool = True, api: str = "lmserve",
                    model: str | None = None) -> BenchRun:
    """Runs warmup then the measured phase; returns the measured records. `api`: "lmserve" (gRPC,
    `target` host:port) or "openai" (`target` a base URL such as http://host:8000/v1)."""
    from tqdm import tqdm

    rng = random.Random(config.seed if config.seed is not None else 0)
    items = list(items)
    rng.shuffle(items)
    async with open_client(target, client_options, api, model) as client:
        model = None
        try:
            model = await client.model_info(timeout=config.timeout)
        except LmserveError as e:
            print(f"lmserve bench load: model info unavailable ({e})", file=sys.stderr)
        if model is not None and not model.has_chat_template:
            items = [WorkItem(flatten_chat(it.prompt), it.max_new_tokens) for it in items]

        bar = None
        run_start = time.perf_counter()

        async def send(index: int, item: WorkItem) -> RequestRecord:
            record = await timed_request(client, item.prompt, config.params(index, item), config.timeout, run_start)
            if bar is not None:
                bar.update(1)
            return record

        concurrency = config.concurrency or 1
        if config.warmup:
            await _closed_loop(_Jobs(items, config.warmup, None), concurrency, send)

        bar = tqdm(total=config.requests, unit="req", desc="bench", file=sys.stderr, disable=not progress)
        run_start = time.perf_counter()
        jobs = _Jobs(items, config.requests, config.duration, first=config.warmup)
        try:
            if config.rate is None:
                records = await _closed_loop(jobs, concurrency, send)
            else:
                records = await _open_loop(jobs, config.rate, config.concurrency, send, rng)
        finally:
            bar.close()
        duration = time.perf_counter() - run_start
    return BenchRun(records=records, duration=duration, model=model)


def wave(target: str, concurrency: int, requests: int, max_new_tokens: int, *, api: str = "lmserve",
         items: list[WorkItem] | None = None, warmup: int = 0, ignore_eos: bool = True, seed: int | None = 0,
         timeout: float | None = None) -> tuple[BenchRun, Aggregate]:
    """`requests` greedy requests, `concurrency` in flight (closed loop), through `api` at `target`, with
    `warmup` unmeasured ones first; the run and its statistics. The chat workload unless `items`."""
    config = BenchConfig(concurrency=concurrency, rate=None, requests=requests, duration=None, warmup=warmup,
                         max_new_tokens=max_new_tokens, temperature=0.0, seed=seed, ignore_eos=ignore_eos,
                         timeout=timeout)
    result = asyncio.run(run_bench(target, config, synthetic_workload() if items is None else items,
                                   progress=False, api=api))
    return result, aggregate(result.records, result.duration)


# ---------------------------------------------------------------- report


def format_report(agg: Aggregate) -> str:
    """A human-readable summary table (latencies in milliseconds)."""
    lines = [
        f"requests: {agg.completed} completed, {agg.failed} failed"
        + (f" {dict(sorted(agg.errors.items()))}" if agg.errors else ""),
        f"duration: {agg.duration:.2f} s",
        f"request throughput: {agg.request_throughput:.2f} req/s",
        f"output token throughput: {agg.output_token_throughput:.1f} tok/s",
        f"tokens: {agg.prompt_tokens} prompt, {agg.output_tokens} output",
        f"{'metric (ms)':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for name in ("ttft", "tpot", "itl", "e2e"):
        s = getattr(agg, name)
        if s is None:
            lines.append(f"{name.upper():<12}{'-':>10}{'-':>10}{'-':>10}{'-':>10}")
        else:
            lines.append(f"{name.upper():<12}" + "".join(f"{1000 * v:>10.1f}" for v in (s.mean, s.p50, s.p90, s.p99)))
    return "\n".join(lines)


def plot_run(run: BenchRun, path: str) -> bool:
    """Draws latency CDFs and output throughput over time; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ok = [r for r in run.records if r.ok]
    fig, (ax_cdf, ax_tp) = plt.subplots(1, 2, figsize=(11, 4))
    for label, values in (("TTFT", [r.ttft for r in ok if r.ttft is not None]), ("e2e", [r.e2e for r in ok])):
        if values:
            xs, ys = ecdf(values)
            ax_cdf.step(xs, ys, where="post", label=label)
    ax_cdf.set(xlabel="seconds", ylabel="fraction of requests", title="latency CDF")
    ax_cdf.legend()
    # 1 s bins, finer for short runs so that the curve has at least ~20 points.
    timeline = token_timeline(ok, bin_seconds=max(min(1.0, run.duration / 20), 1e-3))
    if timeline:
        ax_tp.step([t for t, _ in timeline], [v for _, v in timeline], where="post", marker=".")
    ax_tp.set(xlabel="seconds since start", ylabel="output tokens/s", title="throughput over time")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


# ---------------------------------------------------------------- command

FLAGS = {"max_new_tokens": 128}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The load's own flags (the shared --max-new-tokens caps a request unless its prompt says)."""
    load = p.add_argument_group("load")
    load.add_argument("--concurrency", type=int, default=None,
                      help="closed loop: requests in flight (default 1); with --rate: cap on requests in flight")
    load.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals at this many requests/s")
    load.add_argument("--requests", type=int, default=None,
                      help=f"measured requests (default {DEFAULT_REQUESTS} when --duration is not given)")
    load.add_argument("--duration", type=float, default=None, help="stop sending new requests after this many seconds")
    load.add_argument("--warmup", type=int, default=0, help="requests sent first and not measured")
    load.add_argument("--prompts", help="JSON lines file: {\"prompt\": ...} or {\"messages\": [...]} per line")
    load.add_argument("--workload", choices=("chat", "repeat"), default="chat",
                      help="built-in prompts when --prompts is not given: chat (short, medium and long questions) "
                           "or repeat (code editing, quoting, document QA: answers that repeat the prompt, where "
                           "speculative decoding pays)")
    load.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    load.add_argument("--ignore-eos", action="store_true", help="generate max-new-tokens every time")
    load.add_argument("--seed", type=int, default=None,
                      help="seeds prompt order and arrivals; request i gets sampling seed SEED+i")
    load.add_argument("--max-retries", type=int, default=0, help="SDK retries per request (default 0: count overload)")
    load.add_argument("--shared-prefix-tokens", type=int, default=0,
                      help="every request starts with the same system prompt of about this many tokens")
    load.add_argument("--multi-turn", type=int, default=0, metavar="TURNS",
                      help="run conversations of TURNS turns, each resending the history plus a new message "
                           "(--requests counts conversations); prints TTFT per turn")
    api = p.add_argument_group("server API")
    api.add_argument("--api", choices=APIS, default="lmserve",
                     help="lmserve: the gRPC API at --target; openai: any OpenAI-compatible server at --url "
                          "(chat prompts to /chat/completions, text to /completions, streamed)")
    api.add_argument("--url", help="with --api openai: the API's base URL, e.g. http://127.0.0.1:8000/v1")
    api.add_argument("--model", help="with --api openai: the model to ask for (default: the first of /models)")
    out = p.add_argument_group("output")
    out.add_argument("--plot", help="draw latency CDF and throughput over time to this PNG (needs matplotlib)")
    out.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_connection_args(p)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    requests = args.requests
    if requests is None and args.duration is None:
        requests = DEFAULT_REQUESTS
    return BenchConfig(concurrency=args.concurrency, rate=args.rate, requests=requests, duration=args.duration,
                       warmup=args.warmup, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       seed=args.seed, ignore_eos=args.ignore_eos, timeout=args.timeout)


def _target(args: argparse.Namespace) -> str:
    if args.api == "openai":
        if not args.url:
            raise CliUsageError("--api openai needs --url (e.g. http://127.0.0.1:8000/v1)")
        return args.url
    if args.url or args.model:
        raise CliUsageError("--url and --model go with --api openai")
    return args.target


async def _run_multi_turn(args: argparse.Namespace, config: BenchConfig, items: list[WorkItem], options: dict):
    if args.multi_turn < 1 or config.requests is None:
        raise CliUsageError("--multi-turn needs TURNS >= 1 and a --requests count (conversations)")
    async with open_client(_target(args), options, args.api, args.model) as client:
        model = await client.model_info(timeout=config.timeout)
        flatten = None if model is None or model.has_chat_template else flatten_chat
        records, turns, duration = await prefix.run_conversations(
            client, items, args.multi_turn, config.concurrency or 1, config.requests, config.params,
            config.timeout, flatten)
    return BenchRun(records=records, duration=duration, model=model), turns


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The load as the flags describe it; the report's body: the settings in effect, the server's model,
    the summary and every request."""
    config = config_from_args(args)
    if args.prompts:
        items = load_prompts(args.prompts)
    else:
        items = repeating_workload() if args.workload == "repeat" else synthetic_workload()
    if args.shared_prefix_tokens:
        items = prefix.with_shared_prefix(items, args.shared_prefix_tokens)
    options = {**client_kwargs(args), "max_retries": args.max_retries, "timeout": None}
    try:
        if args.multi_turn:
            result, turns = asyncio.run(_run_multi_turn(args, config, items, options))
        else:
            result = asyncio.run(run_bench(_target(args), config, items, client_options=options,
                                           progress=not args.no_progress, api=args.api, model=args.model))
    except (ValueError, OSError) as e:  # bad TLS flags or certificate files
        raise CliUsageError(str(e)) from e
    agg = aggregate(result.records, result.duration)
    print(format_report(agg))
    if args.multi_turn:
        print(prefix.per_turn_table(result.records, turns))
    if args.plot and not plot_run(result, args.plot):
        print("lmserve bench load: matplotlib is not installed; --plot skipped", file=sys.stderr)
    return {"effective": asdict(config), "model": result.model.to_dict() if result.model is not None else None,
            "summary": agg.to_dict(), "requests": [asdict(r) for r in result.records]}


def succeeded(results: dict[str, Any]) -> bool:
    return results["summary"]["completed"] > 0
