"""Tokenizer: GGUF byte-level BPE (SmolLM2) against transformers, GGUF sentencepiece-style vocabularies
against sentencepiece itself, HF directories, chat templates against transformers' renderer, and the
named load errors."""

from __future__ import annotations

import io
import json
import random
from datetime import datetime

import pytest
import regex

from lmserve.model.text.chat_template import ChatTemplate, ChatTemplateError, NoChatTemplateError
from lmserve.model.errors import CheckpointNotFoundError, UnsupportedArchitectureError
from lmserve.model.text.tokenizer import Tokenizer

# ---------------------------------------------------------------------------------------------
# text samples

# No whitespace run directly before a digit: there the GGUF conversion in transformers (GPT-2 split
# only) and llama.cpp's "smollm" split (each digit first, as SmolLM2's own tokenizer.json does) differ.
VARIED_TEXTS = [
    "Hello world!",
    "The capital of France is",
    "def add(a, b):\n    return a + b\n",
    "    indented\n\tcode with\ttabs",
    "multiple     spaces and trailing   ",
    "中文测试，你好世界。这是一个句子。",
    "日本語のテキストと한국어 텍스트",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷 robot🤖",
    "café naïve Ωmega straße Ünïcödé",
    "it's they're we'll I'd YOU'VE",
    "<|im_start|>user\nWhat is AI?<|im_end|>\n<|im_start|>assistant\n",
    "line1\r\nline2\n\n\nline5",
    "",
    " ",
    "\n",
    "https://example.com/path?q=a&b=c#frag",
    'JSON: {"a": [1, 2, 3], "b": null}',
    "x=3.14; y=1e-10; z=0xFF; v2.0.1",
    "<|endoftext|>",
    "<repo_name>lmserve<file_sep>README.md",
    "ALLCAPS and MiXeD CaSe",
]
DIGIT_TEXTS = ["  1 22  333", "version  2.0.1", "\t42\n  7", "x  9y", "٣٤ and  ٥", "total:   1000000"]


def random_texts(seed: int, count: int) -> list[str]:
    """Strings mixing ASCII words, digits, whitespace runs, punctuation, CJK and emoji."""
    rng = random.Random(seed)
    atoms = ["the", "model", " ", "  ", "\n", "\t", "12", "7", ".", ",", "!", "'s", "(", ")", "{", "中", "文", "字",
             "😀", "👍🏽", "é", "Ω", "-", "_", "A", "z", "\u200d", "   "]
    return ["".join(rng.choice(atoms) for _ in range(rng.randint(1, 24))) for _ in range(count)]


# ---------------------------------------------------------------------------------------------
# SmolLM2 GGUF (byte-level BPE, pre-tokenizer "smollm")


@pytest.fixture(scope="module")
def smol_meta(smollm2_gguf_path) -> dict:
    import gguf

    reader = gguf.GGUFReader(str(smollm2_gguf_path))
    return {key: field.contents() for key, field in reader.fields.items() if key.startswith("tokenizer.")}


@pytest.fixture(scope="module")
def smol(smol_meta) -> Tokenizer:
    return Tokenizer.from_gguf_fields(smol_meta)


@pytest.fixture(scope="module")
def hf_smol(smollm2_gguf_path):
    """transformers' tokenizer for the same GGUF (what AutoTokenizer(gguf_file=...) builds)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(smollm2_gguf_path))
    backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)


def digits_apart_oracle(hf, text: str) -> list[int]:
    """SmolLM2's split (every digit its own piece, then GPT-2's) built from transformers' encoder."""
    pieces = [p for p in regex.split(r"(\p{N})", text) if p]
    return [i for p in pieces for i in hf.encode(p, add_special_tokens=False)]


@pytest.mark.slow
@pytest.mark.parametrize("text", VARIED_TEXTS)
def test_smollm2_encode_matches_transformers(smol, hf_smol, text):
    assert smol.encode(text) == hf_smol.encode(text, add_special_tokens=False)


@pytest.mark.slow
@pytest.mark.parametrize("text", DIGIT_TEXTS)
def test_smollm2_splits_every_digit_apart(smol, hf_smol, text):
    assert smol.encode(text) == digits_apart_oracle(hf_smol, text)


