"""Gemma 3 270M (the catalog's `gemma3`: the pretrained base model, Q4_K_M GGUF) pulled by name and served by
name, answering through gRPC and the OpenAI-compatible HTTP API with the same tokens; chat requests are
refused (the model has no chat template). Oracles: the model's own float32 greedy answer through the
other protocol, and what a base model does with the start of a Python function."""

from __future__ import annotations

import grpc
import openai
import pytest
from test_cli import lmserve

from lmserve.v1 import lmserve_pb2 as pb
from lmserve.v1 import lmserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def gemma3(start_module_server, gemma3_gguf_path):
    """`lmserve serve --model gemma3` over the models directory the catalog pulled into (float32, the reference)."""
    srv = start_module_server("gemma3", models_dir=gemma3_gguf_path.parent.parent, threads=2, max_batch=4,
                              metrics_port=None, wait=False)
    srv.wait_ready(timeout=900)  # a first start compiles the native kernels and dequantizes 262k x 640 embeddings
    return srv


def test_pull_by_name_finds_the_verified_file(gemma3_gguf_path):
    proc = lmserve("pull", "gemma3", "--quiet", "--models-dir", gemma3_gguf_path.parent.parent)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(gemma3_gguf_path) and gemma3_gguf_path.stat().st_size == 253_113_024


def test_both_protocols_answer_with_the_same_tokens(gemma3):
    with gemma3.channel() as ch:
        stub = pb_grpc.TextGenerationStub(ch)
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        want = stub.Generate(pb.GenerateRequest(prompt=PROMPT, params=pb.SamplingParams(max_new_tokens=12)), timeout=300)
    assert (info.architecture, info.vocab_size, info.has_chat_template) == ("gemma3", 262144, False)
    assert want.text.startswith("\n    if n == 0:\n        return")  # a base model writes the body
    with openai.OpenAI(base_url=gemma3.http_url, api_key="x", max_retries=0, timeout=300) as client:
        got = client.completions.create(model=info.model_name, prompt=PROMPT, max_tokens=12, temperature=0)
    assert got.choices[0].text == want.text
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.prompt_tokens == want.usage.prompt_tokens


def test_chat_is_refused_for_a_model_without_a_template(gemma3):
    messages = [{"role": "user", "content": "Hello"}]
    with gemma3.channel() as ch:
        stub = pb_grpc.TextGenerationStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in messages]),
                                             params=pb.SamplingParams(max_new_tokens=4)), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no chat template" in info.value.details()
    with openai.OpenAI(base_url=gemma3.http_url, api_key="x", max_retries=0, timeout=60) as client:
        with pytest.raises(openai.BadRequestError) as http:
            client.chat.completions.create(model="gemma3", messages=messages, max_tokens=4)
    assert http.value.status_code == 400 and "no chat template" in str(http.value)
