"""Prompt attention on CPU for a bfloat16 cache (prompt_attention.cpp, built by native/build.py).

SDPA's CPU kernel computes a bfloat16 prompt's attention in float32 arithmetic (~150 GFLOP/s on a
2-core AVX-512 EPYC, against ~900 for the bfloat16 matrix multiplies of the linear layers), so a
long prompt spends most of its prefill there, and a late chunk of it costs a decoding batch
sharing the step more than its linear layers do. The kernel here takes the bfloat16 dot products
of AVX-512 BF16 with float32 sums (the products are exact either way; on AVX2, float multiply-adds in
the order the instruction is specified with), in one call per layer for every prefill token of a step. Each
token's output depends only on its own keys: the same whatever chunk, batch or prefix-cache hit it
came with. A float32 cache takes float32 products, so the token-exact reference keeps that property too.
"""

from __future__ import annotations

import ctypes
import math

import torch
from torch import Tensor

from .decode import scale_pointers
from ..native.build import rows_packed


class PromptAttention:
    """The loaded kernel: `__call__` attends every given token over its slot's cached keys."""

    def __init__(self, lib: ctypes.CDLL):
        fn = lib.lm_prompt_attention
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        fn.argtypes = [i32, p, i64, p, p, p, p, p, p, p, i32, i32, i32, i32, i64, i64, ctypes.c_float, i32]
        fn.restype = i32
        self._fn = fn
        lib.lm_prompt_attention_amx.argtypes, lib.lm_prompt_attention_amx.restype = [i32], i32
        lib.lm_prompt_attention_set_amx.argtypes, lib.lm_prompt_attention_set_amx.restype = [i32], i32
        self._amx = lib.lm_prompt_attention_amx
        self._set_amx = lib.lm_prompt_attention_set_amx

    def allow_amx(self, on: bool) -> bool:
        """Whether the AMX tiles may serve (the default: yes, where granted); returns the previous
        setting. Tests compare both paths on one machine; a server keeps one for every prompt token."""
        return bool(self._set_amx(int(on)))

    def uses_amx(self, head_dim: int) -> bool:
        """Whether this head_dim takes the AMX tile path here (the CPU has it and the OS grants it)."""
        return bool(self._amx(head_dim))

    @staticmethod
    def built(lib: ctypes.CDLL) -> bool:
        """Whether this machine's build has the kernel (it needs AVX2 and FMA)."""
        return bool(lib.lm_prompt_attention_built())

    @staticmethod
    def supports(dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int) -> bool:
        return (dtype in (torch.bfloat16, torch.float32) and head_dim % 32 == 0 and head_dim <= 256
                and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= 24)

    def __call__(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, pos: Tensor,
                 k_scales: Tensor | None = None, v_scales: Tensor | None = None, scale: float | None = None) -> Tensor:
        """q [T, H, d] (rotated queries; rows may be strided); k_cache/v_cache one layer's
        [slots, Hkv, max_len, d] holding every key the tokens see (bfloat16, or int8 codes with their
        scale views: KVCache.scale_views); slots/pos [T] int64. Token t attends to keys 0..pos[t] of
        slot slots[t], scores scaled by `scale` (None: 1 / sqrt(d)); returns [T, H * d]."""
        T, H, d = q.shape
        q = rows_packed(q)
        slots, pos = slots.contiguous(), pos.contiguous()
        out = torch.empty(T, H * d, dtype=q.dtype)
        ks, vs = scale_pointers(k_cache, k_scales, v_scales)
        if q.dtype != (torch.bfloat16 if k_cache.dtype == torch.int8 else k_cache.dtype):
            raise TypeError(f"prompt attention takes {k_cache.dtype} caches with queries of their own dtype, not {q.dtype}")
        rc = self._fn(int(q.dtype == torch.bfloat16), q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), ks, vs, slots.data_ptr(),
                      pos.data_ptr(), out.data_ptr(), T, H, k_cache.shape[1], d, k_cache.shape[0], k_cache.shape[2],
                      1.0 / math.sqrt(d) if scale is None else scale, torch.get_num_threads())
        if rc == 1:
            raise ValueError(f"prompt attention does not take head_dim={d}, heads={H}/{k_cache.shape[1]} "
                             "(or this CPU lacks AVX2)")
        if rc == 2:
            raise IndexError(f"prompt attention: a token's slot or position lies outside the cache "
                             f"({k_cache.shape[0]} slots x {k_cache.shape[2]} positions)")
        return out


__all__ = ["PromptAttention"]
