"""The Messages and Responses dialects' translation without a server: the written field policy (unknown
fields ignored or refused with --strict-openai-fields; no-effect fields accepted), Anthropic's defaults,
field names in the dialects' words, and the bounded store of responses (count and age)."""

from __future__ import annotations

import pytest

from lmserve.server.edge_errors import EdgeError
from lmserve.server.engine.request import RequestValidationError
from lmserve.server.http import anthropic_messages
from lmserve.server.http.openai_responses_api import ResponsesDialect
from lmserve.server.http.response_store import ResponseStore, Stored
from lmserve.server.http.translate import FieldPolicy
from lmserve.server.inputs import ChatTurn

MESSAGES = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
RESPONSES = {"model": "m", "input": "hi"}


def messages(body: dict, strict: bool = False):
    return anthropic_messages.translate(body, FieldPolicy(strict))


def responses(body: dict, strict: bool = False, store: ResponseStore | None = None):
    return ResponsesDialect(store or ResponseStore()).translate(body, FieldPolicy(strict))


def refused(call) -> tuple[str, str]:
    with pytest.raises(RequestValidationError) as err:
        call()
    ((param, message),) = err.value.violations
    return param, message


def test_unknown_fields_are_ignored_unless_strict():
    for translate, body in ((messages, MESSAGES), (responses, RESPONSES)):
        assert translate({**body, "newer_field": 1}).model == "m"
        assert refused(lambda: translate({**body, "newer_field": 1}, strict=True))[0] == "newer_field"


def test_no_effect_fields_are_accepted_even_when_strict():
    messages({**MESSAGES, "metadata": {"user_id": "u"}, "thinking": {"type": "enabled", "budget_tokens": 1024},
              "service_tier": "auto", "cache_control": {"type": "ephemeral"}}, strict=True)
    responses({**RESPONSES, "metadata": {"a": "b"}, "store": False, "include": [], "reasoning": {"effort": "low"},
               "user": "u", "truncation": "disabled"}, strict=True)
    count = anthropic_messages.translate({**MESSAGES, "temperature": 0.5}, FieldPolicy(True), counting=True)
    assert count.input.params.max_new_tokens == 0  # count_tokens ignores a messages body's sampling fields


