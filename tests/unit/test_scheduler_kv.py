"""Scheduler with a KV block budget and a prefix cache: plain Python, fake token outputs, no model."""

from lmserve.server.engine.prefix_cache import PrefixCache
from lmserve.server.engine.request import FinishReason, Request
from lmserve.server.engine.scheduler import InFlight, Scheduler
from lmserve.server.engine.sequence import SeqStatus


class Released:
    """Records the scheduler's release(slot, positions) calls (a part of some layers: (slot, upto, start, layers))."""

    def __init__(self):
        self.calls = []

    def __call__(self, slot, positions, start=0, layers=None):
        self.calls.append((slot, positions) if (start, layers) == (0, None) else (slot, positions, start, layers))


def req(tokens, rid, max_new=100):
    r = Request(prompt_ids=list(tokens), request_id=rid)
    return r


def run_step(s, outputs, token_of=lambda seq: 7):
    """One step; every sampled sequence gets a token, recorded per request id in `outputs`."""
    batch = s.schedule()
    toks = {seq: token_of(seq) for seq in batch.sampled()}
    s.record(batch, toks)
    for seq, t in toks.items():
        outputs.setdefault(seq.request_id, []).append(t)
    return batch


def balanced(s):
    """Blocks in use are exactly the running sequences' plus the prefix entries', and allocated - freed."""
    entries = s.kv.prefix_cache.pages_held if s.kv.prefix_cache else 0
    running = sum(s.kv.pages(max(q.num_cached, 1)) <= s.kv.held(q) for q in s.running) == len(s.running)
    held = sum(s.kv.held(q) for q in s.running)
    return running and s.kv.pages_used == held + entries == s.kv.pages_allocated_total - s.kv.pages_freed_total


def test_decode_growth_preempts_the_newest_and_it_resumes_with_its_tokens():
    """Budget 6 blocks of 4 positions; three requests of 4-token prompts grow until one must go."""
    rel = Released()
    s = Scheduler(num_slots=4, max_queue=10, token_budget=64, min_prefill_chunk=1,
                  kv_pages=6, kv_page_tokens=4, release=rel)
    seqs = [s.add(req(range(10 * i + 1, 10 * i + 5), f"r{i}")) for i in range(3)]
    outputs, preempted = {}, []
    counter = iter(range(1000))
    for _ in range(60):
        b = run_step(s, outputs, token_of=lambda seq: 100 + next(counter))
        preempted += b.preempted
        assert s.kv.pages_used <= 6 and balanced(s)
        for seq in b.sampled():
            if len(seq.output_ids) == 6:
                s.finish(seq, FinishReason.LENGTH)
        if not s.num_unfinished:
            break
    assert preempted, "the budget never ran out"
    victim = preempted[0]
    assert victim is seqs[2]  # the most recently admitted goes first
    for seq in seqs:
        assert seq.status is SeqStatus.FINISHED and len(seq.output_ids) == 6
        assert outputs[seq.request_id] == seq.output_ids  # each token sampled once: none lost or repeated
    assert s.kv.pages_used == 0 and s.kv.pages_allocated_total == s.kv.pages_freed_total
    assert s.kv.request_slots_total == s.kv.request_slots_returned_total == 3 + len(preempted)
    assert s.kv.slots.used == 0 and s.preemptions_total == len(preempted)


def test_a_preempted_request_is_prefilled_again_with_prompt_and_output_then_samples():
    s = Scheduler(num_slots=2, max_queue=10, token_budget=64, min_prefill_chunk=1, kv_pages=3, kv_page_tokens=4)
    a, b = s.add(req([1, 2, 3, 4], "a")), s.add(req([5, 6, 7], "b"))
    out = {}
    run_step(s, out)  # both prefilled: a holds 1 block, b 1
    for _ in range(8):
        batch = run_step(s, out)
        if batch.preempted:
            break
    assert batch.preempted == (b,) and b.status is SeqStatus.WAITING and s.waiting[0] is b
    assert b.num_cached == 0 and b.resume_len == b.total_len and b.output_ids
    s.finish(a, FinishReason.LENGTH)
    n_out = len(b.output_ids)
    batch = run_step(s, out)
    (chunk,) = batch.prefill
    assert (chunk.seq, chunk.start, chunk.length) == (b, 0, b.prompt_len + n_out) and chunk.completes_prompt
    assert len(b.output_ids) == n_out + 1 and not b.in_prefill  # sampled the next token, then decodes
    assert run_step(s, out).decode == (b,)


