"""OpenAI request bodies -> the edge-neutral GenerateInput of inputs.py (the path gRPC takes too).

`parse_body` and `translate` run on the Frontend's worker threads: parsing JSON, walking messages
and checking types are work whose size the client chooses. Only types, OpenAI's documented ranges and
the translation's own constraints are checked here; values are checked by the shared path (inputs.py,
the engine). The compatibility policy (docs/openai-api.md): a known parameter is translated, accepted
because it cannot change the output (`user`, `metadata`, ...), or refused with a 400 that names it; a
top-level field this server does not know is ignored and its name logged once (`FieldPolicy`), or
refused with --strict-openai-fields.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from ..inputs import ChatTurn, GenerateInput, InputParams
from ..tools import ToolCall, ToolUse
from .errors import OpenAINames
from .translate import (BodyError, FieldPolicy, History, Reader, ToolSet, check_model, json_type, or_default,
                        parse_body, strings)

__all__ = ["BodyError", "FieldPolicy", "OpenAIRequest", "check_model", "parse_body", "translate"]

# OpenAI's default for /v1/completions when max_tokens is left out (chat leaves it to the server)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# Accepted as given and not acted on: they cannot change what is generated (hints for caching, routing
# and abuse tracking on OpenAI's side).
NO_EFFECT = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "prompt_cache_retention",
                       "safety_identifier"})
# Known OpenAI parameters this server does not implement; each is a 400 naming it unless null/default.
UNSUPPORTED = frozenset({"functions", "function_call", "audio", "modalities",
                         "reasoning_effort", "web_search_options", "echo", "suffix", "best_of", "verbosity"})
_HARMLESS_DEFAULTS = {"echo": False, "best_of": 1, "functions": []}
_WHY_NOT = {"functions": "is the deprecated form of tools", "function_call": "is the deprecated form of tool_choice",
            "reasoning_effort": "applies to reasoning models; the model served here does not reason",
            "verbosity": "applies to reasoning models; the model served here does not reason"}
# Chat roles the chat template knows; "developer" is OpenAI's newer name for "system".
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
_MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "refusal"})
# message fields OpenAI defines that this server cannot take (unless null)
_MESSAGE_REFUSED = frozenset({"function_call", "audio"})
_TOOL_CHOICE = "must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}"
# OpenAI's documented ranges; lmserve's own (temperature: any finite value >= 0, as over gRPC) with
# the extension field `lmserve_ranges: true`
MAX_OPENAI_TEMPERATURE = 2.0
# choices per request (n) at most, as OpenAI allows; the engine's --max-batch may allow fewer
MAX_CHOICES = 128


@dataclass(frozen=True)
class OpenAIRequest:
    """A translated request: what to generate and how to answer (stream, usage, logprobs)."""

    chat: bool
    model: str
    input: GenerateInput
    names: OpenAINames
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False  # return log-probabilities (chat: logprobs true; completions: logprobs set)
    user: str | None = None  # also a conversation key for load balancers (deploy/nginx)
    n: int = 1  # choices: samples of the same prompt

    @property
    def reads_calls(self) -> bool:
        """Whether the answer may hold tool calls, to be read out of its text."""
        return self.input.tools is not None and self.input.tools.calls_allowed


def translate(body: dict, chat: bool, fields: FieldPolicy | None = None) -> OpenAIRequest:
    """A parsed body of /v1/chat/completions (chat) or /v1/completions -> OpenAIRequest.

    The fields are read in a fixed order, so that a body with several faults is always refused for the
    same one."""
    fields = fields or FieldPolicy()
    r = Reader(body)
    model = r.get("model", str, required=True)
    _refuse_unsupported(body)
    max_name, max_tokens = _max_tokens(r, chat)
    stop = _stop(r.get("stop", (str, list)))
    want_logprobs, logprobs = _logprobs(r, chat)
    n = or_default(r.get("n", int, low=1, high=MAX_CHOICES), 1)
    constraint = _response_format(r.get("response_format", dict))
    stream, include_usage = _streaming(r)
    r.get("user", str)
    params = _params(r, chat, max_tokens, stop, logprobs, constraint)
    inp = _chat_input(r, params, fields) if chat else _prompt_input(r, params)
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    fields.unknown(sorted(body.keys() - r.seen - UNSUPPORTED - NO_EFFECT), endpoint)
    return OpenAIRequest(chat=chat, model=model, input=inp, names=OpenAINames(chat, max_name), stream=stream,
                         include_usage=include_usage, logprobs=want_logprobs, user=body.get("user"), n=n)


def _refuse_unsupported(body: dict) -> None:
    """A 400 naming the first known parameter this server does not implement, unless null or its default."""
    for name in sorted(UNSUPPORTED & body.keys()):
        value = body[name]
        if value is not None and _HARMLESS_DEFAULTS.get(name, object()) != value:
            raise BodyError(name, _WHY_NOT.get(name, "is not supported by this server"))


def _max_tokens(r: Reader, chat: bool) -> tuple[str, int | None]:
    """The name the client used for the token limit (answers name it too) and the limit: None leaves it to
    the server (chat); completions default to OpenAI's 16."""
    body = r.body
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = r.get(max_name, int, low=1)
    if max_name == "max_completion_tokens" and body.get("max_tokens") is not None:
        raise BodyError("max_tokens", "set max_tokens or max_completion_tokens, not both")
    r.seen.update(("max_tokens", "max_completion_tokens"))
    if not chat and max_tokens is None:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    return max_name, max_tokens


