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
def native_row_max(native_kernels_dir):
    lib, why = native.build(native_kernels_dir)
    if lib is None:
        pytest.skip(why)
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
