"""Text <-> token ids for a checkpoint: one `Tokenizer` over two backends.

* `tokenizers` (Rust) for a Hugging Face `tokenizer.json` and for a GGUF byte-level BPE
  vocabulary (`tokenizer.ggml.model == "gpt2"`), rebuilt from its tokens and merges with the
  pre-tokenizer its `tokenizer.ggml.pre` names.
* `sentencepiece` for a `tokenizer.model` and for a GGUF sentencepiece-style vocabulary
  (`tokenizer.ggml.model == "llama"`): the GGUF tokens, scores and token types are written back
  into a sentencepiece BPE model, so encoding follows sentencepiece's merge-by-score rule and byte
  fallback (`<0xNN>` pieces) exactly.

Special tokens (control, user-defined, and the ones `tokenizer_config.json` adds) are matched
whole in the text passed to `encode`, so a rendered chat prompt keeps `<|im_start|>` as one id.
`encode(text, parse_special=False)` reads the text of special tokens as ordinary characters
instead, and `encode_chat` gives special ids only to the markup a chat template writes itself,
never to text inside a message's content (which would let a user forge turns).
"""

from __future__ import annotations

import codecs
import json
import re
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Sequence

from lmserve.model.text.chat_template import ChatTemplate, ChatTemplateError, NoChatTemplateError
from lmserve.model.errors import CheckpointNotFoundError, UnsupportedArchitectureError

# Token types shared by GGUF (llama.cpp) and sentencepiece's ModelProto.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


def _one_replacement_per_byte(error: UnicodeDecodeError) -> tuple[str, int]:
    return "\ufffd", error.start + 1


# The codecs error handler that decodes invalid UTF-8 as sentencepiece does: one U+FFFD for each byte
# that does not start a valid character (Python's "replace" gives one per maximal invalid subpart).
SENTENCEPIECE_ERRORS = "lmserve-sentencepiece"
codecs.register_error(SENTENCEPIECE_ERRORS, _one_replacement_per_byte)

# Turn-closing markers: when a chat template writes one of these and the vocabulary has it, the
# model ends its reply with it, so it stops generation like the eos token does.
_END_OF_TURN_MARKERS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "<|return|>", "</s>", "<|END_OF_TURN_TOKEN|>",
)

# Split regexes of the byte-level BPE families, by the name llama.cpp writes to tokenizer.ggml.pre.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_PRE = ("default", "gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "roberta-bpe")
_DIGITS_THEN_GPT2_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")
_LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3", "pixtral", "lfm2")
_QWEN2_PRE = ("qwen2", "deepseek-r1-qwen", "megrez")
SUPPORTED_GGUF_PRE_TOKENIZERS = _GPT2_PRE + _DIGITS_THEN_GPT2_PRE + _LLAMA3_PRE + _QWEN2_PRE


