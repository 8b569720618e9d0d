"""Client input -> engine request, with every limit checked before the work it bounds: one path for both edges.

Each edge turns its request into a `GenerateInput` (gRPC: `GenerateInput.from_proto`, O(1), it only
refers to the message's fields; HTTP: server/http/openai_requests.py, on a worker thread), then
`precheck_generate` and `InputConverter.generate_request` check and convert it the same way for both.
Field names in violations are the proto's (`params.max_new_tokens`); an edge may rename them.

`precheck_*` only look at sizes (O(1), or O(messages) after the message count is capped) and may run
on the event loop. Everything whose cost a client chooses (tokenizing, rendering a chat template,
validating token ids, decoding ids for Tokenize and log-probabilities) is in `InputConverter`, whose
methods the edges run on their worker threads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Sequence

from lmserve.model.text.chat_template import ChatTemplateError, NoChatTemplateError
from lmserve.model.text.tokenizer import Tokenizer
from lmserve.v1 import lmserve_pb2 as pb

from .engine.constraints import Constraint, ConstraintLimits
from .tools import ToolCall, ToolUse
from .tools.grammar import generation_schema, tool_grammar
from .tools.prompt import SpecialText, renders_tools, template_input
from .tools.spec import TAIL, TRIGGER
from .engine.request import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, Request, RequestValidationError, SamplingParams

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
MAX_MESSAGES = 256
MAX_REQUEST_ID_CHARS = 128
CHARS_PER_CONTEXT_TOKEN = 32  # the default character cap: far more text than the context can hold
CONSTRAINT_LIMITS = ConstraintLimits()


@dataclass(frozen=True)
class InputLimits:
    max_input_chars: int  # a prompt, a Tokenize text, one message content, all contents of a request
    max_prompt_tokens: int  # context length - 1
    max_messages: int = MAX_MESSAGES
    max_request_id_chars: int = MAX_REQUEST_ID_CHARS

    @classmethod
    def for_context(cls, context_length: int, max_input_chars: int | None = None) -> "InputLimits":
        return cls(max_input_chars=max_input_chars or CHARS_PER_CONTEXT_TOKEN * context_length,
                   max_prompt_tokens=context_length - 1)


@dataclass(frozen=True)
class ChatTurn:
    """One chat message (pb.ChatMessage, which has the first two fields, is accepted wherever this is):
    an assistant's calls, or the id of the call a `tool` message answers."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


@dataclass(frozen=True)
class InputParams:
    """Sampling parameters as a client gave them; None (or 0 for max_new_tokens) means "unset"."""

    max_new_tokens: int = 0  # 0: the server's default, shortened to what the cap and the context leave
    temperature: float = 0.0
    top_k: int = 0
    top_p: float | None = None  # None: 1.0
    min_p: float = 0.0
    repetition_penalty: float | None = None  # None: 1.0 (off)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    speculate: bool = True  # False: this request opts out of speculative decoding
    prediction: str = ""  # text the output is expected to repeat (a source of speculative drafts); "" for none
    # the output constraint as sent: (kind, its text / True / the choice's strings), None for free text;
    # held by reference (O(1)) and built into a Constraint on a worker thread
    constraint: tuple[str, object] | None = None
    logit_bias: Sequence[tuple[int, float]] = ()  # (token id, value added to its logit)

    @classmethod
    def from_proto(cls, p: pb.SamplingParams) -> "InputParams":
        return cls(max_new_tokens=p.max_new_tokens, temperature=p.temperature, top_k=p.top_k,
                   top_p=p.top_p if p.top_p != 0 else None, min_p=p.min_p,
                   repetition_penalty=p.repetition_penalty if p.repetition_penalty != 0 else None,
                   presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                   seed=p.seed if p.HasField("seed") else None, stop=p.stop, stop_token_ids=p.stop_token_ids,
                   ignore_eos=p.ignore_eos, logprobs=p.logprobs if p.HasField("logprobs") else None,
                   speculate=not p.disable_speculation, prediction=p.prediction, constraint=_proto_constraint(p))


