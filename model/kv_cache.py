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

A sliding-window layer's keys below a query's window are never read again (no attention kernel
reads outside the window), so `release` also takes a part of a slot in some layers: the KV manager
(server/engine/kv_manager.py) hands back a sliding layer's pages wholly below the window as its
sequence advances, and a prefix hit copies only what a continuation reads (`copy_prefix` with a
start and layers). Each (layer, slot, head) being one run of positions, this needs no kernel to
change. A dense (CUDA) cache has nothing to hand back: its sliding layers keep every position, and
the manager counts them so.

An int8 cache (dtype torch.int8, CPU) holds each position's K and V of one head as int8 codes with
one float32 scale (scale = max|x| / 127, code = x / scale rounded to nearest even): 68 bytes a row
instead of bfloat16's 128 at head_dim 64, so nearly twice the tokens fit and decode attention reads
about half the bytes. `scales` [layers, slots, max_len, 2, kv_heads] keeps a position's K and V
scales of every head together (one short run per position, read alongside the codes); the native
attention kernels read codes and scales (native_common.h defines the format), and `write` computes
the same codes with torch, bitwise. Only the native CPU attention backend serves it (SDPA cannot
read codes): the engine decides (server/engine/kv_choice.py).
"""

from __future__ import annotations

import math
import mmap
import sys

import torch
from torch import Tensor

from .config import ModelConfig

_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., d] -> (int8 codes [..., d], float32 scales [...]): the int8 cache's format, bitwise what
    the native kernels write (native_common.h quantize_kv_row) for finite rows."""
    xf = x.float()
    scale = xf.abs().amax(-1) / 127
    nonzero = scale > 0
    codes = torch.where(nonzero[..., None], xf / torch.where(nonzero, scale, 1)[..., None], 0)
    return codes.round().clamp(-127, 127).to(torch.int8), scale


