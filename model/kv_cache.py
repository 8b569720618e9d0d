"""A KV cache preallocated once and indexed by slot: one slot per running request."""

from __future__ import annotations

import torch
from torch import Tensor

from .config import ModelConfig


class KVCache:
    """k, v: [layers, slots, kv_heads, max_len, head_dim]. A request owns one slot for its lifetime.

    Writes go to explicit (slot, position) pairs; reads are views over a slot range.
    Slot bookkeeping (which slot is free, how long each is) belongs to the engine.
    """

    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"KV cache needs at least one slot and one position (slots={num_slots}, max_len={max_len})")
        shape = (cfg.num_layers, num_slots, cfg.num_kv_heads, max_len, cfg.head_dim)
        # torch.zeros on CPU maps untouched pages lazily: resident memory grows with use.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.max_len = max_len

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
        return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()

    @classmethod
    def from_budget(cls, cfg: ModelConfig, budget_bytes: int, max_len: int, max_slots: int,
                    dtype: torch.dtype, device: torch.device | str = "cpu") -> "KVCache":
        """As many slots of max_len tokens as fit in budget_bytes, at most max_slots."""
        per_slot = cls.bytes_per_token(cfg, dtype) * max_len
        slots = min(max_slots, budget_bytes // per_slot)
        if slots < 1:
            raise ValueError(
                f"KV budget of {budget_bytes / 2**20:.0f} MiB holds no slot of {max_len} tokens "
                f"({per_slot / 2**20:.1f} MiB each); raise the budget or lower the context length"
            )
        return cls(cfg, int(slots), max_len, dtype, device)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def write(self, layer: int, slot_idx: Tensor, pos_idx: Tensor, k: Tensor, v: Tensor) -> None:
        """k, v [T, kv_heads, d] go to (slot_idx[t], :, pos_idx[t])."""
        self.k[layer][slot_idx, :, pos_idx] = k
        self.v[layer][slot_idx, :, pos_idx] = v

    def clear(self, slot: int, upto: int | None = None) -> None:
        """Zero a slot's first `upto` positions (all by default): no stale non-finite K/V for the next owner."""
        self.k[:, slot, :, :upto] = 0
        self.v[:, slot, :, :upto] = 0

    def view(self, layer: int, lo: int, hi: int, length: int) -> tuple[Tensor, Tensor]:
        """Views (no copy) k, v [hi - lo, kv_heads, length, d] of slots lo..hi-1."""
        return self.k[layer, lo:hi, :, :length], self.v[layer, lo:hi, :, :length]
