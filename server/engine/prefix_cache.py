"""Prefix cache: K/V of finished requests kept in their slots, found again by token prefix. Plain Python.

An entry is a KV slot holding positions [0, n) of a known token sequence. It is indexed by the
chained hashes of its full `block`-token prefixes (hash of block i covers blocks 0..i), so a
lookup walks the new prompt block by block and stops at the first hash no entry holds: O(prompt
blocks) dict probes, whatever the number of entries. The match found there is then checked token
by token against the entry (a hash collision cannot hand out wrong K/V) and extended past the last
full block, so a hit covers exactly the tokens shared, not only whole blocks.

The cache never touches tensors: the scheduler copies a hit's rows into the new request's slot
and hands an evicted entry's slot back. Entries are immutable; least recently used goes first.

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
        """The entry of this tag sharing the longest prefix with tokens[:limit], and that length (0: none)."""
        limit = min(limit, len(tokens))
        candidates: dict[PrefixEntry, None] | None = None
        depth = 0
        for h in block_hashes(tokens, self.block, limit, tag):
            found = self._index.get(h)
            if not found:
                break
            candidates, depth = found, depth + self.block
        if candidates is None:  # not one full block in common
            return None, 0
        best, best_len = None, 0
        head = tuple(tokens[:depth])
        for entry in candidates:
            if entry.tag != tag or entry.tokens[:depth] != head:  # a hash collision
                continue
            n = common_prefix(entry.tokens, tokens, depth, min(limit, entry.num_tokens))
            if n > best_len:
                best, best_len = entry, n
        return best, best_len

    def touch(self, entry: PrefixEntry) -> None:
        entry.hits += 1
        self._lru.move_to_end(entry)

    # ---- insert / evict ---------------------------------------------------------------
    def insert(self, slot: int, tokens, pages: int, tag: int = 0) -> tuple[PrefixEntry, list[PrefixEntry]]:
        """Add an entry (at least one full block of tokens); returns it and the entries it makes
        redundant (their tokens are a prefix of its own, same tag), which the caller frees at once."""
        if len(tokens) < self.block:
            raise ValueError(f"an entry needs at least {self.block} tokens, got {len(tokens)}")
        entry = PrefixEntry(slot, tuple(tokens), pages, tuple(block_hashes(tokens, self.block, tag=tag)), tag=tag)
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
                and entry.tokens[: e.num_tokens] == e.tokens]

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
