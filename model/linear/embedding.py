"""The token embedding served from a GGUF file's own blocks (K-quants, or Q8_0 / Q5_0 as Q8_0 bytes): the table stays at the file's size
(a Llama-3.1-8B Q4_K_M's 128256 x 4096 table is 0.29 GB as Q4_K, 1.05 GB in bfloat16) and each looked-up
row is decoded to bfloat16 when a step needs it (model/native/csrc/gguf_blocks.h: the values a bfloat16
read of the file gives, bitwise). The native step decodes its rows itself (native_step.cpp StepEnds)."""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor, nn

from ..native.build import bound
from .formats import KQuantBlocks, Q80Blocks

Q8_0 = 8  # GGML type id


class _RowsBf16:
    def __init__(self, lib):
        self.fn = lib.lm_gguf_rows_bf16
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self.fn.argtypes = [p, i64, p, i64, i64, ctypes.c_int, p, ctypes.c_int]
        self.fn.restype = ctypes.c_int


def available() -> bool:
    """Whether this process has the native library that decodes the rows (loaded by the model loader)."""
    return bound(_RowsBf16) is not None


class QuantizedEmbedding(nn.Module):
    """ids [...] -> bfloat16 rows [..., D] of a K-quant or Q8_0 table (CPU). `raw` is the file's bytes, one row
    of blocks per token id; `ggml_type` their type."""

    dtype = torch.bfloat16

    def __init__(self, blocks: KQuantBlocks | Q80Blocks):
        super().__init__()
        self.num_embeddings, self.embedding_dim = blocks.shape if isinstance(blocks, KQuantBlocks) else blocks.q.shape
        self.ggml_type = blocks.qtype if isinstance(blocks, KQuantBlocks) else Q8_0
        raw = blocks.raw if isinstance(blocks, KQuantBlocks) else blocks.to_raw()
        self.register_buffer("raw", raw.contiguous(), persistent=False)  # [V, row bytes] uint8

    @property
    def row_bytes(self) -> int:
        return self.raw.shape[1]

    def forward(self, ids: Tensor) -> Tensor:
        native = bound(_RowsBf16)
        if native is None:
            raise RuntimeError("a quantized embedding needs the native library, which is not loaded")
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range for an embedding of {self.num_embeddings} rows")
        out = torch.empty(flat.numel(), self.embedding_dim, dtype=torch.bfloat16)
        if native.fn(self.raw.data_ptr(), self.row_bytes, flat.data_ptr(), flat.numel(), self.embedding_dim,
                     self.ggml_type, out.data_ptr(), torch.get_num_threads()):
            raise ValueError(f"GGML type {self.ggml_type} rows of {self.embedding_dim} values cannot be decoded")
        return out.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, ggml_type={self.ggml_type}"


__all__ = ["QuantizedEmbedding", "available"]
