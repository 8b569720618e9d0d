"""KV memory in the engine's terms: slots, the pages each running sequence holds, prefix-cache
entries with their pins, and eviction. Plain Python, no torch.

The KV cache (model/kv_cache.py) commits memory page by page: a page holds `page_tokens` positions
of one slot. The manager hands out slots, charges pages to the sequences that write them, keeps a
finished sequence's slot as a prefix-cache entry (prefix_cache.py) or hands its positions back to
the cache (`release`), and evicts the least recently used unpinned entries when memory runs out.
It decides nothing about who runs: when a running sequence needs pages that eviction cannot free,
the scheduler chooses whom to preempt.
"""

from __future__ import annotations

import heapq
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


class KvManager:
    """`kv_pages`: KV memory in pages of `page_tokens` positions (None: unlimited). `release(slot,
    positions)`: hands a slot's first positions back (the KV cache's `release`). `prefix_tag(seq)`:
    the prefix-cache tag of a sequence's K/V (prefix_cache.py; default 0 for all)."""

    def __init__(self, num_slots: int, kv_pages: int | None = None, page_tokens: int = 1,
                 prefix_cache: PrefixCache | None = None, release: Callable[[int, int], None] | None = None,
                 prefix_tag: Callable[[Sequence], int] | None = None):
        self.slots = SlotAllocator(num_slots)
        self.kv_pages = kv_pages
        self.page_tokens = page_tokens
        self.prefix_cache = prefix_cache
        self._release = release or (lambda slot, positions: None)
        self.prefix_tag = prefix_tag or (lambda seq: 0)
        self._held: dict[Sequence, int] = {}  # KV pages of each running sequence
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
        return -(-positions // self.page_tokens)

    @property
    def pages_free(self) -> int | None:
        return None if self.kv_pages is None else self.kv_pages - self.pages_used

    def held(self, seq: Sequence) -> int:
        """KV pages `seq` holds."""
        return self._held.get(seq, 0)

    def charge(self, seq: Sequence, pages: int) -> None:
        self._held[seq] = self._held.get(seq, 0) + pages
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
        need = self.pages(want) - self.held(seq)
        if need <= 0:
            return want
        self.evict_until_free(need)
        free = self.pages_free
        if free >= need:
            self.charge(seq, need)
            return want
        covered = (self.held(seq) + free) * self.page_tokens
        if covered < least:
            return 0
        self.charge(seq, free)
        return min(want, covered)

    def grant(self, seq: Sequence, positions: int) -> int:
        """Pages for positions [0, positions) from free memory only (no eviction): the positions
        `seq` may write now, at most `positions`."""
        if self.kv_pages is None:
            return positions
        held = self.held(seq) * self.page_tokens
        grant = max(0, min(self.pages(positions) - self.held(seq), self.pages_free))
        if grant:
            self.charge(seq, grant)
        return min(positions, held + grant * self.page_tokens)

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
        self._release(entry.slot, entry.pages * self.page_tokens)
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
        pages = self._held.pop(seq, 0)
        self.request_slots_returned_total += 1
        if keep_as_prefix:
            entry, dominated = self.prefix_cache.insert(seq.slot, seq.all_tokens[: seq.num_cached], pages,
                                                        self.prefix_tag(seq))
            for old in dominated:  # a later turn of the same conversation covers these
                self._drop_entry(old)
            return
        self._release(seq.slot, pages * self.page_tokens if self.kv_pages is not None else seq.total_len + 1)
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


__all__ = ["KvManager", "SlotAllocator"]
