"""The real `openai` SDK, sync and async, streamed and not, against the HTTP edge of a real server.

The trained model (tests/fixtures) memorised its corpus, so greedy continuations are known; the gRPC
path of the same server is the oracle for tokens, usage and log-probabilities.
"""

from __future__ import annotations

import math

import grpc
import openai
import pytest

from lmserve.client import Client
from lmserve.v1 import lmserve_pb2 as pb


@pytest.fixture(scope="module")
def model_id(server) -> str:
    with openai.OpenAI(base_url=server.http_url, api_key="unused", max_retries=0) as client:
        (card,) = client.models.list().data
    return card.id


def grpc_generate(stub, prompt: str, **params) -> pb.GenerateResponse:
    return stub.Generate(pb.GenerateRequest(prompt=prompt, params=pb.SamplingParams(**params)), timeout=60)


def test_models_lists_the_served_model_with_its_context(client, model_id, stub):
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    (card,) = client.models.list().data
    assert card.id == model_id == info.model_name and card.object == "model"
    assert card.model_extra["context_length"] == info.context_length
    assert client.models.retrieve(model_id).id == model_id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_greedy_completion_equals_the_grpc_path(client, model_id, stub, training_prompts):
    for prefix, continuation in training_prompts[:4]:
        want = grpc_generate(stub, prefix, max_new_tokens=40, logprobs=0)
        got = client.completions.create(model=model_id, prompt=prefix, max_tokens=40, temperature=0, logprobs=0)
        (choice,) = got.choices
        assert choice.text == want.text
        assert continuation.startswith(choice.text) or choice.text.startswith(continuation)
        assert got.usage.prompt_tokens == want.usage.prompt_tokens
        assert got.usage.completion_tokens == want.usage.completion_tokens == len(want.token_ids)
        assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
        assert choice.finish_reason == ("length" if want.finish_reason == pb.FINISH_REASON_LENGTH else "stop")
        # token by token: the same tokens (gRPC decodes each alone, without its word-boundary space, and
        # spells the end-of-sequence token, which adds nothing to OpenAI's text) and the same log-probabilities
        eos = set(stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).eos_token_ids)
        assert [t.strip() for t in choice.logprobs.tokens] == [
            "" if lp.token_id in eos else lp.text.strip() for lp in want.logprobs]
        assert choice.logprobs.token_logprobs == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-6)


def test_streamed_completion_is_the_whole_one_in_pieces(client, model_id, training_prompts):
    prefix = training_prompts[1][0]
    whole = client.completions.create(model=model_id, prompt=prefix, max_tokens=30, temperature=0)
    events = list(client.completions.create(model=model_id, prompt=prefix, max_tokens=30, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    *pieces, last = events
    assert "".join(e.choices[0].text for e in pieces) == whole.choices[0].text
    assert [e.choices[0].finish_reason for e in pieces][-1] == whole.choices[0].finish_reason
    assert all(e.choices[0].finish_reason is None for e in pieces[:-1])
    assert all(e.usage is None for e in pieces)
    assert last.choices == []  # cached_prompt_tokens differs: the later request hits the earlier one's prefix
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (whole.usage.prompt_tokens,
                                                                        whole.usage.completion_tokens)
    assert len({e.id for e in events}) == 1


def test_chat_answers_and_streams_the_same_text(client, model_id, stub):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "The baker"}]
    whole = client.chat.completions.create(model=model_id, messages=messages, max_tokens=20, temperature=0)
    (choice,) = whole.choices
    assert whole.object == "chat.completion" and choice.message.role == "assistant"
    want = stub.Generate(pb.GenerateRequest(messages=pb.ChatMessages(messages=[
        pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages]),
        params=pb.SamplingParams(max_new_tokens=20)), timeout=60)
    assert choice.message.content == want.text
    assert whole.usage.prompt_tokens == want.usage.prompt_tokens
    assert whole.usage.completion_tokens == want.usage.completion_tokens

    chunks = list(client.chat.completions.create(model=model_id, messages=messages, max_tokens=20, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_max_completion_tokens_and_stop_strings(client, model_id, training_prompts):
    prefix = training_prompts[0][0]
    full = client.completions.create(model=model_id, prompt=prefix, max_tokens=40, temperature=0).choices[0].text
    words = full.split()
    assert len(words) >= 4
    stop = " " + words[2]  # cut before the third word
    for given in (stop, [stop, "unlikely-never-said"]):
        cut = client.completions.create(model=model_id, prompt=prefix, max_tokens=40, temperature=0, stop=given)
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].text == full[: full.index(stop)]
    chat = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": prefix}],
                                          max_completion_tokens=3, temperature=0)
    assert chat.usage.completion_tokens == 3 and chat.choices[0].finish_reason == "length"


