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


def row_max(logits: Tensor) -> tuple[Tensor, Tensor]:
    """logits [N, V] -> (maxima [N], indices [N] int64), as logits.max(dim=-1) gives them (the maxima
    in float32 when the native pass runs)."""
    native = native_lib.bound(_NativeRowMax)  # the model loader's library on CPU; never built here
    if native is not None and native.applies(logits):
        return native(logits)
    return logits.max(dim=-1)


__all__ = ["row_max"]
