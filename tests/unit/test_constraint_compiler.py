"""Constraint compiling, limits, cache and per-request matcher state, on SmolLM2's real vocabulary.

Outputs are produced without a model by walking the masks: at each step a seeded random choice
among the allowed ids (end of sequence as soon as it is allowed). Every walk's text must satisfy
the constraint by an independent oracle: the jsonschema library, lark, re.fullmatch.
"""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from lmserve.model.text.tokenizer import Tokenizer
from lmserve.server.engine.constraints.compiler import ConstraintCompiler
from lmserve.server.engine.constraints.spec import Constraint
from lmserve.server.engine.constraints.state import ConstraintError, ConstraintState, mask_logits, unpack
from lmserve.server.engine.errors import RequestValidationError

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city"], "additionalProperties": False},
        "nick": {"type": "string", "maxLength": 6},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
ARITH = 'start: expr\nexpr: term (("+" | "-") term)*\nterm: NUMBER | "(" expr ")"\nNUMBER: /[0-9]{1,3}/\n'


@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer):
    c = ConstraintCompiler(smollm2_tokenizer)
    yield c
    c.close()


def walk(compiled, tok: Tokenizer, seed: int, max_steps: int = 400) -> str:
    """Text of a random walk over the allowed ids, ended by end of sequence."""
    rng = random.Random(seed)
    state = compiled.new_state()
    eos = set(compiled.vocabulary.eos_ids)
    ids = []
    for _ in range(max_steps):
        allowed = unpack(state.mask()[None], compiled.vocabulary.size)[0].nonzero().flatten()  # [n]
        assert allowed.numel(), "a state with nothing allowed"
        ends = any(state.allowed(t) for t in eos)
        assert ends == state.is_complete, "end of sequence must be allowed exactly when complete"
        if ends:
            return tok.decode(ids)
        token = int(allowed[rng.randrange(allowed.numel())])
        state.advance(token)
        ids.append(token)
    raise AssertionError(f"walk did not finish in {max_steps} steps: {tok.decode(ids)!r}")


def test_json_schema_walks_validate(compiler, smollm2_tokenizer):
    jsonschema = pytest.importorskip("jsonschema")
    compiled = compiler.compile(Constraint.json_schema(PERSON))
    for seed in range(6):
        text = walk(compiled, smollm2_tokenizer, seed)
        jsonschema.validate(json.loads(text), PERSON)


def test_json_schema_outputs_keep_the_schemas_property_order(compiler, smollm2_tokenizer):
    """Properties are written in the order the schema declares them (as OpenAI's structured outputs
    write them), not sorted: every walk's keys come in PERSON's order ('name' before 'age'), and the
    same schema given as text or as a dict is one constraint."""
    order = list(PERSON["properties"])
    assert Constraint.json_schema(PERSON) == Constraint.json_schema(json.dumps(PERSON, indent=2))
    compiled = compiler.compile(Constraint.json_schema(PERSON))
    for seed in range(6):
        keys = list(json.loads(walk(compiled, smollm2_tokenizer, seed)))
        assert keys[:2] == ["name", "age"] and keys == sorted(keys, key=order.index), keys


def test_json_object_accepts_objects_only(compiler, smollm2_tokenizer):
    compiled = compiler.compile(Constraint.json_object())
    for text, ok in (('{"a": [1, 2.5, "x"], "b": {"c": null}}', True), ("[1, 2]", False), ('"s"', False),
                     ('{"a": 1', None)):
        state = compiled.new_state()
        taken = state.count_valid(smollm2_tokenizer.encode(text))
        if ok is False:
            assert taken < len(smollm2_tokenizer.encode(text))
            continue
        for t in smollm2_tokenizer.encode(text):
            state.advance(t)
        assert state.is_complete is bool(ok)


def test_regex_walks_fullmatch(compiler, smollm2_tokenizer):
    for pattern in (r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)( [a-z]{1,5}){0,3}", r"\d+(\.\d{1,2})?e?"):
        compiled = compiler.compile(Constraint.regex(pattern))
        for seed in range(6):
            text = walk(compiled, smollm2_tokenizer, seed)
            assert re.fullmatch(pattern, text), (pattern, text)


