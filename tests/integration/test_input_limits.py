"""Input limits on the shared trained-model server (context 128, so --max-input-chars is 32 x 128): each
is advertised in GetModelInfo, checked before the work it bounds, and refused with INVALID_ARGUMENT
naming the field. Values that would overflow the sampler behave as their limit."""

from __future__ import annotations

import grpc
import pytest
from _server import field_violations

from lmserve.v1 import lmserve_pb2 as pb

CONTEXT = 128
P = pb.SamplingParams


@pytest.fixture(scope="module")
def limits(stub) -> pb.ServerLimits:
    return stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).limits


def refused(call, request) -> list[tuple[str, str]]:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (info.value.code(), info.value.details())
    return field_violations(info.value)


def chat(*contents, role="user") -> pb.ChatMessages:
    return pb.ChatMessages(messages=[pb.ChatMessage(role=role, content=c) for c in contents])


def test_every_limit_is_advertised(limits, trained_server_flags):
    assert limits.max_request_id_chars == 128
    assert limits.max_input_chars == 32 * CONTEXT
    assert limits.max_prompt_tokens == CONTEXT - 1
    assert (limits.max_messages, limits.max_stop_strings, limits.max_stop_string_chars) == (256, 16, 256)
    assert (limits.max_stop_token_ids, limits.max_logprobs) == (64, 20)
    assert limits.greedy_temperature_below == pytest.approx(1e-5)
    assert (limits.min_repetition_penalty, limits.max_repetition_penalty) == pytest.approx((0.01, 100.0))
    assert limits.max_abs_additive_penalty == 2.0
    assert limits.max_queue == trained_server_flags["max_queue"]
    assert limits.max_receive_message_bytes == trained_server_flags["max_receive_message_bytes"]
    assert (limits.max_concurrent_rpcs, limits.max_concurrent_streams, limits.max_health_watchers) == (1024, 256, 64)
    assert limits.stream_idle_timeout_seconds == 60.0


def test_the_sdk_reports_the_limits(server, limits):
    from lmserve.client import Client

    with Client(server.target, timeout=30) as client:
        info = client.model_info()
    assert info.limits["max_input_chars"] == limits.max_input_chars
    assert info.limits["max_request_id_chars"] == 128 and len(info.limits) == len(limits.DESCRIPTOR.fields)


@pytest.mark.parametrize("rid,why", [("x" * 129, "at most 128"), ("a\nb", "printable"), ("tab\there", "printable"),
                                     ("café", "printable"), ("\x1b[31mred", "printable")])
def test_bad_request_ids_are_refused(stub, rid, why):
    violations = refused(stub.Generate, pb.GenerateRequest(request_id=rid, prompt="The baker"))
    assert [f for f, _ in violations] == ["request_id"] and why in violations[0][1]


def test_a_request_id_at_the_limit_is_echoed(stub):
    rid = "id-" + "~!" * 62 + "z"
    assert len(rid) == 128
    res = stub.Generate(pb.GenerateRequest(request_id=rid, prompt="The baker", params=P(max_new_tokens=2)), timeout=30)
    assert res.request_id == rid


def test_text_longer_than_the_character_cap(stub, limits):
    n = limits.max_input_chars
    violations = refused(stub.Generate, pb.GenerateRequest(prompt="a" * (n + 1)))
    assert violations == [("prompt", f"at most {n} characters, got {n + 1}")]
    assert refused(stub.Tokenize, pb.TokenizeRequest(text="a" * (n + 1)))[0][0] == "text"
    assert len(stub.Tokenize(pb.TokenizeRequest(text="a " * (n // 2)), timeout=30).token_ids) > CONTEXT


def test_too_many_token_ids_are_refused_before_validation(stub, limits):
    violations = refused(stub.Generate, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[10**9] * (limits.max_prompt_tokens + 1))))
    assert [f for f, _ in violations] == ["token_ids"] and "at most 127" in violations[0][1]


def test_conversation_limits(stub, limits):
    many = chat(*["hi"] * (limits.max_messages + 1))
    assert [f for f, _ in refused(stub.Tokenize, pb.TokenizeRequest(messages=many))] == ["messages"]
    long_one = chat("ok", "b" * (limits.max_input_chars + 1))
    assert [f for f, _ in refused(stub.Generate, pb.GenerateRequest(messages=long_one))] == ["messages[1].content"]
    together = chat(*["c" * (limits.max_input_chars // 3)] * 4)  # each fine, too many characters in all
    violations = refused(stub.Tokenize, pb.TokenizeRequest(messages=together))
    assert [f for f, _ in violations] == ["messages"] and "together" in violations[0][1]


def test_stop_token_ids_are_capped(stub, limits):
    ids = list(range(limits.max_stop_token_ids + 1))
    violations = refused(stub.Generate, pb.GenerateRequest(prompt="The baker", params=P(stop_token_ids=ids)))
    assert [f for f, _ in violations] == ["params.stop_token_ids"]
    res = stub.Generate(pb.GenerateRequest(prompt="The baker", params=P(max_new_tokens=4, stop_token_ids=ids[:-1])),
                        timeout=30)
    assert res.usage.completion_tokens >= 1


def test_a_temperature_too_small_to_divide_by_decodes_greedily(stub):
    def tokens(**params):
        return list(stub.Generate(pb.GenerateRequest(prompt="On the far side", params=P(
            max_new_tokens=12, ignore_eos=True, **params)), timeout=30).token_ids)

    greedy = tokens()
    assert tokens(temperature=1e-40, seed=1) == greedy  # dividing the logits by it gave inf, then NaN
    assert tokens(temperature=1e-30, seed=2) == greedy
    assert 0 not in tokens(temperature=0.9, seed=3, repetition_penalty=1e-40)  # clamped to 0.01, never NaN
    assert tokens(temperature=0.9, seed=3, repetition_penalty=1e-40) == tokens(temperature=0.9, seed=3,
                                                                              repetition_penalty=0.01)
