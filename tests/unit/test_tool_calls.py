"""Tool calling without a server: the call envelope read back whole and piece by piece (every split
of the text gives the same content and calls), the grammar compiled by the matcher library over
SmolLM2's vocabulary (what it lets through and what it refuses), the schema it generates under, and the
fallback prompt."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from lmserve.server.tools import Tool, ToolCall, ToolUse
from lmserve.server.tools.grammar import generation_schema, tool_grammar
from lmserve.server.tools.parser import CallParser
from lmserve.server.tools.prompt import FALLBACK_FORMAT, renders_tools, template_input
from lmserve.server.inputs import ChatTurn

WEATHER = Tool("get_weather", "Weather in a city", {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city"]})
ADD = Tool("add", "Add two integers", {"type": "object", "properties": {"a": {"type": "integer"},
                                                                          "b": {"type": "integer"}},
                                       "required": ["a", "b"]})
NOARGS = Tool("now")


def envelope(name: str, arguments: str) -> str:
    return ToolCall("x", name, arguments).envelope()


CASES = [
    ("Just text, no call.", "Just text, no call.", []),
    ("", "", []),
    (envelope("get_weather", '{"city": "Paris"}'), "", [("get_weather", '{"city": "Paris"}')]),
    ("Let me look.\n" + envelope("add", '{"a": 1, "b": 2}') + "\n" + envelope("now", "{}"), "Let me look.",
     [("add", '{"a": 1, "b": 2}'), ("now", "{}")]),
    (envelope("f", '{"s": "a } ] \\" {"}'), "", [("f", '{"s": "a } ] \\" {"}')]),
    (envelope("f", "[1, [2], {}]"), "", [("f", "[1, [2], {}]")]),
    (envelope("f", "42"), "", [("f", "42")]),
    (envelope("f", '"text }"'), "", [("f", '"text }"')]),
    ("a <tool_ca", "a <tool_ca", []),  # a trigger begun and never finished stays content
    ("mentions <tool_call> in passing", "mentions <tool_call> in passing", []),  # not followed by a call
    ("x" + envelope("add", '{"a": 1, "b": 2}')[:-3], "x", [("add", '{"a": 1, "b": 2}')]),  # cut in its tail
    (envelope("add", '{"a": 1, "b": 2}') + "\n" + envelope("add", '{"a": 3, "b": 4}')[:-5], "",
     [("add", '{"a": 1, "b": 2}')]),  # a later call cut: dropped
    ('ok <tool_call>\n{"name": "ad', "ok", []),  # cut in its name: dropped
    (envelope("add", '{"a": 1, "b": 2}') + "\n" + envelope("add", '{"a": 1, "b": 3}') + "\n"
     + envelope("add", '{"a": 1, "b": 2}') + "\n" + envelope("now", "{}"), "",
     [("add", '{"a": 1, "b": 2}'), ("add", '{"a": 1, "b": 3}')]),  # a repeat ends the answer
]


@pytest.mark.parametrize("text, content, calls", CASES)
def test_calls_are_read_the_same_whole_and_split_anywhere(text, content, calls):
    for cuts in [(len(text),), *((i,) for i in range(len(text))), tuple(range(0, len(text), 3))]:
        parser = CallParser()
        deltas, at = [], 0
        for cut in (*cuts, len(text)):
            deltas += parser.feed(text[at:cut])
            at = max(at, cut)
        deltas += parser.finish()
        assert parser.content == content == "".join(d.content for d in deltas if d.index is None)
        assert [(c.name, c.arguments) for c in parser.calls] == calls
        for k, call in enumerate(parser.calls):  # the streamed deltas spell each call
            starts = [d for d in deltas if d.index == k and d.id is not None]
            assert [(d.id, d.name) for d in starts] == [(call.id, call.name)]
            assert "".join(d.arguments for d in deltas if d.index == k and d.arguments is not None) == call.arguments
            assert call.id.startswith("call_") and len(call.id) == 29
        assert parser.complete_calls == min(text.count("</tool_call>"), len(calls))
        assert parser.repeated == (len(calls) < text.count("</tool_call>"))
        if len(calls) > 1 or parser.repeated:  # later calls are streamed once complete and new only
            assert not any(d.index and d.id is not None and d.index >= len(calls) for d in deltas)


def test_call_ids_differ():
    parser = CallParser()
    parser.feed(envelope("add", '{"a": 1, "b": 2}') + "\n" + envelope("add", '{"a": 2, "b": 1}'))
    assert len({c.id for c in parser.calls}) == 2


@pytest.fixture(scope="module")
def vocabulary(smollm2_tokenizer):
    from lmserve.server.engine.constraints.vocabulary import build_vocabulary

    return build_vocabulary(smollm2_tokenizer)


def matcher_after(vocabulary, tokenizer, grammar: str, text: str):
    """The grammar's matcher after `text` (tokenized as the model would write it), or None where it refuses it."""
    from llguidance import LLMatcher

    matcher = LLMatcher(vocabulary.ll_tokenizer, LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher if all(matcher.consume_token(t) for t in tokenizer.encode(text, parse_special=False)) else None


def accepts(vocabulary, tokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar lets `text` through to its end."""
    matcher = matcher_after(vocabulary, tokenizer, grammar, text)
    return matcher is not None and matcher.is_accepting()


def test_the_grammar_holds_calls_to_the_envelope_and_the_schemas(vocabulary, smollm2_tokenizer):
    ok_weather = envelope("get_weather", '{"city": "Paris", "unit": "c"}')
    ok_add = envelope("add", '{"a": 1, "b": 2}')
    cases = {
        "required": [(ok_weather, True), (ok_add + "\n" + ok_weather, True), ("Sure. " + ok_add, False),
                     ("Paris is sunny.", False), (envelope("add", '{"a": 1}'), False),
                     (envelope("sub", '{"a": 1, "b": 2}'), False), (envelope("add", '{"a":1,"b":2}'), False),
                     (envelope("add", '{"a": 1, "b": 2, "c": 3}'), False), (ok_add + " more", False)],
        "auto": [("Paris is sunny.", True), ("", True), ("Let me see. " + ok_weather, True),
                 ("<tool_call> is a tag", False), ("Sure " + envelope("add", '{"a": "x", "b": 2}'), False),
                 (ok_add + "\nthen text", False)],
        "function": [(ok_add, True), (ok_weather, False), (ok_add + "\n" + envelope("add", '{"a": 3, "b": 4}'), False)],
    }
    for choice, examples in cases.items():
        use = ToolUse((WEATHER, ADD), choice, "add" if choice == "function" else None)
        grammar = tool_grammar(use)
        for text, want in examples:
            assert accepts(vocabulary, smollm2_tokenizer, grammar, text) is want, (choice, text)
    single = tool_grammar(ToolUse((WEATHER, ADD), "required", parallel=False))
    assert accepts(vocabulary, smollm2_tokenizer, single, ok_add)
    assert not accepts(vocabulary, smollm2_tokenizer, single, ok_add + "\n" + ok_add)
    # one call all that may follow: after it nothing but the end (where the engine ends the answer); else more calls
    for use, one in ((ToolUse((WEATHER, ADD), "required", parallel=False), True),
                     (ToolUse((WEATHER, ADD), "function", "add"), True), (ToolUse((WEATHER, ADD), "required"), False)):
        assert use.one_call is one
        assert matcher_after(vocabulary, smollm2_tokenizer, tool_grammar(use), ok_add).is_stopped() is one
    answer = tool_grammar(ToolUse((ADD,), "auto"), answer={"type": "object", "properties": {"x": {"type": "integer"}},
                                                             "required": ["x"]})
    assert accepts(vocabulary, smollm2_tokenizer, answer, '{"x": 3}')
    assert accepts(vocabulary, smollm2_tokenizer, answer, ok_add)
    assert not accepts(vocabulary, smollm2_tokenizer, answer, "free text")


def test_keywords_the_grammar_cannot_hold_are_left_out_under_auto_and_refused_where_calls_are_promised(
        vocabulary, smollm2_tokenizer):
    """Agent clients' tool lists use keywords the matcher cannot enforce (Claude Code's: propertyNames):
    under `auto` the rest of the schema still holds the call; under `required` the grammar is refused."""
    from llguidance import LLMatcher

    env = Tool("set_env", "Set variables", {"type": "object", "properties": {"vars": {
        "type": "object", "additionalProperties": {"type": "string"}, "propertyNames": {"pattern": "^[A-Z]+$"}}},
        "required": ["vars"]})
    auto = tool_grammar(ToolUse((env, ADD), "auto"))
    assert accepts(vocabulary, smollm2_tokenizer, auto, envelope("set_env", '{"vars": {"HOME": "/x"}}'))
    assert not accepts(vocabulary, smollm2_tokenizer, auto, envelope("set_env", '{"vars": {"HOME": 3}}'))
    assert "propertyNames" in LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(
        tool_grammar(ToolUse((env, ADD), "required"))))
    assert generation_schema(env.schema)["x-guidance"].get("lenient") is None
    assert generation_schema(env.schema, lenient=True)["x-guidance"]["lenient"] is True


def test_the_generation_schema_closes_objects_only_where_every_output_stays_valid():
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "b": {"type": "object"},
        "n": {"type": "object", "properties": {}},
        "c": {"type": "object", "properties": {"y": {"type": "string"}}, "additionalProperties": True},
        "d": {"allOf": [{"properties": {"p": {"type": "integer"}}}, {"properties": {"q": {"type": "integer"}}}]},
        "e": {"type": "object", "properties": {"z": {"type": "integer"}}, "required": ["z", "w"]},
        "f": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "boolean"}}}},
        "g": {"$ref": "#/$defs/G"}}, "$defs": {"G": {"type": "object", "properties": {"h": {"type": "null"}}}}}
    gen = generation_schema(schema)
    props = gen["properties"]
    assert gen["additionalProperties"] is False and props["a"]["additionalProperties"] is False
    assert "additionalProperties" not in props["b"] and props["c"]["additionalProperties"] is True
    assert props["n"]["additionalProperties"] is False  # a function without arguments: {}
    assert all("additionalProperties" not in s for s in props["d"]["allOf"])
    assert "additionalProperties" not in props["e"]  # requires a key it does not declare
    assert props["f"]["items"]["additionalProperties"] is False
    assert gen["$defs"]["G"]["additionalProperties"] is False
    assert gen["x-guidance"]["whitespace_flexible"] is False
    jsonschema.Draft202012Validator.check_schema({k: v for k, v in gen.items() if k != "x-guidance"})
    example = {"a": {"x": 1}, "b": {"any": 1}, "n": {}, "c": {"y": "s", "more": 1}, "d": {"p": 1, "q": 2},
               "e": {"z": 1, "w": 2}, "f": [{"k": True}], "g": {"h": None}}
    jsonschema.validate(example, schema)
    jsonschema.validate(example, {k: v for k, v in gen.items() if k != "x-guidance"})


def test_the_fallback_prompt_lists_the_tools_and_writes_earlier_calls_in_words():
    use = ToolUse((WEATHER, ADD), "required")
    call = ToolCall("call_1", "add", '{"a": 1, "b": 2}')
    turns = [ChatTurn("system", "Be brief."), ChatTurn("user", "1+2?"), ChatTurn("assistant", "", (call,)),
             ChatTurn("tool", "3", tool_call_id="call_1"), ChatTurn("tool", "ok", tool_call_id="call_1")]
    messages, variables = template_input(turns, use, native=False)
    assert variables == {}
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\n") and FALLBACK_FORMAT in system and "Answer with a function call." in system
    listed = [json.loads(line) for line in system.splitlines() if line.startswith('{"name": "')]
    assert [t["name"] for t in listed] == ["get_weather", "add"] and listed[1]["parameters"] == ADD.parameters
    assert messages[2]["content"] == 'I called add({"a": 1, "b": 2}).'
    assert messages[3]["content"] == "The call add returned:\n3\n\nThe call add returned:\nok"
    none, _ = template_input([ChatTurn("user", "hi")], ToolUse((WEATHER,), "none"), native=False)
    assert none == [{"role": "user", "content": "hi"}]


def test_a_native_template_gets_tools_calls_and_results_in_hugging_faces_shape():
    from lmserve.model.text.chat_template import ChatTemplate

    template = ChatTemplate("{% if tools %}[{{ tools | length }} tools]{% endif %}{% for m in messages %}"
                            "{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}<{{ c.function.name }}"
                            "{{ c.function.arguments | tojson }}>{% endfor %}"
                            "{% if m.tool_call_id %}({{ m.name }}){% endif %};{% endfor %}")
    assert renders_tools(template.render)
    assert not renders_tools(ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}").render)
    call = ToolCall("call_1", "add", '{"a": 1, "b": 2}')
    turns = [ChatTurn("user", "1+2?"), ChatTurn("assistant", "", (call,)), ChatTurn("tool", "3", tool_call_id="call_1")]
    messages, variables = template_input(turns, ToolUse((ADD,), "auto"), native=True)
    assert template.render(messages, **variables) == '[1 tools]user:1+2?;assistant:<add{"a": 1, "b": 2}>;tool:3(add);'
    with pytest.raises(ValueError) as err:
        template_input(turns, ToolUse((Tool("add", "<|im_end|>"),), "auto"), native=True,
                       special=lambda text: "<|im_end|>" in text)
    assert err.value.field == "tools[0].function"


TEMPLATE = Path(__file__).resolve().parents[1] / "fixtures" / "chatml_tools.jinja"


def test_a_template_that_renders_tools_gets_them_as_transformers_renders_them(smollm2_gguf_path):
    """InputConverter with a tool-aware template (--chat-template): the rendered prompt is the one
    transformers' own renderer makes of the same conversation in Hugging Face's shape."""
    import gguf
    from transformers.utils.chat_template_utils import render_jinja_template

    from lmserve.model.text.tokenizer import Tokenizer
    from lmserve.server.engine.request import RequestValidationError
    from lmserve.server.inputs import InputConverter

    reader = gguf.GGUFReader(str(smollm2_gguf_path))
    tok = Tokenizer.from_gguf_fields({k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")})
    source = TEMPLATE.read_text()
    tok.use_chat_template(source)
    inputs = InputConverter(tok, engine=None)
    assert inputs.template_renders_tools
    call = ToolCall("call_1", "add", '{"a": 1, "b": 2}')
    turns = [ChatTurn("system", "Be brief."), ChatTurn("user", "1+2?"), ChatTurn("assistant", "", (call,)),
             ChatTurn("tool", "3", tool_call_id="call_1")]
    ids, text = inputs._chat(turns, "messages", tools=ToolUse((WEATHER, ADD), "auto"))
    hf = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2?"},
          {"role": "assistant", "content": "", "tool_calls": [
              {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
          {"role": "tool", "content": "3", "tool_call_id": "call_1", "name": "add"}]
    (want,), _ = render_jinja_template(conversations=[hf], tools=[WEATHER.definition(), ADD.definition()],
                                       chat_template=source, add_generation_prompt=True)
    assert text == want and '"name": "get_weather"' in text and "<tool_response>\n3\n" in text
    assert ids == tok.encode(want)  # the template's markup, and only it, became special ids
    bad = ToolUse((Tool("add", "ends <|im_end|> here"),), "auto")
    with pytest.raises(RequestValidationError) as err:
        inputs._chat(turns[:2], "messages", tools=bad)
    assert err.value.violations[0][0] == "tools[0].function"
