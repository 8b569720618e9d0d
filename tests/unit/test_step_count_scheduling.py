"""Scheduling on a device whose step cost is flat in batch size (a GPU's), counted in steps, not seconds.

The real engine (scheduler, step pacer and its start-up seeding, runner, sampler, output processor)
runs around a stand-in model that computes nothing (server/bench/host_ceiling.py's StandInModel). What
a step costs comes from a synthetic clock instead of real time: a decode step costs DECODE_MS whatever
its rows, and a step that prefills costs several decode steps more (a GPU runs prompt chunks eagerly
where decode steps replay a graph), plus a little per prompt token. The engine's step timer reads that
clock, so the step-cost model fits these costs and sizes prompt chunks from them, as it would on a GPU.
Nothing depends on this machine's speed: the steps are driven one at a time on the test's thread.
"""

from __future__ import annotations

import random
import types

import pytest
import torch

from lmserve.model.loader import LoadedModel
from lmserve.server.bench.host_ceiling import StandInModel
from lmserve.server.engine import Engine, EngineSettings
from lmserve.server.engine import engine as engine_module
from lmserve.server.engine.request import Request, SamplingParams
from lmserve.server.engine.runner import ModelRunner
from lmserve.model.text.tokenizer import Tokenizer
from test_engine_helpers import FIRST_PLAIN_ID, tiny_config

DECODE_MS = 4.0  # any decode step, 1 row or 128: the weights are read once
PREFILL_PASS_MS = 12.0  # on top, for a step that prefills at all: 3 decode steps
PREFILL_TOKEN_MS = 0.004  # per prompt token (compute, small next to reading the weights)


class SyntheticClock:
    """Milliseconds of device time, advanced by each step the runner runs."""

    def __init__(self):
        self.ms = 0.0

    def seconds(self) -> float:
        return self.ms / 1e3

    def step_ms(self, batch) -> float:
        tokens = sum(c.length for c in batch.prefill)
        return DECODE_MS + (PREFILL_PASS_MS + PREFILL_TOKEN_MS * tokens if tokens else 0.0)


class StepLog:
    """Each step's decode rows and prefill chunks, as the engine's observers hear of them."""

    def __init__(self):
        self.steps: list[tuple[frozenset[str], list[tuple[str, int, int]]]] = []

    def on_step(self, seconds, batch) -> None:
        self.steps.append((frozenset(s.request_id for s in batch.decode),
                           [(c.seq.request_id, c.start, c.length) for c in batch.prefill]))

    def on_tokens(self, seq, count, gap_seconds) -> None:
        pass

    def on_finish(self, seq, final) -> None:
        pass


@pytest.fixture
def flat_cost_engine(trained_model_dir, monkeypatch):
    """make(max_batch) -> (engine, clock, log): an engine (not started) over the stand-in model whose step
    timer reads the synthetic clock."""
    clock = SyntheticClock()
    real_run = ModelRunner.run

    def run(self, batch, previous=None):
        clock.ms += clock.step_ms(batch)
        return real_run(self, batch, previous)

    monkeypatch.setattr(ModelRunner, "run", run)
    # the engine times its steps (and its start-up seeding of the step-cost model) with perf_counter
    monkeypatch.setattr(engine_module, "time", types.SimpleNamespace(
        perf_counter=clock.seconds, monotonic=engine_module.time.monotonic, sleep=engine_module.time.sleep))
    tok = Tokenizer.from_dir(trained_model_dir)  # the trained model's tokenizer; its weights are not needed
    cfg = tiny_config(tok.vocab_size, max_pos=1024)
    text = [i for i in range(FIRST_PLAIN_ID, tok.vocab_size) if i not in tok.eos_ids]

    def make(max_batch: int, overlap: bool = False):
        loaded = LoadedModel(model=StandInModel(cfg.vocab_size, text, max_batch + 512), tokenizer=tok, config=cfg,
                             source=None, dtype=torch.float32, device=torch.device("cpu"))
        engine = Engine(loaded, EngineSettings(max_batch=max_batch, max_model_len=1024, prefix_cache=False,
                                               overlap_steps=overlap, speculation="off", kv_cache_gb=0.25))
        log = StepLog()
        engine.observers.append(log)
        return engine, clock, log

    return make


def short_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Chat-sized prompts, 24-64 tokens (never split: at most 4 x the smallest chunk)."""
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_PLAIN_ID, 400) for _ in range(rng.randrange(24, 65))] for _ in range(n)]


def run_wave(engine, prompts: list[list[int]], max_new: int) -> int:
    """Every prompt submitted before the first step, then steps until all are done; the steps run."""
    for i, p in enumerate(prompts):
        engine.scheduler.add(Request(p, SamplingParams(max_new_tokens=max_new, ignore_eos=True), request_id=f"r{i}"))
    steps = 0
    while engine.scheduler.num_unfinished:
        assert engine._step_once(), "a step with requests waiting did nothing"
        steps += 1
        assert steps < 10 * max_new * len(prompts), "the wave does not end"
    return steps


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlapped"])
def test_64_short_prompts_submitted_at_once_are_all_decoding_within_16_steps(flat_cost_engine, overlap):
    engine, clock, log = flat_cost_engine(64, overlap)
    prompts = short_prompts(64)
    run_wave(engine, prompts, 32)
    ids = {f"r{i}" for i in range(64)}
    first_all = next((n for n, (decode, _) in enumerate(log.steps, 1) if decode == ids), None)
    admitted = [sum(len(p) for _, p in log.steps[:n]) for n in range(1, len(log.steps) + 1)]
    print(f"all 64 decoding from step {first_all}; prefill chunks run by each step, cumulative: {admitted[:first_all]}")
    assert first_all is not None and first_all <= 16, (first_all, admitted[:20])
    # each prompt was prefilled in contiguous chunks, and a stream once decoding keeps a row in every step
    for rid in ids:
        chunks = [(start, length) for _, prefill in log.steps for r, start, length in prefill if r == rid]
        assert chunks[0][0] == 0 and sum(n for _, n in chunks) == len(prompts[int(rid[1:])]), (rid, chunks)
        assert all(a + n == b for (a, n), (b, _) in zip(chunks, chunks[1:])), (rid, chunks)
    for rid in ids:
        rows = [rid in decode for decode, _ in log.steps]
        first = rows.index(True)
        # its decode steps in a row (32 tokens, the first from its prefill; overlapped: one more step, whose
        # token is dropped, may follow its last)
        assert all(rows[first: first + 31]) and not any(rows[first + 32:]), rid


def test_steps_and_device_time_per_generated_token_fall_as_concurrency_rises(flat_cost_engine):
    max_new = 48
    per_token = {}
    for c in (1, 8, 32, 64):
        engine, clock, log = flat_cost_engine(64)
        start_ms = clock.ms  # after the engine's start-up steps
        steps = run_wave(engine, short_prompts(c, seed=c), max_new)
        per_token[c] = (steps / (c * max_new), (clock.ms - start_ms) / (c * max_new))
    print("steps, device ms per token:", {c: (round(s, 4), round(ms, 3)) for c, (s, ms) in per_token.items()})
    cs = sorted(per_token)
    for lo, hi in zip(cs, cs[1:]):
        assert per_token[hi][0] < per_token[lo][0], per_token  # steps per token
        assert per_token[hi][1] < per_token[lo][1], per_token  # device time per token: throughput rises
    # a flat-cost device serves 64 streams at close to 64 tokens a step: admission costs few extra steps
    assert per_token[64][0] <= 1.25 / 64, per_token
