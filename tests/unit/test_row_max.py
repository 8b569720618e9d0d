"""Greedy decoding's row maximum on the native pass (row_max.cpp) against torch.max(dim=-1), the
oracle: the same maxima and indices on rows full of ties (the first of equal maxima), rows holding
NaN or infinities, float32 and bfloat16, SmolLM2's vocabulary width and odd ones, strided rows. The
row statistics (top values, log-sum-exp) against topk and a float64 logsumexp, and the step's one
scan of every row against each row's own passes, bit for bit."""

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


class _MaxOnly:
    """The scan asked for the maxima alone, called as row_max is."""

    def __init__(self, rows: RM._NativeRows):
        self.applies = rows.applies
        self._rows = rows

    def __call__(self, logits):
        return self._rows.scan(logits)[:2]


@pytest.fixture(scope="module")
def avx2_lib(tmp_path_factory):
    """row_max.cpp built for x86-64-v3 (AVX2, no AVX-512), once for the module; None without AVX2 here."""
    if "avx2" not in open("/proc/cpuinfo").read():
        return None
    built, why = native.build(tmp_path_factory.mktemp("row-max-avx2"), march="x86-64-v3",
                              sources=[native.CSRC / "row_max.cpp"])
    assert built is not None, why
    return built


@pytest.fixture(scope="module")
def native_row_max(lib):
    return _MaxOnly(RM._NativeRows(lib))


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


