"""Constrained decoding in the engine with the real SmolLM2 model (float32).

Every output is checked by an independent oracle (jsonschema, lark, re.fullmatch), and greedy tokens
against a reference loop: full-recompute logits, the constraint's mask, argmax. Mixed batches,
load, preemption by recompute, stop strings, logprobs, length limits and cancellation.
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest
import torch

from test_engine_helpers import (  # noqa: F401 - fixtures are used by name
    collect, full_forward_logits, one_torch_thread, running, wait_idle, wait_until)
from lmserve.model.kv_cache import KVCache
from lmserve.server.engine.constraints import Constraint
from lmserve.server.engine.constraints.state import mask_logits
from lmserve.server.engine.errors import RequestValidationError
from lmserve.server.engine.request import FinishReason, Request, SamplingParams

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "height_m": {"type": "number", "minimum": 1.2, "maximum": 2.2},
        "role": {"enum": ["engineer", "doctor", "artist"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 15}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "country": {"type": "string", "maxLength": 20}},
                    "required": ["city"], "additionalProperties": False},
        "nickname": {"type": "string", "maxLength": 10},
    },
    "required": ["name", "age", "role", "skills", "address"],
    "additionalProperties": False,
}
ARITH = 'start: expr\nexpr: term | term " " OP " " term\nterm: NUMBER | "(" expr ")"\nOP: "+" | "-"\nNUMBER: /[0-9]{1,3}/\n'
PHONE = r"\(\d{3}\) \d{3}-\d{4}"


@pytest.fixture(scope="module")
def smol(smollm2_gguf_path):
    from lmserve.model.loader import load_model

    return load_model(smollm2_gguf_path, dtype=torch.float32, device="cpu")


def chat(loaded, text: str) -> list[int]:
    return loaded.tokenizer.encode_chat([{"role": "user", "content": text}])[0]


def params(constraint: Constraint, n: int = 80, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, constraint=constraint, **kw)


def reference(engine, loaded, prompt: list[int], constraint: Constraint, n: int) -> list[int]:
    """Greedy under the constraint by full recompute: logits of the whole sequence, the mask, argmax."""
    state = engine.constraints.compile(constraint).new_state()
    ids, out = list(prompt), []
    eos = set(loaded.tokenizer.eos_ids)
    for _ in range(n):
        logits = full_forward_logits(loaded.model, ids)[-1:].clone()  # [1, V]
        mask_logits(logits, [0], torch.stack([state.mask()]))
        token = int(logits[0].argmax())
        out.append(token)
        if token in eos:
            break
        state.advance(token)
        ids.append(token)
    return out


def text_of(loaded, result) -> str:
    return loaded.tokenizer.decode(result.token_ids, skip_special_tokens=True)


async def test_json_schema_outputs_validate_and_greedy_matches_the_reference(smol):
    jsonschema = pytest.importorskip("jsonschema")
    prompt = chat(smol, "Describe a fictional person as JSON.")
    c = Constraint.json_schema(PERSON)
    with running(smol) as engine:
        greedy, _ = await collect(engine, Request(prompt, params(c, 120)))
        sampled = [await collect(engine, Request(prompt, params(c, 120, temperature=1.0, seed=1)))]
        ref = reference(engine, smol, prompt, c, 24)
    assert greedy.token_ids[:24] == ref
    for res in [greedy] + [r for r, _ in sampled]:
        assert res.finish_reason is FinishReason.EOS, res.text
        jsonschema.validate(json.loads(res.text), PERSON)


async def test_lazy_masks_give_the_tokens_of_full_masks(smol):
    """Greedy constrained rows take their argmax when the constraint allows it and compute their mask only
    where it does not (Sampler.lazy_masks): the tokens are those of every row masked every step, for
    schemas, a regex, a grammar, a choice, with a logit_bias, logprobs, sampled rows beside them, in one
    batch, and alone verifying n-gram drafts (drafts are offered while at most 4 rows decode) against the
    batch's full masks (float32 is batch-invariant, so a difference is the lazy path's)."""
    ask = [chat(smol, q) for q in ("Describe a fictional person as JSON.", "Give a phone number.", "Write a sum.",
                                   "Your favourite colour?", "A JSON object about a cat.", "Repeat: 1 2 3 1 2 3 1 2 3")]
    bias = ((smol.tokenizer.encode('"name')[0], 5.0), (smol.tokenizer.encode(" 4")[0], -100.0))
    reqs = [(ask[0], params(Constraint.json_schema(PERSON), 60)),
            (ask[0], params(Constraint.json_schema(PERSON), 40, logit_bias=bias, logprobs=2)),
            (ask[1], params(Constraint.regex(PHONE), 30)),
            (ask[2], params(Constraint.grammar(ARITH), 30)),
            (ask[2], params(Constraint.grammar(ARITH), 30, temperature=0.9, seed=8)),
            (ask[3], params(Constraint.choice(["red", "green", "blue", "dark purple"]))),
            (ask[4], params(Constraint.json_object(), 40)),
            (ask[5], params(Constraint.regex(r"( ?[1-3]){1,30}"), 40))]

    async def outputs(engine, alone: bool) -> list:
        if alone:
            results = [(await collect(engine, Request(p, sp)))[0] for p, sp in reqs]
        else:
            results = [r for r, _ in await asyncio.gather(*(collect(engine, Request(p, sp)) for p, sp in reqs))]
        return [(r.token_ids, r.logprobs) for r in results]

    for speculation in ("off", "ngram"):
        with running(smol, prefix_cache=False, speculation=speculation) as engine:
            masks = engine.constraints.worker
            before = masks.computed
            lazy = await outputs(engine, alone=speculation == "ngram")
            lazy_masks = masks.computed - before
            engine.runner.sampler.lazy_masks = False
            before = masks.computed
            full = await outputs(engine, alone=False)
            full_masks = masks.computed - before
            drafted = engine.stats().drafted_tokens_total
        assert lazy == full, speculation
        assert lazy_masks < 0.75 * full_masks, (lazy_masks, full_masks)  # the lazy path was taken
        assert (drafted > 0) == (speculation == "ngram")


async def test_regex_grammar_and_choice_outputs(smol):
    lark = pytest.importorskip("lark")
    parser = lark.Lark(ARITH, start="start")
    options = ["red", "green", "blue", "dark purple"]
    with running(smol) as engine:
        phone = await collect(engine, Request(chat(smol, "Give a phone number."), params(Constraint.regex(PHONE), 30)))
        arith = await collect(engine, Request(chat(smol, "Write a sum."), params(Constraint.grammar(ARITH), 60,
                                                                                  temperature=0.8, seed=3)))
        pick = await collect(engine, Request(chat(smol, "Your favourite colour?"), params(Constraint.choice(options))))
        tight = await collect(engine, Request(chat(smol, "Your favourite colour?"),
                                              params(Constraint.choice(options), len(pick[0].token_ids))))
        obj = await collect(engine, Request(chat(smol, "A JSON object about a cat."),
                                            params(Constraint.json_object(), 60)))
    for res, _ in (phone, arith, pick):
        assert res.finish_reason is FinishReason.EOS, res.text
    assert re.fullmatch(PHONE, phone[0].text)
    parser.parse(arith[0].text)
    assert pick[0].text in options
    # nothing may follow a choice but the end: the answer ends with it, no end-of-sequence token generated,
    # and so does one whose length limit strikes at its last token
    assert not set(pick[0].token_ids) & set(smol.tokenizer.eos_ids)
    assert tight[0].finish_reason is FinishReason.EOS and tight[0].token_ids == pick[0].token_ids
    if obj[0].finish_reason is FinishReason.EOS:
        assert isinstance(json.loads(obj[0].text), dict)
    else:  # ran out of tokens mid-object: a prefix of one
        assert obj[0].finish_reason is FinishReason.LENGTH and obj[0].text.startswith("{")


async def test_mixed_batch_and_load_give_the_tokens_of_each_request_alone(smol):
    prompts = [chat(smol, q) for q in ("Describe a person as JSON.", "Tell me about Paris.", "A phone number?",
                                       "What is 2+2?", "Name a colour.", "Write a haiku.")]
    reqs = [
        (prompts[0], params(Constraint.json_schema(PERSON), 40)),
        (prompts[1], SamplingParams(max_new_tokens=24)),  # free text
        (prompts[2], params(Constraint.regex(PHONE), 30)),
        (prompts[3], SamplingParams(max_new_tokens=30, temperature=0.7, seed=5)),
        (prompts[4], params(Constraint.choice(["red", "green", "blue"]))),
        (prompts[5], params(Constraint.grammar(ARITH), 30, temperature=0.9, seed=8)),
    ]
    with running(smol) as engine:
        alone = [(await collect(engine, Request(p, sp)))[0].token_ids for p, sp in reqs]
        together = await asyncio.gather(*(collect(engine, Request(p, sp)) for p, sp in reqs * 2))
    for i, (res, _) in enumerate(together):
        assert res.token_ids == alone[i % len(reqs)], i


async def test_preemption_by_recompute_keeps_the_matcher_in_step(smol):
    cfg = smol.config
    page = KVCache(cfg, 1, 64, smol.dtype).bytes_per_page
    prompts = [chat(smol, f"Describe person number {i} as JSON.") for i in range(4)]
    c = Constraint.json_schema(PERSON)
    with running(smol, prefix_cache=False) as engine:
        alone = [(await collect(engine, Request(p, params(c, 24))))[0] for p in prompts]
    with running(smol, max_batch=4, max_model_len=128, kv_cache_gb=10 * page / 2**30, prefix_cache=False) as engine:
        outs = await asyncio.gather(*(collect(engine, Request(p, params(c, 24))) for p in prompts))
        assert engine.stats().preemptions_total > 0
    for (res, chunks), ref in zip(outs, alone):
        assert res.token_ids == ref.token_ids
        assert [t for ch in chunks for t in ch.token_ids] == res.token_ids


async def test_prefix_cache_hit_then_constrained(smol):
    prompt = chat(smol, "Describe a fictional person as JSON.")
    c = Constraint.json_schema(PERSON)
    with running(smol) as engine:
        first, _ = await collect(engine, Request(prompt, params(c, 30)))
        before = engine.stats().prefix_hit_tokens_total
        again, _ = await collect(engine, Request(prompt, params(c, 30)))
        assert engine.stats().prefix_hit_tokens_total > before
    assert again.token_ids == first.token_ids


async def test_stop_strings_length_and_logprobs(smol):
    prompt = chat(smol, "Describe a fictional person as JSON.")
    c = Constraint.json_schema(PERSON)
    with running(smol) as engine:
        full, _ = await collect(engine, Request(prompt, params(c, 40)))
        stopped, _ = await collect(engine, Request(prompt, params(c, 120, stop=('"age"',))))
        short, _ = await collect(engine, Request(prompt, params(c, 5)))
        lp, _ = await collect(engine, Request(prompt, params(c, 8, logprobs=3)))
    assert stopped.finish_reason is FinishReason.STOP and full.text.startswith(stopped.text)
    assert '"age"' not in stopped.text and '"age"' in full.text
    assert short.finish_reason is FinishReason.LENGTH and len(short.token_ids) == 5
    assert lp.token_ids == full.token_ids[:8]
    # the model's own distribution (before the mask): the first token's as a full forward gives it
    model_lp = full_forward_logits(smol.model, prompt)[-1].float().log_softmax(-1)  # [V]
    first = lp.logprobs[0]
    assert first.logprob == pytest.approx(float(model_lp[first.token_id]), abs=1e-4)
    top = model_lp.topk(3)
    assert [t for t, _ in first.top] == top.indices.tolist()


async def test_cancel_a_constrained_request_and_serve_the_next(smol):
    prompt = chat(smol, "Describe a fictional person as JSON.")
    c = Constraint.json_schema(PERSON)
    with running(smol) as engine:
        req = Request(prompt, params(c, 200))
        stream = engine.generate(req)
        await stream.__anext__()
        engine.cancel(req.request_id)
        async for chunk in stream:
            last = chunk
        assert last.finish_reason is FinishReason.CANCELLED
        await wait_idle(engine)
        after, _ = await collect(engine, Request(prompt, params(c, 30)))
        ref, _ = await collect(engine, Request(prompt, params(c, 30)))
    assert after.token_ids == ref.token_ids


def test_bad_constraints_fail_validation_before_queueing(smol):
    with running(smol) as engine:
        for constraint, field in ((Constraint.json_schema({"type": "array", "uniqueItems": True}), "json_schema"),
                                  (Constraint.regex("(unclosed"), "regex")):
            with pytest.raises(RequestValidationError) as e:
                engine.validate(Request(chat(smol, "hi"), params(constraint)))
            assert [f for f, _ in e.value.violations] == [field]
        with pytest.raises(RequestValidationError) as e:
            engine.validate(Request(chat(smol, "hi"), params(Constraint.json_object(), ignore_eos=True)))
        assert [f for f, _ in e.value.violations] == ["ignore_eos"]
        assert engine.stats().waiting == 0


async def test_speculation_under_a_constraint_gives_the_tokens_of_speculation_off(smol):
    """A constrained greedy request verifies drafts too: each verifying row masked as of its place in
    the draft, the matcher rewound to what was kept. The answers copy JSON from the prompt (drafts
    accepted) or leave it (drafts rejected, the matcher rolled back); every output equals speculation
    off, and the first tokens equal the full-recompute reference."""
    record = '{"name": "Ada Lovelace", "age": 36, "role": "engineer", "skills": ["maths", "poetry"], ' \
             '"address": {"city": "London", "country": "England"}}'
    cases = [
        (chat(smol, f"Repeat this JSON exactly:\n{record}"), Constraint.json_schema(PERSON), 80),
        (chat(smol, f"Repeat this JSON exactly:\n{record}"), Constraint.json_object(), 80),
        (chat(smol, "Call (555) 123-4567 or (555) 123-9876. Give one of the numbers."), Constraint.regex(PHONE), 30),
        (chat(smol, "red, green or blue? red, green or blue?"), Constraint.choice(["red", "green", "blue"]), 10),
    ]
    results, stats = {}, {}
    for mode in ("off", "ngram"):
        with running(smol, speculation=mode) as engine:
            results[mode] = [(await collect(engine, Request(p, params(c, n))))[0] for p, c, n in cases]
            stats[mode] = engine.stats()
            if mode == "ngram":
                ref = reference(engine, smol, cases[0][0], cases[0][1], 16)
    for off, on in zip(results["off"], results["ngram"]):
        assert (on.token_ids, on.text, on.finish_reason) == (off.token_ids, off.text, off.finish_reason)
    assert results["ngram"][0].token_ids[:16] == ref
    assert stats["ngram"].accepted_tokens_total > 10  # the copied JSON was drafted and kept
    assert stats["ngram"].drafted_tokens_total > stats["ngram"].accepted_tokens_total  # and some drafts rejected
