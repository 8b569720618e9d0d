"""Tool calls from the real SmolLM2 through the OpenAI edge, the fallback prompt (its template renders no
tools): under `required` or a named function every call, on a set of 24 schemas, parses and validates
against its schema as given (jsonschema as the oracle); streamed calls come in OpenAI's chunk shape
and add up to the whole answer's; `auto` answers text or valid calls; results are fed back."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow


def obj(properties: dict, required=None, **extra) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            **extra}


S, I, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
# (function name, description, parameters or None, what the user asks)
SCHEMAS = [
    ("get_weather", "Current weather in a city", obj({"city": S}), "What is the weather in Paris?"),
    ("get_forecast", "Forecast for a city", obj({"city": S, "unit": {"enum": ["celsius", "fahrenheit"]}}),
     "Forecast for Berlin in celsius please."),
    ("add", "Add two integers", obj({"a": {**I, "minimum": 0, "maximum": 100}, "b": {**I, "minimum": 0, "maximum": 100}}),
     "What is 12 plus 30?"),
    ("convert", "Convert money", obj({"amount": N, "currency": {"enum": ["USD", "EUR", "GBP"]}}), "Convert 20 dollars to euros."),
    ("set_alarm", "Turn the alarm on or off", obj({"enabled": B}), "Turn my alarm on."),
    ("tag_photo", "Tag a photo", obj({"tags": {"type": "array", "items": {**S, "maxLength": 20}, "maxItems": 3}}),
     "Tag my beach photo."),
    ("ship", "Ship to an address", obj({"address": obj({"street": S, "zip": {**S, "pattern": "^[0-9]{5}$"}})}),
     "Ship it to 1 Main Street, 12345."),
    ("search", "Search the web", obj({"query": S, "limit": {**I, "minimum": 1, "maximum": 10}}, ["query"]),
     "Search for pasta recipes."),
    ("thermostat", "Set the thermostat", {"$defs": {"Mode": {"enum": ["heat", "cool", "off"]}}, "type": "object",
                                          "properties": {"mode": {"$ref": "#/$defs/Mode"}, "target": N},
                                          "required": ["mode", "target"]}, "Heat the house to 21 degrees."),
    ("store", "Store a value", obj({"value": {"anyOf": [I, {**S, "maxLength": 10}]}}), "Store the number 7."),
    ("note", "Save a note", obj({"title": {**S, "maxLength": 40}, "body": {"type": ["string", "null"]}}),
     "Save a note titled groceries."),
    ("deploy", "Deploy a service", obj({"version": {"const": 2}, "service": S}), "Deploy the web service."),
    ("book", "Book a table", obj({"date": {**S, "format": "date"}, "people": {**I, "minimum": 1}}),
     "Book a table for two on 2025-05-01."),
    ("now", "The current time", None, "What time is it?"),
    ("rate", "Rate a movie", obj({"movie": S, "stars": {**I, "minimum": 1, "maximum": 5}, "review": S},
                                 additionalProperties=False), "Rate Inception five stars."),
    ("order", "Order items", obj({"items": {"type": "array", "minItems": 1, "maxItems": 3,
                                            "items": obj({"sku": S, "qty": {**I, "minimum": 1}})}}),
     "Order two apples."),
    ("log_level", "Set the log level", obj({"level": {"enum": [1, 2, 3]}}), "Set the log level to 2."),
    ("area", "Area of a shape", obj({"shape": {"oneOf": [obj({"radius": N}), obj({"side": N})]}}),
     "Area of a circle of radius 3."),
    ("matrix", "Store a matrix", obj({"m": {"type": "array", "maxItems": 3,
                                           "items": {"type": "array", "items": I, "maxItems": 3}}}),
     "Store the 2x2 identity matrix."),
    ("email", "Send an email", obj({"to": {**S, "format": "email"}, "subject": {**S, "maxLength": 60}}),
     "Email bob@example.com about lunch."),
    ("lookup", "Look up a code", obj({"code": {**S, "minLength": 3, "maxLength": 6}}), "Look up code ABC12."),
    ("sample", "Sample at a temperature", obj({"temperature": {**N, "exclusiveMinimum": 0, "maximum": 1}}),
     "Sample at temperature 0.5."),
    ("merge", "Merge two records", {"type": "object", "allOf": [{"properties": {"a": I}, "required": ["a"]},
                                                                 {"properties": {"b": S}, "required": ["b"]}]},
     "Merge record 1 with bob."),
    ("configure", "Configure the database", obj({"db": obj({"host": S, "port": {**I, "minimum": 1, "maximum": 65535}})}),
     "Use the database at localhost port 5432."),
]


def tool(name: str, description: str, parameters) -> dict:
    function = {"name": name, "description": description}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def schema_of(parameters) -> dict:
    return parameters if parameters is not None else {"type": "object", "properties": {}}


ALL = [tool(n, d, p) for n, d, p, _ in SCHEMAS]
BY_NAME = {n: schema_of(p) for n, _, p, _ in SCHEMAS}


def check_calls(message, names) -> list:
    """Every call parses and validates against its function's schema as the request gave it."""
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), BY_NAME[call.function.name])
    return message.tool_calls


