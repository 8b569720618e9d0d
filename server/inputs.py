"""Client input -> engine request, with every limit checked before the work it bounds.

`precheck_*` run on the event loop and only look at sizes (O(1), or O(messages) after the message
count is capped). Everything whose cost a client chooses (tokenizing, rendering a chat template,
validating token ids, decoding ids for Tokenize and log-probabilities) is in `InputConverter`, whose
methods the service runs on its worker threads.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmserve.model.chat_template import ChatTemplateError
from lmserve.model.tokenizer import Tokenizer
from lmserve.v1 import lmserve_pb2 as pb

from .engine.request import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, Request, RequestValidationError, SamplingParams

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
MAX_MESSAGES = 256
MAX_REQUEST_ID_CHARS = 128
CHARS_PER_CONTEXT_TOKEN = 32  # the default character cap: far more text than the context can hold


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


def request_id_violations(rid: str, limits: InputLimits) -> list[tuple[str, str]]:
    """The id is echoed in every message and written to logs: short, printable ASCII only."""
    if len(rid) > limits.max_request_id_chars:
        return [("request_id", f"at most {limits.max_request_id_chars} characters, got {len(rid)}")]
    if not (rid.isascii() and rid.isprintable()):
        return [("request_id", "must be printable ASCII (no control characters or line breaks)")]
    return []


def _messages_violations(msgs: pb.ChatMessages, field: str, limits: InputLimits) -> list[tuple[str, str]]:
    n = len(msgs.messages)
    if n == 0:
        return [(field, "must hold at least one message")]
    if n > limits.max_messages:
        return [(field, f"at most {limits.max_messages} messages, got {n}")]
    v, total, cap = [], 0, limits.max_input_chars
    for i, m in enumerate(msgs.messages):
        if m.role not in CHAT_ROLES:
            v.append((f"{field}[{i}].role", f"must be one of {sorted(CHAT_ROLES)}, got {m.role[:32]!r}"))
        size = len(m.content)
        total += size
        if size > cap:
            v.append((f"{field}[{i}].content", f"at most {cap} characters, got {size}"))
    if total > cap and not v:
        v.append((field, f"the message contents hold {total} characters together; at most {cap}"))
    return v


def _params_violations(p: pb.SamplingParams) -> list[tuple[str, str]]:
    v = []
    if len(p.stop) > MAX_STOP_STRINGS:
        v.append(("params.stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(p.stop)}"))
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        v.append(("params.stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(p.stop_token_ids)}"))
    return v


def precheck_generate(req: pb.GenerateRequest, limits: InputLimits) -> None:
    """Size limits of a GenerateRequest, checked before any work; raises RequestValidationError."""
    v = request_id_violations(req.request_id, limits)
    kind = req.WhichOneof("input")
    if kind == "prompt":
        if not req.prompt:
            v.append(("prompt", "must not be empty"))
        elif len(req.prompt) > limits.max_input_chars:
            v.append(("prompt", f"at most {limits.max_input_chars} characters, got {len(req.prompt)}"))
    elif kind == "token_ids":
        n = len(req.token_ids.ids)
        if n > limits.max_prompt_tokens:
            v.append(("token_ids", f"has {n} tokens; at most {limits.max_prompt_tokens} fit the context "
                                   "with room to generate"))
    elif kind == "messages":
        v += _messages_violations(req.messages, "messages", limits)
    else:
        v.append(("input", "set one of prompt, token_ids or messages"))
    v += _params_violations(req.params)
    if v:
        raise RequestValidationError(v)


def precheck_tokenize(req: pb.TokenizeRequest, limits: InputLimits) -> None:
    kind = req.WhichOneof("input")
    v = []
    if kind == "text":
        if len(req.text) > limits.max_input_chars:
            v.append(("text", f"at most {limits.max_input_chars} characters, got {len(req.text)}"))
    elif kind == "messages":
        v += _messages_violations(req.messages, "messages", limits)
    else:
        v.append(("input", "set one of text or messages"))
    if v:
        raise RequestValidationError(v)


class InputConverter:
    """The client-sized work of the edge; every method is meant for a worker thread."""

    def __init__(self, tokenizer: Tokenizer, engine):
        self.tokenizer = tokenizer
        self.engine = engine

    def _chat(self, msgs: pb.ChatMessages, field: str, add_generation_prompt: bool = True) -> tuple[list[int], str]:
        messages = [{"role": m.role, "content": m.content} for m in msgs.messages]
        try:
            return self.tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt)
        except ChatTemplateError as exc:  # the checkpoint's template refused the conversation (raise_exception)
            raise RequestValidationError([(field, f"the model's chat template rejected these messages: {exc}")]) from None

    def _params(self, p: pb.SamplingParams, prompt_len: int) -> SamplingParams:
        s = self.engine.settings
        # unset max_new_tokens: the server default, shortened to what the cap and the context leave
        default = max(1, min(s.default_max_new_tokens, s.max_new_tokens_cap, self.engine.max_model_len - prompt_len))
        return SamplingParams(
            max_new_tokens=p.max_new_tokens or default,
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p if p.top_p != 0 else 1.0,
            min_p=p.min_p,
            repetition_penalty=p.repetition_penalty if p.repetition_penalty != 0 else 1.0,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            seed=p.seed if p.HasField("seed") else None,
            stop=tuple(p.stop),
            stop_token_ids=frozenset(p.stop_token_ids),
            ignore_eos=p.ignore_eos,
            logprobs=p.logprobs if p.HasField("logprobs") else None,
            speculate=not p.disable_speculation,
        )

    def generate_request(self, req: pb.GenerateRequest, engine_id: str, deadline: float | None) -> Request:
        """The engine Request of a prechecked GenerateRequest; RequestValidationError names proto fields."""
        kind = req.WhichOneof("input")
        if kind == "prompt":
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=True, parse_special=req.parse_special_tokens)
        elif kind == "token_ids":
            ids = list(req.token_ids.ids)
        else:
            ids, _ = self._chat(req.messages, "messages")
        request = Request(prompt_ids=ids, params=self._params(req.params, len(ids)), request_id=engine_id,
                          deadline=deadline)
        try:
            self.engine.validate(request)
        except RequestValidationError as exc:  # name fields as the proto does
            raise RequestValidationError([(_field_path(f, kind), d) for f, d in exc.violations]) from None
        return request

    def tokenize(self, req: pb.TokenizeRequest) -> pb.TokenizeResponse:
        if req.WhichOneof("input") == "messages":
            ids, _ = self._chat(req.messages, "messages", req.add_generation_prompt)
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