def _proto_constraint(p: pb.SamplingParams) -> tuple[str, object] | None:
    kind = p.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not p.json_object):  # json_object = false sets none
        return None
    return kind, (p.choice.options if kind == "choice" else getattr(p, kind))


def build_constraint(sent: tuple[str, object] | None) -> Constraint | None:
    """InputParams.constraint -> the engine's Constraint (parses a schema's JSON: a worker thread's job)."""
    if sent is None:
        return None
    kind, value = sent
    if kind == "json_object":
        return Constraint.json_object()
    if kind == "choice":
        return Constraint.choice(value)
    return {"json_schema": Constraint.json_schema, "regex": Constraint.regex, "grammar": Constraint.grammar}[kind](value)


@dataclass(frozen=True)
class GenerateInput:
    """What to generate from, edge-neutral: exactly one of prompt, token_ids and messages is set."""

    prompt: str | None = None
    token_ids: Sequence[int] | None = None
    messages: Sequence[ChatTurn] | None = None
    params: InputParams = field(default_factory=InputParams)
    request_id: str = ""
    parse_special_tokens: bool = False
    tools: ToolUse | None = None  # the functions the model may call (chat only)
    adapter: str = ""  # the LoRA adapter chosen (its name); "": the base model

    @property
    def kind(self) -> str | None:
        """The input field that is set (prompt, token_ids or messages), or None."""
        for name in ("prompt", "token_ids", "messages"):
            if getattr(self, name) is not None:
                return name
        return None

    @classmethod
    def from_proto(cls, req: pb.GenerateRequest) -> "GenerateInput":
        """O(1): refers to the message's repeated fields, copies none of them."""
        kind = req.WhichOneof("input")
        return cls(prompt=req.prompt if kind == "prompt" else None,
                   token_ids=req.token_ids.ids if kind == "token_ids" else None,
                   messages=req.messages.messages if kind == "messages" else None,
                   params=InputParams.from_proto(req.params), request_id=req.request_id,
                   parse_special_tokens=req.parse_special_tokens, adapter=req.adapter)


def request_id_violations(rid: str, limits: InputLimits) -> list[tuple[str, str]]:
    """The id is echoed in every message and written to logs: short, printable ASCII only."""
    if len(rid) > limits.max_request_id_chars:
        return [("request_id", f"at most {limits.max_request_id_chars} characters, got {len(rid)}")]
    if not (rid.isascii() and rid.isprintable()):
        return [("request_id", "must be printable ASCII (no control characters or line breaks)")]
    return []


def _messages_violations(msgs: Sequence[ChatTurn], field: str, limits: InputLimits) -> list[tuple[str, str]]:
    n = len(msgs)
    if n == 0:
        return [(field, "must hold at least one message")]
    if n > limits.max_messages:
        return [(field, f"at most {limits.max_messages} messages, got {n}")]
    v, total, cap = [], 0, limits.max_input_chars
    for i, m in enumerate(msgs):
        if m.role not in CHAT_ROLES:
            v.append((f"{field}[{i}].role", f"must be one of {sorted(CHAT_ROLES)}, got {m.role[:32]!r}"))
        size = len(m.content)
        total += size
        if size > cap:
            v.append((f"{field}[{i}].content", f"at most {cap} characters, got {size}"))
    if total > cap and not v:
        v.append((field, f"the message contents hold {total} characters together; at most {cap}"))
    return v


def _params_violations(p: InputParams, limits: InputLimits) -> list[tuple[str, str]]:
    v = []
    if len(p.prediction) > limits.max_input_chars:
        v.append(("params.prediction", f"at most {limits.max_input_chars} characters, got {len(p.prediction)}"))
    if len(p.stop) > MAX_STOP_STRINGS:
        v.append(("params.stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(p.stop)}"))
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        v.append(("params.stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(p.stop_token_ids)}"))
    if p.constraint is not None:  # sizes only; the content is checked on a worker thread
        kind, value = p.constraint
        if kind == "choice":
            if len(value) > CONSTRAINT_LIMITS.max_choices:
                v.append(("params.choice.options", f"at most {CONSTRAINT_LIMITS.max_choices} strings, got {len(value)}"))
        elif kind != "json_object":
            cap = CONSTRAINT_LIMITS.max_regex_chars if kind == "regex" else CONSTRAINT_LIMITS.max_source_chars
            if len(value) > cap:
                v.append((f"params.{kind}", f"at most {cap} characters, got {len(value)}"))
    return v


