"""Prefix caching and preemption in the engine, on real (tiny) models: every result is checked against
a cold engine or the full-recompute oracle, and the `running` helper checks after each test that every
slot and KV block handed out came back (allocated == freed once the prefix cache is dropped).

Logits are compared bit for bit. That holds because nothing a hit changes reorders a float sum: the
copy is exact (test_kv_cache.py); the shared positions' K/V come from an earlier prefill whose rows are
computed independently of how many rows it had (the serving GEMMs do not change their reduction order
with M at these shapes, which the batched == alone tests also hold); and the remaining tokens' masked
SDPA call over the cache walks the keys in the same blocks from position 0 as the cold prompt's causal
call, a masked key adding exactly 0. Should a kernel ever split differently, the tolerance fallback is
wrong in principle only at near-ties; the tokens are compared exactly in any case.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from test_engine_helpers import (  # noqa: F401 - fixtures are used by name
    collect, greedy, greedy_reference, one_torch_thread, random_prompt, random_tiny, results_of, running,
    trained, wait_idle, wrap_step)
from lmserve.model.kv_cache import KVCache
from lmserve.server.engine.request import FinishReason, Request, SamplingParams


def capture_first_logits(engine, request_id: str) -> dict:
    """Records the logits row a request's first token is sampled from."""
    seen = {}

    def after(batch, logits):
        for i, seq in enumerate(batch.sampled()):
            if seq.request_id == request_id and request_id not in seen:
                seen[request_id] = logits[i].clone()
    wrap_step(engine, after=after)
    return seen


async def hit_and_cold(loaded, shared, tail, n_new=12, **settings):
    """Tokens and first logits of `shared + tail` served after `shared + other tail` (a prefix hit), and
    the same on a cold engine without a prefix cache."""
    rng = random.Random(5)
    vocab = loaded.config.vocab_size
    with running(loaded, **settings) as engine:
        logits = capture_first_logits(engine, "b")
        await collect(engine, Request(shared + random_prompt(rng, 7, vocab), greedy(5, ignore_eos=True)))
        before = engine.stats().prefix_hit_tokens_total
        hot, _ = await collect(engine, Request(shared + tail, greedy(n_new, ignore_eos=True), request_id="b"))
        hit = engine.stats().prefix_hit_tokens_total - before
    with running(loaded, prefix_cache=False, **settings) as engine:
        cold_logits = capture_first_logits(engine, "b")
        cold, _ = await collect(engine, Request(shared + tail, greedy(n_new, ignore_eos=True), request_id="b"))
    return hot, cold, hit, logits["b"], cold_logits["b"]


@pytest.mark.parametrize("settings", [dict(), dict(token_budget=16)], ids=["one_chunk", "chunked"])
async def test_a_prefix_hit_gives_the_cold_engines_tokens_and_logits(random_tiny, settings):
    rng = random.Random(1)
    vocab = random_tiny.config.vocab_size
    shared, tail = random_prompt(rng, 70, vocab), random_prompt(rng, 9, vocab)
    hot, cold, hit, hot_logits, cold_logits = await hit_and_cold(random_tiny, shared, tail, **settings)
    assert hit == 70  # every shared position, not only whole 16-token blocks
    assert hot.token_ids == cold.token_ids == greedy_reference(random_tiny.model, shared + tail, 12)[0]
    assert torch.equal(hot_logits, cold_logits)


async def test_a_prefix_hit_on_the_memorizing_model(trained):
    rng = random.Random(2)
    vocab = trained.config.vocab_size
    shared, tail = random_prompt(rng, 50, vocab), random_prompt(rng, 5, vocab)
    hot, cold, hit, hot_logits, cold_logits = await hit_and_cold(trained, shared, tail, n_new=16)
    assert hit == 50 and hot.token_ids == cold.token_ids
    assert torch.equal(hot_logits, cold_logits)


