"""Continuous-batching scheduler: plain Python, no torch.

Each step runs every running sequence's next decode token, then spends what is left of the
token budget on prompt prefill: first the unfinished chunked prompts, then new requests in
arrival order while the request limit (max_batch) and KV memory allow. A long prompt is cut into
chunks, so running streams keep getting a token every step.

KV memory is counted in pages (`kv_page_tokens` positions of one slot; model/kv_cache.py
commits memory page by page, and a page holds that many positions of one layer and head).
Running sequences hold the pages of the positions they have written or will write this step;
prefix-cache entries (prefix_cache.py) hold theirs until evicted. When a running sequence needs a
page and none is free, the least recently used prefix entries go first, then the most recently
admitted sequences are preempted: their slot and pages are handed back and they wait at the head
of the queue, keeping their generated tokens, to be prefilled again (prompt + output) later.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from .ngram import Speculation, kept
from .outputs import merge_chunks
from .prefix_cache import PrefixCache, PrefixEntry
from .processor import StepOutput
from .request import FinishReason, Request
from .sequence import Sequence, SeqStatus
from .step_cost import StepPacer, prefill_tokens

if TYPE_CHECKING:
    from .processor import OutputProcessor
    from .sampler import SampleOutput

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
    kv_copies: tuple[tuple[int, int, int], ...] = ()  # prefix hits: (src slot, dst slot, tokens), run first
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
    kv_copies: list[tuple[int, int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    drafts: list[tuple[int, ...]] = field(default_factory=list)  # aligned with decode

    def freeze(self) -> ScheduledBatch:
        drafts = tuple(self.drafts) if any(self.drafts) else ()
        return ScheduledBatch(tuple(self.decode), tuple(self.prefill), tuple(self.dropped), tuple(self.kv_copies),
                              tuple(self.preempted), drafts)


@dataclass(frozen=True)
class InFlight:
    """A launched step whose tokens are not recorded yet: its plan and the sequences awaiting a token."""

    batch: ScheduledBatch
    awaiting: tuple[Sequence, ...]


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
    calls over runs of neighbouring slots (model/attention/plan.py) read fewer keys for nothing.
    None: always the lowest.

    `max_batch`: requests admitted at once (default num_slots; slots beyond it hold prefix-cache
    entries). `kv_pages`: KV memory in pages of `kv_page_tokens` positions (None: unlimited).
    `release(slot, positions)`: hands a slot's first positions back (the KV cache's `release`).
    `step_pacer`: sizes each step's prefill from measured step costs (step_cost.py) within
    [min_prefill_chunk, token_budget - decode rows]; None: always the upper bound.
    `outputs`: turns each recorded token into its chunk and says when a sequence is done (stops,
    detokenizing; processor.OutputProcessor), for postprocess().
    `speculation`: draft tokens for greedy decode rows from an n-gram index of each sequence
    (ngram.py) while few sequences decode; a row then verifies its drafts in the same step, and
    postprocess() keeps the longest prefix equal to the model's own choices plus the model's next
    token, rewinding the rest. None: off.
    `prefix_tag(seq)`: the prefix-cache tag of a sequence's K/V (prefix_cache.py; default 0 for all).
    """

    def __init__(self, num_slots: int, max_queue: int, token_budget: int, min_prefill_chunk: int = 16,
                 clock: Callable[[], float] = time.monotonic, long_prompt: int | None = None,
                 max_batch: int | None = None, kv_pages: int | None = None, kv_page_tokens: int = 1,
                 prefix_cache: PrefixCache | None = None, release: Callable[[int, int], None] | None = None,
                 step_pacer: StepPacer | None = None, outputs: "OutputProcessor | None" = None,
                 speculation: Speculation | None = None, prefix_tag: Callable[[Sequence], int] | None = None):
        if token_budget < 1 or max_queue < 0:
            raise ValueError("token_budget must be >= 1 and max_queue >= 0")
        self.slots = SlotAllocator(num_slots)
        self.max_queue = max_queue
        self.token_budget = token_budget
        self.min_prefill_chunk = min_prefill_chunk
        self.clock = clock
        self.long_prompt = long_prompt
        self.max_batch = min(num_slots, max_batch or num_slots)
        self.kv_pages = kv_pages
        self.kv_page_tokens = kv_page_tokens
        self.prefix_cache = prefix_cache
        self._release = release or (lambda slot, positions: None)
        self.step_pacer = step_pacer
        self.outputs = outputs
        self.speculation = speculation
        self.prefix_tag = prefix_tag or (lambda seq: 0)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self._by_id: dict[str, Sequence] = {}
        self._held: dict[Sequence, int] = {}  # KV pages of each running sequence
        self._pinned: list[PrefixEntry] = []  # copy sources of the step being built
        self._launched: deque[InFlight] = deque()  # launched steps, oldest first, until their tokens are recorded
        # accounting (tests check that what was handed out came back)
        self.pages_used = 0  # running sequences' and prefix entries' pages
        self.pages_allocated_total = 0
        self.pages_freed_total = 0
        self.request_slots_total = 0  # slots handed to requests
        self.request_slots_returned_total = 0  # ... and given up (freed, or kept as a prefix entry)
        self.preemptions_total = 0
        self.prefix_queried_tokens_total = 0
        self.prefix_hit_tokens_total = 0
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
    def _pages(self, positions: int) -> int:
        return -(-positions // self.kv_page_tokens)

    @property
    def pages_free(self) -> int | None:
        return None if self.kv_pages is None else self.kv_pages - self.pages_used

    def _charge(self, seq: Sequence, pages: int) -> None:
        self._held[seq] = self._held.get(seq, 0) + pages
        self.pages_used += pages
        self.pages_allocated_total += pages

    def _uncharge(self, pages: int) -> None:
        self.pages_used -= pages
        self.pages_freed_total += pages

    def _evict_until_free(self, pages: int) -> bool:
        """Evict LRU prefix entries until `pages` are free; False if that is not possible."""
        if self.kv_pages is None:
            return True
        while self.pages_free < pages:
            if not self._evict_one():
                return False
        return True

    def _evict_one(self) -> bool:
        entry = self.prefix_cache.evict_lru() if self.prefix_cache is not None else None
        if entry is None:
            return False
        self._drop_entry(entry)
        return True

    def _drop_entry(self, entry: PrefixEntry) -> None:
        self._release(entry.slot, entry.pages * self.kv_page_tokens)
        self.slots.free(entry.slot)
        self._uncharge(entry.pages)

    def _hold(self, plan: _Plan, seq: Sequence, want: int, least: int) -> int:
        """Hold pages for positions [0, want) of a running sequence, or at least [0, least): evicts
        prefix entries, then preempts the most recently admitted sequences (seq itself last).
        Returns the positions covered (>= least), or 0 when seq itself had to be preempted."""
        if self.kv_pages is None:
            return want
        while True:
            need = self._pages(want) - self._held.get(seq, 0)
            if need <= 0:
                return want
            self._evict_until_free(need)
            free = self.pages_free
            if free >= need:
                self._charge(seq, need)
                return want
            covered = (self._held.get(seq, 0) + free) * self.kv_page_tokens
            if covered >= least:
                self._charge(seq, free)
                return min(want, covered)
            victim = self.running[-1]
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is seq:
                return 0

    def _preempt(self, seq: Sequence) -> None:
        """Back to the head of the queue; prompt + output are prefilled again when it is readmitted."""
        self.running.remove(seq)
        self._give_back_slot(seq)
        # a token still in flight (overlapped steps) is recorded when its step is read back, before readmission
        seq.resume_len = seq.total_len + seq.pending if seq.output_ids or seq.pending else 0
        seq.num_cached, seq.slot, seq.status = 0, None, SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.preemptions_total += 1

    def _give_back_slot(self, seq: Sequence, keep_as_prefix: bool = False) -> None:
        pages = self._held.pop(seq, 0)
        self.request_slots_returned_total += 1
        if keep_as_prefix:
            entry, dominated = self.prefix_cache.insert(seq.slot, seq.all_tokens[: seq.num_cached], pages,
                                                        self.prefix_tag(seq))
            for old in dominated:  # a later turn of the same conversation covers these
                self._drop_entry(old)
            return
        self._release(seq.slot, pages * self.kv_page_tokens if self.kv_pages is not None else seq.total_len + 1)
        self.slots.free(seq.slot)
        self._uncharge(pages)

    def _take_slot(self, from_top: bool) -> int | None:
        slot = self.slots.allocate(from_top=from_top)
        while slot is None and self._evict_one():
            slot = self.slots.allocate(from_top=from_top)
        return slot

    def drop_prefix_cache(self) -> int:
        """Evict every prefix entry (not pinned); returns how many."""
        n = 0
        while self._evict_one():
            n += 1
        return n

    # ---- one step ------------------------------------------------------------------
    def _prefill_budget(self, decodes: list[Sequence]) -> int:
        """Prompt tokens this step may prefill after its decode rows (the one place that decides it)."""
        return prefill_tokens(self.step_pacer, decodes, self.running, self.waiting, self.token_budget,
                              self.min_prefill_chunk)

    def schedule(self) -> ScheduledBatch:
        """Plan the next step (see the module docstring)."""
        batch = _Plan()
        self._unpin()
        now = self.clock()
        for seq in [s for s in (*self.waiting, *self.running) if self._expired(s, now)]:
            self.finish(seq, FinishReason.DEADLINE)
            batch.dropped.append(seq)

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
            if not self._admit(batch, head, budget, now):
                break
            budget -= batch.prefill[-1].length
        # drafts only in decode-only steps: a step that prefills is the compute-bound kind already, and a
        # draft would lengthen it for the prompt waiting on its first token and for every stream in it
        if self.speculation is not None and not batch.prefill and len(batch.decode) <= self.speculation.max_batch:
            self._add_drafts(batch, budget)
        return batch.freeze()

    def _add_drafts(self, batch: _Plan, budget: int) -> None:
        """Drafts for the decode rows of a decode-only step, within its step tokens, on KV pages that
        are free (a draft never evicts or preempts anything)."""
        for seq in batch.decode:
            draft = self._draft(seq, budget)
            if draft and self.kv_pages is not None:
                held = self._held.get(seq, 0) * self.kv_page_tokens
                need = self._pages(seq.num_cached + 1 + len(draft)) - self._held.get(seq, 0)
                grant = max(0, min(need, self.pages_free))
                if grant:
                    self._charge(seq, grant)
                draft = draft[: held + grant * self.kv_page_tokens - seq.num_cached - 1]
            batch.drafts.append(draft)
            budget -= len(draft)  # drafts are step tokens like any other

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
        """Give the head of the queue a slot, its prefix-cache hit and pages for its first chunk."""
        entry, hit = None, 0
        if self.prefix_cache is not None:
            entry, hit = self.prefix_cache.match(seq.all_tokens, seq.prefill_len - 1, self.prefix_tag(seq))  # >= 1 computed
        n = min(seq.prefill_len - hit, budget)
        if entry is not None:
            entry.pinned += 1  # neither evicted nor dominated while this step copies from it
        need = self._pages(hit + n)
        headroom = sum(1 for s in self.running if not s.in_prefill)  # next step's decodes need no preemption
        ok = self._evict_until_free(need + headroom)
        slot = self._take_slot(self.long_prompt is not None and seq.prefill_len >= self.long_prompt) if ok else None
        if slot is None:
            if entry is not None:
                entry.pinned -= 1
            return False
        self.waiting.popleft()
        self.request_slots_total += 1
        seq.slot, seq.status = slot, SeqStatus.RUNNING
        if seq.first_scheduled is None:
            seq.first_scheduled = now
            seq.cached_prompt_tokens = min(hit, seq.prompt_len)
        self.running.append(seq)
        self._charge(seq, need)
        if self.prefix_cache is not None:
            self.prefix_queried_tokens_total += seq.prefill_len
            self.prefix_hit_tokens_total += hit
        if entry is not None:
            self.prefix_cache.touch(entry)
            self._pinned.append(entry)
            batch.kv_copies.append((entry.slot, slot, hit))
            seq.num_cached = hit
        batch.prefill.append(PrefillChunk(seq, hit, n))
        return True

    def _unpin(self) -> None:
        for entry in self._pinned:
            entry.pinned -= 1
        self._pinned = []

    def advance(self, batch: ScheduledBatch) -> None:
        """A step was launched: its chunks' and decodes' K/V are cached (or being written, in order, on
        the device), and the sequences it samples await their token (`pending`) until record()."""
        self._unpin()  # the step's prefix copies are done, or queued ahead of anything that could reuse the slot
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
        self._launched.append(InFlight(batch, tuple(awaiting)))

    def _landed(self, batch: ScheduledBatch) -> None:
        """The oldest launched step's tokens are back (advance() first if it was not called: a step
        that ran to completion): its sequences no longer await them."""
        if not self._launched or self._launched[0].batch is not batch:
            self.advance(batch)
        step = self._launched.popleft()
        assert step.batch is batch, "steps are recorded in launch order"
        for seq in step.awaiting:
            seq.pending -= 1

    def _append(self, seq: Sequence, token: int, now: float) -> None:
        seq.output_ids.append(token)
        if seq.first_token is None:
            seq.first_token = now
        if seq.draft is not None:
            seq.draft.extend((token,))

    def record(self, batch: ScheduledBatch, tokens: dict[Sequence, int]) -> None:
        """A launched step's sampled tokens, read back (one per sequence, in launch order): appended to
        their sequences (also to one preempted since, whose recompute includes it), unless the sequence
        finished meanwhile. What postprocess() does without the output processor."""
        self._landed(batch)
        now = self.clock()
        for seq, tok in tokens.items():
            if seq.status is not SeqStatus.FINISHED:
                self._append(seq, tok, now)

    def postprocess(self, batch: ScheduledBatch, out: "SampleOutput | None") -> list[StepOutput]:
        """A step's sampled tokens (`out`: one row per sampled sequence, k + 1 rows for one verifying k
        drafts; None when no row sampled): recorded, each turned into its chunk by the output
        processor (stops, detokenizing), and the sequences that are done (a stop, the length, a
        non-finite row, a processing error) retired.

        A verifying row keeps its drafts up to the first one that differs from the model's own greedy
        token at that position, then the model's token there: exactly the tokens decoding one at a time
        would give. The K/V written for the rejected drafts is discarded (num_cached rewinds; the
        positions are rewritten before anything reads them); tokens after a stop are dropped too."""
        self._landed(batch)
        now = self.clock()
        results, row = [], 0
        for seq, draft in zip(batch.sampled(), batch.sampled_drafts()):
            rows = range(row, row + 1 + len(draft))
            row += len(rows)
            if seq.status is SeqStatus.FINISHED:
                continue  # cancelled while the step ran, or (overlapped steps) done at the step before
            if not out.ok[rows[0]]:
                self.finish(seq, FinishReason.ERROR)
                results.append(StepOutput(seq, None, FinishReason.ERROR))
                continue
            keep = kept(out.token_ids, out.ok, rows[0], draft)  # drafts accepted
            if draft:
                seq.num_cached -= len(draft) - keep
                self.drafted_tokens_total += len(draft)
                self.accepted_tokens_total += keep
                seq.draft.accepted(len(draft), keep)
            chunk = reason = None
            for r in rows[: keep + 1]:
                self._append(seq, out.token_ids[r], now)
                try:
                    piece, reason = self.outputs.on_token(seq, out.token_ids[r], out.logprobs[r])
                except Exception:  # noqa: BLE001 - detokenizing one request must not stop the others
                    log.exception("output processing failed for %s", seq.request_id)
                    chunk, reason = None, FinishReason.ERROR
                    break
                chunk = piece if chunk is None else merge_chunks(chunk, piece)
                if reason is not None:
                    break
            if draft:
                seq.num_cached = min(seq.num_cached, seq.total_len - 1)  # a stop inside the accepted run
            if chunk is None:
                self.finish(seq, FinishReason.ERROR)
                results.append(StepOutput(seq, None, FinishReason.ERROR))
                continue
            if reason is not None:
                self.finish(seq, reason)
            gap = None if seq.last_token_time is None else now - seq.last_token_time
            seq.last_token_time = now
            results.append(StepOutput(seq, chunk, reason, gap))
        return results

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
            keep = (self.prefix_cache is not None and reason in CACHEABLE
                    and seq.num_cached >= self.prefix_cache.block)
            self._give_back_slot(seq, keep_as_prefix=keep)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        self._by_id.pop(seq.request_id, None)

    @staticmethod
    def _expired(seq: Sequence, now: float) -> bool:
        return seq.request.deadline is not None and now >= seq.request.deadline