class Tokenizer:
    """Encodes text to ids and decodes ids to text for one checkpoint.

    Attributes:
        vocab_size: number of ids the tokenizer can produce (including added tokens).
        bos_id / pad_id: the beginning-of-sequence / padding id, or None.
        eos_ids: every id that ends generation: the eos id(s) the checkpoint names, plus the
            turn-closing markers its chat template writes (e.g. `<|im_end|>`, `<|eot_id|>`).
        chat_template: the checkpoint's Jinja2 template, or None (a base model: `apply_chat_template`
            and `encode_chat` raise NoChatTemplateError; it takes text, not messages).
        add_bos_token: whether `encode(..., add_special_tokens=True)` prepends `bos_id`.
        special_ids: ids that `skip_special_tokens=True` leaves out of decoded text.
    """

    def __init__(
        self,
        backend: "_TokenizersBackend | _SentencePieceBackend",
        *,
        bos_id: int | None,
        eos_ids: Iterable[int],
        pad_id: int | None,
        add_bos_token: bool,
        chat_template: str | None,
    ):
        self._backend = backend
        self.vocab_size: int = backend.vocab_size
        self.bos_id = bos_id
        self._named_eos = eos = tuple(dict.fromkeys(int(i) for i in eos_ids))
        self.eos_ids: tuple[int, ...] = eos + _template_end_markers(backend, chat_template, eos)
        self.pad_id = pad_id
        self.add_bos_token = bool(add_bos_token and bos_id is not None)
        self.chat_template = chat_template
        self.special_ids: frozenset[int] = backend.special_ids

    # -- text <-> ids ---------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids of `text`.

        With `parse_special` (the default), special tokens written in the text (`<|im_end|>`,
        `</s>`) become their single ids; without it their text is encoded like any other, so
        untrusted text can never produce a control token. Vocabulary entries that are not
        special (sentencepiece user-defined pieces, non-special added tokens) match either way.
        With `add_special_tokens`, `bos_id` is prepended when the model wants one
        (`add_bos_token`) and the ids do not already start with it.
        """
        ids = self._backend.encode(text, parse_special)
        if add_special_tokens and self.add_bos_token and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    def encode_marked(self, segments: Iterable[tuple[str, bool]]) -> list[int]:
        """Token ids of the concatenated text of `(text, trusted)` segments, where only trusted
        segments may yield special tokens.

        The text is cut at the special tokens found in trusted segments, and each stretch between
        them (which may join trusted and untrusted text) is encoded with `parse_special=False`, so
        merges across segment borders are the ones encoding the whole text would make.
        """
        specials = self._backend.special_text
        pattern = self._special_pattern
        ids: list[int] = []
        run: list[str] = []

        def flush() -> None:
            if run:
                ids.extend(self._backend.encode("".join(run), False))
                run.clear()

        for text, trusted in segments:
            if not trusted or pattern is None:
                run.append(text)
                continue
            start = 0
            for match in pattern.finditer(text):
                run.append(text[start:match.start()])
                flush()
                ids.append(specials[match.group()])
                start = match.end()
            run.append(text[start:])
        flush()
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`. Bytes that do not form complete UTF-8 characters decode to U+FFFD; ids
        outside the vocabulary (a model's padded embedding rows) decode to nothing."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens)

    @cached_property
    def token_bytes(self) -> tuple[bytes, ...] | None:
        """The bytes each id contributes to decoded text, when that does not depend on the ids
        around it (byte-level BPE, and sentencepiece without a dummy prefix, Gemma's: `decode(ids)` is the
        UTF-8 decoding of the concatenated bytes, invalid bytes as `utf8_errors` says); None for
        vocabularies whose decoding depends on context (a dummy prefix's word-boundary space). Lets a
        stream be detokenized in time proportional to its new bytes."""
        return self._backend.token_bytes()

    @property
    def utf8_errors(self) -> str:
        """The codecs error handler that turns `token_bytes` into the text `decode` gives: "replace" for
        byte-level BPE, SENTENCEPIECE_ERRORS (one U+FFFD per invalid byte) for sentencepiece."""
        return self._backend.utf8_errors

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary entry, spelled as the vocabulary spells it (e.g. `<|im_end|>`,
        `Ġthe` in a byte-level vocabulary, `▁the` in a sentencepiece one); None if absent."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry for `token_id`, or None if out of range."""
        return self._backend.id_to_token(int(token_id))

    # -- chat -----------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **variables: Any) -> str:
        """Prompt text for a conversation, rendered by the checkpoint's template in a Jinja2
        sandbox. Raises `lmserve.model.text.chat_template.ChatTemplateError` on a bad template or
        messages the template refuses."""
        return self._compiled_template.render(messages, add_generation_prompt=add_generation_prompt, **variables)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    **variables: Any) -> tuple[list[int], str]:
        """Token ids and text of a rendered conversation in which only the template's own markup
        yields special tokens: special-token text inside a message's content stays plain text.

        When the template transforms contents so that they cannot be located in its output, a
        content holding special-token text is refused (ChatTemplateError) rather than trusted.
        """
        template = self._compiled_template
        text, spans = template.render_with_spans(messages, add_generation_prompt=add_generation_prompt, **variables)
        if spans is None:
            for i, m in enumerate(messages):
                content = m.get("content")
                if isinstance(content, str) and self.has_special_text(content):
                    raise ChatTemplateError(f"message {i} holds special-token text, which this model's chat "
                                            "template cannot carry as plain text")
            return self.encode(text, parse_special=True), text
        segments, at = [], 0
        for start, end in spans:
            segments += [(text[at:start], True), (text[start:end], False)]
            at = end
        segments.append((text[at:], True))
        return self.encode_marked(segments), text

    def use_chat_template(self, source: str) -> None:
        """Render chats with `source` instead of the checkpoint's template (`--chat-template`): compiled
        in the same sandbox now (ChatTemplateError if it does not compile), and the turn-closing markers
        it writes end generation in place of the old template's."""
        compiled = ChatTemplate(source, *self._template_tokens())
        self.chat_template = source
        self.eos_ids = self._named_eos + _template_end_markers(self._backend, source, self._named_eos)
        self.__dict__["_compiled_template"] = compiled

    def has_special_text(self, text: str) -> bool:
        """Whether `text` spells a special token (which a chat template's own markup may turn into one)."""
        return self._special_pattern is not None and self._special_pattern.search(text) is not None

    def _template_tokens(self) -> tuple[str | None, str | None]:
        bos = self.id_to_token(self.bos_id) if self.bos_id is not None else None
        eos = self.id_to_token(self.eos_ids[0]) if self.eos_ids else None
        return bos, eos

    @cached_property
    def _special_pattern(self) -> "re.Pattern[str] | None":
        return _alternation(self._backend.special_text)

    @cached_property
    def _compiled_template(self) -> ChatTemplate:
        if not self.chat_template:
            raise NoChatTemplateError("this model has no chat template (a pretrained base model): send a text "
                                      "prompt, not messages")
        return ChatTemplate(self.chat_template, *self._template_tokens())

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load from a Hugging Face checkpoint directory.

        Reads `tokenizer.json` (preferred) or `tokenizer.model`; then, when present,
        `tokenizer_config.json` (chat template, bos/eos/pad tokens, `add_bos_token`, added tokens),
        `chat_template.jinja`, `special_tokens_map.json`, `generation_config.json` (eos ids) and
        `config.json` (fallback ids). Raises `CheckpointNotFoundError` if neither tokenizer file
        exists.
        """
        root = Path(path)
        if not root.is_dir():
            raise CheckpointNotFoundError(f"checkpoint directory {str(root)!r} does not exist")
        config = _read_json(root / "tokenizer_config.json")
        special_map = _read_json(root / "special_tokens_map.json")
        if (root / "tokenizer.json").is_file():
            backend = _TokenizersBackend.from_file(root / "tokenizer.json")
        elif (root / "tokenizer.model").is_file():
            backend = _SentencePieceBackend.from_model_file(root / "tokenizer.model", config.get("added_tokens_decoder"))
        else:
            raise CheckpointNotFoundError(f"no tokenizer.json or tokenizer.model in {str(root)!r}")

        def special_id(name: str) -> int | None:
            for source in (config, special_map):
                token = source.get(name)
                if isinstance(token, dict):
                    token = token.get("content")
                if isinstance(token, str) and backend.token_to_id(token) is not None:
                    return backend.token_to_id(token)
            return None

        model_config = _read_json(root / "config.json")
        generation = _read_json(root / "generation_config.json")
        bos_id = _first_int(special_id("bos_token"), generation.get("bos_token_id"), model_config.get("bos_token_id"),
                            backend.default_bos_id)
        pad_id = _first_int(special_id("pad_token"), generation.get("pad_token_id"), model_config.get("pad_token_id"))
        eos_ids = [i for i in (special_id("eos_token"),) if i is not None]
        eos_ids += _int_list(generation.get("eos_token_id"))
        if not eos_ids:
            eos_ids = _int_list(model_config.get("eos_token_id")) or _int_list(backend.default_eos_id)

        add_bos = config.get("add_bos_token")
        if add_bos is None:
            add_bos = backend.adds_bos_by_default(bos_id)
        return cls(backend, bos_id=bos_id, eos_ids=eos_ids, pad_id=pad_id, add_bos_token=bool(add_bos),
                   chat_template=_read_chat_template(root, config))

    @classmethod
    def from_gguf_fields(cls, meta: dict) -> "Tokenizer":
        """Build from GGUF metadata already decoded to Python values.

        Supports `tokenizer.ggml.model` "gpt2" (byte-level BPE from `.tokens` + `.merges`, split
        by the pre-tokenizer `.pre` names) and "llama" (sentencepiece-style BPE from `.tokens`,
        `.scores`, `.token_type`). Raises `UnsupportedArchitectureError` for anything else.
        """
        kind = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise CheckpointNotFoundError("GGUF metadata has no tokenizer.ggml.tokens: the file carries no tokenizer")
        tokens = [t.decode("utf-8", "replace") if isinstance(t, (bytes, bytearray)) else str(t) for t in tokens]
        types = [int(t) for t in meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)]
        if len(types) != len(tokens):
            raise UnsupportedArchitectureError("GGUF tokenizer.ggml.token_type and tokenizer.ggml.tokens differ in length")
        if kind == "gpt2":
            backend = _TokenizersBackend.from_gguf_bpe(tokens, types, meta.get("tokenizer.ggml.merges") or [],
                                                       meta.get("tokenizer.ggml.pre") or "default")
            add_bos_default = False
        elif kind == "llama":
            backend = _SentencePieceBackend.from_gguf(
                tokens, types, meta.get("tokenizer.ggml.scores"),
                unk_id=meta.get("tokenizer.ggml.unknown_token_id"),
                add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
                remove_extra_whitespaces=bool(meta.get("tokenizer.ggml.remove_extra_whitespaces", False)),
                precompiled_charsmap=meta.get("tokenizer.ggml.precompiled_charsmap"),
            )
            add_bos_default = True  # llama.cpp's default for sentencepiece vocabularies
        else:
            raise UnsupportedArchitectureError(
                f"GGUF tokenizer model {kind!r} is not supported; supported are 'gpt2' (byte-level BPE) "
                "and 'llama' (sentencepiece-style BPE)")

        def token_id(key: str) -> int | None:
            value = meta.get(key)
            return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

        eos_ids = [i for i in (token_id("tokenizer.ggml.eos_token_id"), token_id("tokenizer.ggml.eot_token_id"),
                               token_id("tokenizer.ggml.eom_token_id")) if i is not None]
        return cls(backend, bos_id=token_id("tokenizer.ggml.bos_token_id"), eos_ids=eos_ids,
                   pad_id=token_id("tokenizer.ggml.padding_token_id"),
                   add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
                   chat_template=meta.get("tokenizer.chat_template"))

    def save_pretrained(self, path: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json into `path`, so that `from_dir` reads back this
        tokenizer (byte-level BPE vocabularies; a sentencepiece one raises NotImplementedError)."""
        if not isinstance(self._backend, _TokenizersBackend):
            raise NotImplementedError("only a tokenizers-backed vocabulary can be saved as tokenizer.json")
        root = Path(path)
        self._backend._tk.save(str(root / "tokenizer.json"))
        name = self.id_to_token
        config = {"add_bos_token": self.add_bos_token, "chat_template": self.chat_template,
                  "bos_token": None if self.bos_id is None else name(self.bos_id),
                  "eos_token": name(self.eos_ids[0]) if self.eos_ids else None,
                  "pad_token": None if self.pad_id is None else name(self.pad_id)}
        (root / "tokenizer_config.json").write_text(json.dumps(config, indent=1))

    def __repr__(self) -> str:
        return (f"Tokenizer({type(self._backend).__name__}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
                f"eos_ids={self.eos_ids}, pad_id={self.pad_id})")


