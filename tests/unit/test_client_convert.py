"""Request building and response parsing of the SDK (no network)."""

import random

import pytest

from lmserve.client import _convert as conv
from lmserve.client.types import FINISH_REASONS, ChatMessage, SamplingParams, StreamChunk
from lmserve.v1 import lmserve_pb2 as pb


def test_prompt_string_sets_prompt_oneof():
    req = conv.build_generate_request("Once upon", SamplingParams())
    assert req.WhichOneof("input") == "prompt" and req.prompt == "Once upon"


@pytest.mark.parametrize("ids", [[1, 2, 3], (7, 8), range(4, 9)])
def test_token_ids_set_token_ids_oneof(ids):
    req = conv.build_generate_request(ids, SamplingParams())
    assert req.WhichOneof("input") == "token_ids"
    assert list(req.token_ids.ids) == list(ids)


def test_chat_messages_in_every_accepted_form():
    forms = [
        [ChatMessage("system", "be brief"), ChatMessage("user", "hi")],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        [("system", "be brief"), ("user", "hi")],
    ]
    for form in forms:
        req = conv.build_generate_request(form, SamplingParams())
        assert req.WhichOneof("input") == "messages"
        assert [(m.role, m.content) for m in req.messages.messages] == [("system", "be brief"), ("user", "hi")]


@pytest.mark.parametrize("bad", [b"bytes", 3.5, [1, "two"], [{"role": "user"}]])
def test_unsupported_prompts_raise(bad):
    with pytest.raises((TypeError, KeyError)):
        conv.build_generate_request(bad, SamplingParams())


def test_keyword_overrides_apply_and_unknown_keywords_raise():
    base = SamplingParams(max_new_tokens=10, temperature=0.5)
    merged = conv.resolve_params(base, {"temperature": 0.9, "seed": 3})
    assert (merged.max_new_tokens, merged.temperature, merged.seed) == (10, 0.9, 3)
    assert base.temperature == 0.5  # frozen input untouched
    with pytest.raises(TypeError, match="tempreature"):
        conv.resolve_params(None, {"tempreature": 1.0})


def _random_params(rng: random.Random) -> SamplingParams:
    # Float values exactly representable in float32 so the proto round trip is lossless.
    return SamplingParams(
        max_new_tokens=rng.randrange(0, 1000),
        temperature=rng.choice([0.0, 0.5, 1.25]),
        top_k=rng.randrange(0, 100),
        top_p=rng.choice([1.0, 0.5, 0.75]),
        min_p=rng.choice([0.0, 0.125]),
        repetition_penalty=rng.choice([1.0, 1.5]),
        presence_penalty=rng.choice([0.0, -0.5, 2.0]),
        frequency_penalty=rng.choice([0.0, 0.25]),
        seed=rng.choice([None, 0, 2**40]),
        stop=tuple(rng.sample(["\n", "###", "User:", "é"], rng.randrange(0, 3))),
        stop_token_ids=tuple(rng.sample(range(50000), rng.randrange(0, 3))),
        ignore_eos=rng.random() < 0.5,
        logprobs=rng.choice([None, 0, 5]),
        speculate=rng.random() < 0.5,
        prediction=rng.choice(["", "def f(x):\n    return x"]),
    )


def test_params_round_trip_through_wire_bytes():
    rng = random.Random(1234)
    for _ in range(200):
        params = _random_params(rng)
        wire = conv.params_to_proto(params).SerializeToString()
        again = pb.SamplingParams()
        again.ParseFromString(wire)
        assert conv.params_from_proto(again) == params


def test_defaults_encode_as_unset_proto_fields():
    """The proto documents 0 as "unset" for top_p and repetition_penalty; absence for seed/logprobs."""
    msg = conv.params_to_proto(SamplingParams())
    assert msg == pb.SamplingParams()  # nothing set: every server default applies
    msg = conv.params_to_proto(SamplingParams(seed=0, logprobs=0))
    assert msg.HasField("seed") and msg.HasField("logprobs")


def test_finish_reasons_cover_the_proto_enum():
    values = [v.number for v in pb.FinishReason.DESCRIPTOR.values if v.number != 0]
    names = [conv.finish_reason_name(v) for v in values]
    assert sorted(names) == sorted(FINISH_REASONS)
    assert all(conv.finish_reason_value(n) == v for n, v in zip(names, values))
    assert conv.finish_reason_name(pb.FINISH_REASON_UNSPECIFIED) is None
    assert conv.finish_reason_name(99) == "unknown_99"


