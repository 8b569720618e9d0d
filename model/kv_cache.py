"""The KV cache: one slot (a contiguous range of max_len positions) per request, memory held per token.

k, v: [layers, slots, kv_heads, max_len, head_dim]. Attention reads no-copy views over slot
ranges, so every slot is one contiguous run of positions per (layer, head).

On CPU the two tensors live in anonymous private mappings reserved without commitment
(MAP_NORESERVE): the virtual size may exceed RAM, a page becomes resident when it is first
written, and `release` hands a slot's pages back to the kernel (MADV_DONTNEED), after which
they read as zeros again. Resident memory thus follows the tokens held, not slots x max_len
(the vAttention idea, with the kernel's own demand paging doing the work). A page holds
`page_tokens` positions of one (layer, head), so memory is accounted in KV pages of that many
tokens. Elsewhere (CUDA) the tensors are allocated in full ("dense") and the number of slots
is what the budget allows; `release` then zeroes what was written.
"""

from __future__ import annotations

import math
import mmap
import sys

import torch
from torch import Tensor

from .config import ModelConfig

_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


def _dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class KVCache:
    """A request owns one slot while it runs (and a prefix-cache entry may keep it afterwards).

    Writes go to explicit (slot, position) pairs; reads are views over a slot range. Which slot
    is free and how many pages are held is the engine's bookkeeping (server/engine/scheduler.py).
    """

    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", virtual: bool | None = None):
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"KV cache needs at least one slot and one position (slots={num_slots}, max_len={max_len})")
        device = torch.device(device)
        self.virtual = device.type == "cpu" and bool(_MAP_NORESERVE) if virtual is None else virtual
        row = cfg.head_dim * _dtype_size(dtype)  # bytes of one position of one (layer, head)
        page = mmap.PAGESIZE
        # a page holds `page_tokens` positions; a slot's run per (layer, head) starts on a page
        self.page_tokens = page // math.gcd(page, row) if self.virtual else 1
        max_len = -(-max_len // self.page_tokens) * self.page_tokens
        shape = (cfg.num_layers, num_slots, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.num_slots, self.max_len, self.shape = num_slots, max_len, shape
        self._row = row
        self._maps: list[mmap.mmap] = []
        if self.virtual:
            self.k, self.v = self._mapped(shape, dtype), self._mapped(shape, dtype)
        else:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.bytes_per_page = self.page_tokens * self.bytes_per_token(cfg, dtype)

    def _mapped(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        size = math.prod(shape) * _dtype_size(dtype)
        mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | _MAP_NORESERVE)  # anonymous: reads as zeros
        if hasattr(mmap, "MADV_NOHUGEPAGE"):  # a 2 MiB huge page would commit 8k positions at once
            mm.madvise(mmap.MADV_NOHUGEPAGE)
        self._maps.append(mm)
        return torch.frombuffer(mm, dtype=dtype).view(shape)

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
        return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * _dtype_size(dtype)

    @classmethod
    def from_budget(cls, cfg: ModelConfig, budget_bytes: int, max_len: int, max_slots: int,
                    dtype: torch.dtype, device: torch.device | str = "cpu") -> "KVCache":
        """Virtual (CPU): max_slots slots whatever the budget, which then limits pages held, not slots.
        Dense: as many slots of max_len tokens as fit in budget_bytes, at most max_slots."""
        if torch.device(device).type == "cpu" and _MAP_NORESERVE:
            return cls(cfg, max_slots, max_len, dtype, device)
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
        """Bytes the two tensors span (virtual on CPU: mostly never committed)."""
        return self.k.numel() * self.k.element_size() * 2

    def pages(self, tokens: int) -> int:
        """Blocks (pages per (layer, head)) that `tokens` positions of one slot occupy."""
        return -(-tokens // self.page_tokens)

    def write(self, layer: int, slot_idx: Tensor, pos_idx: Tensor, k: Tensor, v: Tensor) -> None:
        """k, v [T, kv_heads, d] go to (slot_idx[t], :, pos_idx[t])."""
        self.k[layer][slot_idx, :, pos_idx] = k
        self.v[layer][slot_idx, :, pos_idx] = v

    def release(self, slot: int, upto: int | None = None) -> None:
        """Hand back a slot's first `upto` positions (all by default); they read as zeros afterwards,
        so no stale (possibly non-finite) K/V reaches the slot's next owner."""
        upto = self.max_len if upto is None else min(self.max_len, upto)
        if upto <= 0:
            return
        if not self.virtual:
            self.k[:, slot, :, :upto] = 0
            self.v[:, slot, :, :upto] = 0
            return
        layers, _, heads, max_len, _ = self.shape
        run = max_len * self._row  # bytes of one (layer, slot, head) run: a multiple of the page size
        length = self.pages(upto) * self.page_tokens * self._row
        length = -(-length // mmap.PAGESIZE) * mmap.PAGESIZE
        for mm in self._maps:
            for layer in range(layers):
                base = ((layer * self.num_slots + slot) * heads) * run
                if length == run:  # the whole slot of this layer: one call for every head
                    mm.madvise(mmap.MADV_DONTNEED, base, heads * run)
                    continue
                for head in range(heads):
                    mm.madvise(mmap.MADV_DONTNEED, base + head * run, length)

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Positions [0, length) of slot src -> slot dst, every layer and head (a prefix-cache hit)."""
        self.k[:, dst, :, :length].copy_(self.k[:, src, :, :length])
        self.v[:, dst, :, :length].copy_(self.v[:, src, :, :length])

    def view(self, layer: int, lo: int, hi: int, length: int) -> tuple[Tensor, Tensor]:
        """Views (no copy) k, v [hi - lo, kv_heads, length, d] of slots lo..hi-1."""
        return self.k[layer, lo:hi, :, :length], self.v[layer, lo:hi, :, :length]
