"""What the three HTTP dialects (Chat Completions, Anthropic Messages, OpenAI Responses) share on the way in:
each reads its own wire shape and builds the same edge-neutral `GenerateInput` (inputs.py), through the
pieces here: a body's JSON (`parse_body`), typed fields (`Reader`), the policy for fields it does not
know (`FieldPolicy`), function tools and the choice among them (`ToolSet`), a conversation whose tool
results must answer earlier calls (`History`), and the model name (`check_model`).

Everything here runs on the Frontend's worker threads: its cost grows with what a client sends.
A fault is a `BodyError`, a 400 naming the field as the dialect spells it.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from dataclasses import dataclass
from typing import Callable

from ..edge_errors import EdgeError, Failure
from ..engine.request import RequestValidationError
from ..inputs import ChatTurn, GenerateInput
from ..tools import MAX_TOOLS, Tool, ToolCall, ToolUse
from ..tools.spec import NAME

log = logging.getLogger("lmserve.http")


class BodyError(RequestValidationError):
    """A body that is not a usable request (malformed JSON, a wrong type): a 400 naming the field."""

    def __init__(self, param: str, message: str):
        super().__init__([(param, message)])


class FieldPolicy:
    """What a top-level field this server does not know gets: refused with a 400 naming it (strict),
    or ignored, its name logged once (at most `max_logged` names, so a client cannot grow the set)."""

    def __init__(self, strict: bool = False, max_logged: int = 256):
        self.strict = strict
        self.max_logged = max_logged
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def unknown(self, names: list[str], where: str) -> None:
        if not names:
            return
        if self.strict:
            raise BodyError(names[0], f"is not a parameter of {where} (this server refuses unknown fields: "
                                      "--strict-openai-fields)")
        with self._lock:
            new = [n for n in names if n not in self._logged][: max(0, self.max_logged - len(self._logged))]
            self._logged.update(new)
        for name in new:
            log.warning("ignoring the field %r of %s, which this server does not know (logged once per name; "
                        "--strict-openai-fields refuses such requests)", name[:64], where)


@dataclass(frozen=True)
class Generation:
    """A dialect's request, translated: the model asked for, what to generate, and how to answer."""

    model: str
    input: GenerateInput
    names: Callable[[str], str]  # an engine field (`params.max_new_tokens`) -> the dialect's name for it
    stream: bool = False
    echo: dict | None = None  # what the dialect's answer repeats of the request (the Responses API's settings)


def parse_body(raw: bytes) -> dict:
    """The JSON object of a request body; BodyError (a 400) for anything else."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyError("body", f"is not valid UTF-8 (byte {exc.start})") from None
    try:
        body = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise BodyError("body", f"is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise BodyError("body", "is nested too deeply") from None
    if not isinstance(body, dict):
        raise BodyError("body", f"must be a JSON object, got {json_type(body)}")
    return body


def _refuse_constant(name: str):
    raise BodyError("body", f"is not valid JSON: {name} is not a number JSON allows")


def check_model(model: str, served: tuple[str, ...]) -> None:
    """An unknown model is a 404, as OpenAI and Anthropic answer it."""
    if model not in served:
        names = " or ".join(repr(n) for n in served)
        raise EdgeError(Failure.NOT_FOUND, f"the model {model[:200]!r} is not served here; this server serves "
                                           f"{names} (GET /v1/models)", param="model")


class Reader:
    """Typed access to a body's fields (`prefix` names where the body sits); remembers which it read."""

    def __init__(self, body: dict, prefix: str = ""):
        self.body, self.prefix, self.seen = body, prefix, set()

    def get(self, name: str, kind, required: bool = False, low=None, high=None, beyond: str = ""):
        self.seen.add(name)
        value = self.body.get(name)
        where = self.prefix + name
        if value is None:
            if required:
                raise BodyError(where, "is required")
            return None
        if kind is float:  # JSON numbers: an integer is a fine float; a bool is neither
            if type(value) not in (int, float) or not math.isfinite(value):
                raise BodyError(where, f"must be a number, got {json_type(value)}")
            value = float(value)
        elif kind is int:
            if type(value) is float and value.is_integer():
                value = int(value)
            if type(value) is not int:
                raise BodyError(where, f"must be an integer, got {json_type(value)}")
        elif kind is bool:
            if type(value) is not bool:
                raise BodyError(where, f"must be true or false, got {json_type(value)}")
        elif not isinstance(value, kind):
            names = {str: "a string", list: "an array", dict: "an object"}
            want = " or ".join(names[k] for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise BodyError(where, f"must be {want}, got {json_type(value)}")
        if low is not None and value < low:
            raise BodyError(where, f"must be at least {low}, got {value}")
        if high is not None and value > high:
            raise BodyError(where, f"must be at most {high}, got {value}{beyond}")
        if isinstance(value, str) and kind is str and name == "model" and not value:
            raise BodyError(where, "must not be empty")
        return value

    def unknown(self) -> list[str]:
        """The fields of the body not read (nor marked seen), sorted."""
        return sorted(self.body.keys() - self.seen)


def json_type(value) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(value), type(value).__name__)


def or_default(value, default):
    return default if value is None else value


def strings(values: list, name: str) -> list[str]:
    for i, v in enumerate(values):
        if not isinstance(v, str):
            raise BodyError(f"{name}[{i}]", f"must be a string, got {json_type(v)}")
    return values


