"""Fused elementwise ops for bfloat16 activations on CPU (fused_ops.cpp, built by native/build.py).

At one or a few rows a decoder layer's work between matrix multiplies is a chain of ~30 small torch
ops (RMSNorm alone is eight), and their dispatch costs more than their arithmetic: on the 2-core
EPYC an add + RMSNorm of one row took 13 us through torch and 2.7 us here. Each function below
replaces one chain, keeps its bfloat16 rounding points and computes every row on its own, so a
row's result does not depend on the batch. float32 keeps the torch ops (its path is the one that
must match transformers token for token), and so does a compiled step (torch.compile fuses them
itself).
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor


NORM_STYLES = {"llama": 0, "gemma": 1}  # fused_ops.cpp's norm_style codes (config.norm_style)
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # and its act codes (config.hidden_act)


class FusedOps:
    def __init__(self, lib: ctypes.CDLL):
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        self._norm = lib.lm_add_rmsnorm_bf16
        self._norm.argtypes = [p, p, p, p, p, i32, i32, f32, i32, i32]
        self._rope = lib.lm_rope_bf16
        self._rope.argtypes = [p, i64, p, p, p, p, i32, f32, i32, p, i32, i32, i32, i32]
        self._act_mul = lib.lm_act_mul_bf16
        self._act_mul.argtypes = [p, p, i32, i32, i32, i32]
        for fn in (self._norm, self._rope, self._act_mul):
            fn.restype = i32

    @staticmethod
    def applies(x: Tensor) -> bool:
        """Whether a tensor's op goes through here: bfloat16 on CPU, outside a compiled graph."""
        return x.dtype == torch.bfloat16 and x.device.type == "cpu" and not torch.compiler.is_compiling()

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise ValueError(f"fused {what} does not take this shape")

    def add_rmsnorm(self, x: Tensor, residual: Tensor | None, weight: Tensor, eps: float,
                    style: str = "llama") -> tuple[Tensor, Tensor]:
        """(s, rmsnorm(s) scaled by weight in the norm style) with s = x + residual (or x itself);
        x, residual [..., D]. style: "llama" (w * n) or "gemma" ((1 + w) * n), as llama.RMSNorm."""
        x = x.contiguous()
        D = x.shape[-1]
        out = torch.empty_like(x)
        s, res_ptr, sum_ptr = x, None, None
        if residual is not None:
            residual, s = residual.contiguous(), torch.empty_like(x)
            res_ptr, sum_ptr = residual.data_ptr(), s.data_ptr()
        rc = self._norm(x.data_ptr(), res_ptr, sum_ptr, weight.data_ptr(), out.data_ptr(), x.numel() // D, D, eps,
                        NORM_STYLES[style], torch.get_num_threads())
        self._check(rc, "RMSNorm")
        return s, out

    def rope(self, qkv: Tensor, cos: Tensor, sin_signed: Tensor, heads: int, q_heads: int = 0,
             norms: tuple | None = None) -> Tensor:
        """The first `heads` heads of qkv [B, L, heads_total, d] rotated: [B, L, heads, d] (packed).
        cos, sin_signed: [B, L, 1, d]. norms: None, or the (q, k) norms (llama.RMSNorm over [d]) each
        head is normed by before its rotation: heads 0 .. q_heads - 1 by q's, the rest by k's."""
        B, L, total, d = qkv.shape
        if qkv.stride(3) != 1 or qkv.stride(2) != d or qkv.stride(0) != L * qkv.stride(1):
            qkv = qkv.contiguous()
        cos, sin_signed = cos.expand(B, L, 1, d).contiguous(), sin_signed.expand(B, L, 1, d).contiguous()
        out = torch.empty(B, L, heads, d, dtype=qkv.dtype)
        q_w, k_w, eps, style = None, None, 0.0, "llama"
        if norms is not None:
            q_w, k_w, eps, style = norms[0].weight.data_ptr(), norms[1].weight.data_ptr(), norms[0].eps, norms[0].style
        rc = self._rope(qkv.data_ptr(), qkv.stride(1), cos.data_ptr(), sin_signed.data_ptr(), q_w, k_w, q_heads, eps,
                        NORM_STYLES[style], out.data_ptr(), B * L, heads, d, torch.get_num_threads())
        self._check(rc, "RoPE")
        return out

    def act_mul(self, gate_up: Tensor, act: str = "silu") -> Tensor:
        """act(gate) * up for gate_up [..., 2I] = gate | up: [..., I]; act "silu" or "gelu_tanh"
        (GELU with the tanh approximation)."""
        gate_up = gate_up.contiguous()
        I2 = gate_up.shape[-1]
        out = torch.empty(*gate_up.shape[:-1], I2 // 2, dtype=gate_up.dtype)
        rc = self._act_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // I2, I2 // 2, ACTIVATIONS[act],
                           torch.get_num_threads())
        self._check(rc, "activation")
        return out


def supports(hidden: int, head_dim: int, intermediate: int) -> bool:
    return hidden % 16 == 0 and head_dim % 32 == 0 and intermediate % 16 == 0


__all__ = ["ACTIVATIONS", "FusedOps", "NORM_STYLES", "supports"]
