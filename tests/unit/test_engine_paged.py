"""The engine on the paged attention (`attention="paged"`): the paged KV cache and the paged kernel, on CPU
(the kernel run by Triton's interpreter), on the tiny random model in float32.

Oracles: the same requests through the engine's default attention (SDPA over the dense/virtual cache),
and the full-recompute greedy reference. Greedy tokens must be equal alone, batched, chunked, after a
prefix hit and through preemption; the `running` helper then checks that every slot and page the KV
manager charged came back, and these tests check that the pool's pages did too.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from torch.testing import assert_close

from test_engine_helpers import (  # noqa: F401 - fixtures are used by name
    collect, greedy, greedy_reference, one_torch_thread, random_prompt, results_of, running, tiny_loaded)
from lmserve.model.attention.backend import PagedBackend
from lmserve.model.attention.paged import paged_attention, triton_available
from lmserve.model.paged_kv_cache import PagedKVCache
from lmserve.model.text.tokenizer import Tokenizer
from lmserve.server.engine.request import FinishReason, Request
from lmserve.server.engine.settings import EngineSettings

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed (pip install -e .[dev]): "
                                                               "the paged kernel cannot run")
# small enough to start fast: no step-cost seeding (max_step_ms 0), no speculation, a small pool
PAGED = dict(attention="paged", max_step_ms=0, speculation="off", kv_cache_gb=0.002, max_model_len=128)
SDPA = dict(max_step_ms=0, speculation="off", max_model_len=128)


@pytest.fixture(scope="module")
def random_tiny(trained_model_dir):
    """test_engine_helpers' random tiny model over the trained tokenizer, without loading the trained model
    itself (its native kernels are not needed here)."""
    return tiny_loaded(Tokenizer.from_dir(trained_model_dir), seed=0)


def prompts_for(loaded, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [random_prompt(rng, n, loaded.config.vocab_size) for n in lengths]


async def tokens(loaded, prompts: list[list[int]], new: int, concurrent: bool, **settings) -> tuple[list[list[int]], object]:
    with running(loaded, **settings) as engine:
        reqs = [Request(p, greedy(new, ignore_eos=True)) for p in prompts]
        if concurrent:
            results = await results_of(engine, reqs)
        else:
            results = [(await collect(engine, r))[0] for r in reqs]
        stats = engine.stats()
        if settings.get("attention") == "paged":
            assert isinstance(engine.cache, PagedKVCache) and isinstance(engine.runner.attention, PagedBackend)
            assert engine.runner.attention.kernel is paged_attention
            engine.drop_prefix_cache()
            assert engine.cache.pages_free == engine.cache.num_pages  # every page mapped came back
    assert all(r.finish_reason is FinishReason.LENGTH for r in results)
    return [r.token_ids for r in results], stats


@needs_triton
async def test_paged_greedy_tokens_equal_sdpa_alone_batched_and_chunked(random_tiny):
    prompts = prompts_for(random_tiny, [5, 17, 15, 33], seed=1)  # around the 16-token page
    want, _ = await tokens(random_tiny, prompts, 8, False, **SDPA)
    assert want[1] == greedy_reference(random_tiny.model, prompts[1], 8)[0]
    alone, _ = await tokens(random_tiny, prompts, 8, False, **PAGED)
    batched, _ = await tokens(random_tiny, prompts, 8, True, **PAGED)
    chunked, _ = await tokens(random_tiny, prompts, 8, True, token_budget=8, **PAGED)  # prompts in chunks of <= 8
    assert alone == want
    assert batched == want
    assert chunked == want


@needs_triton
async def test_paged_prefix_hit_shares_pages_and_gives_the_cold_tokens(random_tiny):
    rng = random.Random(3)
    vocab = random_tiny.config.vocab_size
    shared = random_prompt(rng, 37, vocab)  # two full pages shared, the third copied
    first, second = shared + random_prompt(rng, 5, vocab), shared + random_prompt(rng, 6, vocab)
    with running(random_tiny, **PAGED) as engine:
        await collect(engine, Request(first, greedy(4, ignore_eos=True)))
        entry = engine.scheduler.kv.prefix_cache.entries()[0]
        shared_pages = engine.cache.mapped(entry.slot)[:2]
        seen = {}
        inner = engine.runner.step

        def step(batch, previous=None):  # the hit's slot maps the entry's pages once its copy ran
            out = inner(batch, previous)
            for c in batch.prefill:
                seen.setdefault("pages", engine.cache.mapped(c.seq.slot)[:2])
            return out

        engine.runner.step = step
        hot, _ = await collect(engine, Request(second, greedy(8, ignore_eos=True)))
        hit = engine.stats().prefix_hit_tokens_total
    assert hit == 37
    assert seen["pages"] == shared_pages
    cold, _ = await tokens(random_tiny, [second], 8, False, **{**SDPA, "prefix_cache": False})
    assert hot.token_ids == cold[0] == greedy_reference(random_tiny.model, second, 8)[0]


@needs_triton
async def test_paged_preemption_under_a_small_pool_loses_no_token(random_tiny):
    """Four requests growing past a pool of 7 pages: the newest are preempted and recomputed, the tokens
    still equal the oracle's, and every page comes back."""
    page_bytes = 16 * PagedKVCache.bytes_per_token(random_tiny.config, torch.float32)
    prompts = prompts_for(random_tiny, [20, 30, 18, 25], seed=4)
    settings = {**PAGED, "kv_cache_gb": 7 * page_bytes / 2**30, "max_model_len": 64, "prefix_cache": False}
    with running(random_tiny, **settings) as engine:
        outs = await asyncio.gather(*(collect(engine, Request(p, greedy(18, ignore_eos=True))) for p in prompts))
        assert engine.stats().preemptions_total > 0
        assert engine.cache.pages_free == engine.cache.num_pages == 7
    for (res, _), p in zip(outs, prompts):
        assert res.token_ids == greedy_reference(random_tiny.model, p, 18)[0]


