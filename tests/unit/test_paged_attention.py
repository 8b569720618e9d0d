"""Paged varlen attention (model/attention/paged.py) against the explicit attention, and its batch invariance.

The Triton kernel runs here in Triton's interpreter (CPU, numpy): shapes stay tiny. Each case builds
sequences whose keys live in a page pool under shuffled, non-contiguous page ids, queries some of their
last tokens (a decode row: 1; a prompt chunk: several) in one call, and compares every token with the
explicit softmax over exactly the keys it may see (tests/oracles.py), gathered densely.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from torch.testing import assert_close

from lmserve.model.attention.paged import Tiles, paged_attention, paged_attention_reference, tile_rows, triton_available
from oracles import explicit_attention

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed (pip install -e .[dev]): "
                                                               "the paged kernel cannot run")
TOL = dict(rtol=2e-5, atol=2e-5)


@dataclass
class Case:
    """Sequences in a page pool and one call's queries: sequence i queries its last q_lens[i] positions."""

    q: torch.Tensor  # [T, H, d]
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    table: torch.Tensor  # [S, max_pages] int32
    rows: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    q_lens: list[int]
    keys: list[tuple[torch.Tensor, torch.Tensor]]  # each sequence's dense K, V [n, Hkv, d]

    def tiles(self) -> Tiles:
        H, Hkv = self.q.shape[1], self.k_pool.shape[2]
        return Tiles.of_runs(self.q_lens, tile_rows(H, Hkv)[0], "cpu")


def make_case(lengths: list[int], q_lens: list[int], heads: int, kv_heads: int, d: int = 16, page: int = 4,
              seed: int = 0, share: dict[int, tuple[int, int]] | None = None) -> Case:
    """share {i: (j, pages)}: sequence i's first `pages` pages are sequence j's (a prefix hit: same ids, same keys)."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    share = share or {}
    max_pages = max(-(-n // page) for n in lengths) + 1
    num_pages = sum(-(-n // page) for n in lengths) + 3
    ids = list(range(1, num_pages))  # page 0 stays unused: an unmapped entry points there
    rng.shuffle(ids)
    k_pool = torch.randn(num_pages, page, kv_heads, d, generator=g) * 9  # garbage in pages no one maps
    v_pool = torch.randn(num_pages, page, kv_heads, d, generator=g) * 9
    table = torch.zeros(len(lengths), max_pages, dtype=torch.int32)
    keys = []
    for i, n in enumerate(lengths):
        k = torch.randn(n, kv_heads, d, generator=g)
        v = torch.randn(n, kv_heads, d, generator=g)
        j, shared = share.get(i, (None, 0))
        for p in range(-(-n // page)):
            if p < shared:
                table[i, p] = table[j, p]
                k[p * page:(p + 1) * page] = keys[j][0][p * page:(p + 1) * page]
                v[p * page:(p + 1) * page] = keys[j][1][p * page:(p + 1) * page]
            else:
                table[i, p] = ids.pop()
            span = slice(p * page, min(n, (p + 1) * page))
            k_pool[table[i, p], : span.stop - span.start] = k[span]
            v_pool[table[i, p], : span.stop - span.start] = v[span]
        keys.append((k, v))
    rows = torch.tensor([i for i, m in enumerate(q_lens) for _ in range(m)])
    positions = torch.tensor([p for n, m in zip(lengths, q_lens) for p in range(n - m, n)])
    q = torch.randn(len(rows), heads, d, generator=g)
    return Case(q, k_pool, v_pool, table, rows, positions, q_lens, keys)


def explicit(case: Case, window: int = 0, scale: float | None = None) -> torch.Tensor:
    """Each sequence's queries against its dense keys with the explicit attention: [T, H, d]."""
    out, t = [], 0
    for (k, v), m in zip(case.keys, case.q_lens):
        n = k.shape[0]
        qpos = torch.arange(n - m, n)[:, None]  # [m, 1]
        key = torch.arange(n)[None, :]
        mask = (key <= qpos) & ((key > qpos - window) if window else True)  # [m, n]
        q = case.q[t: t + m].transpose(0, 1)[None]  # [1, H, m, d]
        o, _ = explicit_attention(q, k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask[None, None], scale)
        out.append(o[0].transpose(0, 1))  # [m, H, d]
        t += m
    return torch.cat(out)


def run(case: Case, window: int = 0, scale: float | None = None, kernel=paged_attention) -> torch.Tensor:
    return kernel(case.q, case.k_pool, case.v_pool, case.table, case.rows, case.positions, case.tiles(),
                  window=window, scale=scale)


# page 4: lengths at page - 1, page, page + 1, and longer; decode rows (1) and chunks in one call
LAYOUTS = {
    "ragged": ([3, 4, 5, 13, 9], [1, 4, 1, 6, 2]),
    "decode": ([1, 4, 8, 17], [1, 1, 1, 1]),
    "one-prompt": ([11], [11]),
}


@needs_triton
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 2), (8, 1)])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_kernel_equals_the_explicit_attention(heads, kv_heads, layout):
    lengths, q_lens = LAYOUTS[layout]
    case = make_case(lengths, q_lens, heads, kv_heads, seed=len(layout) + heads)
    assert_close(run(case), explicit(case), **TOL)


