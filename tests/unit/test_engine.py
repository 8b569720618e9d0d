"""Engine end to end on CPU: greedy against a full-recompute oracle, the trained model's corpus,
streamed text, logprobs, stop strings and stop ids, eos handling, lengths, usage and seeds."""

from __future__ import annotations

import random

import pytest
import torch

from lmserve.server.engine import EngineUnavailableError, Engine
from lmserve.server.engine.errors import RequestValidationError
from lmserve.server.engine.request import FinishReason, Request, SamplingParams
from lmserve.server.engine.settings import EngineSettings
from test_engine_helpers import (  # noqa: F401 - fixtures are used by name
    collect, corpus_prompt, one_torch_thread, full_forward_logits, greedy, greedy_reference, prompt_continuations, random_prompt,
    random_tiny, results_of, running, trained,
)


def model_named(request, name):
    return request.getfixturevalue(name)


def decoded_suffix(tokenizer, prompt, out):
    """Text `out` adds to `prompt`, by whole-sequence decoding (independent of the streaming detokenizer)."""
    before = tokenizer.decode(prompt, skip_special_tokens=True)
    after = tokenizer.decode(prompt + out, skip_special_tokens=True)
    assert after.startswith(before)
    return after[len(before):]


def token_pieces(tokenizer, prompt, out):
    """The text each generated token adds, by whole-sequence decoding."""
    return [decoded_suffix(tokenizer, prompt + out[:k], [out[k]]) for k in range(len(out))]


# ---- greedy through the engine == the oracle ---------------------------------------------------

@pytest.mark.parametrize("model_name", ["trained", "random_tiny"])
async def test_greedy_equals_full_recompute(request, model_name):
    loaded = model_named(request, model_name)
    tok, vocab = loaded.tokenizer, loaded.config.vocab_size
    rng = random.Random(1)
    prompts = [corpus_prompt(tok, "The lighthouse keeper"), corpus_prompt(tok, "A red fox lived under")]
    prompts += [random_prompt(rng, n, vocab) for n in (1, 2, 7, 33)]
    max_new = 24
    eos = tuple(tok.eos_ids)
    refs = [greedy_reference(loaded.model, p, max_new, stop_ids=eos)[0] for p in prompts]
    with running(loaded, max_batch=8) as engine:
        results = await results_of(engine, [Request(p, greedy(max_new)) for p in prompts])
    for prompt, ref, res in zip(prompts, refs, results):
        assert res.token_ids == ref, f"prompt of {len(prompt)} tokens"
        expected = FinishReason.EOS if ref[-1] in eos else FinishReason.LENGTH
        assert res.finish_reason is expected
        assert res.usage.prompt_tokens == len(prompt) and res.usage.completion_tokens == len(ref)


async def test_trained_model_reproduces_its_corpus(trained):
    tok = trained.tokenizer
    pairs = prompt_continuations()
    prompts = [corpus_prompt(tok, prefix) for prefix, _ in pairs]
    with running(trained, max_batch=len(prompts)) as engine:
        results = await results_of(engine, [Request(p, greedy(120 - len(p))) for p in prompts])
    for (prefix, continuation), prompt, res in zip(pairs, prompts, results):
        assert res.text == continuation, prefix
        assert res.finish_reason is FinishReason.EOS
        assert res.token_ids[-1] in tok.eos_ids
        assert res.usage.completion_tokens == len(res.token_ids)
        assert res.usage.prompt_tokens == len(prompt)


# ---- streaming and logprobs --------------------------------------------------------------------

async def test_streamed_chunks_concatenate_to_the_decoded_text(trained):
    tok = trained.tokenizer
    prompts = [corpus_prompt(tok, p) for p in ("Tea time in", "Numbers are patient", "On the far side")]
    with running(trained) as engine:
        for prompt in prompts:
            res, chunks = await collect(engine, Request(prompt, greedy(100)))
            assert [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]
            # a reader that keeps up gets a token per chunk; one that falls behind gets them merged
            assert all(len(c.token_ids) >= 1 for c in chunks)
            assert sum(len(c.token_ids) for c in chunks) == len(res.token_ids)
            assert "".join(c.text for c in chunks) == res.text
            assert res.text == decoded_suffix(tok, prompt, res.token_ids)
            assert "\ufffd" not in res.text
            assert chunks[-1].usage is not None and chunks[-1].timings is not None
            assert all(c.usage is None for c in chunks[:-1])
            t = res.timings
            assert 0 <= t.queue_seconds <= t.time_to_first_token_seconds <= t.total_seconds