@pytest.mark.slow
def test_smollm2_random_text_matches_oracle(smol, hf_smol):
    for text in random_texts(seed=1, count=300):
        assert smol.encode(text) == digits_apart_oracle(hf_smol, text), text


@pytest.mark.slow
@pytest.mark.parametrize("skip", [False, True])
def test_smollm2_decode_matches_transformers_and_round_trips(smol, hf_smol, skip):
    for text in VARIED_TEXTS + DIGIT_TEXTS + random_texts(seed=2, count=100):
        ids = smol.encode(text)
        expected = hf_smol.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        assert smol.decode(ids, skip_special_tokens=skip) == expected
        if not skip:
            assert smol.decode(ids) == text


@pytest.mark.slow
def test_smollm2_special_tokens_are_single_ids(smol, smol_meta, hf_smol):
    tokens = smol_meta["tokenizer.ggml.tokens"]
    for token, kind in zip(tokens, smol_meta["tokenizer.ggml.token_type"]):
        if kind == 3:  # control
            assert smol.encode(f"a{token}b")[1:2] == [tokens.index(token)]
            assert smol.token_to_id(token) == tokens.index(token) == hf_smol.convert_tokens_to_ids(token)
            assert smol.decode([tokens.index(token)], skip_special_tokens=True) == ""
    assert smol.token_to_id("no such token, surely") is None


@pytest.mark.slow
def test_smollm2_ids_and_flags_follow_metadata(smol, smol_meta, hf_smol):
    tokens = smol_meta["tokenizer.ggml.tokens"]
    assert smol.vocab_size == len(tokens) == len(hf_smol)
    assert smol.bos_id == smol_meta["tokenizer.ggml.bos_token_id"] == hf_smol.bos_token_id
    assert smol.pad_id == smol_meta["tokenizer.ggml.padding_token_id"] == hf_smol.pad_token_id
    assert smol.eos_ids[0] == smol_meta["tokenizer.ggml.eos_token_id"] == hf_smol.eos_token_id
    # Every turn-closing marker the template writes ends generation.
    assert "<|im_end|>" in smol.chat_template and tokens.index("<|im_end|>") in smol.eos_ids
    assert smol.add_bos_token == smol_meta["tokenizer.ggml.add_bos_token"]
    assert smol.encode("Hi there", add_special_tokens=True) == hf_smol.encode("Hi there", add_special_tokens=True)


# ---------------------------------------------------------------------------------------------
# Gemma 3 270M GGUF (sentencepiece-style, tokenizer.ggml.model "llama", scores, no space prefix)


