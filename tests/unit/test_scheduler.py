"""Scheduler unit tests: plain Python, fake token outputs, no model."""

import pytest

from lmserve.server.engine.request import FinishReason, Request
from lmserve.server.engine.scheduler import QueueFullError, Scheduler
from lmserve.server.engine.sequence import SeqStatus


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def req(n, rid=None, deadline=None):
    kw = {"request_id": rid} if rid else {}
    return Request(prompt_ids=list(range(1, n + 1)), deadline=deadline, **kw)


def run_step(s: Scheduler, token=7):
    """One step with fake outputs: every sampled sequence gets `token`."""
    batch = s.schedule()
    s.record(batch, {seq: token for seq in batch.sampled()})
    return batch


def test_admission_bounded_by_slots_fcfs():
    s = Scheduler(num_slots=2, max_queue=10, token_budget=100)
    seqs = [s.add(req(3, f"r{i}")) for i in range(4)]
    b = s.schedule()
    assert [c.seq for c in b.prefill] == seqs[:2]
    assert [c.seq.slot for c in b.prefill] == [0, 1]
    assert list(s.waiting) == seqs[2:]
    s.record(b, {q: 5 for q in b.sampled()})
    s.finish(seqs[0], FinishReason.LENGTH)
    b2 = s.schedule()
    assert [c.seq for c in b2.prefill] == [seqs[2]]  # first come, first served
    assert seqs[2].slot == 0  # the freed slot is reused
    assert b2.decode == (seqs[1],)


def test_long_prompts_take_slots_from_the_top_so_neighbours_have_similar_lengths():
    s = Scheduler(num_slots=6, max_queue=10, token_budget=1000, long_prompt=10)
    lengths = [3, 40, 4, 12, 10, 9]  # 10 and more count as long
    seqs = [s.add(req(n, f"r{i}")) for i, n in enumerate(lengths)]
    run_step(s)
    assert [q.slot for q in seqs] == [0, 5, 1, 4, 3, 2]
    assert max(q.slot for q in seqs if q.prompt_len < 10) < min(q.slot for q in seqs if q.prompt_len >= 10)
    s.finish(seqs[1], FinishReason.LENGTH)  # a long one leaves slot 5 ...
    s.finish(seqs[0], FinishReason.LENGTH)  # ... a short one slot 0
    late = [s.add(req(n, f"late{n}")) for n in (50, 2)]
    run_step(s)
    assert [q.slot for q in late] == [5, 0]  # each end refilled by its own kind


def test_queue_bound_rejects_overflow():
    s = Scheduler(num_slots=1, max_queue=2, token_budget=100)
    for _ in range(3):  # one will take the free slot, two may wait
        s.add(req(3))
    with pytest.raises(QueueFullError, match="full"):
        s.add(req(3))
    assert len(s.waiting) == 3
    run_step(s)  # the first is admitted: still only two wait, so the queue stays full
    with pytest.raises(QueueFullError):
        s.add(req(3))
    assert len(s.waiting) == 2 and len(s.running) == 1


def test_token_budget_chunks_long_prompt_and_keeps_decoding():
    s = Scheduler(num_slots=4, max_queue=10, token_budget=10, min_prefill_chunk=1)
    short = s.add(req(3, "short"))
    run_step(s)  # short prefilled, sampled its first token
    long = s.add(req(25, "long"))
    chunks = []
    for _ in range(3):
        b = run_step(s)
        assert short in b.decode  # the running stream gets a token every step
        assert b.num_tokens <= 10
        chunks += [(c.start, c.length) for c in b.prefill if c.seq is long]
    assert chunks == [(0, 9), (9, 9), (18, 7)]
    assert long.num_cached == 25 and len(long.output_ids) == 1  # sampled only once the prompt completed


def test_chunk_logits_only_for_completed_prompts():
    s = Scheduler(num_slots=2, max_queue=10, token_budget=8, min_prefill_chunk=1)
    a = s.add(req(12, "a"))
    b = s.schedule()
    assert b.sampled() == []  # a partial prompt produces no token
    s.record(b, {})
    assert a.num_cached == 8 and a.output_ids == []


