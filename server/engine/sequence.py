"""A request's life inside the engine: its slot, what is cached, what it has generated."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .request import FinishReason, Request

if TYPE_CHECKING:
    from .constraints.state import ConstraintState
    from .ngram import NgramProposer
    from .outputs import OutputState
    from .repeat_probe import RepeatProbe
    from .sampler import SamplingState


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """The scheduler owns the lifecycle fields (status, slot, what is cached, the tokens, timings);
    each later layer keeps its own per-request state in one typed field it creates and reads."""

    request: Request
    status: SeqStatus = SeqStatus.WAITING
    slot: int | None = None
    num_cached: int = 0  # tokens whose K/V are in the cache
    resume_len: int = 0  # after a preemption: prompt + output tokens to prefill again before sampling
    output_ids: list[int] = field(default_factory=list)
    # tokens sampled by launched steps and not read back yet (overlapped steps: up to 2 for a moment),
    # and the newest one's row in its step's sampled tokens (the next decode reads its input there)
    pending: int = 0
    pending_row: int | None = None
    finish_reason: FinishReason | None = None
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token_time: float | None = None  # when the latest token was recorded (inter-token gaps)
    cached_prompt_tokens: int = 0  # prompt tokens the prefix cache supplied at first admission (usage)
    sampling: "SamplingState | None" = None  # the sampler's: seeded generator, penalty tallies
    output: "OutputState | None" = None  # the output processor's: detokenizer, stop matcher
    draft: "NgramProposer | None" = None  # the scheduler's: n-gram index for speculative drafts
    constraint: "ConstraintState | None" = None  # constrained decoding's matcher, made at the first sampled step
    repeats: "RepeatProbe | None" = None  # the output processor's (made with `output`): parts of a repeat_marker
    lora: tuple[int, int] | None = None  # (slot, uid) of its adapter while admitted (adapters.AdapterPool.acquire)
    # the prompt's length and the request's id, read by every step's scheduling and output processing
    prompt_len: int = field(init=False)
    request_id: str = field(init=False)

    def __post_init__(self):
        self.prompt_len = len(self.request.prompt_ids)
        self.request_id = self.request.request_id

    @property
    def total_len(self) -> int:
        return self.prompt_len + len(self.output_ids)

    @property
    def prefill_len(self) -> int:
        """Tokens to cache before the next sample: the prompt, or everything so far after a preemption."""
        return max(self.prompt_len, self.resume_len)

    @property
    def out_of_tokens(self) -> bool:
        """Its recorded and in-flight tokens are all that max_new_tokens allows."""
        return len(self.output_ids) + self.pending >= self.request.params.max_new_tokens

    @property
    def in_prefill(self) -> bool:
        return self.num_cached < self.prefill_len

    @property
    def all_tokens(self) -> list[int]:
        return self.request.prompt_ids + self.output_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        p = self.request.prompt_ids
        if end <= len(p):
            return p[start:end]
        return (p + self.output_ids)[start:end]

    def token_at(self, i: int) -> int:
        return self.request.prompt_ids[i] if i < self.prompt_len else self.output_ids[i - self.prompt_len]