@pytest.fixture(scope="module")
def gemma_meta(gemma3_gguf_path) -> dict:
    import mmap

    from lmserve.model.checkpoints.gguf_reader import read_directory

    with open(gemma3_gguf_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        meta, _ = read_directory(buf)
    return meta


@pytest.fixture(scope="module")
def gemma(gemma_meta) -> Tokenizer:
    return Tokenizer.from_gguf_fields(gemma_meta)


@pytest.fixture(scope="module")
def hf_gemma(gemma3_gguf_path):
    """transformers' tokenizer built from the same GGUF."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gemma3_gguf_path.parent, gguf_file=gemma3_gguf_path.name)


@pytest.mark.slow
def test_gemma3_encodes_like_transformers_and_round_trips(gemma, hf_gemma):
    for text in VARIED_TEXTS + DIGIT_TEXTS + random_texts(seed=4, count=200):
        ids = gemma.encode(text)
        assert ids == hf_gemma.encode(text, add_special_tokens=False), text
        assert gemma.decode(ids) == text == hf_gemma.decode(ids), text


@pytest.mark.slow
def test_gemma3_ids_and_special_tokens_follow_metadata(gemma, gemma_meta, hf_gemma):
    assert gemma.vocab_size == len(gemma_meta["tokenizer.ggml.tokens"]) == 262144
    assert (gemma.bos_id, gemma.eos_ids, gemma.pad_id) == (2, (1,), 0) == (hf_gemma.bos_token_id,
                                                                          (hf_gemma.eos_token_id,), hf_gemma.pad_token_id)
    assert gemma.chat_template is None and gemma.add_bos_token
    assert gemma.encode("Hi there", add_special_tokens=True) == hf_gemma.encode("Hi there", add_special_tokens=True)
    turn = "<start_of_turn>user\nhi<end_of_turn>"
    ids = gemma.encode(turn)
    assert ids[0] == gemma.token_to_id("<start_of_turn>") == hf_gemma.convert_tokens_to_ids("<start_of_turn>")
    assert ids == hf_gemma.encode(turn, add_special_tokens=False)
    assert gemma.decode(ids, skip_special_tokens=True) == "user\nhi"


CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! 😀"},
     {"role": "user", "content": "翻译：你好"}],
]


@pytest.mark.slow
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_smollm2_chat_template_matches_transformers(smol, hf_smol, messages, add_generation_prompt):
    expected = hf_smol.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    rendered = smol.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert rendered == expected
    assert smol.encode(rendered) == hf_smol.encode(expected, add_special_tokens=False)


@pytest.mark.slow
def test_hf_directory_with_tokenizer_json_matches_transformers(hf_smol, tmp_path):
    hf_smol.save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    tok = Tokenizer.from_dir(tmp_path)
    for text in VARIED_TEXTS + DIGIT_TEXTS + random_texts(seed=3, count=100):
        ids = hf_smol.encode(text, add_special_tokens=False)
        assert tok.encode(text) == ids, text
        assert tok.decode(ids, skip_special_tokens=True) == hf_smol.decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert (tok.bos_id, tok.eos_ids[0], tok.pad_id) == (hf_smol.bos_token_id, hf_smol.eos_token_id, hf_smol.pad_token_id)
    for messages in CONVERSATIONS:
        assert tok.apply_chat_template(messages) == hf_smol.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True)


# ---------------------------------------------------------------------------------------------
# sentencepiece-style GGUF ("llama"), checked against sentencepiece on the model it came from

SP_USER_SYMBOLS = ["<|im_start|>", "<|im_end|>"]


def train_sentencepiece(add_dummy_prefix: bool) -> bytes:
    import sentencepiece as spm

    rng = random.Random(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "token", "model", "stream", "hello",
             "world", "return", "print", "数据", "模型", "你好", "世界", "😀", "café"]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) + rng.choice([".", "!", "?", ",", ""])
             for _ in range(2000)]
    lines += [f"x = {rng.randint(0, 999)} + {rng.randint(0, 999)}\tnext\nline" for _ in range(200)]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, model_type="bpe", vocab_size=420, byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=add_dummy_prefix,
        character_coverage=1.0, user_defined_symbols=SP_USER_SYMBOLS, num_threads=1, minloglevel=2)
    return buf.getvalue()


def gguf_fields_from_sentencepiece(model_bytes: bytes, chat_template: str | None = None) -> dict:
    """The tokenizer keys llama.cpp's converter writes for a sentencepiece model: every piece with its
    score and type (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte)."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as spb

    sp = spm.SentencePieceProcessor(model_proto=model_bytes)
    proto = spb.ModelProto()
    proto.ParseFromString(model_bytes)
    types = []
    for i in range(sp.get_piece_size()):
        if sp.is_unknown(i):
            types.append(2)
        elif sp.is_control(i):
            types.append(3)
        elif sp.is_unused(i):
            types.append(5)
        elif sp.is_byte(i):
            types.append(6)
        else:
            types.append(4 if proto.pieces[i].type == spb.ModelProto.SentencePiece.USER_DEFINED else 1)
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(sp.get_piece_size())],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(sp.get_piece_size())],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
        "tokenizer.ggml.add_space_prefix": proto.normalizer_spec.add_dummy_prefix,
    }
    if chat_template is not None:
        meta["tokenizer.chat_template"] = chat_template
    return meta


@pytest.fixture(scope="module", params=[True, False], ids=["dummy-prefix", "no-dummy-prefix"])
def sp_pair(request):
    import sentencepiece as spm

    model_bytes = train_sentencepiece(add_dummy_prefix=request.param)
    sp = spm.SentencePieceProcessor(model_proto=model_bytes)
    return sp, Tokenizer.from_gguf_fields(gguf_fields_from_sentencepiece(model_bytes)), model_bytes


