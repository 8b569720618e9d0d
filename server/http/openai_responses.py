"""Engine output -> OpenAI response bodies and SSE events (chat.completion[.chunk], text_completion).

The streamed events are built from pre-encoded pieces: per chunk only its text (and log-probabilities,
when asked for) is JSON-encoded, so a stream costs little more than gRPC's per-message encoding.
Log-probability objects need each token's text: `logprobs_of` decodes them and runs on a worker thread.
"""

from __future__ import annotations

import json
import re

from ..edge_errors import Problem
from ..engine.outputs import TokenLogprob, Usage
from ..engine.request import FinishReason
from .errors import error_body
from ..tools.parser import CallParser, Delta, ParsedCall
from .openai_requests import OpenAIRequest
from .reply import Ending, ending

FINISH = {FinishReason.EOS: "stop", FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}
_ENDINGS = {Ending.END: "stop", Ending.STOP: "stop", Ending.LENGTH: "length", Ending.CALLS: "tool_calls"}
DONE = b"data: [DONE]\n\n"
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def usage_of(usage: Usage | None) -> dict | None:
    if usage is None:
        return None
    out = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
           "total_tokens": usage.prompt_tokens + usage.completion_tokens,
           "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens}}
    if usage.draft_tokens:  # OpenAI's predicted-output counts: here every verified draft, whatever its source
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": usage.accepted_draft_tokens,
            "rejected_prediction_tokens": usage.draft_tokens - usage.accepted_draft_tokens}
    return out


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_surface(tokenizer, token_id: int) -> tuple[str, bytes]:
    """What one token adds to the text, as (text, bytes): the vocabulary's bytes where they do not depend
    on context (byte-level BPE), else its piece with sentencepiece's word-boundary mark as a space.
    A special token (the end-of-turn that ends an answer, say) adds nothing to the text: ""."""
    if token_id in tokenizer.special_ids or token_id in tokenizer.eos_ids:
        return "", b""
    table = tokenizer.token_bytes
    if table is not None and 0 <= token_id < len(table):
        raw = table[token_id]
        return raw.decode("utf-8", errors="replace"), raw
    piece = tokenizer.id_to_token(token_id) or ""
    byte = _BYTE_PIECE.fullmatch(piece)
    if byte:
        raw = bytes([int(byte.group(1), 16)])
        return raw.decode("utf-8", errors="replace"), raw
    text = piece.replace("\u2581", " ")
    return text, text.encode("utf-8")


def logprobs_of(tokenizer, lps: list[TokenLogprob], chat: bool, offset: int = 0) -> dict:
    """The choice's `logprobs` object for these tokens (chat: `content` list; completions: parallel lists).
    `offset`: characters of completion text before these tokens (completions' text_offset)."""
    def dec(ids: list[int]) -> str:
        return token_surface(tokenizer, ids[0])[0]

    if chat:
        def entry(token_id: int, logprob: float) -> dict:
            text, raw = token_surface(tokenizer, token_id)
            return {"token": text, "logprob": logprob, "bytes": list(raw)}

        return {"content": [dict(entry(lp.token_id, lp.logprob), top_logprobs=[entry(t, v) for t, v in lp.top])
                            for lp in lps]}
    tokens, offsets = [], []
    for lp in lps:
        tokens.append(dec([lp.token_id]))
        offsets.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{dec([t]): v for t, v in lp.top} for lp in lps], "text_offset": offsets}


def finish_name(finish: FinishReason, calls: CallParser | None = None) -> str:
    """OpenAI's finish_reason: `tool_calls` where the answer ended after complete calls (or at a repeat)."""
    return _ENDINGS[ending(finish, calls)]


def choice_body(req: OpenAIRequest, index: int, text: str, finish: FinishReason, logprobs: dict | None,
                calls: CallParser | None = None) -> dict:
    """One choice of a whole response; `calls`: a chat answer's text read for calls (it replaces `text`)."""
    if calls is not None:
        message = {"role": "assistant", "content": calls.content or (None if calls.calls else "")}
        if calls.calls:
            message["tool_calls"] = [call_body(c) for c in calls.calls]
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_name(finish, calls)}
    if req.chat:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": FINISH.get(finish, "stop")}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": FINISH.get(finish, "stop")}


