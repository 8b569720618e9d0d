"""Load-generator statistics against independent computations."""

import math
import random
import statistics

import pytest

from lmserve.client.bench.stats import RequestRecord, Summary, aggregate, ecdf, percentile, token_timeline


def _samples(rng, n):
    return [rng.expovariate(3.0) for _ in range(n)]


def test_percentile_matches_statistics_inclusive_quantiles():
    rng = random.Random(0)
    for n in (2, 3, 10, 101, 500):
        data = _samples(rng, n)
        cuts = statistics.quantiles(data, n=100, method="inclusive")  # cuts[i] is the (i+1)-th percentile
        for q in range(1, 100):
            assert percentile(data, q) == pytest.approx(cuts[q - 1], rel=1e-12, abs=1e-15)


def test_percentile_properties():
    rng = random.Random(1)
    for _ in range(50):
        data = _samples(rng, rng.randrange(1, 60))
        ordered = sorted(data)
        assert percentile(data, 0) == ordered[0] and percentile(data, 100) == ordered[-1]
        qs = sorted(rng.uniform(0, 100) for _ in range(20))
        values = [percentile(data, q) for q in qs]
        assert values == sorted(values)  # monotone in q
        assert all(ordered[0] <= v <= ordered[-1] for v in values)
        # at least q% of the data lies at or below the q-th percentile
        for q, v in zip(qs, values):
            assert sum(x <= v for x in data) >= math.floor(q / 100 * (len(data) - 1)) + 1
    assert percentile([4.0], 37) == 4.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summary_against_statistics():
    data = _samples(random.Random(2), 77)
    s = Summary.of(data)
    assert s.count == 77
    assert s.mean == pytest.approx(statistics.fmean(data))
    assert s.p50 == pytest.approx(statistics.median(data))
    assert (s.min, s.max) == (min(data), max(data))
    assert Summary.of([]) is None


def test_request_metrics_from_chunk_events():
    # chunks at 0.5 s (1 token), 0.7 s (2 tokens), 1.0 s (1 token); stream ends at 1.1 s
    r = RequestRecord(start=0.0, e2e=1.1, events=[(0.5, 1), (0.7, 2), (1.0, 1)], prompt_tokens=9)
    assert r.output_tokens == 4
    assert r.ttft == 0.5
    assert r.tpot == pytest.approx((1.1 - 0.5) / 3)
    assert r.itls == pytest.approx([0.1, 0.1, 0.3])  # the 2-token message: two gaps of half its wait
    assert len(r.itls) == r.output_tokens - r.events[0][1]
    one = RequestRecord(start=0.0, e2e=0.4, events=[(0.3, 1)])
    assert one.tpot is None and one.itls == []
    empty = RequestRecord(start=0.0, e2e=0.1)
    assert empty.ttft is None and empty.tpot is None


def test_aggregate_counts_throughput_and_errors():
    ok = [RequestRecord(start=i, e2e=1.0 + i, events=[(0.1 * (i + 1), 2), (0.5 + i, 3)], prompt_tokens=4)
          for i in range(4)]
    bad = [RequestRecord(start=0, e2e=0.01, error="RESOURCE_EXHAUSTED"),
           RequestRecord(start=0, e2e=0.01, error="RESOURCE_EXHAUSTED"),
           RequestRecord(start=0, e2e=0.01, error="UNAVAILABLE")]
    agg = aggregate(ok + bad, duration=10.0)
    assert (agg.completed, agg.failed) == (4, 3)
    assert agg.errors == {"RESOURCE_EXHAUSTED": 2, "UNAVAILABLE": 1}
    assert agg.output_tokens == 20 and agg.prompt_tokens == 16
    assert agg.request_throughput == pytest.approx(0.4)
    assert agg.output_token_throughput == pytest.approx(2.0)
    assert agg.e2e.mean == pytest.approx(statistics.fmean([1.0, 2.0, 3.0, 4.0]))
    assert agg.ttft.p50 == pytest.approx(statistics.median([0.1, 0.2, 0.3, 0.4]))
    assert agg.itl.count == 4 * 3  # one gap per token after each request's first message
    with pytest.raises(ValueError):
        aggregate(ok, duration=0)


def test_token_timeline_conserves_tokens():
    rng = random.Random(3)
    records = [RequestRecord(start=rng.uniform(0, 5), e2e=1.0,
                             events=sorted((rng.uniform(0, 3), rng.randrange(1, 4)) for _ in range(6)))
               for _ in range(20)]
    for width in (0.25, 1.0, 2.0):
        timeline = token_timeline(records, width)
        assert sum(rate * width for _, rate in timeline) == pytest.approx(sum(r.output_tokens for r in records))
        assert [t for t, _ in timeline] == pytest.approx([i * width for i in range(len(timeline))])


def test_ecdf():
    xs, ys = ecdf([3.0, 1.0, 2.0, 2.0])
    assert xs == [1.0, 2.0, 2.0, 3.0] and ys == [0.25, 0.5, 0.75, 1.0]