SP_TEXTS = [
    "hello world", "  two  spaces ", "数据模型 你好世界", "未见过的字 😀 emoji 🤖", "tabs\tand\nnewlines\n\n",
    "x = 12345", "", " ", "Ünïcödé café", "the quick brown fox jumps over the lazy dog!", "\n leading newline",
]


def test_sentencepiece_gguf_encode_decode_match_sentencepiece(sp_pair):
    sp, tok, _ = sp_pair
    for text in SP_TEXTS + random_texts(seed=4, count=300):
        ids = tok.encode(text)
        assert ids == sp.encode(text), text
        assert tok.decode(ids) == sp.decode(ids), text


def test_sentencepiece_gguf_falls_back_to_bytes_for_unseen_characters(sp_pair):
    sp, tok, _ = sp_pair
    ids = tok.encode("未见 🤖")
    assert any(sp.is_byte(i) for i in ids)  # the sample does exercise byte fallback
    assert tok.decode(ids) == sp.decode(ids) == "未见 🤖"


def test_sentencepiece_gguf_special_tokens(sp_pair):
    sp, tok, _ = sp_pair
    assert (tok.bos_id, tok.eos_ids[0]) == (sp.bos_id(), sp.eos_id())
    assert tok.add_bos_token  # llama.cpp's default when the file does not say
    body = sp.encode("hello world")
    assert tok.encode("hello world", add_special_tokens=True) == [sp.bos_id(), *body]
    # bos written in the text is matched whole and not doubled
    assert tok.encode(sp.id_to_piece(sp.bos_id()) + "hello world", add_special_tokens=True) == [sp.bos_id(), *body]
    for symbol in SP_USER_SYMBOLS:
        assert tok.encode(f"hello{symbol}world").count(sp.piece_to_id(symbol)) == 1
    ids = [sp.bos_id(), *body, sp.eos_id()]
    assert tok.decode(ids, skip_special_tokens=True) == sp.decode(body)
    shown = tok.decode(ids)
    assert shown.startswith(sp.id_to_piece(sp.bos_id())) and shown.endswith(sp.id_to_piece(sp.eos_id()))


def test_sentencepiece_directory_with_tokenizer_model(sp_pair, tmp_path):
    sp, _, model_bytes = sp_pair
    (tmp_path / "tokenizer.model").write_bytes(model_bytes)
    template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    im_end = sp.piece_to_id("<|im_end|>")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": False, "bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": template}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [sp.eos_id(), 7]}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.chat_template == template
    assert tok.eos_ids[:2] == (sp.eos_id(), 7) and im_end in tok.eos_ids
    assert not tok.add_bos_token and tok.encode("hello", add_special_tokens=True) == sp.encode("hello")
    for text in SP_TEXTS:
        assert tok.encode(text) == sp.encode(text)
    assert tok.vocab_size == sp.get_piece_size()


# ---------------------------------------------------------------------------------------------
# other GGUF byte-level splits, checked against transformers' GGUF conversion on a trained vocabulary


@pytest.fixture(scope="module")
def byte_level_fields() -> dict:
    from tokenizers import Tokenizer as RustTokenizer, decoders, models, pre_tokenizers, trainers

    tk = RustTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|end|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(random_texts(seed=5, count=3000) + VARIED_TEXTS * 20, trainer=trainer)
    spec = json.loads(tk.to_str())["model"]
    tokens = sorted(spec["vocab"], key=spec["vocab"].get)
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t == "<|end|>" else 1 for t in tokens],
        "tokenizer.ggml.merges": [" ".join(m) if isinstance(m, list) else m for m in spec["merges"]],
        "tokenizer.ggml.eos_token_id": tokens.index("<|end|>"),
    }


