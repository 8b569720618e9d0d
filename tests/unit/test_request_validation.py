"""Request validation: every rule names its field, and every bad field is reported in one error."""

from __future__ import annotations

import math

import pytest

from lmserve.server.engine.request import (
    GREEDY_TEMPERATURE, MAX_LOGIT_BIAS_TOKENS, MAX_LOGPROBS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
    REPETITION_PENALTY_RANGE, Request, RequestValidationError, SamplingParams,
)

VOCAB = 100
CONTEXT = 64
CAP = 32


def fields_of(prompt=(5, 6, 7), **params) -> list[str]:
    """The fields Request.validate reports ([] when the request is valid)."""
    params.setdefault("max_new_tokens", 8)  # the default (256) exceeds this test's context and cap
    req = Request(list(prompt), SamplingParams(**params))
    try:
        req.validate(VOCAB, CONTEXT, CAP)
    except RequestValidationError as err:
        assert isinstance(err, ValueError)
        for name, description in err.violations:
            assert name in str(err) and description in str(err)  # the message lists each one
        return [name for name, _ in err.violations]
    return []


BAD_PARAMS = [
    # (SamplingParams kwargs, field)
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=-3), "max_new_tokens"),
    (dict(max_new_tokens=CAP + 1), "max_new_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=-0.5), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_p=math.nan), "top_p"),
    (dict(min_p=-0.01), "min_p"),
    (dict(min_p=1.0), "min_p"),
    (dict(min_p=math.nan), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(repetition_penalty=math.nan), "repetition_penalty"),
    (dict(repetition_penalty=math.inf), "repetition_penalty"),
    (dict(presence_penalty=2.01), "presence_penalty"),
    (dict(presence_penalty=-2.01), "presence_penalty"),
    (dict(presence_penalty=math.nan), "presence_penalty"),
    (dict(frequency_penalty=2.5), "frequency_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(frequency_penalty=math.nan), "frequency_penalty"),
    (dict(seed=-1), "seed"),
    (dict(seed=2**63), "seed"),
    (dict(stop=tuple(f"s{i}" for i in range(MAX_STOP_STRINGS + 1))), "stop"),
    (dict(stop=("ok", "")), "stop[1]"),
    (dict(stop=("x" * (MAX_STOP_STRING_CHARS + 1),)), "stop[0]"),
    (dict(stop_token_ids=(3, -1)), "stop_token_ids"),
    (dict(stop_token_ids=(VOCAB,)), "stop_token_ids"),
    (dict(stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS + 1))), "stop_token_ids"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"),
    (dict(logit_bias=((5, 100.5),)), "logit_bias"),
    (dict(logit_bias=((5, -101.0),)), "logit_bias"),
    (dict(logit_bias=((5, math.nan),)), "logit_bias"),
    (dict(logit_bias=((VOCAB, 1.0),)), "logit_bias"),
    (dict(logit_bias=((-1, 1.0),)), "logit_bias"),
    (dict(logit_bias=tuple((i % VOCAB, 1.0) for i in range(MAX_LOGIT_BIAS_TOKENS + 1))), "logit_bias"),
]


@pytest.mark.parametrize("params,field", BAD_PARAMS, ids=[f"{f}={list(p.values())[0]!r}"[:40] for p, f in BAD_PARAMS])
def test_each_bad_parameter_is_named(params, field):
    assert fields_of(**params) == [field]


@pytest.mark.parametrize("prompt,max_new,field", [
    ([], 4, "prompt"),  # empty
    ([5] * CONTEXT, 1, "prompt"),  # fills the context: no room to generate
    ([5] * (CONTEXT + 10), 1, "prompt"),
    ([5] * (CONTEXT - 4), 5, "max_new_tokens"),  # prompt + max_new_tokens over the context
    ([5, -1, 6], 4, "token_ids"),
    ([5, VOCAB, 6], 4, "token_ids"),
])
def test_each_bad_prompt_is_named(prompt, max_new, field):
    assert fields_of(prompt, max_new_tokens=max_new) == [field]


@pytest.mark.parametrize("params", [
    dict(),
    dict(max_new_tokens=CAP),
    dict(temperature=0.0), dict(temperature=2.0),
    dict(top_k=0), dict(top_k=10 * VOCAB),
    dict(top_p=1.0), dict(top_p=1e-6),
    dict(min_p=0.0), dict(min_p=0.99),
    dict(repetition_penalty=1e-3), dict(repetition_penalty=3.0),
    dict(presence_penalty=-2.0, frequency_penalty=2.0),
    dict(seed=0), dict(seed=2**63 - 1),
    dict(stop=tuple(f"s{i}" for i in range(MAX_STOP_STRINGS))),
    dict(stop=("x" * MAX_STOP_STRING_CHARS,)),
    dict(stop_token_ids=(0, VOCAB - 1)),
    dict(logprobs=0), dict(logprobs=MAX_LOGPROBS),
    dict(ignore_eos=True),
    dict(logit_bias=((0, -100.0), (VOCAB - 1, 100.0))),
])
def test_boundary_values_are_accepted(params):
    assert fields_of(**params) == []


def test_prompt_plus_max_new_tokens_may_fill_the_context_exactly():
    assert fields_of([5] * (CONTEXT - 5), max_new_tokens=5) == []
    assert fields_of([0, VOCAB - 1], max_new_tokens=4) == []


