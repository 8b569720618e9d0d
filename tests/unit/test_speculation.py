"""Speculative decoding from the context (prompt lookup): a verified draft computes what decoding one
token at a time computes, bit for bit, and the engine returns the very tokens of speculation off.

Oracles: the runner decoding the same tokens one step at a time (logits compared bit for bit, with a
neighbour in the batch); the engine with --speculation off (tokens, text, finish reasons)."""

from __future__ import annotations

import random

import pytest
import torch

from lmserve.model.attention.backend import SdpaBackend
from lmserve.model.kv_cache import KVCache
from lmserve.server.engine import Request, SamplingParams
from lmserve.server.engine.runner import ModelRunner
from lmserve.server.engine.scheduler import PrefillChunk, ScheduledBatch
from lmserve.server.engine.sequence import Sequence, SeqStatus
from test_engine_helpers import (  # noqa: F401 - fixtures
    corpus_prompt, greedy, one_torch_thread, random_prompt, random_tiny, results_of, running, trained,
)


def _placed(prompt: list[int], slot: int) -> Sequence:
    seq = Sequence(Request(list(prompt), SamplingParams(max_new_tokens=64, ignore_eos=True)))
    seq.slot, seq.status = slot, SeqStatus.RUNNING
    return seq


def _prefill(runner: ModelRunner, seqs: list[Sequence]) -> list[int]:
    batch = ScheduledBatch(prefill=tuple(PrefillChunk(s, 0, s.prompt_len) for s in seqs))
    logits = runner.step(batch)
    for s in seqs:
        s.num_cached = s.prompt_len
    return logits.argmax(-1).tolist()


def verify_vs_decode(loaded, attention, prompt: list[int], neighbour: list[int], drafts: list[int]):
    """Logits of one step verifying `drafts` (with a neighbour decoding beside it), and those of the
    same tokens decoded one step at a time (the neighbour decoding its same token each time)."""
    out = []
    for speculative in (True, False):
        cache = KVCache(loaded.config, num_slots=4, max_len=128, dtype=loaded.dtype)
        runner = ModelRunner(loaded.model, cache, torch.device("cpu"), attention)
        seq, other = _placed(prompt, 2), _placed(neighbour, 0)
        first, other_first = _prefill(runner, [seq, other])
        seq.output_ids, other.output_ids = [first], [other_first]
        rows = []
        with torch.inference_mode():
            if speculative:
                logits = runner.step(ScheduledBatch(decode=(other, seq), drafts=((), tuple(drafts))))  # [1 + k + 1, V]
                rows = list(logits[1:])
            else:
                for d in [None, *drafts]:
                    if d is not None:
                        seq.output_ids.append(d)
                        seq.num_cached += 1
                    logits = runner.step(ScheduledBatch(decode=(other, seq)))  # [2, V]
                    rows.append(logits[1])
                    other.num_cached = other.prompt_len  # the neighbour recomputes its same token every step
        out.append(torch.stack(rows))
    return out


@pytest.mark.parametrize("backend", ["loaded", "sdpa"])
def test_a_verified_draft_gives_the_logits_of_decoding_one_token_at_a_time(trained, backend):
    """Each verification row attends over exactly the keys a decode row at its position would, on the
    backend the loader chose (the native decode kernel) and on SDPA: the logits are equal bit for bit,
    so greedy speculation can only accept what decoding would have produced."""
    attention = trained.attention if backend == "loaded" else SdpaBackend("cpu")
    tok = trained.tokenizer
    prompt = corpus_prompt(tok, "The lighthouse keeper climbed the spiral stairs every evening")
    neighbour = corpus_prompt(tok, "On the far side of the bay")
    drafts = tok.encode(" at dusk. He carried a brass lamp")[:5]
    spec, plain = verify_vs_decode(trained, attention, prompt, neighbour, drafts)
    assert spec.shape == plain.shape == (len(drafts) + 1, trained.config.vocab_size)
    assert torch.equal(spec, plain)
    assert spec.std() > 0.1  # real logits: the comparison means something


QUOTES = [
    ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He carried a brass lamp. "
     "The lighthouse keeper climbed"),
    ("On the far side of the bay, the baker woke long before sunrise. On the far side of the bay, the baker"),
    "Tea time in Shanghai: we waved hello to the world. Tea time in Shanghai:",
]


def _requests(tok, stop=(), n=40, ignore_eos=True, speculate=True):
    return [Request(corpus_prompt(tok, q), SamplingParams(max_new_tokens=n, ignore_eos=ignore_eos, stop=stop,
                                                          speculate=speculate), request_id=f"q{i}")
            for i, q in enumerate(QUOTES)]


