"""Stall-free prefill budget: the scheduler with a learned step-cost model, fed fake step costs (no model)."""

import random

import pytest

from lmserve.server.engine.request import Request
from lmserve.server.engine.scheduler import Scheduler
from lmserve.server.engine.step_cost import (
    ANY_STEP, AUTO_FACTOR, StepPacer, StepCostModel, batch_features, features, prefill_pairs, step_kind,
)


class FakeDevice:
    """Step time in ms from a batch: a fixed cost of any step, fixed pass costs, per row, per prefill
    token, per query-key pair."""

    def __init__(self, a_d=30.0, b=2.0, a_p=10.0, c=3.0, d_per_k=1.0, noise=0.0, seed=0, a_0=0.0):
        self.a_0, self.a_d, self.b, self.a_p, self.c, self.d = a_0, a_d, b, a_p, c, d_per_k / 1000
        self.noise = noise
        self.rng = random.Random(seed)

    def ms(self, batch) -> float:
        t = self.a_0
        if batch.decode:
            t += self.a_d + self.b * len(batch.decode)
        if batch.prefill:
            t += self.a_p + sum(self.c * ch.length + self.d * prefill_pairs(ch.start, ch.length) for ch in batch.prefill)
        return t * (1 + self.rng.uniform(-self.noise, self.noise))


def req(n, rid):
    return Request(prompt_ids=list(range(1, n + 1)), request_id=rid)


def drive(sched: Scheduler, budget: StepPacer, device: FakeDevice, steps: int, until=lambda: False):
    """Run up to `steps` steps (stop early once `until()`), feeding each step's fake time to the budget.
    Returns [(batch, ms)]."""
    out = []
    for _ in range(steps):
        if until():
            break
        batch = sched.schedule()
        if batch.empty:
            break
        sched.record(batch, {seq: 7 for seq in batch.sampled()})
        ms = device.ms(batch)
        budget.on_step(ms / 1000, batch)
        out.append((batch, ms))
    return out


def streams_then_long_prompt(target_ms, device, long_len=3000, token_budget=512, streams=8, warm=30):
    budget = StepPacer(target_ms)
    s = Scheduler(num_slots=streams + 1, max_queue=10, token_budget=token_budget, step_pacer=budget)
    for i in range(streams):
        s.add(req(20, f"s{i}"))
    drive(s, budget, device, warm)  # the streams' prompts (a prefill-only step), then decode-only steps
    long = s.add(req(long_len, "long"))
    steps = drive(s, budget, device, 2000, until=lambda: not long.in_prefill)
    prefilling = [(b, ms) for b, ms in steps if any(ch.seq is long for ch in b.prefill)]
    return long, prefilling, budget


def test_cost_model_recovers_the_fake_costs():
    dev = FakeDevice()
    model = StepCostModel()
    rng = random.Random(1)
    for _ in range(200):
        rows, n, start = rng.choice([0, 1, 4, 8]), rng.choice([0, 16, 64, 200]), rng.randrange(0, 2000)
        if rows == n == 0:
            continue
        keys = rows * rng.randrange(10, 2000)
        x = features(rows, keys, n, prefill_pairs(start, n))
        ms = (dev.a_d + dev.b * rows if rows else 0) + (dev.a_p + dev.c * n + dev.d * prefill_pairs(start, n) if n else 0)
        model.observe(x, ms)
    a_0, a_d, b, e, a_p, c, d = model.coef
    assert a_0 == pytest.approx(0, abs=0.5)  # this fake device has no cost shared by every step
    assert a_d == pytest.approx(30, rel=0.05) and b == pytest.approx(2, rel=0.05)
    assert c == pytest.approx(3, rel=0.02) and d == pytest.approx(1, rel=0.05) and a_p == pytest.approx(10, rel=0.1)
    assert e == pytest.approx(0, abs=0.05)  # decode keys cost nothing on this fake device
    assert min(model.coef) >= 0


