"""Overlapped engine steps (`overlap_steps`): step k+1 is launched before step k's tokens are read back.

On CPU a step computes inside the call, so nothing runs concurrently here, but every piece of the
bookkeeping that overlap needs runs exactly as on an accelerator: decode inputs read from the previous
step's sampled tokens on the device, tokens recorded a step late, sequences that end at step k holding
a row of step k+1 whose token is dropped, preemption of a sequence whose token is still in flight.
The oracle is the plain loop (`overlap_steps=False`) over the same requests: the same tokens, text and
finish reasons, request by request.
"""

from __future__ import annotations

import random

import pytest

from lmserve.model.kv_cache import KVCache
from lmserve.server.engine.request import FinishReason, Request, SamplingParams
from test_engine_helpers import (  # noqa: F401 - fixtures are used by name
    greedy, one_torch_thread, random_prompt, random_tiny, results_of, running, trained, wait_idle, wrap_step,
)


def mixed_requests(vocab: int, stop_id: int | None = None, stop_text: str | None = None) -> list[Request]:
    """Greedy, seeded sampling with each filter, penalties, logprobs; the last two greedy requests end
    at `stop_id` and at `stop_text` when given (both taken from a plain run)."""
    rng = random.Random(5)
    kinds = [
        greedy(24, ignore_eos=True),
        SamplingParams(max_new_tokens=20, temperature=0.9, seed=7, top_k=40),
        SamplingParams(max_new_tokens=20, temperature=1.1, seed=8, top_p=0.8),
        SamplingParams(max_new_tokens=20, temperature=0.8, seed=9, min_p=0.05),
        greedy(22, ignore_eos=True, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3),
        greedy(16, ignore_eos=True, logprobs=3),
        greedy(30, ignore_eos=True, stop_token_ids=() if stop_id is None else (stop_id,)),
        greedy(30, ignore_eos=True, stop=() if stop_text is None else (stop_text,)),
    ]
    return [Request(random_prompt(rng, rng.randint(30, 60), vocab), params, request_id=f"r{i}")
            for i, params in enumerate(kinds)]


def squeezed(random_tiny) -> dict:
    """Three blocks of 64 positions for eight requests that each grow past one block: preemptions."""
    per_block = KVCache.bytes_per_token(random_tiny.config, random_tiny.dtype) * 64
    return dict(max_batch=8, max_model_len=128, kv_cache_gb=3 * per_block / 2**30)


async def run_both(loaded, requests: list[Request], **settings):
    out = {}
    for overlap in (False, True):
        with running(loaded, overlap_steps=overlap, **settings) as engine:
            out[overlap] = (await results_of(engine, [Request(r.prompt_ids, r.params, request_id=r.request_id)
                                                      for r in requests]), engine.stats())
    return out


async def test_overlapped_steps_give_the_plain_loops_results_under_kv_pressure(random_tiny):
    vocab = random_tiny.config.vocab_size
    base = await run_both(random_tiny, mixed_requests(vocab), **squeezed(random_tiny))
    plain = base[False][0]
    # stops taken from the plain run: a stop id at its 6th token, a stop string inside its text
    stop_id, text = plain[6].token_ids[5], plain[7].text
    stop_text = text[len(text) // 2:][:3]
    assert stop_text.strip(), "the stop string must be visible text"
    both = await run_both(random_tiny, mixed_requests(vocab, stop_id, stop_text), **squeezed(random_tiny))
    (plain, plain_stats), (over, over_stats) = both[False], both[True]
    for p, o in zip(plain, over):
        assert (o.token_ids, o.text, o.finish_reason) == (p.token_ids, p.text, p.finish_reason), o.request_id
        assert o.usage.completion_tokens == p.usage.completion_tokens
        assert [lp.token_id for lp in o.logprobs] == [lp.token_id for lp in p.logprobs]
        assert [lp.logprob for lp in o.logprobs] == pytest.approx([lp.logprob for lp in p.logprobs], abs=1e-5)
    assert over[6].finish_reason is FinishReason.EOS and over[6].token_ids[-1] == stop_id
    assert over[7].finish_reason is FinishReason.STOP and stop_text not in over[7].text
    assert over[5].logprobs and over[1].token_ids != over[0].token_ids
    assert plain_stats.preemptions_total > 0 and over_stats.preemptions_total > 0  # the squeeze did preempt


async def test_each_step_is_launched_before_the_previous_ones_tokens_are_read(random_tiny):
    """The call order itself: plain, launch k then record k; overlapped, launch k+1 before record k,
    and decode rows fed from the previous step's tokens on the device."""
    prompt = random_prompt(random.Random(3), 9, random_tiny.config.vocab_size)
    orders = {}
    for overlap in (False, True):
        with running(random_tiny, overlap_steps=overlap) as engine:
            events, fed = [], []
            postprocess = engine.processor.postprocess

            def recorded(scheduler, step, postprocess=postprocess, events=events):
                events.append("record")
                return postprocess(scheduler, step)

            engine.processor.postprocess = recorded
            wrap_step(engine, before=lambda batch, events=events, fed=fed: (
                events.append("launch"), fed.append(sum(s.pending for s in batch.decode))))
            (res,) = await results_of(engine, [Request(prompt, greedy(6, ignore_eos=True))])
            await wait_idle(engine)
        orders[overlap] = (events, fed)
        assert len(res.token_ids) == 6
    assert orders[False] == (["launch", "record"] * 6, [0] * 6)
    assert orders[True] == (["launch", "launch", "record"] + ["launch", "record"] * 4 + ["record"], [0] + [1] * 5)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
async def test_a_stop_costs_overlap_one_dropped_row_and_a_length_limit_none(random_tiny, overlap):
    """A request ending at a stop token is discovered a step late when overlapped: one more row ran
    for it (its token dropped); a length limit is known in advance, so no row is wasted on it."""
    prompt = random_prompt(random.Random(4), 7, random_tiny.config.vocab_size)
    with running(random_tiny, overlap_steps=overlap) as engine:
        seen = wrap_step(engine)
        (free,) = await results_of(engine, [Request(prompt, greedy(12, ignore_eos=True), request_id="free")])
        stop_id = free.token_ids[4]
        (stopped,) = await results_of(engine, [Request(prompt, greedy(12, ignore_eos=True, stop_token_ids=(stop_id,)),
                                                       request_id="stopped")])
    rows = {rid: sum(rid in step for step in seen) for rid in ("free", "stopped")}
    assert stopped.token_ids == free.token_ids[:5] and stopped.finish_reason is FinishReason.EOS
    assert rows == {"free": 12, "stopped": 5 + overlap}