@pytest.mark.parametrize("pre", ["gpt-2", "qwen2", "llama-bpe"])
def test_gguf_byte_level_splits_match_transformers(byte_level_fields, pre):
    from transformers.integrations.gguf import convert_gguf_tokenizer

    fields = dict(byte_level_fields, **{"tokenizer.ggml.pre": pre})
    tok = Tokenizer.from_gguf_fields(fields)
    oracle, _ = convert_gguf_tokenizer("llama", {
        "tokenizer_type": "gpt2", "pre_tokenizer_type": pre, "tokens": fields["tokenizer.ggml.tokens"],
        "token_type": fields["tokenizer.ggml.token_type"], "merges": fields["tokenizer.ggml.merges"]})
    # transformers' GPT2Tokenizer adds its own "<|endoftext|>" beyond this vocabulary: leave that text out.
    texts = [t for t in VARIED_TEXTS + DIGIT_TEXTS if "<|endoftext|>" not in t] + random_texts(seed=6, count=200)
    for text in texts:
        ids = oracle.encode(text, add_special_tokens=False).ids
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == oracle.decode(ids, skip_special_tokens=False)


# ---------------------------------------------------------------------------------------------
# load errors


def test_missing_directory_or_tokenizer_file_is_checkpoint_not_found(tmp_path):
    with pytest.raises(CheckpointNotFoundError):
        Tokenizer.from_dir(tmp_path / "absent")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointNotFoundError, match="tokenizer"):
        Tokenizer.from_dir(tmp_path)
    with pytest.raises(FileNotFoundError):  # the named error is also a FileNotFoundError
        Tokenizer.from_dir(tmp_path)


