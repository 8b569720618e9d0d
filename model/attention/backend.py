"""One attention backend per device, chosen once at load (`choose_backend`).

A backend turns a step's layout (which cache slot, which positions) into a *step attention*: the
per-step metadata every layer calls with its rotated q, k, v. A step attention writes the new K/V
into the cache and returns the attention (`StepAttention.attend`), so the model never asks which
kernel runs. Three backends:

- `SdpaBackend`: SDPA over views of the cache (attention.AttentionMetadata and its call plan);
  any device. Batch-invariant serving gives every sequence its own call over exactly its own keys.
- `NativeCpuBackend`: the project's CPU kernels: decode rows in one call per layer
  (attention/decode.py) and, on any CPU with AVX2, prompt tokens in one call per
  layer (attention/prompt.py); SDPA for what they do not take.
- `CudaGraphsBackend`: SDPA, plus decode steps of static shape over the whole cache so that they
  can be captured as CUDA graphs (server/engine/cuda_graphs.py).
- `PagedBackend`: a paged KV cache (model/paged_kv_cache.py) and the paged varlen kernel
  (attention/paged.py): one kernel call per layer for each forward segment (decode rows, a continued
  chunk, the packed new prompts), every row's result its own; decode steps captured as CUDA graphs
  read only the pages each sequence holds. The CUDA default where triton is installed; on CPU only
  when asked for (the engine's `attention` setting), run by Triton's interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from .paged import Tiles, host_to_device, paged_attention, paged_attention_reference, tile_rows, triton_available
from .sdpa import AttentionMetadata, packed_positions
from ..config import ModelConfig
from ..kv_cache import KVCache

class StepAttention(Protocol):
    """What every layer of one forward calls: the cache write and the attention of its tokens."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor, cache: KVCache | None, layer: int, window: int = 0,
               scale: float | None = None) -> Tensor:
        """Rotated q [B, L, H, d], k, v [B, L, Hkv, d] -> [B, L, H*d] before o_proj. window: the layer's
        sliding window (0: none; else a query at p sees keys p - window + 1 .. p); scale: the scores'
        (None: 1 / sqrt(d))."""
        ...


@dataclass(frozen=True)
class KernelDecode:
    """Decode rows (one token each) through the CPU decode kernel: write and attend in one call."""

    kernel: object  # decode_attention.DecodeAttention
    slots: Tensor  # [B]
    starts: Tensor  # [B] each row's position (keys 0..starts[b] after the write)
    write_first: bool = False  # rows share a slot (a verified draft): every row's K/V written before any attends

    def attend(self, q: Tensor, k: Tensor, v: Tensor, cache: KVCache, layer: int, window: int = 0,
               scale: float | None = None) -> Tensor:
        if self.write_first:  # the kernel writes each row as it goes; it rewrites the same values
            cache.write(layer, self.slots, self.starts, k[:, 0], v[:, 0])  # [B, Hkv, d]
        return self.kernel(q, k, v, cache.k[layer], cache.v[layer], self.slots, self.starts, *cache.scale_views(layer),
                           window=window, scale=scale)


@dataclass(frozen=True)
class KernelPrompt:
    """Prompt tokens through the CPU prompt kernel: written to the cache, then each real token
    attends over its slot's keys 0..its position in one call per layer. In a sliding layer every token
    takes the decode kernel instead, as a row over its own window (the prompt kernel reads from key 0):
    a token's attention is then the same whatever chunk or step it came in."""

    kernel: object  # prompt_attention.PromptAttention
    write_b: Tensor  # [T] batch row of each real token
    write_j: Tensor  # [T] its offset in the row
    write_slot: Tensor  # [T]
    write_pos: Tensor  # [T]
    rows_kernel: object = None  # decode_attention.DecodeAttention, for sliding layers

    def attend(self, q: Tensor, k: Tensor, v: Tensor, cache: KVCache, layer: int, window: int = 0,
               scale: float | None = None) -> Tensor:
        B, L, H, d = q.shape
        b, j = self.write_b, self.write_j
        kt, vt = k[b, j], v[b, j]  # [T, Hkv, d]
        cache.write(layer, self.write_slot, self.write_pos, kt, vt)
        dense = b.shape[0] == B * L
        rows = q.reshape(B * L, H, d) if dense else q[b, j]  # row-major: in order
        if window:  # every token's k/v is in the cache: the decode kernel rewrites each row's own, unchanged
            out = self.rows_kernel(rows[:, None], kt[:, None], vt[:, None], cache.k[layer], cache.v[layer],
                                   self.write_slot.contiguous(), self.write_pos.contiguous(), *cache.scale_views(layer),
                                   window=window, scale=scale).view(-1, H * d)  # [T, H*d]
        else:
            out = self.kernel(rows, cache.k[layer], cache.v[layer], self.write_slot, self.write_pos,
                              *cache.scale_views(layer), scale=scale)  # [T, H*d]
        if dense:
            return out.view(B, L, H * d)
        full = out.new_zeros(B, L, H * d)  # padding rows stay 0
        full[b, j] = out
        return full


