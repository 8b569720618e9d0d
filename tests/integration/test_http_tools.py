"""Bad tool input through the OpenAI edge of the shared trained-model server: each is a 400 naming the
field, before any generation (the calls themselves: test_http_tools_smollm2.py; the trained model's
128-token context holds no tool prompt)."""

from __future__ import annotations

import httpx
import pytest

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}}]
MESSAGES = [{"role": "user", "content": "The lighthouse keeper"}]


@pytest.fixture(scope="module")
def model_id(server) -> str:
    return httpx.get(f"{server.http_url}/models", timeout=30).json()["data"][0]["id"]


BAD = [
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]),
     "tools[0].function.parameters", "invalid JSON schema"),
    (dict(tools=[TOOLS[0], {"type": "function", "function": {"name": "g", "parameters": {
        "type": "array", "uniqueItems": True}}}], tool_choice="required"), "tools[1].function.parameters",
     "uniqueItems"),  # under auto such a keyword is left out (no call is promised valid there)
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice.function.name",
     "not a function in tools"),
    (dict(tool_choice="required"), "tool_choice", "needs tools"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice", "must be"),
    (dict(tools=[{"type": "code_interpreter"}]), "tools[0].type", "function"),
    (dict(tools=[{"type": "function", "function": {"name": "has space"}}]), "tools[0].function.name", "letters"),
    (dict(tools=[TOOLS[1], TOOLS[1]]), "tools[1].function.name", "twice"),
    (dict(tools=TOOLS, messages=MESSAGES + [{"role": "tool", "tool_call_id": "call_x", "content": "1"}]),
     "messages[1].tool_call_id", "matches no call"),
    (dict(tools=TOOLS, messages=MESSAGES + [
        {"role": "assistant", "tool_calls": [{"id": "call_a", "type": "function",
                                              "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_b", "content": "1"}]), "messages[2].tool_call_id", "matches no call"),
    (dict(tools=TOOLS, messages=MESSAGES + [{"role": "tool", "content": "1"}]), "messages[1].tool_call_id", "required"),
]


@pytest.mark.parametrize("kwargs, param, words", BAD, ids=[b[1] + ":" + b[2] for b in BAD])
def test_bad_tool_input_is_a_400_naming_the_field(server, model_id, kwargs, param, words):
    body = {"model": model_id, "messages": MESSAGES, "max_tokens": 5, **kwargs}
    r = httpx.post(f"{server.http_url}/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"] and err["type"] == "invalid_request_error", err
    assert "Traceback" not in err["message"] and "lmserve." not in err["message"]


def test_tools_are_chat_only(server, model_id):
    r = httpx.post(f"{server.http_url}/completions", json={"model": model_id, "prompt": "x", "tools": TOOLS},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