@pytest.mark.parametrize("model_name", ["trained", "random_tiny"])
async def test_logprobs_are_log_softmax_of_the_full_recompute_logits(request, model_name):
    loaded = model_named(request, model_name)
    tok = loaded.tokenizer
    prompt = corpus_prompt(tok, "A red fox")
    n_top = 5
    with running(loaded) as engine:
        res, _ = await collect(engine, Request(prompt, greedy(12, logprobs=n_top, ignore_eos=True)))
        bare, _ = await collect(engine, Request(prompt, greedy(12, logprobs=0, ignore_eos=True)))
        none, chunks = await collect(engine, Request(prompt, greedy(12, ignore_eos=True)))
    ref, rows = greedy_reference(loaded.model, prompt, 12)
    assert res.token_ids == ref == bare.token_ids == none.token_ids
    assert len(res.logprobs) == len(ref) and len(bare.logprobs) == len(ref)
    for tok_id, row, lp, lp0 in zip(ref, rows, res.logprobs, bare.logprobs):
        ref_lsm = row.float().log_softmax(-1)
        assert lp.token_id == tok_id == lp0.token_id
        assert lp.logprob == pytest.approx(float(ref_lsm[tok_id]), abs=1e-4)
        assert lp0.logprob == pytest.approx(lp.logprob, abs=1e-6) and lp0.top == ()
        assert len(lp.top) == n_top
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert values[0] == pytest.approx(float(ref_lsm.max()), abs=1e-4)
        for top_id, top_lp in lp.top:
            assert top_lp == pytest.approx(float(ref_lsm[top_id]), abs=1e-4)
        # nothing outside the reported top n beats its last entry
        assert float(ref_lsm.topk(n_top).values[-1]) == pytest.approx(values[-1], abs=1e-4)
    assert none.logprobs == [] and all(c.logprobs == () for c in chunks)


# ---- stop conditions ---------------------------------------------------------------------------

async def test_stop_string_spanning_two_tokens_cuts_the_text_before_it(trained):
    tok = trained.tokenizer
    prompt = corpus_prompt(tok, "On the far side of the")
    with running(trained) as engine:
        free, _ = await collect(engine, Request(prompt, greedy(100)))
        out = free.token_ids
        pieces = token_pieces(tok, prompt, out)
        text = "".join(pieces)
        assert text == free.text
        # a stop string made of the last 2 chars of token k and the first 2 of token k+1
        offsets = [sum(len(p) for p in pieces[:k]) for k in range(len(pieces) + 1)]
        choice = None
        for k in range(3, len(pieces) - 2):
            if len(pieces[k]) >= 2 and len(pieces[k + 1]) >= 2:
                stop = pieces[k][-2:] + pieces[k + 1][:2]
                if text.find(stop) == offsets[k + 1] - 2:  # its first occurrence is this one
                    choice = (k, stop)
                    break
        assert choice is not None, "no stop string spanning a token boundary in the output"
        k, stop = choice
        cut = offsets[k + 1] - 2
        assert offsets[k] <= cut < offsets[k + 1] < cut + len(stop) <= offsets[k + 2]  # spans tokens k and k+1
        later = text[offsets[k + 2] + 4: offsets[k + 2] + 9]  # another stop that matches only later
        assert later and text.find(later) > cut
        params = greedy(100, stop=("never-in-the-text", later, stop))
        res, chunks = await collect(engine, Request(prompt, params))
    assert res.finish_reason is FinishReason.STOP
    assert res.matched_stop == stop
    assert res.text == text[:cut]
    assert all(stop not in c.text for c in chunks) and stop not in res.text
    assert res.token_ids == out[: k + 2]  # generation ends with the token that completed the stop
    assert res.usage.completion_tokens == k + 2


