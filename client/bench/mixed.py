"""Steady streams plus periodic long prompts on a running server: the workload behind stalls.

    lmserve bench mixed -t localhost:50051 --streams 8 --long-tokens 3000

1. Idle: after one unmeasured long prompt (warm-up), each of ``--idle-runs`` long prompts
   (``--long-tokens`` tokens) is sent alone; their median time to first token is the baseline.
2. Load: ``--streams`` closed-loop streams decode short prompts (``--stream-tokens`` each, EOS
   ignored, the next sent when one ends). Once they are all streaming, ``--long-prompts`` long prompts
   are sent one at a time, ``--gap`` seconds apart (each after the previous one's first token), each
   when every stream is partway into a request with at least half of it to go. The streams finish
   their requests together; a long prompt sent as they all restart met no decoding stream and was
   prefilled alone, the new stream requests queued behind it (a run on the AMX Xeon VM measured
   1.17x its idle TTFT that way, against 2.4x a run earlier).

Reported: the streams' inter-token latency (ITL) outside any prefill window ("steady") and during
one (a gap that overlaps [long prompt sent, its first token]), and the long prompts' TTFT under load
and idle, with the two ratios a stall-free scheduler keeps small: ITL p99 during prefill / steady
ITL p50, and TTFT under load / idle TTFT. Every long prompt starts with its own words, so a prefix
cache cannot serve one from another.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..aio import AsyncClient
from ..cli_args import CliUsageError, add_connection_args, client_kwargs
from .stats import Summary

_FILLER = ("The harbour master kept a ledger of every ship that entered the bay: its name, its cargo, "
           "the weather, and the hour the tide turned. ")


@dataclass(frozen=True)
class MixedConfig:
    streams: int = 8
    stream_tokens: int = 256
    long_tokens: int = 3000
    long_prompts: int = 3
    idle_runs: int = 2
    gap: float = 5.0  # seconds of steady decoding between long prompts (and before the first)
    long_new_tokens: int = 4

    def __post_init__(self) -> None:
        for name in ("streams", "stream_tokens", "long_tokens", "long_prompts", "long_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.idle_runs < 0 or self.gap < 0:
            raise ValueError("--idle-runs and --gap must be >= 0")


@dataclass
class MixedResult:
    config: dict
    idle_ttft: list[float] = field(default_factory=list)
    load_ttft: list[float] = field(default_factory=list)
    windows: list[tuple[float, float]] = field(default_factory=list)  # (sent, first token) of each long prompt
    steady_itl: list[float] = field(default_factory=list)
    prefill_itl: list[float] = field(default_factory=list)
    stream_tokens: int = 0
    errors: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        steady, during = Summary.of(self.steady_itl), Summary.of(self.prefill_itl)
        idle = statistics.median(self.idle_ttft) if self.idle_ttft else None
        load = statistics.median(self.load_ttft) if self.load_ttft else None
        return {
            "steady_itl": None if steady is None else asdict(steady),
            "prefill_itl": None if during is None else asdict(during),
            "itl_p99_during_prefill_over_steady_p50": (during.p99 / steady.p50) if steady and during else None,
            "idle_ttft_median": idle,
            "load_ttft_median": load,
            "ttft_load_over_idle": (load / idle) if idle and load else None,
        }


def split_gaps(events: list[tuple[int, float]], windows: list[tuple[float, float]], since: float):
    """(steady, during) inter-token gaps from (request number, arrival time) events in arrival order.

    A gap counts only between two tokens of the same request, both after `since`; it is "during" when
    it overlaps a window (a long prompt between being sent and its first token), else steady."""
    steady, during = [], []
    for (r0, t0), (r1, t1) in zip(events, events[1:]):
        if r0 != r1 or t0 < since:
            continue
        (during if any(t1 > a and t0 < b for a, b in windows) else steady).append(t1 - t0)
    return steady, during


async def long_prompt_ids(client: AsyncClient, n: int, tag: int) -> list[int]:
    """Exactly n token ids of plain prose, starting with words of its own (tag)."""
    head = (await client.tokenize(f"Document {tag}: notes kept by harbour master number {tag * 7919 % 1000}. ",
                                  add_generation_prompt=False)).token_ids
    body = (await client.tokenize(_FILLER * 8, add_generation_prompt=False)).token_ids
    ids = list(head)
    while len(ids) < n:
        ids.extend(body)
    return ids[:n]


async def _ttft(client: AsyncClient, ids: list[int], max_new: int) -> tuple[float, float, float]:
    """(sent, first token, end) of one long prompt, perf_counter seconds."""
    sent = time.perf_counter()
    first = None
    async for chunk in client.stream(ids, max_new_tokens=max_new, ignore_eos=True):
        if chunk.token_ids and first is None:
            first = time.perf_counter()
    if first is None:
        raise RuntimeError("a long prompt produced no token")
    return sent, first, time.perf_counter()


async def _streams_midway(current: list[int], stream_tokens: int, timeout: float = 60.0) -> None:
    """Until every stream has tokens of its request under way and half of it or more to go (at most
    `timeout` seconds: a stream that keeps failing must not stop the run)."""
    lo = min(3, max(1, stream_tokens // 2))
    hi = max(lo, stream_tokens // 2)
    deadline = time.perf_counter() + timeout
    while not all(lo <= n <= hi for n in current) and time.perf_counter() < deadline:
        await asyncio.sleep(0.005)


class _Streams:
    """The load phase's closed-loop streams: each decodes short prompts one after another (EOS ignored,
    the next sent when one ends) until stopped, every token's arrival kept with its request's number."""

    def __init__(self, client: AsyncClient, config: MixedConfig, errors: list[str]):
        self.client, self.config, self.errors = client, config, errors
        self.events: list[tuple[int, float]] = []  # (request number, token arrival), all streams
        self.started = [0] * config.streams  # tokens each stream has received
        self.current = [0] * config.streams  # tokens of each stream's request under way
        self.stop = asyncio.Event()
        self._counter = iter(range(10**9))

    async def _worker(self, w: int) -> None:
        k = 0
        while not self.stop.is_set():
            rid = next(self._counter)
            prompt = f"A long story about lighthouse number {w * 100 + k}:"
            self.current[w] = 0
            try:
                async for chunk in self.client.stream(prompt, max_new_tokens=self.config.stream_tokens,
                                                      ignore_eos=True):
                    if chunk.token_ids:
                        self.events.append((rid, time.perf_counter()))
                        self.started[w] += len(chunk.token_ids)
                        self.current[w] += len(chunk.token_ids)
                    if self.stop.is_set():
                        break
            except Exception as exc:  # noqa: BLE001 - reported, the run goes on
                self.errors.append(f"stream {w}: {exc}")
                await asyncio.sleep(0.5)
            k += 1

    @contextlib.asynccontextmanager
    async def streaming(self):
        """The streams running, from when each has its first tokens until the block ends."""
        workers = [asyncio.create_task(self._worker(w)) for w in range(self.config.streams)]
        try:
            while min(self.started) < 3:
                await asyncio.sleep(0.05)
            yield
        finally:
            self.stop.set()
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)


async def _long_prompts(client: AsyncClient, config: MixedConfig) -> list[list[int]]:
    """Every long prompt the run sends (one more than measured: the idle warm-up's), each its own words."""
    info = await client.model_info()
    if config.long_tokens + config.long_new_tokens > info.context_length:
        raise ValueError(f"--long-tokens {config.long_tokens} does not fit the context ({info.context_length})")
    return [await long_prompt_ids(client, config.long_tokens, i) for i in range(config.idle_runs + config.long_prompts + 1)]


async def _idle_ttfts(client: AsyncClient, prompts: list[list[int]], config: MixedConfig, result: MixedResult,
                      log) -> None:
    """The baseline: after one unmeasured long prompt (taken from the end of `prompts`), each idle run's
    long prompt sent alone, its TTFT kept."""
    if config.idle_runs:  # a first long prompt pays one-off costs (kernels for new shapes, allocations)
        await _ttft(client, prompts.pop(), config.long_new_tokens)
    for i in range(config.idle_runs):
        sent, first, _ = await _ttft(client, prompts[i], config.long_new_tokens)
        result.idle_ttft.append(first - sent)
        log(f"idle long prompt {i + 1}/{config.idle_runs}: TTFT {first - sent:.2f} s")


async def _ttfts_under_load(client: AsyncClient, prompts: list[list[int]], streams: _Streams, config: MixedConfig,
                            result: MixedResult, log) -> None:
    """The long prompts sent one at a time while the streams decode, each after `gap` seconds and once
    every stream is midway through a request; each one's window and TTFT kept."""
    for i in range(config.long_prompts):
        await asyncio.sleep(config.gap)
        await _streams_midway(streams.current, config.stream_tokens)
        sent, first, _ = await _ttft(client, prompts[i], config.long_new_tokens)
        result.windows.append((sent, first))
        result.load_ttft.append(first - sent)
        log(f"long prompt {i + 1}/{config.long_prompts} under load: TTFT {first - sent:.2f} s")
    await asyncio.sleep(config.gap)


async def run_mixed(target: str, config: MixedConfig, client_options: dict[str, Any] | None = None,
                    log=print) -> MixedResult:
    result = MixedResult(config=asdict(config))
    async with AsyncClient(target, **(client_options or {})) as client:
        prompts = await _long_prompts(client, config)
        await client.generate("Warm up.", max_new_tokens=4)
        await _idle_ttfts(client, prompts, config, result, log)
        streams = _Streams(client, config, result.errors)
        async with streams.streaming():
            since = time.perf_counter()
            await _ttfts_under_load(client, prompts[config.idle_runs:], streams, config, result, log)
        events = sorted(streams.events, key=lambda e: (e[0], e[1]))
        result.steady_itl, result.prefill_itl = split_gaps(events, result.windows, since)
        result.stream_tokens = len(events)
    return result


def format_mixed(result: MixedResult) -> str:
    s = result.summary()
    ms = lambda v: "-" if v is None else f"{v * 1000:.0f}"  # noqa: E731
    lines = [f"{'':28s}{'n':>6s}{'p50 ms':>9s}{'p90 ms':>9s}{'p99 ms':>9s}{'max ms':>9s}"]
    for name, key in (("streams' ITL, steady", "steady_itl"), ("streams' ITL, during prefill", "prefill_itl")):
        v = s[key] or {}
        lines.append(f"{name:28s}{v.get('count', 0):6d}{ms(v.get('p50')):>9s}{ms(v.get('p90')):>9s}"
                     f"{ms(v.get('p99')):>9s}{ms(v.get('max')):>9s}")
    ratio = s["itl_p99_during_prefill_over_steady_p50"]
    lines.append(f"ITL p99 during prefill / steady p50: {'-' if ratio is None else f'{ratio:.2f}x'}")
    ttft = ", ".join(f"{t:.2f}" for t in result.load_ttft)
    idle = ", ".join(f"{t:.2f}" for t in result.idle_ttft)
    r2 = s["ttft_load_over_idle"]
    lines.append(f"long prompt TTFT under load: {ttft} s; idle: {idle} s; "
                 f"median ratio {'-' if r2 is None else f'{r2:.2f}x'}")
    if result.errors:
        lines.append(f"errors: {len(result.errors)} (first: {result.errors[0]})")
    return "\n".join(lines)


FLAGS: dict = {}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("mixed workload")
    d = MixedConfig()
    g.add_argument("--streams", type=int, default=d.streams, help="streams decoding throughout")
    g.add_argument("--stream-tokens", type=int, default=d.stream_tokens, help="tokens per stream request")
    g.add_argument("--long-tokens", type=int, default=d.long_tokens, help="tokens of each long prompt")
    g.add_argument("--long-prompts", type=int, default=d.long_prompts, help="long prompts sent under load")
    g.add_argument("--idle-runs", type=int, default=d.idle_runs, help="long prompts sent alone first (TTFT baseline)")
    g.add_argument("--gap", type=float, default=d.gap, help="seconds of steady decoding before each long prompt")
    add_connection_args(parser)


def run(args: argparse.Namespace) -> dict[str, Any]:
    try:
        config = MixedConfig(streams=args.streams, stream_tokens=args.stream_tokens, long_tokens=args.long_tokens,
                             long_prompts=args.long_prompts, idle_runs=args.idle_runs, gap=args.gap)
    except ValueError as e:
        raise CliUsageError(str(e)) from e
    options = {**client_kwargs(args), "max_retries": 0, "timeout": None}
    result = asyncio.run(run_mixed(args.target, config, options))
    print(format_mixed(result))
    return {"summary": result.summary(), **asdict(result)}


def succeeded(results: dict[str, Any]) -> bool:
    return bool(results["load_ttft"]) and not results["errors"]
