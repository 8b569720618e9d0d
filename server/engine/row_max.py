"""What the sampler reads of each logits row: its maximum and the first index holding it (greedy
decoding's whole answer), and for the rows that ask, its top values and log-sum-exp.

torch.max(dim=-1) over SmolLM2's 49,152-wide bfloat16 rows took ~60 us for one row and ~1.3 ms for
32 on a 2-core Xeon; with the model's native library loaded (CPU), row_max.cpp reads each row once
instead, and one call serves a whole step (row_scan): the maxima of every row and what a sampled or
logprobs row asks of it. Both give the same values and indices: the first of equal maxima, and NaN
(with the first NaN's index) for a row that holds one.
"""

from __future__ import annotations

import ctypes
import time

import torch
from torch import Tensor

from lmserve.model.native import build as native_lib


class _NativeRows:
    """row_max.cpp's passes: lm_row_scan (every row of a step in one call) and lm_row_draw."""

    def __init__(self, lib):
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        self._scan = {torch.float32: lib.lm_row_scan_f32, torch.bfloat16: lib.lm_row_scan_bf16}
        for fn in self._scan.values():
            fn.argtypes, fn.restype = [p, i64, i32, i32, p, p, p, i32, p, p, p, p, p, i32], i32
        self._draw = lib.lm_row_draw_f32
        self._draw.argtypes, self._draw.restype = [p, i32, f32, f32, ctypes.c_double], i64
        self._masked = {torch.float32: lib.lm_masked_row_max_f32, torch.bfloat16: lib.lm_masked_row_max_bf16}
        for fn in self._masked.values():
            fn.argtypes, fn.restype = [p, i64, p, p, i32, i32, i32, p, p, i32], i32

    def applies(self, rows: Tensor) -> bool:
        return (rows.device.type == "cpu" and rows.dtype in self._scan and rows.dim() == 2
                and rows.stride(1) == 1 and rows.shape[1] > 0)

    def scan(self, rows: Tensor, maxima: bool = True, t: list[float] | None = None, n: list[int] | None = None,
             lse: list[bool] | None = None) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor, Tensor]:
        """rows [R, V] -> (maxima [R], first indices [R]) when asked, then log-sum-exps [R] (rows whose `lse`
        is false: not written), top values [R, max(n)] and their indices (a row's first n[r] written):
        per row r at inverse temperature t[r]."""
        R, k = rows.shape[0], max(n, default=0) if n else 0
        out_max, out_index = (torch.empty(R), torch.empty(R, dtype=torch.int64)) if maxima else (None, None)
        out_lse = torch.empty(R) if lse else None
        vals, idx = torch.empty(R, k), torch.empty(R, k, dtype=torch.int64)
        ts = torch.tensor(t, dtype=torch.float32) if t else None
        ns = torch.tensor(n, dtype=torch.int32) if n else None
        flags = torch.tensor(lse, dtype=torch.uint8) if lse else None

        def ptr(x):
            return None if x is None else x.data_ptr()

        rc = self._scan[rows.dtype](rows.data_ptr(), rows.stride(0), R, rows.shape[1], ptr(ts), ptr(ns), ptr(flags),
                                    k, ptr(out_max), ptr(out_index), ptr(out_lse), vals.data_ptr(), idx.data_ptr(),
                                    torch.get_num_threads())
        if rc:
            raise ValueError(f"row scan refused its arguments ({R} rows of {rows.shape[1]}, top {n})")
        return out_max, out_index, out_lse, vals, idx

    def masked_max(self, logits: Tensor, rows: list[int], bitmasks: Tensor) -> tuple[Tensor, Tensor]:
        """(maxima [R], first indices [R]) of logits [N, V]'s rows `rows` as if the ids each one's bitmask
        (bitmasks [R, W] int32) does not allow were -inf; the logits are read, not written."""
        R = len(rows)
        index = torch.tensor(rows, dtype=torch.int64)
        bits = bitmasks.contiguous()
        out_max, out_index = torch.empty(R), torch.empty(R, dtype=torch.int64)
        rc = self._masked[logits.dtype](logits.data_ptr(), logits.stride(0), index.data_ptr(), bits.data_ptr(), R,
                                        bits.shape[1], logits.shape[1], out_max.data_ptr(), out_index.data_ptr(),
                                        torch.get_num_threads())
        if rc:
            raise ValueError(f"masked row max refused its arguments ({R} rows of {logits.shape[1]}, {bits.shape[1]} words)")
        return out_max, out_index

    def draw(self, row: Tensor, t: float, lse: float, u: float) -> int:
        return int(self._draw(row.data_ptr(), row.shape[0], t, lse, u))