class SdpaBackend:
    """SDPA over cache views. `batch_invariant`: every sequence gets its own call over exactly its own
    keys (SDPA on CPU rounds differently when a row's keys are padded with masked ones)."""

    name = "sdpa"

    def __init__(self, device: torch.device | str, batch_invariant: bool = True):
        self.device = torch.device(device)
        self.call_cost = 0 if batch_invariant else None  # None: the device's (attention_plan)

    def describe(self) -> str:
        return "SDPA over cache views"

    # Each layout returns the step attention and its tokens' positions.
    def decode(self, slots: list[int], starts: list[int]) -> tuple[StepAttention, Tensor]:
        """One new token per row: b writes slot slots[b] at position starts[b] and attends to keys
        0..starts[b]. A slot may repeat at consecutive positions (a speculative draft's verification
        rows); each row then computes exactly what a decode row at that position would. Positions [B, 1]."""
        if len(set(slots)) < len(slots):
            meta = AttentionMetadata.for_rows(slots, starts, self.device)
        else:
            meta = AttentionMetadata.for_decode(slots, starts, self.device, self.call_cost)
        return meta, meta.starts[:, None]

    def chunk(self, slot: Tensor, start: Tensor, length: int) -> tuple[StepAttention, Tensor]:
        """A continued prompt chunk: `length` tokens from position start [1] of slot [1], attending to
        the slot's cached prefix in place. Positions [1, L]."""
        meta = AttentionMetadata.for_cache(slot, start, torch.full((1,), length, device=self.device), length,
                                           call_cost=self.call_cost)
        return meta, start[:, None] + torch.arange(length, device=self.device)[None, :]

    def packed(self, slots: Tensor, lengths: Tensor) -> tuple[StepAttention, Tensor]:
        """New prompts (from position 0) packed into one row, each into its slot. Positions [1, T]."""
        return AttentionMetadata.packed(slots, lengths)


class NativeCpuBackend(SdpaBackend):
    """The CPU kernels where they apply; SDPA (per sequence when batch-invariant) for the rest."""

    name = "native"

    def __init__(self, decode_kernel, prompt_kernel=None, batch_invariant: bool = True, head_dim: int | None = None):
        super().__init__("cpu", batch_invariant)
        self.decode_kernel = decode_kernel
        self.prompt_kernel = prompt_kernel
        self.head_dim = head_dim  # for describe(): whether prompts take the AMX tiles

    def describe(self) -> str:
        if self.prompt_kernel is None:
            return "native decode-attention kernel, SDPA for prompts"
        amx = self.head_dim is not None and self.prompt_kernel.uses_amx(self.head_dim)
        return "native decode-attention kernel, native prompt-attention kernel" + (" (amx)" if amx else "")

    def decode(self, slots: list[int], starts: list[int]) -> tuple[StepAttention, Tensor]:
        starts_t = torch.tensor(starts)
        repeats = len(set(slots)) < len(slots)
        return KernelDecode(self.decode_kernel, torch.tensor(slots), starts_t, repeats), starts_t[:, None]

    def chunk(self, slot: Tensor, start: Tensor, length: int) -> tuple[StepAttention, Tensor]:
        if self.prompt_kernel is None:
            return super().chunk(slot, start, length)
        j = torch.arange(length)
        pos = start + j  # [L]
        return KernelPrompt(self.prompt_kernel, torch.zeros_like(j), j, slot.expand(length), pos,
                            self.decode_kernel), pos[None]

    def packed(self, slots: Tensor, lengths: Tensor) -> tuple[StepAttention, Tensor]:
        if self.prompt_kernel is None:
            return super().packed(slots, lengths)
        seg, pos = packed_positions(lengths)  # [T], [T]
        return KernelPrompt(self.prompt_kernel, torch.zeros_like(pos), torch.arange(pos.shape[0]), slots[seg], pos,
                            self.decode_kernel), pos[None]


class CudaGraphsBackend(SdpaBackend):
    """SDPA, with decode steps of static shape (every slot, every position, masked by each slot's
    length) for capture as CUDA graphs: built from tensor ops alone, no host sync."""

    name = "cuda-graphs"

    def describe(self) -> str:
        return "SDPA, decode steps captured as CUDA graphs"

    @staticmethod
    def static_decode(slots: Tensor, positions: Tensor, num_slots: int, max_len: int) -> StepAttention:
        return AttentionMetadata.static_decode(slots, positions, num_slots, max_len)

    def graph_decode(self, slots: Tensor, positions: Tensor, cache: KVCache) -> StepAttention:
        """The decode step attention a CUDA graph captures (cuda_graphs.DecodeGraphs): tensor ops only."""
        return self.static_decode(slots, positions, cache.num_slots, cache.max_len)


