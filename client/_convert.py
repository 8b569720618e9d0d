"""Conversion between SDK values and lmserve.v1 protobuf messages.

The single place where requests are built and responses parsed; the sync and asyncio
clients both call into it and differ only in how they perform I/O.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lmserve.v1 import lmserve_pb2 as pb

from .types import (
    ChatMessage,
    GenerationResult,
    ModelInfo,
    SamplingParams,
    StreamChunk,
    Timing,
    TokenizeResult,
    TokenLogprob,
    TopLogprob,
    Usage,
)

_FINISH_PREFIX = "FINISH_REASON_"
_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


# ---------------------------------------------------------------- requests


def resolve_params(params: SamplingParams | None, overrides: Mapping[str, Any]) -> SamplingParams:
    """Applies keyword overrides (``temperature=0.7``) on top of ``params`` or the defaults."""
    unknown = set(overrides) - _SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
    base = params if params is not None else SamplingParams()
    return dataclasses.replace(base, **overrides) if overrides else base


def params_to_proto(params: SamplingParams) -> pb.SamplingParams:
    """SDK sampling parameters -> lmserve.v1.SamplingParams (neutral values stay zero)."""
    msg = pb.SamplingParams(
        max_new_tokens=params.max_new_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        # 1.0 is the neutral value; the proto spells "unset" as 0.
        top_p=0.0 if params.top_p == 1.0 else params.top_p,
        min_p=params.min_p,
        repetition_penalty=0.0 if params.repetition_penalty == 1.0 else params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        disable_speculation=not params.speculate,
        prediction=params.prediction,
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.json_schema is not None:
        msg.json_schema = params.json_schema
    elif params.json_object:
        msg.json_object = True
    elif params.regex is not None:
        msg.regex = params.regex
    elif params.grammar is not None:
        msg.grammar = params.grammar
    elif params.choice is not None:
        msg.choice.options.extend(params.choice)
    return msg


def params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """lmserve.v1.SamplingParams -> SDK sampling parameters (zeros read as defaults)."""
    return SamplingParams(
        max_new_tokens=msg.max_new_tokens,
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p or 1.0,
        min_p=msg.min_p,
        repetition_penalty=msg.repetition_penalty or 1.0,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        speculate=not msg.disable_speculation,
        prediction=msg.prediction,
        **_constraint_from_proto(msg),
    )


def _constraint_from_proto(msg: pb.SamplingParams) -> dict[str, Any]:
    kind = msg.WhichOneof("constraint")
    if kind == "choice":
        return {"choice": tuple(msg.choice.options)}
    return {kind: getattr(msg, kind)} if kind else {}


def to_chat_message(item: ChatMessage | Mapping[str, str] | Sequence[str]) -> ChatMessage:
    """Accepts a ChatMessage, a ``{"role", "content"}`` mapping or a ``(role, content)`` pair."""
    if isinstance(item, ChatMessage):
        return item
    if isinstance(item, Mapping):
        return ChatMessage(role=str(item["role"]), content=str(item["content"]))
    if isinstance(item, Sequence) and not isinstance(item, str) and len(item) == 2:
        return ChatMessage(role=str(item[0]), content=str(item[1]))
    raise TypeError(f"not a chat message: {item!r}")


def _messages_proto(items: Iterable[Any]) -> pb.ChatMessages:
    messages = [to_chat_message(m) for m in items]
    return pb.ChatMessages(messages=[pb.ChatMessage(role=m.role, content=m.content) for m in messages])


def _is_token_ids(items: Sequence[Any]) -> bool:
    return all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in items)


def build_generate_request(
    prompt: Any, params: SamplingParams, request_id: str = "", parse_special_tokens: bool = False
) -> pb.GenerateRequest:
    """Builds a GenerateRequest from a prompt string, a token id list or chat messages.

    An empty list is sent as empty token ids (the server rejects it as invalid).
    parse_special_tokens: read special-token text in a string prompt (e.g. "<|im_start|>") as
    those tokens; refused for token ids and messages, where it would mean nothing.
    """
    request = pb.GenerateRequest(request_id=request_id, params=params_to_proto(params))
    if parse_special_tokens and not isinstance(prompt, str):
        raise TypeError("parse_special_tokens applies to a text prompt only")
    if isinstance(prompt, str):
        request.prompt = prompt
        request.parse_special_tokens = parse_special_tokens
    elif isinstance(prompt, (bytes, bytearray)):
        raise TypeError("prompt must be str, a list of token ids or a list of chat messages, not bytes")
    elif isinstance(prompt, Sequence) and _is_token_ids(prompt):
        request.token_ids.ids.extend(int(t) for t in prompt)
    elif isinstance(prompt, Iterable):
        request.messages.CopyFrom(_messages_proto(prompt))
    else:
        raise TypeError(f"unsupported prompt type: {type(prompt).__name__}")
    return request


def build_tokenize_request(
    text: Any, add_generation_prompt: bool = True, parse_special_tokens: bool = False
) -> pb.TokenizeRequest:
    """Builds a TokenizeRequest from text or chat messages (parse_special_tokens: text only)."""
    if parse_special_tokens and not isinstance(text, str):
        raise TypeError("parse_special_tokens applies to text only")
    if isinstance(text, str):
        return pb.TokenizeRequest(text=text, parse_special_tokens=parse_special_tokens)
    if isinstance(text, Iterable) and not isinstance(text, (bytes, bytearray)):
        return pb.TokenizeRequest(messages=_messages_proto(text), add_generation_prompt=add_generation_prompt)
    raise TypeError(f"tokenize input must be str or chat messages, not {type(text).__name__}")


# ---------------------------------------------------------------- responses


def finish_reason_name(value: int) -> str | None:
    """FinishReason enum value -> "length", "eos", ...; None for UNSPECIFIED."""
    if value == pb.FINISH_REASON_UNSPECIFIED:
        return None
    try:
        name = pb.FinishReason.Name(value)
    except ValueError:  # a reason added to the proto after this SDK was built
        return f"unknown_{value}"
    return name[len(_FINISH_PREFIX):].lower()


def finish_reason_value(name: str) -> int:
    """Inverse of :func:`finish_reason_name`."""
    return pb.FinishReason.Value(_FINISH_PREFIX + name.upper())


def _logprobs(items: Iterable[pb.TokenLogprob]) -> list[TokenLogprob]:
    return [
        TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            text=lp.text,
            top=tuple(TopLogprob(token_id=t.token_id, logprob=t.logprob, text=t.text) for t in lp.top),
        )
        for lp in items
    ]


def _usage(msg: pb.GenerateResponse | pb.GenerateStreamResponse) -> Usage | None:
    if not msg.HasField("usage"):
        return None
    return Usage(prompt_tokens=msg.usage.prompt_tokens, completion_tokens=msg.usage.completion_tokens,
                 cached_prompt_tokens=msg.usage.cached_prompt_tokens, draft_tokens=msg.usage.draft_tokens,
                 accepted_draft_tokens=msg.usage.accepted_draft_tokens)


def _timing(msg: pb.GenerateResponse | pb.GenerateStreamResponse) -> Timing | None:
    if not msg.HasField("timing"):
        return None
    t = msg.timing
    return Timing(
        queue_seconds=t.queue_seconds,
        time_to_first_token_seconds=t.time_to_first_token_seconds,
        total_seconds=t.total_seconds,
    )


def parse_generate_response(msg: pb.GenerateResponse) -> GenerationResult:
    """GenerateResponse -> GenerationResult."""
    token_ids = list(msg.token_ids)
    return GenerationResult(
        request_id=msg.request_id,
        text=msg.text,
        token_ids=token_ids,
        finish_reason=finish_reason_name(msg.finish_reason) or "unspecified",
        usage=_usage(msg) or Usage(prompt_tokens=0, completion_tokens=len(token_ids)),
        logprobs=_logprobs(msg.logprobs),
        timing=_timing(msg),
        matched_stop=msg.matched_stop or None,
    )


def parse_stream_response(msg: pb.GenerateStreamResponse) -> StreamChunk:
    """GenerateStreamResponse -> StreamChunk."""
    return StreamChunk(
        request_id=msg.request_id,
        text=msg.text,
        token_ids=list(msg.token_ids),
        logprobs=_logprobs(msg.logprobs),
        finish_reason=finish_reason_name(msg.finish_reason),
        usage=_usage(msg),
        timing=_timing(msg),
        matched_stop=msg.matched_stop or None,
    )


def parse_tokenize_response(msg: pb.TokenizeResponse) -> TokenizeResult:
    """TokenizeResponse -> TokenizeResult."""
    return TokenizeResult(token_ids=list(msg.token_ids), tokens=list(msg.tokens), text=msg.text)


def parse_model_info(msg: pb.GetModelInfoResponse) -> ModelInfo:
    """GetModelInfoResponse -> ModelInfo."""
    return ModelInfo(
        model_name=msg.model_name,
        architecture=msg.architecture,
        context_length=msg.context_length,
        vocab_size=msg.vocab_size,
        dtype=msg.dtype,
        device=msg.device,
        eos_token_ids=list(msg.eos_token_ids),
        max_new_tokens_limit=msg.max_new_tokens_limit,
        max_batch_size=msg.max_batch_size,
        default_max_new_tokens=msg.default_max_new_tokens,
        bos_token_id=msg.bos_token_id if msg.HasField("bos_token_id") else None,
        has_chat_template=msg.has_chat_template,
        num_parameters=msg.num_parameters,
        server_version=msg.server_version,
        limits={f.name: getattr(msg.limits, f.name) for f in msg.limits.DESCRIPTOR.fields} if msg.HasField("limits")
        else {},
        quantization=msg.quantization,
        kernels=msg.kernels,
        precision_choice=msg.precision_choice,
        kv_cache_dtype=msg.kv_cache_dtype,
        kv_cache_choice=msg.kv_cache_choice,
        speculation=msg.speculation,
        speculation_verify_cost=msg.speculation_verify_cost if msg.HasField("speculation_verify_cost") else None,
    )


class StreamAccumulator:
    """Folds stream chunks into the GenerationResult the unary call would have returned."""

    def __init__(self) -> None:
        self.request_id = ""
        self._text: list[str] = []
        self._token_ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []
        self._last: StreamChunk | None = None

    def add(self, chunk: StreamChunk) -> None:
        self.request_id = chunk.request_id or self.request_id
        self._text.append(chunk.text)
        self._token_ids.extend(chunk.token_ids)
        self._logprobs.extend(chunk.logprobs)
        if chunk.is_last:
            self._last = chunk

    @property
    def finished(self) -> bool:
        return self._last is not None

    def result(self) -> GenerationResult:
        """The assembled result; raises ValueError if no final chunk was seen."""
        if self._last is None:
            raise ValueError("stream ended without a final chunk")
        last = self._last
        return GenerationResult(
            request_id=self.request_id,
            text="".join(self._text),
            token_ids=list(self._token_ids),
            finish_reason=last.finish_reason or "unspecified",
            usage=last.usage or Usage(prompt_tokens=0, completion_tokens=len(self._token_ids)),
            logprobs=list(self._logprobs),
            timing=last.timing,
            matched_stop=last.matched_stop,
        )
