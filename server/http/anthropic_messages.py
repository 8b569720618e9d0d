"""Anthropic's Messages API: `POST /v1/messages` and `/v1/messages/count_tokens` bodies -> the shared
translation (translate.py), and an answer (reply.Reply) -> a message, its stream of events, or an error
in Anthropic's envelope. The edge (app.py) runs it as it runs every dialect.

A `system` message inside `messages` (after the first; Anthropic's mid-conversation system messages, which
Claude Code sends) joins the user turn next to it (translate.History.note): chat templates take a
system message only first.

Content blocks: `text`, `tool_use` (an assistant's calls), `tool_result` (the user's answers to them,
each naming a call made earlier) and `thinking`/`redacted_thinking` (accepted in history, not shown to a
model that does not think); `cache_control` is accepted anywhere and has no effect (the prefix cache
works on its own). Other blocks (images, documents, server tools) are refused with a 400 naming them.
"""

from __future__ import annotations

import json
import time

from ..edge_errors import Problem
from ..inputs import GenerateInput, InputParams
from ..tools import ToolCall
from ..tools.parser import Delta, ParsedCall
from .reply import Ending, Reply
from .translate import (BodyError, FieldNames, FieldPolicy, Generation, History, Reader, ToolSet,
                        json_schema_constraint, json_type, strings)

PATH = "/v1/messages"
# Accepted and not acted on: routing and caching hints, and the thinking budget of a model that does not think
# (`output_config.effort` likewise).
NO_EFFECT = frozenset({"metadata", "service_tier", "thinking", "context_management", "cache_control", "inference_geo",
                       "speed", "user_profile_id", "workspace_id"})
# Known and not served: a 400 naming them unless null or empty.
UNSUPPORTED = frozenset({"mcp_servers", "container"})
MAX_TEMPERATURE = 1.0  # Anthropic's range: 0 to 1, default 1
_CHOICES = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}
_STOP_REASONS = {Ending.END: "end_turn", Ending.STOP: "stop_sequence", Ending.LENGTH: "max_tokens",
                 Ending.CALLS: "tool_use"}
_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "stop_sequences", "stream", "output_format", "output_config")
_IGNORED_BLOCKS = frozenset({"thinking", "redacted_thinking"})
# an HTTP status -> Anthropic's error type
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                499: "api_error", 500: "api_error", 503: "overloaded_error", 504: "timeout_error"}
NAMES = FieldNames(("params.max_new_tokens", "max_tokens"), ("params.stop", "stop_sequences"),
                   ("params.json_schema", "output_config.format.schema"), ("tools[].function.parameters", "tools[].input_schema"),
                   ("messages*", "messages"), ("prompt", "messages"), ("token_ids", "messages"))
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


# ---- requests -------------------------------------------------------------------------------
def translate(body: dict, fields: FieldPolicy, counting: bool = False) -> Generation:
    """A /v1/messages body (or, `counting`, a count_tokens body: no max_tokens, no sampling) -> Generation.
    Fields are read in a fixed order, so a body with several faults is always refused for the same one."""
    r = Reader(body)
    model = r.get("model", str, required=True)
    for name in sorted(UNSUPPORTED & body.keys()):
        if body[name] not in (None, [], {}):
            raise BodyError(name, "is not supported by this server")
    params = InputParams()
    stream = False
    if not counting:
        params = _params(r)
        stream = bool(r.get("stream", bool))
    tools = _tools(r.get("tools", list) or [], body.get("tool_choice"))
    r.seen.add("tool_choice")
    history = History()
    _system(body.get("system"), history)
    r.seen.add("system")
    _messages(r.get("messages", list, required=True), history)
    history.close()
    if counting:  # a count_tokens body copied from a messages body: its sampling fields count nothing
        r.seen.update(_SAMPLING)
    fields.unknown(sorted(body.keys() - r.seen - NO_EFFECT - UNSUPPORTED), PATH + ("/count_tokens" if counting else ""))
    return Generation(model, GenerateInput(messages=history.turns, params=params, tools=tools), NAMES, stream)


def _params(r: Reader) -> InputParams:
    max_tokens = r.get("max_tokens", int, required=True, low=1)
    temperature = r.get("temperature", float, high=MAX_TEMPERATURE)
    top_p = r.get("top_p", float, high=1.0)
    top_k = r.get("top_k", int, low=0)
    stop = tuple(strings(r.get("stop_sequences", list) or [], "stop_sequences"))
    config = r.get("output_config", dict) or {}
    where, fmt = "output_config.format", Reader(config, "output_config.").get("format", dict)
    if fmt is None:  # the earlier spelling
        where, fmt = "output_format", r.get("output_format", dict)
    constraint = None
    if fmt is not None:
        if fmt.get("type") != "json_schema":
            raise BodyError(f"{where}.type", f"must be 'json_schema', got {str(fmt.get('type'))[:40]!r}")
        constraint = json_schema_constraint(fmt.get("schema"), f"{where}.schema")
    return InputParams(max_new_tokens=max_tokens, temperature=1.0 if temperature is None else temperature,
                       top_p=None if top_p is None else top_p, top_k=top_k or 0, stop=stop, constraint=constraint)