def test_grammar_walks_parse_with_lark(compiler, smollm2_tokenizer):
    lark = pytest.importorskip("lark")
    parser = lark.Lark(ARITH, start="start")
    compiled = compiler.compile(Constraint.grammar(ARITH))
    for seed in range(8):
        parser.parse(walk(compiled, smollm2_tokenizer, seed, max_steps=1000))


def test_choice_walks_are_one_option(compiler, smollm2_tokenizer):
    options = ['say "hi"', "naïve ☃", "a\\b", "x\ny", "yes", "yes!"]
    compiled = compiler.compile(Constraint.choice(options))
    seen = {walk(compiled, smollm2_tokenizer, seed) for seed in range(20)}
    assert seen <= set(options) and len(seen) >= 2


def test_end_of_sequence_only_when_complete_and_rollback(compiler, smollm2_tokenizer):
    state = compiler.compile(Constraint.regex("ab(cd)?")).new_state()
    eos = compiler.vocabulary.eos_ids[0]
    start = state.mask().clone()
    assert not state.allowed(eos)
    state.advance(smollm2_tokenizer.encode("a")[0])
    state.advance(smollm2_tokenizer.encode("b")[0])
    assert state.is_complete and state.allowed(eos) and not state.is_finished
    assert state.count_valid(smollm2_tokenizer.encode("cd")) == len(smollm2_tokenizer.encode("cd"))
    assert state.count_valid(smollm2_tokenizer.encode("x")) == 0
    state.rollback(2)
    assert state.tokens == 0 and torch.equal(state.mask(), start)
    with pytest.raises(ConstraintError):
        state.advance(smollm2_tokenizer.encode("z")[0])
    state2 = compiler.compile(Constraint.regex("ab(cd)?")).new_state()
    for t in smollm2_tokenizer.encode("abcd"):
        state2.advance(t)
    allowed = unpack(state2.mask()[None], compiler.vocabulary.size)[0].nonzero().flatten().tolist()
    assert state2.is_finished and set(allowed) <= set(compiler.vocabulary.eos_ids)


LAZY_CASES = [Constraint.json_schema(PERSON), Constraint.regex(r"\(\d{3}\) \d{3}-\d{4}"), Constraint.grammar(ARITH),
              Constraint.choice(["red", "green", "dark purple"]), Constraint.json_object()]


@pytest.mark.parametrize("constraint", LAZY_CASES, ids=[c.kind.value for c in LAZY_CASES])
def test_a_state_computing_masks_on_demand_answers_as_the_mask_does(compiler, constraint):
    """ahead=False (greedy rows): `allowed(t)` asks the matcher about one token (and what the grammar
    forces next) until a mask is asked for. Along a walk, each id a fresh on-demand state is asked
    about answers as the mask's bit: every id the matcher would accept in some split (a superset of
    the mask's), the mask's own, end of sequence, ids outside the vocabulary, and random others."""
    compiled = compiler.compile(constraint)
    ahead = compiled.new_state()
    rng = random.Random(3)
    vocab = compiled.vocabulary.size
    eos = compiled.vocabulary.eos_ids
    for _ in range(40):
        bits = unpack(ahead.mask()[None], vocab)[0]
        allowed = bits.nonzero().flatten().tolist()
        accepted = [t for t in range(vocab) if ahead._m.validate_tokens([t]) == 1]
        probe = {*rng.sample(accepted, min(300, len(accepted))), *allowed[:300], *eos, *rng.sample(range(vocab), 100),
                 vocab, -1}
        for t in sorted(probe):
            lazy = ConstraintState(ahead._m.deep_copy(), compiled.vocabulary, compiler.worker, ahead=False)
            assert lazy.allowed(t) == (0 <= t < vocab and bool(bits[t])), (t, ahead.tokens)
        assert torch.equal(lazy.mask(), ahead.mask())  # asked for: computed here, the same
        # a row's best ids offered in turn: the first the mask allows, or (a fresh on-demand state, the grammar
        # forcing the next bytes) none, the mask's to say
        forced = bool(ahead._m.compute_ff_bytes())
        for n in (1, 3, 8):
            ids = rng.sample(sorted(probe), n)
            want = next((k for k, t in enumerate(ids) if 0 <= t < vocab and bits[t]), None)
            lazy = ConstraintState(ahead._m.deep_copy(), compiled.vocabulary, compiler.worker, ahead=False)
            assert lazy.first_allowed(ids) == (None if forced else want), (ids, ahead.tokens)
            assert ahead.first_allowed(ids) == want, (ids, ahead.tokens)
        text = [t for t in allowed if t not in eos]
        if not text:
            break
        ahead.advance(text[0] if rng.random() < 0.3 else text[rng.randrange(len(text))])


