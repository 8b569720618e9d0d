"""Continuous-batching scheduler: plain Python, no torch.

Each step runs every running sequence's next decode token, then spends what is left of the
token budget on prompt prefill: first the unfinished chunked prompts, then new requests in
arrival order while a KV slot is free. A long prompt is cut into chunks, so running streams
keep getting a token every step.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .request import FinishReason, Request
from .sequence import Sequence, SeqStatus
from .step_budget import StepBudget, prefill_budget


class QueueFullError(Exception):
    """The waiting queue is at its bound; the request was not accepted."""


@dataclass(frozen=True)
class PrefillChunk:
    seq: Sequence
    start: int  # first prompt position in this chunk (== tokens already cached)
    length: int

    @property
    def completes_prompt(self) -> bool:
        return self.start + self.length == self.seq.prompt_len


@dataclass
class ScheduledBatch:
    decode: list[Sequence] = field(default_factory=list)
    prefill: list[PrefillChunk] = field(default_factory=list)
    dropped: list[Sequence] = field(default_factory=list)  # finished without compute (deadline, cancel)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(c.length for c in self.prefill)

    def sampled(self) -> list[Sequence]:
        """Sequences that get a new token from this step, in the runner's logits order."""
        return [c.seq for c in self.prefill if c.completes_prompt] + list(self.decode)


class SlotAllocator:
    """Hands out the lowest free slot, or the highest one when asked, which keeps live slots dense
    at both ends (cache views stay small)."""

    def __init__(self, num_slots: int):
        self.capacity = num_slots
        self._free = list(range(num_slots))
        self.allocated_total = 0
        self.freed_total = 0

    @property
    def used(self) -> int:
        return self.capacity - len(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, from_top: bool = False) -> int | None:
        if not self._free:
            return None
        self.allocated_total += 1
        if not from_top:
            return heapq.heappop(self._free)
        top = max(self._free)
        self._free.remove(top)
        heapq.heapify(self._free)
        return top

    def free(self, slot: int) -> None:
        self.freed_total += 1
        heapq.heappush(self._free, slot)


class Scheduler:
    """`long_prompt`: prompts of at least this many tokens take the highest free slot and the others
    the lowest, so neighbouring slots hold requests of similar length and a decode step's attention
    calls over runs of neighbouring slots (model/attention_plan.py) read fewer keys for nothing.
    None: always the lowest.

    `step_budget`: sizes each step's prefill from measured step costs (step_budget.py) within
    [min_prefill_chunk, token_budget - decode rows]; None: always the upper bound."""

    def __init__(self, num_slots: int, max_queue: int, token_budget: int, min_prefill_chunk: int = 16,
                 clock: Callable[[], float] = time.monotonic, long_prompt: int | None = None,
                 step_budget: StepBudget | None = None):
        if token_budget < 1 or max_queue < 0:
            raise ValueError("token_budget must be >= 1 and max_queue >= 0")
        self.slots = SlotAllocator(num_slots)
        self.max_queue = max_queue
        self.token_budget = token_budget
        self.min_prefill_chunk = min_prefill_chunk
        self.clock = clock
        self.long_prompt = long_prompt
        self.step_budget = step_budget
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self._by_id: dict[str, Sequence] = {}

    # ---- intake ------------------------------------------------------------------
    def add(self, request: Request) -> Sequence:
        # waiting requests first claim the free slots; only the rest count against the queue bound
        if len(self.waiting) - self.slots.num_free >= self.max_queue:
            raise QueueFullError(f"the waiting queue is full ({self.max_queue} requests)")
        seq = Sequence(request)
        self.waiting.append(seq)
        self._by_id[request.request_id] = seq
        return seq

    def get(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- one step ------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        now = self.clock()
        for seq in [s for s in (*self.waiting, *self.running) if self._expired(s, now)]:
            self.finish(seq, FinishReason.DEADLINE)
            batch.dropped.append(seq)

        batch.decode = [s for s in self.running if not s.in_prefill]
        budget = prefill_budget(self.step_budget, batch.decode, self.running, self.waiting, self.token_budget,
                                self.min_prefill_chunk)
        for seq in self.running:  # chunked prompts already holding a slot go first
            if seq.in_prefill and budget > 0:
                n = min(seq.prompt_len - seq.num_cached, budget)
                batch.prefill.append(PrefillChunk(seq, seq.num_cached, n))
                budget -= n
        while self.waiting and budget > 0:
            slot = self.slots.allocate(from_top=self.long_prompt is not None
                                       and self.waiting[0].prompt_len >= self.long_prompt)
            if slot is None:
                break
            seq = self.waiting.popleft()
            seq.slot, seq.status, seq.first_scheduled = slot, SeqStatus.RUNNING, now
            self.running.append(seq)
            n = min(seq.prompt_len, budget)
            batch.prefill.append(PrefillChunk(seq, 0, n))
            budget -= n
        return batch

    def update(self, batch: ScheduledBatch, tokens: dict[Sequence, int]) -> None:
        """Record a step's results: the chunk/decode K/V are cached, sampled tokens appended."""
        for chunk in batch.prefill:
            if chunk.seq.status is SeqStatus.RUNNING:
                chunk.seq.num_cached = chunk.start + chunk.length
        for seq in batch.decode:
            if seq.status is SeqStatus.RUNNING:
                seq.num_cached += 1
        now = self.clock()
        for seq, tok in tokens.items():
            if seq.status is SeqStatus.RUNNING:
                seq.output_ids.append(tok)
                if seq.first_token is None:
                    seq.first_token = now

    # ---- leaving -----------------------------------------------------------------------
    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Retire a sequence (any state) and free its slot; idempotent."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
            self.slots.free(seq.slot)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        self._by_id.pop(seq.request_id, None)

    def cancel(self, request_id: str) -> Sequence | None:
        seq = self._by_id.get(request_id)
        if seq is not None:
            self.finish(seq, FinishReason.CANCELLED)
        return seq

    @staticmethod
    def _expired(seq: Sequence, now: float) -> bool:
        return seq.request.deadline is not None and now >= seq.request.deadline
