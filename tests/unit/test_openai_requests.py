"""The OpenAI edge's translation of request bodies, without a server: the compatibility policy (unknown
fields ignored and logged once per name, or refused when strict), OpenAI's documented ranges and
lmserve's wider ones, and max_completion_tokens on both endpoints."""

from __future__ import annotations

import logging

import pytest

from lmserve.server.engine.request import RequestValidationError, SamplingParams
from lmserve.server.http.openai_requests import FieldPolicy, check_model, translate
from lmserve.server.edge_errors import EdgeError, Failure

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


def refused(body: dict, chat: bool = True, fields: FieldPolicy | None = None) -> tuple[str, str]:
    with pytest.raises(RequestValidationError) as err:
        translate(body, chat, fields)
    ((param, message),) = err.value.violations
    return param, message


def test_unknown_fields_are_ignored_and_each_name_logged_once(caplog):
    policy = FieldPolicy()
    with caplog.at_level(logging.WARNING, logger="lmserve.http"):
        for _ in range(3):
            for body, chat in ((CHAT, True), (COMPLETION, False)):
                req = translate({**body, "newer_field": {"x": 1}, "another": 2}, chat, policy)
                assert req.model == "m"
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2 and all("logged once" in m for m in logged)
    assert any("'newer_field'" in m for m in logged) and any("'another'" in m for m in logged)


def test_the_logged_names_are_bounded():
    policy = FieldPolicy(max_logged=4)
    for i in range(10):
        translate({**CHAT, f"field_{i}": 1}, True, policy)
    assert len(policy._logged) == 4


def test_strict_fields_refuse_an_unknown_one_by_name():
    strict = FieldPolicy(strict=True)
    param, message = refused({**CHAT, "newer_field": 1}, fields=strict)
    assert param == "newer_field" and "--strict-openai-fields" in message
    param, _ = refused({**CHAT, "messages": [{"role": "user", "content": "hi", "extra": 1}]}, fields=strict)
    assert param == "messages[0].extra"


def test_unknown_message_fields_follow_the_policy_and_openai_ones_are_known():
    req = translate({**CHAT, "messages": [{"role": "user", "content": "hi", "extra": 1},
                                          {"role": "assistant", "content": "yes", "refusal": None}]}, True)
    assert [t.content for t in req.input.messages] == ["hi", "yes"]


def range_violations(body: dict, chat: bool) -> list[tuple[str, str]]:
    """The edge's refusal, or else the engine's (the lower bounds and the penalties' range are checked
    there, for both edges alike)."""
    try:
        p = translate(body, chat).input.params
    except RequestValidationError as exc:
        return exc.violations
    return SamplingParams(temperature=p.temperature, top_p=1.0 if p.top_p is None else p.top_p,
                          presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty).violations()


@pytest.mark.parametrize("field, value", [("temperature", 2.5), ("temperature", -0.1), ("top_p", 1.5),
                                          ("top_p", -0.5), ("presence_penalty", 2.5),
                                          ("frequency_penalty", -3)])
def test_documented_ranges_are_enforced(field, value):
    for body, chat in ((CHAT, True), (COMPLETION, False)):
        ((param, message),) = range_violations({**body, field: value}, chat)
        assert param == field and str(float(value)) in message
    for ok in (0, 1, 2) if field == "temperature" else (0, 0.5, 1) if field == "top_p" else (-2, 0, 2):
        assert range_violations({**CHAT, field: ok}, True) == []


def test_lmserve_ranges_reach_wider_temperatures():
    param, message = refused({**CHAT, "temperature": 7})
    assert param == "temperature" and "lmserve_ranges" in message
    req = translate({**CHAT, "temperature": 7, "lmserve_ranges": True}, True)
    assert req.input.params.temperature == 7.0
    assert translate({**CHAT, "temperature": 2}, True).input.params.temperature == 2.0


def test_top_p_zero_keeps_only_the_most_likely_token():
    p = translate({**CHAT, "temperature": 1.3, "top_p": 0}, True).input.params
    assert (p.temperature, p.top_p) == (0.0, None)
    assert translate({**CHAT, "top_p": 1}, True).input.params.top_p == 1.0


@pytest.mark.parametrize("chat", [True, False])
def test_max_completion_tokens_on_both_endpoints(chat):
    body = CHAT if chat else COMPLETION
    req = translate({**body, "max_completion_tokens": 7}, chat)
    assert req.input.params.max_new_tokens == 7
    assert req.names("params.max_new_tokens") == "max_completion_tokens"
    assert refused({**body, "max_completion_tokens": 7, "max_tokens": 5}, chat)[0] == "max_tokens"
    assert refused({**body, "max_completion_tokens": 0}, chat)[0] == "max_completion_tokens"
    assert translate({**body, "max_tokens": 5}, chat).input.params.max_new_tokens == 5


@pytest.mark.parametrize("field, value, words", [
    ("functions", [{"name": "f"}], "tools"),
    ("reasoning_effort", "high", "reason"),
    ("audio", {"voice": "x"}, "not supported"),
    ("echo", True, "not supported"),
])
def test_known_parameters_that_cannot_be_served_are_refused(field, value, words):
    param, message = refused({**CHAT, field: value})
    assert param == field and words in message


@pytest.mark.parametrize("field, value", [("user", "u"), ("metadata", {"a": "b"}), ("store", True),
                                          ("service_tier", "auto"), ("prompt_cache_key", "k"),
                                          ("safety_identifier", "s"), ("echo", False), ("best_of", 1)])
def test_parameters_without_effect_are_accepted(field, value):
    assert translate({**COMPLETION, field: value}, False).model == "m"


def test_an_unknown_model_names_every_served_name():
    check_model("b", ("a", "b"))
    with pytest.raises(EdgeError) as err:
        check_model("c", ("a", "b"))
    assert err.value.failure is Failure.NOT_FOUND and "'a' or 'b'" in str(err.value)
