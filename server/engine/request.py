"""What a caller asks the engine for: sampling parameters and a request, validated in one place."""

from __future__ import annotations

import enum
import itertools
import math
import time
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, ClassVar

from .constraints.spec import Constraint
from .errors import RequestValidationError

if TYPE_CHECKING:
    from .constraints.compiler import CompiledConstraint

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
# a predicted output's tokens: the engine thread indexes them at the request's first draft (~1.4 us a token on
# a 2-core EPYC, a pause of every stream's step like a 4,096-token prompt's)
MAX_PREDICTION_TOKENS = 4096
# Temperatures in (0, GREEDY_TEMPERATURE) decode greedily: dividing logits by less can overflow to
# inf and turn the softmax into NaN. Repetition penalties are clamped to REPETITION_PENALTY_RANGE
# for the same reason. Both are normalized when SamplingParams is built, so nothing downstream
# ever sees the extreme value.
GREEDY_TEMPERATURE = 1e-5
REPETITION_PENALTY_RANGE = (0.01, 100.0)
MAX_ABS_ADDITIVE_PENALTY = 2.0
# logit_bias: token ids biased per request, and the bias's range (OpenAI's: -100 bans a token, 100 all but forces it)
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_ABS_LOGIT_BIAS = 100.0

_ids = itertools.count(1)


