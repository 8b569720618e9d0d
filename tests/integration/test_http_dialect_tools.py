"""Function tools through Anthropic's Messages API and OpenAI's Responses API, from the real SmolLM2
(its template renders no tools: the fallback prompt) and the real clients: the `anthropic` SDK, the
`openai` SDK's responses, openai-agents' default (Responses) model, and langchain-anthropic. With a call
required or a function named, every call validates against its schema (jsonschema as the oracle); a
streamed call adds up to the whole answer's; a result fed back is answered."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest
from test_openai_clients import run_weather_agent

from lmserve.client import Client
from lmserve.server.tools import ToolCall

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def model_id(smollm2_http) -> str:
    with openai.OpenAI(base_url=smollm2_http.http_url, api_key="x", max_retries=0) as c:
        return c.models.list().data[0].id


@pytest.fixture(scope="module")
def own_tokens(smollm2_http):
    """A call's own tokens: its envelope, as the model writes it, tokenized by the server (the Tokenize RPC)."""
    with Client(smollm2_http.target, timeout=60) as client:
        yield lambda name, arguments: len(client.tokenize(ToolCall("", name, arguments).envelope()).token_ids)


@pytest.fixture(scope="module")
def claude(smollm2_http):
    with anthropic.Anthropic(base_url=smollm2_http.http_url.removesuffix("/v1"), api_key="x", max_retries=0,
                             timeout=600) as c:
        yield c


@pytest.fixture(scope="module")
def oai(smollm2_http):
    with openai.OpenAI(base_url=smollm2_http.http_url, api_key="x", max_retries=0, timeout=600) as c:
        yield c


def anthropic_tools() -> list[dict]:
    return [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER},
            {"name": "add", "description": "Add two integers", "input_schema": ADD}]


def test_anthropic_tool_use_validates_streams_alike_and_takes_its_result(claude, model_id):
    kw = dict(model=model_id, max_tokens=60, tools=anthropic_tools(), messages=[{"role": "user", "content": QUESTION}],
              tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body={"temperature": 0})
    whole = claude.messages.create(**kw)
    assert whole.stop_reason == "tool_use"
    (call,) = [b for b in whole.content if b.type == "tool_use"]
    assert call.id.startswith("toolu_") and call.name in SCHEMAS
    jsonschema.validate(call.input, SCHEMAS[call.name])
    with claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in final.content] == [
        (b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in whole.content]
    assert final.stop_reason == "tool_use" and final.usage.output_tokens == whole.usage.output_tokens
    named = claude.messages.create(**{**kw, "tool_choice": {"type": "tool", "name": "add"},
                                      "messages": [{"role": "user", "content": "What is 2 plus 40?"}]})
    (add,) = [b for b in named.content if b.type == "tool_use"]
    assert add.name == "add"
    jsonschema.validate(add.input, ADD)
    history = kw["messages"] + [{"role": "assistant", "content": [b.model_dump() for b in whole.content]},
                                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                              "content": "Sunny, 24 C"}]}]
    answer = claude.messages.create(**{**kw, "max_tokens": 24, "tool_choice": {"type": "auto"}, "messages": history})
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    counted = claude.messages.count_tokens(model=model_id, tools=anthropic_tools(), messages=history).input_tokens
    assert counted == answer.usage.input_tokens + answer.usage.cache_read_input_tokens > whole.usage.input_tokens


def test_responses_function_call_validates_streams_alike_and_continues_by_id(oai, model_id):
    tools = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
              "parameters": WEATHER}, {"type": "function", "name": "add", "description": "Add two integers",
                                       "parameters": ADD}]
    kw = dict(model=model_id, input=QUESTION, tools=tools, tool_choice="required", parallel_tool_calls=False,
              max_output_tokens=60, temperature=0)
    whole = oai.responses.create(**kw)
    (call,) = [i for i in whole.output if i.type == "function_call"]
    assert call.call_id.startswith("call_") and call.name in SCHEMAS and whole.status == "completed"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    with oai.responses.stream(**kw) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[2:4] == ["response.output_item.added", "response.function_call_arguments.delta"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [(i.name, i.arguments) for i in final.output] == [(call.name, call.arguments)]
    answer = oai.responses.create(model=model_id, previous_response_id=whole.id, tools=tools, max_output_tokens=40,
                                  temperature=0, input=[{"type": "function_call_output", "call_id": call.call_id,
                                                         "output": "Sunny, 24 C"}])
    assert answer.output and answer.usage.input_tokens > whole.usage.input_tokens


async def test_openai_agents_default_responses_model_runs_a_tool_to_the_end(smollm2_http, model_id):
    # a response ended by the token limit fails the run: room for the answer, and one call
    await run_weather_agent(smollm2_http.http_url, "OpenAIResponsesModel", model_id, max_tokens=100,
                            parallel_tool_calls=False)


def test_langchain_anthropic_bind_tools(smollm2_http, model_id):
    langchain_anthropic = pytest.importorskip("langchain_anthropic")
    from langchain_core.tools import tool

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    chat = langchain_anthropic.ChatAnthropic(model=model_id, base_url=smollm2_http.http_url.removesuffix("/v1"),
                                             api_key="x", max_tokens=60, temperature=0, max_retries=0, timeout=600)
    message = chat.bind_tools([add], tool_choice="add").invoke("What is 2 plus 40?")
    assert message.tool_calls and not message.invalid_tool_calls, message
    (call,) = message.tool_calls
    assert call["name"] == "add"
    jsonschema.validate(call["args"], add.tool_call_schema.model_json_schema())


ADD_QUESTION = "What is 2 plus 40?"


ADD_CHAT_TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}}]