def test_prefix_hit_copies_the_shared_positions_and_prefills_the_rest():
    s = Scheduler(num_slots=4, max_queue=10, token_budget=64, min_prefill_chunk=1, max_batch=2,
                  kv_pages=100, kv_page_tokens=4, prefix_cache=PrefixCache(block=4))
    system = list(range(1, 21))
    first = s.add(req(system + [30, 31], "first"))
    out = {}
    run_step(s, out)
    run_step(s, out)
    s.finish(first, FinishReason.EOS)  # 23 positions cached: prompt + first output
    assert len(s.kv.prefix_cache) == 1 and s.kv.request_slots_returned_total == 1 and s.kv.slots.used == 1
    second = s.add(req(system + [40, 41, 42], "second"))
    batch = s.schedule()
    (chunk,) = batch.prefill
    assert batch.kv_copies == ((first.slot, second.slot, 20, 0, None),) and second.slot != first.slot
    assert (chunk.start, chunk.length) == (20, 3) and second.num_cached == 20
    assert s.kv.prefix_hit_tokens_total == 20 and s.kv.prefix_queried_tokens_total == 22 + 23
    s.record(batch, {second: 9})
    # the whole prompt cached: at least one token is still computed, so the hit stops one short
    third = s.add(req(system + [40, 41, 42], "third"))
    s.finish(second, FinishReason.LENGTH)  # 23 positions, a longer entry for the same 20 + [40, 41, 42]
    batch = s.schedule()
    assert batch.kv_copies[0][2] == 22 and batch.prefill[0].start == 22 and batch.prefill[0].length == 1
    s.record(batch, {third: 9})
    s.finish(third, FinishReason.CANCELLED)  # not kept: a cancelled request's K/V may be incomplete
    assert len(s.kv.prefix_cache) == 2 and balanced(s)
    assert s.kv.drop_prefix_cache() == 2 and s.kv.pages_used == 0 and s.kv.slots.used == 0


def test_entries_are_evicted_lru_when_admission_needs_their_blocks_or_slots():
    rel = Released()
    s = Scheduler(num_slots=3, max_queue=10, token_budget=64, min_prefill_chunk=1, max_batch=1,
                  kv_pages=8, kv_page_tokens=4, prefix_cache=PrefixCache(block=4), release=rel)
    out = {}
    done = []
    for i in range(3):  # three finished requests of 11 tokens (3 blocks each) -> entries, LRU order
        seq = s.add(req(range(100 * i + 1, 100 * i + 12), f"e{i}"))
        run_step(s, out)
        s.finish(seq, FinishReason.EOS)
        done.append(seq)
    # 8 blocks: the third entry already needed the first one's blocks
    assert [e.slot for e in s.kv.prefix_cache.entries()] == [done[1].slot, done[2].slot]
    assert rel.calls[-1] == (done[0].slot, 12)
    s.kv.prefix_cache.touch(s.kv.prefix_cache.entries()[0])  # e1 used again: e2 is now the oldest
    big = s.add(req(range(500, 520), "big"))  # 5 blocks: one entry must go
    run_step(s, out)
    assert big.status is SeqStatus.RUNNING
    assert [e.tokens[0] for e in s.kv.prefix_cache.entries()] == [101]
    assert balanced(s) and s.kv.pages_used <= 8


def test_an_entry_being_copied_from_is_not_evicted_in_the_same_step():
    s = Scheduler(num_slots=3, max_queue=10, token_budget=64, min_prefill_chunk=1, max_batch=2,
                  kv_pages=7, kv_page_tokens=4, prefix_cache=PrefixCache(block=4))
    out = {}
    seq = s.add(req(range(1, 12), "src"))
    run_step(s, out)
    s.finish(seq, FinishReason.EOS)  # entry: 3 blocks
    a = s.add(req(list(range(1, 9)) + [50], "a"))  # hits 8 positions: 3 blocks of its own
    b = s.add(req(range(200, 212), "b"))  # would need the entry's blocks
    batch = s.schedule()
    assert [c.seq for c in batch.prefill] == [a] and batch.kv_copies and b.status is SeqStatus.WAITING
    s.record(batch, {a: 1})
    batch = s.schedule()  # the copy has run: now the entry may go
    assert [c.seq for c in batch.prefill] == [b] and len(s.kv.prefix_cache) == 0


