"""Continuous-batching scheduler: plain Python, no torch.

Each step runs every running sequence's next decode token, then spends what is left of the
token budget on prompt prefill: first the unfinished chunked prompts, then new requests in
arrival order while the request limit (max_batch) and KV memory allow. A long prompt is cut into
chunks, so running streams keep getting a token every step.

KV memory (slots, pages, prefix-cache entries) is the KV manager's (kv_manager.py): running
sequences hold the pages of the positions they have written or will write this step. When a
running sequence needs a page and evicting prefix entries frees none, the scheduler preempts the
most recently admitted sequences: their slot and pages are handed back and they wait at the head of
the queue, keeping their generated tokens, to be prefilled again (prompt + output) later. Before
each step, every running sequence's sliding-window layers hand back the pages below the window of
the lowest position a step may still query (`_first_query`).

A launched step is one `InFlight` record from launch until its tokens are recorded; the output
processor (processor.py) reads its tokens back and records them through `land`, `append`,
`verified` and `finish`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from .kv_manager import KvManager
from .ngram import Speculation
from .prefix_cache import PrefixCache
from .request import FinishReason, Request
from .sequence import Sequence, SeqStatus
from .step_cost import StepPacer, prefill_tokens

if TYPE_CHECKING:
    from .adapters import AdapterPool

log = logging.getLogger("lmserve.engine")

# finishes after which a request's K/V are whole and finite (every written position fed a sampled
# token's logits), so its slot may become a prefix-cache entry
CACHEABLE = frozenset({FinishReason.EOS, FinishReason.STOP, FinishReason.LENGTH})


class QueueFullError(Exception):
    """The waiting queue is at its bound; the request was not accepted."""


@dataclass(frozen=True)
class PrefillChunk:
    seq: Sequence
    start: int  # first position in this chunk (== tokens already cached)
    length: int

    @property
    def completes_prompt(self) -> bool:
        """The chunk ends the sequence's prefill (prompt, or prompt + output after a preemption): it samples."""
        return self.start + self.length == self.seq.prefill_len


@dataclass(frozen=True)
class ScheduledBatch:
    """One step's plan, fixed once schedule() returns it. Each row is a decode token or a prefill
    chunk (a speculative draft's verification tokens will be a row kind of their own)."""

    decode: tuple[Sequence, ...] = ()
    prefill: tuple[PrefillChunk, ...] = ()
    dropped: tuple[Sequence, ...] = ()  # finished without compute (deadline)
    # prefix hits: (src slot, dst slot, tokens, first position, layers or None: all) (KVCache.copy_prefix), run first
    kv_copies: tuple[tuple[int, int, int, int, tuple[int, ...] | None], ...] = ()
    preempted: tuple[Sequence, ...] = ()  # back to waiting, to be recomputed
    drafts: tuple[tuple[int, ...], ...] = ()  # per decode row, the drafted tokens it verifies (() when none)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(c.length for c in self.prefill) + sum(map(len, self.drafts))

    def sampled(self) -> list[Sequence]:
        """Sequences that get a new token from this step, in the runner's logits order."""
        return [c.seq for c in self.prefill if c.completes_prompt] + list(self.decode)

    def draft_of(self, i: int) -> tuple[int, ...]:
        """The drafted tokens decode row i verifies (its query tokens are its latest token, then these)."""
        return self.drafts[i] if self.drafts else ()

    def sampled_drafts(self) -> list[tuple[int, ...]]:
        """batch.sampled()'s drafts, in order; a sequence with k drafts has k + 1 logits rows."""
        n = len(self.sampled()) - len(self.decode)
        return [()] * n + [self.draft_of(i) for i in range(len(self.decode))]


