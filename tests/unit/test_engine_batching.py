"""Batch invariance: a request's tokens do not depend on who else is in the batch.

A pool of 33 requests (different prompt lengths, lengths to generate, greedy and seeded sampling)
is first run one at a time (one KV slot: every request alone), then with the target request among
1, 8 or 32 others that join while it streams and leave before it ends; also with chunked prefill
(a small token budget splits prompts) and with fewer slots than requests (queueing, slot reuse).
Every request must produce exactly the tokens it produced alone.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import pytest

from lmserve.server.engine.outputs import GenerationResult
from lmserve.server.engine.request import Request, SamplingParams
from test_engine_helpers import (  # noqa: F401 - fixtures are used by name
    collect, corpus_prompt, greedy, greedy_reference, one_torch_thread, prompt_continuations, random_prompt,
    random_tiny, running, single_torch_thread, trained, wait_idle,
)

POOL_SIZE = 33  # the target and up to 32 others
TARGET_NEW = 32


@dataclass(frozen=True)
class Spec:
    prompt: list[int]
    params: SamplingParams
    join_after: int  # others: submitted once the target has streamed this many tokens (0: at once)

    def request(self, rid: str) -> Request:
        return Request(list(self.prompt), self.params, request_id=rid)


def make_pool(loaded, seed: int) -> list[Spec]:
    """Spec 0 is the target; the others mix corpus and random prompts of 1..50 tokens."""
    rng = random.Random(seed)
    tok, vocab = loaded.tokenizer, loaded.config.vocab_size
    ctx = loaded.config.max_position_embeddings
    prefixes = [p for p, _ in prompt_continuations()]
    trained_like = ctx <= 128  # the memorizing model: it ends corpus prompts with eos by itself
    pool = [Spec(corpus_prompt(tok, "The lighthouse keeper climbed the"), greedy(TARGET_NEW, ignore_eos=not trained_like), 0)]
    for i in range(1, POOL_SIZE):
        if i % 3 == 0:
            prompt = corpus_prompt(tok, prefixes[i % len(prefixes)])
        else:
            prompt = random_prompt(rng, rng.choice([1, 2, 5, 17, 31, 50]), vocab)
        max_new = rng.randint(1, min(24, ctx - len(prompt)))
        if i % 4 == 1:  # seeded sampling; its generator must not see the neighbours
            params = SamplingParams(max_new_tokens=max_new, temperature=0.8, top_p=0.95, seed=i,
                                    ignore_eos=not trained_like)
        else:
            params = greedy(max_new, ignore_eos=not trained_like or i % 2 == 0)
        pool.append(Spec(prompt, params, join_after=0 if i % 3 == 1 else rng.randint(1, 10)))
    return pool


async def run_alone(loaded, pool: list[Spec]) -> list[GenerationResult]:
    """Every request on its own: one KV slot, each request awaited before the next is sent."""
    out = []
    with running(loaded, max_batch=1) as engine:
        for i, spec in enumerate(pool):
            out.append((await collect(engine, spec.request(f"alone-{i}")))[0])
    return out


async def run_staggered(engine, pool: list[Spec], n_others: int) -> list[GenerationResult]:
    """The target streams while others join at their `join_after` point; returns results in pool order."""
    reached = [asyncio.Event() for _ in range(TARGET_NEW + 1)]
    reached[0].set()

    async def target() -> GenerationResult:
        res = GenerationResult("target")
        async for chunk in engine.generate(pool[0].request("target")):
            res.add(chunk)
            reached[min(len(res.token_ids), TARGET_NEW)].set()
        for ev in reached:
            ev.set()
        return res

    async def other(i: int) -> GenerationResult:
        await reached[pool[i].join_after].wait()
        return (await collect(engine, pool[i].request(f"other-{i}")))[0]

    first = [asyncio.ensure_future(other(i)) for i in range(1, n_others + 1) if pool[i].join_after == 0]
    results = await asyncio.gather(target(), *(other(i) for i in range(1, n_others + 1) if pool[i].join_after))
    early = await asyncio.gather(*first)
    by_id = {r.request_id: r for r in [*results, *early]}
    return [by_id["target"], *(by_id[f"other-{i}"] for i in range(1, n_others + 1))]


@pytest.fixture(scope="module")
def pools(trained, random_tiny):
    """Pools and their alone results, computed once per model."""
    out = {}
    with single_torch_thread():
        for name, loaded in (("trained", trained), ("random_tiny", random_tiny)):
            pool = make_pool(loaded, seed=7)
            out[name] = (loaded, pool, asyncio.run(run_alone(loaded, pool)))
    return out


CASES = [
    ("wide", 1, dict(max_batch=40)),
    ("wide", 8, dict(max_batch=40)),
    ("wide", 32, dict(max_batch=40)),
    ("chunked", 8, dict(max_batch=40, token_budget=16)),
    ("chunked", 32, dict(max_batch=40, token_budget=16)),
    ("few_slots", 32, dict(max_batch=5)),
    ("few_slots_chunked", 32, dict(max_batch=5, token_budget=16)),
]


@pytest.mark.parametrize("model_name", ["trained", "random_tiny"])
@pytest.mark.parametrize("case,n_others,settings", CASES, ids=[f"{c}-{n}" for c, n, _ in CASES])
async def test_tokens_identical_alone_and_among_others(pools, model_name, case, n_others, settings):
    loaded, pool, alone = pools[model_name]
    shared_steps, split_prompts = [], []

    with running(loaded, **settings) as engine:
        inner = engine.runner.step

        def step(batch, previous=None):
            ids = [c.seq.request_id for c in batch.prefill] + [s.request_id for s in batch.decode]
            if "target" in ids and len(ids) > 1:
                shared_steps.append(ids)
            split_prompts.extend(c.seq.request_id for c in batch.prefill if c.start > 0)
            return inner(batch, previous)

        engine.runner.step = step
        results = await run_staggered(engine, pool, n_others)
        await wait_idle(engine)
        stats = engine.stats()

    for i, (got, want) in enumerate(zip(results, alone)):
        assert len(want.token_ids) >= 1
        assert got.token_ids == want.token_ids, f"request {i} ({len(pool[i].prompt)}-token prompt)"
        assert got.finish_reason is want.finish_reason
        assert got.text == want.text
    assert stats.slots_allocated_total == n_others + 1  # every request got a slot exactly once
    assert stats.max_batch == settings["max_batch"]
    # the scenario really batched: the target shared steps with others
    assert shared_steps, "the target never ran in a step with another request"
    if "token_budget" in settings:
        assert split_prompts, "no prompt was split into chunks"
    else:
        assert not split_prompts


async def test_alone_results_match_the_full_recompute_oracle(pools):
    """The alone runs themselves are right: greedy pool entries equal the cache-free oracle."""
    for loaded, pool, alone in pools.values():
        checked = 0
        for spec, res in zip(pool[:12], alone[:12]):
            if spec.params.temperature == 0:
                stop = () if spec.params.ignore_eos else tuple(loaded.tokenizer.eos_ids)
                ref, _ = greedy_reference(loaded.model, spec.prompt, spec.params.max_new_tokens, stop_ids=stop)
                assert res.token_ids == ref
                checked += 1
        assert checked >= 6


async def test_many_more_requests_than_slots_all_finish_and_slots_come_back(random_tiny):
    rng = random.Random(3)
    vocab = random_tiny.config.vocab_size
    prompts = [random_prompt(rng, rng.randint(1, 20), vocab) for _ in range(40)]
    news = [rng.randint(1, 8) for _ in prompts]
    with running(random_tiny, max_batch=3) as engine:
        results = await asyncio.gather(*(collect(engine, Request(p, greedy(n, ignore_eos=True)))
                                         for p, n in zip(prompts, news)))
        await wait_idle(engine)
        stats = engine.stats()
    for (res, _), p, n in zip(results, prompts, news):
        assert res.token_ids == greedy_reference(random_tiny.model, p, n)[0]
    assert stats.max_batch == 3
    assert stats.slots_allocated_total == stats.slots_freed_total == 40
