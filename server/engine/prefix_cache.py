"""Prefix cache: K/V of finished requests kept in their slots, found again by token prefix. Plain Python.

An entry is a KV slot holding positions [0, n) of a known token sequence. It is indexed by the
chained hashes of its full `block`-token prefixes (hash of block i covers blocks 0..i), so a
lookup walks the new prompt block by block and stops at the first hash no entry holds: O(prompt
blocks) dict probes, whatever the number of entries. The match found there is then checked token
by token against the entry (a hash collision cannot hand out wrong K/V) and extended past the last
full block, so a hit covers exactly the tokens shared, not only whole blocks.

The cache never touches tensors: the scheduler copies a hit's rows into the new request's slot
and hands an evicted entry's slot back. Entries are immutable; least recently used goes first.

A sliding-window layer's keys below its window are handed back as a sequence advances
(kv_manager.py), so an entry may hold only the last window of some layers: a hit of m positions is
then served only if every window it reads is still there (m >= `min_hit`); otherwise a shorter hit
from another entry, or none. An entry covering another's tokens replaces it only if it serves every
hit the other does.

A `tag` keeps apart K/V computed differently for the same tokens (a LongRoPE model rotates a
sequence whose prompt is long with other frequencies): an entry is found only by its own tag.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(eq=False)
class PrefixEntry:
    slot: int
    tokens: tuple[int, ...]  # the tokens whose K/V positions [0, len) of `slot` hold
    pages: int  # KV pages it holds (the scheduler's unit of KV memory)
    hashes: tuple[int, ...] = ()
    pinned: int = 0  # hits copied from it in the step being built: not evictable until that step ran
    hits: int = field(default=0, compare=False)
    tag: int = 0
    span: int = 0  # positions [0, span) of its slot that may have been written (handed back when it goes)
    min_hit: int = 0  # the shortest hit whose windows its sliding layers still hold (0: every layer keeps all)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


def block_hashes(tokens, block: int, limit: int | None = None, tag: int = 0) -> list[int]:
    """Chained hashes of the full blocks of tokens[:limit]: h[i] covers tokens[: (i + 1) * block] (and the tag)."""
    n = len(tokens) if limit is None else min(limit, len(tokens))
    out, h = [], tag
    for i in range(n // block):
        h = hash((h, tuple(tokens[i * block: (i + 1) * block])))
        out.append(h)
    return out


def common_prefix(a, b, start: int, end: int) -> int:
    """The first index in [start, end) where a and b differ, or end."""
    i = start
    while i < end and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    def __init__(self, block: int = 16):
        if block < 1:
            raise ValueError("block must be >= 1")
        self.block = block
        self._lru: OrderedDict[PrefixEntry, None] = OrderedDict()  # oldest first
        self._index: dict[int, dict[PrefixEntry, None]] = {}
        self.pages_held = 0
        self.evicted_total = 0

    def __len__(self) -> int:
        return len(self._lru)

    def entries(self) -> list[PrefixEntry]:
        return list(self._lru)

    # ---- lookup ---------------------------------------------------------------------
    def match(self, tokens, limit: int, tag: int = 0) -> tuple[PrefixEntry | None, int]:
        """The entry of this tag sharing the longest prefix with tokens[:limit] that it can serve (at
        least its min_hit), and that length (0: none)."""
        limit = min(limit, len(tokens))
        levels: list[dict[PrefixEntry, None]] = []  # entries sharing 1, 2, ... full blocks
        for h in block_hashes(tokens, self.block, limit, tag):
            found = self._index.get(h)
            if not found:
                break
            levels.append(found)
        judged: set[PrefixEntry] = set()  # each entry is judged at the deepest level it is found at
        for i in range(len(levels) - 1, -1, -1):  # deepest first: a shallower entry shares fewer tokens
            depth = (i + 1) * self.block
            best, best_len = None, 0
            head = tuple(tokens[:depth])
            for entry in levels[i]:
                if entry in judged:
                    continue
                judged.add(entry)
                if entry.tag != tag or entry.tokens[:depth] != head:  # a hash collision
                    continue
                n = common_prefix(entry.tokens, tokens, depth, min(limit, entry.num_tokens))
                if entry.min_hit <= n and n > best_len:  # a shorter hit would need keys it handed back
                    best, best_len = entry, n
            if best is not None:
                return best, best_len
        return None, 0

    def touch(self, entry: PrefixEntry) -> None:
        entry.hits += 1
        self._lru.move_to_end(entry)

    # ---- insert / evict ---------------------------------------------------------------
    def insert(self, slot: int, tokens, pages: int, tag: int = 0, span: int = 0,
               min_hit: int = 0) -> tuple[PrefixEntry, list[PrefixEntry]]:
        """Add an entry (at least one full block of tokens); returns it and the entries it makes
        redundant (their tokens are a prefix of its own, same tag, and it serves every hit they do),
        which the caller frees at once."""
        if len(tokens) < self.block:
            raise ValueError(f"an entry needs at least {self.block} tokens, got {len(tokens)}")
        entry = PrefixEntry(slot, tuple(tokens), pages, tuple(block_hashes(tokens, self.block, tag=tag)), tag=tag,
                            span=span, min_hit=min_hit)
        dominated = [e for e in self._covered_by(entry) if not e.pinned]
        for e in dominated:
            self.remove(e)
        self._lru[entry] = None
        for h in entry.hashes:
            self._index.setdefault(h, {})[entry] = None
        self.pages_held += pages
        return entry, dominated

    def _covered_by(self, entry: PrefixEntry) -> list[PrefixEntry]:
        pool = self._index.get(entry.hashes[0], {})  # every entry holds at least one full block
        return [e for e in pool if e.tag == entry.tag and e.num_tokens <= entry.num_tokens
                and entry.min_hit <= e.min_hit and entry.tokens[: e.num_tokens] == e.tokens]

    def remove(self, entry: PrefixEntry) -> None:
        del self._lru[entry]
        for h in entry.hashes:
            bucket = self._index.get(h)
            if bucket is not None:
                bucket.pop(entry, None)
                if not bucket:
                    del self._index[h]
        self.pages_held -= entry.pages

    def evict_lru(self) -> PrefixEntry | None:
        """Remove and return the least recently used unpinned entry (None: nothing evictable)."""
        for entry in self._lru:
            if not entry.pinned:
                self.remove(entry)
                self.evicted_total += 1
                return entry
        return None