@dataclass
class _Plan:
    """The step being planned inside schedule() (frozen into a ScheduledBatch at its end)."""

    decode: list[Sequence] = field(default_factory=list)
    prefill: list[PrefillChunk] = field(default_factory=list)
    dropped: list[Sequence] = field(default_factory=list)
    kv_copies: list[tuple[int, int, int, int, tuple[int, ...] | None]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    drafts: list[tuple[int, ...]] = field(default_factory=list)  # aligned with decode

    def freeze(self) -> ScheduledBatch:
        drafts = tuple(self.drafts) if any(self.drafts) else ()
        return ScheduledBatch(tuple(self.decode), tuple(self.prefill), tuple(self.dropped), tuple(self.kv_copies),
                              tuple(self.preempted), drafts)


@dataclass(eq=False)
class InFlight:
    """A launched step, from its launch until its tokens are recorded: its plan, the runner's output
    (runner.RunOutput), the host time of the call, and the sequences awaiting a token from it."""

    batch: ScheduledBatch
    run: object = None  # runner.RunOutput
    seconds: float = 0.0  # the call's host time (the whole step where the call computes it); after wait(), the step's
    timing: tuple | None = None  # CUDA events around an overlapped step, whose launch returns at once
    awaiting: tuple[Sequence, ...] = ()  # set by Scheduler.advance
    first_query: dict[Sequence, int] = field(default_factory=dict)  # each sequence's lowest query position in it

    def wait(self) -> None:
        """Until the step ran and its tokens are back (at once where the call computed it); its
        duration then comes from its CUDA events."""
        if self.timing is not None:
            start, end = self.timing
            end.synchronize()
            self.seconds, self.timing = start.elapsed_time(end) / 1e3, None
        if self.run is not None and self.run.out is not None:
            _ = self.run.out.token_ids  # reads the copy back


class Scheduler:
    """`long_prompt`: prompts of at least this many tokens take the highest free slot and the others
    the lowest, so neighbouring slots hold requests of similar length and a decode step's attention
    calls over runs of neighbouring slots (model/attention/plan.py) read fewer keys for nothing.
    None: always the lowest.

    `max_batch`: requests admitted at once (default num_slots; slots beyond it hold prefix-cache
    entries). `kv_pages`, `kv_page_tokens`, `prefix_cache`, `release`, `prefix_tag`, `layer_windows`, `map_pages`: the
    KV manager's (kv_manager.KvManager, `self.kv`).
    `step_pacer`: sizes each step's prefill from measured step costs (step_cost.py) within
    [min_prefill_chunk, token_budget - decode rows]; None: always the upper bound.
    `speculation`: draft tokens for greedy decode rows from an n-gram index of each sequence
    (ngram.py) while few sequences decode; a row then verifies its drafts in the same step, and
    the output processor keeps the longest prefix equal to the model's own choices plus the model's
    next token (`verified` rewinds the rest). None: off.
    """

    def __init__(self, num_slots: int, max_queue: int, token_budget: int, min_prefill_chunk: int = 16,
                 clock: Callable[[], float] = time.monotonic, long_prompt: int | None = None,
                 max_batch: int | None = None, kv_pages: int | None = None, kv_page_tokens: int = 1,
                 prefix_cache: PrefixCache | None = None, release: Callable[[int, int], None] | None = None,
                 step_pacer: StepPacer | None = None, speculation: Speculation | None = None,
                 prefix_tag: Callable[[Sequence], int] | None = None, layer_windows: tuple[int, ...] = (),
                 map_pages: Callable[[int, int], None] | None = None, adapters: "AdapterPool | None" = None):
        if token_budget < 1 or max_queue < 0:
            raise ValueError("token_budget must be >= 1 and max_queue >= 0")
        self.kv = KvManager(num_slots, kv_pages, kv_page_tokens, prefix_cache, release, prefix_tag, layer_windows,
                            map_pages)
        self.max_queue = max_queue
        self.token_budget = token_budget
        self.min_prefill_chunk = min_prefill_chunk
        self.clock = clock
        self.long_prompt = long_prompt
        self.max_batch = min(num_slots, max_batch or num_slots)
        self.step_pacer = step_pacer
        self.speculation = speculation
        self.adapters = adapters  # LoRA adapters made resident at admission (adapters.py); None: none served
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self._by_id: dict[str, Sequence] = {}
        self.in_flight: deque[InFlight] = deque()  # launched steps, oldest first, until their tokens are recorded
        self.preemptions_total = 0
        self.drafted_tokens_total = 0  # tokens drafted and verified ...
        self.accepted_tokens_total = 0  # ... and those the model agreed with

    # ---- intake ------------------------------------------------------------------
    def add(self, request: Request) -> Sequence:
        # waiting requests first claim the free places; only the rest count against the queue bound
        if len(self.waiting) - (self.max_batch - len(self.running)) >= self.max_queue:
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

    # ---- KV pages -------------------------------------------------------------------
    def _hold(self, plan: _Plan, seq: Sequence, want: int, least: int) -> int:
        """Hold pages for positions [0, want) of a running sequence, or at least [0, least): the KV
        manager evicts prefix entries, then the most recently admitted sequences are preempted (seq
        itself last). Returns the positions covered (>= least), or 0 when seq itself was preempted."""
        while True:
            covered = self.kv.reserve(seq, want, least)
            if covered:
                return covered
            victim = self.running[-1]
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is seq:
                return 0

    def _first_query(self, seq: Sequence) -> int:
        """The lowest position a step may still query for `seq`: its next one, or lower in a launched step
        whose tokens are not recorded yet (a rejected draft rewinds num_cached no lower than its row's)."""
        return min([seq.num_cached, *(step.first_query[seq] for step in self.in_flight if seq in step.first_query)])

    def _preempt(self, seq: Sequence) -> None:
        """Back to the head of the queue; prompt + output are prefilled again when it is readmitted."""
        self.running.remove(seq)
        self.kv.give_back(seq)
        self._drop_adapter(seq)
        # a token still in flight (overlapped steps) is recorded when its step is read back, before readmission
        seq.resume_len = seq.total_len + seq.pending if seq.output_ids or seq.pending else 0
        seq.num_cached, seq.slot, seq.status = 0, None, SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.preemptions_total += 1

    # ---- one step ------------------------------------------------------------------
    def _prefill_budget(self, decodes: list[Sequence]) -> int:
        """Prompt tokens this step may prefill after its decode rows (the one place that decides it)."""
        return prefill_tokens(self.step_pacer, decodes, self.running, self.waiting, self.token_budget,
                              self.min_prefill_chunk)

    def schedule(self) -> ScheduledBatch:
        """Plan the next step (see the module docstring)."""
        batch = _Plan()
        self.kv.unpin()
        now = self.clock()
        for seq in [s for s in (*self.waiting, *self.running) if self._expired(s, now)]:
            self.finish(seq, FinishReason.DEADLINE)
            batch.dropped.append(seq)

        for seq in self.running:  # sliding layers' keys no step reads any more go back first
            self.kv.slide(seq, self._first_query(seq))
        decoding = [s for s in self.running if not s.in_prefill]
        budget = self._prefill_budget(decoding)
        for seq in list(self.running):  # oldest first: the newest are preempted when pages run out
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted in this loop
            if not seq.in_prefill:
                if seq.pending and seq.out_of_tokens:
                    continue  # its token in flight is its last (overlapped steps): nothing more to compute
                if self._hold(batch, seq, seq.num_cached + 1, seq.num_cached + 1):
                    batch.decode.append(seq)
            elif budget > 0:  # chunked prompts already holding a slot go before new ones
                n = min(seq.prefill_len - seq.num_cached, budget)
                n = self._hold(batch, seq, seq.num_cached + n, seq.num_cached + 1) - seq.num_cached
                if n > 0:
                    batch.prefill.append(PrefillChunk(seq, seq.num_cached, n))
                    budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_batch:
            head = self.waiting[0]
            # Not a sequence preempted by this very schedule: it lost its pages to the running ones,
            # and readmitting it now would recompute a chunk only to lose it at their next page; with
            # overlapped steps its newest token may also be in flight still, its id unknown until read back.
            if head in batch.preempted:
                break
            if head.request.adapter and head.lora is None and not self._take_adapter(batch, head):
                if head.status is SeqStatus.FINISHED:  # its adapter can no longer be served: dropped
                    continue
                # every adapter slot is pinned by running requests: a request for the base model behind it
                # goes first (it pins no slot, so it never delays the head's), the head keeping its place
                head = next((s for s in self.waiting if not s.request.adapter and s not in batch.preempted), None)
                if head is None:
                    break
            if not self._admit(batch, head, budget, now):
                break
            budget -= batch.prefill[-1].length
        # drafts only in decode-only steps: a step that prefills is the compute-bound kind already, and a
        # draft would lengthen it for the prompt waiting on its first token and for every stream in it
        if not batch.prefill:
            speculate = self.speculation is not None and len(batch.decode) <= self.speculation.max_batch
            if speculate or any(seq.repeats is not None and seq.repeats.due for seq in batch.decode):
                self._add_drafts(batch, budget, speculate)
        return batch.freeze()

    def _add_drafts(self, batch: _Plan, budget: int, speculate: bool) -> None:
        """Drafts for the decode rows of a decode-only step, within its step tokens, on KV pages that
        are free (a draft never evicts or preempts anything): a repeat probe where one is due, else
        (`speculate`) the proposer's."""
        for seq in batch.decode:
            draft = self._probe(seq, budget) if seq.repeats is not None else ()
            if not draft and speculate:
                draft = self._draft(seq, budget)
                if draft:
                    draft = draft[: self.kv.grant(seq, seq.num_cached + 1 + len(draft)) - seq.num_cached - 1]
            batch.drafts.append(draft)
            budget -= len(draft)  # drafts are step tokens like any other

    def _probe(self, seq: Sequence, budget: int) -> tuple[int, ...]:
        """The rest of an earlier part of the output the latest part begins like (repeat_probe.py), whole
        or not at all: within the step's tokens, the request's remaining length, its constraint and the
        KV pages free (only a whole repeat accepted ends the output)."""
        if seq.pending or not Speculation.verifiable(seq.request.params):
            return ()
        probe = seq.repeats.draft(seq.output_ids)
        if (not probe or len(probe) >= budget
                or len(probe) > seq.request.params.max_new_tokens - len(seq.output_ids)
                or (seq.constraint is not None and seq.constraint.count_valid(probe) < len(probe))
                or self.kv.grant(seq, seq.num_cached + 1 + len(probe)) < seq.num_cached + 1 + len(probe)):
            return ()
        seq.repeats.probed = True
        return probe

    def _draft(self, seq: Sequence, budget: int) -> tuple[int, ...]:
        """Tokens for a decode row to verify: at most what the step's tokens, the request's remaining
        length and the proposer allow; () for rows speculation does not apply to."""
        p = seq.request.params
        if seq.pending or not Speculation.applies(p):
            return ()
        if seq.draft is None:
            seq.draft = self.speculation.proposer(seq.all_tokens, p.prediction)
        draft = seq.draft.propose(min(budget - 1, p.max_new_tokens - len(seq.output_ids) - 1))
        if draft and seq.constraint is not None:  # a constrained row verifies only what its constraint allows
            draft = draft[: seq.constraint.count_valid(draft)]
        return tuple(draft)

    def _admit(self, batch: _Plan, seq: Sequence, budget: int, now: float) -> bool:
        """Give the head of the queue its adapter (resident and pinned), a slot, its prefix-cache hit and
        pages for its first chunk."""
        if not self._take_adapter(batch, seq):
            return False
        entry, hit = self.kv.match(seq)  # pinned: neither evicted nor dominated while this step copies from it
        n = min(seq.prefill_len - hit, budget)
        need = self.kv.cost(hit + n, first_query=hit)
        # next step's decodes need no preemption
        headroom = self.kv.page_weight * sum(1 for s in self.running if not s.in_prefill)
        ok = self.kv.evict_until_free(need + headroom)
        slot = self.kv.take_slot(self.long_prompt is not None and seq.prefill_len >= self.long_prompt) if ok else None
        if slot is None:
            if entry is not None:
                self.kv.unpin(entry)
            self._drop_adapter(seq)
            return False
        if self.waiting[0] is seq:
            self.waiting.popleft()
        else:  # a base-model request admitted past a head waiting for its adapter
            self.waiting.remove(seq)
        seq.slot, seq.status = slot, SeqStatus.RUNNING
        if seq.first_scheduled is None:
            seq.first_scheduled = now
            seq.cached_prompt_tokens = min(hit, seq.prompt_len)
        self.running.append(seq)
        self.kv.open(seq, hit + n, first_query=hit)
        self.kv.use(seq, entry, hit)
        if entry is not None:
            batch.kv_copies.extend(self.kv.copies(entry.slot, slot, hit))
            seq.num_cached = hit
        batch.prefill.append(PrefillChunk(seq, hit, n))
        return True

    def _take_adapter(self, batch: _Plan, seq: Sequence) -> bool:
        """The head's adapter resident and pinned (True), or False: it waits (every slot pinned by running
        requests), or it was finished with an error (its adapter was unloaded, or no longer reads)."""
        name = seq.request.adapter
        if not name or seq.lora is not None:
            return True
        try:
            seq.lora = self.adapters.acquire(name) if self.adapters is not None else None
        except (LookupError, ValueError) as exc:
            log.warning("request %s: adapter %r cannot be served: %s", seq.request_id, name, exc)
            self.finish(seq, FinishReason.ERROR)
            batch.dropped.append(seq)
            return False
        if seq.lora is None and self.adapters is None:
            raise ValueError(f"request {seq.request_id} names adapter {name!r} but no adapters are served")
        return seq.lora is not None

    def _drop_adapter(self, seq: Sequence) -> None:
        if seq.lora is not None:
            self.adapters.release(seq.lora[1])
            seq.lora = None

    def advance(self, step: InFlight) -> None:
        """A step was launched: its chunks' and decodes' K/V are cached (or being written, in order, on
        the device), and the sequences it samples await their token (`pending`) until land()."""
        batch = step.batch
        self.kv.unpin()  # the step's prefix copies are done, or queued ahead of anything that could reuse the slot
        for seq in batch.decode:
            step.first_query[seq] = seq.num_cached
        for chunk in batch.prefill:
            step.first_query[chunk.seq] = chunk.start
        for chunk in batch.prefill:
            if chunk.seq.status is SeqStatus.RUNNING:
                chunk.seq.num_cached = chunk.start + chunk.length
        for i, seq in enumerate(batch.decode):
            if seq.status is SeqStatus.RUNNING:
                seq.num_cached += 1 + len(batch.draft_of(i))  # drafts' K/V too, until postprocess rewinds
        awaiting = []
        for row, seq in enumerate(batch.sampled()):
            if seq.status is SeqStatus.RUNNING:
                seq.pending += 1
                seq.pending_row = row
                awaiting.append(seq)
        step.awaiting = tuple(awaiting)
        self.in_flight.append(step)

    def land(self, step: InFlight) -> None:
        """The oldest launched step's tokens are back (advance() first if it was not called: a step
        that ran to completion): its sequences no longer await them."""
        if not self.in_flight or self.in_flight[0] is not step:
            self.advance(step)
        landed = self.in_flight.popleft()
        assert landed is step, "steps are recorded in launch order"
        for seq in step.awaiting:
            seq.pending -= 1

    def append(self, seq: Sequence, token: int, now: float) -> None:
        """A token the model produced for `seq`, recorded."""
        seq.output_ids.append(token)
        if seq.first_token is None:
            seq.first_token = now
        if seq.draft is not None:
            seq.draft.extend((token,))

    def record(self, batch: ScheduledBatch, tokens: dict[Sequence, int]) -> None:
        """A launched step's sampled tokens, read back (one per sequence, in launch order): appended to
        their sequences (also to one preempted since, whose recompute includes it), unless the sequence
        finished meanwhile. The recording the output processor does, without its chunks (tests)."""
        oldest = self.in_flight[0] if self.in_flight else None
        self.land(oldest if oldest is not None and oldest.batch is batch else InFlight(batch))
        now = self.clock()
        for seq, tok in tokens.items():
            if seq.status is not SeqStatus.FINISHED:
                self.append(seq, tok, now)

    def verified(self, seq: Sequence, drafted: int, kept: int, probe: bool = False) -> None:
        """A decode row verified `drafted` drafts (the proposer's, or a repeat `probe`) and the model agreed
        with the first `kept`: the K/V written for the others is discarded (num_cached rewinds; the
        positions are rewritten before anything reads them)."""
        seq.num_cached -= drafted - kept
        self.drafted_tokens_total += drafted
        self.accepted_tokens_total += kept
        if not probe:
            seq.draft.accepted(drafted, kept)

    def trim_to_output(self, seq: Sequence) -> None:
        """After a verified row's tokens were recorded: a stop inside the accepted run dropped the
        tokens after it, whose K/V is discarded too."""
        seq.num_cached = min(seq.num_cached, seq.total_len - 1)

    # ---- leaving -----------------------------------------------------------------------
    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Retire a sequence (any state) and give its slot back, or keep it as a prefix-cache entry
        when it finished normally; idempotent."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
            cache = self.kv.prefix_cache
            keep = cache is not None and reason in CACHEABLE and seq.num_cached >= cache.block
            self.kv.give_back(seq, keep_as_prefix=keep)
        self._drop_adapter(seq)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        self._by_id.pop(seq.request_id, None)

    @staticmethod
    def _expired(seq: Sequence, now: float) -> bool:
        return seq.request.deadline is not None and now >= seq.request.deadline