def precheck_generate(req: GenerateInput, limits: InputLimits) -> None:
    """Size limits of a request, checked before any work; raises RequestValidationError."""
    v = request_id_violations(req.request_id, limits)
    kind = req.kind
    if kind == "prompt":
        if not req.prompt:
            v.append(("prompt", "must not be empty"))
        elif len(req.prompt) > limits.max_input_chars:
            v.append(("prompt", f"at most {limits.max_input_chars} characters, got {len(req.prompt)}"))
    elif kind == "token_ids":
        n = len(req.token_ids)
        if n > limits.max_prompt_tokens:
            v.append(("token_ids", f"has {n} tokens; at most {limits.max_prompt_tokens} fit the context "
                                   "with room to generate"))
    elif kind == "messages":
        v += _messages_violations(req.messages, "messages", limits)
    else:
        v.append(("input", "set one of prompt, token_ids or messages"))
    v += _params_violations(req.params, limits)
    if v:
        raise RequestValidationError(v)


def precheck_tokenize(req: pb.TokenizeRequest, limits: InputLimits) -> None:
    kind = req.WhichOneof("input")
    v = []
    if kind == "text":
        if len(req.text) > limits.max_input_chars:
            v.append(("text", f"at most {limits.max_input_chars} characters, got {len(req.text)}"))
    elif kind == "messages":
        v += _messages_violations(req.messages.messages, "messages", limits)
    else:
        v.append(("input", "set one of text or messages"))
    if v:
        raise RequestValidationError(v)


