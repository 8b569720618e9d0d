"""What a request offers the model: its functions, the choice among them, and the call envelope."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

MAX_TOOLS = 128  # functions per request, as OpenAI allows
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
CHOICES = ("none", "auto", "required", "function")

# The envelope of one call: TRIGGER HEAD "name" ARGUMENTS_KEY {arguments} TAIL, that is
# <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>; parallel calls are joined by BETWEEN.
TRIGGER = "<tool_call>"
HEAD = '\n{"name": '
ARGUMENTS_KEY = ', "arguments": '
TAIL = "}\n</tool_call>"
BETWEEN = "\n"


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, what it does, and its arguments' JSON schema."""

    name: str
    description: str = ""
    parameters: dict | None = None  # None: no arguments (an empty object)

    @property
    def schema(self) -> dict:
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}

    def definition(self) -> dict:
        """OpenAI's shape, which chat templates that render tools expect."""
        function = {"name": self.name, "description": self.description, "parameters": self.schema}
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolUse:
    """A request's tools and tool_choice: `none` (no call), `auto` (the model chooses text or calls),
    `required` (one call or more) or `function` (a call of `function`); `parallel`: several calls at once."""

    tools: tuple[Tool, ...]
    choice: str = "auto"
    function: str | None = None
    parallel: bool = True

    @property
    def calls_allowed(self) -> bool:
        return self.choice != "none" and bool(self.tools)

    @property
    def one_call(self) -> bool:
        """At most one call: parallel calls refused, or a function named (OpenAI's forced function, Anthropic's
        `tool` choice); the answer ends where that call ends."""
        return not self.parallel or self.choice == "function"

    def callable(self) -> tuple[Tool, ...]:
        """The functions a call may name."""
        if self.choice == "function":
            return tuple(t for t in self.tools if t.name == self.function)
        return self.tools


@dataclass(frozen=True)
class ToolCall:
    """A call as OpenAI's messages carry it: `arguments` is JSON text."""

    id: str
    name: str
    arguments: str

    def envelope(self) -> str:
        """The call as the model writes it."""
        return f"{TRIGGER}{HEAD}{json.dumps(self.name)}{ARGUMENTS_KEY}{self.arguments}{TAIL}"


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)