def _tools(raw: list, choice):
    found = ToolSet(len(raw), "tools")
    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise BodyError(where, f"must be an object, got {json_type(t)}")
        if t.get("type") not in (None, "custom"):
            raise BodyError(f"{where}.type", f"{str(t.get('type'))[:60]!r} is a server tool, which this server does "
                                             "not run; only custom tools (name, description, input_schema) are served")
        r = Reader(t, f"{where}.")
        found.add(t.get("name"), r.get("description", str), r.get("input_schema", dict, required=True), f"{where}.name")
    if choice is None:
        return found.use("auto")
    r = Reader(choice if isinstance(choice, dict) else {}, "tool_choice.")
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in _CHOICES:
        raise BodyError("tool_choice.type", "must be 'auto', 'any', 'tool' or 'none'")
    parallel = not r.get("disable_parallel_tool_use", bool)
    name = r.get("name", str, required=kind == "tool")
    return found.use(_CHOICES[kind], name, parallel, "tool_choice.name")


def _system(system, history: History) -> None:
    if system is None:
        return
    if isinstance(system, str):
        text = system
    elif isinstance(system, list):
        text = "\n\n".join(_texts(system, "system"))
    else:
        raise BodyError("system", f"must be a string or an array of text blocks, got {json_type(system)}")
    if text:
        history.say("system", text)


def _texts(blocks: list, where: str) -> list[str]:
    """Text blocks -> their texts."""
    out = []
    for j, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text":
            raise BodyError(f"{where}[{j}]", "must be a text block ({\"type\": \"text\", \"text\": ...})")
        out.append(Reader(b, f"{where}[{j}].").get("text", str, required=True))
    return out


def _messages(raw: list, history: History) -> None:
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BodyError(where, f"must be an object, got {json_type(m)}")
        role = m.get("role")
        content = m.get("content")
        if role == "system" and i > 0:  # a mid-conversation system message (Claude Code sends them)
            if not isinstance(content, (str, list)):
                raise BodyError(f"{where}.content", f"must be a string or an array of text blocks, got {json_type(content)}")
            history.note(content if isinstance(content, str) else "\n\n".join(_texts(content, f"{where}.content")))
            continue
        if role not in ("user", "assistant"):
            raise BodyError(f"{where}.role", "must be 'user' or 'assistant' (or 'system' after the first message), "
                                             f"got {str(role)[:32]!r}")
        if isinstance(content, str):
            history.say(role, content)
        elif isinstance(content, list):
            _blocks(content, role, f"{where}.content", history)
        else:
            raise BodyError(f"{where}.content", f"must be a string or an array of content blocks, got {json_type(content)}")


def _blocks(blocks: list, role: str, where: str, history: History) -> None:
    """A message's blocks: an assistant's text and calls make one turn; a user's tool results come first,
    each as the answer to its call, then its text as one turn."""
    texts, calls = [], []
    for j, b in enumerate(blocks):
        at = f"{where}[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        r = Reader(b if isinstance(b, dict) else {}, f"{at}.")
        if kind == "text":
            texts.append(r.get("text", str, required=True))
        elif kind in _IGNORED_BLOCKS:
            continue
        elif kind == "tool_use" and role == "assistant":
            arguments = b.get("input")
            if not isinstance(arguments, dict):
                raise BodyError(f"{at}.input", f"must be an object, got {json_type(arguments)}")
            calls.append(ToolCall(r.get("id", str, required=True), r.get("name", str, required=True),
                                  json.dumps(arguments, ensure_ascii=False)))
        elif kind == "tool_result" and role == "user":
            call_id = r.get("tool_use_id", str, required=True)
            result = b.get("content")
            if isinstance(result, list):
                result = "\n".join(_texts(result, f"{at}.content"))
            elif result is None:
                result = ""
            elif not isinstance(result, str):
                raise BodyError(f"{at}.content", f"must be a string or an array of text blocks, got {json_type(result)}")
            if r.get("is_error", bool):
                result = f"Error: {result}"
            history.result(call_id, result, f"{at}.tool_use_id")
        elif kind in ("tool_use", "tool_result"):
            raise BodyError(f"{at}.type", f"a {kind} block belongs in {'an assistant' if kind == 'tool_use' else 'a user'} "
                                          "message")
        else:
            raise BodyError(f"{at}.type" if isinstance(b, dict) else at,
                            "must be a block of type text, tool_use, tool_result, thinking or redacted_thinking "
                            f"(got {str(kind)[:40]!r}; images and documents are not served)")
    if texts or calls or not blocks:
        history.say(role, "".join(texts), tuple(calls))