Stats = tuple[Tensor | None, Tensor, Tensor]  # a row's (log-sum-exp [1] or None, top values [1, n], indices [1, n])


def row_stats(rows: Tensor, t: float, n: int, lse: bool = True) -> tuple[Tensor | None, Tensor, Tensor]:
    """rows [R, V] (float32 or bfloat16) -> (log-sum-exp of t * rows [R], or None when not asked; the n largest values
    [R, n] and their indices, largest first), in one native pass over each row where the library is loaded
    (row_max.cpp), else torch's."""
    native = native_lib.bound(_NativeRows)
    if native is not None and native.applies(rows) and n <= rows.shape[1]:
        R = rows.shape[0]
        _, _, out_lse, vals, idx = native.scan(rows, False, [t] * R, [n] * R, [lse] * R)
        return out_lse, vals, idx
    vals, idx = rows.float().topk(n, dim=-1)
    return (rows.float() * t).logsumexp(-1) if lse else None, vals, idx


def row_draw(row: Tensor, t: float, lse: float, u: float) -> int:
    """The first index where the running sum of exp(t * row - lse) exceeds u in [0, 1): a draw from
    softmax(t * row) by one uniform number."""
    native = native_lib.bound(_NativeRows)
    if native is not None and native.applies(row[None]) and row.dtype == torch.float32:
        return native.draw(row.contiguous(), t, lse, u)
    cdf = (row * t - lse).exp().double().cumsum(0)
    return int(torch.searchsorted(cdf, torch.tensor(u, dtype=torch.float64), right=True).clamp(max=row.shape[0] - 1))


# The block width of first_max's pass on CPU: 256 floats, 1 KB per block maximum read back.
MAX_BLOCK = 256


def first_max(logits: Tensor) -> tuple[Tensor, Tensor]:
    """logits [N, V] -> (maxima [N], the first index holding each [N] int64): logits.max(dim=-1)'s values and
    indices (a NaN anywhere in a row: NaN and the first NaN's index). On CPU without the native pass,
    torch.max(dim=-1) walks a row element by element (~2.9 ms for 64 rows of SmolLM2's 49,152 ids on one
    Zen 3 core); here the vectorised amax takes each block's maximum, the first block holding the row's
    maximum is found among those, and only that block is read again (~0.4 ms; a single row keeps torch's
    max, ~50 us against ~75). A later block's window that would run past the row ends at its end instead,
    its first ids from the block before it, which holds nothing as large."""
    N, V = logits.shape
    if logits.device.type != "cpu" or N < 2 or V < 2 * MAX_BLOCK or logits.stride(-1) != 1:  # one row: torch's
        return logits.max(dim=-1)
    full = V // MAX_BLOCK * MAX_BLOCK
    block_max = logits[:, :full].unflatten(1, (-1, MAX_BLOCK)).amax(-1)  # [N, V // B]
    if full < V:
        block_max = torch.cat([block_max, logits[:, full:].amax(-1, keepdim=True)], 1)  # [N, nb]
    block = block_max.argmax(-1)  # [N] the first block holding the maximum (NaN: the first holding one)
    start = (block * MAX_BLOCK).clamp_(max=V - MAX_BLOCK)  # [N]
    window = logits.gather(1, start[:, None] + torch.arange(MAX_BLOCK))  # [N, B]
    return block_max.gather(1, block[:, None])[:, 0], start + window.argmax(-1)


# (dtype, width) -> whether first_max beat the native scan for a step's maxima alone, timed on this machine at
# the first step of at least MEASURE_ROWS rows. Both give the same values and indices, so the choice moves
# only the time: the native scan's 16-lane vectors run at full width under AVX-512, while on an AVX2 Zen 3
# core its maxima pass took ~12.5 ms for 64 rows of 49,152 float32 ids against ~0.5 ms for first_max.
_MAX_CHOICE: dict[tuple[torch.dtype, int], bool] = {}
MEASURE_ROWS = 8