def dequantize_rows(codes: Tensor, scale: Tensor) -> Tensor:
    """The values an int8 cache's rows stand for (float32): codes x scale."""
    return codes.float() * scale[..., None]


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
        self.quantized = dtype == torch.int8
        if self.quantized and device.type != "cpu":
            raise ValueError("an int8 KV cache is served on CPU only (the native attention kernels read it)")
        self.virtual = device.type == "cpu" and bool(_MAP_NORESERVE) if virtual is None else virtual
        row = cfg.head_dim * _dtype_size(dtype)  # bytes of one position of one (layer, head)
        scale_row = 2 * cfg.num_kv_heads * 4  # bytes of one position's scales in one (layer, slot)
        page = mmap.PAGESIZE
        # a page holds `page_tokens` positions; a slot's run per (layer, head) starts on a page (and so
        # does its run of scales per layer: a released page never holds another slot's)
        self.page_tokens = page // math.gcd(page, row) if self.virtual else 1
        if self.quantized and self.virtual:
            self.page_tokens = math.lcm(self.page_tokens, page // math.gcd(page, scale_row))
        max_len = -(-max_len // self.page_tokens) * self.page_tokens
        shape = (cfg.num_layers, num_slots, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.num_slots, self.max_len, self.shape = num_slots, max_len, shape
        self._runs: list[tuple[mmap.mmap, int, int]] = []  # (map, runs per (layer, slot), bytes per position)
        self.scales = None
        if self.virtual:
            self.k, self.v = self._mapped(shape, dtype, cfg.num_kv_heads, row), self._mapped(shape, dtype, cfg.num_kv_heads, row)
        else:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        if self.quantized:
            sshape = (cfg.num_layers, num_slots, max_len, 2, cfg.num_kv_heads)
            self.scales = (self._mapped(sshape, torch.float32, 1, scale_row) if self.virtual
                           else torch.zeros(sshape, dtype=torch.float32))
        self.bytes_per_page = self.page_tokens * self.bytes_per_token(cfg, dtype)

    def _mapped(self, shape: tuple[int, ...], dtype: torch.dtype, runs: int, position_bytes: int) -> Tensor:
        """An anonymous mapping viewed as `shape`: `runs` runs of max_len positions per (layer, slot),
        `position_bytes` each position (release's layout)."""
        size = math.prod(shape) * _dtype_size(dtype)
        mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | _MAP_NORESERVE)  # anonymous: reads as zeros
        if hasattr(mmap, "MADV_NOHUGEPAGE"):  # a 2 MiB huge page would commit 8k positions at once
            mm.madvise(mmap.MADV_NOHUGEPAGE)
        self._runs.append((mm, runs, position_bytes))
        return torch.frombuffer(mm, dtype=dtype).view(shape)

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
        """K and V bytes of one position over every layer and head (an int8 cache's scales included)."""
        row = cfg.head_dim * _dtype_size(dtype) + (4 if dtype == torch.int8 else 0)
        return 2 * cfg.num_layers * cfg.num_kv_heads * row

    @property
    def token_bytes(self) -> int:
        """bytes_per_token of this cache's own dtype."""
        return self.bytes_per_page // self.page_tokens

    def scale_views(self, layer: int) -> tuple[Tensor, Tensor] | tuple[None, None]:
        """An int8 cache's K and V scales of one layer ([slots, max_len, kv_heads] views), else (None, None)."""
        if self.scales is None:
            return None, None
        return self.scales[layer, :, :, 0], self.scales[layer, :, :, 1]

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
        """Bytes the K and V tensors (and an int8 cache's scales) span (virtual on CPU: mostly never committed)."""
        return self.k.numel() * self.k.element_size() * 2 + (self.scales.numel() * 4 if self.scales is not None else 0)

    def pages(self, tokens: int) -> int:
        """Blocks (pages per (layer, head)) that `tokens` positions of one slot occupy."""
        return -(-tokens // self.page_tokens)

    def write(self, layer: int, slot_idx: Tensor, pos_idx: Tensor, k: Tensor, v: Tensor) -> None:
        """k, v [T, kv_heads, d] go to (slot_idx[t], :, pos_idx[t]) (as codes and scales when int8)."""
        if self.quantized:
            (kc, ks), (vc, vs) = quantize_rows(k), quantize_rows(v)
            self.k[layer][slot_idx, :, pos_idx] = kc
            self.v[layer][slot_idx, :, pos_idx] = vc
            self.scales[layer][slot_idx, pos_idx] = torch.stack((ks, vs), 1)  # [T, 2, kv_heads]
            return
        self.k[layer][slot_idx, :, pos_idx] = k
        self.v[layer][slot_idx, :, pos_idx] = v

    def release(self, slot: int, upto: int | None = None, start: int = 0, layers: tuple[int, ...] | None = None) -> None:
        """Hand back a slot's positions [start, upto) (all by default) in `layers` (all by default); they
        read as zeros afterwards, so no stale (possibly non-finite) K/V reaches the slot's next owner.
        The pages holding them go whole: `upto` rounds up to a page (what lies beyond was never
        written), `start` must begin one (a multiple of page_tokens: the positions below stay)."""
        upto = self.max_len if upto is None else min(self.max_len, upto)
        if start % self.page_tokens:
            raise ValueError(f"a release starts on a page: {start} is not a multiple of {self.page_tokens} positions")
        if upto <= start:
            return
        every = layers is None
        layers = range(self.shape[0]) if every else layers
        if not self.virtual:
            for layer in layers:
                self.k[layer, slot, :, start:upto] = 0
                self.v[layer, slot, :, start:upto] = 0
                if self.scales is not None:
                    self.scales[layer, slot, start:upto] = 0
            return
        max_len = self.max_len
        for mm, runs, position_bytes in self._runs:
            run = max_len * position_bytes  # bytes of one run: a multiple of the page size
            first = start * position_bytes  # a multiple of the page size (start is whole pages)
            length = self.pages(upto) * self.page_tokens * position_bytes - first
            length = -(-length // mmap.PAGESIZE) * mmap.PAGESIZE
            for layer in layers:
                base = ((layer * self.num_slots + slot) * runs) * run
                if length == run:  # the whole slot of this layer: one call for every run
                    mm.madvise(mmap.MADV_DONTNEED, base, runs * run)
                    continue
                for r in range(runs):
                    mm.madvise(mmap.MADV_DONTNEED, base + r * run + first, length)

    def copy_prefix(self, src: int, dst: int, length: int, start: int = 0, layers: tuple[int, ...] | None = None) -> None:
        """Positions [start, length) of slot src -> slot dst, in `layers` (all by default), every head
        (a prefix-cache hit; a sliding layer's copy starts where the continuation's window does)."""
        for layer in (slice(None),) if layers is None else layers:  # every layer in one copy by default
            self.k[layer, dst, :, start:length].copy_(self.k[layer, src, :, start:length])
            self.v[layer, dst, :, start:length].copy_(self.v[layer, src, :, start:length])
            if self.scales is not None:
                self.scales[layer, dst, start:length].copy_(self.scales[layer, src, start:length])

    def view(self, layer: int, lo: int, hi: int, length: int) -> tuple[Tensor, Tensor]:
        """Views (no copy) k, v [hi - lo, kv_heads, length, d] of slots lo..hi-1."""
        if self.quantized:
            raise TypeError("an int8 KV cache is read by the native attention kernels only, not through views")
        return self.k[layer, lo:hi, :, :length], self.v[layer, lo:hi, :, :length]
