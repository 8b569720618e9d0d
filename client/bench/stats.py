"""Pure statistics for the load generator: per-request latency metrics and their aggregates.

No I/O and no clocks here; :mod:`lmserve.client.bench.load` records, this module computes.
Definitions (seconds):

- TTFT: request start -> first chunk carrying tokens.
- TPOT: (e2e - TTFT) / (output tokens - 1), for requests with at least 2 tokens.
- ITL: each gap between consecutive token-carrying chunks.
- e2e: request start -> end of the stream.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

SUMMARY_PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) by linear interpolation between closest ranks.

    Matches ``numpy.percentile`` (method "linear") and ``statistics.quantiles(method="inclusive")``.
    """
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"q must lie in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    frac = rank - lo
    return ordered[lo] + (ordered[hi] - ordered[lo]) * frac


@dataclass(frozen=True)
class Summary:
    """Count, mean, min, max and the SUMMARY_PERCENTILES of one metric."""

    count: int
    mean: float
    min: float
    max: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Iterable[float]) -> "Summary | None":
        data = [float(v) for v in values]
        if not data:
            return None
        p50, p90, p99 = (percentile(data, q) for q in SUMMARY_PERCENTILES)
        return cls(count=len(data), mean=math.fsum(data) / len(data), min=min(data), max=max(data),
                   p50=p50, p90=p90, p99=p99)


@dataclass
class RequestRecord:
    """What the load generator saw of one request.

    ``start`` is seconds since the run began; ``events`` are ``(seconds since request
    start, tokens in chunk)`` for every chunk that carried tokens; ``error`` is the
    status code name of a failed request.
    """

    start: float
    e2e: float
    events: list[tuple[float, int]] = field(default_factory=list)
    prompt_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def output_tokens(self) -> int:
        return sum(n for _, n in self.events)

    @property
    def ttft(self) -> float | None:
        return self.events[0][0] if self.events else None

    @property
    def tpot(self) -> float | None:
        tokens = self.output_tokens
        if tokens < 2 or self.ttft is None:
            return None
        return (self.e2e - self.ttft) / (tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between tokens. A message carrying k tokens (a server merges what a slow reader has
        not taken) counts as k gaps of 1/k of its wait, so every token after the first is counted."""
        gaps = []
        for (a, _), (b, k) in zip(self.events, self.events[1:]):
            gaps += [(b - a) / k] * k
        return gaps


@dataclass(frozen=True)
class Aggregate:
    """The report of one run over ``duration`` seconds."""

    duration: float
    completed: int
    failed: int
    errors: dict[str, int]
    prompt_tokens: int
    output_tokens: int
    request_throughput: float
    output_token_throughput: float
    ttft: Summary | None
    tpot: Summary | None
    itl: Summary | None
    e2e: Summary | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def aggregate(records: Sequence[RequestRecord], duration: float) -> Aggregate:
    """Aggregates request records; throughputs count completed requests only."""
    if duration <= 0:
        raise ValueError(f"duration must be > 0, got {duration}")
    ok = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    return Aggregate(
        duration=duration,
        completed=len(ok),
        failed=len(records) - len(ok),
        errors=dict(Counter(r.error for r in records if not r.ok)),
        prompt_tokens=sum(r.prompt_tokens for r in ok),
        output_tokens=output_tokens,
        request_throughput=len(ok) / duration,
        output_token_throughput=output_tokens / duration,
        ttft=Summary.of(r.ttft for r in ok if r.ttft is not None),
        tpot=Summary.of(r.tpot for r in ok if r.tpot is not None),
        itl=Summary.of(gap for r in ok for gap in r.itls),
        e2e=Summary.of(r.e2e for r in ok),
    )


def token_timeline(records: Iterable[RequestRecord], bin_seconds: float = 1.0) -> list[tuple[float, float]]:
    """Output tokens per second in consecutive bins of the run: ``[(bin start, tokens/s), ...]``."""
    if bin_seconds <= 0:
        raise ValueError("bin_seconds must be > 0")
    bins: Counter[int] = Counter()
    for r in records:
        for t, n in r.events:
            bins[int((r.start + t) // bin_seconds)] += n
    if not bins:
        return []
    return [(i * bin_seconds, bins.get(i, 0) / bin_seconds) for i in range(max(bins) + 1)]


def ecdf(values: Iterable[float]) -> tuple[list[float], list[float]]:
    """Empirical CDF points: sorted values and the fraction of values <= each."""
    xs = sorted(values)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]