async def test_stop_prefix_that_never_completes_changes_nothing(trained):
    tok = trained.tokenizer
    prompt = corpus_prompt(tok, "The lighthouse")
    with running(trained) as engine:
        free, _ = await collect(engine, Request(prompt, greedy(100)))
        word = free.text.split()[2]
        res, chunks = await collect(engine, Request(prompt, greedy(100, stop=(word + "\u2603",))))
    assert res.text == free.text and res.token_ids == free.token_ids
    assert res.finish_reason is FinishReason.EOS and res.matched_stop is None


async def test_stop_token_id_ends_generation_after_that_token(trained):
    tok = trained.tokenizer
    prompt = corpus_prompt(tok, "The lighthouse keeper climbed")
    ref, _ = greedy_reference(trained.model, prompt, 30)
    j = next(j for j in range(3, len(ref)) if ref[j] not in ref[:j])
    with running(trained) as engine:
        res, chunks = await collect(engine, Request(prompt, greedy(30, stop_token_ids=(ref[j],))))
    assert res.finish_reason is FinishReason.EOS
    assert res.token_ids == ref[: j + 1]
    assert res.usage.completion_tokens == j + 1
    assert chunks[-1].token_ids[-1] == ref[j]  # the stop token ends the stream and adds no text (below)
    assert res.text == decoded_suffix(tok, prompt, ref[:j])


async def test_eos_ends_generation_unless_ignored(trained):
    tok = trained.tokenizer
    prompt = corpus_prompt(tok, "Numbers are patient")
    ref, _ = greedy_reference(trained.model, prompt, 100, stop_ids=tuple(tok.eos_ids))
    assert ref[-1] in tok.eos_ids
    n = len(ref)
    beyond, _ = greedy_reference(trained.model, prompt, n + 6)  # keeps going past the eos
    with running(trained) as engine:
        stopped, _ = await collect(engine, Request(prompt, greedy(100)))
        ignored, _ = await collect(engine, Request(prompt, greedy(n + 6, ignore_eos=True)))
    assert stopped.finish_reason is FinishReason.EOS and stopped.token_ids == ref
    assert ignored.finish_reason is FinishReason.LENGTH
    assert ignored.token_ids == beyond and len(ignored.token_ids) == n + 6
    assert ignored.token_ids[n - 1] in tok.eos_ids
    # the eos is a special token: it adds no text, what follows it does
    assert ignored.text == decoded_suffix(tok, prompt, ignored.token_ids)
    assert ignored.text.startswith(stopped.text)


@pytest.mark.parametrize("max_new", [1, 2, 13])
async def test_max_new_tokens_finishes_with_length(random_tiny, max_new):
    prompt = random_prompt(random.Random(max_new), 6, random_tiny.config.vocab_size)
    with running(random_tiny) as engine:
        res, chunks = await collect(engine, Request(prompt, greedy(max_new, ignore_eos=True)))
    assert res.finish_reason is FinishReason.LENGTH
    assert len(res.token_ids) == res.usage.completion_tokens == max_new
    assert res.usage.prompt_tokens == 6
    assert sum(len(c.token_ids) for c in chunks) == max_new and 1 <= len(chunks) <= max_new


async def test_request_filling_the_context_ends_with_length(random_tiny):
    ctx = 40
    prompt = random_prompt(random.Random(3), ctx - 5, random_tiny.config.vocab_size)
    with running(random_tiny, max_model_len=ctx) as engine:
        assert engine.max_model_len == ctx
        res, _ = await collect(engine, Request(prompt, greedy(5, ignore_eos=True)))
        with pytest.raises(RequestValidationError) as err:
            engine.generate(Request(prompt, greedy(6)))
    assert res.finish_reason is FinishReason.LENGTH and len(res.token_ids) == 5
    assert res.token_ids == greedy_reference(random_tiny.model, prompt, 5)[0]
    assert [f for f, _ in err.value.violations] == ["max_new_tokens"]