async def _both(loaded, requests, waves: int = 1, **settings):
    """Every request through an engine with speculation off, then on (in `waves` rounds, so that later
    ones may hit the prefix cache): results, the engine's stats, logprobs."""
    results = {}
    n = -(-len(requests) // waves)
    for mode in ("off", "ngram"):
        with running(loaded, speculation=mode, **settings) as engine:
            got = []
            for w in range(waves):
                got += await results_of(engine, requests[w * n: (w + 1) * n])
            stats = engine.stats()
        results[mode] = ([(r.token_ids, r.text, r.finish_reason, r.matched_stop) for r in got], stats,
                         [[(lp.token_id, lp.logprob, lp.top) for lp in r.logprobs] for r in got])
    off, on = results["off"][2], results["ngram"][2]
    for a, b in zip(off, on):  # logprobs per token: the same distributions (a row's log_softmax may round
        assert [t for t, *_ in a] == [t for t, *_ in b]  # its last bit by where the row sits in the step)
        assert [lp for _, lp, _ in a] == pytest.approx([lp for _, lp, _ in b], rel=1e-5, abs=1e-6)
    return results


async def test_speculation_returns_the_tokens_of_speculation_off_and_accepts_drafts(trained):
    results = await _both(trained, _requests(trained.tokenizer))
    (off, _, _), (on, stats, _) = results["off"], results["ngram"]
    assert on == off
    assert stats.drafted_tokens_total > 0 and stats.accepted_tokens_total > 0  # it did speculate, and it paid


async def test_stops_inside_an_accepted_run_end_where_decoding_would(trained):
    """A stop string or eos that an accepted draft reaches ends the request at that very token: same
    tokens, text, matched stop and finish reason as speculation off; max_new_tokens is never exceeded."""
    tok = trained.tokenizer
    for requests in (_requests(tok, stop=("lamp", "sunrise", "world")), _requests(tok, ignore_eos=False, n=60),
                     _requests(tok, n=7)):
        results = await _both(trained, requests)
        assert results["ngram"][0] == results["off"][0]
    assert all(len(t) <= 7 for t, *_ in results["ngram"][0])


async def test_mixed_batch_under_kv_pressure_with_prefix_cache_gives_the_same_results(trained):
    """Speculating and sampled requests, a per-request opt-out and logprobs share steps; pages are
    scarce (preemptions recompute), and later requests hit the prefix cache: all as speculation off."""
    tok = trained.tokenizer
    rng = random.Random(1)
    requests = []
    for i in range(8):
        q = QUOTES[i % len(QUOTES)]
        params = [SamplingParams(max_new_tokens=30, ignore_eos=True, logprobs=2),
                  SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=0.8, seed=i),
                  SamplingParams(max_new_tokens=30, ignore_eos=True, speculate=False)][i % 3]
        requests.append(Request(corpus_prompt(tok, q) + random_prompt(rng, 3, trained.config.vocab_size), params,
                                request_id=f"m{i}"))
    results = await _both(trained, requests, waves=2, max_batch=8, kv_cache_gb=0.00025, token_budget=64)
    assert results["ngram"][0] == results["off"][0]
    for _, stats, _ in results.values():  # what the test is about did happen
        assert stats.preemptions_total > 0 and stats.prefix_hit_tokens_total > 0
    assert results["ngram"][1].accepted_tokens_total > 0


def test_auto_speculates_only_where_it_is_exact_and_measured_to_pay(trained, monkeypatch):
    from dataclasses import replace

    from lmserve.server.engine import Engine, EngineSettings
    from lmserve.server.engine import engine as engine_module

    trained = replace(trained, cache_dir=None)  # each engine measures (no cost kept from an earlier start)
    monkeypatch.setattr(engine_module, "AUTO_SPECULATION_MAX_BREAK_EVEN", float("inf"))  # no timing in the test
    auto = Engine(trained, EngineSettings())
    assert auto.scheduler.speculation is not None and auto.verify_cost > 0  # measured; CPU, batch-invariant
    monkeypatch.setattr(engine_module, "AUTO_SPECULATION_MAX_BREAK_EVEN", -1.0)  # a device where verifying is dear
    monkeypatch.setattr(engine_module, "AUTO_SPECULATION_REMEASURE_PAUSE", 0.0)
    measured = []
    real = Engine._verify_cost
    monkeypatch.setattr(Engine, "_verify_cost", lambda self, k: measured.append(real(self, k)) or measured[-1])
    from lmserve.server.engine import threads

    monkeypatch.setattr(threads, "BUSY_CORES", -1.0)  # other processes busy while it was timed
    dear = Engine(trained, EngineSettings())
    assert dear.scheduler.speculation is None  # measured again before giving up, the fastest kept
    assert len(measured) == 1 + engine_module.AUTO_SPECULATION_REMEASURE and dear.verify_cost == min(measured)
    measured.clear()
    monkeypatch.setattr(threads, "BUSY_CORES", float("inf"))  # a quiet machine: the first measurement stands
    assert Engine(trained, EngineSettings()).scheduler.speculation is None and len(measured) == 1
    monkeypatch.undo()
    monkeypatch.setattr(engine_module, "AUTO_SPECULATION_REMEASURE_PAUSE", 0.0)
    monkeypatch.setattr(threads, "BUSY_CORES", -1.0)
    # a start beside a busy neighbour: the first measurement dear (3x for 4 drafts), the next ones not
    costs = iter([4.0, 1.4, 1.3])
    monkeypatch.setattr(Engine, "_verify_cost", lambda self, k: next(costs))
    busy_start = Engine(trained, EngineSettings(draft_tokens=4))
    assert busy_start.scheduler.speculation is not None and busy_start.verify_cost == 1.4
    monkeypatch.undo()
    assert Engine(trained, EngineSettings(speculation="ngram")).scheduler.speculation is not None  # asked for
    monkeypatch.setattr(engine_module, "AUTO_SPECULATION_MAX_BREAK_EVEN", float("inf"))
    assert Engine(trained, EngineSettings(overlap_steps=True)).scheduler.speculation is None
    assert Engine(replace(trained, batch_invariant=False), EngineSettings()).scheduler.speculation is None
    assert Engine(trained, EngineSettings(speculation="off")).scheduler.speculation is None
    with pytest.raises(ValueError, match="overlap-steps false"):
        Engine(trained, EngineSettings(speculation="ngram", overlap_steps=True))


