"""IncrementalDetokenizer: streamed pieces add up to the full decode, never show a half-finished
character as U+FFFD, and each step decodes a bounded window. Checked on SmolLM2's byte-level BPE
and on a sentencepiece vocabulary with byte fallback. ByteStreamDetokenizer (fixed bytes per id): the
same on SmolLM2's vocabulary and Gemma 3's (sentencepiece without a dummy prefix), where it also gives
what the window detokenizer gave."""

from __future__ import annotations

import io
import json
import random

import pytest

from lmserve.model.text.detokenizer import ByteStreamDetokenizer, IncrementalDetokenizer, make_detokenizer
from lmserve.model.text.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"

STREAM_TEXTS = [
    "中文测试，你好世界。这是一个很长的句子，用来检查流式解码。",
    "日本語のテキスト、한국어 텍스트, ελληνικά, русский, עברית",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 robot 🤖🧠✨ keycap 1️⃣",
    "combining e\u0301 a\u0308 and precomposed é ä",
    "def f(x):\n    return x ** 2  # plain ASCII code\n",
    "mixed 数据 model 😀 stream 你好 end.",
]


def random_texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    atoms = ["the", " model", " ", "\n", "中", "文", "字", "模型", "😀", "👍🏽", "🇫🇷", "é", "Ω", "한", "!", "42", "\u200d"]
    return ["".join(rng.choice(atoms) for _ in range(rng.randint(1, 30))) for _ in range(count)]


def stream(tokenizer, ids, prompt_ids=(), skip_special_tokens=True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    assert detok.text == "".join(pieces)
    return pieces


# ---------------------------------------------------------------------------------------------
# tokenizers under test


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory):
    """A sentencepiece BPE model with byte fallback, saved as an HF-style directory."""
    import sentencepiece as spm

    rng = random.Random(0)
    words = ["the", "quick", "fox", "model", "stream", "hello", "world", "数据", "模型", "你好", "😀"]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 10))) for _ in range(1500)]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, model_type="bpe", vocab_size=340, byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, character_coverage=1.0,
        user_defined_symbols=["<|im_end|>"], num_threads=1, minloglevel=2)
    root = tmp_path_factory.mktemp("sp")
    (root / "tokenizer.model").write_bytes(buf.getvalue())
    (root / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return root


@pytest.fixture(scope="module")
def sp(sp_dir) -> Tokenizer:
    return Tokenizer.from_dir(sp_dir)


@pytest.fixture(params=["smollm2-bpe", "sentencepiece"])
def tok(request) -> Tokenizer:
    return request.getfixturevalue("smollm2_tokenizer" if request.param == "smollm2-bpe" else "sp")


# ---------------------------------------------------------------------------------------------
# tests


def test_samples_split_characters_across_tokens(tok):
    """The samples must hold characters whose bytes span several ids, or the tests below prove little."""
    ids = [i for text in STREAM_TEXTS for i in tok.encode(text)]
    assert any(REPLACEMENT in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("skip", [True, False])
def test_stream_adds_up_to_full_decode_without_replacement_chars(tok, skip):
    for text in STREAM_TEXTS + random_texts(seed=1, count=150):
        ids = tok.encode(text)
        pieces = stream(tok, ids, skip_special_tokens=skip)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip), text
        assert not any(REPLACEMENT in p for p in pieces), (text, pieces)


def test_held_back_bytes_come_out_in_the_same_step_the_character_completes(tok):
    for text in STREAM_TEXTS:
        ids = tok.encode(text)
        detok = IncrementalDetokenizer(tok)
        for n, token_id in enumerate(ids, start=1):
            detok.push(token_id)
            # Everything except an unfinished tail is already out, and nothing that will change.
            assert detok.text.startswith(tok.decode(ids[:n]).rstrip(REPLACEMENT))
            assert tok.decode(ids).startswith(detok.text)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_flag(smollm2_tokenizer, skip):
    ids = smollm2_tokenizer.encode("<|im_start|>assistant\n你好 😀, fine.<|im_end|>") + [smollm2_tokenizer.eos_ids[0]]
    text = "".join(stream(smollm2_tokenizer, ids, skip_special_tokens=skip))
    assert text == smollm2_tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in text) is (not skip)


def test_prompt_context_byte_level_equals_decode_of_generated(smollm2_tokenizer):
    full = smollm2_tokenizer.encode("Question: 你好吗? Answer: 我很好 😀 thanks, and you?")
    for cut in range(1, len(full)):
        prompt, generated = full[:cut], full[cut:]
        if REPLACEMENT in smollm2_tokenizer.decode(prompt) or REPLACEMENT in smollm2_tokenizer.decode(generated):
            continue  # the cut falls inside a character
        assert "".join(stream(smollm2_tokenizer, generated, prompt)) == smollm2_tokenizer.decode(generated)