def call_body(call: ParsedCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def completion_body(req: OpenAIRequest, rid: str, created: int, choices: list[dict], usage: Usage | None) -> bytes:
    """A whole (not streamed) response."""
    return _dumps({"id": response_id(req, rid), "object": "chat.completion" if req.chat else "text_completion",
                   "created": created, "model": req.model, "choices": choices, "usage": usage_of(usage)}).encode()


def total_usage(usages: list[Usage], prompt: Usage | None = None) -> Usage:
    """The usage of n samples of one prompt: the prompt counted once (`prompt`: the request that computed
    it for them to share, when there was one), the completions' tokens and drafts summed."""
    first = usages[0]
    if len(usages) == 1:
        return first
    return Usage(prompt_tokens=first.prompt_tokens, completion_tokens=sum(u.completion_tokens for u in usages),
                 cached_prompt_tokens=(prompt or first).cached_prompt_tokens,
                 draft_tokens=sum(u.draft_tokens for u in usages),
                 accepted_draft_tokens=sum(u.accepted_draft_tokens for u in usages))


def response_id(req: OpenAIRequest, rid: str) -> str:
    return f"{'chatcmpl' if req.chat else 'cmpl'}-{rid}"


class StreamEvents:
    """The SSE events of one streamed response, each `data: {...}\\n\\n` as bytes."""

    def __init__(self, req: OpenAIRequest, rid: str, created: int):
        self.req = req
        obj = "chat.completion.chunk" if req.chat else "text_completion"
        self._head = (f'data: {{"id":{_dumps(response_id(req, rid))},"object":"{obj}","created":{created},'
                      f'"model":{_dumps(req.model)},"choices":[')
        self._tail = ('],"usage":null}\n\n' if req.include_usage else ']}\n\n')
        self._text_key = '"delta":{"content":' if req.chat else '"text":'
        self._text_end = '}' if req.chat else ''

    def role(self, index: int = 0) -> bytes:
        """Chat's first event of a choice: the assistant's role, no content yet."""
        return (f'{self._head}{{"index":{index},"delta":{{"role":"assistant","content":""}},"logprobs":null,'
                f'"finish_reason":null}}{self._tail}').encode()

    def piece(self, text: str, logprobs: dict | None = None, finish: FinishReason | None = None,
              index: int = 0) -> bytes:
        """New text of a choice (with its log-probabilities), and the finish reason on its last one."""
        fr = "null" if finish is None else f'"{FINISH.get(finish, "stop")}"'
        lp = "null" if logprobs is None else _dumps(logprobs)
        return (f'{self._head}{{"index":{index},{self._text_key}{_dumps(text)}{self._text_end},"logprobs":{lp},'
                f'"finish_reason":{fr}}}{self._tail}').encode()

    def delta(self, delta: Delta, logprobs: dict | None = None, index: int = 0) -> bytes:
        """A chat choice's content or tool-call delta (OpenAI's delta.tool_calls: a call's index, id, type and
        name first, then pieces of its arguments)."""
        if delta.index is None:
            return self.piece(delta.content, logprobs, None, index)
        if delta.id is not None:
            call = {"index": delta.index, "id": delta.id, "type": "function",
                    "function": {"name": delta.name, "arguments": ""}}
        else:
            call = {"index": delta.index, "function": {"arguments": delta.arguments}}
        return (f'{self._head}{{"index":{index},"delta":{{"tool_calls":[{_dumps(call)}]}},'
                f'"logprobs":{"null" if logprobs is None else _dumps(logprobs)},"finish_reason":null}}{self._tail}').encode()

    def finish(self, reason: str, index: int = 0) -> bytes:
        """A choice's last event: no new text, its finish_reason."""
        return f'{self._head}{{"index":{index},"delta":{{}},"logprobs":null,"finish_reason":"{reason}"}}{self._tail}'.encode()

    def usage(self, usage: Usage | None) -> bytes:
        """With stream_options.include_usage: a last event with no choices and the usage."""
        return (self._head + '],"usage":' + _dumps(usage_of(usage)) + '}\n\n').encode()


def error_event(problem: Problem) -> bytes:
    """An error after the stream started: sent as an event (then [DONE]); the status is already 200."""
    return b"data: " + error_body(problem.failure, problem.message, problem.param) + b"\n\n"
