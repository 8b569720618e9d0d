"""KV memory in the engine's terms: slots, the pages each running sequence holds, prefix-cache
entries with their pins, and eviction. Plain Python, no torch.

The KV cache (model/kv_cache.py) commits memory page by page: a page holds `page_tokens` positions
of one slot. The manager hands out slots, charges pages to the sequences that write them, keeps a
finished sequence's slot as a prefix-cache entry (prefix_cache.py) or hands its positions back to
the cache (`release`), and evicts the least recently used unpinned entries when memory runs out.
It decides nothing about who runs: when a running sequence needs pages that eviction cannot free,
the scheduler chooses whom to preempt.

Sliding-window layers keep only their window. A query at position q of a layer with window w reads
keys q - w + 1 .. q, so once no step can query below q (`slide`), that layer's pages wholly below
q - w + 1 are handed back. The layers are grouped by window (`window_classes`), and a KV page is
`page_tokens` positions of as many layers as the gcd of the groups' sizes (every layer where none
slides, as before): a sequence holding positions [0, n) whose layers of window w dropped their first
r_w pages holds sum(weight_w * (pages(n) - r_w)) pages, global layers' r being 0. A prefix entry
whose sliding layers dropped keys serves only hits whose window they still hold (`min_hit`).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Callable

from .prefix_cache import PrefixCache, PrefixEntry
from .sequence import Sequence


class SlotAllocator:
    """Hands out the lowest free slot, or the highest one when asked, which keeps live slots dense
    at both ends (cache views stay small)."""

    def __init__(self, num_slots: int):
        self.capacity = num_slots
        self._free = list(range(num_slots))
        self.allocated_total = 0
        self.freed_total = 0

    @property
    def used(self) -> int:
        return self.capacity - len(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, from_top: bool = False) -> int | None:
        if not self._free:
            return None
        self.allocated_total += 1
        if not from_top:
            return heapq.heappop(self._free)
        top = max(self._free)
        self._free.remove(top)
        heapq.heapify(self._free)
        return top

    def free(self, slot: int) -> None:
        self.freed_total += 1
        heapq.heappush(self._free, slot)


@dataclass(frozen=True)
class WindowClass:
    """Layers of one sliding window (0: global), and the KV pages one position page of them costs."""

    window: int
    layers: tuple[int, ...] | None  # None: every layer of the model
    weight: int


def window_classes(layer_windows: tuple[int, ...] = ()) -> tuple[WindowClass, ...]:
    """The layers grouped by window, each group's weight its size over the gcd of the sizes; ()
    (no layer slides, or a dense cache that keeps every position): one global class of weight 1."""
    if not any(layer_windows):
        return (WindowClass(0, None, 1),)
    groups: dict[int, list[int]] = {}
    for layer, w in enumerate(layer_windows):
        groups.setdefault(w, []).append(layer)
    unit = math.gcd(*(len(g) for g in groups.values()))
    every = len(groups) == 1
    return tuple(WindowClass(w, None if every else tuple(g), len(g) // unit) for w, g in sorted(groups.items()))


def page_weight(layer_windows: tuple[int, ...] = ()) -> int:
    """KV pages of one position page in every layer (the sum of window_classes' weights)."""
    return sum(c.weight for c in window_classes(layer_windows))


@dataclass(eq=False)
class _Holding:
    """What a running sequence's slot holds: positions [0, pages * page_tokens) in global layers, and in
    each sliding class (in window_classes' order) from its dropped pages on."""

    pages: int = 0
    dropped: list[int] = field(default_factory=list)


class KvManager:
    """`kv_pages`: KV memory in pages of `page_tokens` positions (None: unlimited). `release(slot,
    upto[, start, layers])`: hands a slot's positions back (the KV cache's `release`). `prefix_tag(seq)`:
    the prefix-cache tag of a sequence's K/V (prefix_cache.py; default 0 for all). `layer_windows`: the
    model's window per layer (ModelConfig.layer_windows) where the cache hands sliding layers' pages
    back; () counts every layer at full length. `map_pages(slot, positions)`: a cache that maps pages on
    demand (model/paged_kv_cache.py) maps those of positions [0, positions) of the slot, called whenever a
    sequence's charge grows, so the pages mapped are the pages charged (None: the cache commits memory as
    it is written)."""

    def __init__(self, num_slots: int, kv_pages: int | None = None, page_tokens: int = 1,
                 prefix_cache: PrefixCache | None = None, release: Callable[..., None] | None = None,
                 prefix_tag: Callable[[Sequence], int] | None = None, layer_windows: tuple[int, ...] = (),
                 map_pages: Callable[[int, int], None] | None = None):
        self.slots = SlotAllocator(num_slots)
        self.kv_pages = kv_pages
        self.page_tokens = page_tokens
        self.prefix_cache = prefix_cache
        self._release = release or (lambda slot, upto, start=0, layers=None: None)
        self._map = map_pages
        self.prefix_tag = prefix_tag or (lambda seq: 0)
        self.classes = window_classes(layer_windows)
        self._sliding = [i for i, c in enumerate(self.classes) if c.window]
        self.page_weight = page_weight(layer_windows)
        # the first query from which some sliding layer has a page wholly below its window (slide: nothing before)
        self._slides_from = min((self.classes[i].window for i in self._sliding), default=0) + page_tokens - 1
        self._held: dict[Sequence, _Holding] = {}  # what each running sequence's slot holds
        self._pinned: list[PrefixEntry] = []  # copy sources of the step being built
        # accounting (tests check that what was handed out came back)
        self.pages_used = 0  # running sequences' and prefix entries' pages
        self.pages_allocated_total = 0
        self.pages_freed_total = 0
        self.request_slots_total = 0  # slots handed to requests
        self.request_slots_returned_total = 0  # ... and given up (freed, or kept as a prefix entry)
        self.prefix_queried_tokens_total = 0
        self.prefix_hit_tokens_total = 0

    # ---- pages ---------------------------------------------------------------------------
    def pages(self, positions: int) -> int:
        """Position pages (of one layer) that positions [0, positions) span."""
        return -(-positions // self.page_tokens)

    def _dropped(self, window: int, first_query: int) -> int:
        """Pages of a layer of this window wholly below the window of a query at first_query."""
        return max(0, first_query - window + 1) // self.page_tokens

    def cost(self, positions: int, first_query: int = 0) -> int:
        """KV pages a slot holding positions [0, positions) holds once no query comes before first_query."""
        return sum(c.weight * (self.pages(positions) - (self._dropped(c.window, first_query) if c.window else 0))
                   for c in self.classes)

    @property
    def pages_free(self) -> int | None:
        return None if self.kv_pages is None else self.kv_pages - self.pages_used

    def held(self, seq: Sequence) -> int:
        """KV pages `seq` holds."""
        h = self._held.get(seq)
        if h is None:
            return 0
        return self.page_weight * h.pages - sum(self.classes[i].weight * d for i, d in zip(self._sliding, h.dropped))

    def open(self, seq: Sequence, positions: int, first_query: int = 0) -> None:
        """An admitted sequence holds positions [0, positions), its sliding layers from first_query's
        window on (a prefix hit copies no more: `copies`)."""
        self._held[seq] = _Holding(self.pages(positions), [self._dropped(self.classes[i].window, first_query)
                                                           for i in self._sliding])
        self._charge(self.held(seq))
        if self._map is not None:
            self._map(seq.slot, self._held[seq].pages * self.page_tokens)

    def _holding(self, seq: Sequence) -> _Holding:
        return self._held.setdefault(seq, _Holding(0, [0] * len(self._sliding)))

    def _grow(self, seq: Sequence, pages: int) -> None:
        """`pages` more position pages for a running sequence."""
        h = self._holding(seq)
        h.pages += pages
        self._charge(pages * self.page_weight)
        if self._map is not None:
            self._map(seq.slot, h.pages * self.page_tokens)

    def _charge(self, pages: int) -> None:
        self.pages_used += pages
        self.pages_allocated_total += pages

    def _uncharge(self, pages: int) -> None:
        self.pages_used -= pages
        self.pages_freed_total += pages

    def reserve(self, seq: Sequence, want: int, least: int) -> int:
        """Pages for positions [0, want) of a running sequence, or at least [0, least), evicting prefix
        entries as needed: the positions covered (>= least), or 0 when not even `least` fit."""
        if self.kv_pages is None:
            return want
        h = self._holding(seq)
        need = self.pages(want) - h.pages
        if need <= 0:
            return want
        self.evict_until_free(need * self.page_weight)
        more = self.pages_free // self.page_weight
        if more >= need:
            self._grow(seq, need)
            return want
        covered = (h.pages + more) * self.page_tokens
        if covered < least:
            return 0
        self._grow(seq, more)
        return min(want, covered)

    def grant(self, seq: Sequence, positions: int) -> int:
        """Pages for positions [0, positions) from free memory only (no eviction): the positions
        `seq` may write now, at most `positions`."""
        if self.kv_pages is None:
            return positions
        h = self._holding(seq)
        held = h.pages * self.page_tokens
        grant = max(0, min(self.pages(positions) - h.pages, self.pages_free // self.page_weight))
        if grant:
            self._grow(seq, grant)
        return min(positions, held + grant * self.page_tokens)

    def slide(self, seq: Sequence, first_query: int) -> None:
        """No step queries `seq` below first_query any more: its sliding layers' pages wholly below that
        query's window go back to the cache (and out of its charge)."""
        if not self._sliding or first_query < self._slides_from:
            return
        h = self._held.get(seq)
        if h is None or self.kv_pages is None:
            return
        for j, i in enumerate(self._sliding):
            c = self.classes[i]
            dropped = self._dropped(c.window, first_query)
            if dropped > h.dropped[j]:
                self._release(seq.slot, dropped * self.page_tokens, h.dropped[j] * self.page_tokens, c.layers)
                self._uncharge(c.weight * (dropped - h.dropped[j]))
                h.dropped[j] = dropped

    def copies(self, src: int, dst: int, hit: int) -> list[tuple[int, int, int, int, tuple[int, ...] | None]]:
        """The cache copies of a prefix hit of `hit` positions from slot src to dst, as (src, dst, end,
        start, layers) (KVCache.copy_prefix's arguments): every position of global layers, a sliding
        class's from the window of the hit's first query on (what `open` charges)."""
        out = []
        for c in self.classes:
            start = self._dropped(c.window, hit) * self.page_tokens if c.window else 0
            out.append((src, dst, hit, start, c.layers))
        if len(out) > 1 and all(start == 0 for *_, start, _ in out):
            return [(src, dst, hit, 0, None)]  # a hit inside every window: one copy of every layer
        return out

    # ---- eviction ------------------------------------------------------------------------
    def evict_until_free(self, pages: int) -> bool:
        """Evict LRU prefix entries until `pages` are free; False if that is not possible."""
        if self.kv_pages is None:
            return True
        while self.pages_free < pages:
            if not self.evict_one():
                return False
        return True

    def evict_one(self) -> bool:
        entry = self.prefix_cache.evict_lru() if self.prefix_cache is not None else None
        if entry is None:
            return False
        self._drop_entry(entry)
        return True

    def _drop_entry(self, entry: PrefixEntry) -> None:
        self._release(entry.slot, entry.span)
        self.slots.free(entry.slot)
        self._uncharge(entry.pages)

    def drop_prefix_cache(self) -> int:
        """Evict every prefix entry (not pinned); returns how many."""
        n = 0
        while self.evict_one():
            n += 1
        return n

    # ---- slots -------------------------------------------------------------------------
    def take_slot(self, from_top: bool) -> int | None:
        """A free slot for a request, evicting prefix entries while there is none; None: none at all."""
        slot = self.slots.allocate(from_top=from_top)
        while slot is None and self.evict_one():
            slot = self.slots.allocate(from_top=from_top)
        if slot is not None:
            self.request_slots_total += 1
        return slot

    def give_back(self, seq: Sequence, keep_as_prefix: bool = False) -> None:
        """A sequence's slot and pages, handed back or kept as a prefix-cache entry of its cached tokens."""
        pages = self.held(seq)
        h = self._held.pop(seq, None) or _Holding()
        span = h.pages * self.page_tokens if self.kv_pages is not None else seq.total_len + 1  # positions it may have written
        self.request_slots_returned_total += 1
        if keep_as_prefix:
            # a hit of m positions reads a sliding class's keys from m - w + 1 on: its dropped pages must lie below
            min_hit = max((d * self.page_tokens + self.classes[i].window - 1 for i, d in zip(self._sliding, h.dropped)
                           if d), default=0)
            entry, dominated = self.prefix_cache.insert(seq.slot, seq.all_tokens[: seq.num_cached], pages,
                                                        self.prefix_tag(seq), span=span, min_hit=min_hit)
            for old in dominated:  # a later turn of the same conversation covers these
                self._drop_entry(old)
            return
        self._release(seq.slot, span)
        self.slots.free(seq.slot)
        self._uncharge(pages)

    # ---- prefix hits ---------------------------------------------------------------------
    def match(self, seq: Sequence) -> tuple[PrefixEntry | None, int]:
        """The prefix entry sharing the longest prefix with what `seq` must prefill (at least its
        last token is computed), pinned (neither evicted nor dominated) until unpin(); and its length."""
        if self.prefix_cache is None:
            return None, 0
        entry, hit = self.prefix_cache.match(seq.all_tokens, seq.prefill_len - 1, self.prefix_tag(seq))
        if entry is not None:
            entry.pinned += 1
        return entry, hit

    def use(self, seq: Sequence, entry: PrefixEntry | None, hit: int) -> None:
        """`seq` was admitted with this hit (counted); its entry stays pinned until the step is launched."""
        if self.prefix_cache is None:
            return
        self.prefix_queried_tokens_total += seq.prefill_len
        self.prefix_hit_tokens_total += hit
        if entry is not None:
            self.prefix_cache.touch(entry)
            self._pinned.append(entry)

    def unpin(self, entry: PrefixEntry | None = None) -> None:
        """The given entry's pin (a hit not taken), or those of every hit of the step being built."""
        if entry is not None:
            entry.pinned -= 1
            return
        for e in self._pinned:
            e.pinned -= 1
        self._pinned = []


__all__ = ["KvManager", "SlotAllocator", "WindowClass", "page_weight", "window_classes"]