async def test_a_conversation_prefills_only_each_new_message(random_tiny):
    """Turn k's prompt is turn k-1's prompt + its answer + a new message: only the new part is computed,
    and the earlier turn's entry gives way to the longer one."""
    rng = random.Random(3)
    vocab = random_tiny.config.vocab_size
    prompt = random_prompt(rng, 30, vocab)
    with running(random_tiny, max_model_len=256) as engine:
        for turn in range(5):
            before = engine.stats()
            res, _ = await collect(engine, Request(prompt, greedy(8, ignore_eos=True)))
            after = engine.stats()
            assert res.token_ids == greedy_reference(random_tiny.model, prompt, 8)[0]
            if turn:
                # everything but the new message (and the previous answer's last token, never fed back)
                assert after.prefix_hit_tokens_total - before.prefix_hit_tokens_total == len(prompt) - new - 1
            assert after.prefix_cache_entries == 1
            new = 6
            prompt = prompt + res.token_ids + random_prompt(rng, new, vocab)


async def test_entries_are_evicted_under_memory_pressure_and_results_stay_exact(random_tiny):
    """A budget of 4 blocks of 64 positions: a new prompt family pushes the oldest entries out."""
    cfg = random_tiny.config
    block_bytes = KVCache(cfg, 1, 64, random_tiny.dtype).bytes_per_page
    rng = random.Random(4)
    vocab = cfg.vocab_size
    families = [random_prompt(rng, 40, vocab) for _ in range(5)]
    with running(random_tiny, max_model_len=128, max_batch=2, kv_cache_gb=4 * block_bytes / 2**30) as engine:
        for round_ in range(2):
            for fam in families:
                prompt = fam + random_prompt(rng, 4, vocab)
                res, _ = await collect(engine, Request(prompt, greedy(6, ignore_eos=True)))
                assert res.token_ids == greedy_reference(random_tiny.model, prompt, 6)[0]
                assert engine.stats().kv_pages_used <= 4
        st = engine.stats()
    assert st.prefix_cache_evictions_total > 0 and st.prefix_cache_entries <= 4
    assert st.prefix_hit_tokens_total == 0  # each family was evicted before it came back (LRU, 5 > 4)


async def test_a_request_cancelled_mid_prefill_leaves_no_entry_and_the_next_is_exact(random_tiny):
    rng = random.Random(6)
    prompt = random_prompt(rng, 90, random_tiny.config.vocab_size)
    with running(random_tiny, token_budget=16) as engine:
        def before(batch):
            for c in batch.prefill:
                if c.seq.request_id == "cut" and c.start >= 32:
                    engine.cancel("cut")
        wrap_step(engine, before=before)
        cut, _ = await collect(engine, Request(prompt, greedy(4), request_id="cut"))
        assert cut.finish_reason is FinishReason.CANCELLED
        await wait_idle(engine)
        assert engine.stats().prefix_cache_entries == 0
        res, _ = await collect(engine, Request(prompt, greedy(8, ignore_eos=True)))
        assert res.token_ids == greedy_reference(random_tiny.model, prompt, 8)[0]
        assert engine.stats().prefix_hit_tokens_total == 0


async def test_a_poisoned_request_that_shares_a_cached_prefix_fails_alone_and_is_not_cached(trained):
    from test_engine_faults import poisoned_model

    loaded, poisoned = poisoned_model(trained, 40)
    clean = poisoned[:2] + random_prompt(random.Random(9), 45, loaded.config.vocab_size)
    clean = [t for t in clean if t != poisoned[2]][:45]
    with running(loaded, max_batch=2) as engine:
        first, _ = await collect(engine, Request(clean, greedy(6, ignore_eos=True)))
        bad, _ = await collect(engine, Request(poisoned, greedy(5), request_id="poisoned"))
        assert bad.finish_reason is FinishReason.ERROR
        await wait_idle(engine)
        assert engine.stats().prefix_cache_entries == 1  # the clean one only
        again, _ = await collect(engine, Request(clean + [5, 6], greedy(6, ignore_eos=True)))
        assert engine.stats().prefix_hit_tokens_total >= len(clean)
    assert first.token_ids == greedy_reference(loaded.model, clean, 6)[0]
    assert again.token_ids == greedy_reference(loaded.model, clean + [5, 6], 6)[0]