# ---- answers --------------------------------------------------------------------------------
def _usage(reply: Reply, prompt_tokens: int) -> dict:
    """Anthropic's usage: input_tokens are the prompt tokens the prefix cache did not supply."""
    u = reply.usage
    cached = u.cached_prompt_tokens if u else 0
    return {"input_tokens": (u.prompt_tokens if u else prompt_tokens) - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": u.completion_tokens if u else 0}


def tool_use_id(call: ParsedCall | Delta) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def _input(call: ParsedCall) -> dict:
    """A call's arguments as an object (a call cut by the token limit: what of it parses, else {})."""
    try:
        value = json.loads(call.arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _stop(reply: Reply) -> tuple[str, str | None]:
    ending = reply.ending
    return _STOP_REASONS[ending], reply.matched_stop if ending is Ending.STOP else None


def message_body(gen: Generation, rid: str, reply: Reply, prompt_tokens: int) -> bytes:
    content = [{"type": "text", "text": reply.content}] if reply.content else []
    content += [{"type": "tool_use", "id": tool_use_id(c), "name": c.name, "input": _input(c)} for c in reply.tool_calls]
    reason, sequence = _stop(reply)
    return _dumps({"id": f"msg_{rid}", "type": "message", "role": "assistant", "model": gen.model,
                   "content": content or [{"type": "text", "text": ""}], "stop_reason": reason,
                   "stop_sequence": sequence, "usage": _usage(reply, prompt_tokens)}).encode()


def _event(kind: str, data: dict) -> bytes:
    return f"event: {kind}\ndata: {_dumps({'type': kind, **data})}\n\n".encode()


class MessageEvents:
    """The event stream of one answer: message_start and a ping, then content blocks (text, tool_use),
    each content_block_start, its deltas (text_delta, input_json_delta) and content_block_stop, then
    message_delta (stop reason, usage) and message_stop."""

    def __init__(self, gen: Generation, rid: str, prompt_tokens: int):
        self.gen, self.rid, self.prompt_tokens = gen, rid, prompt_tokens
        self.index = -1
        self.open: str | None = None  # the kind of the open block

    def start(self) -> bytes:
        message = {"id": f"msg_{self.rid}", "type": "message", "role": "assistant", "model": self.gen.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.prompt_tokens, "cache_creation_input_tokens": 0,
                             "cache_read_input_tokens": 0, "output_tokens": 0}}
        return _event("message_start", {"message": message}) + _event("ping", {})

    def _block(self, kind: str, block: dict) -> bytes:
        out = self._close()
        self.index += 1
        self.open = kind
        return out + _event("content_block_start", {"index": self.index, "content_block": block})

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        self.open = None
        return _event("content_block_stop", {"index": self.index})

    def delta(self, d: Delta) -> bytes:
        out = b""
        if d.index is None:
            if self.open != "text":
                out = self._block("text", {"type": "text", "text": ""})
            return out + _event("content_block_delta", {"index": self.index, "delta": {"type": "text_delta", "text": d.content}})
        if d.id is not None:
            return self._block("tool_use", {"type": "tool_use", "id": tool_use_id(d), "name": d.name, "input": {}})
        return _event("content_block_delta", {"index": self.index,
                                              "delta": {"type": "input_json_delta", "partial_json": d.arguments}})

    def end(self, reply: Reply) -> bytes:
        out = self._block("text", {"type": "text", "text": ""}) if self.index < 0 else b""
        reason, sequence = _stop(reply)
        return out + self._close() + _event("message_delta", {
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": _usage(reply, self.prompt_tokens)}) + _event("message_stop", {})

    def error(self, problem: Problem) -> bytes:
        return b"event: error\ndata: " + error_body(problem.failure.http_status, problem.message) + b"\n\n"


# ---- errors and models ------------------------------------------------------------------------
def error_body(status: int, message: str, rid: str | None = None) -> bytes:
    body = {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}
    if rid:
        body["request_id"] = rid
    return _dumps(body).encode()


def error(problem: Problem, rid: str | None = None) -> tuple[int, bytes]:
    status = problem.failure.http_status
    return status, error_body(status, problem.message, rid)


def model_card(name: str, created: int) -> dict:
    return {"type": "model", "id": name, "display_name": name,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))}


def models_body(names: tuple[str, ...], created: int) -> bytes:
    cards = [model_card(n, created) for n in names]
    return _dumps({"data": cards, "has_more": False, "first_id": names[0] if names else None,
                   "last_id": names[-1] if names else None}).encode()


class MessagesDialect:
    """Anthropic's Messages API, as the edge runs a dialect (app.py)."""

    path = PATH
    translate = staticmethod(translate)
    answer = staticmethod(message_body)
    events = MessageEvents

    @staticmethod
    def error(problem: Problem, rid: str | None = None) -> tuple[int, bytes]:
        return error(problem, rid)