def _full_response(rng: random.Random) -> tuple[pb.GenerateResponse, list[str]]:
    n = rng.randrange(1, 12)
    words = ["".join(rng.choice("abcé ") for _ in range(rng.randrange(0, 4))) for _ in range(n)]
    return pb.GenerateResponse(
        request_id="r-1",
        text="".join(words),
        token_ids=[rng.randrange(50000) for _ in range(n)],
        finish_reason=rng.choice([pb.FINISH_REASON_EOS, pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP]),
        usage=pb.Usage(prompt_tokens=rng.randrange(1, 100), completion_tokens=n),
        logprobs=[
            pb.TokenLogprob(token_id=i, logprob=-0.5, text=w, top=[pb.TopLogprob(token_id=i + 1, logprob=-1.0)])
            for i, w in enumerate(words)
        ],
        timing=pb.Timing(queue_seconds=0.25, time_to_first_token_seconds=0.5, total_seconds=1.0),
        matched_stop="###" if rng.random() < 0.5 else "",
    ), words


def test_stream_chunks_accumulate_to_the_unary_result():
    """Splitting a response into stream chunks anywhere and folding them back changes nothing."""
    rng = random.Random(7)
    for _ in range(100):
        full, words = _full_response(rng)
        cuts = sorted(rng.sample(range(1, len(words)), rng.randrange(0, len(words)))) if len(words) > 1 else []
        bounds = [0, *cuts, len(words)]
        acc = conv.StreamAccumulator()
        for a, b in zip(bounds, bounds[1:]):
            acc.add(conv.parse_stream_response(pb.GenerateStreamResponse(
                request_id="r-1", text="".join(words[a:b]), token_ids=full.token_ids[a:b],
                logprobs=full.logprobs[a:b])))
        assert not acc.finished
        acc.add(conv.parse_stream_response(pb.GenerateStreamResponse(
            request_id="r-1", finish_reason=full.finish_reason, usage=full.usage, timing=full.timing,
            matched_stop=full.matched_stop)))
        assert acc.result() == conv.parse_generate_response(full)


def test_accumulator_without_final_chunk_raises():
    acc = conv.StreamAccumulator()
    acc.add(StreamChunk(request_id="x", text="a", token_ids=[1]))
    with pytest.raises(ValueError):
        acc.result()


def test_middle_chunks_report_no_finish_usage_or_timing():
    chunk = conv.parse_stream_response(pb.GenerateStreamResponse(request_id="x", text="a", token_ids=[1]))
    assert chunk.finish_reason is None and chunk.usage is None and chunk.timing is None
    assert not chunk.is_last


def test_model_info_optional_bos():
    info = conv.parse_model_info(pb.GetModelInfoResponse(model_name="m"))
    assert info.bos_token_id is None
    info = conv.parse_model_info(pb.GetModelInfoResponse(model_name="m", bos_token_id=0))
    assert info.bos_token_id == 0


def test_tokenize_request_forms():
    assert conv.build_tokenize_request("abc").WhichOneof("input") == "text"
    req = conv.build_tokenize_request([("user", "hi")], add_generation_prompt=False)
    assert req.WhichOneof("input") == "messages" and not req.add_generation_prompt
    with pytest.raises(TypeError):
        conv.build_tokenize_request(42)


@pytest.mark.parametrize("kw, field", [
    (dict(json_schema={"type": "object", "required": ["a"]}), "json_schema"),
    (dict(json_schema='{"type": "string"}'), "json_schema"),
    (dict(json_object=True), "json_object"),
    (dict(regex=r"\d+"), "regex"),
    (dict(grammar='start: "a"+'), "grammar"),
    (dict(choice=["yes", "no"]), "choice"),
])
def test_constraints_set_the_constraint_oneof_and_round_trip(kw, field):
    params = conv.resolve_params(None, kw)
    msg = conv.params_to_proto(params)
    assert msg.WhichOneof("constraint") == field
    back = conv.params_from_proto(pb.SamplingParams.FromString(msg.SerializeToString()))
    assert back == params
    if field == "json_schema" and isinstance(kw[field], dict):
        import json

        assert json.loads(msg.json_schema) == kw[field]


def test_no_constraint_leaves_the_oneof_unset_and_two_are_refused():
    assert conv.params_to_proto(SamplingParams()).WhichOneof("constraint") is None
    with pytest.raises(ValueError, match="at most one"):
        SamplingParams(regex="a", json_object=True)
    with pytest.raises(TypeError):
        SamplingParams(choice="yes")