# ---------------------------------------------------------------------------------------------
# backends


class _TokenizersBackend:
    """A `tokenizers.Tokenizer`; its added tokens are the special ones."""

    def __init__(self, tk):
        self._tk = tk
        added = tk.get_added_tokens_decoder()  # {id: AddedToken}
        self.special_ids = frozenset(i for i, token in added.items() if token.special)
        self.special_text = {token.content: i for i, token in added.items() if token.special and token.content}
        self._plain = None  # a copy that reads special-token text as ordinary text, made on first use
        self.utf8_errors = "replace"  # invalid bytes: one U+FFFD per maximal invalid subpart, as Python's "replace"
        self.vocab_size = max([tk.get_vocab_size(with_added_tokens=True), *(i + 1 for i in added)])
        self.default_bos_id = None
        self.default_eos_id = None

    @classmethod
    def from_file(cls, path: Path) -> "_TokenizersBackend":
        import tokenizers

        return cls(tokenizers.Tokenizer.from_file(str(path)))

    @classmethod
    def from_gguf_bpe(cls, tokens: list[str], types: list[int], merges: list[str], pre: str) -> "_TokenizersBackend":
        from tokenizers import AddedToken, Regex, Tokenizer as RustTokenizer, decoders, models, pre_tokenizers

        ignore_merges = False
        if pre in _GPT2_PRE:
            pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        elif pre in _DIGITS_THEN_GPT2_PRE:  # every digit its own piece, then the GPT-2 split
            pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ])
        elif pre in _LLAMA3_PRE or pre in _QWEN2_PRE:
            split = _LLAMA3_SPLIT if pre in _LLAMA3_PRE else _QWEN2_SPLIT
            ignore_merges = pre in _LLAMA3_PRE  # a whole word found in the vocabulary is taken as is
            pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
        else:
            raise UnsupportedArchitectureError(
                f"GGUF byte-level BPE pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; "
                f"supported: {', '.join(SUPPORTED_GGUF_PRE_TOKENIZERS)}")

        vocab: dict[str, int] = {}
        for index, token in enumerate(tokens):
            vocab.setdefault(token, index)
        pairs = [tuple(m.split(" ", 1)) for m in merges if " " in m]
        tk = RustTokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges))
        tk.pre_tokenizer = pre_tokenizer
        tk.decoder = decoders.ByteLevel()
        control = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
        user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
        if control:
            tk.add_special_tokens(control)
        if user:
            tk.add_tokens(user)
        return cls(tk)

    def adds_bos_by_default(self, bos_id: int | None) -> bool:
        # The post-processor of tokenizer.json says whether the model wants bos.
        if bos_id is None:
            return False
        with_special = self._tk.encode("", add_special_tokens=True).ids
        return bool(with_special) and with_special[0] == bos_id

    def encode(self, text: str, parse_special: bool = True) -> list[int]:
        if parse_special:
            return self._tk.encode(text, add_special_tokens=False).ids
        if self._plain is None:
            import tokenizers

            plain = tokenizers.Tokenizer.from_str(self._tk.to_str())
            plain.encode_special_tokens = True  # special tokens are split like any other text
            self._plain = plain
        return self._plain.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self._tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self) -> tuple[bytes, ...] | None:
        from tokenizers import decoders

        if not isinstance(self._tk.decoder, decoders.ByteLevel):
            return None
        alphabet = _byte_level_alphabet()
        added = self._tk.get_added_tokens_decoder()
        table = []
        for i in range(self.vocab_size):
            if i in added:  # added tokens decode to their own text
                table.append(added[i].content.encode("utf-8"))
                continue
            piece = self._tk.id_to_token(i)
            table.append(b"" if piece is None else
                         b"".join(bytes([alphabet[c]]) if c in alphabet else c.encode("utf-8") for c in piece))
        return tuple(table)

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tk.id_to_token(token_id) if token_id >= 0 else None


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table), inverted: char -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class _SentencePieceBackend:
    """A sentencepiece model, plus the whole-token matching of special pieces that sentencepiece
    itself leaves to its caller.

    Text is cut at special tokens and each stretch between them is encoded on its own (so each
    stretch gets sentencepiece's dummy-prefix space, as llama.cpp does). Decoding renders special
    pieces by their text (or drops them) and keeps the word-boundary space of a stretch that
    follows one; only the very first piece of the output loses its dummy-prefix space.
    """

    def __init__(self, model_proto, added: dict[str, int] | None = None, added_special: Iterable[int] = ()):
        import sentencepiece

        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(model_proto.SerializeToString())
        except (RuntimeError, OSError) as exc:
            raise UnsupportedArchitectureError(f"sentencepiece rejected the vocabulary: {exc}") from exc
        pieces = [(p.piece, p.type) for p in model_proto.pieces]
        self._n_pieces = len(pieces)
        self._dummy_prefix = model_proto.normalizer_spec.add_dummy_prefix
        self._pieces = [p for p, _ in pieces]
        self._types = [t for _, t in pieces]
        # sentencepiece's decoder drops the leading space of the first piece of a call when the
        # vocabulary adds a dummy prefix or removes extra whitespace; a denormalizer rewrites text;
        # a suffix-space vocabulary drops a trailing one. With none of these, each id's text is fixed.
        self._fixed_text = not (model_proto.normalizer_spec.add_dummy_prefix
                                or model_proto.normalizer_spec.remove_extra_whitespaces
                                or model_proto.denormalizer_spec.precompiled_charsmap
                                or model_proto.trainer_spec.treat_whitespace_as_suffix)
        # Matched whole in text: control, unknown and user-defined pieces, and added tokens.
        matched = {p: i for i, (p, t) in enumerate(pieces) if t in (_CONTROL, _UNKNOWN, _USER_DEFINED) and p}
        self._extra: dict[int, str] = {}
        for content, index in (added or {}).items():
            if index >= self._n_pieces:
                self._extra[index] = content
            matched.setdefault(content, index)
        self._matched = matched
        self._split = _alternation(matched)
        # Rendered apart from sentencepiece's decoder: control, unknown and added tokens.
        self._rendered_apart = frozenset(i for i, (_, t) in enumerate(pieces) if t in (_CONTROL, _UNKNOWN)) | set(self._extra)
        self.special_ids = frozenset(i for i, (_, t) in enumerate(pieces) if t in (_CONTROL, _UNKNOWN)) | frozenset(
            set(added_special) | set(self._extra))
        self.vocab_size = max([self._n_pieces, *(i + 1 for i in self._extra)])
        self.special_text = {p: i for p, i in matched.items() if i in self.special_ids}
        self._split_plain = _alternation([p for p in matched if p not in self.special_text])
        self.utf8_errors = SENTENCEPIECE_ERRORS
        bos, eos = self._sp.bos_id(), self._sp.eos_id()
        self.default_bos_id = bos if bos >= 0 else None
        self.default_eos_id = eos if eos >= 0 else None

    @classmethod
    def from_model_file(cls, path: Path, added_tokens_decoder: dict | None = None) -> "_SentencePieceBackend":
        from sentencepiece import sentencepiece_model_pb2 as spb

        proto = spb.ModelProto()
        proto.ParseFromString(path.read_bytes())
        added, added_special = {}, []
        for index, entry in (added_tokens_decoder or {}).items():
            content = entry.get("content") if isinstance(entry, dict) else None
            if content:
                added[content] = int(index)
                if entry.get("special"):
                    added_special.append(int(index))
        return cls(proto, added, added_special)

    @classmethod
    def from_gguf(cls, tokens: list[str], types: list[int], scores: list[float] | None, *, unk_id: int | None,
                  add_space_prefix: bool, remove_extra_whitespaces: bool, precompiled_charsmap=None
                  ) -> "_SentencePieceBackend":
        from sentencepiece import sentencepiece_model_pb2 as spb

        types = [t if _NORMAL <= t <= _BYTE else _NORMAL for t in types]
        if _UNKNOWN not in types:
            if unk_id is None or not 0 <= int(unk_id) < len(tokens):
                raise UnsupportedArchitectureError("sentencepiece-style GGUF vocabulary names no unknown token")
            types[int(unk_id)] = _UNKNOWN
        # Without scores, earlier entries win, the usual order of a BPE vocabulary.
        scores = [float(s) for s in scores] if scores else [-float(i) for i in range(len(tokens))]
        proto = spb.ModelProto()
        proto.trainer_spec.model_type = spb.TrainerSpec.BPE
        proto.trainer_spec.vocab_size = len(tokens)
        proto.trainer_spec.byte_fallback = _BYTE in types
        proto.normalizer_spec.name = "identity"
        proto.normalizer_spec.add_dummy_prefix = add_space_prefix
        proto.normalizer_spec.remove_extra_whitespaces = remove_extra_whitespaces
        proto.normalizer_spec.escape_whitespaces = True
        if precompiled_charsmap:
            proto.normalizer_spec.precompiled_charsmap = bytes(int(b) & 0xFF for b in precompiled_charsmap)
        for token, kind, score in zip(tokens, types, scores):
            piece = proto.pieces.add()
            piece.piece, piece.type, piece.score = token, kind, score
        return cls(proto)

    def adds_bos_by_default(self, bos_id: int | None) -> bool:
        return bos_id is not None

    def encode(self, text: str, parse_special: bool = True) -> list[int]:
        split = self._split if parse_special else self._split_plain
        if split is None:
            return list(self._sp.encode(text))
        ids: list[int] = []
        start = 0
        for match in split.finditer(text):
            if match.start() > start:
                ids += self._sp.encode(text[start:match.start()])
            ids.append(self._matched[match.group()])
            start = match.end()
        if start < len(text):
            ids += self._sp.encode(text[start:])
        return ids

    def token_bytes(self) -> tuple[bytes, ...] | None:
        """Each id's bytes when decoding does not depend on context (no dummy prefix: Gemma's vocabulary):
        a piece with its `▁` as a space, a byte-fallback piece `<0xNN>` the byte NN, a token rendered
        apart (control, unknown, added) its text; None where a piece's leading space depends on where it
        falls. Invalid UTF-8 then decodes as sentencepiece does it: one U+FFFD per byte (SENTENCEPIECE_ERRORS)."""
        if not self._fixed_text:
            return None
        table = []
        for i in range(self.vocab_size):
            if i in self._rendered_apart or i >= self._n_pieces:
                table.append((self.id_to_token(i) or "").encode("utf-8"))
            elif self._types[i] == _BYTE:
                table.append(bytes([int(self._pieces[i][3:5], 16)]))  # <0xNN>
            else:
                table.append(self._pieces[i].replace("\u2581", " ").encode("utf-8"))
        return tuple(table)

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        parts: list[str] = []
        run: list[int] = []

        def close_run() -> None:
            text = self._sp.decode(run)
            if parts and self._dummy_prefix and self._pieces[run[0]].startswith("\u2581"):
                text = " " + text  # sentencepiece drops it from the first piece of every call
            parts.append(text)
            run.clear()

        for token_id in ids:
            if token_id in self._rendered_apart:
                if run:
                    close_run()
                if not (skip_special_tokens and token_id in self.special_ids):
                    parts.append(self.id_to_token(token_id) or "")
            elif 0 <= token_id < self._n_pieces:
                run.append(token_id)
            # ids outside the vocabulary (e.g. padded embedding rows) decode to nothing, as in `tokenizers`
        if run:
            close_run()
        return "".join(parts)

    def token_to_id(self, token: str) -> int | None:
        if token in self._matched:
            return self._matched[token]
        index = self._sp.piece_to_id(token)
        return index if self._sp.id_to_piece(index) == token else None

    def id_to_token(self, token_id: int) -> str | None:
        if token_id in self._extra:
            return self._extra[token_id]
        return self._pieces[token_id] if 0 <= token_id < self._n_pieces else None