@pytest.fixture(scope="module")
def model_id(smollm2_http) -> str:
    with openai.OpenAI(base_url=smollm2_http.http_url, api_key="x", max_retries=0) as c:
        return c.models.list().data[0].id


@pytest.mark.timeout(1500)  # 24 prompts of 150-400 tokens and their calls: a minute on an idle 2-core CPU
async def test_every_required_or_named_call_validates_on_24_schemas(smollm2_http, model_id):
    """Each schema offered alone and named, or beside two others under `required`, parallel calls
    allowed for every fourth; all sent at once (they decode together)."""
    async def ask(i: int, name: str, description: str, parameters, question: str):
        named = i % 2 == 0
        tools = [tool(name, description, parameters)] if named else [
            tool(name, description, parameters), ALL[(i + 1) % len(ALL)], ALL[(i + 5) % len(ALL)]]
        res = await client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": question}], tools=tools, max_tokens=160,
            temperature=0, tool_choice={"type": "function", "function": {"name": name}} if named else "required",
            parallel_tool_calls=i % 4 == 1)
        return res, {t["function"]["name"] for t in tools}, named, i % 4 == 1

    async with openai.AsyncOpenAI(base_url=smollm2_http.http_url, api_key="x", max_retries=0, timeout=1200) as client:
        answers = await asyncio.gather(*(ask(i, *s) for i, s in enumerate(SCHEMAS)))
    for (res, names, named, parallel), (name, *_) in zip(answers, SCHEMAS):
        (c,) = res.choices
        calls = check_calls(c.message, {name} if named else names)
        assert len({(k.function.name, k.function.arguments) for k in calls}) == len(calls)  # no call twice
        assert c.message.content is None
        if parallel:  # SmolLM2 offered parallel calls makes several, different ones, up to its token limit
            assert c.finish_reason in ("tool_calls", "length")
        else:  # one call, and the end
            assert c.finish_reason == "tool_calls" and len(calls) == 1, (name, c)


def test_a_streamed_call_comes_in_openais_chunk_shape_and_adds_up(smollm2_http, model_id):
    kw = dict(model=model_id, messages=[{"role": "user", "content": SCHEMAS[1][3]}], tools=ALL[:3],
              tool_choice="required", max_tokens=120, temperature=0)
    with openai.OpenAI(base_url=smollm2_http.http_url, api_key="x", max_retries=0, timeout=600) as client:
        whole = client.chat.completions.create(**kw)
        chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    calls: dict[int, dict] = {}
    for d in (d for c in chunks for d in (c.choices[0].delta.tool_calls or [])):
        if d.id is not None:  # a call's first delta: id, type and name, arguments empty
            assert d.index not in calls and d.type == "function" and d.function.arguments == ""
            calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
        else:
            assert d.function.name is None and d.id is None
            calls[d.index]["arguments"] += d.function.arguments
    want = check_calls(whole.choices[0].message, {"get_weather", "get_forecast", "add"})
    assert [(k.function.name, k.function.arguments) for k in want] == [
        (calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls" == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)


async def test_async_client_auto_and_results_fed_back(smollm2_http, model_id):
    question = [{"role": "user", "content": SCHEMAS[0][3]}]
    async with openai.AsyncOpenAI(base_url=smollm2_http.http_url, api_key="x", max_retries=0, timeout=600) as client:
        auto = await client.chat.completions.create(model=model_id, messages=question, tools=ALL[:2], max_tokens=60,
                                                    temperature=0)
        first = await client.chat.completions.create(model=model_id, messages=question, tools=ALL[:2],
                                                     tool_choice="required", max_tokens=60, temperature=0)
        (call,) = check_calls(first.choices[0].message, {"get_weather", "get_forecast"})
        history = question + [first.choices[0].message.model_dump(exclude_none=True),
                              {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"}]
        answer = await client.chat.completions.create(model=model_id, messages=history, tools=ALL[:2], max_tokens=40,
                                                      temperature=0)
    (a,) = auto.choices
    if a.message.tool_calls:  # auto: the model's choice, text or calls; a call is always valid
        check_calls(a.message, {"get_weather", "get_forecast"})
    else:
        assert a.message.content and a.finish_reason in ("stop", "length")
    (c,) = answer.choices
    assert c.message.content or c.message.tool_calls
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in the prompt