# ---- seeds -------------------------------------------------------------------------------------

def sampled(seed, max_new=20, **kw):
    return SamplingParams(max_new_tokens=max_new, temperature=1.0, seed=seed, ignore_eos=True, **kw)


async def test_same_seed_same_tokens_alone_and_in_a_busy_batch(random_tiny):
    vocab = random_tiny.config.vocab_size
    rng = random.Random(11)
    prompt = random_prompt(rng, 8, vocab)
    noise = [Request(random_prompt(rng, rng.randint(1, 30), vocab),
                     sampled(1000 + i, rng.randint(3, 30)) if i % 2 else greedy(rng.randint(3, 30)))
             for i in range(12)]
    with running(random_tiny, max_batch=16) as engine:
        alone, _ = await collect(engine, Request(prompt, sampled(1234)))
        again, _ = await collect(engine, Request(prompt, sampled(1234)))
        busy = await results_of(engine, [*noise[:6], Request(prompt, sampled(1234)), *noise[6:]])
        other_seed, _ = await collect(engine, Request(prompt, sampled(4321)))
        unseeded = [(await collect(engine, Request(prompt, sampled(None))))[0] for _ in range(2)]
    assert len(alone.token_ids) == 20
    assert again.token_ids == alone.token_ids
    assert busy[6].token_ids == alone.token_ids
    # a random model's flat distribution makes a 20-token collision essentially impossible
    assert other_seed.token_ids != alone.token_ids
    assert unseeded[0].token_ids != unseeded[1].token_ids
    assert alone.token_ids != greedy_reference(random_tiny.model, prompt, 20)[0]  # it did sample


async def test_top_k_one_sampling_is_greedy(random_tiny):
    prompt = random_prompt(random.Random(2), 5, random_tiny.config.vocab_size)
    with running(random_tiny) as engine:
        res, _ = await collect(engine, Request(prompt, sampled(99, top_k=1)))
    assert res.token_ids == greedy_reference(random_tiny.model, prompt, 20)[0]


# ---- submission errors -------------------------------------------------------------------------

async def test_bad_requests_raise_at_submission(random_tiny):
    vocab = random_tiny.config.vocab_size
    with running(random_tiny) as engine:
        with pytest.raises(RequestValidationError) as err:
            engine.generate(Request([], greedy(4)))
        assert ("prompt" in [f for f, _ in err.value.violations])
        with pytest.raises(RequestValidationError) as err:
            engine.generate(Request([5, vocab], SamplingParams(max_new_tokens=4, top_p=0.0)))
        assert sorted(f for f, _ in err.value.violations) == ["token_ids", "top_p"]
        # a request id already in flight is refused; the first request is unaffected
        first = engine.generate(Request([5, 6, 7], greedy(8, ignore_eos=True), request_id="dup"))
        with pytest.raises(RequestValidationError) as err:
            engine.generate(Request([5, 6], greedy(4), request_id="dup"))
        assert [f for f, _ in err.value.violations] == ["request_id"]
        tokens = [t async for c in first for t in c.token_ids]
        assert tokens == greedy_reference(random_tiny.model, [5, 6, 7], 8)[0]
        assert engine.stats().steps > 0


async def test_engine_not_started_or_shut_down_refuses_requests(random_tiny):
    engine = Engine(random_tiny, EngineSettings(max_batch=2))
    assert not engine.health().alive
    with pytest.raises(EngineUnavailableError):
        engine.generate(Request([5, 6], greedy(2)))
    engine.start()
    res, _ = await collect(engine, Request([5, 6], greedy(2)))
    assert res.finish_reason is FinishReason.LENGTH
    engine.shutdown()
    assert not engine.health().alive
    with pytest.raises(EngineUnavailableError):
        engine.generate(Request([5, 6], greedy(2)))


