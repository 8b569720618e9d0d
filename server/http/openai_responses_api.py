"""OpenAI's Responses API: `POST /v1/responses` bodies -> the shared translation (translate.py), and an
answer (reply.Reply) -> a response object with its output items (`message` with `output_text`,
`function_call`), or its stream of typed events. Errors are OpenAI's shape (errors.py), as on Chat
Completions. With `store` (the default) a response is kept (response_store.py) with its conversation, which
`previous_response_id` continues.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import replace

from ..edge_errors import EdgeError, Failure, Problem
from ..inputs import ChatTurn, GenerateInput, InputParams
from ..tools import ToolCall
from ..tools.parser import Delta
from .errors import render
from .openai_requests import MAX_OPENAI_TEMPERATURE, NO_EFFECT as CHAT_NO_EFFECT
from .openai_responses import error_event
from .reply import Ending, Reply
from .response_store import ResponseStore, Stored
from .translate import (BodyError, FieldNames, FieldPolicy, Generation, History, Reader, ToolSet,
                        json_schema_constraint, json_type, or_default)

PATH = "/v1/responses"
# Accepted and not acted on: hints for caching and routing, what to include of reasoning a model that does
# not reason never produces, and its reasoning settings.
NO_EFFECT = CHAT_NO_EFFECT | {"include", "reasoning", "max_tool_calls", "stream_options"}
# Known and not served: a 400 naming them unless null or their default.
UNSUPPORTED = {"background": False, "conversation": None, "prompt": None, "truncation": "disabled", "top_logprobs": 0}
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "refusal"})
_SKIPPED_ITEMS = frozenset({"reasoning"})
NAMES = FieldNames(("params.max_new_tokens", "max_output_tokens"), ("params.json_schema", "text.format.schema"),
                   ("params.json_object", "text.format"), ("tools[].function.parameters", "tools[].parameters"),
                   ("messages*", "input"), ("prompt", "input"), ("token_ids", "input"))
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


class ResponsesDialect:
    """The Responses API as the edge runs a dialect (app.py), over a store of responses."""

    path = PATH

    def __init__(self, store: ResponseStore):
        self.store = store

    # ---- requests -------------------------------------------------------------------------
    def translate(self, body: dict, fields: FieldPolicy) -> Generation:
        r = Reader(body)
        model = r.get("model", str, required=True)
        for name, default in sorted(UNSUPPORTED.items()):
            if body.get(name) not in (None, default):
                raise BodyError(name, "is not supported by this server")
        params = InputParams(
            max_new_tokens=r.get("max_output_tokens", int, low=1) or 0,
            temperature=or_default(r.get("temperature", float, high=MAX_OPENAI_TEMPERATURE), 1.0),
            top_p=r.get("top_p", float, high=1.0),
            constraint=_text_format(r.get("text", dict)))
        if params.top_p == 0.0:  # only the most likely token, as on Chat Completions
            params = replace(params, temperature=0.0, top_p=None)
        tools, namespaces = _tools(r.get("tools", list) or [], body.get("tool_choice"), r.get("parallel_tool_calls", bool),
                                   fields)
        r.seen.add("tool_choice")
        instructions = r.get("instructions", str)
        previous = r.get("previous_response_id", str)
        history = History()  # the conversation as stored: `instructions` are this response's alone
        if previous is not None:
            stored = self.store.get(previous)
            if stored is None:
                raise EdgeError(Failure.NOT_FOUND, f"no stored response {previous[:80]!r} (unknown, expired or not "
                                                   "stored)", param="previous_response_id")
            history.resume(stored.turns)
        _input(body.get("input"), history, required=previous is None)
        history.close()
        turns = list(history.turns)
        if instructions and turns and turns[0].role == "system":
            turns[0] = ChatTurn("system", f"{instructions}\n\n{turns[0].content}")
        elif instructions:
            turns.insert(0, ChatTurn("system", instructions))
        r.seen.add("input")
        stream = bool(r.get("stream", bool))
        store = or_default(r.get("store", bool), True)
        metadata = r.get("metadata", dict)
        fields.unknown(sorted(body.keys() - r.seen - NO_EFFECT - UNSUPPORTED.keys()), PATH)
        echo = {"id": "resp_" + secrets.token_hex(16), "instructions": instructions, "previous_response_id": previous,
                "store": store, "metadata": metadata or {}, "tools": body.get("tools") or [],
                "tool_choice": body.get("tool_choice") or "auto", "parallel_tool_calls": tools is None or tools.parallel,
                "temperature": params.temperature, "top_p": or_default(params.top_p, 1.0),
                "max_output_tokens": params.max_new_tokens or None,
                "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
                "user": body.get("user"), "history": tuple(history.turns), "namespaces": namespaces}
        return Generation(model, GenerateInput(messages=turns, params=params, tools=tools), NAMES, stream, echo)

    # ---- answers --------------------------------------------------------------------------
    def answer(self, gen: Generation, rid: str, reply: Reply, prompt_tokens: int) -> bytes:
        body = self._finished(gen, reply, _output(reply, f"msg_{rid}", gen.echo["namespaces"]))
        return _dumps(body).encode()

    def events(self, gen: Generation, rid: str, prompt_tokens: int) -> "ResponseEvents":
        return ResponseEvents(self, gen, rid)

    @staticmethod
    def error(problem: Problem, rid: str | None = None) -> tuple[int, bytes]:
        return render(problem)

    def _finished(self, gen: Generation, reply: Reply, output: list[dict]) -> dict:
        """The response of a finished answer, stored (with its conversation) where asked."""
        body = response_body(gen, "incomplete" if reply.ending is Ending.LENGTH else "completed", output, reply)
        if gen.echo["store"]:
            said = ChatTurn("assistant", reply.content,
                            tuple(ToolCall(c.id, c.name, c.arguments) for c in reply.tool_calls if c.complete))
            self.store.put(body["id"], Stored(body, gen.echo["history"] + (said,)))
        return body

    def stored(self, response_id: str) -> dict:
        found = self.store.get(response_id)
        if found is None:
            raise EdgeError(Failure.NOT_FOUND, f"no stored response {response_id[:80]!r} (unknown, expired or not "
                                               "stored)", param="response_id")
        return found.body


def response_body(gen: Generation, status: str, output: list[dict], reply: Reply | None = None) -> dict:
    echo = gen.echo
    usage = None
    if reply is not None and reply.usage is not None:
        u = reply.usage
        usage = {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
                 "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": u.prompt_tokens + u.completion_tokens}
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {"id": echo["id"], "object": "response", "created_at": int(time.time()), "status": status,
            "background": False, "error": None, "incomplete_details": incomplete, "instructions": echo["instructions"],
            "max_output_tokens": echo["max_output_tokens"], "model": gen.model, "output": output,
            "parallel_tool_calls": echo["parallel_tool_calls"], "previous_response_id": echo["previous_response_id"],
            "reasoning": {"effort": None, "summary": None}, "store": echo["store"], "temperature": echo["temperature"],
            "text": echo["text"], "tool_choice": echo["tool_choice"], "tools": echo["tools"], "top_p": echo["top_p"],
            "truncation": "disabled", "usage": usage, "user": echo["user"], "metadata": echo["metadata"]}


def _message_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = [] if status == "in_progress" else [_text_part(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed", namespaces: dict | None = None) -> dict:
    """A function_call item; a function of a namespace tool is named as the client named it, with its namespace."""
    item = {"type": "function_call", "id": "fc_" + call_id.removeprefix("call_"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}
    if namespaces and name in namespaces:
        item["namespace"], item["name"] = namespaces[name]
    return item


def _output(reply: Reply, message_id: str, namespaces: dict | None = None) -> list[dict]:
    """The output items: the text as a message (also when there is neither text nor a call), then the calls."""
    calls = [_call_item(c.id, c.name, c.arguments, namespaces=namespaces) for c in reply.tool_calls]
    return ([_message_item(message_id, reply.content)] if reply.content or not calls else []) + calls


class ResponseEvents:
    """The typed events of one streamed response, numbered: response.created and .in_progress, then for
    each output item output_item.added, its parts (content_part.added, output_text.delta ... .done,
    content_part.done; or function_call_arguments.delta ... .done) and output_item.done; then
    response.completed with the whole response (its status `incomplete` where the token limit struck)."""

    def __init__(self, dialect: ResponsesDialect, gen: Generation, rid: str):
        self.dialect, self.gen, self.message_id = dialect, gen, f"msg_{rid}"
        self.sequence = 0
        self.output: list[dict] = []  # the items done
        self.open: dict | None = None  # the item being written: its kind, id and text so far

    def _event(self, kind: str, **data) -> bytes:
        self.sequence += 1
        return f"event: {kind}\ndata: {_dumps({'type': kind, 'sequence_number': self.sequence - 1, **data})}\n\n".encode()

    def start(self) -> bytes:
        head = response_body(self.gen, "in_progress", [])
        return self._event("response.created", response=head) + self._event("response.in_progress", response=head)

    def _index(self) -> int:
        return len(self.output)

    def _open_message(self) -> bytes:
        self.open = {"kind": "message", "text": ""}
        at = dict(output_index=self._index(), item_id=self.message_id, content_index=0)
        return (self._event("response.output_item.added", output_index=self._index(),
                            item=_message_item(self.message_id, "", "in_progress"))
                + self._event("response.content_part.added", **at, part=_text_part("")))

    def _close(self) -> bytes:
        item, self.open = self.open, None
        if item is None:
            return b""
        i = self._index()
        if item["kind"] == "message":
            at = dict(output_index=i, item_id=self.message_id, content_index=0)
            done = _message_item(self.message_id, item["text"])
            out = (self._event("response.output_text.done", **at, text=item["text"], logprobs=[])
                   + self._event("response.content_part.done", **at, part=_text_part(item["text"])))
        else:
            done = _call_item(item["call_id"], item["name"], item["text"], namespaces=self.gen.echo["namespaces"])
            out = self._event("response.function_call_arguments.done", output_index=i, item_id=done["id"],
                              name=item["name"], arguments=item["text"])
        self.output.append(done)
        return out + self._event("response.output_item.done", output_index=i, item=done)

    def delta(self, d: Delta) -> bytes:
        out = b""
        if d.index is None:
            if self.open is None or self.open["kind"] != "message":
                out = self._close() + self._open_message()
            self.open["text"] += d.content
            return out + self._event("response.output_text.delta", output_index=self._index(), item_id=self.message_id,
                                     content_index=0, delta=d.content, logprobs=[])
        if d.id is not None:
            out = self._close()
            self.open = {"kind": "call", "call_id": d.id, "name": d.name, "text": ""}
            return out + self._event("response.output_item.added", output_index=self._index(),
                                     item=_call_item(d.id, d.name, "", "in_progress", self.gen.echo["namespaces"]))
        self.open["text"] += d.arguments
        return self._event("response.function_call_arguments.delta", output_index=self._index(),
                           item_id="fc_" + self.open["call_id"].removeprefix("call_"), delta=d.arguments)

    def end(self, reply: Reply) -> bytes:
        out = self._open_message() if self.open is None and not self.output else b""
        out += self._close()
        # a later call cut by the end of the text is no call (parser.CallParser.finish): as in the whole answer
        kept = {c.id for c in reply.tool_calls}
        self.output = [i for i in self.output if i["type"] != "function_call" or i["call_id"] in kept]
        body = self.dialect._finished(self.gen, reply, self.output)
        return out + self._event("response.completed", response=body)

    def error(self, problem: Problem) -> bytes:
        return error_event(problem)


# ---- the request's parts ---------------------------------------------------------------------
def _text_format(text: dict | None):
    """text.format -> the constraint as sent: None for plain text."""
    fmt = Reader(text or {}, "text.").get("format", dict)
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return "json_object", True
    if fmt.get("type") == "json_schema":
        return json_schema_constraint(fmt.get("schema"), "text.format.schema")
    raise BodyError("text.format.type", f"must be 'text', 'json_object' or 'json_schema', got {str(fmt.get('type'))[:40]!r}")


def _tools(raw: list, choice, parallel: bool | None, fields: FieldPolicy) -> tuple:
    """(ToolUse, namespaces): function tools, and those of namespace tools offered to the model as
    `<namespace>__<name>` (namespaces maps that name back). Tools the server would have to run itself (web
    search, file search, code interpreter, MCP, ...) are not offered, as an unknown field is not read: a 400
    under --strict-openai-fields, logged otherwise."""
    found, namespaces = ToolSet(len(raw), "tools"), {}

    def function(t, where: str, namespace: str | None = None) -> None:
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else json_type(t)
            raise BodyError(f"{where}.type", f"must be 'function', got {str(kind)[:40]!r}")
        r = Reader(t, f"{where}.")
        r.get("strict", bool)  # calls always follow the schema here
        name = t.get("name")
        if namespace is not None and isinstance(name, str):
            namespaces[f"{namespace}__{name}"] = (namespace, name)
            name = f"{namespace}__{name}"
        found.add(name, r.get("description", str), r.get("parameters", dict), f"{where}.name")

    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        kind = t.get("type") if isinstance(t, dict) else None
        if kind == "namespace":
            r = Reader(t, f"{where}.")
            namespace = r.get("name", str, required=True)
            for j, inner in enumerate(r.get("tools", list, required=True)):
                function(inner, f"{where}.tools[{j}]", namespace)
        elif isinstance(kind, str) and kind != "function":
            fields.unknown([f"{where} (a {kind[:40]} tool, which this server does not run)"], PATH)
        else:
            function(t, where)
    parallel = or_default(parallel, True)
    if choice is None or choice in ("none", "auto", "required"):
        return found.use(choice or "auto", parallel=parallel), namespaces
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if isinstance(choice.get("namespace"), str):
            name = f"{choice['namespace']}__{name}"
        return found.use("function", name, parallel, "tool_choice.name"), namespaces
    raise BodyError("tool_choice", "must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}")


def _input(raw, history: History, required: bool) -> None:
    """`input`: a string (the user's message) or items: messages, function_call and function_call_output;
    consecutive calls (and the assistant message before them) make one assistant turn."""
    if raw is None:
        if required:
            raise BodyError("input", "is required (or continue a stored response: previous_response_id)")
        return
    if isinstance(raw, str):
        history.say("user", raw)
        return
    if not isinstance(raw, list):
        raise BodyError("input", f"must be a string or an array of items, got {json_type(raw)}")
    said, calls = None, []  # the assistant turn being gathered

    def flush():
        nonlocal said, calls
        if said is not None or calls:
            history.say("assistant", said or "", tuple(calls))
        said, calls = None, []

    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise BodyError(where, f"must be an object, got {json_type(item)}")
        kind = item.get("type", "message")
        r = Reader(item, f"{where}.")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise BodyError(f"{where}.role", f"must be one of {sorted(_ROLES)}, got {str(role)[:32]!r}")
            text = _content(item.get("content"), f"{where}.content")
            flush()
            if role == "assistant":
                said = text
            elif _ROLES[role] == "system":  # the system turn at the start; a note to a user turn later
                history.system(text)
            else:
                history.say(_ROLES[role], text)
        elif kind == "function_call":
            arguments = r.get("arguments", str, required=True)
            name = r.get("name", str, required=True)
            if r.get("namespace", str):  # a function of a namespace tool, as offered to the model
                name = f"{item['namespace']}__{name}"
            calls.append(ToolCall(r.get("call_id", str, required=True), name, arguments))
        elif kind == "function_call_output":
            call_id = r.get("call_id", str, required=True)
            output = item.get("output")
            flush()
            history.result(call_id, output if isinstance(output, str) else _content(output, f"{where}.output"),
                           f"{where}.call_id")
        elif kind not in _SKIPPED_ITEMS:
            raise BodyError(f"{where}.type", "must be message, function_call, function_call_output or reasoning "
                                             f"(got {str(kind)[:40]!r})")
    flush()


def _content(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BodyError(where, f"must be a string or an array of text parts, got {json_type(content)}")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise BodyError(f"{where}[{j}].type", f"only text parts (input_text, output_text) are served, got {str(kind)[:40]!r}")
        parts.append(Reader(part, f"{where}[{j}].").get("refusal" if kind == "refusal" else "text", str, required=True))
    return "".join(parts)