def _stop(stop: str | list | None) -> tuple[str, ...]:
    """stop: one string or a list of them -> a tuple of stop strings."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    return tuple(strings(stop, "stop"))


def _logprobs(r: Reader, chat: bool) -> tuple[bool, int | None]:
    """Whether to answer with log-probabilities, and how many alternatives per token (None: no logprobs).
    Chat asks with logprobs: true and top_logprobs: k; completions with logprobs: k."""
    if not chat:
        logprobs = r.get("logprobs", int)
        return logprobs is not None, logprobs
    want = bool(r.get("logprobs", bool))
    top = r.get("top_logprobs", int)
    if top is not None and not want:
        raise BodyError("top_logprobs", "needs logprobs: true")
    return want, (top or 0) if want else None


def _streaming(r: Reader) -> tuple[bool, bool]:
    """stream, and stream_options.include_usage (only allowed when streaming)."""
    stream = bool(r.get("stream", bool))
    options = r.get("stream_options", dict)
    if options is not None and not stream:
        raise BodyError("stream_options", "is only allowed with stream: true")
    return stream, bool(Reader(options or {}, "stream_options.").get("include_usage", bool))


def _temperature_top_p(r: Reader) -> tuple[float, float | None]:
    """temperature (OpenAI's range unless lmserve_ranges: true) and top_p; top_p 0 means greedy decoding.
    The lower bounds are the engine's own (one message for both edges)."""
    wide = bool(r.get("lmserve_ranges", bool))
    temperature = or_default(r.get("temperature", float, high=None if wide else MAX_OPENAI_TEMPERATURE,
                            beyond="; lmserve_ranges: true accepts more"), 1.0)  # OpenAI's default is 1
    top_p = r.get("top_p", float)
    if top_p == 0.0:  # only the most likely token
        return 0.0, None
    return temperature, top_p


def _params(r: Reader, chat: bool, max_tokens: int | None, stop: tuple[str, ...], logprobs: int | None,
            constraint: tuple[str, object] | None) -> InputParams:
    """The sampling and stopping parameters; their values' ranges (and the penalties') are the engine's
    to check."""
    temperature, top_p = _temperature_top_p(r)
    return InputParams(
        max_new_tokens=max_tokens or 0,
        temperature=temperature,
        top_p=top_p,
        seed=r.get("seed", int),
        stop=stop,
        presence_penalty=or_default(r.get("presence_penalty", float), 0.0),
        frequency_penalty=or_default(r.get("frequency_penalty", float), 0.0),
        logprobs=logprobs,
        top_k=or_default(r.get("top_k", int), 0),
        min_p=or_default(r.get("min_p", float), 0.0),
        repetition_penalty=r.get("repetition_penalty", float),
        ignore_eos=bool(r.get("ignore_eos", bool)),
        stop_token_ids=tuple(_ints(r.get("stop_token_ids", list) or [], "stop_token_ids")),
        speculate=or_default(r.get("speculate", bool), True),
        prediction=_prediction(r.get("prediction", dict)) if chat else "",
        constraint=constraint,
        logit_bias=_logit_bias(r.get("logit_bias", dict)),
    )


def _chat_input(r: Reader, params: InputParams, fields: FieldPolicy) -> GenerateInput:
    """messages, tools, tool_choice and parallel_tool_calls of a chat body."""
    tools = _tool_use(r.get("tools", list), r.body.get("tool_choice"), r.get("parallel_tool_calls", bool))
    r.seen.add("tool_choice")
    return GenerateInput(messages=_messages(r.get("messages", list, required=True), fields), params=params,
                         tools=tools)


def _prompt_input(r: Reader, params: InputParams) -> GenerateInput:
    """The prompt of a completions body; tools are a chat matter."""
    for name in ("tools", "tool_choice"):
        if r.body.get(name) not in (None, []):
            raise BodyError(name, "is served on /v1/chat/completions, not here")
    r.seen.update(("prompt", "tools", "tool_choice", "parallel_tool_calls"))
    return _completion_input(r.body.get("prompt"), params)


def _response_format(fmt: dict | None) -> tuple[str, object] | None:
    """response_format -> the constraint as sent (inputs.InputParams.constraint): None for text."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object", True
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise BodyError("response_format.json_schema.schema", "must be a JSON schema object")
        return "json_schema", json.dumps(spec["schema"])
    raise BodyError("response_format.type", f"must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def _logit_bias(bias: dict | None) -> tuple[tuple[int, float], ...]:
    """{"token id": bias} -> ((id, bias), ...); the ids' and values' ranges are the engine's to check."""
    if not bias:
        return ()
    out = []
    for key, value in bias.items():
        if not (key.isascii() and key.lstrip("-").isdigit()):
            raise BodyError("logit_bias", f"keys must be token ids (integers, as strings), got {key[:32]!r}")
        if type(value) not in (int, float) or not math.isfinite(value):
            raise BodyError("logit_bias", f"the bias of token {key} must be a number, got {json_type(value)}")
        out.append((int(key), float(value)))
    return tuple(out)


def _prediction(prediction: dict | None) -> str:
    """A predicted output ({"type": "content", "content": text or text parts}) -> its text; "" for none."""
    if prediction is None:
        return ""
    if prediction.get("type") != "content" or sorted(prediction.keys()) != ["content", "type"]:
        raise BodyError("prediction", 'must be {"type": "content", "content": ...}')
    return _content(prediction["content"], "prediction.content", "user")


def _tool_use(tools: list | None, choice, parallel: bool | None) -> ToolUse | None:
    """tools, tool_choice and parallel_tool_calls -> ToolUse; None when no tools are offered."""
    tools = tools or []
    found = ToolSet(len(tools), "tools")
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            raise BodyError(f"{where}.type", "must be 'function' (the only kind of tool served)")
        f = t.get("function")
        if not isinstance(f, dict):
            raise BodyError(f"{where}.function", f"must be an object, got {json_type(f)}")
        r = Reader(f, f"{where}.function.")
        r.get("name", str, required=True)
        r.get("strict", bool)  # calls always follow the schema here
        found.add(f["name"], r.get("description", str), r.get("parameters", dict), f"{where}.function.name")
    parallel = or_default(parallel, True)
    if choice is None or choice in ("none", "auto", "required"):
        return found.use(choice or "auto", parallel=parallel)
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(choice.get("function"), dict):
        if not found.tools:
            raise BodyError("tool_choice", "needs tools to choose from")
        raise BodyError("tool_choice", _TOOL_CHOICE)
    return found.use("function", choice["function"].get("name"), parallel, "tool_choice.function.name")


def _tool_calls(raw, where: str) -> tuple[ToolCall, ...]:
    """An assistant message's tool_calls -> ToolCalls (arguments as JSON text)."""
    if not isinstance(raw, list):
        raise BodyError(where, f"must be an array, got {json_type(raw)}")
    calls = []
    for j, c in enumerate(raw):
        at = f"{where}[{j}]"
        if not isinstance(c, dict) or not isinstance(c.get("function"), dict):
            raise BodyError(at, 'must be {"id": ..., "type": "function", "function": {"name": ..., "arguments": ...}}')
        call_id = Reader(c, f"{at}.").get("id", str, required=True)
        f = Reader(c["function"], f"{at}.function.")
        arguments = c["function"].get("arguments")
        if isinstance(arguments, dict):  # some clients send the object itself
            arguments = json.dumps(arguments, ensure_ascii=False)
        elif not isinstance(arguments, str):
            raise BodyError(f"{at}.function.arguments", f"must be a string of JSON, got {json_type(arguments)}")
        calls.append(ToolCall(call_id, f.get("name", str, required=True), arguments))
    return tuple(calls)


def _messages(raw: list, fields: FieldPolicy) -> list[ChatTurn]:
    history = History()
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BodyError(where, f"must be an object, got {json_type(m)}")
        extra = sorted(m.keys() - _MESSAGE_KEYS)
        if extra:
            refused = [k for k in extra if k in _MESSAGE_REFUSED and m[k] is not None]
            if refused:
                raise BodyError(f"{where}.{refused[0]}", "is not supported by this server")
            fields.unknown([f"{where}.{k}" for k in extra if k not in _MESSAGE_REFUSED], "a chat message")
        role = m.get("role")
        if role not in _ROLES:
            raise BodyError(f"{where}.role", f"must be one of {sorted(_ROLES)}, got {str(role)[:32]!r}")
        if role == "tool":
            call_id = Reader(m, f"{where}.").get("tool_call_id", str, required=True)
            history.result(call_id, _content(m.get("content"), f"{where}.content", role), f"{where}.tool_call_id")
            continue
        calls = ()
        if role == "assistant" and m.get("tool_calls") is not None:
            calls = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
        history.say(_ROLES[role], _content(m.get("content"), f"{where}.content", role), calls)
    return history.turns


def _content(content, where: str, role: str) -> str:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BodyError(f"{where}[{j}]", "only text parts ({\"type\": \"text\", \"text\": ...}) are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise BodyError(where, f"must be a string or a list of text parts, got {json_type(content)}")


def _completion_input(prompt, params: InputParams) -> GenerateInput:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return GenerateInput(prompt=prompt, params=params)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return GenerateInput(token_ids=prompt, params=params)
    if prompt is None:
        raise BodyError("prompt", "is required")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise BodyError("prompt", "one prompt per request: send a string or a list of token ids")
    raise BodyError("prompt", "must be a non-empty string or a list of token ids")


def _ints(values: list, name: str) -> list[int]:
    for i, v in enumerate(values):
        if type(v) is not int:
            raise BodyError(f"{name}[{i}]", f"must be an integer, got {json_type(v)}")
    return values