class InputConverter:
    """The client-sized work of the edge; every method is meant for a worker thread."""

    def __init__(self, tokenizer: Tokenizer, engine):
        self.tokenizer = tokenizer
        self.engine = engine
        self._native_tools: bool | None = None

    @property
    def template_renders_tools(self) -> bool:
        """Whether the chat template renders tools itself (else server/tools/prompt.py's fallback does)."""
        if self._native_tools is None:
            self._native_tools = renders_tools(self.tokenizer.apply_chat_template)
        return self._native_tools

    def _chat(self, msgs: Sequence[ChatTurn], field: str, add_generation_prompt: bool = True,
              tools: ToolUse | None = None) -> tuple[list[int], str]:
        variables = {}
        if tools is None and not any(getattr(m, "tool_calls", ()) or getattr(m, "tool_call_id", None) for m in msgs):
            messages = [{"role": m.role, "content": m.content} for m in msgs]
        else:
            try:
                messages, variables = template_input(msgs, tools, self.template_renders_tools,
                                                     self.tokenizer.has_special_text)
            except SpecialText as exc:
                raise RequestValidationError([(exc.field, str(exc))]) from None
        try:
            return self.tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt, **variables)
        except NoChatTemplateError as exc:
            raise RequestValidationError([(field, str(exc))]) from None
        except ChatTemplateError as exc:  # the checkpoint's template refused the conversation (raise_exception)
            raise RequestValidationError([(field, f"the model's chat template rejected these messages: {exc}")]) from None

    def _tool_constraint(self, use: ToolUse, sent: tuple[str, object] | None):
        """The compiled constraint of a request offering tools: each function's schema compiled alone first
        (a failure names tools[i].function.parameters), then the grammar of the calls (None under `none`,
        where a response_format's constraint applies as without tools)."""
        compiler = self.engine.constraints
        for i, tool in enumerate(use.tools):
            try:
                compiler.compile(Constraint.json_schema(generation_schema(tool.schema, use.choice in ("auto", "none"))))
            except RequestValidationError as exc:
                raise RequestValidationError([(f"tools[{i}].function.parameters", d) for _, d in exc.violations]) from None
        if not use.calls_allowed:
            return None
        answer = None
        if sent is not None and sent[0] in ("json_schema", "json_object"):  # the alternative to calls under auto
            try:
                compiler.compile(build_constraint(sent))
            except RequestValidationError as exc:
                raise RequestValidationError([(f"params.{f}", d) for f, d in exc.violations]) from None
            answer = json.loads(sent[1]) if sent[0] == "json_schema" else {"type": "object"}
        try:
            return compiler.compile(Constraint.grammar(tool_grammar(use, answer)))
        except RequestValidationError as exc:
            raise RequestValidationError([("tools", d) for _, d in exc.violations]) from None

    def _params(self, p: InputParams, prompt_len: int) -> SamplingParams:
        s = self.engine.settings
        # unset max_new_tokens: the server default, shortened to what the cap and the context leave
        default = max(1, min(s.default_max_new_tokens, s.max_new_tokens_cap, self.engine.max_model_len - prompt_len))
        return SamplingParams(
            max_new_tokens=p.max_new_tokens or default,
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=1.0 if p.top_p is None else p.top_p,
            min_p=p.min_p,
            repetition_penalty=1.0 if p.repetition_penalty is None else p.repetition_penalty,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            seed=p.seed,
            stop=tuple(p.stop),
            stop_token_ids=frozenset(p.stop_token_ids),
            ignore_eos=p.ignore_eos,
            logprobs=p.logprobs,
            speculate=p.speculate,
            # plain text (never control tokens), as the answer would spell it
            prediction=tuple(self.tokenizer.encode(p.prediction, parse_special=False)) if p.prediction else (),
            constraint=build_constraint(p.constraint),
            logit_bias=tuple(p.logit_bias),
        )

    def prompt_ids(self, req: GenerateInput) -> list[int]:
        """The prompt's token ids: the text tokenized, or the chat rendered with its tools."""
        if req.kind == "prompt":
            return self.tokenizer.encode(req.prompt, add_special_tokens=True, parse_special=req.parse_special_tokens)
        if req.kind == "token_ids":
            return list(req.token_ids)
        return self._chat(req.messages, "messages", tools=req.tools)[0]

    def generate_request(self, req: GenerateInput, engine_id: str, deadline: float | None,
                         origin: str = "") -> Request:
        """The engine Request of a prechecked input; RequestValidationError names proto fields."""
        kind = req.kind
        ids = self.prompt_ids(req)
        compiled = self._tool_constraint(req.tools, req.params.constraint) if req.tools is not None else None
        params = self._params(req.params, len(ids))
        if compiled is not None:  # several calls allowed: one that would repeat an earlier one ends the answer
            params = replace(params, constraint=compiled.constraint,
                             repeat_marker=() if req.tools.one_call else (TRIGGER, TAIL))
        request = Request(prompt_ids=ids, params=params, request_id=engine_id, deadline=deadline, origin=origin,
                          adapter=req.adapter)
        try:
            return self.engine.validate(request, compiled)  # a ValidRequest: the engine does not check it again
        except RequestValidationError as exc:  # name fields as the proto does
            raise RequestValidationError([(_field_path(f, kind), d) for f, d in exc.violations]) from None

    def tokenize(self, req: pb.TokenizeRequest) -> pb.TokenizeResponse:
        if req.WhichOneof("input") == "messages":
            ids, _ = self._chat(req.messages.messages, "messages", req.add_generation_prompt)
        else:
            ids = self.tokenizer.encode(req.text, add_special_tokens=True, parse_special=req.parse_special_tokens)
        tokens = [self.tokenizer.id_to_token(i) or "" for i in ids]
        return pb.TokenizeResponse(token_ids=ids, tokens=tokens, text=self.tokenizer.decode(ids))

    def logprobs(self, chunk_lps) -> list[pb.TokenLogprob]:
        dec = self.tokenizer.decode
        return [pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, text=dec([lp.token_id]),
                                top=[pb.TopLogprob(token_id=t, logprob=v, text=dec([t])) for t, v in lp.top])
                for lp in chunk_lps]


def _field_path(name: str, input_field: str) -> str:
    if name in ("prompt", "token_ids"):
        return input_field
    if name == "request_id":
        return name
    return f"params.{name}"