def json_schema_constraint(schema, where: str) -> tuple[str, object]:
    """A JSON schema object -> the constraint as sent (inputs.InputParams.constraint)."""
    if not isinstance(schema, dict):
        raise BodyError(where, "must be a JSON schema object")
    return "json_schema", json.dumps(schema)


class ToolSet:
    """A request's function tools, checked as each dialect reads them (names as OpenAI allows, each once)."""

    def __init__(self, count: int, where: str):
        if count > MAX_TOOLS:
            raise BodyError(where, f"at most {MAX_TOOLS} functions, got {count}")
        self.tools: list[Tool] = []

    def add(self, name, description, parameters, where: str) -> None:
        """One function; `where` names its `name` field (`tools[0].function.name`)."""
        if not isinstance(name, str):
            raise BodyError(where, "is required" if name is None else f"must be a string, got {json_type(name)}")
        if not NAME.fullmatch(name):
            raise BodyError(where, f"must be 1 to 64 letters, digits, '_' or '-', got {name[:80]!r}")
        if any(t.name == name for t in self.tools):
            raise BodyError(where, f"{name!r} is defined twice")
        self.tools.append(Tool(name, description or "", parameters))

    def use(self, choice: str, function: str | None = None, parallel: bool = True,
            where: str = "tool_choice") -> ToolUse | None:
        """The ToolUse of `choice` (none, auto, required or function); None without tools, where a choice
        that needs a call is refused. `where` names the field of a named function."""
        if not self.tools:
            if choice in ("none", "auto"):
                return None
            raise BodyError(where.partition(".")[0], "needs tools to choose from")
        if choice == "function" and not any(t.name == function for t in self.tools):
            raise BodyError(where, f"{str(function)[:80]!r} is not a function in tools "
                                   f"({', '.join(t.name for t in self.tools[:8])})")
        return ToolUse(tuple(self.tools), choice, function if choice == "function" else None, parallel=parallel)


class History:
    """A conversation as the chat template takes it: turns in order, where a tool result must answer a
    call made earlier in the conversation."""

    def __init__(self):
        self.turns: list[ChatTurn] = []
        self._calls: set[str] = set()
        self._note = ""  # system text inside the conversation, waiting for a user turn (`note`)

    def resume(self, turns) -> None:
        """Turns of a conversation checked before (a stored response's)."""
        for t in turns:
            self.turns.append(t)
            self._calls.update(c.id for c in t.tool_calls)

    def say(self, role: str, content: str, calls: tuple[ToolCall, ...] = ()) -> None:
        if self._note and role == "user":  # a system note waiting for the next user turn
            content, self._note = f"{self._note}\n\n{content}" if content else self._note, ""
        self.turns.append(ChatTurn(role, content, calls))
        self._calls.update(c.id for c in calls)

    def system(self, text: str) -> None:
        """A system (or developer) message: the conversation's system turn while nothing else was said,
        joined to the one there; a note (`note`) after that."""
        if not text:
            return
        if not self.turns or (len(self.turns) == 1 and self.turns[0].role == "system"):
            head = self.turns[0].content + "\n\n" if self.turns else ""
            self.turns[:1] = [ChatTurn("system", head + text)]
        else:
            self.note(text)

    def note(self, text: str) -> None:
        """A system message inside the conversation (after its start). Chat templates take a system
        message first or not at all (Gemma's raises on any other order), so the note joins the user
        turn it follows, or else the next one; one that ends the conversation is a user turn of its own."""
        if not text:
            return
        last = self.turns[-1] if self.turns else None
        if last is not None and last.role == "user" and not self._note:
            self.turns[-1] = ChatTurn("user", f"{last.content}\n\n{text}" if last.content else text, last.tool_calls)
        else:
            self._note = f"{self._note}\n\n{text}" if self._note else text

    def close(self) -> None:
        """The conversation is complete: a note no user turn followed becomes one."""
        if self._note:
            note, self._note = self._note, ""
            self.say("user", note)

    def result(self, call_id: str, content: str, where: str) -> None:
        """The result of an earlier call; `where` names the field holding `call_id`."""
        if call_id not in self._calls:
            raise BodyError(where, f"{call_id[:80]!r} matches no call of an earlier assistant message")
        self.turns.append(ChatTurn("tool", content, (), call_id))


class FieldNames:
    """An engine field (as inputs.py and the engine name it: `params.max_new_tokens`, `messages[2].content`,
    `tools[0].function.parameters`) -> the dialect's name. The first rule whose engine prefix the field
    starts with renames that prefix; a rule ending in "*" renames the whole field (where the engine's
    indexes are not the body's). Other fields lose `params.`."""

    def __init__(self, *rules: tuple[str, str]):
        self.rules = rules

    def __call__(self, field: str) -> str:
        for engine, dialect in self.rules:
            whole = engine.endswith("*")
            prefix = engine.rstrip("*")
            if field == prefix or field.startswith((prefix + ".", prefix + "[")):
                return dialect if whole else dialect + field[len(prefix):]
            if "[]" in prefix:  # tools[].function.parameters: any index
                head, _, tail = prefix.partition("[]")
                if field.startswith(head + "[") and "]" in field:
                    index, _, rest = field[len(head) + 1:].partition("]")
                    if index.isdigit() and (rest == tail or rest.startswith(tail + ".")):
                        return dialect.replace("[]", f"[{index}]") + rest[len(tail):]
        return field.removeprefix("params.")