def test_the_step_cost_model_counts_a_verifying_row_as_its_decode_rows():
    """The step pacer learns step costs from features: a row verifying k drafts is k + 1 decode rows at
    consecutive positions (num_cached already counts them when a step is observed)."""
    from lmserve.server.engine.step_cost import batch_features

    a, b = _placed([1, 2, 3], 0), _placed([4, 5], 1)
    a.num_cached, b.num_cached = 10 + 1 + 3, 7 + 1  # after advance: a verified 3 drafts from position 10
    rows = [_placed([9], 2) for _ in range(4)]
    for j, r in enumerate(rows):
        r.num_cached = 10 + j + 1
    assert batch_features([a, b], [], [(7, 8, 9), ()]) == batch_features([*rows, b], [])
    assert batch_features([b], []) == batch_features([b], [], [()])


async def test_metrics_count_every_token_of_an_accepted_draft(trained):
    """Several tokens in one step still count one by one: generated tokens equal the requests' usage,
    each token after a request's first has its inter-token gap, and the speculation counters scrape."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from lmserve.server.metrics import Metrics

    with running(trained, speculation="ngram") as engine:
        m = Metrics(engine, "trained")
        got = await results_of(engine, _requests(trained.tokenizer))
        st = engine.stats()
        text = generate_latest(m.registry).decode()
    values = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}
    assert st.accepted_tokens_total > 0  # some step did carry several tokens of one request
    assert values["lmserve_generated_tokens_total"] == sum(len(r.token_ids) for r in got)
    assert values["lmserve_inter_token_latency_seconds_count"] == sum(len(r.token_ids) - 1 for r in got)
    assert values["lmserve_speculative_draft_tokens_total"] == st.drafted_tokens_total
    assert values["lmserve_speculative_accepted_tokens_total"] == st.accepted_tokens_total


async def test_a_predicted_output_is_drafted_and_changes_no_token(trained):
    """Drafts come from the request's prediction as from its prompt: a prediction equal to the answer
    (taken from a run without one) is accepted for most tokens, a wrong one costs nothing but
    rejected drafts, and the tokens are those of decoding without speculation every time."""
    from dataclasses import replace

    rng = random.Random(5)
    prompt = random_prompt(rng, 12, trained.config.vocab_size)  # random text: nothing for the prompt to draft
    base = SamplingParams(max_new_tokens=40, ignore_eos=True)
    with running(trained, speculation="off") as engine:
        (plain,) = await results_of(engine, [Request(list(prompt), base)])
    answer = tuple(plain.token_ids)
    wrong = tuple(rng.randrange(trained.config.vocab_size) for _ in range(40))
    accepted = {}
    for name, prediction in (("none", ()), ("answer", answer), ("wrong", wrong)):
        with running(trained, speculation="ngram") as engine:
            (got,) = await results_of(engine, [Request(list(prompt), replace(base, prediction=prediction))])
            stats = engine.stats()
            accepted[name] = stats.accepted_tokens_total
        assert tuple(got.token_ids) == answer, name
        # the request's usage counts its own drafts: here the only request of the engine
        assert (got.usage.draft_tokens, got.usage.accepted_draft_tokens) == (stats.drafted_tokens_total,
                                                                             stats.accepted_tokens_total), name
    assert accepted["answer"] >= len(answer) // 2 > accepted["none"]


def test_a_prediction_outside_the_vocabulary_is_refused(trained):
    vocab = trained.config.vocab_size
    bad = SamplingParams(prediction=(1, vocab)).violations(vocab)
    assert [name for name, _ in bad] == ["prediction"]
    assert SamplingParams(prediction=(-1,)).violations(None)  # the proposer's separator is never a token
    assert not SamplingParams(prediction=(1, vocab - 1)).violations(vocab)
