"""The tokenizer -> matcher vocabulary bridge, on SmolLM2's byte-level BPE and on a sentencepiece
vocabulary with byte fallback (the project's own trained model)."""

from __future__ import annotations

import pytest
import torch

from lmserve.model.text.tokenizer import Tokenizer
from lmserve.server.engine.constraints.vocabulary import SPECIAL_MARK, build_vocabulary, token_bytes_of

MULTIBYTE = "naïve café — 你好，世界 🌍🍵"


@pytest.fixture(scope="module")
def smol_vocab(smollm2_tokenizer):
    return build_vocabulary(smollm2_tokenizer, logits_size=smollm2_tokenizer.vocab_size + 64)


def test_byte_level_tokens_concatenate_to_the_text_bytes(smollm2_tokenizer):
    table = token_bytes_of(smollm2_tokenizer)
    for text in (MULTIBYTE, '{"name": "Zoë", "tags": ["a"]}', "x\n\ty"):
        ids = smollm2_tokenizer.encode(text)
        assert b"".join(table[i] for i in ids) == text.encode("utf-8")
    split = [i for i in smollm2_tokenizer.encode("🌍🍵") if _not_utf8(table[i])]
    assert split, "expected the emoji to be spelled with tokens that split a character"


def test_special_ids_are_marked_and_text_ids_are_not(smollm2_tokenizer):
    table = token_bytes_of(smollm2_tokenizer)
    im_end = smollm2_tokenizer.token_to_id("<|im_end|>")
    assert table[im_end] == SPECIAL_MARK + b"<|im_end|>"
    assert all(table[i].startswith(SPECIAL_MARK) for i in smollm2_tokenizer.special_ids)
    assert not any(table[i].startswith(SPECIAL_MARK) for i in smollm2_tokenizer.encode(MULTIBYTE))


def test_matcher_accepts_a_character_split_across_tokens(smollm2_tokenizer, smol_vocab):
    from llguidance import LLMatcher

    m = LLMatcher(smol_vocab.ll_tokenizer, LLMatcher.grammar_from_regex("🌍+"), log_level=0)
    ids = smollm2_tokenizer.encode("🌍🌍")
    assert m.consume_tokens(ids), m.get_error()
    assert m.is_accepting()


def test_padded_logit_ids_are_never_allowed(smollm2_tokenizer, smol_vocab):
    from lmserve.server.engine.constraints.compiler import ConstraintCompiler
    from lmserve.server.engine.constraints.spec import Constraint
    from lmserve.server.engine.constraints.state import unpack

    compiler = ConstraintCompiler(smollm2_tokenizer, logits_size=smollm2_tokenizer.vocab_size + 64)
    compiler._vocab = smol_vocab
    state = compiler.compile(Constraint.regex(".*")).new_state()  # anything: every text id is allowed
    allowed = unpack(state.mask()[None], smol_vocab.size)[0]  # [V]
    assert allowed.shape[0] == smollm2_tokenizer.vocab_size + 64
    assert not allowed[smollm2_tokenizer.vocab_size:].any()
    assert allowed[smollm2_tokenizer.encode("hello")[0]]
    compiler.close()


def test_sentencepiece_byte_fallback_and_word_spaces(trained_model_dir):
    tok = Tokenizer.from_dir(trained_model_dir)
    assert tok.token_bytes is None  # the sentencepiece path of the bridge
    table = token_bytes_of(tok)
    byte_ids = [i for i in range(tok.vocab_size) if (tok.id_to_token(i) or "").startswith("<0x")]
    assert len(byte_ids) == 256
    for i in byte_ids:
        assert table[i] == bytes([int(tok.id_to_token(i)[3:5], 16)])
    text = "the fox 你好 🌍"
    ids = tok.encode(text)
    assert any(i in byte_ids for i in ids), "expected byte-fallback pieces for the rare characters"
    spelled = b"".join(table[i] for i in ids).decode("utf-8")
    assert spelled.strip() == text and spelled == " " * (len(spelled) - len(spelled.lstrip(" "))) + tok.decode(ids)


