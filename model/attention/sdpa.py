"""The SDPA attention backend's per-step metadata: attention over a slot-indexed KV cache with SDPA.

Mask convention everywhere: boolean, True = may attend (SDPA's `attn_mask`). A mask is never
combined with `is_causal`; a call over exactly one prompt's own tokens uses `is_causal` alone.
The model hands SDPA the mask in additive form (0 / -inf), converted once per step
(`AttentionMetadata.folded_mask`); every real query row keeps at least one key. SDPA scales by
1/sqrt(d) itself, so q is never pre-divided, and inference passes dropout_p=0.0.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from .plan import AttentionCall, cache_calls, packed_calls

if TYPE_CHECKING:
    from ..kv_cache import KVCache


def packed_positions(q_lens: Tensor) -> tuple[Tensor, Tensor]:
    """Prompts packed back to back into one row: each token's prompt index and own position [T], [T]."""
    seg = torch.repeat_interleave(torch.arange(q_lens.shape[0], device=q_lens.device), q_lens)  # [T]
    pos = torch.arange(seg.shape[0], device=q_lens.device) - (torch.cumsum(q_lens, 0) - q_lens)[seg]  # [T]
    return seg, pos


@dataclass(frozen=True)
class AttentionMetadata:
    """Where one forward step's tokens live and what they may attend to; shared by all layers.

    Two layouts:
    - fresh: keys are this chunk's own k/v (prefill from position 0, or training). Mask rows
      are the batch rows: mask [B, 1, L, L] = causal AND key-valid.
    - cache: keys are read from the KV cache as a *view* over the slot range [lo, hi)
      (no gather, no copy). Sequence b sits at row `rows[b]` of that view; queries are
      scattered to those rows when the batch is not exactly the range in order.

    `calls` is how the serving path runs the cache layout: several SDPA calls, each over a
    narrower view (attention_plan). `mask`, `lo`, `hi`, `rows` describe the same attention as
    one call (what a reference implementation of the same step reads).

    Every layer calls `attend` (model/attention/backend.py: the step attention protocol).
    """

    q_lens: Tensor  # [B] real (unpadded) query tokens per sequence
    mask: Tensor  # [R, 1, L, S] bool, True = may attend (R = B when fresh, hi - lo when cache)
    read_cache: bool = False
    slots: Tensor | None = None  # [B] cache slot of each sequence; None = no cache at all
    starts: Tensor | None = None  # [B] tokens already in the cache before this chunk
    lo: int = 0
    hi: int = 0
    rows: Tensor | None = None  # [B] row of each sequence in the cache view; None = identity
    write_b: Tensor | None = None  # [T] batch index of each real token
    write_j: Tensor | None = None  # [T] chunk offset of each real token
    write_slot: Tensor | None = None  # [T] slot of each real token
    write_pos: Tensor | None = None  # [T] cache position of each real token
    calls: tuple[AttentionCall, ...] = ()  # the same attention split into SDPA calls over cache views
    # each mask row's query position, on the mask's key axis ([R, 1, L, 1]; None: the row index, as in the
    # fresh and packed layouts): a sliding layer's query at p sees keys p - w + 1 .. p (window_mask)
    query_pos: Tensor | None = None

    @functools.cached_property
    def _folded(self) -> dict[tuple, Tensor]:
        return {}

    def folded_mask(self, group: int, dtype: torch.dtype | None = None, window: int = 0) -> Tensor:
        """mask (window_mask(window) for a sliding layer) repeated for `group` query heads per KV head:
        [R, 1, group*L, S]; built once per step.

        With a dtype: the additive form (0 = may attend, -inf = blocked), which SDPA would
        otherwise rebuild from the boolean mask inside every layer's call.
        """
        key = (group, dtype, window)
        if key not in self._folded:
            mask = self.window_mask(window) if window else self.mask
            mask = mask if group == 1 else mask.repeat(1, 1, group, 1)
            if dtype is not None:
                mask = additive(mask, dtype)
            self._folded[key] = mask
        return self._folded[key]

    def window_mask(self, window: int) -> Tensor:
        """mask, each query at position p cut to keys p - window + 1 .. p; a row left with no key (a padding
        query past its sequence) keeps key 0, so that no row is all masked (NaN)."""
        key = ("window", window)
        if key not in self._folded:
            S = self.mask.shape[-1]
            ar = torch.arange(S, device=self.mask.device)
            qpos = self.query_pos if self.query_pos is not None else torch.arange(self.mask.shape[-2], device=ar.device)[:, None]
            mask = self.mask & (ar > qpos - window)  # [R, 1, L, S]
            self._folded[key] = mask | (~mask.any(-1, keepdim=True) & (ar == 0))
        return self._folded[key]

    def causal_window(self, n: int, window: int, dtype: torch.dtype) -> Tensor:
        """The additive mask [1, 1, n, n] of one prompt's own n tokens from position 0 in a sliding layer."""
        key = ("causal", n, window, dtype)
        if key not in self._folded:
            ar = torch.arange(n, device=self.mask.device)
            d = ar[:, None] - ar[None, :]  # [n, n] query - key
            self._folded[key] = additive(((d >= 0) & (d < window))[None, None], dtype)
        return self._folded[key]

    @property
    def batch_size(self) -> int:
        return self.q_lens.shape[0]

    def write(self, k: Tensor, v: Tensor, cache: KVCache, layer: int) -> None:
        """This step's real tokens' k/v [B, L, Hkv, d] into the cache, each at its explicit position."""
        cache.write(layer, self.write_slot, self.write_pos, k[self.write_b, self.write_j], v[self.write_b, self.write_j])

    def attend(self, q: Tensor, k: Tensor, v: Tensor, cache: KVCache | None, layer: int, window: int = 0,
               scale: float | None = None) -> Tensor:
        """Rotated q [B, L, H, d], k, v [B, L, Hkv, d] -> attention [B, L, H*d] (before o_proj): the
        cache write (when there is a cache), then the planned calls over cache views, or one call over
        the chunk's own keys (fresh layout). window: the layer's sliding window (0: none); scale: of the
        scores (None: 1 / sqrt(d))."""
        B, L, H, d = q.shape
        if cache is not None and cache.quantized:
            raise TypeError("an int8 KV cache is served by the native attention kernels only, not SDPA")
        if cache is not None and self.write_b is not None:
            self.write(k, v, cache, layer)
        q = q.transpose(1, 2)  # [B, H, L, d]
        if self.calls:
            out = attend_calls(q, cache.k[layer], cache.v[layer], self, window, scale)  # [B, H, L, d]
        else:
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, L, d]
            out = sdpa_attention(q, k, v, self.folded_mask(H // k.shape[1], q.dtype, window), scale)
        return out.transpose(1, 2).reshape(B, L, H * d)

    @staticmethod
    def causal_padded(q_lens: Tensor, L: int | None = None) -> Tensor:
        """mask [B, 1, L, L]: query i sees key j iff j <= i and j < q_len (padding keys blocked)."""
        L = int(q_lens.max()) if L is None else L
        ar = torch.arange(L, device=q_lens.device)
        causal = ar[None, :] <= ar[:, None]  # [L, L]
        key_valid = ar[None, :] < q_lens[:, None]  # [B, L]
        return (causal[None] & key_valid[:, None, :])[:, None]  # [B, 1, L, L]

    @classmethod
    def fresh(cls, q_lens: Tensor, L: int | None = None) -> "AttentionMetadata":
        """No cache: training, scoring, or a reference forward."""
        return cls(q_lens=q_lens, mask=cls.causal_padded(q_lens, L))

    @classmethod
    def packed(cls, slots: Tensor, q_lens: Tensor) -> tuple["AttentionMetadata", Tensor]:
        """Fresh prompts (all from position 0) packed into ONE row with no padding at all.

        Token t of the row belongs to sequence seg[t]; it sees key u iff u <= t and seg[u] == seg[t]
        (causal AND same sequence). Returns the metadata and positions [1, T] (each sequence's own
        0, 1, 2, ...). K/V go to each sequence's slot as with `for_cache`.
        """
        device = q_lens.device
        T = int(q_lens.sum())
        ar = torch.arange(T, device=device)
        seg, pos = packed_positions(q_lens)  # [T], [T]
        mask = (seg[:, None] == seg[None, :]) & (ar[None, :] <= ar[:, None])  # [T, T]
        meta = cls(q_lens=torch.full((1,), T, device=device), mask=mask[None, None], read_cache=False,
                   slots=slots, starts=torch.zeros_like(slots), write_b=torch.zeros_like(ar), write_j=ar,
                   write_slot=slots[seg], write_pos=pos, calls=packed_calls(slots, q_lens))
        return meta, pos[None]

    @classmethod
    def static_decode(cls, slots: Tensor, positions: Tensor, num_slots: int, max_len: int) -> "AttentionMetadata":
        """One token per sequence (sequence b at cache position positions[b] of slot slots[b]),
        attending over the whole cache: every slot, all max_len keys, masked by each slot's length.

        Built from tensor ops alone, with shapes fixed by (B, num_slots, max_len): no host sync, so a
        decode step can be captured in a CUDA graph and replayed with new slots and positions. It
        reads every slot's keys in full, which suits a GPU (a launch costs more than those reads).
        A row may repeat another row (same slot, position and token): it writes the same K/V.
        """
        device = slots.device
        B = slots.shape[0]
        kv_len = torch.zeros(num_slots, dtype=positions.dtype, device=device).index_put_((slots,), positions + 1)
        mask = torch.arange(max_len, device=device)[None, :] < kv_len[:, None]  # [num_slots, S]
        mask[:, 0] = True  # slots outside the batch: one harmless key, no NaN
        ar = torch.arange(B, device=device)
        call = AttentionCall(batch=slice(0, B), tokens=slice(0, 1), lo=0, hi=num_slots, length=max_len,
                             mask_rows=slice(0, num_slots), rows=slots)
        return cls(q_lens=torch.ones_like(slots), mask=mask[:, None, None, :], read_cache=True, slots=slots,
                   starts=positions, lo=0, hi=num_slots, rows=slots, write_b=ar, write_j=torch.zeros_like(ar),
                   write_slot=slots, write_pos=positions, calls=(call,),
                   query_pos=(kv_len - 1).clamp(min=0)[:, None, None, None])

    @classmethod
    def for_decode(cls, slots: list[int], starts: list[int], device: torch.device | str,
                   call_cost: int | None = None) -> "AttentionMetadata":
        """One new token per sequence (b writes slot slots[b] at position starts[b] and attends to
        keys 0..starts[b]): the same attention as `for_cache(slots, starts, ones, 1)` with every
        start > 0, built from host lists in a handful of tensor ops (a decode step's input cost
        is all host time on a fast device)."""
        B = len(slots)
        slots_t = torch.tensor(slots, device=device)
        starts_t = torch.tensor(starts, device=device)
        lo, hi = min(slots), max(slots) + 1
        kv_len = [s + 1 for s in starts]
        row_len = [1] * (hi - lo)  # slots outside the batch: one harmless key, no NaN
        for s, n in zip(slots, kv_len):
            row_len[s - lo] = n
        S = max(kv_len)
        mask = torch.arange(S, device=device)[None, :] < torch.tensor(row_len, device=device)[:, None]  # [R, S]
        identity = hi - lo == B and all(s == lo + b for b, s in enumerate(slots))
        ar = torch.arange(B, device=device)
        return cls(q_lens=torch.ones(B, dtype=torch.long, device=device), mask=mask[:, None, None, :], read_cache=True,
                   slots=slots_t, starts=starts_t, lo=lo, hi=hi, rows=None if identity else slots_t - lo,
                   write_b=ar, write_j=torch.zeros_like(ar), write_slot=slots_t, write_pos=starts_t,
                   calls=cache_calls(slots, kv_len, 1, device, call_cost),
                   query_pos=torch.tensor([n - 1 for n in row_len], device=device)[:, None, None, None])

    @classmethod
    def for_rows(cls, slots: list[int], starts: list[int], device: torch.device | str) -> "AttentionMetadata":
        """One token per row, rows attending alone: b writes slot slots[b] at position starts[b], then
        attends over keys 0..starts[b] of that slot in a call of its own. Slots may repeat (a
        speculative draft verified as consecutive positions of one sequence): every row's K/V is
        written before any row attends. Each call is exactly the call a decode row of that sequence at
        that position gets in batch-invariant serving (`for_decode` with call_cost 0)."""
        B = len(slots)
        slots_t = torch.tensor(slots, device=device)
        starts_t = torch.tensor(starts, device=device)
        S = max(starts) + 1
        mask = torch.arange(S, device=device)[None, :] <= starts_t[:, None]  # [B, S]
        ar = torch.arange(B, device=device)
        calls = tuple(AttentionCall(batch=slice(b, b + 1), tokens=slice(0, 1), lo=s, hi=s + 1, length=p + 1,
                                    mask_rows=slice(b, b + 1), first_query=p) for b, (s, p) in enumerate(zip(slots, starts)))
        return cls(q_lens=torch.ones(B, dtype=torch.long, device=device), mask=mask[:, None, None, :], read_cache=True,
                   slots=slots_t, starts=starts_t, lo=0, hi=0, write_b=ar, write_j=torch.zeros_like(ar),
                   write_slot=slots_t, write_pos=starts_t, calls=calls, query_pos=starts_t[:, None, None, None])

    @classmethod
    def for_cache(cls, slots: Tensor, starts: Tensor, q_lens: Tensor, L: int | None = None,
                  call_cost: int | None = None) -> "AttentionMetadata":
        """Tokens of sequence b go to cache slot slots[b] at positions starts[b] + j, j < q_lens[b].

        call_cost: attention_plan's fixed cost of a call (None: the device's). 0 gives every
        sequence its own call over exactly its own keys: SDPA on CPU rounds differently when a
        row's keys are padded with masked ones, so batch-invariant serving needs that.

        When every sequence starts at 0 the keys are the chunk itself (fresh layout); otherwise
        they are read back from the cache view covering the slots involved.
        """
        device = q_lens.device
        B = q_lens.shape[0]
        L = int(q_lens.max()) if L is None else L
        j = torch.arange(L, device=device)
        valid = j[None, :] < q_lens[:, None]  # [B, L]
        write_b, write_j = valid.nonzero(as_tuple=True)  # [T], [T]
        write_slot = slots[write_b]
        write_pos = starts[write_b] + write_j
        common = dict(q_lens=q_lens, slots=slots, starts=starts, write_b=write_b, write_j=write_j,
                      write_slot=write_slot, write_pos=write_pos)
        if not bool((starts > 0).any()):
            return cls(mask=cls.causal_padded(q_lens, L), read_cache=False, **common)

        lo, hi = int(slots.min()), int(slots.max()) + 1
        rows = slots - lo  # [B]
        S = int((starts + q_lens).max())
        kv_len = starts + q_lens  # [B]
        k = torch.arange(S, device=device)
        # query j of sequence b sits at absolute position starts[b] + j and sees keys k <= that, k < kv_len
        qpos = starts[:, None] + j[None, :]  # [B, L]
        seq_mask = (k[None, None, :] <= qpos[:, :, None]) & (k[None, None, :] < kv_len[:, None, None])  # [B, L, S]
        mask = torch.zeros(hi - lo, L, S, dtype=torch.bool, device=device)
        mask[:, :, 0] = True  # rows of slots outside the batch: one harmless key, no NaN
        mask[rows] = seq_mask
        query_pos = torch.zeros(hi - lo, L, dtype=qpos.dtype, device=device)
        query_pos[rows] = qpos
        identity = (hi - lo == B) and bool((rows == torch.arange(B, device=device)).all())
        return cls(mask=mask[:, None], read_cache=True, lo=lo, hi=hi, rows=None if identity else rows,
                   calls=cache_calls(slots.tolist(), kv_len.tolist(), L, device, call_cost),
                   query_pos=query_pos[:, None, :, None], **common)


def additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean mask (True = may attend) as SDPA's additive one: 0 where it may, -inf where not."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None = None) -> Tensor:
    """Grouped-query attention through SDPA without repeating K/V.

    q [N, H, L, d], k/v [N, Hkv, S, d] (may be strided views of the cache).
    The G = H / Hkv query heads sharing one KV head are folded into the query-length axis,
    so K/V are read in place. mask is [N, 1, L, S], or already folded [N, 1, G*L, S]
    (AttentionMetadata.folded_mask) so that the repeat is paid once per step, not per layer.
    """
    N, H, L, d = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    if G > 1:
        q = q.reshape(N, Hkv, G * L, d)  # [N, Hkv, G*L, d] (head h = kv*G + g)
        if mask.shape[2] != G * L:
            mask = mask.repeat(1, 1, G, 1)  # [N, 1, G*L, S]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=scale)
    return out.reshape(N, H, L, d)


def attend_calls(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, window: int = 0,
                 scale: float | None = None) -> Tensor:
    """Run meta.calls (attention_plan) for queries q [B, H, L, d] against one layer's cache
    k_cache, v_cache [slots, Hkv, max_len, d]. Returns [B, H, L, d]; K/V are read as views. In a sliding
    layer (window > 0) a call reads keys from its lowest query's window start on."""
    G = q.shape[1] // k_cache.shape[1]
    out = torch.zeros_like(q)  # every real query is covered by a call; padding rows stay 0
    for c in meta.calls:
        qc = q[c.batch, :, c.tokens]  # [n, H, Lq, d]
        if c.mask_rows is None:  # a whole prompt from position 0: causal is the entire mask (windowed if it slides)
            k, v = k_cache[c.lo: c.hi, :, : c.length], v_cache[c.lo: c.hi, :, : c.length]  # [1, Hkv, S, d] views
            if window and c.length > window:
                o = F.scaled_dot_product_attention(qc, k, v, attn_mask=meta.causal_window(c.length, window, q.dtype),
                                                   dropout_p=0.0, enable_gqa=G > 1, scale=scale)
            else:
                o = F.scaled_dot_product_attention(qc, k, v, dropout_p=0.0, is_causal=True, enable_gqa=G > 1, scale=scale)
        else:
            k0 = max(0, c.first_query - window + 1) if window else 0  # keys before it are outside every window
            k, v = k_cache[c.lo: c.hi, :, k0: c.length], v_cache[c.lo: c.hi, :, k0: c.length]  # [R, Hkv, S, d] views
            if c.rows is not None:
                scattered = qc.new_zeros(c.hi - c.lo, *qc.shape[1:])  # [R, H, Lq, d]
                scattered[c.rows] = qc
                qc = scattered
            mask = meta.folded_mask(G, q.dtype, window)[c.mask_rows, :, :, k0: c.length]  # [R, 1, G*Lq, S] view
            o = sdpa_attention(qc, k, v, mask, scale)  # [R, H, Lq, d]
            o = o if c.rows is None else o[c.rows]
        out[c.batch, :, c.tokens] = o
    return out