def test_overlapped_steps_preempt_and_resume_with_every_token_and_never_prefill_an_unknown_one():
    """The engine's overlapped loop, by hand: step k is scheduled and advanced before step k-1's tokens
    are recorded. Preemption then meets sequences whose newest token is still in flight: each must
    resume with it (recorded while it waits), and no prefill chunk may reach past the tokens known
    when it is scheduled (its ids could not be built)."""
    s = Scheduler(num_slots=4, max_queue=10, token_budget=64, min_prefill_chunk=1, kv_pages=6, kv_page_tokens=4)
    seqs = [s.add(req(range(10 * i + 1, 10 * i + 5), f"r{i}")) for i in range(3)]
    counter = iter(range(1000))
    outputs, preempted, in_flight = {}, [], None
    for _ in range(80):
        batch = s.schedule()
        for c in batch.prefill:
            assert c.start + c.length <= len(c.seq.all_tokens), f"{c.seq.request_id} prefilled past its known tokens"
        s.advance(InFlight(batch))
        preempted += batch.preempted
        if in_flight is not None:  # the step before this one, read back now
            done, toks = in_flight
            s.record(done, toks)
            for seq, t in toks.items():
                outputs.setdefault(seq.request_id, []).append(t)
                if len(seq.output_ids) == 6 and seq.status is not SeqStatus.FINISHED:
                    s.finish(seq, FinishReason.LENGTH)
        in_flight = (batch, {seq: 100 + next(counter) for seq in batch.sampled()})
        assert s.kv.pages_used <= 6 and balanced(s)
        if not s.num_unfinished:
            break
    assert preempted and any(p.resume_len > p.prompt_len for p in preempted)
    for seq in seqs:
        assert seq.status is SeqStatus.FINISHED and len(seq.output_ids) == 6
        # every token recorded once, in order; tokens sampled for a finished sequence's extra row are dropped
        assert outputs[seq.request_id][:6] == seq.output_ids


