"""Step metrics from a real Metrics registry over a real (not started) engine: kind labels, prefill
tokens per step, and the budget's target gauge, read back from the Prometheus text format."""

import math

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lmserve.server.engine import Engine
from lmserve.server.engine.scheduler import PrefillChunk, ScheduledBatch
from lmserve.server.engine.sequence import Sequence
from lmserve.server.engine.request import Request
from lmserve.server.engine.settings import EngineSettings
from lmserve.server.metrics import Metrics
from test_engine_helpers import one_torch_thread, trained  # noqa: F401 - fixtures are used by name


def samples(metrics: Metrics) -> dict:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def seq(n):
    s = Sequence(Request(list(range(1, n + 1))))
    s.num_cached = n
    return s


def test_steps_are_counted_by_kind_with_their_prefill_tokens(trained):
    engine = Engine(trained, EngineSettings(max_batch=2, max_step_ms=80))
    m = Metrics(engine, "trained")
    before = samples(m)
    assert before[("lmserve_step_duration_seconds_count", (("kind", "mixed"),))] == 0  # series exist from the start
    assert math.isnan(before[("lmserve_step_target_seconds", ())])  # nothing decoding: no target
    long = seq(300)
    engine.observers[0].model.counts.update(decode=1, prefill=1)  # pretend measured, so a target applies
    for obs in engine.observers:
        obs.on_step(0.02, ScheduledBatch(decode=[seq(5), seq(6)]))
        obs.on_step(0.07, ScheduledBatch(decode=[seq(5)], prefill=[PrefillChunk(long, 100, 40)]))
        obs.on_step(0.50, ScheduledBatch(prefill=[PrefillChunk(long, 0, 100), PrefillChunk(seq(9), 0, 9)]))
    engine.step_pacer.prefill_tokens(decode_rows=2, decode_keys=11, context=0, cap=500, floor=16)
    after = samples(m)
    count = {k: after[("lmserve_step_duration_seconds_count", (("kind", k),))] for k in ("decode", "mixed", "prefill")}
    assert count == {"decode": 1, "mixed": 1, "prefill": 1}
    assert after[("lmserve_step_duration_seconds_sum", (("kind", "mixed"),))] == 0.07
    assert after[("lmserve_step_prefill_tokens_sum", (("kind", "mixed"),))] == 40
    assert after[("lmserve_step_prefill_tokens_sum", (("kind", "prefill"),))] == 109
    assert ("lmserve_step_prefill_tokens_count", (("kind", "decode"),)) not in after  # decode steps prefill nothing
    assert after[("lmserve_step_target_seconds", ())] == 0.08  # --max-step-ms 80 while rows decode
    assert after[("lmserve_engine_step_duration_seconds_count", ())] == 3  # the unlabelled total is kept


def test_budget_off_means_the_fixed_token_budget_and_no_target(trained):
    engine = Engine(trained, EngineSettings(max_batch=2, max_step_ms=0, token_budget=64))
    m = Metrics(engine, "trained")
    assert engine.step_pacer is None and engine.scheduler.step_pacer is None and engine.observers == [m]
    assert math.isnan(samples(m)[("lmserve_step_target_seconds", ())])