def test_logits_oracle_is_position_consistent(random_tiny):
    """The oracle itself: a prefix's logits do not depend on what follows it (causality)."""
    ids = random_prompt(random.Random(0), 12, random_tiny.config.vocab_size)
    full = full_forward_logits(random_tiny.model, ids)
    part = full_forward_logits(random_tiny.model, ids[:7])
    torch.testing.assert_close(full[:7], part, rtol=1e-5, atol=1e-5)


async def test_max_new_tokens_cap_comes_from_the_settings(random_tiny):
    with running(random_tiny, max_new_tokens_cap=8) as engine:
        with pytest.raises(RequestValidationError) as err:
            engine.generate(Request([5, 6], greedy(9)))
        res, _ = await collect(engine, Request([5, 6], greedy(8, ignore_eos=True)))
    assert [f for f, _ in err.value.violations] == ["max_new_tokens"] and "8" in str(err.value)
    assert len(res.token_ids) == 8


def penalized_greedy_reference(model, prompt, max_new, rep, presence, frequency):
    """Greedy over full-recompute logits with the penalties applied by hand: repetition (HF rule) over
    prompt and output, presence and frequency over the output only."""
    out: list[int] = []
    for _ in range(max_new):
        logits = full_forward_logits(model, prompt + out)[-1].clone()  # [V]
        for t in set(prompt) | set(out):
            logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
        for t in set(out):
            logits[t] -= frequency * out.count(t) + presence
        out.append(int(logits.argmax()))
    return out


async def test_penalties_see_the_prompt_and_the_tokens_generated_so_far(random_tiny):
    rng = random.Random(21)
    prompts = [random_prompt(rng, n, random_tiny.config.vocab_size) for n in (3, 12)]
    kw = dict(repetition_penalty=1.6, presence_penalty=0.7, frequency_penalty=0.4)
    refs = [penalized_greedy_reference(random_tiny.model, p, 30, 1.6, 0.7, 0.4) for p in prompts]
    with running(random_tiny) as engine:
        results = await results_of(engine, [Request(p, greedy(30, ignore_eos=True, **kw)) for p in prompts]
                                   + [Request(prompts[0], greedy(30, ignore_eos=True))])
    assert [r.token_ids for r in results[:2]] == refs
    assert results[2].token_ids != refs[0]  # the penalties changed the choice somewhere


async def test_kv_budget_limits_the_blocks_held_not_the_slots_and_everyone_still_finishes(random_tiny):
    """A budget of 2.5 full-length requests: all eight requests may be admitted (max_batch), but only the
    blocks of two at a time are held (the tiny model's page holds 64 positions: one block per request);
    the others wait or are preempted, and every result is still the reference's."""
    from lmserve.model.kv_cache import KVCache

    cfg = random_tiny.config
    per_slot = KVCache.bytes_per_token(cfg, random_tiny.dtype) * 64
    budget = 2 * per_slot + per_slot // 2
    rng = random.Random(17)
    prompts = [random_prompt(rng, rng.randint(1, 20), cfg.vocab_size) for _ in range(6)]
    with running(random_tiny, max_batch=8, max_model_len=64, prefix_cache=False, kv_cache_gb=budget / 2**30) as engine:
        st = engine.stats()
        assert (st.max_batch, st.kv_pages_capacity, st.kv_cache_bytes) == (8, 2, budget)
        results = await results_of(engine, [Request(p, greedy(10, ignore_eos=True)) for p in prompts])
        st = engine.stats()
    for res, p in zip(results, prompts):
        assert res.token_ids == greedy_reference(random_tiny.model, p, 10)[0]
    assert st.kv_pages_used == 0 and st.kv_pages_allocated_total == st.kv_pages_freed_total > 0
    with pytest.raises(ValueError, match="holds no request of 64 tokens"):
        Engine(random_tiny, EngineSettings(max_model_len=64, kv_cache_gb=(per_slot - 1) / 2**30))


def test_context_length_is_bounded_by_the_model(random_tiny):
    engine = Engine(random_tiny, EngineSettings(max_batch=1, max_model_len=100_000))
    assert engine.max_model_len == random_tiny.config.max_position_embeddings
    assert Engine(random_tiny, EngineSettings(max_batch=1, max_model_len=50)).max_model_len == 50
