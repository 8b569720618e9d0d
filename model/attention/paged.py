"""Paged, varlen attention in one call per layer: every query token of a step, over a page pool.

The contract (`paged_attention`):

- q [T, H, d]: every query token of the call, decode rows and prompt chunks alike, back to back
  (ragged: no padding to the longest);
- k_pool, v_pool [num_pages, page_tokens, Hkv, d]: one layer's pages;
- block_table [rows, max_pages]: row r's page ids, in position order (position p of row r lies at
  slot p % page_tokens of page block_table[r, p // page_tokens]);
- rows, positions [T]: each token's row of the block table and its own position: it attends to
  keys 0..position of that row, or in a sliding layer (window w > 0) to keys position - w + 1 .. position;
- scale of the scores (None: 1 / sqrt(d)); grouped-query heads (H a multiple of Hkv).

Every key a token sees must already be in the pool (its own included: the step attention writes
first). Returns [T, H, d].

Two implementations of that contract:

- a Triton kernel (`_paged_kernel`), on CUDA compiled, on CPU run by Triton's interpreter (slow:
  tests and tiny models only);
- `paged_attention_reference`: plain torch, each token's keys gathered from its pages and the
  softmax written out; the oracle, and what serves where Triton is missing.

Batch invariance by construction: a program of the kernel takes one *tile* (up to BLOCK_M
consecutive tokens of one row) and one KV head with its query heads, and walks that row's keys one
page (BLOCK_N = page_tokens keys) at a time, in position order, with an online softmax in float32.
BLOCK_M is fixed by the head shape alone (BLOCK_M * group >= 16, what tensor cores need), never by
the batch: a token's output comes from the same operations whatever else the call holds. A tile
visits the key blocks its lowest-window token starts in up to its last token's; for any one token
the blocks outside its keys are fully masked and leave its running max, sum and accumulator exactly
as they were, so the tile a token shares (a chunk cut elsewhere, a decode row alone) changes no bit.
No split of the keys, no reduction across programs.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

import torch
from torch import Tensor

# triton: an optional dependency (the dev extra installs it; CUDA builds of torch ship it), imported on
# the kernel's first call (_kernel_for), not with this module: a CPU server never pays for it
triton = None
tl = None
_MAX = _SUM = None

MIN_DOT = 16  # the smallest M, N, K tl.dot takes on a GPU


def triton_available() -> bool:
    """Whether triton is installed (the kernel can run)."""
    return importlib.util.find_spec("triton") is not None


def tile_rows(heads: int, kv_heads: int) -> tuple[int, int]:
    """(BLOCK_M, GROUP): tokens per tile and query heads per KV head padded to a power of two, so that
    a tile's rows (BLOCK_M * GROUP) are at least 16. Depends on the head shape only."""
    group = triton_next_pow2(heads // kv_heads)
    return max(1, MIN_DOT // group), group


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class Tiles:
    """A call's query tiles: tile i holds tokens first[i] .. first[i] + count[i] - 1 (one row each)."""

    first: Tensor  # [n] int32
    count: Tensor  # [n] int32

    @staticmethod
    def of_runs(lengths: list[int], block_m: int, device: torch.device | str) -> "Tiles":
        """Tiles over runs of consecutive tokens of one row each (a prompt chunk, or a decode row of
        length 1), back to back from token 0; each run cut into tiles of block_m from its start."""
        first, count, t = [], [], 0
        for n in lengths:
            for s in range(0, n, block_m):
                first.append(t + s)
                count.append(min(block_m, n - s))
            t += n
        return Tiles(host_to_device(first, torch.int32, device), host_to_device(count, torch.int32, device))

    @staticmethod
    def single(tokens: int, device: torch.device | str) -> "Tiles":
        """One tile per token (decode rows): built by tensor ops alone (CUDA graphs)."""
        return Tiles(torch.arange(tokens, dtype=torch.int32, device=device),
                     torch.ones(tokens, dtype=torch.int32, device=device))


def host_to_device(values: list[int], dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """A host list as a tensor on `device`; to a GPU from pinned memory without blocking (a step's inputs
    must not wait for the step before it)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, device=device)


def paged_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_table: Tensor, rows: Tensor, positions: Tensor,
                    tiles: Tiles | None = None, window: int = 0, scale: float | None = None) -> Tensor:
    """The module's contract (see above) through the Triton kernel. `tiles`: the query tiles, each of
    consecutive tokens of one row (None: one per token). q's rows may be strided; the pools, the block
    table, rows and positions are read as they are (contiguous on their last dimension)."""
    if not triton_available():
        raise RuntimeError("paged attention's kernel needs triton (pip install triton); "
                           "paged_attention_reference serves without it")
    T, H, d = q.shape
    P, page_tokens, Hkv, dk = k_pool.shape
    if dk != d or H % Hkv:
        raise ValueError(f"paged attention: q has {H} heads of {d}, the pool {Hkv} of {dk}")
    block_m, group = tile_rows(H, Hkv)
    if tiles is None:
        tiles = Tiles.single(T, q.device)
    out = torch.empty(T, H, d, dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    # the kernel reads these through raw offsets: one element apart (an expanded slot is not)
    rows, positions = rows.contiguous(), positions.contiguous()
    if block_table.stride(1) != 1 or k_pool.stride(3) != 1 or v_pool.stride(3) != 1:
        raise ValueError("paged attention reads the block table's rows and the pools' head rows contiguously")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    n_tiles = tiles.first.shape[0]
    f32 = q.dtype == torch.float32 or q.device.type == "cpu"  # 16-bit dots on a GPU's tensor cores only
    kernel = _kernel_for(q.device)
    kernel[(n_tiles, Hkv)](
        q, k_pool, v_pool, out, block_table, rows, positions, tiles.first, tiles.count,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), out.stride(0), out.stride(1), block_table.stride(0),
        scale * 1.4426950408889634, window,
        H // Hkv, d, BLOCK_M=block_m, GROUP=group, BLOCK_N=page_tokens,
        BLOCK_D=max(MIN_DOT, triton_next_pow2(d)), PAGE=page_tokens,
        PRECISION="ieee" if f32 else "tf32",  # float32 in full (no TF32 rounding); ignored for 16-bit inputs
        F32=f32,
    )
    return out


def paged_attention_reference(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_table: Tensor, rows: Tensor,
                              positions: Tensor, tiles: Tiles | None = None, window: int = 0,
                              scale: float | None = None) -> Tensor:
    """The same contract in plain torch: each token's keys gathered from its pages, the softmax written
    out in float32, one token at a time (so each token's result is its own: batch-invariant too).
    `tiles` is accepted for the kernel's signature and not needed."""
    T, H, d = q.shape
    page_tokens, Hkv = k_pool.shape[1], k_pool.shape[2]
    G = H // Hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty(T, H, d, dtype=q.dtype, device=q.device)
    for t, (r, p) in enumerate(zip(rows.tolist(), positions.tolist())):
        lo = max(0, p - window + 1) if window else 0
        pages = block_table[r, : p // page_tokens + 1].long()  # [n]
        k = k_pool[pages].reshape(-1, Hkv, d)[lo: p + 1].float()  # [S, Hkv, d]
        v = v_pool[pages].reshape(-1, Hkv, d)[lo: p + 1].float()
        qt = q[t].float().view(Hkv, G, d)  # head h = kv * G + g
        scores = torch.einsum("kgd,skd->kgs", qt, k) * scale  # [Hkv, G, S]
        w = torch.softmax(scores, dim=-1)
        out[t] = torch.einsum("kgs,skd->kgd", w, v).reshape(H, d).to(q.dtype)
    return out


# ---- the kernel ----------------------------------------------------------------------------------

def _paged_kernel(q_ptr, k_ptr, v_ptr, o_ptr, table_ptr, rows_ptr, pos_ptr, tile_first_ptr, tile_count_ptr,
                  stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                  stride_ot, stride_oh, stride_table, qk_scale, window,
                  G, D, BLOCK_M: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, PAGE: tl.constexpr, PRECISION: tl.constexpr, F32: tl.constexpr):
    """One program: one tile (up to BLOCK_M tokens of one row) x one KV head and its G query heads.
    Rows of the program's matrices: r = token-in-tile * GROUP + head-in-group."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    first = tl.load(tile_first_ptr + tile)
    count = tl.load(tile_count_ptr + tile)
    R: tl.constexpr = BLOCK_M * GROUP
    r = tl.arange(0, R)
    m = r // GROUP
    g = r % GROUP
    row_ok = (m < count) & (g < G)
    token = first + m
    head = kvh * G + g
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < D
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dd[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [R, BLOCK_D]
    if F32:  # products in float32 (Triton's interpreter multiplies 16-bit floats as their bits)
        q = q.to(tl.float32)
    pos = tl.load(pos_ptr + token, mask=row_ok, other=-1)  # [R]
    seq = tl.load(rows_ptr + first)
    last = tl.load(pos_ptr + first + count - 1)  # tokens of a tile are consecutive: the last is the highest
    # a sliding layer starts at the block holding the tile's first window start (blocks start on
    # absolute multiples of BLOCK_N, whatever the tile)
    lo = tl.maximum(tl.load(pos_ptr + first) - window + 1, 0)
    lo = tl.where(window > 0, (lo // BLOCK_N) * BLOCK_N, 0)
    m_i = tl.full([R], -1.0e30, dtype=tl.float32)  # finite: a fully masked block leaves it exactly as it was
    l_i = tl.full([R], 0.0, dtype=tl.float32)
    acc = tl.full([R, BLOCK_D], 0.0, dtype=tl.float32)
    n = tl.arange(0, BLOCK_N)
    for start in range(lo, last + 1, BLOCK_N):
        key = start + n  # [BLOCK_N] absolute key positions
        page = tl.load(table_ptr + seq * stride_table + start // PAGE).to(tl.int64)  # pools past 2**31 elements
        slot = key % PAGE
        key_ok = key <= last
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + page * stride_kp + slot[:, None] * stride_ks + kvh * stride_kh + dd[None, :],
                    mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptr + page * stride_vp + slot[:, None] * stride_vs + kvh * stride_vh + dd[None, :],
                    mask=kv_mask, other=0.0)
        if F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION, out_dtype=tl.float32) * qk_scale  # [R, BLOCK_N]
        see = (key[None, :] <= pos[:, None]) & row_ok[:, None]
        see = see & ((key[None, :] > pos[:, None] - window) | (window <= 0))
        s = tl.where(see, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION, out_dtype=tl.float32)
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # padding rows saw nothing: 0, never stored
    tl.store(o_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dd[None, :],
             o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


_KERNELS: dict[str, object] = {}


def _import_triton() -> None:
    """triton and triton.language as this module's globals (the kernel's body reads them there), and
    tl.max / tl.sum's own combine functions for tl.reduce: the builtin runs in Triton's interpreter
    whether or not TRITON_INTERPRET was set when triton was imported (tl.max and tl.sum are jit
    functions of their own, callable there only in that case), and compiles to the same reduction on a GPU."""
    global triton, tl, _MAX, _SUM
    if tl is None:
        import triton as _triton
        import triton.language as _tl

        triton, tl = _triton, _tl
        _MAX, _SUM = _tl.standard._elementwise_max, _tl.standard._sum_combine


def _kernel_for(device: torch.device):
    """The kernel for tensors on `device`: compiled (triton.jit) on a GPU, Triton's interpreter on the
    CPU (whatever TRITON_INTERPRET says: the same Python function, run by numpy)."""
    kind = "cpu" if device.type == "cpu" else "gpu"
    if kind not in _KERNELS:
        _import_triton()
        if kind == "cpu":
            from triton.runtime.interpreter import InterpretedFunction

            _KERNELS[kind] = InterpretedFunction(_paged_kernel)
        else:
            # one compiled kernel whatever the window (Triton would specialize a window of 1 as a constant)
            _KERNELS[kind] = triton.jit(_paged_kernel, do_not_specialize=["window"])
    return _KERNELS[kind]


__all__ = ["Tiles", "paged_attention", "paged_attention_reference", "tile_rows", "triton_available"]
