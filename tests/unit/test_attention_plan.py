"""Splitting a step's attention into SDPA calls over cache views (model/attention/plan.py).

Oracles: brute force over every split for the planner; the explicit reference attention
over the step's one full mask for the calls; each sequence run alone for the model.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch
from torch.testing import assert_close

from lmserve.model.attention.sdpa import AttentionMetadata, attend_calls
from oracles import explicit_attention
from lmserve.model.attention.plan import AttentionCall as AttentionCallRef, cache_calls, searched_runs, slot_runs
from lmserve.model.config import ModelConfig
from lmserve.model.kv_cache import KVCache
from lmserve.model.llama import LlamaForCausalLM

TIGHT = dict(rtol=1e-5, atol=1e-5)


def plan_cost(runs, slots, kv_lens, call_cost):
    return sum(call_cost + (max(slots[b] for b in r) - min(slots[b] for b in r) + 1) * max(kv_lens[b] for b in r)
               for r in runs)


@pytest.mark.parametrize("seed", range(12))
def test_slot_runs_is_an_optimal_split_into_runs_of_neighbouring_slots(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 8)
    slots = rng.sample(range(12), n)
    kv_lens = [rng.choice([1, 3, 20, 90, 400]) for _ in range(n)]
    call_cost = rng.choice([0, 16, 256])
    runs = slot_runs(slots, kv_lens, call_cost)
    assert sorted(b for r in runs for b in r) == list(range(n))  # every sequence exactly once
    order = sorted(range(n), key=slots.__getitem__)
    assert [b for r in runs for b in r] == order  # runs are consecutive in slot order
    best = min(plan_cost([order[i:j] for i, j in zip((0, *cuts), (*cuts, n))], slots, kv_lens, call_cost)
               for k in range(n) for cuts in itertools.combinations(range(1, n), k))
    assert plan_cost(runs, slots, kv_lens, call_cost) == best


def test_one_long_sequence_among_short_ones_gets_its_own_call():
    slots, kv_lens = [0, 1, 2, 3, 4], [10, 12, 900, 11, 9]
    assert slot_runs(slots, kv_lens, 256) == [[0, 1], [2], [3, 4]]
    assert slot_runs(slots, [10] * 5, 256) == [[0, 1, 2, 3, 4]]  # alike: one call


def test_a_gpu_plans_one_call_where_a_cpu_splits():
    slots, kv_lens = [0, 1, 2, 3, 4], [10, 12, 900, 11, 9]  # contiguous slots: no index tensors are built
    assert len(cache_calls(slots, kv_lens, 1, torch.device("cpu"))) == 3
    (call,) = cache_calls(slots, kv_lens, 1, torch.device("cuda"))
    assert (call.lo, call.hi, call.length, call.batch) == (0, 5, 900, slice(0, 5))


def layout(call_cost: int):
    """Sequences in scattered slots (gaps, batch order unlike slot order), mixed cache lengths and
    query lengths (continuation chunks with right padding), the calls forced apart by call_cost."""
    slots, starts, q_lens = torch.tensor([6, 1, 3, 0, 9]), torch.tensor([40, 2, 7, 0, 3]), torch.tensor([1, 3, 1, 2, 4])
    meta = AttentionMetadata.for_cache(slots, starts, q_lens)
    calls = cache_calls(slots.tolist(), (starts + q_lens).tolist(), int(q_lens.max()), slots.device, call_cost)
    return dataclasses.replace(meta, calls=calls)


@pytest.mark.parametrize("call_cost", [0, 8, 10_000])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_calls_equal_the_explicit_attention_over_the_full_mask(call_cost, heads, kv_heads):
    meta = layout(call_cost)
    if call_cost == 0:
        assert len(meta.calls) == 5  # calls are free: one per sequence
    if call_cost == 10_000:
        assert len(meta.calls) == 1 and meta.calls[0].rows is not None  # one call spanning gaps
    g = torch.Generator().manual_seed(heads)
    d, L = 8, meta.mask.shape[2]
    k_cache = torch.randn(12, kv_heads, 64, d, generator=g)
    v_cache = torch.randn(12, kv_heads, 64, d, generator=g)
    q = torch.randn(len(meta.q_lens), heads, L, d, generator=g) * 3  # [B, H, L, d]
    out = attend_calls(q, k_cache, v_cache, meta)

    q_rows = q.new_zeros(meta.hi - meta.lo, heads, L, d)
    q_rows[meta.rows] = q
    S = meta.mask.shape[-1]
    ref, _ = explicit_attention(q_rows, k_cache[meta.lo: meta.hi, :, :S], v_cache[meta.lo: meta.hi, :, :S], meta.mask)
    ref = ref[meta.rows]
    real = torch.arange(L)[None, :] < meta.q_lens[:, None]  # [B, L]: padding queries are not compared
    assert_close(out.transpose(1, 2)[real], ref.transpose(1, 2)[real], **TIGHT)


@pytest.mark.parametrize("gpu_plan", [False, True], ids=["call per prompt", "one masked call (GPU plan)"])
def test_packed_prompts_attend_only_to_their_own_tokens(gpu_plan):
    cfg = ModelConfig(vocab_size=61, hidden_size=32, num_layers=2, num_heads=6, num_kv_heads=2, head_dim=8,
                      intermediate_size=48, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).init_weights(0.2, generator=torch.Generator().manual_seed(0)).eval()
    lens = [5, 1, 9]
    seqs = [torch.randint(0, 61, (n,), generator=torch.Generator().manual_seed(n)) for n in lens]
    meta, positions = AttentionMetadata.packed(torch.tensor([4, 0, 2]), torch.tensor(lens))
    assert [(c.lo, c.tokens.start, c.tokens.stop) for c in meta.calls] == [(4, 0, 5), (0, 5, 6), (2, 6, 15)]
    if gpu_plan:  # what packed_calls plans on a GPU: the row's block-diagonal causal mask in one call
        meta = dataclasses.replace(meta, calls=())
    cache = KVCache(cfg, 5, 32, torch.float32)
    cache.k.normal_(0, 50)  # stale garbage in every slot: only the calls' bounds keep it out
    cache.v.normal_(0, 50)
    with torch.no_grad():
        packed = model(torch.cat(seqs)[None], positions, meta, cache)[0]  # [T, V]
        ends = torch.tensor(lens).cumsum(0)
        for s, e, seq in zip((0, *ends[:-1].tolist()), ends.tolist(), seqs):
            alone = model(seq[None], torch.arange(len(seq))[None], AttentionMetadata.fresh(torch.tensor([len(seq)])))
            assert_close(packed[s:e], alone[0], **TIGHT)


@pytest.mark.parametrize("pad", [0, 3])
def test_static_decode_over_the_whole_cache_equals_the_planned_decode(pad):
    """The graph-capturable decode (every slot, all max_len keys, shapes fixed) gives the planned
    decode's logits and K/V writes; padding rows that repeat row 0 change nothing."""
    cfg = ModelConfig(vocab_size=61, hidden_size=32, num_layers=2, num_heads=6, num_kv_heads=2, head_dim=8,
                      intermediate_size=48, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).init_weights(0.2, generator=torch.Generator().manual_seed(1)).eval()
    g = torch.Generator().manual_seed(2)
    planned, static = KVCache(cfg, 6, 32, torch.float32), KVCache(cfg, 6, 32, torch.float32)
    planned.k.normal_(generator=g)
    planned.v.normal_(generator=g)
    static.k.copy_(planned.k)
    static.v.copy_(planned.v)
    slots, positions, ids = [4, 0, 2, 5], [9, 0, 30, 3], [7, 11, 13, 60]  # a sequence at its first and last position
    with torch.no_grad():
        meta = AttentionMetadata.for_cache(torch.tensor(slots), torch.tensor(positions), torch.ones(4, dtype=torch.long), 1)
        want = model(torch.tensor(ids)[:, None], torch.tensor(positions)[:, None], meta, planned)[:, 0]
        rows = [slots, positions, ids]
        slots_p, positions_p, ids_p = (torch.tensor(r + r[:1] * pad) for r in rows)
        meta = AttentionMetadata.static_decode(slots_p, positions_p, 6, 32)
        got = model(ids_p[:, None], positions_p[:, None], meta, static)[:, 0]
    assert_close(got[:4], want, **TIGHT)
    assert_close(got[4:], want[:1].expand(pad, -1), **TIGHT)
    assert_close(static.k, planned.k, **TIGHT)
    assert_close(static.v, planned.v, **TIGHT)