def test_mask_logits_masks_only_constrained_rows(compiler, smollm2_tokenizer):
    state = compiler.compile(Constraint.choice(["42"])).new_state()
    V = compiler.vocabulary.size
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))  # [3, V]
    before = logits.clone()
    mask_logits(logits, [1], torch.stack([state.mask()]))
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = unpack(state.mask()[None], V)[0]
    assert torch.isinf(logits[1][~allowed]).all() and torch.equal(logits[1][allowed], before[1][allowed])
    assert state.allowed(int(logits[1].argmax()))


def test_cache_hits_return_the_compiled_constraint(smollm2_tokenizer, compiler):
    a = compiler.compile(Constraint.json_schema(json.dumps(PERSON)))
    hits = compiler.stats.hits
    b = compiler.compile(Constraint.json_schema(PERSON))  # same content, other spelling: one key
    assert b is a and compiler.stats.hits == hits + 1


def test_cache_is_bounded(smollm2_tokenizer, compiler):
    small = ConstraintCompiler(smollm2_tokenizer, max_entries=3, max_cached_chars=40)
    small._vocab = compiler.vocabulary
    for i in range(6):
        small.compile(Constraint.regex(f"x{i}"))
    assert small.stats.entries == 3 and small.stats.misses == 6
    small.compile(Constraint.regex("y" * 30))
    assert small.stats.source_chars <= 40 and small.stats.entries <= 3
    small.close()


def _refusal(compiler, constraint) -> tuple[str, str]:
    with pytest.raises(RequestValidationError) as e:
        compiler.compile(constraint)
    (field, reason), = e.value.violations
    return field, reason


@pytest.mark.parametrize("constraint, field, words", [
    (Constraint.json_schema({"type": "strin"}), "json_schema", "invalid JSON schema"),
    (Constraint.json_schema({"type": "array", "uniqueItems": True}), "json_schema", "uniqueItems"),
    (Constraint.json_schema("{not json"), "json_schema", "invalid JSON schema"),
    (Constraint.json_schema("[1, 2]"), "json_schema", "invalid JSON schema"),
    (Constraint.regex("a(b"), "regex", "invalid regular expression"),
    (Constraint.regex("[^\\s\\S]"), "regex", "vocabulary"),  # matches nothing at all
    (Constraint.grammar("start: foo\nfoo: ("), "grammar", "invalid grammar"),
    (Constraint.grammar("start: undefined_rule"), "grammar", "invalid grammar"),
    (Constraint.choice([]), "choice.options", "at least one"),
    (Constraint.regex(""), "regex", "empty"),
])
def test_bad_constraints_are_refused_by_field(compiler, constraint, field, words):
    got_field, reason = _refusal(compiler, constraint)
    assert got_field == field and words in reason, reason


def test_size_and_complexity_limits(compiler):
    limits = compiler.limits
    deep: dict = {"type": "integer"}
    for _ in range(limits.max_schema_depth + 5):
        deep = {"type": "array", "items": deep}
    assert "levels deep" in _refusal(compiler, Constraint.json_schema(deep))[1]
    very_deep = "[" * 200_000 + "]" * 200_000  # deeper than Python's JSON parser recurses
    assert "at most" in _refusal(compiler, Constraint.json_schema(very_deep))[1]
    assert "at most" in _refusal(compiler, Constraint.regex("a" * (limits.max_regex_chars + 1)))[1]
    rules = "start: r0\n" + "".join(f"r{i}: \"x\" r{i + 1}\n" for i in range(limits.max_grammar_rules + 1))
    assert "rules" in _refusal(compiler, Constraint.grammar(rules))[1]
    field, reason = _refusal(compiler, Constraint.choice(["x" * (limits.max_choice_chars + 1)]))
    assert field == "choice.options[0]"
    # a schema bomb: alternatives that multiply (6^8 combinations of properties)
    bomb = {"allOf": [{"anyOf": [{"type": "object", "properties": {f"k{j}{i}": {"type": "integer"}}}
                                 for i in range(6)]} for j in range(8)]}
    assert "too complex" in _refusal(compiler, Constraint.json_schema(bomb))[1]