def test_unsupported_gguf_tokenizers_are_named(byte_level_fields):
    with pytest.raises(UnsupportedArchitectureError, match="'bert'"):
        Tokenizer.from_gguf_fields(dict(byte_level_fields, **{"tokenizer.ggml.model": "bert"}))
    with pytest.raises(UnsupportedArchitectureError, match="'mystery-pre'"):
        Tokenizer.from_gguf_fields(dict(byte_level_fields, **{"tokenizer.ggml.pre": "mystery-pre"}))
    with pytest.raises(CheckpointNotFoundError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_gguf_fields({"tokenizer.ggml.model": "gpt2"})


# ---------------------------------------------------------------------------------------------
# chat templates, checked against transformers' renderer

TEMPLATES = {
    "chatml-with-default-system": (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    "blocks-indented-loopcontrols": (
        "{{ bos_token }}\n"
        "{% for message in messages %}\n"
        "    {% if message['role'] == 'system' %}\n"
        "        {% continue %}\n"
        "    {% endif %}\n"
        "    [{{ message['role'] | upper }}] {{ message['content'] | trim }}\n"
        "    {% if loop.index > 3 %}{% break %}{% endif %}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"),
    "namespace-tojson-tools": (
        "{% set ns = namespace(system='') %}"
        "{% for m in messages %}{% if m['role'] == 'system' %}{% set ns.system = m['content'] %}{% endif %}{% endfor %}"
        "SYS={{ ns.system | tojson }}\n"
        "{% if tools is not none %}TOOLS={{ tools | tojson }}\n{% endif %}"
        "{% for m in messages if m['role'] != 'system' %}{{ m | tojson }}{{ eos_token }}\n{% endfor %}"),
}
MESSAGES = [{"role": "system", "content": "Sois bref. 简短"}, {"role": "user", "content": "  Bonjour  "},
            {"role": "assistant", "content": "Salut ! 😀"}, {"role": "user", "content": "Ça va ?"},
            {"role": "assistant", "content": "Oui"}, {"role": "user", "content": "Et toi ?"}]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers_renderer(name, add_generation_prompt):
    from transformers.utils.chat_template_utils import render_jinja_template

    tools = [{"type": "function", "function": {"name": "météo", "parameters": {}}}]
    for messages in (MESSAGES, MESSAGES[1:3]):
        for extra in ({}, {"tools": tools}):
            rendered, _ = render_jinja_template(
                conversations=[messages], chat_template=TEMPLATES[name], add_generation_prompt=add_generation_prompt,
                bos_token="<s>", eos_token="</s>", **extra)
            ours = ChatTemplate(TEMPLATES[name], bos_token="<s>", eos_token="</s>")
            assert ours.render(messages, add_generation_prompt=add_generation_prompt, **extra) == rendered[0]


def test_chat_template_helpers_and_sandbox():
    with pytest.raises(ChatTemplateError, match="only user turns"):
        ChatTemplate("{{ raise_exception('only user turns') }}").render([{"role": "system", "content": "x"}])
    with pytest.raises(ChatTemplateError):  # no way out to Python internals
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}").render([])
    with pytest.raises(ChatTemplateError):  # the caller's messages cannot be modified
        ChatTemplate("{{ messages.append({'role': 'x'}) }}").render([{"role": "user", "content": "hi"}])
    with pytest.raises(ChatTemplateError, match="compile"):
        ChatTemplate("{% for m in messages %}unterminated")
    before = datetime.now().year
    year = ChatTemplate("{{ strftime_now('%Y') }}").render([])
    assert year in {str(before), str(datetime.now().year)}
    assert ChatTemplate("{% generation %}{{ messages[0]['content'] }}{% endgeneration %}").render(
        [{"role": "assistant", "content": "kept"}]) == "kept"


def test_a_model_without_a_chat_template_refuses_messages(sp_pair):
    """A checkpoint without a template (a pretrained base model) takes text only; no template is made up."""
    _, tok, _ = sp_pair
    assert tok.chat_template is None
    for call in (tok.apply_chat_template, tok.encode_chat):
        with pytest.raises(NoChatTemplateError, match="no chat template"):
            call(MESSAGES[1:4])


def test_ids_outside_the_vocabulary_decode_to_nothing(sp_pair, byte_level_fields):
    _, sp_tok, _ = sp_pair
    bpe_tok = Tokenizer.from_gguf_fields(dict(byte_level_fields, **{"tokenizer.ggml.pre": "gpt-2"}))
    for tok in (sp_tok, bpe_tok):
        ids = tok.encode("hello world 你好")
        padded = ids[:2] + [tok.vocab_size, tok.vocab_size + 100] + ids[2:]
        assert tok.decode(padded) == tok.decode(ids)
        assert tok.id_to_token(tok.vocab_size) is None and tok.id_to_token(-1) is None


def test_another_chat_template_replaces_the_models_and_its_end_markers(smol_meta):
    tok = Tokenizer.from_gguf_fields(smol_meta)  # a copy of its own: the module's is shared
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    named = tok.eos_ids
    assert eot not in named
    tok.use_chat_template("{% for m in messages %}[{{ m.role }}] {{ m.content }}<|endoftext|>{% endfor %}"
                          "{% if add_generation_prompt %}[assistant] {% endif %}")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi<|endoftext|>[assistant] "
    ids, _ = tok.encode_chat([{"role": "user", "content": "say <|im_end|>"}])
    assert ids.count(eot) == 1 and im_end not in ids  # the template's markup only becomes special ids
    assert tok.eos_ids == named + (eot,)  # the new template's turn-closing marker ends generation
    with pytest.raises(ChatTemplateError, match="compile"):
        tok.use_chat_template("{% for m in messages %}")
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False) == "[user] x<|endoftext|>"
    tok.use_chat_template("{% for m in messages %}{{ m.content }}\n{% endfor %}")
    assert tok.eos_ids == named
    assert tok.has_special_text("a <|im_start|> b") and not tok.has_special_text("a <|im_sta b")


def test_special_token_split_finds_what_an_alternation_of_the_strings_finds(gemma):
    """The special-token split regex (a trie) matches where, and as long as, an alternation of the strings
    longest first does, on Gemma 3's 6,414 special and user-defined pieces and on text built from them,
    their prefixes and plain characters."""
    import random
    import re

    from lmserve.model.text.tokenizer import _alternation

    strings = sorted(gemma._backend._matched)
    reference = re.compile("|".join(re.escape(s) for s in sorted(strings, key=len, reverse=True)))
    trie = _alternation(strings)
    rng = random.Random(3)
    parts = strings + ["<", "<unused", "<start_of_turn", "\n", " ", "\t", "</", "a", "é", "😀"]
    texts = ["".join(rng.choice(parts) if rng.random() < 0.6 else rng.choice("ab <>/\n\té")
                     for _ in range(rng.randint(1, 40))) for _ in range(1500)]
    for text in texts + strings:
        assert [m.span() for m in trie.finditer(text)] == [m.span() for m in reference.finditer(text)], text
    assert _alternation(["<|im", "<|im_end|>", ""]).fullmatch("<|im_end|>") and _alternation([]) is None
