"""Typed values of the lmserve SDK: sampling parameters in, results out.

These are plain dataclasses; the SDK converts them to and from the lmserve.v1 protobuf
messages, so callers never handle protobuf objects.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "ChatMessage",
    "SamplingParams",
    "Usage",
    "Timing",
    "TopLogprob",
    "TokenLogprob",
    "GenerationResult",
    "StreamChunk",
    "TokenizeResult",
    "ModelInfo",
    "FINISH_REASONS",
]

# The SamplingParams fields that constrain the output; a request sets at most one.
CONSTRAINT_FIELDS = ("json_schema", "json_object", "regex", "grammar", "choice")

# Finish reasons as the SDK spells them (lmserve.v1.FinishReason without its prefix).
FINISH_REASONS = ("length", "eos", "stop", "cancelled", "deadline", "error", "context_length")


@dataclass(frozen=True)
class ChatMessage:
    """One chat message: ``role`` is "system", "user" or "assistant"."""

    role: str
    content: str


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to pick tokens and when to stop; the defaults give greedy decoding.

    Attributes:
        max_new_tokens: most tokens to generate; 0 means the server default.
        temperature: softmax temperature; 0 means greedy (argmax).
        top_k: keep the k most likely tokens; 0 disables the filter.
        top_p: nucleus mass in (0, 1]; 1.0 disables the filter.
        min_p: drop tokens below ``min_p`` times the top probability; 0 disables it.
        repetition_penalty: multiplicative penalty on seen tokens; 1.0 disables it.
        presence_penalty: additive penalty, once per generated token id.
        frequency_penalty: additive penalty, per occurrence of a generated token id.
        seed: sampling seed; None means nondeterministic.
        stop: stop strings; the matched string is left out of the text.
        stop_token_ids: extra token ids that end generation.
        ignore_eos: keep generating past EOS tokens.
        logprobs: None for no log-probabilities, 0 for the chosen token's only,
            n > 0 to add the n most likely alternatives per position (with a constraint:
            the model's own, before the constraint's mask).
        speculate: False to opt out of the server's speculative decoding (the tokens are
            the same either way).
        prediction: text the output is expected to repeat (e.g. the file an edit rewrites):
            the server drafts from it as from the prompt; the tokens are the same either way.

    Constrained decoding (at most one; see docs/constrained-decoding.md):
        json_schema: the output is JSON valid under this schema (a dict, or its JSON text).
        json_object: the output is one JSON object.
        regex: the whole output matches this regular expression.
        grammar: the output derives from this Lark grammar's ``start`` rule.
        choice: the output is exactly one of these strings.
    """

    max_new_tokens: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    speculate: bool = True
    prediction: str = ""
    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        # Accept any iterable (a list, a single string) for the tuple fields.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.json_schema is not None and not isinstance(self.json_schema, str):  # a dict: held as JSON text
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema))
        if self.choice is not None:
            if isinstance(self.choice, str):
                raise TypeError("choice takes a list of strings, not one string")
            object.__setattr__(self, "choice", tuple(str(c) for c in self.choice))
        chosen = [name for name in CONSTRAINT_FIELDS if getattr(self, name) not in (None, False)]
        if len(chosen) > 1:
            raise ValueError(f"set at most one constraint; got {', '.join(chosen)}")


@dataclass(frozen=True)
class Usage:
    """Token counts of one request."""

    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0  # prompt tokens served from the server's prefix cache
    draft_tokens: int = 0  # speculative drafts the server verified for this request
    accepted_draft_tokens: int = 0  # of which the model agreed with

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Timing:
    """Server-measured seconds: queueing, time to first token, and total."""

    queue_seconds: float
    time_to_first_token_seconds: float
    total_seconds: float


@dataclass(frozen=True)
class TopLogprob:
    """An alternative token at one position and its log-probability."""

    token_id: int
    logprob: float
    text: str = ""


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability, with the most likely alternatives."""

    token_id: int
    logprob: float
    text: str = ""
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class GenerationResult:
    """A finished completion.

    ``finish_reason`` is one of :data:`FINISH_REASONS`; ``matched_stop`` names the stop
    string that ended generation, if any; ``timing`` is None when the server sent none.
    """

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    logprobs: list[TokenLogprob] = field(default_factory=list)
    timing: Timing | None = None
    matched_stop: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of every field."""
        return asdict(self)


@dataclass(frozen=True)
class StreamChunk:
    """One streamed piece of a completion.

    ``text`` and ``token_ids`` are deltas. ``finish_reason``, ``usage`` and ``timing``
    are None on every chunk but the last.
    """

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    timing: Timing | None = None
    matched_stop: str | None = None

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class TokenizeResult:
    """Token ids the model would see, their vocabulary pieces, and the text tokenized."""

    token_ids: list[int]
    tokens: list[str]
    text: str


@dataclass(frozen=True)
class ModelInfo:
    """The served model and the server's limits."""

    model_name: str
    architecture: str
    context_length: int
    vocab_size: int
    dtype: str
    device: str
    eos_token_ids: list[int]
    max_new_tokens_limit: int
    max_batch_size: int
    default_max_new_tokens: int
    bos_token_id: int | None
    has_chat_template: bool
    num_parameters: int
    server_version: str
    # Every limit the server applies (GetModelInfoResponse.limits), by its proto field name,
    # e.g. {"max_input_chars": 131072, "max_request_id_chars": 128, ...}; empty from older servers.
    limits: dict[str, float] = field(default_factory=dict)
    quantization: str = ""
    kernels: str = ""
    precision_choice: str = ""  # how the precision mode was chosen and why (GetModelInfoResponse.precision_choice)
    kv_cache_dtype: str = ""  # what the KV cache holds: the model's dtype or "int8"
    kv_cache_choice: str = ""  # why (GetModelInfoResponse.kv_cache_choice)
    speculation: str = ""  # speculative decoding as served and why (GetModelInfoResponse.speculation)
    # a step verifying a full draft over a plain decode step, as measured at start; None where not measured
    speculation_verify_cost: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of every field."""
        return asdict(self)

