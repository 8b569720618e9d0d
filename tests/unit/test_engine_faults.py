"""Engine under trouble: cancellation, poisoned requests, failing steps, deadlines, the queue bound,
the watchdog and shutdown. Each failure must stay with its own request; the loop must live on.

Steps are paused with a threading.Event in a wrapped `runner.step`, and deadlines use a shifted
scheduler clock, so nothing here depends on how fast the machine is.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
import torch

from lmserve.server.engine import Engine, EngineSettings, EngineUnavailableError
from lmserve.server.engine.request import FinishReason, Request
from lmserve.server.engine.scheduler import QueueFullError
from test_engine_helpers import (  # noqa: F401 - fixtures are used by name
    collect, greedy, greedy_reference, one_torch_thread, random_prompt, random_tiny, results_of, running,
    tiny_loaded, trained, wait_idle, wait_until, wrap_step,
)


class FinishLog:
    """An engine observer that records each request's finish reason."""

    def __init__(self):
        self.reasons: dict[str, FinishReason] = {}

    def on_step(self, seconds, batch):
        pass

    def on_tokens(self, seq, count, gap_seconds):
        pass

    def on_finish(self, seq, final):
        self.reasons[seq.request_id] = final.finish_reason


def prompts_for(loaded, seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [random_prompt(rng, n, loaded.config.vocab_size) for n in lengths]


def seq_in(batch, request_id):
    return next((s for s in [c.seq for c in batch.prefill] + list(batch.decode) if s.request_id == request_id), None)


# ---- cancellation --------------------------------------------------------------------------------

async def test_cancel_mid_stream_frees_the_slot_and_spares_the_others(random_tiny):
    prompts = prompts_for(random_tiny, 1, (4, 9, 15, 3))
    news = (80, 12, 20, 30)
    refs = [greedy_reference(random_tiny.model, p, n)[0] for p, n in zip(prompts, news)]
    gate = threading.Event()

    def before(batch):  # hold the engine once the victim has 3 tokens, until the test has cancelled
        victim = seq_in(batch, "victim")
        if victim is not None and len(victim.output_ids) == 3:
            gate.wait(300)

    with running(random_tiny, max_batch=4) as engine:
        wrap_step(engine, before=before)
        try:
            others = [asyncio.ensure_future(collect(engine, Request(p, greedy(n, ignore_eos=True), request_id=f"o{i}")))
                      for i, (p, n) in enumerate(zip(prompts[1:], news[1:]))]
            got, tokens = None, []
            async for chunk in engine.generate(Request(prompts[0], greedy(news[0], ignore_eos=True), request_id="victim")):
                tokens += chunk.token_ids
                if len(tokens) == 3:
                    engine.cancel("victim")
                    gate.set()
                if chunk.finished:
                    got = chunk
        finally:
            gate.set()
        results = [r for r, _ in await asyncio.gather(*others)]
        await wait_idle(engine)
        stats = engine.stats()
    assert got.finish_reason is FinishReason.CANCELLED
    assert 3 <= got.usage.completion_tokens < news[0]
    assert tokens == refs[0][: len(tokens)]
    for res, ref in zip(results, refs[1:]):
        assert res.finish_reason is FinishReason.LENGTH and res.token_ids == ref
    assert stats.slots_allocated_total == stats.slots_freed_total == 4


@pytest.mark.parametrize("how", ["aclose", "break"])
async def test_leaving_the_stream_cancels_the_request(random_tiny, how):
    prompts = prompts_for(random_tiny, 2, (6, 11))
    log = FinishLog()
    gate = threading.Event()

    def before(batch):  # once "left" has 3 tokens, hold the engine until its stream was left, so it cannot
        left = seq_in(batch, "left")  # finish first however slowly this test's loop runs
        if left is not None and len(left.output_ids) >= 3:
            gate.wait(300)

    with running(random_tiny, max_batch=2) as engine:
        engine.observers.append(log)
        cancels = []
        real_cancel = engine.cancel
        engine.cancel = lambda request_id: (cancels.append(request_id), real_cancel(request_id))
        wrap_step(engine, before=before)
        try:
            other = asyncio.ensure_future(collect(engine, Request(prompts[1], greedy(25, ignore_eos=True),
                                                                  request_id="other")))
            if how == "aclose":
                stream = engine.generate(Request(prompts[0], greedy(200, ignore_eos=True), request_id="left"))
                n = 0
                while n < 3:  # chunks may arrive merged: count tokens, not chunks
                    n += len((await stream.__anext__()).token_ids)
                await stream.aclose()
            else:
                async def read_three():
                    n = 0
                    async for chunk in engine.generate(Request(prompts[0], greedy(200, ignore_eos=True),
                                                               request_id="left")):
                        n += len(chunk.token_ids)
                        if n >= 3:
                            break  # the abandoned generator is closed when collected
                await read_three()
            await wait_until(lambda: "left" in cancels, "the abandoned stream to cancel its request")
        finally:
            gate.set()
        await wait_until(lambda: "left" in log.reasons, "the abandoned request to finish")
        res, _ = await other
        await wait_idle(engine)
        stats = engine.stats()
    assert log.reasons["left"] is FinishReason.CANCELLED
    assert res.token_ids == greedy_reference(random_tiny.model, prompts[1], 25)[0]
    assert stats.slots_allocated_total == stats.slots_freed_total == 2


async def test_cancelling_a_waiting_request_and_unknown_ids(random_tiny):
    gate = threading.Event()
    prompts = prompts_for(random_tiny, 3, (5, 5))
    with running(random_tiny, max_batch=1) as engine:
        wrap_step(engine, before=lambda batch: gate.wait(300))
        try:
            first = asyncio.ensure_future(collect(engine, Request(prompts[0], greedy(6, ignore_eos=True))))
            await wait_until(lambda: engine.stats().running == 1, "the first request to hold the slot")
            waiting = engine.generate(Request(prompts[1], greedy(6), request_id="waiting"))
            assert engine.stats().waiting == 1
            engine.cancel("waiting")
            engine.cancel("no-such-request")
        finally:
            gate.set()
        chunks = [c async for c in waiting]
        res, _ = await first
        await wait_idle(engine)
        assert engine.health().ok
    assert [c.finish_reason for c in chunks] == [FinishReason.CANCELLED]
    assert chunks[0].usage.completion_tokens == 0 and chunks[0].token_ids == ()
    assert res.token_ids == greedy_reference(random_tiny.model, prompts[0], 6)[0]


async def test_a_stale_cancel_does_not_hit_a_later_request_with_the_same_id(random_tiny):
    gate = threading.Event()
    held = [False]
    prompts = prompts_for(random_tiny, 13, (4, 6, 5))

    def before(batch):
        if held[0]:
            gate.wait(300)

    with running(random_tiny, max_batch=2) as engine:
        wrap_step(engine, before=before)
        old, _ = await collect(engine, Request(prompts[0], greedy(3, ignore_eos=True), request_id="x"))
        try:
            held[0] = True  # the next step waits: the engine cannot act before both calls below are made
            busy = asyncio.ensure_future(collect(engine, Request(prompts[1], greedy(4, ignore_eos=True))))
            await wait_until(lambda: engine.stats().running == 1, "a step to be held")
            engine.cancel("x")  # late: "x" finished above
            new = asyncio.ensure_future(collect(engine, Request(prompts[2], greedy(6, ignore_eos=True), request_id="x")))
            await asyncio.sleep(0)
        finally:
            gate.set()
        (new_res, _), _ = await asyncio.gather(new, busy)
    assert old.finish_reason is FinishReason.LENGTH
    assert new_res.finish_reason is FinishReason.LENGTH
    assert new_res.token_ids == greedy_reference(random_tiny.model, prompts[2], 6)[0]


async def test_a_request_counts_as_running_until_its_outcome_is_recorded(random_tiny):
    # The slot is freed before the observers hear of the finish; a scrape in between must not
    # show an idle engine whose finished request is not counted yet.
    recording, release = threading.Event(), threading.Event()

    class SlowRecorder(FinishLog):
        def on_finish(self, seq, final):
            recording.set()
            release.wait(300)
            super().on_finish(seq, final)

    log = SlowRecorder()
    with running(random_tiny, max_batch=2) as engine:
        engine.observers.append(log)
        task = asyncio.ensure_future(collect(engine, Request([5, 6, 7], greedy(4, ignore_eos=True), request_id="r")))
        try:
            await asyncio.to_thread(recording.wait, 300)
            stats = engine.stats()
            assert stats.slots_used == 0  # the slot is already back ...
            assert stats.running == 1 and "r" not in log.reasons  # ... but the request is not over
        finally:
            release.set()
        await task
        await wait_idle(engine)
        assert log.reasons == {"r": FinishReason.LENGTH}


# ---- poisoned requests and failing steps -----------------------------------------------------------

async def test_non_finite_logits_fail_only_their_request(random_tiny):
    prompts = prompts_for(random_tiny, 4, (7, 3, 12, 20))
    refs = [greedy_reference(random_tiny.model, p, 15)[0] for p in prompts]

    def after(batch, logits):
        for i, seq in enumerate(batch.sampled()):
            if seq.request_id == "poisoned" and len(seq.output_ids) + seq.pending >= 2:
                logits = logits.clone()
                logits[i, :: 7] = float("nan")
        return logits

    with running(random_tiny, max_batch=4) as engine:
        wrap_step(engine, after=after)
        ids = ["poisoned", "a", "b", "c"]
        results = await results_of(engine, [Request(p, greedy(15, ignore_eos=True), request_id=rid)
                                            for p, rid in zip(prompts, ids)])
        await wait_idle(engine)
        after_ok, _ = await collect(engine, Request(prompts[0], greedy(15, ignore_eos=True)))
        assert engine.health().ok
    bad = results[0]
    assert bad.finish_reason is FinishReason.ERROR and bad.error
    assert bad.token_ids == refs[0][:2] and bad.usage.completion_tokens == 2
    for res, ref in zip(results[1:], refs[1:]):
        assert res.finish_reason is FinishReason.LENGTH and res.token_ids == ref and res.error is None
    assert after_ok.token_ids == refs[0]


async def test_a_failing_step_fails_its_requests_and_the_loop_lives_on(random_tiny):
    prompts = prompts_for(random_tiny, 5, (5, 8, 6, 9, 4))
    raised: list[list[str]] = []

    def before(batch):
        ids = [c.seq.request_id for c in batch.prefill] + [s.request_id for s in batch.decode]
        if "boom" in ids and not raised:
            raised.append(ids)
            raise RuntimeError("injected step failure")

    log = FinishLog()
    with running(random_tiny, max_batch=3) as engine:
        engine.observers.append(log)
        wrap_step(engine, before=before)
        running_first = [asyncio.ensure_future(collect(engine, Request(p, greedy(30, ignore_eos=True), request_id=rid)))
                         for p, rid in zip(prompts[:2], ("a", "b"))]
        await wait_until(lambda: engine.stats().running == 2, "two requests decoding")
        late = [asyncio.ensure_future(collect(engine, Request(p, greedy(10, ignore_eos=True), request_id=rid)))
                for p, rid in zip(prompts[2:4], ("boom", "d"))]
        results = {r.request_id: r for r, _ in await asyncio.gather(*running_first, *late)}
        await wait_idle(engine)
        assert engine.health().ok
        next_one, _ = await collect(engine, Request(prompts[4], greedy(7, ignore_eos=True)))
    assert raised and "boom" in raised[0]
    for rid, res in results.items():
        if rid in raised[0]:
            assert res.finish_reason is FinishReason.ERROR and res.error, rid
        else:
            n = 30 if rid in ("a", "b") else 10
            p = prompts[("a", "b", "boom", "d").index(rid)]
            assert res.finish_reason is FinishReason.LENGTH and res.token_ids == greedy_reference(random_tiny.model, p, n)[0]
    assert next_one.token_ids == greedy_reference(random_tiny.model, prompts[4], 7)[0]


async def test_an_output_processing_error_fails_only_its_request(random_tiny):
    prompts = prompts_for(random_tiny, 6, (5, 9))
    with running(random_tiny, max_batch=2) as engine:
        inner = engine.processor.on_token

        def on_token(seq, token, logprob):
            if seq.request_id == "bad" and len(seq.output_ids) + seq.pending >= 2:
                raise ValueError("injected detokenizer failure")
            return inner(seq, token, logprob)

        engine.processor.on_token = on_token
        results = await results_of(engine, [Request(prompts[0], greedy(12, ignore_eos=True), request_id="bad"),
                                            Request(prompts[1], greedy(12, ignore_eos=True), request_id="good")])
        alive = engine.health().alive
    assert results[0].finish_reason is FinishReason.ERROR
    assert results[1].finish_reason is FinishReason.LENGTH
    assert results[1].token_ids == greedy_reference(random_tiny.model, prompts[1], 12)[0]
    assert alive


# Two requests that must not see a poisoned predecessor's slot: ids drawn from rng seed 8.
_CLEAN_RNG_SEED = 8


def _clean_pair(loaded):
    rng = random.Random(_CLEAN_RNG_SEED)
    vocab = loaded.config.vocab_size
    return rng, random_prompt(rng, 3, vocab), random_prompt(rng, 40, vocab)


def poisoned_model(trained, poisoned_len: int):
    """A tiny untied model whose embedding row for one token is NaN (logit rows stay finite), and a
    prompt of `poisoned_len` tokens holding that token; the token is absent from the clean pair and
    from its greedy outputs."""
    loaded = tiny_loaded(trained.tokenizer, seed=3)
    rng, short, long_ = _clean_pair(loaded)
    used = set(short) | set(long_)
    for p in (short, long_):
        used |= set(greedy_reference(loaded.model, p, 20)[0])
    vocab = loaded.config.vocab_size
    poison = next(t for t in range(vocab - 1, 0, -1) if t not in used)
    with torch.no_grad():
        loaded.model.model.embed_tokens.weight[poison] = float("nan")
    poisoned_prompt = random_prompt(rng, poisoned_len, vocab)
    poisoned_prompt[2] = poison
    return loaded, poisoned_prompt


async def assert_next_owner_is_clean(engine, loaded):
    """After the poisoned request left: a short request takes its freed slot 0 while a long one shares
    its decode steps; both give exactly their greedy reference tokens."""
    await wait_idle(engine)
    _, short, long_ = _clean_pair(loaded)
    stream = engine.generate(Request(short, greedy(20, ignore_eos=True), request_id="short"))
    first = await stream.__anext__()
    long_task = asyncio.ensure_future(collect(engine, Request(long_, greedy(20, ignore_eos=True))))
    rest = [c async for c in stream]
    long_res, _ = await long_task
    assert long_res.token_ids == greedy_reference(loaded.model, long_, 20)[0]
    assert rest[-1].finish_reason is FinishReason.LENGTH, rest[-1].error
    assert [t for c in [first, *rest] for t in c.token_ids] == greedy_reference(loaded.model, short, 20)[0]


async def test_nan_activations_do_not_reach_the_next_owner_of_the_slot(trained):
    loaded, poisoned_prompt = poisoned_model(trained, 24)

    with running(loaded, max_batch=2) as engine:
        bad, _ = await collect(engine, Request(poisoned_prompt, greedy(5), request_id="poisoned"))
        assert bad.finish_reason is FinishReason.ERROR  # it fails, alone
        await assert_next_owner_is_clean(engine, loaded)


@pytest.mark.parametrize("ending", ["cancel", "deadline"])
async def test_nan_left_by_a_prompt_that_ends_without_an_error_does_not_reach_the_next_owner(trained, ending):
    """A poisoned prompt leaves the engine during chunked prefill, before any logits could show the NaN:
    it finishes CANCELLED or DEADLINE, not ERROR, yet its slot holds NaN K/V all the same."""
    loaded, poisoned_prompt = poisoned_model(trained, 40)

    with running(loaded, max_batch=2, token_budget=16) as engine:
        shift = shifted_clock(engine)

        def before(batch):
            seq = seq_in(batch, "poisoned")
            if seq is not None and seq.num_cached >= 16:  # its first chunk (with the NaN) is cached
                if ending == "cancel":
                    engine.cancel("poisoned")
                else:
                    shift[0] = 7200.0

        wrap_step(engine, before=before)
        bad, _ = await collect(engine, Request(poisoned_prompt, greedy(5), request_id="poisoned",
                                               deadline=time.monotonic() + 3600))
        assert bad.finish_reason is (FinishReason.CANCELLED if ending == "cancel" else FinishReason.DEADLINE)
        await assert_next_owner_is_clean(engine, loaded)


async def test_ids_beyond_the_tokenizer_but_inside_the_model_vocabulary(trained):
    """A padded embedding (model vocab > tokenizer vocab): such ids in the prompt or sampled are served."""
    tok = trained.tokenizer
    loaded = tiny_loaded(tok, seed=4, vocab_size=tok.vocab_size + 8)
    pad_id = tok.vocab_size + 3
    prompt = [5, pad_id, 17, 42]

    def after(batch, logits):
        for i, seq in enumerate(batch.sampled()):
            if seq.request_id == "forced" and len(seq.output_ids) + seq.pending < 2:
                logits = logits.clone()
                logits[i, pad_id] = logits[i].max() + 5.0
        return logits

    with running(loaded, max_batch=2) as engine:
        wrap_step(engine, after=after)
        plain, forced = await results_of(engine, [Request(prompt, greedy(6, ignore_eos=True)),
                                                  Request([5, 6], greedy(6, ignore_eos=True), request_id="forced")])
        assert engine.health().ok
    assert plain.finish_reason is FinishReason.LENGTH
    assert plain.token_ids == greedy_reference(loaded.model, prompt, 6)[0]
    assert forced.finish_reason is FinishReason.LENGTH and forced.token_ids[:2] == [pad_id, pad_id]


# ---- deadlines -----------------------------------------------------------------------------------------

def shifted_clock(engine) -> list[float]:
    """Make the scheduler's clock monotonic() + shift[0]; returns the mutable shift."""
    shift = [0.0]
    engine.scheduler.clock = lambda: time.monotonic() + shift[0]
    return shift


async def test_deadline_passed_before_scheduling_drops_the_request(random_tiny):
    with running(random_tiny) as engine:
        res, chunks = await collect(engine, Request([5, 6, 7], greedy(10), deadline=time.monotonic() - 1.0))
        other, _ = await collect(engine, Request([5, 6, 7], greedy(10, ignore_eos=True)))
        await wait_idle(engine)
    assert len(chunks) == 1 and res.finish_reason is FinishReason.DEADLINE
    assert res.token_ids == [] and res.text == "" and res.usage.completion_tokens == 0
    assert other.finish_reason is FinishReason.LENGTH


async def test_deadline_expiring_mid_generation_finishes_and_frees_the_slot(random_tiny):
    prompts = prompts_for(random_tiny, 9, (6, 10))
    with running(random_tiny, max_batch=2) as engine:
        shift = shifted_clock(engine)

        def before(batch):
            late = seq_in(batch, "late")
            if late is not None and len(late.output_ids) >= 3:
                shift[0] = 7200.0  # two hours pass

        wrap_step(engine, before=before)
        results = await results_of(engine, [
            Request(prompts[0], greedy(100, ignore_eos=True), request_id="late", deadline=time.monotonic() + 3600),
            Request(prompts[1], greedy(30, ignore_eos=True), request_id="free"),
        ])
        await wait_idle(engine)
        stats = engine.stats()
    late, free = results
    assert late.finish_reason is FinishReason.DEADLINE
    assert 3 <= late.usage.completion_tokens < 100
    assert late.token_ids == greedy_reference(random_tiny.model, prompts[0], len(late.token_ids))[0]
    assert free.finish_reason is FinishReason.LENGTH
    assert free.token_ids == greedy_reference(random_tiny.model, prompts[1], 30)[0]
    assert stats.slots_allocated_total == stats.slots_freed_total == 2


async def test_deadline_expiring_in_the_queue(random_tiny):
    gate = threading.Event()
    prompts = prompts_for(random_tiny, 10, (6, 6))
    with running(random_tiny, max_batch=1) as engine:
        shift = shifted_clock(engine)
        wrap_step(engine, before=lambda batch: gate.wait(300))
        try:
            first = asyncio.ensure_future(collect(engine, Request(prompts[0], greedy(8, ignore_eos=True))))
            await wait_until(lambda: engine.stats().running == 1, "the first request to hold the slot")
            queued = asyncio.ensure_future(collect(engine, Request(prompts[1], greedy(8), deadline=time.monotonic() + 3600)))
            await wait_until(lambda: engine.stats().waiting == 1, "the second request to wait")
            shift[0] = 7200.0
        finally:
            gate.set()
        (res, _), (queued_res, _) = await asyncio.gather(first, queued)
        await wait_idle(engine)
    assert queued_res.finish_reason is FinishReason.DEADLINE and queued_res.usage.completion_tokens == 0
    assert res.finish_reason is FinishReason.LENGTH
    assert res.token_ids == greedy_reference(random_tiny.model, prompts[0], 8)[0]


# ---- the queue bound -------------------------------------------------------------------------------------

async def test_full_queue_rejects_and_admitted_requests_finish(random_tiny):
    gate = threading.Event()
    prompts = prompts_for(random_tiny, 11, (4, 7, 9, 3, 5))
    with running(random_tiny, max_batch=1, max_queue=2) as engine:
        wrap_step(engine, before=lambda batch: gate.wait(300))
        try:
            tasks = [asyncio.ensure_future(collect(engine, Request(prompts[0], greedy(5, ignore_eos=True))))]
            await wait_until(lambda: engine.stats().running == 1, "the first request to hold the slot")
            tasks += [asyncio.ensure_future(collect(engine, Request(p, greedy(5, ignore_eos=True)))) for p in prompts[1:3]]
            await wait_until(lambda: engine.stats().waiting == 2, "two requests waiting")
            with pytest.raises(QueueFullError):
                engine.generate(Request(prompts[3], greedy(5)))
            assert engine.stats().waiting == 2
        finally:
            gate.set()
        results = [r for r, _ in await asyncio.gather(*tasks)]
        await wait_idle(engine)
        later, _ = await collect(engine, Request(prompts[4], greedy(5, ignore_eos=True)))
    for res, p in zip(results, prompts[:3]):
        assert res.token_ids == greedy_reference(random_tiny.model, p, 5)[0]
    assert later.token_ids == greedy_reference(random_tiny.model, prompts[4], 5)[0]


async def test_a_burst_fills_the_free_slots_and_then_the_queue(random_tiny):
    """With every step held, max_batch + max_queue requests are accepted at once, one more is refused."""
    gate = threading.Event()
    prompts = prompts_for(random_tiny, 12, (3, 4, 5, 6, 7, 8))
    with running(random_tiny, max_batch=3, max_queue=2) as engine:
        wrap_step(engine, before=lambda batch: gate.wait(300))
        try:
            tasks = [asyncio.ensure_future(collect(engine, Request(p, greedy(4, ignore_eos=True)))) for p in prompts[:5]]
            await asyncio.sleep(0)  # every task submits before its first await
            assert engine.stats().running + engine.stats().waiting == 5
            with pytest.raises(QueueFullError):
                engine.generate(Request(prompts[5], greedy(4)))
        finally:
            gate.set()
        results = [r for r, _ in await asyncio.gather(*tasks)]
        await wait_idle(engine)
    for res, p in zip(results, prompts):
        assert res.token_ids == greedy_reference(random_tiny.model, p, 4)[0]


async def test_zero_queue_still_admits_requests_while_slots_are_free(random_tiny):
    with running(random_tiny, max_batch=2, max_queue=0) as engine:
        res, _ = await collect(engine, Request([5, 6, 7], greedy(4, ignore_eos=True)))
    assert res.finish_reason is FinishReason.LENGTH


# ---- watchdog, health and shutdown ----------------------------------------------------------------------

async def test_health_reports_a_stuck_step_while_it_runs(random_tiny):
    gate = threading.Event()
    with running(random_tiny, stuck_after_seconds=0.05) as engine:
        assert engine.health().ok
        wrap_step(engine, before=lambda batch: gate.wait(300))
        try:
            task = asyncio.ensure_future(collect(engine, Request([5, 6, 7], greedy(3, ignore_eos=True))))
            await wait_until(lambda: engine.health().stuck, "the watchdog to flag the step")
            health = engine.health()
        finally:
            gate.set()
        res, _ = await task
        await wait_until(lambda: not engine.health().stuck, "the watchdog to clear")
        assert engine.health().ok
    assert health.alive and not health.ok and "step" in health.detail
    assert res.finish_reason is FinishReason.LENGTH
    assert not engine.health().alive and not engine.health().ok


async def test_shutdown_fails_requests_in_flight_and_refuses_new_ones(random_tiny):
    gate = threading.Event()
    engine_cm = running(random_tiny, max_batch=2)
    engine = engine_cm.__enter__()
    try:
        wrap_step(engine, before=lambda batch: gate.wait(300))
        stream = engine.generate(Request([5, 6, 7], greedy(50, ignore_eos=True)))
        await wait_until(lambda: engine.stats().running == 1, "the request to start")
        stopper = asyncio.ensure_future(asyncio.to_thread(engine.shutdown))
        await wait_until(lambda: engine._stopping.is_set(), "shutdown to begin")
        with pytest.raises(EngineUnavailableError):
            engine.generate(Request([5, 6], greedy(2)))
        gate.set()
        chunks = [c async for c in stream]
        await stopper
    finally:
        gate.set()
        engine_cm.__exit__(None, None, None)
    assert chunks[-1].finish_reason is FinishReason.SHUTDOWN and "shutting down" in chunks[-1].error
    assert len(chunks[-1].token_ids) + sum(len(c.token_ids) for c in chunks[:-1]) < 50
    assert not engine.health().alive


async def test_stop_accepting_drains_requests_in_flight(random_tiny):
    prompt = [9, 8, 7, 6]
    with running(random_tiny) as engine:
        stream = engine.generate(Request(prompt, greedy(12, ignore_eos=True)))
        engine.stop_accepting()
        with pytest.raises(EngineUnavailableError):
            engine.generate(Request(prompt, greedy(2)))
        tokens = [t async for c in stream for t in c.token_ids]
        assert engine.health().ok
    assert tokens == greedy_reference(random_tiny.model, prompt, 12)[0]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the loop dies, by design
@pytest.mark.parametrize("victims", [1, 3], ids=["release-fails-once", "release-always-fails"])
async def test_a_dying_loop_ends_every_request_in_flight(random_tiny, victims):
    """Handing a KV slot back raising while two requests are in flight kills the loop (the cache is
    suspect); each request still gets exactly one final chunk, at once, and new ones are refused.
    (No block accounting check afterwards: the failed hand-back is lost by design.)"""
    with Engine(random_tiny, EngineSettings(max_batch=4, prefix_cache=False)) as engine:
        real_release, calls = engine.scheduler.kv._release, []

        def failing_release(slot, n):
            calls.append(slot)
            if len(calls) <= victims:
                raise RuntimeError("injected: handing a KV slot back failed")
            return real_release(slot, n)

        engine.scheduler.kv._release = failing_release
        short = asyncio.ensure_future(collect(engine, Request([5, 6, 7], greedy(2, ignore_eos=True), request_id="a")))
        long_ = asyncio.ensure_future(collect(engine, Request([8, 9], greedy(100, ignore_eos=True), request_id="b")))
        (res_a, chunks_a), (res_b, chunks_b) = await asyncio.wait_for(asyncio.gather(short, long_), 30)
        await wait_until(lambda: not engine.health().alive, "the loop to be reported dead")
        with pytest.raises(EngineUnavailableError):
            engine.generate(Request([5, 6], greedy(2)))
        engine.scheduler.kv._release = real_release
    # "a" reached its length as the loop died: its end is either that or the shutdown
    assert res_a.finish_reason in (FinishReason.LENGTH, FinishReason.SHUTDOWN)
    assert res_b.finish_reason is FinishReason.SHUTDOWN and "shutting down" in res_b.error
    assert len(res_b.token_ids) < 100
    assert [c.finished for c in chunks_a].count(True) == [c.finished for c in chunks_b].count(True) == 1