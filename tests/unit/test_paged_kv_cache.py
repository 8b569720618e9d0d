"""The paged KV cache (model/paged_kv_cache.py): pages for the tokens held, shared by prefix hits, on CPU.

Oracles: a dense copy of what was written (every position read back through the block table), the
pool's own count of free pages, and the KV manager's charge (the pages mapped never exceed it)."""

from __future__ import annotations

import random

import pytest
import torch

from lmserve.model.config import ModelConfig
from lmserve.model.paged_kv_cache import PagedKVCache
from lmserve.server.engine.kv_manager import KvManager
from lmserve.server.engine.prefix_cache import PrefixCache
from lmserve.server.engine.request import Request, SamplingParams
from lmserve.server.engine.sequence import Sequence

CFG = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                  intermediate_size=64, max_position_embeddings=512, bos_token_id=1, eos_token_ids=(2,), name="paged-kv")


def fill(cache: PagedKVCache, slot: int, first: int, last: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K/V for positions [first, last) of slot in every layer; returns them [layers, n, Hkv, d]."""
    g = torch.Generator().manual_seed(seed)
    n = last - first
    k = torch.randn(CFG.num_layers, n, CFG.num_kv_heads, CFG.head_dim, generator=g)
    v = torch.randn(CFG.num_layers, n, CFG.num_kv_heads, CFG.head_dim, generator=g)
    for layer in range(CFG.num_layers):
        cache.write(layer, torch.full((n,), slot), torch.arange(first, last), k[layer], v[layer])
    return k, v


def read(cache: PagedKVCache, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    ks, vs = zip(*(cache.gather(layer, slot, length) for layer in range(CFG.num_layers)))
    return torch.stack(ks), torch.stack(vs)


def test_a_slot_holds_pages_for_its_tokens_not_max_len_and_release_returns_them():
    cache = PagedKVCache(CFG, num_slots=4, max_len=256, num_pages=20, dtype=torch.float32, page_tokens=4)
    assert cache.max_pages == 64 and cache.pages_free == 20
    cache.map(1, 9)  # 3 pages of 4
    assert len(cache.mapped(1)) == 3 and cache.pages_free == 17 and 0 not in cache.mapped(1)
    cache.map(1, 12)  # still 3
    cache.map(1, 13)
    assert len(cache.mapped(1)) == 4 and cache.pages_free == 16
    assert cache.block_table[1, :4].tolist() == cache.mapped(1) and not cache.block_table[1, 4:].any()
    cache.release(1, 8, start=4)  # the second page only: a hole, mapped again on demand
    assert cache.mapped(1)[1] == 0 and cache.pages_free == 17
    cache.map(1, 13)
    assert 0 not in cache.mapped(1) and cache.pages_free == 16
    cache.release(1)
    assert cache.mapped(1) == [] and cache.pages_free == 20 and not cache.block_table.any()
    with pytest.raises(ValueError, match="starts on a page"):
        cache.release(1, start=3)
    with pytest.raises(ValueError, match="every layer"):
        cache.release(1, layers=(0,))
    assert cache.nbytes == 2 * 2 * 21 * 4 * 2 * 8 * 4 + 4 * 64 * 4
    assert cache.bytes_per_page == 4 * PagedKVCache.bytes_per_token(CFG, torch.float32) and cache.token_bytes * 4 == cache.bytes_per_page


def test_writes_land_where_the_block_table_says_and_read_back_exactly():
    cache = PagedKVCache(CFG, num_slots=3, max_len=64, num_pages=30, dtype=torch.float32, page_tokens=4)
    rng = random.Random(0)
    lengths = {0: 13, 1: 4, 2: 22}
    want = {}
    for slot in rng.sample(list(lengths), 3):  # pages interleave between slots
        cache.map(slot, lengths[slot])
    for slot, n in lengths.items():
        want[slot] = fill(cache, slot, 0, n, seed=slot)
    for slot, n in lengths.items():
        k, v = read(cache, slot, n)
        assert torch.equal(k, want[slot][0]) and torch.equal(v, want[slot][1])
    assert not cache.k[:, 0].any()  # the scratch page took no mapped write


def test_a_prefix_hit_shares_full_pages_and_copies_the_partial_last_one():
    cache = PagedKVCache(CFG, num_slots=3, max_len=64, num_pages=30, dtype=torch.float32, page_tokens=4)
    cache.map(0, 14)
    k0, v0 = fill(cache, 0, 0, 14, seed=1)
    free = cache.pages_free
    cache.map(1, 16)  # the manager maps the hit's positions and its first chunk, then the step copies
    cache.copy_prefix(0, 1, 10)  # 2 full pages shared, positions 8, 9 copied into a page of slot 1's own
    src, dst = cache.mapped(0), cache.mapped(1)
    assert dst[:2] == src[:2] and cache.refcount(src[0]) == cache.refcount(src[1]) == 2
    assert dst[2] != src[2] and cache.refcount(dst[2]) == 1 and len(dst) == 4
    assert cache.pages_free == free - 2  # slot 1 holds two pages of its own, not four
    k1, _ = fill(cache, 1, 10, 16, seed=2)  # the continuation writes past the hit
    k, v = read(cache, 1, 16)
    assert torch.equal(k[:, :10], k0[:, :10]) and torch.equal(v[:, :10], v0[:, :10]) and torch.equal(k[:, 10:], k1)
    assert torch.equal(read(cache, 0, 14)[0], k0)  # the entry is unchanged
    cache.release(0)  # the entry goes: the shared pages stay with slot 1
    assert torch.equal(read(cache, 1, 16)[0][:, :10], k0[:, :10])
    cache.release(1)
    assert cache.pages_free == 30


def test_a_hit_into_a_shared_page_copies_it_before_writing():
    cache = PagedKVCache(CFG, num_slots=3, max_len=64, num_pages=30, dtype=torch.float32, page_tokens=4)
    cache.map(0, 8)
    k0, _ = fill(cache, 0, 0, 8, seed=3)
    cache.copy_prefix(0, 1, 8)  # slot 1 maps nothing yet: both pages shared
    assert cache.mapped(1) == cache.mapped(0)
    cache.copy_prefix(1, 2, 6)  # from slot 1: page 0 shared three ways, page 1 copied for slot 2
    assert cache.refcount(cache.mapped(0)[0]) == 3 and cache.mapped(2)[1] not in cache.mapped(0)
    fill(cache, 2, 6, 8, seed=4)
    assert torch.equal(read(cache, 0, 8)[0], k0) and torch.equal(read(cache, 2, 6)[0], k0[:, :6])
    for slot in range(3):
        cache.release(slot)
    assert cache.pages_free == 30


def test_the_kv_manager_maps_the_pages_it_charges_and_never_more():
    """Sequences admitted, grown, finished into prefix entries, hit and evicted through the KV manager:
    the pool's pages in use never exceed the manager's charge, and all come back."""
    cache = PagedKVCache(CFG, num_slots=6, max_len=64, num_pages=24, dtype=torch.float32, page_tokens=4)
    kv = KvManager(6, kv_pages=24, page_tokens=4, prefix_cache=PrefixCache(block=4), release=cache.release,
                   map_pages=cache.map)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 60) for _ in range(10)] for _ in range(2)]
    running = []

    def admit(tokens):
        seq = Sequence(Request(list(tokens), SamplingParams(max_new_tokens=8)))
        entry, hit = kv.match(seq)
        seq.slot = kv.take_slot(False)
        kv.open(seq, hit + 4, first_query=hit)
        kv.use(seq, entry, hit)
        for copy in (kv.copies(entry.slot, seq.slot, hit) if entry is not None else ()):
            cache.copy_prefix(*copy)
        kv.unpin()
        seq.num_cached = hit + 4
        running.append(seq)
        return seq, hit

    for step in range(3):
        for tokens in prompts:
            seq, hit = admit(tokens + [step])
            assert cache.num_pages - cache.pages_free <= kv.pages_used
            covered = kv.reserve(seq, len(seq.all_tokens) + 5, 1)
            assert covered == len(seq.all_tokens) + 5 and len(cache.mapped(seq.slot)) == kv.held(seq) == kv.pages(covered)
            seq.num_cached = len(seq.all_tokens)
            assert cache.num_pages - cache.pages_free <= kv.pages_used
        for seq in running:
            kv.give_back(seq, keep_as_prefix=True)
        running.clear()
    assert kv.prefix_hit_tokens_total > 0  # later rounds hit the earlier prompts
    kv.drop_prefix_cache()
    assert kv.pages_used == 0 and cache.pages_free == 24


def test_from_budget_counts_pages_and_refuses_a_budget_without_one_request():
    page = 16 * PagedKVCache.bytes_per_token(CFG, torch.float32)
    cache = PagedKVCache.from_budget(CFG, 40 * page + 5, max_len=128, num_slots=8, dtype=torch.float32)
    assert cache.num_pages == 40 and cache.page_tokens == 16 and cache.num_slots == 8
    with pytest.raises(ValueError, match="holds no request of 128 tokens"):
        PagedKVCache.from_budget(CFG, 7 * page, max_len=128, num_slots=8, dtype=torch.float32)