# ---------------------------------------------------------------------------------------------
# helpers


def _alternation(strings) -> "re.Pattern[str] | None":
    """One regex matching any of `strings`, the longest one at each position (`<|im_end|>` over `<|im`),
    written as a trie (common prefixes shared: `<|im_end|>` and `<|im_start|>` as `<|im_` and then one of two
    endings; a string that ends where a longer one goes on makes the rest optional, greedy), which the regex
    engine walks a character at a time, where an alternation of the strings is tried string by string at
    every position (Gemma 3's 6,414 special and user-defined pieces: ~7 ms to split 2,600 characters of
    prose, 0.05 ms as a trie; the trie compiles in ~0.2 s, once)."""
    strings = {s for s in strings if s}
    if not strings:
        return None
    trie: dict = {}
    for text in strings:
        node = trie
        for ch in text:
            node = node.setdefault(ch, {})
        node[""] = {}  # a string ends here

    def pattern(node: dict) -> str:
        branches = [re.escape(ch) + pattern(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return "(?:" + body + ")?" if "" in node else body

    return re.compile(pattern(trie))


def _template_end_markers(backend, chat_template: str | None, eos: tuple[int, ...]) -> tuple[int, ...]:
    if not chat_template:
        return ()
    found = []
    for marker in _END_OF_TURN_MARKERS:
        token_id = backend.token_to_id(marker)
        if marker in chat_template and token_id is not None and token_id not in eos and token_id not in found:
            found.append(token_id)
    return tuple(found)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        value = json.load(f)
    return value if isinstance(value, dict) else {}


def _read_chat_template(root: Path, config: dict) -> str | None:
    if (root / "chat_template.jinja").is_file():
        return (root / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template") or _read_json(root / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) and template else None


def _int_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _first_int(*values) -> int | None:
    for value in values:
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return None


__all__ = ["Tokenizer", "SENTENCEPIECE_ERRORS", "SUPPORTED_GGUF_PRE_TOKENIZERS"]