def test_the_attention_setting_is_validated():
    assert EngineSettings(attention="paged").attention == "paged"
    with pytest.raises(ValueError, match="attention must be one of auto, paged"):
        EngineSettings(attention="flash")


@needs_triton
@torch.inference_mode()
def test_graph_decode_equals_the_eager_decode_with_padded_rows(random_tiny):
    """What DecodeGraphs captures over a paged cache (PagedBackend.graph_decode: built from tensors alone,
    padded to a bucket by repeating row 0) gives the eager decode's logits; a row crossing into a page
    mapped after the prefill reads it through the block table in place."""
    cfg, model = random_tiny.config, random_tiny.model
    cache = PagedKVCache(cfg, num_slots=4, max_len=64, num_pages=12, dtype=torch.float32)
    backend = PagedBackend("cpu", cfg)
    prompts = prompts_for(random_tiny, [5, 16, 9], seed=6)
    slots = [2, 0, 3]
    for s, p in zip(slots, prompts):
        cache.map(s, len(p))
    lens = torch.tensor([len(p) for p in prompts])
    meta, positions = backend.packed(torch.tensor(slots), lens)
    last = model(torch.tensor([[t for p in prompts for t in p]]), positions, meta, cache,
                 logits_index=lens.cumsum(0) - 1).argmax(-1)  # [3]
    for s, p in zip(slots, prompts):
        cache.map(s, len(p) + 1)  # slot 0's position 16 opens its second page
    starts = [len(p) for p in prompts]
    meta, positions = backend.decode(slots, starts)
    eager = model(last[:, None], positions, meta, cache)[:, 0]  # [3, V]
    pad = lambda xs: torch.tensor(xs + xs[:1])  # noqa: E731 - a bucket of 4
    meta = backend.graph_decode(pad(slots), pad(starts), cache)
    graph = model(pad(last.tolist())[:, None], pad(starts)[:, None], meta, cache)[:3, 0]
    assert_close(graph, eager, rtol=1e-5, atol=1e-5)  # the linears round differently at 4 rows than at 3
    assert torch.equal(graph.argmax(-1), eager.argmax(-1))
    want = [greedy_reference(model, p, 2)[0] for p in prompts]
    assert [[int(a), int(b)] for a, b in zip(last, eager.argmax(-1))] == want


@needs_triton
async def test_paged_verified_drafts_give_the_tokens_of_decoding_one_at_a_time(random_tiny):
    """Speculation's verifying rows (one slot at consecutive positions in one decode call, every row's K/V
    written before any attends) through the paged kernel: the tokens of plain decoding."""
    rng = random.Random(8)
    prompt = random_prompt(rng, 20, random_tiny.config.vocab_size)
    want, _ = await tokens(random_tiny, [prompt], 12, False, **SDPA)
    with running(random_tiny, **{**PAGED, "speculation": "ngram"}) as engine:
        # a predicted output (drafted as is) right for 6 tokens, wrong at the 7th: accepted and rejected drafts
        vocab = random_tiny.config.vocab_size
        predicted = tuple(want[0][:6] + [(want[0][6] + 1) % vocab] + want[0][7:])
        got, _ = await collect(engine, Request(prompt, greedy(12, ignore_eos=True, prediction=predicted)))
        drafted, accepted = engine.stats().drafted_tokens_total, engine.stats().accepted_tokens_total
    assert 0 < accepted < drafted
    assert got.token_ids == want[0]


async def test_without_triton_the_paged_engine_serves_on_the_torch_reference(random_tiny, monkeypatch):
    """Where triton is missing, --attention paged still serves (slowly) through the plain-torch reference of
    the kernel's contract: the SDPA engine's tokens, batched and chunked."""
    from lmserve.model.attention import backend as B
    from lmserve.model.attention.paged import paged_attention_reference

    monkeypatch.setattr(B, "triton_available", lambda: False)
    prompts = prompts_for(random_tiny, [7, 20, 16], seed=9)
    want, _ = await tokens(random_tiny, prompts, 6, True, **SDPA)
    with running(random_tiny, token_budget=8, **PAGED) as engine:
        assert engine.runner.attention.kernel is paged_attention_reference
        got = [r.token_ids for r in await results_of(engine, [Request(p, greedy(6, ignore_eos=True)) for p in prompts])]
    assert got == want