def test_sentencepiece_matcher_sees_the_bytes(trained_model_dir):
    from llguidance import LLMatcher

    tok = Tokenizer.from_dir(trained_model_dir)
    vocab = build_vocabulary(tok)
    m = LLMatcher(vocab.ll_tokenizer, LLMatcher.grammar_from_regex(" ?the fox [^a-z]+"), log_level=0)
    assert m.consume_tokens(tok.encode("the fox 你好")), m.get_error()
    assert m.is_accepting()


def _not_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_unpack_bit_order():
    from lmserve.server.engine.constraints.state import unpack

    words = torch.tensor([[1 - (1 << 31), 1 << 3]], dtype=torch.int32)  # bits 0 and 31 (the sign bit), 35
    assert unpack(words, 40)[0].nonzero().flatten().tolist() == [0, 31, 35]


def test_sentencepiece_forced_text_is_spelled_without_the_word_space(trained_model_dir):
    """Where a constraint forces a literal, the library asks the tokenizer for it; sentencepiece alone
    would spell "a" as "▁a" (a space the text lacks), leaving only a token the constraint rejects."""
    from lmserve.server.engine.constraints.compiler import ConstraintCompiler
    from lmserve.server.engine.constraints.spec import Constraint
    from lmserve.server.engine.constraints.state import unpack

    tok = Tokenizer.from_dir(trained_model_dir)
    compiler = ConstraintCompiler(tok)
    for pattern, first in (("a+b", b"a"), ("the fox", b"the fox")):
        state = compiler.compile(Constraint.regex(pattern)).new_state()
        allowed = unpack(state.mask()[None], tok.vocab_size)[0].nonzero().flatten().tolist()
        table = compiler.vocabulary.token_bytes
        assert allowed and all(first.startswith(table[i]) for i in allowed), [table[i] for i in allowed]
        state.advance(allowed[0])
    compiler.close()


@pytest.mark.parametrize("kind", ["schema", "regex", "lark"])
def test_mask_slices_give_the_masks_of_a_walk_over_every_id(smol_vocab, kind):
    """The length slices (MASK_SLICES) change what a mask costs, never what it holds: along seeded random
    walks, each mask equals the one the library computes with no slices (every id walked)."""
    from llguidance import LLMatcher

    from lmserve.server.engine.constraints.compiler import JSON_OPTIONS
    from lmserve.server.engine.constraints.state import fill_bitmask, new_bitmask, unpack

    grammar = {
        "schema": LLMatcher.grammar_from_json_schema(
            {"type": "object", "properties": {"a": {"type": "string", "maxLength": 7}, "b": {"type": "string", "maxLength": 33},
                                              "c": {"type": "array", "items": {"type": "string", "minLength": 2, "maxLength": 4}},
                                              "d": {"type": "string"}, "n": {"type": "integer"}},
             "required": ["a", "b", "c", "d", "n"]}, defaults=JSON_OPTIONS),
        "regex": LLMatcher.grammar_from_regex(r'"[a-z ]{0,12}" and \w{3,5}[ \t]+[^"]{1,9}'),
        "lark": LLMatcher.grammar_from_lark('start: ("x" /[^"\\n]{2,6}/ " ")+ "end"'),
    }[kind]
    sliced = LLMatcher(smol_vocab.ll_tokenizer, grammar, log_level=0)
    plain = LLMatcher(smol_vocab.ll_tokenizer.with_slices([]), grammar, log_level=0)
    gen = torch.Generator().manual_seed(7)
    compared = 0
    for _ in range(6):
        a, b = sliced.deep_copy(), plain.deep_copy()
        for _ in range(60):
            ma, mb = new_bitmask(smol_vocab.size), new_bitmask(smol_vocab.size)
            fill_bitmask(a, ma)
            fill_bitmask(b, mb)
            assert torch.equal(ma, mb)
            compared += 1
            allowed = unpack(ma, smol_vocab.size)[0].nonzero().flatten().tolist()
            text = [t for t in allowed if t not in smol_vocab.eos_ids]
            if not text:
                break
            token = text[int(torch.randint(len(text), (1,), generator=gen))]
            assert a.consume_token(token) and b.consume_token(token)
    assert compared > 40  # every walk ran to its end or 60 tokens
