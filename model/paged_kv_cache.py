"""The paged KV cache: a pool of pages and a block table per slot (the GPU's cache; any device).

k, v: [layers, pages + 1, page_tokens, kv_heads, head_dim]. A slot's position p lies at
p % page_tokens of page block_table[slot, p // page_tokens], in every layer (a page id names the same
page of every layer's pool). Page 0 is a scratch page that no slot owns: every unmapped entry of the
block table points there, so a write to a position no page was mapped for (a CUDA graph's capture, a
start-up timing step) lands there harmlessly, and reads of such positions are never made (the
attention reads only positions 0..its own, which the KV manager mapped before the step).

Memory follows the tokens held: the KV manager (server/engine/kv_manager.py) maps pages for a
sequence's positions as it charges them (`map`) and hands them back when it uncharges them
(`release`); a sequence holds pages for the tokens it has, not for max_len, and the pool is the KV
budget. The same page accounting as the CPU's virtual cache (model/kv_cache.py): a page is
`page_tokens` positions of every layer.

Prefix hits share pages (`copy_prefix`): the new slot's block table points at the entry's full
pages (a reference count per page), and only a partially filled last page is copied (the new
sequence writes into it: copy on write, done at the hit). A shared page is never written: an entry
is immutable, and a sequence writes only positions past its hit. The manager still charges each
holder for its pages (its accounting is the same as on the CPU, where a hit copies): the pool never
runs out where the manager thinks pages are free; the sharing saves the copies and pool memory.

Sliding-window layers keep every position here (a page holds every layer): the engine counts them so
(no window classes), as for the dense cache. The block table lives on the cache's device (the
attention kernel and the writes read it there, inside CUDA graphs too); its host copy (`_pages`) is
the bookkeeping, each change applied to the device table in stream order.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .config import ModelConfig

PAGE_TOKENS = 16  # positions per page: what the attention kernel walks per block (vLLM's default too)


def _dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class PagedKVCache:
    """`num_pages` pages of `page_tokens` positions for `num_slots` slots of up to max_len positions each."""

    paged = True
    quantized = False
    virtual = False
    scales = None

    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, num_pages: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", page_tokens: int = PAGE_TOKENS):
        if num_slots < 1 or max_len < 1 or num_pages < 1:
            raise ValueError(f"a paged KV cache needs a slot, a position and a page "
                             f"(slots={num_slots}, max_len={max_len}, pages={num_pages})")
        if dtype == torch.int8:
            raise ValueError("an int8 KV cache is served by the native CPU attention kernels only, not paged")
        device = torch.device(device)
        self.page_tokens = page_tokens
        self.max_pages = -(-max_len // page_tokens)
        self.max_len = self.max_pages * page_tokens
        self.num_slots, self.num_pages = num_slots, num_pages
        self.shape = (cfg.num_layers, num_pages + 1, page_tokens, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(self.shape, dtype=dtype, device=device)
        self.v = torch.zeros(self.shape, dtype=dtype, device=device)
        self.block_table = torch.zeros(num_slots, self.max_pages, dtype=torch.int32, device=device)  # 0: unmapped
        self._pages: list[list[int]] = [[] for _ in range(num_slots)]  # each slot's page ids, in position order
        self._refs = [0] * (num_pages + 1)
        self._free = list(range(num_pages, 0, -1))  # a stack: the lowest id goes first
        self.bytes_per_page = page_tokens * self.bytes_per_token(cfg, dtype)

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
        """K and V bytes of one position over every layer and head."""
        return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * _dtype_size(dtype)

    @classmethod
    def from_budget(cls, cfg: ModelConfig, budget_bytes: int, max_len: int, num_slots: int, dtype: torch.dtype,
                    device: torch.device | str = "cpu", page_tokens: int = PAGE_TOKENS) -> "PagedKVCache":
        """As many pages as budget_bytes holds, for num_slots slots (a slot costs its block-table row only)."""
        page = page_tokens * cls.bytes_per_token(cfg, dtype)
        pages = budget_bytes // page
        if pages < -(-max_len // page_tokens):
            raise ValueError(f"KV budget of {budget_bytes / 2**20:.0f} MiB holds no request of {max_len} tokens "
                             f"({-(-max_len // page_tokens) * page / 2**20:.1f} MiB); raise the budget or lower "
                             "the context length")
        return cls(cfg, num_slots, max_len, int(pages), dtype, device, page_tokens)

    # ---- sizes ---------------------------------------------------------------------------
    @property
    def token_bytes(self) -> int:
        return self.bytes_per_page // self.page_tokens

    @property
    def nbytes(self) -> int:
        """Bytes of the K and V pools (the scratch page included) and the block table."""
        return 2 * self.k.numel() * self.k.element_size() + self.block_table.numel() * 4

    def pages(self, tokens: int) -> int:
        """Pages that `tokens` positions of one slot occupy."""
        return -(-tokens // self.page_tokens)

    @property
    def pages_free(self) -> int:
        return len(self._free)

    def mapped(self, slot: int) -> list[int]:
        """The page ids slot maps, in position order (a copy)."""
        return list(self._pages[slot])

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def scale_views(self, layer: int) -> tuple[None, None]:
        return None, None

    # ---- pages ---------------------------------------------------------------------------
    def _take(self) -> int:
        if not self._free:
            raise RuntimeError(f"the paged KV cache has no free page left ({self.num_pages} pages): the KV "
                               "manager mapped more than its budget")
        page = self._free.pop()
        self._refs[page] = 1
        return page

    def _drop(self, page: int) -> None:
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._free.append(page)

    def _sync(self, slot: int, first: int, last: int) -> None:
        """Entries [first, last) of slot's row of the device table from the host's pages (0 past them)."""
        if last <= first:
            return
        ids = self._pages[slot][first:last]
        row = torch.tensor(ids + [0] * (last - first - len(ids)), dtype=torch.int32)
        if self.block_table.is_cuda:  # from pinned memory, in stream order, without waiting for the device:
            # pages are mapped while the previous step still runs (overlapped steps); the caching host
            # allocator keeps the pinned row until its copy has run
            self.block_table[slot, first:last].copy_(row.pin_memory(), non_blocking=True)
        else:
            self.block_table[slot, first:last].copy_(row)

    def map(self, slot: int, positions: int) -> None:
        """Pages for positions [0, positions) of slot: those not mapped yet are taken from the pool."""
        pages = self._pages[slot]
        want = min(self.pages(positions), self.max_pages)
        holes = [i for i in range(min(want, len(pages))) if pages[i] == 0]
        if want <= len(pages) and not holes:
            return
        first = holes[0] if holes else len(pages)
        for i in holes:
            pages[i] = self._take()
        pages.extend(self._take() for _ in range(want - len(pages)))
        self._sync(slot, first, want)

    def release(self, slot: int, upto: int | None = None, start: int = 0, layers: tuple[int, ...] | None = None) -> None:
        """Hand back slot's pages for positions [start, upto) (all by default): `upto` rounds up to a page,
        `start` must begin one. A page shared with another slot stays with it. Every layer at once: a page
        holds them all (`layers` other than None is refused)."""
        if layers is not None:
            raise ValueError("a paged KV cache hands pages back for every layer at once")
        if start % self.page_tokens:
            raise ValueError(f"a release starts on a page: {start} is not a multiple of {self.page_tokens} positions")
        pages = self._pages[slot]
        first = start // self.page_tokens
        last = min(len(pages), self.max_pages if upto is None else self.pages(upto))
        if last <= first:
            return
        for i in range(first, last):
            if pages[i]:
                self._drop(pages[i])
                pages[i] = 0
        while pages and pages[-1] == 0:
            pages.pop()
        self._sync(slot, first, last)

    def copy_prefix(self, src: int, dst: int, length: int, start: int = 0, layers: tuple[int, ...] | None = None) -> None:
        """Positions [0, length) of slot src serve slot dst (a prefix-cache hit): dst's first full pages
        become src's (shared), and the page holding a partial last page is dst's own copy of src's.
        `start` and `layers` (what a copying cache may skip) change nothing here."""
        full, part = divmod(min(length, self.max_len), self.page_tokens)
        s, d = self._pages[src], self._pages[dst]
        if len(s) < full + (part > 0):
            raise ValueError(f"slot {src} maps {len(s)} pages, fewer than {length} positions need")
        d.extend([0] * (full + (part > 0) - len(d)))  # holes, filled below
        for i in range(full):
            if d[i] != s[i]:
                if d[i]:
                    self._drop(d[i])
                d[i] = s[i]
                self._refs[s[i]] += 1
        if part:
            if d[full] == 0:
                d[full] = self._take()
            elif self._refs[d[full]] > 1:  # shared: dst gets a page of its own before it writes
                self._drop(d[full])
                d[full] = self._take()
            self.k[:, d[full]].copy_(self.k[:, s[full]])
            self.v[:, d[full]].copy_(self.v[:, s[full]])
        self._sync(dst, 0, full + (part > 0))

    # ---- tokens --------------------------------------------------------------------------
    def write(self, layer: int, slot_idx: Tensor, pos_idx: Tensor, k: Tensor, v: Tensor) -> None:
        """k, v [T, kv_heads, d] go to (slot_idx[t], pos_idx[t]) through the device block table (no host sync)."""
        page = self.block_table[slot_idx, pos_idx // self.page_tokens].long()  # [T]
        at = pos_idx % self.page_tokens
        self.k[layer][page, at] = k
        self.v[layer][page, at] = v

    def gather(self, layer: int, slot: int, length: int) -> tuple[Tensor, Tensor]:
        """K, V [length, kv_heads, d] of slot's positions [0, length) (copies: tests and references)."""
        ids = torch.tensor(self._pages[slot][: self.pages(length)], dtype=torch.long, device=self.k.device)
        k = self.k[layer][ids].reshape(-1, *self.shape[3:])[:length]
        v = self.v[layer][ids].reshape(-1, *self.shape[3:])[:length]
        return k, v


__all__ = ["PAGE_TOKENS", "PagedKVCache"]
