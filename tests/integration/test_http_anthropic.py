"""Anthropic's Messages API through the real `anthropic` SDK, against the shared trained-model server: the
same greedy answer as Chat Completions (the oracle), streamed events that add up to the whole message,
count_tokens, Anthropic's model list, and bad input as 400s in Anthropic's error envelope naming the field.
(Tool calls need a model whose context holds a tool prompt: test_http_anthropic_tools.py, SmolLM2.)"""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

QUESTION = [{"role": "user", "content": "The lighthouse keeper"}]
ADD = {"name": "add", "description": "Add two integers", "input_schema": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}


@pytest.fixture(scope="module")
def client(server):
    with anthropic.Anthropic(base_url=server.http_url.removesuffix("/v1"), api_key="unused", max_retries=0,
                             timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model_id(client) -> str:
    (card,) = client.models.list().data
    assert card.type == "model" and card.display_name == card.id
    return card.id


def chat_oracle(server, model_id: str, messages: list, **kw):
    with openai.OpenAI(base_url=server.http_url, api_key="unused", max_retries=0, timeout=60) as c:
        return c.chat.completions.create(model=model_id, messages=messages, temperature=0, **kw)


def test_a_message_is_the_chat_completions_answer(client, server, model_id):
    want = chat_oracle(server, model_id, QUESTION, max_tokens=12)
    got = client.messages.create(model=model_id, max_tokens=12, messages=QUESTION, extra_body={"temperature": 0})
    assert got.type == "message" and got.role == "assistant" and got.model == model_id
    (block,) = got.content
    assert block.type == "text" and block.text == want.choices[0].message.content
    assert got.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[want.choices[0].finish_reason]
    prompt = got.usage.input_tokens + got.usage.cache_read_input_tokens
    assert (prompt, got.usage.output_tokens) == (want.usage.prompt_tokens, want.usage.completion_tokens)
    assert client.messages.count_tokens(model=model_id, messages=QUESTION).input_tokens == prompt


def test_the_stream_adds_up_to_the_whole_message(client, model_id):
    kw = dict(model=model_id, max_tokens=16, messages=QUESTION, system=[{"type": "text", "text": "Be brief.",
                                                                            "cache_control": {"type": "ephemeral"}}],
              extra_body={"temperature": 0})
    whole = client.messages.create(**kw)
    events = list(client.messages.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
    assert set(kinds[2:-3]) == {"content_block_delta"}
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    for streamed in (final,):
        assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]
        assert (streamed.stop_reason, streamed.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
        assert streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens == (
            whole.usage.input_tokens + whole.usage.cache_read_input_tokens)
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == whole.content[0].text


def test_a_stop_sequence_is_named(client, model_id):
    free = client.messages.create(model=model_id, max_tokens=20, messages=QUESTION, extra_body={"temperature": 0})
    word = free.content[0].text.split()[2]
    got = client.messages.create(model=model_id, max_tokens=20, messages=QUESTION, stop_sequences=[word],
                                 extra_body={"temperature": 0})
    assert got.stop_reason == "stop_sequence" and got.stop_sequence == word
    assert free.content[0].text.startswith(got.content[0].text) and word not in got.content[0].text


def test_thinking_blocks_and_cache_control_change_nothing(client, model_id):
    plain = QUESTION + [{"role": "assistant", "content": "It is dusk."}, {"role": "user", "content": "The fox"}]
    decorated = QUESTION + [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "x"},
                                          {"type": "text", "text": "It is dusk."}]},
        {"role": "user", "content": [{"type": "text", "text": "The fox", "cache_control": {"type": "ephemeral"}}]}]
    a, b = (client.messages.create(model=model_id, max_tokens=8, messages=m, metadata={"user_id": "u1"},
                                   extra_body={"temperature": 0}) for m in (plain, decorated))
    assert a.content == b.content


def test_models_answer_in_openais_shape_without_anthropic_version(server, model_id):
    body = httpx.get(f"{server.http_url}/models", timeout=30).json()
    assert body["object"] == "list" and body["data"][0]["id"] == model_id


BAD = [
    (dict(max_tokens=None), "max_tokens", "is required"),
    (dict(tools=[ADD], tool_choice={"type": "tool", "name": "nope"}), "tool_choice.name", "not a function in tools"),
    (dict(messages=QUESTION + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "3"}]}]),
     "messages[2].content[0].tool_use_id", "matches no call"),
    (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), "messages[0].content[0].type",
     "images"),
    (dict(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages[0].content[0].text", "is required"),
    (dict(messages=[{"role": "robot", "content": "hi"}]), "messages[0].role", "must be"),
    (dict(tools=[{"name": "add"}]), "tools[0].input_schema", "is required"),
    (dict(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools[0].type", "server tool"),
    (dict(tools=[ADD], tool_choice={"type": "sometimes"}), "tool_choice.type", "must be"),
    (dict(temperature=1.5), "temperature", "at most 1"),
]


@pytest.mark.parametrize("kwargs, param, words", BAD, ids=[b[1] for b in BAD])
def test_bad_input_is_a_400_in_anthropics_envelope_naming_the_field(client, model_id, kwargs, param, words):
    body = {"model": model_id, "max_tokens": 5, "messages": QUESTION, **kwargs}
    with pytest.raises(anthropic.BadRequestError) as err:
        client.post("/v1/messages", body={k: v for k, v in body.items() if v is not None}, cast_to=object)
    assert err.value.status_code == 400
    error = err.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
    assert f"{param}: " in error["error"]["message"] and words in error["error"]["message"], error


def test_unknown_models_and_paths_are_404s_in_anthropics_envelope(client, server):
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="claude-no-such", max_tokens=4, messages=QUESTION)
    assert err.value.body["error"]["type"] == "not_found_error" and "claude-no-such" in err.value.message
    r = httpx.post(f"{server.http_url}/messages/batches", json={}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