@needs_triton
@pytest.mark.parametrize("window", [1, 3, 4, 6])
def test_kernel_sliding_window_sees_exactly_its_last_keys(window):
    case = make_case([3, 9, 14, 5], [1, 5, 7, 5], 4, 2, seed=window)
    assert_close(run(case, window=window), explicit(case, window=window), **TOL)


@needs_triton
def test_kernel_scale_head_size_and_a_prefix_hit():
    # head size 24 (padded to 32 inside), a query scale of its own; sequences 1 and 2 share sequence 0's
    # first two pages (ids and keys), as after a prefix-cache hit
    case = make_case([10, 12, 9], [1, 4, 3], 4, 2, d=24, seed=3, share={1: (0, 2), 2: (0, 2)})
    assert int(case.table[1, 0]) == int(case.table[0, 0]) and int(case.table[2, 1]) == int(case.table[0, 1])
    assert_close(run(case, scale=0.3), explicit(case, scale=0.3), **TOL)


@pytest.mark.parametrize("window", [0, 3])
def test_reference_equals_the_explicit_attention(window):
    case = make_case([3, 4, 5, 13], [1, 4, 2, 6], 6, 2, seed=7)
    assert_close(run(case, window=window, kernel=paged_attention_reference), explicit(case, window=window), **TOL)


@needs_triton
@pytest.mark.parametrize("window", [0, 5])
def test_a_sequence_computes_the_same_bits_alone_and_in_a_batch(window):
    """Sequence 1 (a chunk of 7 tokens) alone, then among decode rows and other chunks, then cut into
    other chunks (tiles start elsewhere): every token's output is bitwise the same."""
    lengths, q_lens = [6, 19, 4, 9], [1, 7, 4, 2]
    batch = make_case(lengths, q_lens, 4, 1, seed=11)  # 4 query heads per KV head: tiles of 4 tokens
    together = run(batch, window)
    mine = slice(1, 8)  # sequence 1's tokens in the batch

    def alone(cuts: list[int]) -> torch.Tensor:
        # the same sequence (same pool and table) in calls of its own, its 7 queries cut into runs
        outs, first = [], 12
        for m in cuts:
            sub = Case(batch.q[mine][first - 12: first - 12 + m], batch.k_pool, batch.v_pool, batch.table,
                       torch.tensor([1]).expand(m), torch.arange(first, first + m), [m], [])  # an expanded row, as a chunk's
            outs.append(run(sub, window))
            first += m
        return torch.cat(outs)

    for cuts in ([7], [1, 6], [3, 3, 1], [1] * 7):
        assert torch.equal(alone(cuts), together[mine]), cuts


@needs_triton
def test_kernel_in_bfloat16_equals_the_reference():
    """A bfloat16 pool and queries (products in float32 here, as the interpreter cannot multiply 16-bit floats):
    within a bfloat16 rounding of the float32 reference over the same values."""
    case = make_case([3, 13, 9], [1, 6, 2], 4, 2, seed=13)
    bf = Case(case.q.bfloat16(), case.k_pool.bfloat16(), case.v_pool.bfloat16(), case.table, case.rows,
              case.positions, case.q_lens, [])
    got = run(bf).float()
    want = paged_attention_reference(bf.q.float(), bf.k_pool.float(), bf.v_pool.float(), case.table, case.rows,
                                     case.positions)
    assert got.dtype == torch.float32 and run(bf).dtype == torch.bfloat16
    assert_close(got, want, rtol=1e-2, atol=1e-2)


@needs_triton
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_kernel_compiles_for_a_hopper_gpu_without_one(dtype):
    """The compiled path (no interpreter) down to a cubin for sm_90 with the wheel's own ptxas: what a
    GPU would run, checked where none is (tl.dot shapes, 16-bit dots, the window's branchless masks)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lmserve.model.attention import paged

    paged._import_triton()
    fn = triton.jit(paged._paged_kernel, do_not_specialize=["window"])
    sig = {name: "*i64" if name in ("rows_ptr", "pos_ptr") else "*i32" for name in fn.arg_names if name.endswith("_ptr")}
    sig.update({name: f"*{dtype}" for name in ("q_ptr", "k_ptr", "v_ptr", "o_ptr")})
    sig.update({name: "i32" for name in fn.arg_names if name.startswith("stride_")})
    sig.update(qk_scale="fp32", window="i32", G="i32", D="i32")
    block_m, group = tile_rows(32, 8)  # the 1B shape: 32 query heads over 8 KV heads of 64
    f32 = dtype == "fp32"
    const = dict(BLOCK_M=block_m, GROUP=group, BLOCK_N=16, BLOCK_D=64, PAGE=16, PRECISION="ieee" if f32 else "tf32", F32=f32)
    sig.update(dict.fromkeys(const, "constexpr"))
    try:  # the ahead-of-time API of triton 3.9 (what the dev extra's lower bound may predate)
        src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
    except TypeError as exc:
        pytest.skip(f"triton {triton.__version__}'s ASTSource differs from 3.9's: {exc}")
    try:
        out = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    except RuntimeError as exc:  # pragma: no cover - a wheel without the NVIDIA backend's tools
        if "ptxas" in str(exc):
            pytest.skip(f"this triton cannot assemble for CUDA here: {exc}")
        raise
    assert out.asm["cubin"]
    if not f32:  # the 16-bit dots reach the tensor cores
        assert "mma" in out.asm["ptx"]