def test_a_sequence_preempted_by_a_step_is_not_readmitted_by_the_same_step():
    """Random small budgets (seeded): preemption happens, yet no step prefills a sequence it has just
    preempted (that chunk would be lost at the running ones' next block), and every request still
    gets all its tokens."""
    import random

    preempted_total = 0
    for trial in range(40):
        rng = random.Random(trial)
        bt = rng.choice([2, 4])
        specs = [(rng.randint(1, 2 * bt), rng.randint(3, 12)) for _ in range(rng.randint(2, 5))]  # prompt, new
        fits = max(-(-(p + n) // bt) for p, n in specs)  # blocks of the longest request: the budget holds it
        s = Scheduler(num_slots=6, max_queue=20, token_budget=rng.choice([4, 8, 64]), min_prefill_chunk=1,
                      kv_pages=fits + rng.randint(0, 4), kv_page_tokens=bt)
        seqs = [s.add(req(range(10 * i + 1, 10 * i + 1 + p), f"r{i}")) for i, (p, _) in enumerate(specs)]
        wanted = {q: n for q, (_, n) in zip(seqs, specs)}
        outputs = {}
        for _ in range(400):
            b = run_step(s, outputs)
            preempted_total += len(b.preempted)
            assert not [c.seq.request_id for c in b.prefill if c.seq in b.preempted], f"trial {trial}"
            for q in b.sampled():
                if len(q.output_ids) == wanted[q]:
                    s.finish(q, FinishReason.LENGTH)
            if not s.num_unfinished:
                break
        assert all(len(q.output_ids) == wanted[q] for q in seqs), f"trial {trial}"
    assert preempted_total > 20


def test_sliding_layers_hand_back_pages_below_their_window_and_are_charged_what_they_hold():
    """Layers (6, 0, 6): a page is 4 positions of one layer; the global layer holds every position
    written, the two sliding ones only from the page holding the window's first key on. Each
    schedule hands back what the next query's window no longer covers, and the charge follows."""
    rel = Released()
    pc = PrefixCache(block=4)
    s = Scheduler(num_slots=4, max_queue=10, token_budget=64, min_prefill_chunk=1, kv_pages=100,
                  kv_page_tokens=4, prefix_cache=pc, release=rel, layer_windows=(6, 0, 6))
    assert s.kv.page_weight == 3 and [(c.window, c.layers, c.weight) for c in s.kv.classes] == [(0, (1,), 1),
                                                                                                (6, (0, 2), 2)]
    system = list(range(1, 13))
    a = s.add(req(system, "a"))  # 12 tokens, finishes at once: an entry holding every key
    run_step(s, {})
    s.finish(a, FinishReason.EOS)
    b = s.add(req(system + list(range(50, 58)), "b"))  # 20 tokens: hits a's 12
    batch = s.schedule()
    # the sliding layers' copy starts on the page of the first key position 12's window reads (12 - 6 + 1 = 7)
    assert batch.kv_copies == ((a.slot, b.slot, 12, 0, (1,)), (a.slot, b.slot, 12, 4, (0, 2)))
    assert s.kv.held(b) == 5 + 2 * (5 - 1)
    s.record(batch, {b: 100})
    counter = iter(range(101, 1000))
    for _ in range(20):
        q = b.num_cached  # the position this step's decode row queries
        batch = run_step(s, {}, token_of=lambda seq: next(counter))
        dropped = max(0, q - 6 + 1) // 4
        assert s.kv.held(b) == -(-(q + 1) // 4) + 2 * (-(-(q + 1) // 4) - dropped), q
        assert balanced(s)
    q = b.num_cached - 1
    assert q == 39
    windows = [c for c in rel.calls if len(c) == 4]
    # the first decode (position 20) reads keys from 15 on: [4, 12) go; then a page each time the window
    # moves past one, each release going on where the last one ended, up to position 39's: [28, 32)
    assert windows == [(b.slot, 12, 4, (0, 2))] + [(b.slot, end, end - 4, (0, 2)) for end in range(16, 36, 4)]
    s.finish(b, FinishReason.LENGTH)  # 40 cached; its sliding layers dropped keys below 32
    entry = [e for e in pc.entries() if e.slot == b.slot][0]
    assert entry.min_hit == 32 + 6 - 1 and entry.span == 40 and len(pc) == 2
    c = s.add(req(list(entry.tokens[:30]) + [999, 998], "c"))  # 30 shared: needs keys b handed back
    batch = s.schedule()
    assert batch.kv_copies[0][:3] == (a.slot, c.slot, 12) and c.num_cached == 12
    s.record(batch, {c: 5})
    s.finish(c, FinishReason.CANCELLED)
    d = s.add(req(list(entry.tokens) + [7, 7], "d"))  # the whole conversation and more: b's entry serves it
    batch = s.schedule()
    assert batch.kv_copies == ((b.slot, d.slot, 40, 0, (1,)), (b.slot, d.slot, 40, 32, (0, 2)))
    assert s.kv.held(d) == 11 + 2 * (11 - 8) and balanced(s)
    s.record(batch, {d: 5})
    s.finish(d, FinishReason.CANCELLED)
    assert s.kv.drop_prefix_cache() == 2 and s.kv.pages_used == 0
    assert s.kv.pages_allocated_total == s.kv.pages_freed_total


def test_overlapped_steps_never_hand_back_keys_a_launched_step_still_reads():
    """The overlapped loop by hand with layers (5, 0, 5): step k+1 is scheduled (and slides the windows)
    while step k is launched but not read back; no release may reach a key whose window step k or k+1
    still queries (position p reads keys p - 4 .. p), and the charge balances throughout."""
    rel = Released()
    s = Scheduler(num_slots=4, max_queue=10, token_budget=6, min_prefill_chunk=1, kv_pages=200, kv_page_tokens=2,
                  release=rel, layer_windows=(5, 0, 5))
    seqs = [s.add(req(range(10 * i + 1, 10 * i + 4 + 5 * i), f"r{i}")) for i in range(3)]
    counter = iter(range(1000))
    in_flight = []  # launched steps not read back: (batch, tokens, lowest query position per slot)
    released = 0
    for _ in range(80):
        batch = s.schedule()
        lowest = {c.seq.slot: c.start for c in batch.prefill} | {seq.slot: seq.num_cached for seq in batch.decode}
        s.advance(InFlight(batch))
        for slot, upto, *_ in [c for c in rel.calls if len(c) == 4]:
            for *_, queried in in_flight + [(None, None, lowest)]:
                assert slot not in queried or upto <= queried[slot] - 5 + 1
            released += 1
        rel.calls.clear()
        if in_flight:
            done, toks, _ = in_flight.pop(0)
            s.record(done, toks)
            for seq in toks:
                if len(seq.output_ids) == 20 and seq.status is not SeqStatus.FINISHED:
                    s.finish(seq, FinishReason.LENGTH)
        in_flight.append((batch, {seq: 100 + next(counter) for seq in batch.sampled()}, lowest))
        assert balanced(s)
        if not s.num_unfinished:
            break
    assert released > 20
    assert all(seq.status is SeqStatus.FINISHED and len(seq.output_ids) == 20 for seq in seqs)
    assert s.kv.pages_used == 0 and s.kv.pages_allocated_total == s.kv.pages_freed_total
