"""Each logits row's maximum and the first index holding it: greedy decoding's whole answer.

torch.max(dim=-1) over SmolLM2's 49,152-wide bfloat16 rows took ~60 us for one row and ~1.3 ms for
32 on a 2-core Xeon; with the model's native library loaded (CPU), row_max.cpp reads each row in
two passes from cache instead. Both give the same values and indices: the first of equal maxima,
and NaN (with the first NaN's index) for a row that holds one.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from lmserve.model.native import build as native_lib


class _NativeRowMax:
    def __init__(self, lib):
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._fns = {torch.float32: lib.lm_row_max_f32, torch.bfloat16: lib.lm_row_max_bf16}
        for fn in self._fns.values():
            fn.argtypes, fn.restype = [p, i64, i32, i32, p, p, i32], i32

    def applies(self, logits: Tensor) -> bool:
        return (logits.device.type == "cpu" and logits.dtype in self._fns and logits.dim() == 2
                and logits.stride(1) == 1 and logits.shape[1] > 0)

    def __call__(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        n = logits.shape[0]
        values, index = torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.int64)
        self._fns[logits.dtype](logits.data_ptr(), logits.stride(0), n, logits.shape[1], values.data_ptr(),
                                index.data_ptr(), torch.get_num_threads())
        return values, index


class _NativeRowStats:
    def __init__(self, lib):
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        self._stats = {torch.float32: lib.lm_row_stats_f32, torch.bfloat16: lib.lm_row_stats_bf16}
        for fn in self._stats.values():
            fn.argtypes, fn.restype = [p, i64, i32, i32, f32, i32, p, p, p, i32], i32
        self._draw = lib.lm_row_draw_f32
        self._draw.argtypes, self._draw.restype = [p, i32, f32, f32, ctypes.c_double], i64

    def applies(self, rows: Tensor) -> bool:
        return rows.device.type == "cpu" and rows.dtype in self._stats and rows.dim() == 2 and rows.stride(1) == 1

    def stats(self, rows: Tensor, t: float, n: int, lse: bool = True) -> tuple[Tensor | None, Tensor, Tensor]:
        R = rows.shape[0]
        out, vals, idx = torch.empty(R) if lse else None, torch.empty(R, n), torch.empty(R, n, dtype=torch.int64)
        self._stats[rows.dtype](rows.data_ptr(), rows.stride(0), R, rows.shape[1], t, n, out.data_ptr() if lse else None,
                                vals.data_ptr(), idx.data_ptr(), torch.get_num_threads())
        return out, vals, idx

    def draw(self, row: Tensor, t: float, lse: float, u: float) -> int:
        return int(self._draw(row.data_ptr(), row.shape[0], t, lse, u))


def row_stats(rows: Tensor, t: float, n: int, lse: bool = True) -> tuple[Tensor | None, Tensor, Tensor]:
    """rows [R, V] (float32 or bfloat16) -> (log-sum-exp of t * rows [R], or None when not asked; the n largest values
    [R, n] and their indices, largest first), in one native pass per row for the top and one for the
    log-sum-exp where the library is loaded (row_max.cpp), else torch's."""
    native = native_lib.bound(_NativeRowStats)
    if native is not None and native.applies(rows) and n <= rows.shape[1]:
        return native.stats(rows, t, n, lse)
    vals, idx = rows.float().topk(n, dim=-1)
    return (rows.float() * t).logsumexp(-1) if lse else None, vals, idx


def row_draw(row: Tensor, t: float, lse: float, u: float) -> int:
    """The first index where the running sum of exp(t * row - lse) exceeds u in [0, 1): a draw from
    softmax(t * row) by one uniform number."""
    native = native_lib.bound(_NativeRowStats)
    if native is not None and native.applies(row[None]) and row.dtype == torch.float32:
        return native.draw(row.contiguous(), t, lse, u)
    cdf = (row * t - lse).exp().double().cumsum(0)
    return int(torch.searchsorted(cdf, torch.tensor(u, dtype=torch.float64), right=True).clamp(max=row.shape[0] - 1))


def row_max(logits: Tensor) -> tuple[Tensor, Tensor]:
    """logits [N, V] -> (maxima [N], indices [N] int64), as logits.max(dim=-1) gives them (the maxima
    in float32 when the native pass runs)."""
    native = native_lib.bound(_NativeRowMax)  # the model loader's library on CPU; never built here
    if native is not None and native.applies(logits):
        return native(logits)
    return logits.max(dim=-1)


__all__ = ["row_draw", "row_max", "row_stats"]