def test_redos_regexes_compile_and_stay_exact(compiler, smollm2_tokenizer):
    # catastrophic for a backtracking engine; the library's automaton has no backtracking
    for pattern in (r"(a+)+b", r"(x+x+)+y", r"(a|aa)+c", r"((ab)*)*c"):
        compiled = compiler.compile(Constraint.regex(pattern))
        text = walk(compiled, smollm2_tokenizer, seed=1, max_steps=600)
        assert re.fullmatch(pattern, text)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sampler_masks_greedy_rows_by_reading_and_the_others_in_place(compiler, native_kernels_dir, monkeypatch,
                                                                         dtype):
    """Constrained rows through the Sampler with the native passes loaded (a greedy row's next best ids offered
    to its constraint before a mask, its maximum read over its allowed ids, its logits left as they were; a
    sampled or penalised row masked in place), with every row's mask applied, and on the torch path (every
    masked row written, then read): step after step the same tokens and logprobs, each token one the
    constraint allows, a greedy row's the first argmax of its logits masked id by id."""
    from lmserve.model.native import build as native
    from lmserve.server.engine import row_max as RM
    from lmserve.server.engine import sampler as SM
    from lmserve.server.engine.constraints import state as ST
    from lmserve.server.engine.request import Request, SamplingParams, ValidRequest
    from lmserve.server.engine.sequence import Sequence

    lib, why = native.load(native_kernels_dir)
    assert lib is not None, why
    compiled = [compiler.compile(Constraint.json_schema(PERSON)), compiler.compile(Constraint.grammar(ARITH))]
    kinds = [SamplingParams(max_new_tokens=64), SamplingParams(max_new_tokens=64, logprobs=3),
             SamplingParams(max_new_tokens=64, temperature=0.9, seed=4),
             SamplingParams(max_new_tokens=64, repetition_penalty=1.3)]
    V = compiler.vocabulary.size

    def decode(native_on: bool, lazy: bool = True) -> tuple[list, list]:
        monkeypatch.setattr(native, "_BOUND", {} if native_on else {RM._NativeRows: None, ST._NativeMask: None})
        assert (RM.masked_rows_max(torch.zeros(1, V), [0], torch.full((1, (V + 31) // 32), -1, dtype=torch.int32))
                is not None) == native_on
        seqs = [Sequence(ValidRequest.of(Request([1, 2, 3], p), c)) for c in compiled for p in kinds]
        for s in seqs:  # as the sampler makes them (a greedy row's mask on demand), made here to read the masks
            s.constraint = s.request.compiled.new_state(ahead=not SM._greedy_argmax(s.request.params))
        gen = torch.Generator().manual_seed(2)
        sampler, tokens, logprobs = SM.Sampler(lazy_masks=lazy), [], []
        for _ in range(24):
            live = [s for s in seqs if not s.constraint.is_finished]
            if not live:
                break
            logits = (torch.randn(len(live), V, generator=gen) * 3).round().to(dtype)
            logits[:, :300] += 2  # ties and near-ties among ids the grammar allows (digits, punctuation)
            allowed = [unpack(s.constraint.mask()[None], V)[0] for s in live]
            before = logits.clone()
            out = sampler(logits, live)
            for i, (s, t) in enumerate(zip(live, out.token_ids)):
                assert out.ok[i] and allowed[i][t]
                if SM._greedy_argmax(s.request.params):
                    assert t == int(before[i].float().masked_fill(~allowed[i], float("-inf")).argmax())
                    if native_on:
                        assert torch.equal(logits[i], before[i])  # read, not written
                s.output_ids.append(t)
            tokens.append(out.token_ids)
            logprobs.append(out.logprobs)
        return tokens, logprobs

    (tokens, logprobs), (torch_tokens, torch_logprobs) = decode(True), decode(False)
    assert tokens == torch_tokens == decode(True, lazy=False)[0] and len(tokens) >= 8
    for step, torch_step in zip(logprobs, torch_logprobs):  # the model's, within float32 rounding (the top's
        for a, b in zip(step, torch_step):                   # tied ids may come in another order)
            assert (a is None) == (b is None)
            if a is not None:
                assert [a[0], *(v for _, v in a[1])] == pytest.approx([b[0], *(v for _, v in b[1])], abs=2e-5)
