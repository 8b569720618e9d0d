"""OpenAI's Responses API through the real `openai` SDK, against the shared trained-model server: the same
greedy answer as Chat Completions (the oracle), the typed stream events in the order the SDK's stream
helper relies on and adding up to the whole response, stored responses continued by id, fetched and
deleted, and bad input as 400s naming the field. (Function tools: test_http_dialect_tools.py, SmolLM2.)"""

from __future__ import annotations

import openai
import pytest

QUESTION = "The lighthouse keeper"


def test_a_response_is_the_chat_completions_answer(client, model_id):
    want = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=12, temperature=0)
    got = client.responses.create(model=model_id, input=QUESTION, max_output_tokens=12, temperature=0)
    assert got.object == "response" and got.model == model_id
    (item,) = got.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert got.output_text == want.choices[0].message.content
    assert got.status == {"length": "incomplete", "stop": "completed"}[want.choices[0].finish_reason]
    assert (got.usage.input_tokens, got.usage.output_tokens) == (want.usage.prompt_tokens, want.usage.completion_tokens)


def test_the_stream_sends_the_typed_events_in_order_and_adds_up(client, model_id):
    kw = dict(model=model_id, input=[{"role": "developer", "content": "Be brief."},
                                     {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
              max_output_tokens=10, temperature=0)
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert final.output_text == whole.output_text and final.status == whole.status
    assert [(i.type, i.status, [c.text for c in i.content]) for i in final.output] == [
        (i.type, i.status, [c.text for c in i.content]) for i in whole.output]


def test_a_stored_response_is_continued_fetched_and_deleted(client, model_id):
    first = client.responses.create(model=model_id, input=QUESTION, max_output_tokens=8, temperature=0)
    follow = client.responses.create(model=model_id, input="The fox", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    spelled_out = client.responses.create(model=model_id, max_output_tokens=8, temperature=0, store=False, input=[
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "The fox"}])
    assert follow.previous_response_id == first.id
    assert (follow.output_text, follow.usage.input_tokens) == (spelled_out.output_text, spelled_out.usage.input_tokens)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    for gone in (first.id, spelled_out.id):  # deleted; never stored
        with pytest.raises(openai.NotFoundError) as err:
            client.responses.retrieve(gone)
        assert gone in err.value.message
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=model_id, input="x", previous_response_id=first.id, max_output_tokens=2)
    assert err.value.body["param"] == "previous_response_id" and first.id in err.value.message


ADD = {"type": "function", "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}
BAD = [
    (dict(tools=[ADD], tool_choice={"type": "function", "name": "nope"}), "tool_choice.name", "not a function in tools"),
    (dict(input=[{"type": "function_call_output", "call_id": "call_x", "output": "3"}]), "input[0].call_id",
     "matches no call"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
     "input[0].content[0].type", "only text parts"),
    (dict(input=[{"type": "function_call", "name": "add", "arguments": "{}"}]), "input[0].call_id", "is required"),
    (dict(tools=[{"name": "add", "parameters": {}}]), "tools[0].type", "must be 'function'"),
    (dict(text={"format": {"type": "yaml"}}), "text.format.type", "must be"),
    (dict(max_output_tokens=0), "max_output_tokens", "at least 1"),
    (dict(input=None), "input", "is required"),
    (dict(background=True), "background", "not supported"),
]


@pytest.mark.parametrize("kwargs, param, words", BAD, ids=[b[1] for b in BAD])
def test_bad_input_is_a_400_naming_the_field(client, model_id, kwargs, param, words):
    body = {"model": model_id, "input": QUESTION, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.post("/responses", body={k: v for k, v in body.items() if v is not None}, cast_to=object)
    error = err.value.body
    assert error["param"] == param and words in error["message"] and error["type"] == "invalid_request_error", error