# ---- first_max: torch's blocked pass where the native one does not run (a GPU-shaped host, or no library) ----


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [49152, 49155, 262144, 700, 511, 7, 1])
def test_first_max_matches_torch_max_with_ties_nan_and_infinities(dtype, vocab):
    g = torch.Generator().manual_seed(vocab)
    check(RM.first_max, (torch.randn(40, vocab, generator=g) * 3).round().to(dtype))  # integers: many tied maxima
    check(RM.first_max, (torch.randn(40, vocab, generator=g) * 10).to(dtype))
    logits = torch.randn(12, vocab, generator=g).to(dtype)
    logits[0, vocab // 2] = float("nan")  # NaN wins, at its index
    logits[1, 0] = float("nan")
    logits[1, vocab - 1] = float("nan")
    logits[2] = float("-inf")  # nothing allowed: -inf at index 0
    logits[3, vocab - 1] = float("inf")  # in the last (maybe partial) block
    logits[4, max(0, vocab - RM.MAX_BLOCK - 1)] = 99.0  # just before the last block's window ...
    logits[4, vocab - 1] = 99.0  # ... and a tie inside it: the first one wins
    logits[5, :] = 1.0  # one value throughout: index 0
    logits[6, vocab - 1] = 50.0  # the maximum in the partial tail alone
    logits[7, -min(vocab, RM.MAX_BLOCK + 3):] = 60.0  # a tail and the block before it tied
    check(RM.first_max, logits)


def test_first_max_of_strided_rows_and_as_the_sampler_calls_it():
    wide = torch.randn(6, 49200)
    check(RM.first_max, wide[:, :49152])  # rows 49,200 apart
    check(RM.first_max, wide[:, ::2])  # elements apart: torch's max serves it
    check(RM.first_max, wide[2:3])  # one row: torch's max too
    with torch.inference_mode():  # the model's logits are inference tensors
        logits = torch.randn(5, 49152)
    check(RM.first_max, logits)
    check(lambda x: RM.row_scan(x, {})[:2], logits)


# ---- a row's log-sum-exp, top values and a draw (the sampler's logprobs and filters) -------------------

class _StatsOnly:
    """The scan asked for the same (t, n, lse) of every row and no maxima, as row_stats asks it."""

    def __init__(self, rows: RM._NativeRows):
        self._rows = rows
        self.draw = rows.draw

    def stats(self, rows, t, n, lse=True):
        R = rows.shape[0]
        return self._rows.scan(rows, False, [t] * R, [n] * R, [lse] * R)[2:]


@pytest.fixture(scope="module")
def native_stats(lib):
    return _StatsOnly(RM._NativeRows(lib))


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_scan_of_a_step_gives_what_each_row_pass_gives(lib, native_kernels_dir, dtype):
    """A step's rows asking different things of one scan (greedy, top-k without the sum, logprobs at t = 1,
    top-p's first top at a temperature, the sum alone, min-p's best) get the bits their own passes give, and
    the maxima row_max gives; on peaked rows (most of the row far below its maximum, whose terms the sum
    passes over), flat ones, ties, a NaN and rows of -inf."""
    rows_lib = RM._NativeRows(lib)
    g = torch.Generator().manual_seed(11)
    V = 262144
    asks = [None, (1.25, 50, False), (1.0, 5, True), (1 / 0.7, 256, True), (2.0, 0, True), (1.1, 1, True), None,
            (1.0, 20, True)]
    logits = torch.randn(len(asks), V, generator=g)
    logits[:4, 1234] = 30.0  # peaked
    logits[4] = (logits[4] * 2).round()  # ties
    logits[5, :V // 2] = float("-inf")
    logits[6, 777] = float("nan")
    logits[7] = float("-inf")
    logits[7, [5, 9]] = torch.tensor([1.0, 2.0])
    logits = logits.to(dtype)
    t, n, lse = ([a[k] if a else d for a in asks] for k, d in ((0, 1.0), (1, 0), (2, False)))
    got_max, got_index, got_lse, vals, idx = rows_lib.scan(logits, True, t, n, lse)
    want_max, want_index = logits.max(dim=-1)
    assert torch.equal(got_index, want_index)
    assert torch.equal(got_max[:6], want_max[:6].float()) and torch.isnan(got_max[6])
    for r, a in enumerate(asks):
        if a is None:
            continue
        one_lse, one_vals, one_idx = rows_lib.scan(logits[r:r + 1], False, [a[0]], [a[1]], [a[2]])[2:]
        assert torch.equal(vals[r, :a[1]], one_vals[0]) and torch.equal(idx[r, :a[1]], one_idx[0])
        if a[2]:
            assert got_lse[r].item() == one_lse[0].item()  # the same bits alone or in a step
            want = (logits[r].double() * a[0]).logsumexp(0).item()
            assert got_lse[r].item() == pytest.approx(want, rel=4e-6, abs=1e-5)  # float32 sums of 262k terms
    assert torch.equal(vals[1, :50], logits[1].float().topk(50).values)
    native.load(native_kernels_dir)  # as a CPU server has it: the sampler's row_scan takes the library
    s_max, s_index, s_first = RM.row_scan(logits, {r: a for r, a in enumerate(asks) if a})
    assert torch.equal(s_index, got_index) and set(s_first) == {r for r, a in enumerate(asks) if a}
    for r, (s_lse, s_vals, s_idx) in s_first.items():
        assert torch.equal(s_vals[0], vals[r, :asks[r][1]]) and torch.equal(s_idx[0], idx[r, :asks[r][1]])
        assert (s_lse is None) == (not asks[r][2]) and (s_lse is None or s_lse[0].item() == got_lse[r].item())


@pytest.mark.parametrize("march", ["native -DLMSERVE_SCAN_ONE_BLOCK", "x86-64-v3"])
def test_the_scans_shortcuts_and_the_avx2_build_give_the_same_bits(lib, avx2_lib, tmp_path_factory, march):
    """The scan's shortcuts (a row at t = 1 skips its products by t; the log-sum-exp's loop tests two blocks at
    a time for a new maximum or a value above the top's floor, and finds a NaN through the sums) against the
    scan built without them, and the AVX2 build (no AVX-512: another NaN gathering, two tests per pair of
    blocks) against this CPU's: the same maxima, indices, top values and log-sum-exp bits on rows of every
    kind (peaked, flat, tied, wide, -inf prefixes and masks, NaN and +inf early and deep, odd widths)."""
    if march == "x86-64-v3":
        if avx2_lib is None:
            pytest.skip("no AVX2 here")
        other = avx2_lib
    else:
        other, why = native.build(tmp_path_factory.mktemp("scan-variant"), march=march,
                                  sources=[native.CSRC / "row_max.cpp"])
        assert other is not None, why
    mine, theirs = RM._NativeRows(lib), RM._NativeRows(other)
    g = torch.Generator().manual_seed(21)
    asks = [(1.0, 5, True), (1.0, 0, True), (1.0, 20, False), (1.25, 50, False), (1 / 0.7, 256, True),
            (2.0, 0, True), (1.1, 1, True), (1.0, 1, True)]
    for V in (262144, 49152, 49155, 40, 17):
        rows = torch.randn(13, V, generator=g)
        rows[0, V // 3] = 30.0  # peaked
        rows[1] = (rows[1] * 2).round()  # ties
        rows[2, : V // 2] = float("-inf")  # every lane empty for a while
        rows[3, 5 % V] = float("nan")
        rows[4] = float("-inf")
        rows[4, [1 % V, (V - 1)]] = torch.tensor([1.0, 2.0])
        rows[5, 11 % V] = float("inf")
        rows[6] *= 40  # wide: terms clamped at e^-87
        rows[7, -1] = 50.0  # the maximum in the last block
        rows[8, : V - 3] = float("-inf")  # only the tail
        rows[10, V - 19] = float("nan")  # deep, where the sums find it
        rows[11, V // 2 + 1] = float("inf")
        rows[12, [V // 3, V - 2]] = float("nan")
        for dtype in (torch.float32, torch.bfloat16):
            x = rows.to(dtype)
            for t, n, lse in asks:
                n = min(n, V)
                R = x.shape[0]
                a = mine.scan(x, True, [t] * R, [n] * R, [lse] * R)
                b = theirs.scan(x, True, [t] * R, [n] * R, [lse] * R)
                ok = [r for r in range(R) if r not in (3, 10, 12)]  # a NaN row's top values are meaningless
                assert torch.equal(a[1], b[1]) and a[0].view(torch.int32).equal(b[0].view(torch.int32)), (V, t, n)
                assert torch.equal(a[3][ok], b[3][ok]) and torch.equal(a[4][ok], b[4][ok]), (V, t, n)
                if lse:
                    assert a[2].view(torch.int32).equal(b[2].view(torch.int32)), (V, t, n, a[2], b[2])


def test_rows_max_reads_the_chosen_rows_in_place(lib, native_kernels_dir):
    """A constrained step's masked rows: their maxima and first indices as logits[rows].max(dim=-1) gives
    them, for rows in a run, scattered, alone, in either dtype, with ties and a NaN."""
    native.load(native_kernels_dir)  # as a CPU server has it
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(7, 49155, generator=g) * 3).round()
    logits[5, 77] = float("nan")
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        for rows in ([2, 3, 4], [0, 5, 6], [6], [4, 1]):
            got_v, got_i = RM.rows_max(x, rows)
            want_v, want_i = x[rows].max(dim=-1)
            assert torch.equal(got_i, want_i), rows
            assert [(math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(got_v.tolist(), want_v.float().tolist())] == [True] * len(rows)


def _masked_case(V: int, W: int, seed: int, dtype):
    """Rows full of ties, a NaN allowed and one not, a row of -inf; bitmasks with words of none, of all,
    a single id, and a row allowing nothing."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(6, V, generator=g) * 3).round()
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (5, W), generator=g, dtype=torch.int64).to(torch.int32)
    bits[0, 0] = -1
    bits[0, W - 1] = 0
    bits[1] = 0
    bits[1, W - 1] = 1 << 5  # one id, in the last word (past the row when V < 32 W - 26)
    bits[2] = 0  # nothing allowed: -inf at index 0
    bits[3, 0] = 1 << 2  # a NaN allowed at id 2, another one not at id 3
    logits[1, 2], logits[1, 3] = float("nan"), float("nan")
    bits[4, 0] = ~(1 << 4)  # a NaN not allowed: no NaN
    logits[5, 4] = float("nan")
    logits[0] = float("-inf")
    return logits.to(dtype), [3, 1, 0, 1, 5], bits


def _masked_reference(logits: torch.Tensor, rows: list[int], bits: torch.Tensor):
    """The rows masked id by id (allowed iff inside the bitmask and its bit set), then torch's max."""
    out = logits[rows].clone()
    for r, word_row in enumerate(bits.tolist()):
        for t in range(logits.shape[1]):
            if t >= 32 * bits.shape[1] or not (word_row[t // 32] >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out.max(dim=-1)


@pytest.mark.parametrize("V,W", [(7, 1), (70, 3), (96, 3), (100, 3), (1000, 32), (1000, 30), (4133, 130)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_rows_max_is_the_max_of_the_masked_rows(lib, avx2_lib, V, W, dtype):
    """The masked maxima (nothing written) against the rows masked by the per-id rule, then torch.max: the
    same values and first indices, a row with nothing allowed -inf at 0, an allowed NaN wins and a
    disallowed one does not count; in this CPU's build and the one without AVX-512."""
    libs = [lib] + ([avx2_lib] if avx2_lib is not None else [])
    logits, rows, bits = _masked_case(V, W, V * W, dtype)
    before = logits.clone()
    want_v, want_i = _masked_reference(logits, rows, bits)
    for one in libs:
        got_v, got_i = RM._NativeRows(one).masked_max(logits, rows, bits)
        assert torch.equal(got_i, want_i), (V, W)
        assert [(math.isnan(a) and math.isnan(b)) or a == b
                for a, b in zip(got_v.tolist(), want_v.float().tolist())] == [True] * len(rows), (V, W)
    assert torch.equal(logits.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       before.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))  # nothing written


def test_masked_rows_max_reads_strided_rows_and_says_when_it_cannot(lib, native_kernels_dir, monkeypatch):
    native.load(native_kernels_dir)  # as a CPU server has it
    wide = torch.randn(4, 49200)
    view = wide[:, :49155]  # rows 49,200 apart, the last word partial
    g = torch.Generator().manual_seed(9)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (2, 1537), generator=g, dtype=torch.int64).to(torch.int32)
    got_v, got_i = RM.masked_rows_max(view, [3, 1], bits)
    want_v, want_i = _masked_reference(view, [3, 1], bits)
    assert torch.equal(got_i, want_i) and torch.equal(got_v, want_v)
    assert RM.masked_rows_max(torch.randn(2, 40).half(), [0], bits[:1, :2]) is None  # float16: the caller masks
    monkeypatch.setattr(native, "_BOUND", {})
    monkeypatch.setattr(native, "_LOADED", {})
    assert RM.masked_rows_max(view, [3, 1], bits) is None  # no native library: the caller masks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_steps_maxima_are_the_same_by_either_pass_the_machine_chooses(lib, native_kernels_dir, monkeypatch, dtype):
    """row_scan without asks takes first_max or the native scan, whichever this machine timed faster
    (_MAX_CHOICE): the same maxima (float32), indices and ties either way, and the choice is timed once per
    dtype and width, at a step of at least MEASURE_ROWS rows."""
    native.load(native_kernels_dir)
    g = torch.Generator().manual_seed(9)
    logits = ((torch.randn(12, 49155, generator=g) * 3).round()).to(dtype)
    logits[3, 500] = float("nan")
    got = {}
    for blocked in (False, True):
        monkeypatch.setattr(RM, "_MAX_CHOICE", {(dtype, 49155): blocked})
        m, i, stats = RM.row_scan(logits, {})
        assert m.dtype == torch.float32 and stats == {}
        got[blocked] = (m, i)
    want = logits.float().max(dim=-1)
    for m, i in got.values():
        assert torch.equal(i, want.indices) and torch.equal(m.nan_to_num(), want.values.nan_to_num())
    monkeypatch.setattr(RM, "_MAX_CHOICE", {})
    RM.row_scan(logits[: RM.MEASURE_ROWS - 1], {})
    assert RM._MAX_CHOICE == {}  # too few rows to time
    RM.row_scan(logits, {})
    assert set(RM._MAX_CHOICE) == {(dtype, 49155)}