def test_seeded_sampling_is_reproducible(client, model_id):
    def sample(seed):
        return client.completions.create(model=model_id, prompt="The", max_tokens=24, temperature=1.5,
                                         seed=seed).choices[0].text

    first = sample(7)
    assert sample(7) == first
    assert len({sample(s) for s in range(8)}) > 1  # sampling does vary with the seed


def test_chat_logprobs_with_top_alternatives(client, model_id):
    res = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "The fox"}],
                                         max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    content = res.choices[0].logprobs.content
    assert len(content) == res.usage.completion_tokens
    # sentencepiece's word-boundary spaces depend on context: the tokens spell the text but for spacing
    assert "".join(t.token for t in content).replace(" ", "") == res.choices[0].message.content.replace(" ", "")
    for t in content:
        assert len(t.top_logprobs) == 3
        tops = [a.logprob for a in t.top_logprobs]
        assert tops == sorted(tops, reverse=True) and all(v <= 0 for v in tops)
        assert t.logprob == pytest.approx(tops[0], abs=1e-5)  # greedy: the chosen token is the best one
        assert t.bytes == list(t.token.encode())
        assert sum(math.exp(v) for v in tops) <= 1 + 1e-5


def test_usage_and_presence_penalty_change_nothing_else(client, model_id, stub):
    plain = client.completions.create(model=model_id, prompt="The baker", max_tokens=30, temperature=0)
    penalised = client.completions.create(model=model_id, prompt="The baker", max_tokens=30, temperature=0,
                                          presence_penalty=2.0, frequency_penalty=2.0)
    want = grpc_generate(stub, "The baker", max_new_tokens=30, presence_penalty=2.0, frequency_penalty=2.0)
    assert penalised.choices[0].text == want.text
    assert plain.usage.prompt_tokens == penalised.usage.prompt_tokens


def test_usage_counts_the_prompt_tokens_the_prefix_cache_supplied(client, model_id, stub, training_prompts):
    # a prompt this module has not sent before, long enough to hold whole prefix blocks (16 tokens)
    prompt = "usage and the cache: " + " ".join(p for p, _ in training_prompts[5:8])
    first = client.completions.create(model=model_id, prompt=prompt, max_tokens=3, temperature=0)
    again = client.completions.create(model=model_id, prompt=prompt, max_tokens=3, temperature=0)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens > 16
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # the first request's K/V is reused, all but the last prompt token (computed again, to sample from)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == again.usage.prompt_tokens - 1
    stream = client.completions.create(model=model_id, prompt=prompt, max_tokens=3, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    assert [c.usage for c in stream if c.usage][-1].prompt_tokens_details.cached_tokens == cached
    assert grpc_generate(stub, prompt, max_new_tokens=3).usage.cached_prompt_tokens == cached


async def test_async_client_streams_and_answers(server, model_id, training_prompts):
    async with openai.AsyncOpenAI(base_url=server.http_url, api_key="unused", max_retries=0, timeout=60) as client:
        prefix = training_prompts[2][0]
        whole = await client.completions.create(model=model_id, prompt=prefix, max_tokens=25, temperature=0)
        stream = await client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": prefix}],
                                                      max_tokens=10, temperature=0, stream=True,
                                                      stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        pieces = await client.completions.create(model=model_id, prompt=prefix, max_tokens=25, temperature=0,
                                                 stream=True)
        text = "".join([c.choices[0].text async for c in pieces])
    assert text == whole.choices[0].text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


# ---- errors, as the SDK raises them ------------------------------------------------------

@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=100000), "max_tokens"),
    (dict(stop=["x"] * 17), "stop"),
    (dict(extra_body={"logit_bias": {"5": 200}}), "logit_bias"),
    (dict(extra_body={"echo": True}), "echo"),
    (dict(temperature=2.5), "temperature"),  # OpenAI's documented range (lmserve_ranges: true for more)
    (dict(n=0), "n"),
    (dict(logprobs=21), "logprobs"),
])
def test_a_bad_or_unsupported_parameter_is_a_400_naming_it(client, model_id, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model_id, prompt="The baker", **kwargs)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param, err.value.body
    assert param in err.value.body["message"]
    assert err.value.body["type"] == "invalid_request_error"