@dataclass(frozen=True)
class PagedStep:
    """One forward segment over a paged cache: its tokens' K/V written through the block table, then
    one kernel call (attention/paged.py) for all of them. Every token is real (the paged layouts have
    no padding): token t of the segment, row-major, is at slots[t], positions[t]."""

    kernel: object  # paged.paged_attention or paged.paged_attention_reference
    slots: Tensor  # [T]
    positions: Tensor  # [T]
    tiles: Tiles

    def attend(self, q: Tensor, k: Tensor, v: Tensor, cache, layer: int, window: int = 0,
               scale: float | None = None) -> Tensor:
        B, L, H, d = q.shape
        T, Hkv = B * L, k.shape[2]
        cache.write(layer, self.slots, self.positions, k.reshape(T, Hkv, d), v.reshape(T, Hkv, d))
        out = self.kernel(q.reshape(T, H, d), cache.k[layer], cache.v[layer], cache.block_table, self.slots,
                          self.positions, self.tiles, window=window, scale=scale)  # [T, H, d]
        return out.view(B, L, H * d)


class PagedBackend(SdpaBackend):
    """The paged kernel over a paged KV cache (model/paged_kv_cache.PagedKVCache), one call per layer and
    forward segment. Batch-invariant by construction, whatever `batch_invariant` says. `kernel`: None
    picks the Triton kernel where triton is installed, else the torch reference (slow: CPU tests only)."""

    name = "paged"

    def __init__(self, device: torch.device | str, cfg: ModelConfig, batch_invariant: bool = True, kernel=None):
        super().__init__(device, batch_invariant)
        self.kernel = kernel or (paged_attention if triton_available() else paged_attention_reference)
        self.block_m = tile_rows(cfg.num_heads, cfg.num_kv_heads)[0]  # tokens per query tile

    def describe(self) -> str:
        how = "triton" if self.kernel is paged_attention else "torch reference"
        return f"paged varlen attention ({how}), decode steps captured as CUDA graphs" if self.device.type == "cuda" \
            else f"paged varlen attention ({how})"

    def _step(self, slots: Tensor, positions: Tensor, runs: list[int]) -> PagedStep:
        return PagedStep(self.kernel, slots, positions, Tiles.of_runs(runs, self.block_m, self.device))

    def decode(self, slots: list[int], starts: list[int]) -> tuple[StepAttention, Tensor]:
        """One token per row (rows may share a slot at consecutive positions: a verified draft; every row's
        K/V is written before the call, and each row attends alone as a decode row would)."""
        slots_t = host_to_device(slots, torch.long, self.device)
        starts_t = host_to_device(starts, torch.long, self.device)
        return PagedStep(self.kernel, slots_t, starts_t, Tiles.single(len(slots), self.device)), starts_t[:, None]

    def chunk(self, slot: Tensor, start: Tensor, length: int) -> tuple[StepAttention, Tensor]:
        pos = start + torch.arange(length, device=self.device)  # [L]
        return self._step(slot.expand(length), pos, [length]), pos[None]

    def packed(self, slots: Tensor, lengths: Tensor) -> tuple[StepAttention, Tensor]:
        seg, pos = packed_positions(lengths)  # [T], [T]
        return self._step(slots[seg], pos, lengths.tolist()), pos[None]

    def graph_decode(self, slots: Tensor, positions: Tensor, cache) -> StepAttention:
        """A decode step for a CUDA graph: tensor ops only; the kernel walks each row's pages up to its
        own position (the block table is read in place: pages mapped later are seen by later replays)."""
        return PagedStep(self.kernel, slots, positions, Tiles.single(slots.shape[0], slots.device))


def choose_backend(device: torch.device, dtype: torch.dtype, cfg: ModelConfig, batch_invariant: bool,
                   lib=None) -> SdpaBackend:
    """The backend for this device, dtype and head shape. `lib`: the native library (native.build) on
    CPU, None when it could not be built. On CUDA: the paged kernel over a paged cache where triton is
    installed (PagedBackend), else SDPA over a dense cache (CudaGraphsBackend); either way the engine
    captures decode steps as graphs unless told not to (`graph_decode`)."""
    if device.type == "cuda":
        if triton_available():
            return PagedBackend(device, cfg, batch_invariant)
        return CudaGraphsBackend(device, batch_invariant)
    if device.type != "cpu" or lib is None:
        return SdpaBackend(device, batch_invariant)
    from .decode import DecodeAttention
    from .prompt import PromptAttention

    shape = (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads)
    if not DecodeAttention.supports(dtype, *shape):
        return SdpaBackend(device, batch_invariant)
    prompt = PromptAttention(lib) if PromptAttention.supports(dtype, *shape) and PromptAttention.built(lib) else None
    return NativeCpuBackend(DecodeAttention(lib), prompt, batch_invariant, cfg.head_dim)
