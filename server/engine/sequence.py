"""A request's life inside the engine: its slot, what is cached, what it has generated."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .request import FinishReason, Request


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request: Request
    status: SeqStatus = SeqStatus.WAITING
    slot: int | None = None
    num_cached: int = 0  # tokens whose K/V are in the cache
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    first_scheduled: float | None = None
    first_token: float | None = None
    state: dict = field(default_factory=dict)  # per-request state owned by the runner/processor (generator, detokenizer)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def total_len(self) -> int:
        return self.prompt_len + len(self.output_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_cached < self.prompt_len

    def token_at(self, i: int) -> int:
        return self.request.prompt_ids[i] if i < self.prompt_len else self.output_ids[i - self.prompt_len]