def test_a_fixed_cost_shared_by_mixed_steps_is_counted_once():
    """One forward per step: reading the weights (a_0) is paid once whether the step decodes,
    prefills or both. A model that can only add a decode pass and a prefill pass would predict a
    mixed step ~a_0 too dear and cut its chunks short of the target."""
    dev = FakeDevice(a_0=25.0, a_d=1.0, b=0.5, a_p=2.0, c=0.5, d_per_k=0.02, noise=0.02)
    long, prefilling, budget = streams_then_long_prompt(80.0, dev)
    assert long.num_cached >= long.prompt_len
    coef = budget.model.coef
    assert coef[ANY_STEP] == pytest.approx(25, rel=0.15)
    mixed = features(8, 8 * 400, 100, prefill_pairs(1000, 100))
    assert budget.model.predict(mixed) == pytest.approx(25 + 1 + 4 + 2 + 50 + 0.02 * prefill_pairs(1000, 100) / 1000,
                                                         rel=0.05)
    times = sorted(ms for _, ms in prefilling[1:-1])
    assert times[len(times) // 10] >= 80 * 0.95 and times[-1] <= 80 * 1.15  # the old model: 0.92 x 80


def test_prefill_chunks_follow_the_target_step_time():
    dev = FakeDevice(noise=0.05)
    for target in (150.0, 300.0):
        long, prefilling, _ = streams_then_long_prompt(target, dev)
        assert long.num_cached >= long.prompt_len  # the prompt was prefilled completely
        times = [ms for _, ms in prefilling]
        # every step with a chunk decodes all eight streams and stays near the target
        assert all(len(b.decode) == 8 for b, _ in prefilling)
        assert max(times) <= target * 1.15, (target, max(times))
        # ...without wasting it: chunks fill the target (the prompt's last chunk may be short)
        assert sorted(times)[len(times) // 10] >= target * 0.8, (target, sorted(times)[:5])
    # a larger target takes fewer, larger chunks
    _, small, _ = streams_then_long_prompt(150.0, dev)
    _, large, _ = streams_then_long_prompt(300.0, dev)
    assert len(large) < len(small) / 1.8


def test_late_chunks_are_smaller_as_attention_over_the_cached_prompt_grows():
    dev = FakeDevice(d_per_k=2.0)
    _, prefilling, _ = streams_then_long_prompt(200.0, dev)
    sizes = [b.prefill[0].length for b, _ in prefilling]
    assert sizes[1] > 1.5 * sizes[-2]  # the second chunk (after the first measured mixed step) vs a late one


def test_automatic_target_is_a_multiple_of_the_decode_only_step():
    dev = FakeDevice(c=1.0, d_per_k=0.5)  # decode-only step with 8 rows: 30 + 16 = 46 ms
    long, prefilling, budget = streams_then_long_prompt(None, dev)
    assert long.num_cached >= long.prompt_len
    times = [ms for _, ms in prefilling[1:-1]]
    assert max(times) <= AUTO_FACTOR * 46 * 1.05
    assert min(times) >= AUTO_FACTOR * 46 * 0.8


def test_target_below_the_cost_of_any_prefill_still_makes_progress_every_step():
    # a 1 ms target cannot be met by any step with prefill: each step takes the smallest chunk, keeps
    # every decode row, and the long prompt still completes
    dev = FakeDevice()
    long, prefilling, _ = streams_then_long_prompt(1.0, dev, long_len=300)
    assert long.num_cached == long.prompt_len
    assert all(len(b.decode) == 8 and b.prefill[0].length >= 16 for b, _ in prefilling[:-1])


def test_a_costly_prefill_pass_is_not_cut_into_tiny_chunks():
    # a GPU running prefill eagerly: a prefill pass costs 60 ms whatever its size, a token almost
    # nothing. The 10 ms target cannot be met, so the chunk fills 1.25x the step's fixed part.
    dev = FakeDevice(a_d=4.0, b=0.05, a_p=60.0, c=0.01, d_per_k=0.0)
    long, prefilling, _ = streams_then_long_prompt(10.0, dev)
    assert long.num_cached == long.prompt_len
    assert max(b.prefill[0].length for b, _ in prefilling) >= 500


def test_no_decode_rows_means_the_whole_token_budget():
    budget = StepPacer(50.0)
    s = Scheduler(num_slots=2, max_queue=10, token_budget=256, step_pacer=budget)
    s.add(req(1000, "alone"))
    (b, _), = drive(s, budget, FakeDevice(), 1)
    assert b.prefill[0].length == 256


def test_until_measured_a_step_with_decode_rows_takes_the_smallest_chunk():
    budget = StepPacer(50.0)
    assert not budget.model.ready
    assert budget.prefill_tokens(decode_rows=4, decode_keys=400, context=0, cap=500, floor=16) == 16
    assert budget.prefill_tokens(decode_rows=0, decode_keys=0, context=0, cap=500, floor=16) == 500


def test_outliers_are_clipped_once_the_model_has_data():
    model = StepCostModel()
    x = features(8, 800, 0, 0)
    for _ in range(20):
        model.observe(x, 50.0)
    model.observe(x, 5000.0)  # another process held the CPU for this one
    assert model.predict(x) < 50 * 1.2


def test_step_kind_and_features_of_a_batch():
    s = Scheduler(num_slots=3, max_queue=10, token_budget=100, min_prefill_chunk=1)
    s.add(req(5, "a"))
    b = s.schedule()
    s.record(b, {q: 1 for q in b.sampled()})
    s.add(req(10, "b"))
    b2 = s.schedule()
    s.record(b2, {q: 1 for q in b2.sampled()})
    x = batch_features(b2.decode, b2.prefill)
    assert x == [1.0, 1.0, 1.0, 6 / 1000, 1.0, 10.0, 55 / 1000]  # "a": 5 prompt tokens + its new one
    assert step_kind(1, 10) == "mixed" and step_kind(0, 10) == "prefill" and step_kind(3, 0) == "decode"


def test_settings_validate_max_step_ms():
    from lmserve.server.engine.settings import EngineSettings

    assert EngineSettings().max_step_ms is None
    assert EngineSettings(max_step_ms=0).max_step_ms == 0
    with pytest.raises(ValueError):
        EngineSettings(max_step_ms=-1)
    with pytest.raises(ValueError):
        StepPacer(0)


def test_short_new_prompts_are_never_split_long_ones_are():
    budget = StepPacer(1.0)  # nothing fits: the smallest chunk (16) unless a short prompt needs more
    for n in (30, 60, 100, 200):  # 50 ms per decode pass, 10 ms per prefill pass, 3 ms per token
        budget.model.observe(features(1, 10, 0, 0), 50.0)
        budget.model.observe(features(0, 0, n, prefill_pairs(0, n)), 10 + 3.0 * n)
    s = Scheduler(num_slots=8, max_queue=10, token_budget=512, step_pacer=budget)
    s.add(req(5, "d"))
    run_one = lambda: (lambda b: (s.record(b, {q: 7 for q in b.sampled()}), b)[1])(s.schedule())  # noqa: E731
    run_one()  # "d" decodes from now on
    for rid, n in (("a", 40), ("b", 50), ("c", 30), ("long", 200)):
        s.add(req(n, rid))
    b1 = run_one()
    assert [(c.seq.request_id, c.length) for c in b1.prefill] == [("a", 40)]  # whole, though the budget is 16
    b2 = run_one()
    assert [(c.seq.request_id, c.length) for c in b2.prefill] == [("b", 50)]
    b3 = run_one()
    assert [(c.seq.request_id, c.length) for c in b3.prefill] == [("c", 30)]
    b4 = run_one()
    assert [(c.seq.request_id, c.start, c.length) for c in b4.prefill] == [("long", 0, 16)]  # long ones are cut


def test_a_long_queue_stretches_the_automatic_target_but_not_an_explicit_one():
    """A burst: when more requests wait for their first token than are decoding, the automatic target grows
    by waiting / decoding, so the queue is not prefilled in the smallest chunks behind a few streams; a
    target the operator set is a hard limit whatever the queue."""
    device = FakeDevice(c=0.5)
    for target_ms, stretches in ((None, True), (120.0, False)):
        budget = StepPacer(target_ms)
        s = Scheduler(num_slots=4, max_queue=10, token_budget=512, step_pacer=budget)
        for i in range(2):
            s.add(req(20, f"s{i}"))
        drive(s, budget, device, 10)  # prefill-only, then decode-only steps: the model is fitted
        s.add(req(400, "long"))
        drive(s, budget, device, 1)  # and one mixed step
        alone = budget.prefill_tokens(decode_rows=2, decode_keys=60, context=100, cap=510, floor=16)
        queued = budget.prefill_tokens(decode_rows=2, decode_keys=60, context=100, cap=510, floor=16, queued=12)
        assert 16 < alone < 510
        assert (queued > alone) if stretches else (queued == alone), (target_ms, alone, queued)
        if stretches:  # 6x the target: the chunk grows by about that much of the per-token cost
            assert queued >= min(510, 3 * alone)
