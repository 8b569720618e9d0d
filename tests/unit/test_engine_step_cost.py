"""A long prompt under continuous decode load, with the step-time budget on: its prefill is cut into
chunks that ride along with every stream's decode row, always completes, and gives the tokens it
gives alone."""

from __future__ import annotations

import asyncio
import random

import pytest

from lmserve.server.engine.request import Request
from test_engine_helpers import (  # noqa: F401 - fixtures are used by name
    collect, greedy, greedy_reference, one_torch_thread, random_prompt, running, trained, wait_until,
)

STREAMS = 4
LONG = 100  # > 4 x 16: short prompts are not split


class StepLog:
    def __init__(self):
        self.steps = []  # (decode request ids, [(request id, start, length)])

    def on_step(self, seconds, batch):
        self.steps.append(({s.request_id for s in batch.decode}, [(c.seq.request_id, c.start, c.length) for c in batch.prefill]))

    def on_tokens(self, seq, count, gap):
        pass

    def on_finish(self, seq, final):
        pass


@pytest.mark.parametrize("max_step_ms", [1e-3, None], ids=["target-below-any-step", "automatic"])
async def test_long_prompt_completes_its_prefill_while_streams_keep_decoding(trained, max_step_ms):
    rng = random.Random(3)
    vocab = trained.config.vocab_size
    long_prompt = random_prompt(rng, LONG, vocab)
    expected, _ = greedy_reference(trained.model, long_prompt, 8)
    with running(trained, max_batch=STREAMS + 1, max_model_len=128, token_budget=64, max_step_ms=max_step_ms) as engine:
        log = StepLog()
        engine.observers.append(log)
        streams = [asyncio.ensure_future(collect(engine, Request(random_prompt(rng, 4, vocab), greedy(120, ignore_eos=True),
                                                                 request_id=f"s{i}")))
                   for i in range(STREAMS)]
        await wait_until(lambda: sum(len(d) == STREAMS for d, _ in log.steps) >= 3, "the streams decoding")
        # a starved prefill would wait for the streams to end (120 tokens): the check below catches it
        result, _ = await asyncio.wait_for(collect(engine, Request(long_prompt, greedy(8, ignore_eos=True),
                                                                   request_id="long")), 120)
        streaming_at_end = [not s.done() for s in streams]
        outs = await asyncio.gather(*streams)

    assert result.token_ids == expected  # chunked among decode rows == alone
    assert all(streaming_at_end), "the decode load must outlast the long prompt's prefill"
    assert all(len(r.token_ids) == 120 for r, _ in outs)
    chunks = [(decode, c) for decode, prefill in log.steps for c in prefill if c[0] == "long"]
    assert sum(c[2] for _, c in chunks) == LONG and chunks[0][1][1] == 0  # contiguous chunks cover the prompt
    assert all(a[1] + a[2] == b[1] for (_, a), (_, b) in zip(chunks, chunks[1:]))
    assert all(decode == {f"s{i}" for i in range(STREAMS)} for decode, _ in chunks)  # no decode row dropped
    # within [smallest chunk, token budget - rows]; how many chunks the budget makes depends on the step
    # times it measures, which a busy machine changes, so only these bounds are asserted
    assert all(16 <= c[2] <= 64 - STREAMS for _, c in chunks[:-1])


@pytest.mark.parametrize("max_batch, prefix_cache", [(1, False), (6, True)], ids=["one-slot", "spare-slots"])
async def test_a_new_engines_pacer_has_seen_every_kind_of_step_and_the_cache_is_clean(trained, max_batch, prefix_cache):
    """The pacer's first fit comes from steps the engine runs at start (decode steps of one and of several
    rows, two prompt lengths, a mixed step where a spare slot allows one): ready before any request,
    with nothing left in the cache they wrote to, and the first requests' tokens unchanged."""
    from lmserve.server.engine import Engine, EngineSettings
    from lmserve.server.engine.step_cost import DECODE_ROWS, PREFILL_PAIRS_K, PREFILL_TOKENS

    engine = Engine(trained, EngineSettings(max_batch=max_batch, max_model_len=128, prefix_cache=prefix_cache))
    model = engine.step_pacer.model
    assert model.ready and model.counts["decode"] == 2 and model.counts["prefill"] == 3
    assert model.counts["mixed"] == (0 if engine.cache.num_slots == 1 else 1)  # one slot: no room for a mixed step
    assert min(model.coef[PREFILL_TOKENS], model.coef[PREFILL_PAIRS_K], model.coef[DECODE_ROWS]) >= 0
    assert not engine.cache.k.any() and not engine.cache.v.any()  # every slot handed back: zeros
    rng = random.Random(5)
    prompts = [random_prompt(rng, n, trained.config.vocab_size) for n in (5, 30)]
    engine.start()
    try:
        for p in prompts:
            result, _ = await collect(engine, Request(p, greedy(6, ignore_eos=True)))
            assert result.token_ids == greedy_reference(trained.model, p, 6)[0]
    finally:
        engine.shutdown()


def test_a_restart_takes_the_seeded_step_costs_from_the_disk_cache(trained, tmp_path, monkeypatch):
    """What the start-up steps measured is kept beside the precision plan: a second engine on the same
    model, mode and settings fits the same pacer without running a step."""
    import dataclasses

    from lmserve.server.engine import Engine, EngineSettings
    from lmserve.server.engine.runner import ModelRunner

    loaded = dataclasses.replace(trained, cache_dir=tmp_path)
    settings = EngineSettings(max_batch=6, max_model_len=128, speculation="off")
    first = Engine(loaded, settings)
    assert len(list((tmp_path / "kernels").glob("steps-*.json"))) == 1
    ran, real = [], ModelRunner.run
    monkeypatch.setattr(ModelRunner, "run", lambda self, batch: ran.append(batch) or real(self, batch))
    again = Engine(loaded, settings)
    assert not ran
    assert again.step_pacer.model.counts == first.step_pacer.model.counts
    assert again.step_pacer.model.coef == first.step_pacer.model.coef
    other = Engine(loaded, dataclasses.replace(settings, max_model_len=64))  # other steps: measured again
    assert ran and other.step_pacer.model.ready


def test_a_restart_takes_auto_speculations_verify_cost_from_the_disk_cache(trained, tmp_path, monkeypatch):
    """auto speculation's verify cost (steps verifying drafts against plain ones) is kept beside the plan
    too: a second engine decides with the recorded cost without running a step."""
    import dataclasses

    from lmserve.server.engine import Engine, EngineSettings
    from lmserve.server.engine.runner import ModelRunner

    loaded = dataclasses.replace(trained, cache_dir=tmp_path)
    settings = EngineSettings(max_batch=6, max_model_len=128, speculation="auto", overlap_steps=False)
    first = Engine(loaded, settings)
    assert first.verify_cost is not None and len(list((tmp_path / "kernels").glob("steps-*.json"))) == 2
    ran, real = [], ModelRunner.step
    monkeypatch.setattr(ModelRunner, "step", lambda self, batch: ran.append(batch) or real(self, batch))
    again = Engine(loaded, settings)
    assert not ran and again.verify_cost == first.verify_cost
    assert (again.scheduler.speculation is None) == (first.scheduler.speculation is None)