async def test_preemption_under_a_tiny_budget_loses_and_repeats_no_token(random_tiny):
    """Three blocks of 64 positions for six requests that each grow past 64: the newest are preempted
    and recomputed. Greedy results equal the oracle, streamed chunks add up to exactly the result, and a
    seeded sampled request draws the same tokens as when it runs alone."""
    cfg = random_tiny.config
    block_bytes = KVCache(cfg, 1, 64, random_tiny.dtype).bytes_per_page
    rng = random.Random(7)
    prompts = [random_prompt(rng, rng.randint(20, 50), cfg.vocab_size) for _ in range(6)]
    sampled = SamplingParams(max_new_tokens=60, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    with running(random_tiny, max_model_len=128, prefix_cache=False) as engine:
        alone, _ = await collect(engine, Request(prompts[0], sampled))
    with running(random_tiny, max_model_len=128, max_batch=8, kv_cache_gb=3 * block_bytes / 2**30) as engine:
        reqs = [Request(p, greedy(60, ignore_eos=True)) for p in prompts] + [Request(prompts[0], sampled)]
        outs = await asyncio.gather(*(collect(engine, r) for r in reqs))
        st = engine.stats()
    assert st.preemptions_total > 0
    for (res, chunks), p in zip(outs[:-1], prompts):
        assert res.finish_reason is FinishReason.LENGTH
        assert [t for c in chunks for t in c.token_ids] == res.token_ids  # nothing lost or repeated
        assert res.token_ids == greedy_reference(random_tiny.model, p, 60)[0]
    assert outs[-1][0].token_ids == alone.token_ids


async def test_prefix_cache_off_keeps_nothing(random_tiny):
    rng = random.Random(8)
    prompt = random_prompt(rng, 40, random_tiny.config.vocab_size)
    with running(random_tiny, prefix_cache=False) as engine:
        await results_of(engine, [Request(prompt, greedy(4)), Request(prompt, greedy(4))])
        st = engine.stats()
    assert st.prefix_cache_entries == 0 and st.prefix_hit_tokens_total == 0 and st.prefix_queried_tokens_total == 0


@pytest.fixture(scope="module")
def trained_bf16(trained_model_dir, native_kernels_dir):
    """The memorizing model in bfloat16 with the native kernels the loader installs on this CPU."""
    from lmserve.model.loader import load_model

    loaded = load_model(trained_model_dir, dtype=torch.bfloat16, device="cpu",
                        cache_dir=native_kernels_dir)
    if getattr(loaded.attention, "prompt_kernel", None) is None:  # SDPA serves prompts there; the property below is the kernel's
        pytest.skip("no prompt-attention kernel on this CPU (it needs AVX2)")
    return loaded


async def test_bfloat16_prompt_kernel_gives_the_same_bits_however_the_prompt_is_cut(trained_bf16):
    """On the prompt-attention kernel a token's attention depends only on its own keys: a prompt served
    after a prefix hit and then in 16-token chunks gives the first logits of the same prompt prefilled
    whole on a cold engine, bit for bit (through SDPA in bfloat16 the chunked prefill rounds differently)."""
    rng = random.Random(3)
    vocab = trained_bf16.config.vocab_size
    shared, tail = random_prompt(rng, 40, vocab), random_prompt(rng, 50, vocab)
    with running(trained_bf16, token_budget=16) as engine:
        logits = capture_first_logits(engine, "b")
        await collect(engine, Request(shared + random_prompt(rng, 7, vocab), greedy(3, ignore_eos=True)))
        hot, _ = await collect(engine, Request(shared + tail, greedy(8, ignore_eos=True), request_id="b"))
        assert engine.stats().prefix_hit_tokens_total >= 40
    with running(trained_bf16, prefix_cache=False) as engine:
        cold_logits = capture_first_logits(engine, "b")
        cold, _ = await collect(engine, Request(shared + tail, greedy(8, ignore_eos=True), request_id="b"))
    assert hot.token_ids == cold.token_ids
    assert torch.equal(logits["b"], cold_logits["b"])
