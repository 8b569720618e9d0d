"""Attention contracts of the model, each checked against an independent oracle or property.

Oracles: a per-query softmax loop, the explicit reference attention, full recomputation
without a cache, each sequence run alone, and properties (causality, permutation symmetry).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lmserve.model.attention.sdpa import AttentionMetadata, sdpa_attention
from oracles import ExplicitAttention, explicit_attention
from lmserve.model.config import ModelConfig
from lmserve.model.kv_cache import KVCache
from lmserve.model.llama import LlamaForCausalLM

HEAD_RATIOS = [(4, 4), (4, 2), (6, 2), (8, 1)]  # (query heads, kv heads)
TIGHT = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def make_cfg(heads: int = 4, kv_heads: int = 2, head_dim: int = 8, layers: int = 2) -> ModelConfig:
    return ModelConfig(vocab_size=97, hidden_size=32, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                       head_dim=head_dim, intermediate_size=64, max_position_embeddings=128)


def make_model(cfg: ModelConfig, seed: int = 0, std: float = 0.15) -> LlamaForCausalLM:
    """Random weights large enough that attention is far from uniform."""
    return LlamaForCausalLM(cfg).init_weights(std=std, generator=torch.Generator().manual_seed(seed)).eval()


def random_seqs(lengths: list[int], vocab: int, seed: int) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def right_pad(seqs: list[Tensor], pad_id: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """-> ids [B, L], positions [B, L], q_lens [B]; positions count from 0 in every row."""
    q_lens = torch.tensor([len(s) for s in seqs])
    L = int(q_lens.max())
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = s
    positions = torch.arange(L).expand(len(seqs), L).contiguous()
    return ids, positions, q_lens


def run_alone(model: LlamaForCausalLM, seq: Tensor) -> Tensor:
    """Logits [n, V] of one sequence, no padding, no cache."""
    n = len(seq)
    return model(seq[None], torch.arange(n)[None], AttentionMetadata.fresh(torch.tensor([n])))[0]


def fill_with_garbage(cache: KVCache, seed: int) -> None:
    """Finite stale values everywhere, as a reused slot would hold: only masking keeps them out."""
    g = torch.Generator().manual_seed(seed)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g) * 50)
    cache.v.copy_(torch.randn(cache.v.shape, generator=g) * 50)


# ---- SDPA == explicit == per-query loop ------------------------------------------------

def qkv_for(meta: AttentionMetadata, heads: int, kv_heads: int, d: int, seed: int, strided: bool):
    """Random q [N, H, L, d] and k/v [N, Hkv, S, d]; k/v as strided views of a longer buffer if asked."""
    g = torch.Generator().manual_seed(seed)
    N, _, L, S = meta.mask.shape
    q = torch.randn(N, heads, L, d, generator=g) * 3  # peaky softmax: a wrong scale shows
    extra = 5 if strided else 0
    k = torch.randn(N, kv_heads, S + extra, d, generator=g)[:, :, :S]
    v = torch.randn(N, kv_heads, S + extra, d, generator=g)[:, :, :S]
    return q, k, v


def metas_for_layouts() -> dict[str, AttentionMetadata]:
    q_lens = torch.tensor([5, 2, 7, 1])
    return {
        "fresh": AttentionMetadata.fresh(q_lens),
        "cache": AttentionMetadata.for_cache(slots=torch.arange(4), starts=torch.tensor([3, 0, 6, 9]), q_lens=q_lens),
    }


@pytest.mark.parametrize("layout", ["fresh", "cache"])
@pytest.mark.parametrize("heads,kv_heads", HEAD_RATIOS)
def test_sdpa_attention_equals_explicit_attention(heads, kv_heads, layout):
    meta = metas_for_layouts()[layout]
    q, k, v = qkv_for(meta, heads, kv_heads, d=16, seed=heads * 10 + kv_heads, strided=layout == "cache")
    out = sdpa_attention(q, k, v, meta.mask)
    ref, _ = explicit_attention(q, k, v, meta.mask)
    assert out.shape == ref.shape == q.shape
    assert_close(out, ref, **TIGHT)


@pytest.mark.parametrize("layout", ["fresh", "cache"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 2)])
def test_explicit_attention_equals_per_query_softmax_loop(heads, kv_heads, layout):
    """Independent oracle: each real query attends to keys 0..(its absolute position), nothing else."""
    meta = metas_for_layouts()[layout]
    d = 16
    q, k, v = qkv_for(meta, heads, kv_heads, d=d, seed=7, strided=False)
    out, _ = explicit_attention(q, k, v, meta.mask)
    starts = meta.starts if meta.starts is not None and meta.read_cache else torch.zeros_like(meta.q_lens)
    G = heads // kv_heads
    for b, n in enumerate(meta.q_lens.tolist()):
        for h in range(heads):
            kv = h // G  # query head h shares kv head h // G
            for i in range(n):
                last = int(starts[b]) + i
                keys, vals = k[b, kv, : last + 1], v[b, kv, : last + 1]  # [last+1, d]
                p = torch.softmax(keys @ q[b, h, i] / math.sqrt(d), dim=0)
                assert_close(out[b, h, i], p @ vals, **TIGHT)


@pytest.mark.parametrize("heads,kv_heads", HEAD_RATIOS)
def test_model_sdpa_equals_reference_attention(heads, kv_heads):
    """Whole model, ragged padded prefill and a cached decode step: SDPA path == explicit path."""
    cfg = make_cfg(heads, kv_heads)
    model = make_model(cfg, seed=heads + kv_heads)
    ids, positions, q_lens = right_pad(random_seqs([6, 2, 9], cfg.vocab_size, seed=1))
    slots = torch.tensor([5, 2, 7])
    nxt = torch.tensor([[3], [11], [42]])

    def prefill_and_decode(reference: bool) -> tuple[Tensor, Tensor]:
        wrap = ExplicitAttention if reference else (lambda meta: meta)
        cache = KVCache(cfg, num_slots=8, max_len=16, dtype=torch.float32)
        pre = model(ids, positions, wrap(AttentionMetadata.for_cache(slots, torch.zeros(3, dtype=torch.long), q_lens)), cache)
        dec = model(nxt, q_lens[:, None], wrap(AttentionMetadata.for_cache(slots, q_lens, torch.ones(3, dtype=torch.long))), cache)
        return pre, dec

    pre, dec = prefill_and_decode(reference=False)
    pre_ref, dec_ref = prefill_and_decode(reference=True)
    real = torch.arange(ids.shape[1])[None, :] < q_lens[:, None]  # [B, L]
    assert_close(pre[real], pre_ref[real], **TIGHT)
    assert_close(dec, dec_ref, **TIGHT)


# ---- attention weights ------------------------------------------------------------------

def test_attention_weights_sum_to_one_and_padding_keys_get_exactly_zero():
    cfg = make_cfg(4, 2)
    model = make_model(cfg)
    ids, positions, q_lens = right_pad(random_seqs([6, 3, 1], cfg.vocab_size, seed=2))
    L = ids.shape[1]
    weights = []

    class Recording(ExplicitAttention):
        def attend(self, *args):
            out = super().attend(*args)
            weights.append(self.last_weights)
            return out

    model(ids, positions, Recording(AttentionMetadata.fresh(q_lens)))
    future = torch.triu(torch.ones(L, L, dtype=torch.bool), diagonal=1)  # [L, L] key after query
    assert len(weights) == len(model.model.layers)
    for w in weights:  # [B, H, L, L] of each layer
        assert w is not None and w.shape == (3, cfg.num_heads, L, L)
        assert_close(w.sum(-1), torch.ones(3, cfg.num_heads, L), **TIGHT)
        for b, n in enumerate(q_lens.tolist()):
            assert torch.equal(w[b, :, :, n:], torch.zeros_like(w[b, :, :, n:])), "padding key got weight"
            assert (w[b, :, :n, :n] > 0).sum() > 0
        assert bool((w[:, :, future] == 0).all()), "a query attended to a later key"


# ---- causality ----------------------------------------------------------------------------

def assert_no_future_leak(model: LlamaForCausalLM, ids: Tensor, positions: Tensor, meta: AttentionMetadata, t: int) -> None:
    """AssertionError if replacing every token after position t changes any logit at positions <= t."""
    base = model(ids, positions, meta)  # [B, L, V]
    changed = ids.clone()
    changed[:, t + 1:] = (ids[:, t + 1:] + 1 + torch.arange(ids.shape[1] - t - 1)) % model.config.vocab_size
    assert not torch.equal(changed[:, t + 1:], ids[:, t + 1:])
    out = model(changed, positions, meta)
    assert_close(out[:, : t + 1], base[:, : t + 1], rtol=0, atol=1e-6)


def flipped_triangle(q_lens: Tensor) -> AttentionMetadata:
    """A broken mask: the causal triangle transposed, so each query sees itself and the future."""
    return AttentionMetadata(q_lens=q_lens, mask=AttentionMetadata.causal_padded(q_lens).transpose(-1, -2))


@pytest.mark.parametrize("t", [0, 3, 7])
def test_changing_later_tokens_changes_no_earlier_logit(t):
    cfg = make_cfg(4, 2)
    model = make_model(cfg)
    ids, positions, q_lens = right_pad(random_seqs([9, 9, 9], cfg.vocab_size, seed=3))
    assert_no_future_leak(model, ids, positions, AttentionMetadata.fresh(q_lens), t)
    # the same check run on a padded ragged batch
    ids, positions, q_lens = right_pad(random_seqs([9, 5, 8], cfg.vocab_size, seed=4))
    assert_no_future_leak(model, ids, positions, AttentionMetadata.fresh(q_lens), t)


@pytest.mark.parametrize("t", [0, 3, 7])
def test_future_leak_check_detects_a_flipped_triangle(t):
    cfg = make_cfg(4, 2)
    model = make_model(cfg)
    ids, positions, q_lens = right_pad(random_seqs([9, 9, 9], cfg.vocab_size, seed=3))
    with pytest.raises(AssertionError):
        assert_no_future_leak(model, ids, positions, flipped_triangle(q_lens), t)


# ---- permutation symmetry and RoPE ----------------------------------------------------------

def assert_permutation_equivariant(model: LlamaForCausalLM, ids: Tensor, positions: Tensor, meta: AttentionMetadata, perm: Tensor) -> None:
    """AssertionError unless permuting the input tokens permutes the logits the same way."""
    out = model(ids, positions, meta)  # [B, L, V]
    out_perm = model(ids[:, perm], positions, meta)
    assert_close(out_perm, out[:, perm], **TIGHT)


def test_without_positions_attention_is_permutation_equivariant_and_rope_breaks_it():
    cfg = make_cfg(4, 2)
    model = make_model(cfg)
    B, L = 2, 8
    ids = torch.stack([torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(s))[:L] for s in (5, 6)])
    full = AttentionMetadata(q_lens=torch.full((B,), L), mask=torch.ones(B, 1, L, L, dtype=torch.bool))  # no causal triangle
    perm = torch.tensor([3, 7, 0, 5, 1, 6, 2, 4])
    same_position = torch.full((B, L), 5)  # one rotation for every token: q.k unchanged, RoPE neutral
    assert_permutation_equivariant(model, ids, same_position, full, perm)
    real_positions = torch.arange(L).expand(B, L)
    with pytest.raises(AssertionError):
        assert_permutation_equivariant(model, ids, real_positions, full, perm)


# ---- KV cache ---------------------------------------------------------------------------------

def test_kv_cached_decoding_equals_full_recompute():
    """Ragged prefill into non-contiguous slots, then one token at a time, with subsets and reordered batches."""
    cfg = make_cfg(4, 2)
    model = make_model(cfg)
    prompt_lens, n_new = [5, 3, 7], 6
    full = random_seqs([n + n_new for n in prompt_lens], cfg.vocab_size, seed=8)  # prompt + continuation
    expected = [run_alone(model, s) for s in full]  # [n, V] each
    slots = torch.tensor([5, 2, 7])
    cache = KVCache(cfg, num_slots=9, max_len=32, dtype=torch.float32)
    fill_with_garbage(cache, seed=9)

    ids, positions, q_lens = right_pad([s[:n] for s, n in zip(full, prompt_lens)])
    last = torch.arange(3) * ids.shape[1] + q_lens - 1  # flat index of each prompt's last token
    meta = AttentionMetadata.for_cache(slots, torch.zeros(3, dtype=torch.long), q_lens)
    logits = model(ids, positions, meta, cache, logits_index=last)  # [B, V]
    for b, n in enumerate(prompt_lens):
        assert_close(logits[b], expected[b][n - 1], **TIGHT)

    lens = list(prompt_lens)
    schedule = [[0, 1, 2], [0, 2], [1], [2, 0], [1, 2, 0], [0, 1], [1, 2, 0], [2, 1]]  # subsets, reordered
    for active in schedule:
        batch = torch.tensor(active)
        starts = torch.tensor([lens[b] for b in active])
        ids = torch.stack([full[b][lens[b]] for b in active])[:, None]  # [B, 1]
        meta = AttentionMetadata.for_cache(slots[batch], starts, torch.ones(len(active), dtype=torch.long))
        assert meta.read_cache
        out = model(ids, starts[:, None], meta, cache)[:, 0]  # [B, V]
        for row, b in enumerate(active):
            assert_close(out[row], expected[b][lens[b]], **TIGHT)
            lens[b] += 1
    assert lens == [n + n_new for n in prompt_lens]


def test_chunked_prefill_equals_full_recompute():
    """Prompts fed in three chunks (starts > 0 after the first), ragged per chunk, slots out of order."""
    cfg = make_cfg(6, 2)
    model = make_model(cfg, seed=3)
    seqs = random_seqs([10, 7], cfg.vocab_size, seed=10)
    expected = [run_alone(model, s) for s in seqs]
    chunks = [[4, 2], [3, 4], [3, 1]]  # tokens per chunk for each sequence
    slots = torch.tensor([3, 1])
    cache = KVCache(cfg, num_slots=4, max_len=16, dtype=torch.float32)
    fill_with_garbage(cache, seed=11)
    done = [0, 0]
    for sizes in chunks:
        parts = [s[d: d + n] for s, d, n in zip(seqs, done, sizes)]
        ids, _, q_lens = right_pad(parts)
        starts = torch.tensor(done)
        positions = starts[:, None] + torch.arange(ids.shape[1])[None, :]  # [B, L] absolute positions
        out = model(ids, positions, AttentionMetadata.for_cache(slots, starts, q_lens), cache)  # [B, L, V]
        for b, n in enumerate(sizes):
            assert_close(out[b, :n], expected[b][done[b]: done[b] + n], **TIGHT)
            done[b] += n
    assert done == [10, 7]


def test_new_prompt_batched_with_decoding_sequences_equals_full_recompute():
    """One step mixing a fresh prompt (start 0, several tokens) with sequences decoding one token."""
    cfg = make_cfg(8, 2)
    model = make_model(cfg, seed=5)
    old, new = random_seqs([6, 4], cfg.vocab_size, seed=16), random_seqs([5], cfg.vocab_size, seed=17)[0]
    cache = KVCache(cfg, num_slots=6, max_len=16, dtype=torch.float32)
    fill_with_garbage(cache, seed=18)
    old_slots = torch.tensor([4, 1])
    ids, positions, q_lens = right_pad([s[:-1] for s in old])  # all but the last token already cached
    model(ids, positions, AttentionMetadata.for_cache(old_slots, torch.zeros(2, dtype=torch.long), q_lens), cache)

    starts = torch.tensor([5, 0, 3])
    parts = [old[0][-1:], new, old[1][-1:]]
    ids, _, q_lens = right_pad(parts)
    positions = starts[:, None] + torch.arange(ids.shape[1])[None, :]  # [B, L]
    meta = AttentionMetadata.for_cache(torch.tensor([4, 2, 1]), starts, q_lens)
    assert meta.read_cache
    out = model(ids, positions, meta, cache)  # [B, L, V]
    for b, seq in enumerate([old[0], new, old[1]]):
        n = len(parts[b])
        assert_close(out[b, :n], run_alone(model, seq)[-n:], **TIGHT)


class BigAllocationWatch(TorchDispatchMode):
    """Records every op result of at least `limit` elements that is not a view into the cache."""

    def __init__(self, cache: KVCache, limit: int):
        super().__init__()
        self.cache_storages = {cache.k.untyped_storage().data_ptr(), cache.v.untyped_storage().data_ptr()}
        self.limit = limit
        self.offenders: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor) and t.numel() >= self.limit \
                    and t.untyped_storage().data_ptr() not in self.cache_storages:
                self.offenders.append((str(func), tuple(t.shape)))
        return out


def test_decode_step_reads_cache_views_and_copies_no_whole_slot():
    cfg = make_cfg(4, 2)
    model = make_model(cfg)
    max_len = 512
    cache = KVCache(cfg, num_slots=8, max_len=max_len, dtype=torch.float32)
    slots = torch.tensor([5, 2, 7])
    ids, positions, q_lens = right_pad(random_seqs([4, 6, 3], cfg.vocab_size, seed=12))
    model(ids, positions, AttentionMetadata.for_cache(slots, torch.zeros(3, dtype=torch.long), q_lens), cache)

    meta = AttentionMetadata.for_cache(slots, q_lens, torch.ones(3, dtype=torch.long))
    assert meta.read_cache and (meta.lo, meta.hi) == (2, 8)
    k, v = cache.view(0, meta.lo, meta.hi, meta.mask.shape[-1])
    assert k.untyped_storage().data_ptr() == cache.k.untyped_storage().data_ptr()
    assert v.untyped_storage().data_ptr() == cache.v.untyped_storage().data_ptr()
    assert k.data_ptr() == cache.k[0, 2].data_ptr() and k.stride() == cache.k[0].stride()

    one_slot = cfg.num_kv_heads * max_len * cfg.head_dim  # elements of one slot of one layer's K
    watch = BigAllocationWatch(cache, one_slot)
    with watch:
        model(torch.tensor([[1], [2], [3]]), q_lens[:, None], meta, cache)
    assert watch.offenders == []
    # the watch does see a gather of the batch's slots
    with watch:
        cache.k[0][slots]
    assert watch.offenders


# ---- batching -------------------------------------------------------------------------------------

@pytest.mark.parametrize("pad_id", [0, 96])
def test_right_padded_ragged_batch_equals_each_sequence_alone(pad_id):
    cfg = make_cfg(4, 2)
    model = make_model(cfg)
    seqs = random_seqs([7, 3, 5, 1], cfg.vocab_size, seed=13)
    ids, positions, q_lens = right_pad(seqs, pad_id=pad_id)
    out = model(ids, positions, AttentionMetadata.fresh(q_lens))  # [B, L, V]
    for b, s in enumerate(seqs):
        assert_close(out[b, : len(s)], run_alone(model, s), **TIGHT)


# ---- empty rows ------------------------------------------------------------------------------------

def test_all_masked_row_has_no_defined_attention_so_empty_prompts_are_rejected():
    """q_len 0 leaves a row with every key masked: softmax over nothing is 0/0 = NaN."""
    q_lens = torch.tensor([3, 0])
    meta = AttentionMetadata.fresh(q_lens)
    assert not bool(meta.mask[1].any())
    q, k, v = qkv_for(meta, 4, 2, d=8, seed=14, strided=False)
    out, w = explicit_attention(q, k, v, meta.mask)
    assert bool(out[1].isnan().all()) and bool(w[1].isnan().all())
    assert bool(out[0].isfinite().all())
    # SDPA gives NaN or, on some backends, zeros: either way not an attention result
    fast = sdpa_attention(q, k, v, meta.mask)[1]
    assert bool(fast.isnan().all()) or bool((fast == 0).all())

    cfg = make_cfg(4, 2)
    model = make_model(cfg)
    seq = random_seqs([3], cfg.vocab_size, seed=15)[0]
    logits = model(torch.stack([seq, seq]), torch.arange(3).expand(2, 3), ExplicitAttention(meta))
    assert bool(logits[1].isnan().all())
    assert_close(logits[0], run_alone(model, seq), **TIGHT)


@pytest.mark.parametrize("seed", range(6))
def test_decode_metadata_from_host_lists_equals_the_general_builder(seed):
    """AttentionMetadata.for_decode (the decode step's fast input path) describes exactly the
    attention for_cache describes for one token per sequence: masks, views, rows, writes, calls."""
    import random

    rng = random.Random(seed)
    slots = rng.sample(range(12), rng.randint(1, 8))
    starts = [rng.randint(1, 40) for _ in slots]
    fast = AttentionMetadata.for_decode(slots, starts, "cpu")
    ref = AttentionMetadata.for_cache(torch.tensor(slots), torch.tensor(starts), torch.ones(len(slots), dtype=torch.long), 1)
    assert torch.equal(fast.mask, ref.mask)
    assert (fast.lo, fast.hi, fast.read_cache) == (ref.lo, ref.hi, ref.read_cache)
    assert (fast.rows is None) == (ref.rows is None) and (fast.rows is None or torch.equal(fast.rows, ref.rows))
    for name in ("q_lens", "slots", "starts", "write_b", "write_j", "write_slot", "write_pos"):
        assert torch.equal(getattr(fast, name), getattr(ref, name)), name
    assert [(c.lo, c.hi, c.length, c.mask_rows, str(c.batch), None if c.rows is None else c.rows.tolist()) for c in fast.calls] == \
           [(c.lo, c.hi, c.length, c.mask_rows, str(c.batch), None if c.rows is None else c.rows.tolist()) for c in ref.calls]


# ---- sliding windows --------------------------------------------------------------------

@pytest.mark.parametrize("window", [1, 4, 9, 100])
@pytest.mark.parametrize("build", ["decode", "decode_one_call", "rows", "static", "chunk", "chunk_one_call"])
def test_a_sliding_window_sees_exactly_its_last_keys_in_every_cache_layout(build, window):
    """Each layout's attention over the cache in a sliding layer (window masks, a call's keys read from its
    lowest query's window start, CUDA-graph decode's static masks) against the explicit attention over keys
    p - window + 1 .. p of each query's own slot, scaled as asked; the slot's other keys hold garbage."""
    H, Hkv, d, slots, max_len = 4, 2, 8, 6, 64
    cfg = make_cfg(H, Hkv, d, layers=1)
    cache = KVCache(cfg, slots, max_len, torch.float32, virtual=False)
    fill_with_garbage(cache, seed=window)
    g = torch.Generator().manual_seed(7)
    seq_slots, starts = [4, 1, 2], [20, 3, 33]
    L = 5 if build.startswith("chunk") else 1
    if build.startswith("chunk"):  # one continued chunk of L tokens
        seq_slots, starts = [3], [25]
    if build in ("decode", "decode_one_call"):
        meta = AttentionMetadata.for_decode(seq_slots, starts, "cpu", call_cost=0 if build == "decode" else 10**6)
    elif build == "rows":
        seq_slots, starts = [4, 4, 4, 1], [20, 21, 22, 3]  # a verified draft beside a decode row
        meta = AttentionMetadata.for_rows(seq_slots, starts, "cpu")
    elif build == "static":
        meta = AttentionMetadata.static_decode(torch.tensor(seq_slots), torch.tensor(starts), slots, max_len)
    else:
        meta = AttentionMetadata.for_cache(torch.tensor(seq_slots), torch.tensor(starts), torch.tensor([L]), L,
                                           call_cost=0 if build == "chunk" else 10**6)
    B = len(seq_slots)
    q = torch.randn(B, L, H, d, generator=g) * 3
    k, v = torch.randn(B, L, Hkv, d, generator=g), torch.randn(B, L, Hkv, d, generator=g)
    out = meta.attend(q, k, v, cache, 0, window, 0.3).view(B, L, H, d)
    for b, (s, p0) in enumerate(zip(seq_slots, starts)):
        for j in range(L):
            p = p0 + j
            lo = max(0, p - window + 1)
            K, V = cache.k[0, s, :, lo: p + 1], cache.v[0, s, :, lo: p + 1]  # [Hkv, n, d], this step's writes included
            ref, _ = explicit_attention(q[b, j][None, :, None], K[None], V[None],
                                        torch.ones(1, 1, 1, p + 1 - lo, dtype=torch.bool), 0.3)
            assert_close(out[b, j], ref[0, :, 0], **TIGHT)


def test_window_masks_of_the_fresh_and_packed_layouts_follow_positions():
    """Fresh rows (right-padded) and packed prompts: a query at position p keeps keys p - w + 1 .. p of its own
    sequence; a padding row left with no key keeps key 0 (no NaN)."""
    fresh = AttentionMetadata.fresh(torch.tensor([6, 2]))
    m = fresh.window_mask(3)[:, 0]  # [B, L, L]
    for b, n in enumerate([6, 2]):
        for i in range(6):
            want = [(k <= i and k > i - 3 and k < n) for k in range(6)]
            if not any(want):
                want = [k == 0 for k in range(6)]
            assert m[b, i].tolist() == want, (b, i)
    packed, pos = AttentionMetadata.packed(torch.tensor([0, 1]), torch.tensor([4, 3]))
    pm = packed.window_mask(2)[0, 0]  # [T, T]
    seg = [0] * 4 + [1] * 3
    for t in range(7):
        assert pm[t].tolist() == [seg[u] == seg[t] and 0 <= t - u < 2 for u in range(7)]