@pytest.mark.parametrize("seed", range(8))
def test_no_call_cost_skips_the_search_and_returns_its_answer(seed):
    """call_cost 0 (batch-invariant serving): every sequence alone, in slot order, which must be exactly
    what the search returns, ties between equal costs included."""
    rng = random.Random(seed)
    n = rng.randint(1, 40)
    slots = rng.sample(range(64), n)
    kv_lens = [rng.choice([1, 2, 7, 7, 300]) for _ in range(n)]
    order = sorted(range(n), key=slots.__getitem__)
    runs = slot_runs(slots, kv_lens, 0)
    assert runs == [[b] for b in order]
    assert runs == searched_runs(order, slots, kv_lens, 0)


@pytest.mark.parametrize("L", [1, 4])
def test_no_call_cost_calls_are_one_per_sequence_over_its_own_slot(L):
    """The calls built without the general loop are the general loop's for runs of one sequence: a slice
    of the batch, the sequence's slot alone, its own keys, its row of the step's mask, no row index."""
    rng = random.Random(L)
    slots = rng.sample(range(40), 17)
    kv_lens = [rng.randint(L, 300) for _ in slots]
    base = min(slots)
    want = tuple(AttentionCallRef(batch=slice(b, b + 1), tokens=slice(0, L), lo=slots[b], hi=slots[b] + 1,
                                  length=kv_lens[b], mask_rows=slice(slots[b] - base, slots[b] - base + 1), rows=None,
                                  first_query=max(0, kv_lens[b] - L))
                 for b in sorted(range(len(slots)), key=slots.__getitem__))
    assert cache_calls(slots, kv_lens, L, torch.device("cpu"), call_cost=0) == want