def test_anthropic_defaults_and_choices():
    p = messages(MESSAGES).input.params
    assert (p.temperature, p.top_p, p.top_k, p.max_new_tokens) == (1.0, None, 0, 8)
    tool = {"name": "f", "input_schema": {"type": "object"}}
    use = messages({**MESSAGES, "tools": [tool], "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
    assert (use.input.tools.choice, use.input.tools.parallel) == ("required", False)
    assert messages({**MESSAGES, "tools": [tool], "tool_choice": {"type": "none"}}).input.tools.calls_allowed is False


def test_engine_fields_are_named_in_each_dialects_words():
    m, r = messages(MESSAGES).names, responses(RESPONSES).names
    assert (m("params.max_new_tokens"), m("params.stop"), m("messages[3].content"), m("params.top_k")) == (
        "max_tokens", "stop_sequences", "messages", "top_k")
    assert (r("params.max_new_tokens"), r("tools[2].function.parameters"), r("messages")) == (
        "max_output_tokens", "tools[2].parameters", "input")
    assert m("tools[1].function.parameters") == "tools[1].input_schema"


def test_the_store_is_bounded_in_count_and_age():
    now = [0.0]
    store = ResponseStore(max_entries=2, ttl=10, clock=lambda: now[0])
    for i in range(3):
        store.put(f"r{i}", Stored({"id": f"r{i}"}, ()))
    assert store.get("r0") is None and store.get("r2").body["id"] == "r2" and len(store) == 2
    now[0] = 10.0
    assert store.get("r1") is None and store.get("r2") is None and len(store) == 0
    ResponseStore(max_entries=0).put("x", Stored({}, ()))  # storing off: nothing kept


def test_a_continued_response_starts_from_its_stored_conversation():
    store = ResponseStore()
    said = (ChatTurn("user", "hi"), ChatTurn("assistant", "hello"))
    store.put("resp_a", Stored({"id": "resp_a"}, said))
    gen = responses({**RESPONSES, "input": "more", "previous_response_id": "resp_a", "instructions": "Be brief."},
                    store=store)
    assert [(t.role, t.content) for t in gen.input.messages] == [
        ("system", "Be brief."), ("user", "hi"), ("assistant", "hello"), ("user", "more")]
    with pytest.raises(EdgeError) as err:
        responses({**RESPONSES, "previous_response_id": "resp_b"}, store=store)
    assert err.value.param == "previous_response_id" and "resp_b" in str(err.value)


def test_a_mid_conversation_system_message_joins_the_user_turn_beside_it():
    """Claude Code sends `system` messages inside `messages`; chat templates take a system message only
    first, so each joins the user turn it follows, or else the next one, or ends as a user turn."""
    def turns(msgs):
        return [(t.role, t.content) for t in messages({**MESSAGES, "system": "S", "messages": msgs}).input.messages]

    text = [{"type": "text", "text": "agents: a, b"}]
    assert turns([{"role": "user", "content": "hi"}, {"role": "system", "content": text}]) == \
        [("system", "S"), ("user", "hi\n\nagents: a, b")]
    assert turns([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"},
                  {"role": "system", "content": "n1"}, {"role": "system", "content": "n2"},
                  {"role": "user", "content": "go"}]) == \
        [("system", "S"), ("user", "hi"), ("assistant", "yes"), ("user", "n1\n\nn2\n\ngo")]
    assert turns([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"},
                  {"role": "system", "content": "late"}])[-1] == ("user", "late")
    assert refused(lambda: messages({**MESSAGES, "messages": [{"role": "system", "content": "first"}]}))[0] == \
        "messages[0].role"  # the first message is the conversation's, not a note: `system` takes that
    assert refused(lambda: messages({**MESSAGES, "messages": [{"role": "user", "content": "hi"},
                                                              {"role": "system", "content": 3}]}))[0] == \
        "messages[1].content"


def test_responses_namespace_tools_are_offered_by_qualified_name_and_answered_in_their_namespace():
    """Codex CLI groups functions in `namespace` tools and offers hosted ones (web_search) too: the
    namespaced functions reach the model as `<namespace>__<name>`, a call in history names its namespace,
    and a hosted tool is not offered (a 400 naming it only under --strict-openai-fields)."""
    fn = {"type": "function", "name": "close_agent", "parameters": {"type": "object", "properties": {}}}
    tools = [{"type": "namespace", "name": "agents", "description": "d", "tools": [fn]},
             {"type": "function", "name": "exec", "parameters": {"type": "object"}},
             {"type": "web_search", "external_web_access": False}]
    history = [{"type": "message", "role": "user", "content": "go"},
               {"type": "function_call", "call_id": "c1", "namespace": "agents", "name": "close_agent",
                "arguments": "{}"},
               {"type": "function_call_output", "call_id": "c1", "output": "closed"}]
    gen = responses({**RESPONSES, "tools": tools, "input": history,
                     "tool_choice": {"type": "function", "namespace": "agents", "name": "close_agent"}})
    assert [t.name for t in gen.input.tools.tools] == ["agents__close_agent", "exec"]
    assert gen.input.tools.function == "agents__close_agent"
    assert gen.input.messages[1].tool_calls[0].name == "agents__close_agent"
    assert gen.echo["namespaces"] == {"agents__close_agent": ("agents", "close_agent")}
    assert refused(lambda: responses({**RESPONSES, "tools": tools}, strict=True))[0].startswith("tools[2]")


def test_responses_developer_messages_make_one_system_turn_at_the_start_and_notes_later():
    gen = responses({**RESPONSES, "instructions": "I", "input": [
        {"type": "message", "role": "developer", "content": "D1"},
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "D2"}]},
        {"type": "message", "role": "user", "content": "hi"},
        {"type": "message", "role": "system", "content": "late"}]})
    assert [(t.role, t.content) for t in gen.input.messages] == [("system", "I\n\nD1\n\nD2"), ("user", "hi\n\nlate")]
    assert [(t.role, t.content) for t in gen.echo["history"]] == [("system", "D1\n\nD2"), ("user", "hi\n\nlate")]
