"""Invalid requests: INVALID_ARGUMENT with the offending field in a google.rpc.BadRequest, before any token.

The shared server of the fixture model (context 128) runs with --max-new-tokens-cap below the context and
a small --max-receive-message-bytes, so that each limit is reachable with short requests.
"""

from __future__ import annotations

import re

import grpc
import pytest
from _server import field_violations
from google.protobuf.descriptor import FieldDescriptor

from lmserve.client import Client, InvalidRequestError
from lmserve.v1 import lmserve_pb2 as pb

CONTEXT = 128  # the fixture model's; these constants are checked against the server below
CAP = 120
MAX_MESSAGE = 64 * 1024
VOCAB = 512
INTERNALS = re.compile(r"Traceback|File \"|\.py\b|lmserve\.server|0x[0-9a-f]{6,}|Error\(")


@pytest.fixture(scope="module")
def server(trained_server, trained_server_flags):
    assert (trained_server_flags["max_new_tokens_cap"], trained_server_flags["max_receive_message_bytes"]) == (
        CAP, MAX_MESSAGE)
    return trained_server


def P(**kw) -> pb.SamplingParams:
    return pb.SamplingParams(**kw)


def ids(n: int, token: int = 5) -> pb.TokenIds:
    return pb.TokenIds(ids=[token] * n)


def chat(*turns) -> pb.ChatMessages:
    return pb.ChatMessages(messages=[pb.ChatMessage(role=r, content=c) for r, c in turns])


LONG_TEXT = "The lighthouse keeper climbed the spiral stairs every evening at dusk. " * 16

CASES = {
    "empty prompt": (pb.GenerateRequest(prompt=""), "prompt"),
    "empty token ids": (pb.GenerateRequest(token_ids=pb.TokenIds()), "token_ids"),
    "prompt longer than the context": (pb.GenerateRequest(prompt=LONG_TEXT), "prompt"),
    "token ids filling the context": (pb.GenerateRequest(token_ids=ids(CONTEXT)), "token_ids"),
    "max_new_tokens over the cap": (pb.GenerateRequest(prompt="Hi", params=P(max_new_tokens=CAP + 1)),
                                    "params.max_new_tokens"),
    "prompt + max_new_tokens over the context": (
        pb.GenerateRequest(token_ids=ids(CONTEXT - CAP + 1), params=P(max_new_tokens=CAP)), "params.max_new_tokens"),
    "negative temperature": (pb.GenerateRequest(prompt="Hi", params=P(temperature=-0.5)), "params.temperature"),
    "nan temperature": (pb.GenerateRequest(prompt="Hi", params=P(temperature=float("nan"))), "params.temperature"),
    "negative top_p": (pb.GenerateRequest(prompt="Hi", params=P(top_p=-0.1)), "params.top_p"),
    "top_p above 1": (pb.GenerateRequest(prompt="Hi", params=P(top_p=1.5)), "params.top_p"),
    "min_p above 1": (pb.GenerateRequest(prompt="Hi", params=P(min_p=1.5)), "params.min_p"),
    "negative repetition_penalty": (pb.GenerateRequest(prompt="Hi", params=P(repetition_penalty=-1)),
                                    "params.repetition_penalty"),
    "presence_penalty above 2": (pb.GenerateRequest(prompt="Hi", params=P(presence_penalty=2.5)),
                                 "params.presence_penalty"),
    "frequency_penalty below -2": (pb.GenerateRequest(prompt="Hi", params=P(frequency_penalty=-3)),
                                   "params.frequency_penalty"),
    "too many stop strings": (pb.GenerateRequest(prompt="Hi", params=P(stop=[f"s{i}" for i in range(17)])),
                              "params.stop"),
    "too long stop string": (pb.GenerateRequest(prompt="Hi", params=P(stop=["ok", "x" * 257])), "params.stop[1]"),
    "empty stop string": (pb.GenerateRequest(prompt="Hi", params=P(stop=[""])), "params.stop[0]"),
    "logprobs above 20": (pb.GenerateRequest(prompt="Hi", params=P(logprobs=21)), "params.logprobs"),
    "token id equal to the vocab size": (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, VOCAB])), "token_ids"),
    "huge token id": (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[2**32 - 1])), "token_ids"),
    "stop token id outside the vocab": (pb.GenerateRequest(prompt="Hi", params=P(stop_token_ids=[VOCAB + 7])),
                                        "params.stop_token_ids"),
    "unknown chat role": (pb.GenerateRequest(messages=chat(("user", "hi"), ("wizard", "boo"))), "messages[1].role"),
    "empty chat role": (pb.GenerateRequest(messages=chat(("", "hi"))), "messages[0].role"),
    "no chat messages": (pb.GenerateRequest(messages=pb.ChatMessages()), "messages"),
    "no input": (pb.GenerateRequest(params=P(max_new_tokens=4)), "input"),
    "prediction over the input limit": (pb.GenerateRequest(prompt="Hi", params=P(prediction="x" * (32 * CONTEXT + 1))),
                                        "params.prediction"),
}


