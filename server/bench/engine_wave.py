"""One wave of concurrent requests through the engine's asyncio API, as the in-process benchmarks send
it, and the chat prompts they send: each benchmark reads what it measures from the streams' arrivals."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field


@dataclass
class Stream:
    """One request's output as it arrived."""

    token_ids: list[int] = field(default_factory=list)
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (perf_counter, tokens) per chunk with tokens
    text: str = ""
    finish_reason: object = None

    def gaps(self) -> list[float]:
        """Seconds per token between consecutive chunks with tokens (a merged chunk: its gap over its tokens)."""
        return [(t1 - t0) / n for (t0, _), (t1, n) in zip(self.arrivals, self.arrivals[1:])]

    def token_times(self) -> list[float]:
        """Each token's arrival (the tokens of one chunk arrive together)."""
        return [t for t, n in self.arrivals for _ in range(n)]


@dataclass
class Wave:
    streams: list[Stream]
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.streams)

    def decode_rate(self) -> float:
        """Tokens after each stream's first chunk over the time after the last first chunk: the decode
        rate, the prompts' prefill left out."""
        t_first = max(s.arrivals[0][0] for s in self.streams)
        after_first = sum(len(s.token_ids) - s.arrivals[0][1] for s in self.streams)
        return after_first / max(self.end - t_first, 1e-9)


async def _wave(engine, requests) -> Wave:
    async def one(request) -> Stream:
        s = Stream()
        async for ch in engine.generate(request):
            if ch.token_ids:
                s.arrivals.append((time.perf_counter(), len(ch.token_ids)))
                s.token_ids += ch.token_ids
            s.text += ch.text
            s.finish_reason = ch.finish_reason
        return s

    start = time.perf_counter()
    streams = await asyncio.gather(*(one(r) for r in requests))
    return Wave(list(streams), start, time.perf_counter())


def wave(engine, requests) -> Wave:
    """Every request submitted at once, each stream read to its end."""
    return asyncio.run(_wave(engine, requests))


def greedy(engine, prompts: list[list[int]], max_new_tokens: int, **params) -> Wave:
    """wave() of one greedy request per prompt, EOS ignored unless `params` say otherwise."""
    from ..engine import Request, SamplingParams

    params.setdefault("ignore_eos", True)
    return wave(engine, [Request(list(p), SamplingParams(max_new_tokens=max_new_tokens, **params)) for p in prompts])


def chat_prompts(tok, n: int) -> list[list[int]]:
    """The load generator's chat workload rendered with the model's template, `n` prompts in its order."""
    from lmserve.client.bench.prompts import synthetic_workload

    items = synthetic_workload()
    return [tok.encode(tok.apply_chat_template([{"role": m.role, "content": m.content}
                                                for m in items[i % len(items)].prompt])) for i in range(n)]
