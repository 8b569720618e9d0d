"""Tools, earlier calls and their results into the messages a chat template renders.

Where the template renders tools itself (it reads the `tools` variable: rendering with and without them
differs), it gets them as Hugging Face templates expect: `tools` in OpenAI's shape, assistant messages
with `tool_calls` (arguments as an object where they are JSON), and `tool` messages with `tool_call_id`
and the called function's `name`.

Otherwise (SmolLM2's template, and most templates of models not trained for tools) the fallback:

- a system message, or the text appended to the first one, lists the functions as JSON and shows the
  call envelope (`FALLBACK_INTRO`, `FALLBACK_FORMAT`); under `required` or a named function it says a
  call is expected; under `none` nothing is added;
- an assistant message's calls are appended to its content in words, `I called NAME(ARGUMENTS).` (shown
  as envelopes, SmolLM2 copies its last call again instead of answering from its result);
- `tool` messages become `user` messages saying what the call returned (consecutive results in one
  message), since such templates may refuse or mangle a `tool` role (and SmolLM2, given a `tool` turn
  or a `<tool_response>` block, repeats it instead of answering from it).

Special-token text is never trusted: in the fallback everything is message content (which the template's
markup cannot turn into control tokens); a native template renders tools and arguments as its own markup,
so there they are refused when they hold such text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

from .spec import Tool, ToolCall, ToolUse

FALLBACK_INTRO = "You can call functions. These are available, as JSON schemas:"
FALLBACK_FORMAT = ("To call a function, reply with the call and nothing else, in this form:\n"
                   '<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>')
FALLBACK_PARALLEL = "For several calls at once, write one such block after another."
FALLBACK_CALLED = "I called {name}({arguments})."
FALLBACK_RESULT = "The call {name} returned:\n{result}"
_WHEN = {"auto": "Call a function when it helps to answer; otherwise answer in text.",
         "required": "Answer with a function call.",
         "function": "Answer by calling the function {name}."}
_PROBE = Tool("lmserve_probe", "probe", {"type": "object", "properties": {"q": {"type": "string"}}})


@dataclass(frozen=True)
class Turn:
    """A chat message as the conversion sees it (inputs.ChatTurn and pb.ChatMessage both fit)."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


class SpecialText(ValueError):
    """A field a native template would render as markup holds special-token text: (field, message)."""

    def __init__(self, field: str):
        self.field = field
        super().__init__("holds special-token text, which this model's chat template renders as markup")


def renders_tools(render: Callable[..., str]) -> bool:
    """Whether a template (its `render(messages, **variables)`) renders the `tools` variable."""
    messages = [{"role": "user", "content": "x"}]
    try:
        return render(messages, tools=[_PROBE.definition()]) != render(messages)
    except ValueError:  # a template refusing its probe renders no tools we can rely on
        return False


def template_input(turns, use: ToolUse | None, native: bool,
                   special: Callable[[str], bool] = lambda _: False) -> tuple[list[dict], dict]:
    """(messages, template variables) for `turns` with `use`'s tools; `special` says whether a text spells
    special tokens (refused where a native template would render it as markup: SpecialText)."""
    if native:
        return _native(turns, use, special)
    return _fallback(turns, use), {}


def _native(turns, use: ToolUse | None, special) -> tuple[list[dict], dict]:
    names = {}
    messages = []
    for i, t in enumerate(turns):
        m = {"role": t.role, "content": t.content}
        calls = getattr(t, "tool_calls", ())
        if calls:
            m["tool_calls"] = []
            for j, c in enumerate(calls):
                for field, text in (("id", c.id), ("function.name", c.name), ("function.arguments", c.arguments)):
                    if special(text):
                        raise SpecialText(f"messages[{i}].tool_calls[{j}].{field}")
                names[c.id] = c.name
                m["tool_calls"].append({"id": c.id, "type": "function",
                                        "function": {"name": c.name, "arguments": _arguments(c.arguments)}})
        call_id = getattr(t, "tool_call_id", None)
        if call_id is not None:
            if special(call_id):
                raise SpecialText(f"messages[{i}].tool_call_id")
            m["tool_call_id"] = call_id
            m["name"] = names.get(call_id, "")
        messages.append(m)
    variables = {}
    if use is not None and use.tools:
        tools = [t.definition() for t in use.tools]
        for i, tool in enumerate(tools):
            if special(json.dumps(tool, ensure_ascii=False)):
                raise SpecialText(f"tools[{i}].function")
        variables["tools"] = tools
    return messages, variables


def _arguments(text: str):
    """A call's arguments as templates expect them: the object, where the text is JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _fallback(turns, use: ToolUse | None) -> list[dict]:
    messages: list[dict] = []
    names = {}
    for t in turns:
        calls = getattr(t, "tool_calls", ())
        names.update((c.id, c.name) for c in calls)
        if t.role == "tool":
            block = FALLBACK_RESULT.format(name=names.get(t.tool_call_id, "function"), result=t.content)
            if messages and messages[-1].get("results"):  # consecutive results: one user message
                messages[-1]["content"] += "\n\n" + block
            else:
                messages.append({"role": "user", "content": block, "results": True})
            continue
        content = t.content
        if calls:
            called = " ".join(FALLBACK_CALLED.format(name=c.name, arguments=c.arguments) for c in calls)
            content = f"{content}\n{called}" if content else called
        messages.append({"role": t.role, "content": content})
    for m in messages:
        m.pop("results", None)
    if use is not None and use.calls_allowed:
        text = _fallback_system_text(use)
        if messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{text}"}
        else:
            messages.insert(0, {"role": "system", "content": text})
    return messages


def _fallback_system_text(use: ToolUse) -> str:
    listed = "\n".join(json.dumps({"name": t.name, "description": t.description, "parameters": t.schema},
                                  ensure_ascii=False) for t in use.callable())
    when = _WHEN[use.choice].format(name=use.function)
    parallel = "" if use.one_call else f"\n{FALLBACK_PARALLEL}"
    return f"{FALLBACK_INTRO}\n{listed}\n\n{FALLBACK_FORMAT}{parallel}\n{when}"