@pytest.mark.parametrize("kwargs, param", [
    (dict(tools=[{"type": "web_search"}]), "tools[0].type"),  # function tools only
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format.json_schema.schema"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                                         "if": {}}}}),
     "response_format.json_schema.schema"),
    (dict(top_logprobs=2), "top_logprobs"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content[0]"),
    (dict(messages=[]), "messages"),
    (dict(prediction={"type": "text", "content": "x"}), "prediction"),
    (dict(prediction={"type": "content", "content": [{"type": "image_url"}]}), "prediction.content[0]"),
    (dict(extra_body={"speculate": "no"}), "speculate"),
])
def test_chat_refuses_what_it_cannot_do(client, model_id, kwargs, param):
    kwargs.setdefault("messages", [{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model_id, max_tokens=4, **kwargs)
    assert err.value.body["param"] == param, err.value.body


def test_response_format_text_is_served(client, model_id):
    res = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                         temperature=0, response_format={"type": "text"}, user="conversation-1")
    assert res.usage.completion_tokens >= 1


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    assert err.value.body["param"] == "model" and "gpt-4o" in err.value.body["message"]


def test_an_oversized_body_is_a_413(client, model_id, trained_server_flags):
    big = "x" * (trained_server_flags["max_receive_message_bytes"] + 10)
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model=model_id, prompt=big, max_tokens=2)
    assert err.value.status_code == 413 and "max-receive-message-bytes" in err.value.body["message"]


def test_the_grpc_and_http_errors_come_from_one_table(client, model_id, stub):
    with pytest.raises(grpc.RpcError) as grpc_err:
        grpc_generate(stub, "The baker", temperature=-1)
    with pytest.raises(openai.BadRequestError) as http_err:
        client.completions.create(model=model_id, prompt="The baker", temperature=-1)
    assert grpc_err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert grpc_err.value.details().split("temperature: ")[1] == http_err.value.body["message"].split("temperature: ")[1]


def test_http_requests_are_counted_with_their_protocol(server, client, model_id):
    before = server.wait_idle()
    client.completions.create(model=model_id, prompt="The baker", max_tokens=3, temperature=0)
    after = server.wait_idle()
    assert after.total("lmserve_requests_total", protocol="http") - before.total(
        "lmserve_requests_total", protocol="http") == 1
    assert after.total("lmserve_requests_total", protocol="grpc") == before.total("lmserve_requests_total",
                                                                                  protocol="grpc")
    assert after.total("lmserve_time_to_first_token_seconds_count", protocol="http") - before.total(
        "lmserve_time_to_first_token_seconds_count", protocol="http") == 1


def test_a_predicted_output_is_drafted_from_and_changes_no_token(start_server, trained_model_dir):
    """OpenAI's `prediction`: the server drafts from it (its accepted-draft counter grows by most of
    the answer where the answer repeats it) and the answer is the one given without it."""
    srv = start_server(trained_model_dir, threads=1, speculation="ngram")
    messages = [{"role": "user", "content": "Tell me about the lighthouse keeper."}]
    with openai.OpenAI(base_url=srv.http_url, api_key="unused", max_retries=0, timeout=60) as client:
        model = client.models.list().data[0].id
        accepted, drafted = [], []
        for prediction in (None, "previous"):
            before = srv.wait_idle()
            extra = {} if prediction is None else {"prediction": {"type": "content", "content": text}}
            res = client.chat.completions.create(model=model, messages=messages, max_tokens=60, temperature=0,
                                                 **extra)
            after = srv.wait_idle()
            if prediction is None:
                text, tokens = res.choices[0].message.content, res.usage.completion_tokens
            for counts, name in ((accepted, "accepted"), (drafted, "draft")):
                counts.append(after.total(f"lmserve_speculative_{name}_tokens_total")
                              - before.total(f"lmserve_speculative_{name}_tokens_total"))
        opted_out = client.chat.completions.create(model=model, messages=messages, max_tokens=60, temperature=0,
                                                   extra_body={"speculate": False})
    with Client(srv.target, timeout=60) as grpc_client:  # the same through gRPC and the Python client
        before = srv.wait_idle()
        via_grpc = grpc_client.generate(messages[0]["content"], max_new_tokens=60, prediction=text)
        after = srv.wait_idle()
    assert (via_grpc.usage.draft_tokens, via_grpc.usage.accepted_draft_tokens) == tuple(
        after.total(f"lmserve_speculative_{name}_tokens_total") - before.total(f"lmserve_speculative_{name}_tokens_total")
        for name in ("draft", "accepted"))
    assert via_grpc.usage.accepted_draft_tokens > 0
    assert res.choices[0].message.content == opted_out.choices[0].message.content == text
    assert res.usage.completion_tokens == tokens > 10
    assert accepted[1] >= tokens // 2 and accepted[1] > accepted[0]
    details = res.usage.completion_tokens_details  # this request's own drafts, as OpenAI names them
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (
        accepted[1], drafted[1] - accepted[1])
