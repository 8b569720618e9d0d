"""PrefixCache: plain Python, no tensors."""

import pytest

from lmserve.server.engine.prefix_cache import PrefixCache, block_hashes


def test_block_hashes_are_chained():
    a, b = list(range(40)), list(range(40))
    b[3] = 999
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert len(ha) == 2 and ha != hb
    assert hb[1] != ha[1]  # the second block is equal, but its hash covers the first one too
    assert block_hashes(a, 16, limit=31) == ha[:1]


def test_match_finds_the_longest_shared_prefix_exactly_not_only_whole_blocks():
    pc = PrefixCache(block=4)
    base = list(range(100, 130))
    e1, _ = pc.insert(0, base[:10], pages=1)
    e2, _ = pc.insert(1, base[:7] + [1, 2, 3, 4, 5, 6], pages=1)
    entry, n = pc.match(base + [7, 7], limit=100)
    assert (entry, n) == (e1, 10)
    entry, n = pc.match(base[:7] + [1, 2, 3, 9], limit=100)
    assert (entry, n) == (e2, 10)  # past the last common full block (8 tokens) token by token
    assert pc.match(base, limit=6)[1] == 6  # capped (the engine passes prompt length - 1)
    assert pc.match([5, 5, 5, 5, 5], limit=5) == (None, 0)
    assert pc.match(base[:3], limit=3) == (None, 0)  # not one full block in common


def test_an_entry_whose_hashes_collide_is_not_handed_out(monkeypatch):
    pc = PrefixCache(block=4)
    pc.insert(0, [1, 2, 3, 4, 5, 6, 7, 8], pages=1)
    import lmserve.server.engine.prefix_cache as mod

    monkeypatch.setattr(mod, "hash", lambda x: 42, raising=False)  # every block hashes alike
    pc2 = PrefixCache(block=4)
    pc2.insert(0, [1, 2, 3, 4, 5, 6, 7, 8], pages=1)
    assert pc2.match([9, 9, 9, 9, 9, 9, 9, 9, 9], limit=9) == (None, 0)
    assert pc2.match([1, 2, 3, 4, 9, 9, 9, 9, 9], limit=9)[1] == 0  # deepest block "matches" by hash only


def test_a_longer_entry_replaces_those_it_covers_and_lru_order():
    pc = PrefixCache(block=4)
    turn1, _ = pc.insert(0, list(range(8)), pages=1)
    other, _ = pc.insert(1, [9] * 8, pages=1)
    turn2, dominated = pc.insert(2, list(range(12)), pages=2)
    assert dominated == [turn1] and pc.entries() == [other, turn2] and pc.pages_held == 3
    pc.touch(other)
    assert pc.evict_lru() is turn2 and pc.pages_held == 1
    other.pinned = 1
    assert pc.evict_lru() is None  # pinned: a copy from it is pending
    other.pinned = 0
    assert pc.evict_lru() is other and len(pc) == 0 and pc.pages_held == 0
    with pytest.raises(ValueError):
        pc.insert(3, [1, 2], pages=1)  # shorter than one block: nothing to share


def test_an_entry_whose_sliding_layers_dropped_keys_serves_only_hits_that_reach_past_them():
    """An entry whose sliding layers handed back keys below r serves a hit of m tokens only if
    m - w + 1 >= r (min_hit = r + w - 1); otherwise the next-best entry that can, found at a shallower
    block, or none."""
    pc = PrefixCache(block=4)
    system = list(range(100, 112))
    short, _ = pc.insert(0, system, pages=1)  # kept every key
    long_tokens = system + list(range(200, 240))  # 52 tokens; window 6, keys below 40 handed back
    long_, dominated = pc.insert(1, long_tokens, pages=5, min_hit=40 + 6 - 1)
    assert dominated == []  # it cannot serve the 12-token hits the short one does: both stay
    assert pc.match(long_tokens + [7], limit=100) == (long_, 52)
    assert pc.match(long_tokens[:45] + [7, 7, 7], limit=100) == (long_, 45)  # m = min_hit: its window is whole
    assert pc.match(long_tokens[:44] + [7, 7, 7], limit=100) == (short, 12)  # one short: the other entry's hit
    assert pc.match(long_tokens[:30] + [7], limit=100) == (short, 12)
    pc.remove(short)
    assert pc.match(long_tokens[:44] + [7, 7, 7], limit=100) == (None, 0)
    # a later entry covering another's tokens replaces it only when it serves every hit the other does
    again, dominated = pc.insert(2, long_tokens + [1, 2, 3, 4], pages=6, min_hit=45)
    assert dominated == [long_] and pc.entries() == [again]
    later, dominated = pc.insert(3, long_tokens + [1, 2, 3, 4, 5, 6, 7, 8], pages=6, min_hit=49)
    assert dominated == [] and pc.entries() == [again, later]