def test_every_bad_field_is_reported_at_once():
    params = dict(max_new_tokens=0, temperature=-1.0, top_k=-2, top_p=2.0, min_p=1.5, repetition_penalty=0.0,
                  presence_penalty=9.0, frequency_penalty=-9.0, seed=-5, stop=("a", "", "b" * 300),
                  stop_token_ids=(VOCAB + 1,), logprobs=99)
    got = fields_of([5, VOCAB + 7], **params)
    assert sorted(got) == sorted([
        "token_ids", "max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
        "presence_penalty", "frequency_penalty", "seed", "stop[1]", "stop[2]", "stop_token_ids", "logprobs",
    ])


def test_prompt_and_parameter_errors_come_together():
    assert sorted(fields_of([], temperature=-1.0, logprobs=21)) == ["logprobs", "prompt", "temperature"]
    assert sorted(fields_of([5] * CONTEXT, top_p=0.0)) == ["prompt", "top_p"]


def test_over_the_cap_and_over_the_context_both_reported():
    got = fields_of([5] * 40, max_new_tokens=CAP + 1)
    assert got == ["max_new_tokens", "max_new_tokens"]


def test_sampling_params_alone_without_a_vocabulary():
    """Without a vocabulary only negative stop ids are wrong; without a cap any length >= 1 is fine."""
    assert SamplingParams(stop_token_ids=(10**9,), max_new_tokens=10**6).violations() == []
    assert [f for f, _ in SamplingParams(stop_token_ids=(-1,)).violations()] == ["stop_token_ids"]
    assert [f for f, _ in SamplingParams(stop_token_ids=(10,)).violations(vocab_size=10)] == ["stop_token_ids"]


def test_descriptions_name_the_offending_value():
    with pytest.raises(RequestValidationError) as err:
        Request([5, 250], SamplingParams(max_new_tokens=4, top_p=1.5, logprobs=33)).validate(VOCAB, CONTEXT, CAP)
    found = dict(err.value.violations)
    assert "1.5" in found["top_p"] and "33" in found["logprobs"] and "250" in found["token_ids"]


def test_error_message_joins_all_violations():
    err = RequestValidationError([("a", "first"), ("b", "second")])
    assert str(err) == "a: first; b: second" and err.violations == [("a", "first"), ("b", "second")]


# ---- values that would overflow are normalized when the parameters are built ----------------------

def test_tiny_temperatures_are_greedy():
    for t in (1e-40, 1e-30, GREEDY_TEMPERATURE / 2):
        assert SamplingParams(temperature=t).temperature == 0.0
    assert SamplingParams(temperature=GREEDY_TEMPERATURE).temperature == GREEDY_TEMPERATURE
    assert [f for f, _ in SamplingParams(temperature=-1e-40).violations()] == ["temperature"]  # still rejected


def test_extreme_repetition_penalties_are_clamped():
    lo, hi = REPETITION_PENALTY_RANGE
    assert SamplingParams(repetition_penalty=1e-40).repetition_penalty == lo
    assert SamplingParams(repetition_penalty=1e38).repetition_penalty == hi
    assert SamplingParams(repetition_penalty=1.3).repetition_penalty == 1.3
    for bad in (0.0, -1.0, math.nan, math.inf):  # not clamped: still reported
        assert [f for f, _ in SamplingParams(repetition_penalty=bad).violations()] == ["repetition_penalty"]


def test_stop_token_ids_are_held_as_a_set():
    p = SamplingParams(stop_token_ids=[5, 5, 7])
    assert p.stop_token_ids == frozenset({5, 7})
    assert p.violations() == []
    assert [f for f, _ in SamplingParams(stop_token_ids=range(MAX_STOP_TOKEN_IDS + 1)).violations()] == ["stop_token_ids"]
    assert SamplingParams(stop_token_ids=range(MAX_STOP_TOKEN_IDS)).violations() == []


@pytest.mark.parametrize("params,same_as", [
    (dict(temperature=1e-40), dict(temperature=0.0)),
    (dict(temperature=0.8, repetition_penalty=1e-40, seed=3), dict(temperature=0.8, repetition_penalty=0.01, seed=3)),
    (dict(temperature=1e-40, repetition_penalty=1e30), dict(temperature=0.0, repetition_penalty=100.0)),
])
def test_overflowing_values_sample_like_their_limit(params, same_as):
    """Through the real sampler: never a NaN row silently turned into token 0."""
    import torch

    from lmserve.server.engine.request import Request
    from lmserve.server.engine.sampler import Sampler
    from lmserve.server.engine.sequence import Sequence

    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 30  # [N, V]: large logits, as a confident model gives
    logits[:, 0] = -50.0  # token 0 is never the right answer here
    history = [[1, 2, 3, int(logits[i].argmax())] for i in range(4)]

    def run(kw):
        seqs = []
        for i in range(4):
            seq = Sequence(Request([4], SamplingParams(**kw)))
            seq.output_ids = list(history[i])
            seqs.append(seq)
        return Sampler()(logits.clone(), seqs).token_ids

    got = run(params)
    assert got == run(same_as)
    assert 0 not in got
