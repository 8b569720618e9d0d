"""What the engine streams back for a request, and the per-sequence state the output processor makes it with."""

from __future__ import annotations

from dataclasses import dataclass, field

from .request import FinishReason
from .stopping import StopStringMatcher


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0  # prompt tokens the prefix cache supplied at admission
    draft_tokens: int = 0  # speculative drafts verified for this request (from its prompt, output or prediction)
    accepted_draft_tokens: int = 0  # of which the model agreed with (each saved a step)


@dataclass(frozen=True)
class Timings:
    queue_seconds: float  # arrival -> first scheduled
    time_to_first_token_seconds: float  # arrival -> first token sampled
    total_seconds: float  # arrival -> finish


@dataclass(frozen=True)
class GenerationChunk:
    """A streamed piece: new text and token ids; the last chunk also carries finish_reason, usage, timings."""

    request_id: str
    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    error: str | None = None  # set with FinishReason.ERROR: a message safe to show a caller
    matched_stop: str | None = None  # with FinishReason.STOP: the stop string that matched

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class GenerationResult:
    """All chunks of one request folded together."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    error: str | None = None
    matched_stop: str | None = None

    def add(self, chunk: GenerationChunk) -> None:
        self.text += chunk.text
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs
        if chunk.finished:
            self.finish_reason, self.usage, self.timings, self.error, self.matched_stop = (
                chunk.finish_reason, chunk.usage, chunk.timings, chunk.error, chunk.matched_stop)


def merge_chunks(first: GenerationChunk, later: GenerationChunk) -> GenerationChunk:
    """One chunk carrying both, in order: text and token ids concatenated, logprobs kept per token;
    the finish fields come from the later one (only a stream's last chunk has them)."""
    return GenerationChunk(request_id=later.request_id, text=first.text + later.text,
                           token_ids=first.token_ids + later.token_ids, logprobs=first.logprobs + later.logprobs,
                           finish_reason=later.finish_reason, usage=later.usage, timings=later.timings,
                           error=later.error, matched_stop=later.matched_stop)


@dataclass
class OutputState:
    """A sequence's output state (Sequence.output), made on its first token."""

    detokenizer: object  # lmserve.model.text.detokenizer: the incremental detokenizer for its tokenizer
    stops: StopStringMatcher
    matched_stop: str | None = field(default=None)  # with FinishReason.STOP: the stop string that matched
