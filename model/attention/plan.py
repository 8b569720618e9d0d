"""How one step's attention is split into SDPA calls over the KV cache.

One call over every sequence of a step is the simplest plan, but SDPA then reads, for every
sequence, as many keys as the longest one has, and packed prompts attend over the whole
packed row (T x T) although each may only see its own tokens. The plan here:

- packed new prompts: one call per prompt over its own slot (causal L x L); on a GPU one
  masked call over the packed row instead (launches cost more there than the mask);
- decode / continuation chunks: sequences sorted by slot, cut into runs of neighbouring
  slots so that each call reads (slots spanned) x (longest in the run) keys, minimising
  that total plus a fixed cost per call (`CALL_COST_KEYS`, in key-rows: what launching one
  more SDPA call costs compared with reading keys; measured ~50 us vs ~0.15 us per key-row
  of K and V on a 2-core AVX2 CPU). On a GPU a launch costs ~10 us while a key-row of K and V
  streams in well under a nanosecond, so the cost there (`GPU_CALL_COST_KEYS`) makes one call
  per step the plan unless the keys it would waste run into the tens of thousands of rows.

Every call reads K/V as a view of the cache (no gather). A masked key contributes nothing,
so the result equals one big call up to float rounding (SDPA blocks the key axis differently).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

CALL_COST_KEYS = 256
GPU_CALL_COST_KEYS = 65536


def call_cost_for(device: torch.device) -> int:
    """The fixed cost of one more SDPA call, in key-rows read, on this kind of device."""
    return CALL_COST_KEYS if device.type == "cpu" else GPU_CALL_COST_KEYS


@dataclass(frozen=True)
class AttentionCall:
    """Queries `tokens` of batch rows `batch` attend to keys 0..length-1 of cache slots [lo, hi).

    mask_rows: the rows of the step's full mask (AttentionMetadata.mask, one row per slot from
    the step's lowest slot) that this call uses, cut to `length` keys; None = plain causal over
    the call's own tokens (a prompt starting at position 0). The sequence of batch row batch[i]
    sits at row rows[i] of the slot view (rows None: exactly the view's rows, in order).
    """

    batch: slice | Tensor  # [n] batch rows, or a slice of them
    tokens: slice  # query positions within each batch row
    lo: int
    hi: int
    length: int
    mask_rows: slice | None = None
    rows: Tensor | None = None
    first_query: int = 0  # the lowest position of a query in the call: a sliding layer reads keys from its window's start


def slot_runs(slots: list[int], kv_lens: list[int], call_cost: int = CALL_COST_KEYS) -> list[list[int]]:
    """Batch indices grouped into runs of slot-sorted sequences, minimising
    sum over runs of (call_cost + slots spanned * longest kv_len in the run). O(n^2), n <= batch.
    With no cost per call (batch-invariant serving) every sequence alone is optimal, and it is what
    the search returns (of equal costs it keeps the shortest last run): then no search, O(n log n)."""
    order = sorted(range(len(slots)), key=slots.__getitem__)
    if call_cost == 0:
        return [[b] for b in order]
    return searched_runs(order, slots, kv_lens, call_cost)


def searched_runs(order: list[int], slots: list[int], kv_lens: list[int], call_cost: int) -> list[list[int]]:
    """slot_runs' search over the cuts of `order` (the batch indices in slot order)."""
    n = len(order)
    best = [0] * (n + 1)
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest, best[j] = 0, -1
        for i in range(j, 0, -1):  # run = order[i-1 : j]
            longest = max(longest, kv_lens[order[i - 1]])
            cost = best[i - 1] + call_cost + (slots[order[j - 1]] - slots[order[i - 1]] + 1) * longest
            if best[j] < 0 or cost < best[j]:
                best[j], cut[j] = cost, i - 1
    runs, j = [], n
    while j > 0:
        runs.append(order[cut[j]: j])
        j = cut[j]
    return runs[::-1]


def cache_calls(slots: list[int], kv_lens: list[int], L: int, device: torch.device,
                call_cost: int | None = None) -> tuple[AttentionCall, ...]:
    """Calls for sequences reading the cache (kv_lens[b] = keys of sequence b after this step);
    call_cost defaults to the device's (call_cost_for)."""
    base = min(slots)
    cost = call_cost_for(torch.device(device)) if call_cost is None else call_cost
    if cost == 0:  # every sequence alone (slot_runs): the same calls, built without the general loop's checks
        tokens = slice(0, L)
        return tuple(AttentionCall(batch=slice(b, b + 1), tokens=tokens, lo=slots[b], hi=slots[b] + 1, length=kv_lens[b],
                                   mask_rows=slice(slots[b] - base, slots[b] - base + 1),
                                   first_query=max(0, kv_lens[b] - L)) for b in sorted(range(len(slots)), key=slots.__getitem__))
    calls = []
    for run in slot_runs(slots, kv_lens, cost):
        lo, hi = slots[run[0]], slots[run[-1]] + 1
        contiguous = run == list(range(run[0], run[0] + len(run)))
        batch = slice(run[0], run[-1] + 1) if contiguous else torch.tensor(run, device=device)
        rows = None if hi - lo == len(run) else torch.tensor([slots[b] - lo for b in run], device=device)
        calls.append(AttentionCall(batch=batch, tokens=slice(0, L), lo=lo, hi=hi, length=max(kv_lens[b] for b in run),
                                   mask_rows=slice(lo - base, hi - base), rows=rows,
                                   first_query=max(0, min(kv_lens[b] for b in run) - L)))
    return tuple(calls)


def packed_calls(slots: Tensor, q_lens: Tensor) -> tuple[AttentionCall, ...]:
    """One causal call per prompt of a packed row (batch row 0), each over its own slot.

    On a GPU: no calls, meaning one SDPA call over the whole row with its block-diagonal mask
    (AttentionMetadata.mask); a launch per prompt and layer costs more there than the T x T mask."""
    if slots.device.type != "cpu":
        return ()
    calls, start = [], 0
    for slot, n in zip(slots.tolist(), q_lens.tolist()):
        calls.append(AttentionCall(batch=slice(0, 1), tokens=slice(start, start + n), lo=slot, hi=slot + 1, length=n))
        start += n
    return tuple(calls)
