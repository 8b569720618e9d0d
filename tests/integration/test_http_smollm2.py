"""The real SmolLM2 chat model over the OpenAI API: greedy answers equal the gRPC path's, token by token."""

from __future__ import annotations

import openai
import pytest

from lmserve.v1 import lmserve_pb2 as pb
from lmserve.v1 import lmserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
]


@pytest.fixture(scope="module")
def smollm2(start_module_server, smollm2_gguf_path):
    return start_module_server(smollm2_gguf_path, threads=2, max_batch=4, metrics_port=None)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_tokens_equal_the_grpc_path(smollm2, messages):
    with smollm2.channel() as ch:
        stub = pb_grpc.TextGenerationStub(ch)
        want = stub.Generate(pb.GenerateRequest(
            messages=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in messages]),
            params=pb.SamplingParams(max_new_tokens=12, logprobs=0)), timeout=120)
        model = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).model_name
    with openai.OpenAI(base_url=smollm2.http_url, api_key="x", max_retries=0, timeout=120) as client:
        got = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                             logprobs=True)
        streamed = list(client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                                       stream=True, stream_options={"include_usage": True}))
    (choice,) = got.choices
    assert choice.message.content == want.text
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    assert got.usage.completion_tokens == len(want.token_ids)
    # byte-level BPE: each token's bytes are its own, so the tokens spell the answer exactly
    tokens = choice.logprobs.content
    assert b"".join(bytes(t.bytes) for t in tokens).decode() == want.text
    assert [t.logprob for t in tokens] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-5)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want.text
    assert streamed[-1].usage.completion_tokens == len(want.token_ids)


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


def test_response_format_json_schema_gives_json_that_validates_and_json_object_gives_an_object(smollm2):
    """response_format is constrained decoding: a json_schema answer parses and validates (jsonschema
    as the oracle), the same request through gRPC's json_schema gives the same tokens; json_object
    answers parse as an object."""
    import json

    import jsonschema

    messages = [{"role": "user", "content": "Invent a person and give their name and age as JSON."}]
    with smollm2.channel() as ch:
        stub = pb_grpc.TextGenerationStub(ch)
        want = stub.Generate(pb.GenerateRequest(
            messages=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in messages]),
            params=pb.SamplingParams(max_new_tokens=80, json_schema=json.dumps(PERSON))), timeout=120)
        model = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).model_name
    with openai.OpenAI(base_url=smollm2.http_url, api_key="x", max_retries=0, timeout=120) as client:
        got = client.chat.completions.create(
            model=model, messages=messages, max_tokens=80, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
        obj = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0,
                                             response_format={"type": "json_object"})
    (choice,) = got.choices
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert choice.message.content == want.text
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # the length limit came first: a prefix of an object
        assert obj.choices[0].message.content.lstrip().startswith("{")