def test_prompt_context_sentencepiece_keeps_the_word_boundary_space(sp):
    full = sp.encode("hello world the quick fox 数据 😀 stream")
    checked = 0
    for cut in range(1, len(full)):
        prompt, generated = full[:cut], full[cut:]
        prompt_text, full_text = sp.decode(prompt), sp.decode(full)
        if REPLACEMENT in prompt_text or not full_text.startswith(prompt_text):
            continue  # the cut falls inside a character
        streamed = "".join(stream(sp, generated, prompt))
        assert streamed == full_text[len(prompt_text):]
        if sp.id_to_token(generated[0]).startswith("\u2581"):
            assert streamed.startswith(" ") and not sp.decode(generated).startswith(" ")
            checked += 1
    assert checked > 0


class CountingTokenizer:
    """Passes decode through and remembers the longest id list it was asked to decode."""

    def __init__(self, inner: Tokenizer):
        self.inner, self.special_ids, self.longest = inner, inner.special_ids, 0

    def decode(self, ids, skip_special_tokens=False):
        self.longest = max(self.longest, len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_window_stays_bounded(tok):
    long_text = " ".join(STREAM_TEXTS) * 10
    ids = tok.encode(long_text)
    counting = CountingTokenizer(tok)
    pieces = stream(counting, ids, prompt_ids=ids)  # a long prompt too
    assert "".join(pieces) == tok.decode(ids + ids)[len(tok.decode(ids)):]
    assert len(ids) > 500
    assert counting.longest <= 24  # a few context ids + a few unsettled ones, whatever the length


def test_malformed_bytes_are_emitted_with_bounded_window(sp):
    lone_continuation = sp.token_to_id("<0x80>")
    ids = [sp.token_to_id("\u2581hello")] * 3 + [lone_continuation] * 200 + [sp.token_to_id("\u2581world")]
    ids = [i for i in ids if i is not None]
    counting = CountingTokenizer(sp)
    assert "".join(stream(counting, ids)) == sp.decode(ids)
    assert counting.longest <= IncrementalDetokenizer.MAX_WINDOW + IncrementalDetokenizer.CONTEXT_IDS


def test_unfinished_character_is_held_until_flush(sp):
    ids = sp.encode("未")  # not in the training text: three byte-fallback ids
    assert len(ids) >= 3
    detok = IncrementalDetokenizer(sp)
    assert [detok.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.flush() == sp.decode(ids[:-1])
    detok = IncrementalDetokenizer(sp)
    assert "".join(detok.push(i) for i in ids) + detok.flush() == "未"


# ---------------------------------------------------------------------------------------------
# byte-stream detokenizer (fixed bytes per id)


def byte_stream(tokenizer, ids, skip_special_tokens=True) -> list[str]:
    detok = ByteStreamDetokenizer(tokenizer, skip_special_tokens)
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert detok.text == "".join(pieces)
    return pieces


def test_byte_level_vocabularies_get_the_byte_stream_and_sentencepiece_the_window(smollm2_tokenizer, sp):
    assert smollm2_tokenizer.token_bytes is not None and len(smollm2_tokenizer.token_bytes) == smollm2_tokenizer.vocab_size
    assert sp.token_bytes is None
    assert isinstance(make_detokenizer(smollm2_tokenizer, [1, 2]), ByteStreamDetokenizer)
    assert isinstance(make_detokenizer(sp, [1, 2]), IncrementalDetokenizer)


@pytest.mark.parametrize("skip", [True, False])
def test_byte_stream_equals_decode_on_text_random_ids_and_every_single_id(smollm2_tokenizer, skip):
    rng = random.Random(5)
    for text in STREAM_TEXTS + random_texts(6, 40):
        ids = smollm2_tokenizer.encode(text)
        pieces = byte_stream(smollm2_tokenizer, ids, skip)
        assert "".join(pieces) == smollm2_tokenizer.decode(ids, skip_special_tokens=skip)
        assert all(REPLACEMENT not in p for p in pieces)  # valid UTF-8 never shows a half character
    for _ in range(200):  # arbitrary ids: malformed bytes, special tokens, everything
        ids = [rng.randrange(smollm2_tokenizer.vocab_size) for _ in range(rng.randint(1, 25))]
        assert "".join(byte_stream(smollm2_tokenizer, ids, skip)) == smollm2_tokenizer.decode(ids, skip_special_tokens=skip)
    wrong = [i for i in range(smollm2_tokenizer.vocab_size) if "".join(byte_stream(smollm2_tokenizer, [i], skip)) != smollm2_tokenizer.decode([i], skip_special_tokens=skip)]
    assert wrong == []


def test_byte_stream_emits_a_character_in_the_step_that_completes_it(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("😀中")
    detok = ByteStreamDetokenizer(smollm2_tokenizer)
    out = [detok.push(i) for i in ids]
    text = ""
    for n, piece in enumerate(out, 1):
        text += piece
        assert text == smollm2_tokenizer.decode(ids[:n]).rstrip(REPLACEMENT)


# ---------------------------------------------------------------------------------------------
# Gemma 3: a sentencepiece vocabulary read through a byte table


def gemma_random_ids(tok, rng, n):
    """Ids drawn to hit what sentencepiece decodes apart: byte-fallback pieces (often, so characters are
    split and bytes are malformed), control tokens, user-defined pieces (newline and space runs),
    pieces with a word-boundary space, and anything."""
    pools = getattr(tok, "_test_pools", None)
    if pools is None:
        pieces = [tok.id_to_token(i) or "" for i in range(tok.vocab_size)]
        pools = tok._test_pools = (
            [i for i, p in enumerate(pieces) if len(p) == 6 and p.startswith("<0x") and p.endswith(">")],
            sorted(tok.special_ids),
            [i for i, p in enumerate(pieces) if p and set(p) <= {"\n", " ", "\t"}],
            [i for i, p in enumerate(pieces) if p.startswith("\u2581")],
        )
    out = []
    for _ in range(n):
        r = rng.random()
        pool = pools[0] if r < 0.45 else pools[1] if r < 0.55 else pools[2] if r < 0.62 else pools[3] if r < 0.8 else None
        out.append(rng.choice(pool) if pool else rng.randrange(tok.vocab_size))
    return out


def test_gemma_gets_a_byte_table_equal_to_sentencepiece_decode_of_every_id(gemma3_tokenizer):
    tok = gemma3_tokenizer
    table = tok.token_bytes
    assert table is not None and len(table) == tok.vocab_size == 262144
    assert isinstance(make_detokenizer(tok, [2, 9259]), ByteStreamDetokenizer)
    wrong = [i for i in range(tok.vocab_size) if table[i].decode("utf-8", tok.utf8_errors) != tok.decode([i])]
    assert wrong == []
    assert table[tok.token_to_id("<0xE2>")] == b"\xe2" and table[tok.token_to_id("\u2581the")] == b" the"


@pytest.mark.parametrize("skip", [True, False])
def test_gemma_byte_stream_equals_sentencepiece_decode_and_the_window_detokenizer(gemma3_tokenizer, skip):
    """Random ids (malformed bytes, special tokens, leading spaces): the streamed text is sentencepiece's decode
    of the generated ids (a dropped special token is not there) and what the window detokenizer streamed
    after the same prompt, wherever the prompt ends on a character boundary (the window took a prompt's
    unfinished character as the prompt's; the byte stream, as for SmolLM2, starts with the generated ids)."""
    tok = gemma3_tokenizer
    rng = random.Random(11 + skip)
    compared = 0
    for _ in range(700):
        ids = gemma_random_ids(tok, rng, rng.randint(1, 30))
        prompt = gemma_random_ids(tok, rng, rng.randint(0, 8))
        pieces = byte_stream(tok, ids, skip)
        kept_ids = [i for i in ids if not (skip and i in tok.special_ids)]
        assert "".join(pieces) == tok.decode(kept_ids, skip_special_tokens=skip), ids
        if not tok.decode([i for i in prompt if i not in tok.special_ids]).endswith(REPLACEMENT):
            assert "".join(pieces) == "".join(stream(tok, ids, prompt, skip)), (prompt, ids)
            compared += 1
    assert compared > 500
    for text in STREAM_TEXTS + random_texts(7, 40):  # valid text: the same pieces, step by step
        ids = tok.encode(text)
        assert byte_stream(tok, ids, skip) == stream(tok, ids, tok.encode("Say:"), skip), text
        assert "".join(byte_stream(tok, ids, skip)) == text


def test_gemma_malformed_bytes_decode_one_replacement_per_byte_as_sentencepiece(gemma3_tokenizer):
    tok = gemma3_tokenizer
    byte = {b: tok.token_to_id(f"<0x{b:02X}>") for b in range(256)}
    for raw in (b"\xe2\x82", b"\xe2\x82A", b"\xe2\x82\xe2\x82\xac", b"\xed\xa0\x80", b"\xc0\x80", b"\xf4\x90\x80\x80",
                b"\xf0\x9f\x98", b"\xff\xfe"):
        ids = [byte[b] for b in raw]
        streamed = "".join(byte_stream(tok, ids))
        assert streamed == tok.decode(ids) == tok._backend._sp.decode(ids), raw
    assert "".join(byte_stream(tok, [byte[0xE2], byte[0x82]])) == REPLACEMENT * 2  # Python's "replace" gives one