def test_cancel_waiting_and_running_frees_slot():
    s = Scheduler(num_slots=1, max_queue=10, token_budget=100)
    a, b = s.add(req(3, "a")), s.add(req(3, "b"))
    run_step(s)
    assert a.status is SeqStatus.RUNNING and s.kv.slots.used == 1
    s.finish(s.get("b"), FinishReason.CANCELLED)  # what the engine does with a cancel
    assert b.status is SeqStatus.FINISHED and b.finish_reason is FinishReason.CANCELLED and not s.waiting
    s.finish(s.get("a"), FinishReason.CANCELLED)
    assert s.kv.slots.used == 0 and not s.running
    assert s.kv.slots.allocated_total == s.kv.slots.freed_total == 1
    s.finish(a, FinishReason.CANCELLED)  # idempotent
    assert s.get("a") is None and a.finish_reason is FinishReason.CANCELLED and s.kv.slots.freed_total == 1


def test_deadline_drops_before_compute():
    clock = Clock()
    s = Scheduler(num_slots=1, max_queue=10, token_budget=100, clock=clock)
    a = s.add(req(3, "a", deadline=5.0))
    b = s.add(req(3, "b", deadline=1.0))  # waits behind a, expires while waiting
    run_step(s)
    clock.t = 2.0
    batch = s.schedule()
    assert b in batch.dropped and b.finish_reason is FinishReason.DEADLINE
    assert b.num_cached == 0  # never cost compute
    assert batch.decode == (a,)
    s.record(batch, {a: 1})
    clock.t = 6.0
    batch = s.schedule()
    assert a in batch.dropped and batch.empty and s.kv.slots.used == 0


def test_fairness_many_requests_all_finish_in_order():
    s = Scheduler(num_slots=3, max_queue=100, token_budget=6, min_prefill_chunk=1)
    seqs = [s.add(req(4, f"r{i}")) for i in range(10)]
    order = []
    for _ in range(200):
        if not s.num_unfinished:
            break
        b = run_step(s)
        for seq in b.sampled():
            if len(seq.output_ids) == 3:
                s.finish(seq, FinishReason.LENGTH)
                order.append(seq)
    assert order == seqs  # equal work finishes first-come first-served
    assert s.kv.slots.allocated_total == s.kv.slots.freed_total == 10 and s.kv.slots.used == 0


def test_lowest_free_slot_keeps_slots_dense():
    s = Scheduler(num_slots=4, max_queue=10, token_budget=100)
    seqs = [s.add(req(2, f"r{i}")) for i in range(4)]
    run_step(s)
    s.finish(seqs[1], FinishReason.LENGTH)
    s.finish(seqs[3], FinishReason.LENGTH)
    new = s.add(req(2, "n"))
    s.schedule()
    assert new.slot == 1


def test_drafts_go_only_into_steps_that_prefill_nothing():
    """A repeating history gives the decode row a draft, except in a step that also prefills a prompt
    (that step is compute-bound already; a draft would delay the prompt's first token)."""
    from lmserve.server.engine.ngram import Speculation

    def after_first_token(then_add: bool):
        s = Scheduler(num_slots=2, max_queue=10, token_budget=100, speculation=Speculation())
        seq = s.add(Request(prompt_ids=[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]))
        run_step(s, token=7)  # ... 5 6 7: the suffix (6, 7) was followed by 8 5 6 7 before
        if then_add:
            s.add(req(4, "newcomer"))
        return seq, s.schedule()

    seq, alone = after_first_token(then_add=False)
    assert alone.decode == (seq,) and alone.draft_of(0) == (8, 5, 6, 7)  # a first draft is 4 tokens long
    seq, mixed = after_first_token(then_add=True)
    assert mixed.decode == (seq,) and [c.seq.request_id for c in mixed.prefill] == ["newcomer"]
    assert mixed.draft_of(0) == ()
