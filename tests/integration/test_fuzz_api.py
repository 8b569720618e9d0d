"""Property-based fuzzing of the public API on the shared trained-model server (context 128).

Random GenerateRequest and TokenizeRequest messages, valid and not (huge, negative, NaN and
infinite numbers, unknown roles, special-token text, oversized lists), each sent with a deadline:
every call must end OK, INVALID_ARGUMENT or RESOURCE_EXHAUSTED, never INTERNAL, UNKNOWN or a
hang (DEADLINE_EXCEEDED); afterwards the server is still SERVING and every slot is free.
The examples are derandomized, so a run is reproducible; raise FUZZ_EXAMPLES to search longer.
"""

from __future__ import annotations

import math
import os

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmserve.v1 import lmserve_pb2 as pb
from lmserve.v1 import lmserve_pb2_grpc as pb_grpc

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "100"))
CALL_TIMEOUT = 30  # seconds; a call still running then counts as a hang
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

SPECIAL = st.sampled_from(["<s>", "</s>", "<unk>", "<pad>", "<|im_start|>", "<|im_end|>", "\x00", "\n", "\ufffd",
                           "🍵", "你好", "\U000f0000", "{{", "{%", "%}"])
TEXT = st.lists(st.one_of(st.text(max_size=40), SPECIAL, st.sampled_from(["The baker", " the fox", "Hi"])),
                max_size=6).map("".join)
FLOAT32 = st.one_of(st.floats(width=32), st.sampled_from([0.0, 1e-40, 1e-30, 1e-6, 0.5, 1.0, 2.0, 100.0, 1e30,
                                                           -1.0, math.inf, -math.inf, math.nan]))
UINT32 = st.integers(0, 2**32 - 1)
ROLES = st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), st.text(max_size=10))


@st.composite
def sampling_params(draw) -> pb.SamplingParams:
    p = pb.SamplingParams(
        max_new_tokens=draw(st.one_of(st.integers(0, 6), st.sampled_from([121, 2**32 - 1]))),
        temperature=draw(FLOAT32), top_k=draw(st.one_of(st.integers(-5, 100), st.integers(-2**31, 2**31 - 1))),
        top_p=draw(FLOAT32), min_p=draw(FLOAT32), repetition_penalty=draw(FLOAT32),
        presence_penalty=draw(FLOAT32), frequency_penalty=draw(FLOAT32),
        stop=draw(st.lists(TEXT, max_size=18)),
        stop_token_ids=draw(st.lists(st.one_of(st.integers(0, 600), UINT32), max_size=70)),
        ignore_eos=draw(st.booleans()))
    if draw(st.booleans()):
        p.seed = draw(st.integers(0, 2**64 - 1))
    if draw(st.booleans()):
        p.logprobs = draw(st.one_of(st.integers(0, 21), UINT32))
    return p


def messages() -> st.SearchStrategy:
    return st.lists(st.builds(pb.ChatMessage, role=ROLES, content=TEXT), max_size=5).map(
        lambda ms: pb.ChatMessages(messages=ms))


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=draw(st.one_of(st.just(""), st.text(max_size=140))),
                             parse_special_tokens=draw(st.booleans()))
    kind = draw(st.sampled_from(["prompt", "token_ids", "messages", "none"]))
    if kind == "prompt":
        req.prompt = draw(TEXT)
    elif kind == "token_ids":
        req.token_ids.CopyFrom(pb.TokenIds(ids=draw(st.lists(st.one_of(st.integers(0, 600), UINT32), max_size=140))))
    elif kind == "messages":
        req.messages.CopyFrom(draw(messages()))
    if draw(st.booleans()):
        req.params.CopyFrom(draw(sampling_params()))
    return req


@st.composite
def tokenize_requests(draw) -> pb.TokenizeRequest:
    req = pb.TokenizeRequest(add_generation_prompt=draw(st.booleans()), parse_special_tokens=draw(st.booleans()))
    kind = draw(st.sampled_from(["text", "messages", "none"]))
    if kind == "text":
        req.text = draw(TEXT)
    elif kind == "messages":
        req.messages.CopyFrom(draw(messages()))
    return req


@pytest.fixture(scope="module")
def stub(server):
    ch = server.channel()
    yield pb_grpc.TextGenerationStub(ch)
    ch.close()
    assert server.health() == "SERVING"
    idle = server.wait_idle()
    assert idle.get("lmserve_kv_slots_used") == 0 and idle.get("lmserve_running_requests") == 0
    assert "Traceback" not in server.log and "internal error" not in server.log


def outcome(call, request):
    try:
        return grpc.StatusCode.OK, call(request)
    except grpc.RpcError as exc:
        return exc.code(), exc.details()


def check(code, detail, request):
    assert code in ALLOWED, f"{code}: {detail!r} for {request}"


@FUZZ
@given(request=generate_requests(), streaming=st.booleans())
def test_generate_never_fails_internally_or_hangs(stub, request, streaming):
    if streaming:
        code, got = outcome(lambda r: list(stub.GenerateStream(r, timeout=CALL_TIMEOUT)), request)
        if code is grpc.StatusCode.OK:
            assert got and got[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
            assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in got[:-1])
    else:
        code, got = outcome(lambda r: stub.Generate(r, timeout=CALL_TIMEOUT), request)
        if code is grpc.StatusCode.OK:
            assert got.finish_reason != pb.FINISH_REASON_UNSPECIFIED
            assert got.usage.completion_tokens == len(got.token_ids) >= 1
            assert not request.request_id or got.request_id == request.request_id
    check(code, got if code is not grpc.StatusCode.OK else "", request)


@FUZZ
@given(request=tokenize_requests())
def test_tokenize_never_fails_internally_or_hangs(stub, request):
    code, got = outcome(lambda r: stub.Tokenize(r, timeout=CALL_TIMEOUT), request)
    check(code, got if code is not grpc.StatusCode.OK else "", request)
    if code is grpc.StatusCode.OK:
        assert len(got.token_ids) == len(got.tokens)
        if request.WhichOneof("input") == "text" and not request.parse_special_tokens:
            assert not {0, 1, 2} & set(got.token_ids[1:])  # <unk>/<s>/</s> text never becomes a control id