def one_call_costs_its_own_tokens_in_every_dialect(oai, claude, model_id, own_tokens, chat_choice, claude_choice,
                                                   **responses_kw) -> str:
    """Chat Completions, Messages and Responses each answer ADD_QUESTION with one valid call of `add` that
    ends the answer and costs its own tokens + 10 at most; the Responses call's arguments."""
    question = [{"role": "user", "content": ADD_QUESTION}]
    chat = oai.chat.completions.create(model=model_id, messages=question, tools=ADD_CHAT_TOOLS, max_tokens=120,
                                       temperature=0, tool_choice=chat_choice)
    (c,) = chat.choices
    (call,) = c.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), ADD)
    own = own_tokens("add", call.function.arguments)
    assert c.finish_reason == "tool_calls" and chat.usage.completion_tokens <= own + 10, (chat.usage, own)

    message = claude.messages.create(model=model_id, max_tokens=120, tools=anthropic_tools(), messages=question,
                                     tool_choice=claude_choice, extra_body={"temperature": 0})
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "add"
    jsonschema.validate(use.input, ADD)
    own = own_tokens("add", json.dumps(use.input))
    assert message.stop_reason == "tool_use" and message.usage.output_tokens <= own + 10, (message.usage, own)

    response_tools = [{"type": "function", "name": "add", "description": "Add two integers", "parameters": ADD}]
    response = oai.responses.create(model=model_id, input=ADD_QUESTION, tools=response_tools, tool_choice="required",
                                    max_output_tokens=120, temperature=0, **responses_kw)
    (item,) = response.output
    jsonschema.validate(json.loads(item.arguments), ADD)
    own = own_tokens("add", item.arguments)
    assert response.status == "completed" and response.usage.output_tokens <= own + 10, (response.usage, own)
    return item.arguments


def test_a_forced_call_ends_where_it_ends_in_every_dialect(oai, claude, model_id, own_tokens):
    """A named function (Anthropic's `tool` choice) or parallel calls refused: one call is all that may follow,
    so the answer ends with it, costing its own tokens (+ 10 at most); the limit striking at its last token
    still ends it as a call. With parallel calls allowed, the limit striking after a complete call ends the
    answer at the limit, the complete call kept."""
    arguments = one_call_costs_its_own_tokens_in_every_dialect(
        oai, claude, model_id, own_tokens, {"type": "function", "function": {"name": "add"}},
        {"type": "tool", "name": "add"}, parallel_tool_calls=False)
    own = own_tokens("add", arguments)
    question = [{"role": "user", "content": ADD_QUESTION}]
    exact = oai.chat.completions.create(model=model_id, messages=question, tools=ADD_CHAT_TOOLS, max_tokens=own,
                                        temperature=0, tool_choice="required", parallel_tool_calls=False)
    (same,) = exact.choices[0].message.tool_calls
    assert same.function.arguments == arguments
    assert exact.choices[0].finish_reason == "tool_calls" and exact.usage.completion_tokens == own
    more = oai.chat.completions.create(model=model_id, messages=question, tools=ADD_CHAT_TOOLS, max_tokens=own + 3,
                                       temperature=0, tool_choice="required")  # SmolLM2 goes on to a second call
    (kept,) = more.choices[0].message.tool_calls
    jsonschema.validate(json.loads(kept.function.arguments), ADD)  # complete
    assert more.choices[0].finish_reason == "length" and own_tokens("add", kept.function.arguments) < own + 3


def test_a_call_the_model_would_repeat_ends_the_answer_in_every_dialect(oai, claude, model_id, own_tokens):
    """Parallel calls allowed and a call required: SmolLM2 writes its call, then begins the same call again.
    Where decoding would write it again word for word (verified as a draft in one step), the answer ends
    where the repeat begins: one call, costing its own tokens + 10 at most, in each dialect (that the model
    does write the repeat without the probe is test_repeat_probe's)."""
    one_call_costs_its_own_tokens_in_every_dialect(oai, claude, model_id, own_tokens, "required", {"type": "any"})
