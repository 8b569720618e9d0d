"""Greedy decoding's row maximum on the native pass (row_max.cpp) against torch.max(dim=-1), the
oracle: the same maxima and indices on rows full of ties (the first of equal maxima), rows holding
NaN or infinities, float32 and bfloat16, SmolLM2's vocabulary width and odd ones, strided rows."""

from __future__ import annotations

import math

import pytest
import torch

from lmserve.model.native import build as native
from lmserve.server.engine import row_max as RM


@pytest.fixture(scope="module")
def lib(native_kernels_dir):
    lib, why = native.build(native_kernels_dir)
    if lib is None:
        pytest.skip(why)
    return lib


@pytest.fixture(scope="module")
def native_row_max(lib):
    return RM._NativeRowMax(lib)


def check(fn, logits):
    want_v, want_i = logits.max(dim=-1)
    got_v, got_i = fn(logits)
    assert torch.equal(got_i, want_i)
    for g, w in zip(got_v.tolist(), want_v.float().tolist()):
        assert (math.isnan(g) and math.isnan(w)) or g == w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [49152, 49155, 7, 16, 1])
def test_matches_torch_max_with_ties(native_row_max, dtype, vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(40, vocab, generator=g) * 3).round().to(dtype)  # integers: many tied maxima
    check(native_row_max, logits)
    check(native_row_max, (torch.randn(40, vocab, generator=g) * 10).to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nan_and_infinite_rows(native_row_max, dtype):
    V = 49152
    logits = torch.randn(8, V).to(dtype)
    logits[0, 30000] = float("nan")  # NaN wins, at its index
    logits[1, 3] = float("nan")  # in the first vector
    logits[1, 40000] = float("nan")
    logits[2] = float("-inf")  # nothing allowed (a constrained row): -inf at index 0
    logits[3, 12345] = float("inf")
    logits[4, 49151] = float("nan")  # the last id
    logits[5, 100:200] = float("-inf")
    check(native_row_max, logits)
    v, _ = native_row_max(logits)
    assert math.isnan(v[0]) and math.isnan(v[1]) and v[2] == float("-inf")


def test_strided_rows_and_the_fallback(native_row_max):
    wide = torch.randn(6, 49200).bfloat16()
    view = wide[:, :49152]  # rows 49,200 apart
    assert native_row_max.applies(view)
    check(native_row_max, view)
    assert not native_row_max.applies(torch.randn(3, 10).half())  # float16: torch's max serves it
    check(RM.row_max, torch.randn(3, 10).half())


# ---- a row's log-sum-exp, top values and a draw (the sampler's logprobs and filters) -------------------

@pytest.fixture(scope="module")
def native_stats(lib):
    return RM._NativeRowStats(lib)


@pytest.mark.parametrize("vocab", [262144, 49152, 49155, 17, 5])
@pytest.mark.parametrize("t", [1.0, 1 / 0.7])
def test_row_stats_match_logsumexp_and_topk(native_stats, vocab, t):
    g = torch.Generator().manual_seed(vocab)
    rows = torch.randn(6, vocab, generator=g) * 4
    rows[1, -1] = 30.0  # the best in the tail
    n = min(vocab, 20)
    lse, vals, idx = native_stats.stats(rows, t, n)
    want_vals, want_idx = rows.topk(n, dim=-1)
    assert torch.equal(idx, want_idx) and torch.equal(vals, want_vals)  # distinct values: one order
    torch.testing.assert_close(lse, (rows.double() * t).logsumexp(-1).float(), rtol=1e-6, atol=1e-5)
    assert torch.isnan(native_stats.stats(torch.tensor([[0.0, float("nan"), 1.0]]), 1.0, 1)[0]).all()


def test_row_stats_take_the_lower_index_of_equal_values(native_stats):
    row = torch.tensor([[1.0, 3.0, 2.0, 3.0, 3.0, 0.0] * 5])
    _, vals, idx = native_stats.stats(row, 1.0, 4)
    assert vals[0].tolist() == [3.0] * 4 and idx[0].tolist() == [1, 3, 4, 7]


def test_row_draw_follows_softmax(native_stats):
    """Draws at evenly spaced u land on each id in proportion to softmax(t * row), with the same index the
    float64 cumulative sum gives."""
    g = torch.Generator().manual_seed(3)
    row, t = torch.randn(1000, generator=g) * 2, 1.3
    lse = float((row.double() * t).logsumexp(0))
    cdf = (row.double() * t - lse).exp().cumsum(0)
    for u in torch.linspace(0.0005, 0.9995, 400).tolist():
        got = native_stats.draw(row, t, lse, u)
        want = int(torch.searchsorted(cdf, torch.tensor(u, dtype=torch.float64), right=True))
        assert abs(cdf[got].item() - cdf[want].item()) < 1e-5  # the same id up to float32 rounding of the terms
    assert native_stats.draw(row, t, lse, 0.999999999) >= 0


def test_row_stats_of_a_masked_row_with_fewer_values_than_asked(native_stats):
    """A constrained row may allow fewer tokens than the top it is asked for: the rest come as -inf, at real ids."""
    row = torch.full((1, 1000), float("-inf"))
    row[0, [7, 300, 999]] = torch.tensor([1.0, 3.0, 2.0])
    lse, vals, idx = native_stats.stats(row, 1.0, 5)
    assert vals[0, :3].tolist() == [3.0, 2.0, 1.0] and idx[0, :3].tolist() == [300, 999, 7]
    assert vals[0, 3:].tolist() == [float("-inf")] * 2 and ((0 <= idx[0]) & (idx[0] < 1000)).all()
    assert lse.item() == pytest.approx(math.log(math.exp(1) + math.exp(2) + math.exp(3)), rel=1e-6)


def test_row_stats_read_bfloat16_rows_in_place(native_stats):
    g = torch.Generator().manual_seed(9)
    rows = (torch.randn(3, 262144, generator=g) * 4).bfloat16()[:, ::1]
    lse, vals, idx = native_stats.stats(rows, 1.0, 8)
    wide = rows.float()
    want_vals, _ = wide.topk(8, dim=-1)
    assert torch.equal(vals, want_vals) and torch.equal(wide.gather(1, idx), vals)  # bf16 has ties: values, ids
    torch.testing.assert_close(lse, wide.double().logsumexp(-1).float(), rtol=1e-6, atol=1e-5)