def assert_invalid(err: grpc.RpcError, field: str) -> None:
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
    violations = field_violations(err)
    assert field in [f for f, _ in violations], violations
    assert all(d.strip() for _, d in violations)
    for text in [err.details(), *(d for _, d in violations)]:
        assert not INTERNALS.search(text), f"internals leak into the message: {text!r}"
    assert err.details().startswith("invalid request")


def test_vocab_and_limits_are_as_configured(stub):
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert (info.vocab_size, info.context_length, info.max_new_tokens_limit) == (VOCAB, CONTEXT, CAP)


@pytest.mark.parametrize("case", list(CASES))
def test_generate_rejects(stub, case):
    request, field = CASES[case]
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(request, timeout=30)
    assert_invalid(info.value, field)


@pytest.mark.parametrize("case", ["empty prompt", "prompt + max_new_tokens over the context", "top_p above 1",
                                  "unknown chat role", "no input", "token id equal to the vocab size"])
def test_stream_rejects_before_any_message(stub, case):
    request, field = CASES[case]
    received = []
    with pytest.raises(grpc.RpcError) as info:
        for msg in stub.GenerateStream(request, timeout=30):
            received.append(msg)
    assert received == []
    assert_invalid(info.value, field)


def test_negative_top_k_is_impossible_or_rejected(stub):
    """top_k < 0: a uint32 wire type cannot carry it; an int32 one must be rejected by the server."""
    field = pb.SamplingParams.DESCRIPTOR.fields_by_name["top_k"]
    if field.type == FieldDescriptor.TYPE_UINT32:
        with pytest.raises(ValueError):
            pb.SamplingParams(top_k=-1)
        return
    assert field.type == FieldDescriptor.TYPE_INT32
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(pb.GenerateRequest(prompt="Hi", params=P(top_k=-1)), timeout=30)
    assert_invalid(info.value, "params.top_k")


def test_every_violation_is_listed(stub):
    request = pb.GenerateRequest(prompt="Hi", params=P(temperature=-1, top_p=2, logprobs=99, max_new_tokens=CAP + 5))
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(request, timeout=30)
    fields = {f for f, _ in field_violations(info.value)}
    assert {"params.temperature", "params.top_p", "params.logprobs", "params.max_new_tokens"} <= fields


@pytest.mark.parametrize("request_, field", [
    (pb.TokenizeRequest(), "input"),
    (pb.TokenizeRequest(messages=chat(("robot", "hi"))), "messages[0].role"),
], ids=["no input", "bad role"])
def test_tokenize_rejects(stub, request_, field):
    with pytest.raises(grpc.RpcError) as info:
        stub.Tokenize(request_, timeout=30)
    assert_invalid(info.value, field)


def test_sdk_raises_invalid_request_with_field_violations(server):
    with Client(server.target, timeout=30) as client:
        with pytest.raises(InvalidRequestError) as info:
            client.generate("Hi", temperature=-2.0)
    assert "params.temperature" in [f for f, _ in info.value.field_violations]


def test_message_over_the_receive_limit_is_resource_exhausted(server, stub):
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(pb.GenerateRequest(prompt="x " * MAX_MESSAGE), timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # just under the limit the request reaches the service, which finds it longer than the context
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(pb.GenerateRequest(prompt="x " * (MAX_MESSAGE // 2 - 64)), timeout=30)
    assert_invalid(info.value, "prompt")
    assert server.health() == "SERVING"
    res = stub.Generate(pb.GenerateRequest(prompt="A red fox", params=P(max_new_tokens=4)), timeout=30)
    assert res.usage.completion_tokens >= 1


def test_server_survives_every_rejection(server, stub):
    assert server.running and server.health() == "SERVING"
    assert "Traceback" not in server.log and "internal error" not in server.log