class FinishReason(str, enum.Enum):
    LENGTH = "length"  # max_new_tokens reached
    EOS = "eos"  # an end-of-sequence token (or a stop token id)
    STOP = "stop"  # a stop string matched
    CANCELLED = "cancelled"
    DEADLINE = "deadline"
    ERROR = "error"
    SHUTDOWN = "shutdown"  # the engine stopped before the request finished (retryable elsewhere)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters. temperature 0 is greedy."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # (0, 1]
    min_p: float = 0.0  # [0, 1)
    repetition_penalty: float = 1.0  # > 0; 1 = off (divides positive logits of seen tokens)
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()  # any iterable is accepted and held as a set
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; 0: the chosen token's; n: plus the top n (n <= 20)
    speculate: bool = True  # False: never verify drafted tokens for this request (the output is the same)
    prediction: tuple[int, ...] = ()  # tokens the output is expected to repeat: a source of drafts (ngram.py)
    constraint: Constraint | None = None  # the output's shape (constraints/spec.py); None: free text
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, value added to its logit), applied like a mask
    # (text that begins a part of the output, text that ends it): a tool call's trigger and closing tag. Where
    # a greedy row would write an ended part again word for word, the output ends where that repeat begins
    # (repeat_probe.py); (): off
    repeat_marker: tuple[str, str] | tuple[()] = ()

    def __post_init__(self):
        if 0 < self.temperature < GREEDY_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        lo, hi = REPETITION_PENALTY_RANGE
        if math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0:
            object.__setattr__(self, "repetition_penalty", min(max(self.repetition_penalty, lo), hi))
        if not isinstance(self.stop_token_ids, frozenset):
            object.__setattr__(self, "stop_token_ids", frozenset(self.stop_token_ids))
        if not isinstance(self.prediction, tuple):
            object.__setattr__(self, "prediction", tuple(self.prediction))
        if not isinstance(self.logit_bias, tuple):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias))

    def violations(self, vocab_size: int | None = None, max_new_tokens_cap: int | None = None) -> list[tuple[str, str]]:
        v: list[tuple[str, str]] = []

        def bad(name, msg):
            v.append((name, msg))

        if self.max_new_tokens < 1:
            bad("max_new_tokens", f"must be at least 1, got {self.max_new_tokens}")
        elif max_new_tokens_cap is not None and self.max_new_tokens > max_new_tokens_cap:
            bad("max_new_tokens", f"must be at most {max_new_tokens_cap}, got {self.max_new_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            bad("top_k", f"must be >= 0 (0 disables it), got {self.top_k}")
        if not (0 < self.top_p <= 1):
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not (0 <= self.min_p < 1):
            bad("min_p", f"must be in [0, 1), got {self.min_p}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty", f"must be > 0 (1 disables it), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            val = getattr(self, name)
            if not (-MAX_ABS_ADDITIVE_PENALTY <= val <= MAX_ABS_ADDITIVE_PENALTY):
                bad(name, f"must be in [-{MAX_ABS_ADDITIVE_PENALTY:g}, {MAX_ABS_ADDITIVE_PENALTY:g}], got {val}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            bad("seed", f"must be in [0, 2^63), got {self.seed}")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for i, s in enumerate(self.stop):
            if not s:
                bad(f"stop[{i}]", "must not be empty")
            elif len(s) > MAX_STOP_STRING_CHARS:
                bad(f"stop[{i}]", f"at most {MAX_STOP_STRING_CHARS} characters, got {len(s)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} distinct ids, got {len(self.stop_token_ids)}")
        else:
            outside = sorted(t for t in self.stop_token_ids if t < 0 or (vocab_size is not None and t >= vocab_size))
            if outside:
                bad("stop_token_ids", f"{len(outside)} id(s) outside the vocabulary [0, {vocab_size}), e.g. {outside[0]}")
        if len(self.prediction) > MAX_PREDICTION_TOKENS:
            bad("prediction", f"at most {MAX_PREDICTION_TOKENS} tokens, got {len(self.prediction)}")
        elif any(t < 0 or (vocab_size is not None and t >= vocab_size) for t in self.prediction):
            bad("prediction", f"holds ids outside the vocabulary [0, {vocab_size or 'vocab size'})")
        v += self._logit_bias_violations(vocab_size)
        if self.logprobs is not None and not (0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.constraint is not None and self.ignore_eos:
            bad("ignore_eos", f"cannot be combined with a constraint ({self.constraint.field}): the output ends "
                              "where the constraint is complete")
        return v

    def _logit_bias_violations(self, vocab_size: int | None) -> list[tuple[str, str]]:
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            return [("logit_bias", f"at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(self.logit_bias)}")]
        for token, value in self.logit_bias:
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                return [("logit_bias", f"token id {token} is outside the vocabulary [0, {vocab_size or 'vocab size'})")]
            if not (math.isfinite(value) and abs(value) <= MAX_ABS_LOGIT_BIAS):
                return [("logit_bias", f"the bias of token {token} must be in [-{MAX_ABS_LOGIT_BIAS:g}, "
                                       f"{MAX_ABS_LOGIT_BIAS:g}], got {value}")]
        return []


@dataclass
class Request:
    """A prompt (as token ids) and how to continue it."""

    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    deadline: float | None = None  # time.monotonic() after which the request is abandoned
    arrival: float = field(default_factory=time.monotonic)
    origin: str = ""  # which edge sent it ("grpc", "http"): a metrics label, nothing in the engine reads it
    adapter: str = ""  # the LoRA adapter the request chose by name (adapters.py); "": the base model
    compiled: ClassVar[None] = None  # not compiled yet: a ValidRequest carries its constraint compiled

    def validate(self, vocab_size: int, max_context: int, max_new_tokens_cap: int | None = None) -> None:
        """Raise RequestValidationError listing every bad field."""
        v: list[tuple[str, str]] = []
        n = len(self.prompt_ids)
        if n == 0:
            v.append(("prompt", "must not be empty"))
        elif n >= max_context:
            v.append(("prompt", f"has {n} tokens; the context holds {max_context}, leaving no room to generate"))
        elif n + self.params.max_new_tokens > max_context:
            v.append(("max_new_tokens", f"prompt ({n} tokens) + max_new_tokens ({self.params.max_new_tokens}) "
                                        f"exceeds the context length {max_context}"))
        bad_ids = [t for t in self.prompt_ids if not (0 <= t < vocab_size)]
        if bad_ids:
            v.append(("token_ids", f"{len(bad_ids)} id(s) outside the vocabulary [0, {vocab_size}), e.g. {bad_ids[0]}"))
        v += self.params.violations(vocab_size, max_new_tokens_cap)
        if v:
            raise RequestValidationError(v)


@dataclass
class ValidRequest(Request):
    """A request checked against the served model by Engine.validate, its params.constraint compiled
    for it (on the edge's worker thread, off the engine thread): what the engine queues. A copy
    (dataclasses.replace) with another id or seed stays valid."""

    compiled: "CompiledConstraint | None" = field(default=None, repr=False)

    @classmethod
    def of(cls, request: Request, compiled: "CompiledConstraint | None") -> "ValidRequest":
        return cls(**{f.name: getattr(request, f.name) for f in fields(request)}, compiled=compiled)
