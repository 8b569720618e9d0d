"""Decode attention on CPU in one call per layer (decode_attention.cpp, built by native/build.py).

A decode step's rows each add one token and attend over their own slot. Through SDPA that is one
call per row and layer when rows must not depend on the batch (SDPA rounds differently when a
row's keys are padded), each call mostly fixed cost: at batch 32, 960 calls and ~30 ms of a
55 ms step on a 2-core EPYC. The kernel here writes every row's new k/v into the cache and
attends for all rows in one call, parallel over (row, kv head), each pair computed by the same
operations whatever the batch: batch-invariant by construction. Without the native library, or
for a head size it does not take, attention stays on SDPA (attention_plan).
"""

from __future__ import annotations

import ctypes
import math

import torch
from torch import Tensor

from ..native.build import rows_packed

DTYPES = {torch.float32: 0, torch.bfloat16: 1}
HEAD_DIMS = (32, 64, 80, 96, 128, 256)  # compiled for these (decode_attention.cpp); others keep SDPA


class DecodeAttention:
    """The loaded kernel: `__call__` writes the rows' new k/v and returns their attention."""

    def __init__(self, lib: ctypes.CDLL):
        fn = lib.lm_decode_attention
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        fn.argtypes = [i32, p, i64, p, i64, p, i64, p, p, p, p, p, p, p, i32, i32, i32, i32, i64, i64, ctypes.c_float,
                       i64, i32]
        fn.restype = i32
        self._fn = fn

    @staticmethod
    def supports(dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int) -> bool:
        return (dtype in DTYPES and head_dim in HEAD_DIMS and num_heads % num_kv_heads == 0
                and num_heads // num_kv_heads <= 16)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                 slots: Tensor, pos: Tensor, k_scales: Tensor | None = None, v_scales: Tensor | None = None,
                 window: int = 0, scale: float | None = None) -> Tensor:
        """q [B, 1, H, d], k/v [B, 1, Hkv, d] (rotated, this step's token of each row); k_cache/v_cache
        one layer's [slots, Hkv, max_len, d]; slots/pos [B] int64. Row b's k/v go to
        (slots[b], pos[b]); its attention over keys 0..pos[b] (a sliding layer's window > 0: keys
        pos[b] - window + 1 .. pos[b]) comes back as [B, 1, H * d], scores scaled by `scale` (None:
        1 / sqrt(d)). An int8 cache (kv_cache.py) passes its layer's scale views (KVCache.scale_views) too."""
        B, _, H, d = q.shape
        Hkv = k.shape[2]
        q, k, v = (rows_packed(x) for x in (q, k, v))
        out = torch.empty(B, 1, H * d, dtype=q.dtype)
        ks, vs = scale_pointers(k_cache, k_scales, v_scales)
        rc = self._fn(DTYPES[q.dtype], q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(),
                      v.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), ks, vs, slots.data_ptr(), pos.data_ptr(),
                      out.data_ptr(), B, H, Hkv, d, k_cache.shape[0], k_cache.shape[2],
                      1.0 / math.sqrt(d) if scale is None else scale, window, torch.get_num_threads())
        if rc == 1:
            raise ValueError(f"decode attention does not take head_dim={d}, heads={H}/{Hkv}")
        if rc == 2:
            raise IndexError(f"decode attention: a row's slot or position lies outside the cache "
                             f"({k_cache.shape[0]} slots x {k_cache.shape[2]} positions)")
        return out


def scale_pointers(k_cache: Tensor, k_scales: Tensor | None, v_scales: Tensor | None) -> tuple[int | None, int | None]:
    """The kernels' scale arguments: None (null) for a float cache, else the int8 cache's scale views
    (KVCache.scale_views: [slots, max_len, Hkv] with K and V interleaved per position)."""
    if k_cache.dtype != torch.int8:
        return None, None
    if k_scales is None or v_scales is None:
        raise ValueError("an int8 KV cache needs its scales")
    return k_scales.data_ptr(), v_scales.data_ptr()


__all__ = ["DecodeAttention", "scale_pointers"]