def _blocked_max_wins(native: _NativeRows, logits: Tensor) -> bool:
    key = (logits.dtype, logits.shape[1])
    if key not in _MAX_CHOICE:
        if logits.shape[0] < MEASURE_ROWS:
            return False
        sample = logits[:MEASURE_ROWS]

        def best(fn) -> float:
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn(sample)
                times.append(time.perf_counter() - t0)
            return min(times)

        _MAX_CHOICE[key] = best(first_max) < best(lambda x: native.scan(x))
    return _MAX_CHOICE[key]


def row_max(logits: Tensor) -> tuple[Tensor, Tensor]:
    """logits [N, V] -> (maxima [N], indices [N] int64), as logits.max(dim=-1) gives them (the maxima
    in float32 when the native pass runs)."""
    return row_scan(logits, {})[:2]


def rows_max(logits: Tensor, rows: list[int]) -> tuple[Tensor, Tensor]:
    """row_max(logits[rows]) for rows of logits [N, V]: read in place where the native pass runs (consecutive
    rows in one call, others one call each; a constrained step's masked rows of Gemma 3's 262,144 ids are
    1 MB each in float32), else through a copy of those rows."""
    native = native_lib.bound(_NativeRows)
    if native is None or not native.applies(logits):
        return row_max(logits[torch.tensor(rows, device=logits.device)])
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return native.scan(logits[rows[0]: rows[0] + len(rows)])[:2]
    parts = [native.scan(logits[i: i + 1])[:2] for i in rows]
    return torch.cat([m for m, _ in parts]), torch.cat([i for _, i in parts])


def masked_rows_max(logits: Tensor, rows: list[int], bitmasks: Tensor) -> tuple[Tensor, Tensor] | None:
    """rows_max(logits, rows) once each row's ids its bitmask (bitmasks [R, W] int32, constraints.state's) does not
    allow were set to -inf (constraints.state.mask_logits), without setting them: the native pass reads only the
    words of allowed ids, in place (a JSON schema allows few of Gemma 3's 262,144 ids, and a forced key one; a
    greedy row's token is all it needs of them). None where the native pass does not run: the caller masks the
    rows and takes rows_max."""
    native = native_lib.bound(_NativeRows)
    if native is None or not native.applies(logits) or bitmasks.dtype != torch.int32 or bitmasks.device.type != "cpu":
        return None
    return native.masked_max(logits, rows, bitmasks)


def row_scan(logits: Tensor, asks: dict[int, tuple[float, int, bool]]) -> tuple[Tensor, Tensor, dict[int, Stats]]:
    """row_max(logits), and for each row i in `asks` (t, n, lse) what row_stats(logits[i][None], t, n, lse)
    gives, the same values: every row read once, in one native call, where the library is loaded and reads
    the logits in place (a step's rows of Gemma 3's 262,144 ids are 1 MB each in float32). Elsewhere only
    the maxima, and no stats: the asking rows make their own passes."""
    native = native_lib.bound(_NativeRows)  # the model loader's library on CPU; never built here
    if native is None or not native.applies(logits):
        return *first_max(logits), {}
    asks = {i: a for i, a in asks.items() if a[1] <= logits.shape[1]}
    if not asks:
        if _blocked_max_wins(native, logits):
            out_max, out_index = first_max(logits)
            return out_max.float(), out_index, {}  # float32 maxima, as the native pass gives them
        out_max, out_index, _, _, _ = native.scan(logits)
        return out_max, out_index, {}
    R = logits.shape[0]
    t, n, lse = [1.0] * R, [0] * R, [False] * R
    for i, (ti, ni, li) in asks.items():
        t[i], n[i], lse[i] = ti, ni, li
    out_max, out_index, out_lse, vals, idx = native.scan(logits, True, t, n, lse)
    return out_max, out_index, {i: (out_lse[i:i + 1] if lse[i] else None, vals[i:i + 1, :n[i]], idx[i:i + 1, :n[i]])
                                for i in asks}


__all__ = ["first_max", "row_draw", "row_max", "row_scan", "row_stats", "rows_max"]
