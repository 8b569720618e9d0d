"""The bridge from an lmserve tokenizer to the matcher library's vocabulary: the bytes of every id.

A grammar matcher decides which tokens may come next by the bytes each token adds to the output, so
it needs one byte string per id, the one the output text is made of:

* byte-level BPE (GGUF "gpt2", most `tokenizer.json` files): `Tokenizer.token_bytes` already gives
  them (a multi-byte character may be split across tokens; the matcher works on bytes, so a token
  holding half of one is allowed exactly where the grammar allows the whole character);
* sentencepiece (GGUF "llama", `tokenizer.model`): a piece's `▁` is a space, and a byte-fallback
  piece `<0xNN>` is the single byte NN;
* special ids (control tokens, `<|im_end|>`) are marked with a leading 0xFF byte, which no UTF-8
  text contains, so no grammar can spell them: they can only be allowed as end of sequence;
* ids past the tokenizer's vocabulary (a model's padded embedding rows) are empty and never allowed.

Building the index costs about a second for a 50k vocabulary (~3 s for Gemma 3's 262k), so one is
built per served model.

The index is cut into slices (MASK_SLICES): tokens grouped by a pattern, whose mask the library ORs in
whole wherever the grammar allows every string of the pattern, and walks token by token elsewhere.
Inside a JSON string the tokens of plain characters are nearly the whole vocabulary; with a
`maxLength`, only the slices no longer than what is left of it apply, so the slices go by length.
The masks are the same with any slices; only their cost differs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SPECIAL_MARK = b"\xff"
_STRING_CHAR = r'[^"\\\x00-\x1F\x7F]'  # a character a JSON string holds as itself (no quote, backslash, control)
# whitespace runs; plain string characters by length, up to 30 (finer at the short end, where a string's
# maxLength leaves few); any number of them. The library's default has lengths 10 and 30 only: a string
# with fewer than 10 characters left then walks every id (~0.4 ms a mask at 262k ids, 0.04 at 49k).
MASK_SLICES = (r"[\x20\x0A\x0D\x09]+", *(f"{_STRING_CHAR}{{1,{k}}}" for k in (1, 2, 3, 4, 5, 6, 8, 10, 15, 30)),
               _STRING_CHAR + "+")


@dataclass(frozen=True)
class Vocabulary:
    """A model's vocabulary as the matcher sees it.

    size: the width of the model's logits (>= the tokenizer's vocabulary);
    token_bytes: the bytes each id adds to the output (special ids: SPECIAL_MARK + their text);
    eos_ids: the ids allowed where, and only where, a constraint is complete;
    ll_tokenizer: the library's index over those bytes, shared by every matcher of this model.
    """

    size: int
    token_bytes: tuple[bytes, ...]
    eos_ids: tuple[int, ...]
    ll_tokenizer: object

    def __repr__(self) -> str:
        return f"Vocabulary(size={self.size}, eos_ids={self.eos_ids})"


def token_bytes_of(tokenizer) -> list[bytes]:
    """The output bytes of each of `tokenizer`'s ids, special ids marked (see the module docstring)."""
    special = tokenizer.special_ids
    fixed = tokenizer.token_bytes
    table: list[bytes] = []
    for i in range(tokenizer.vocab_size):
        if fixed is not None:
            raw = fixed[i]
        else:  # sentencepiece: spell the piece
            piece = tokenizer.id_to_token(i) or ""
            m = _BYTE_PIECE.fullmatch(piece)
            raw = bytes([int(m.group(1), 16)]) if m and i not in special else piece.replace("\u2581", " ").encode("utf-8")
        table.append(SPECIAL_MARK + raw if i in special else raw)
    return table


class _Encoder:
    """What the library calls to tokenize text it forces (a literal the constraint requires): lmserve's
    own encoding when its tokens spell exactly that text, else the longest matching token at each
    position. (A sentencepiece encoding starts with a word-boundary space the text does not have, and
    the library would then allow only that token.)"""

    def __init__(self, tokenizer, tokens: list[bytes], eos_id: int):
        self._tokenizer = tokenizer
        self.tokens = tokens
        self.eos_token_id = eos_id
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = sorted(tokenizer.special_ids)
        self._by_bytes: dict[bytes, int] = {}
        for i, b in enumerate(tokens):  # the last id of equal bytes: a piece over sentencepiece's earlier byte pieces
            if b and not b.startswith(SPECIAL_MARK):
                self._by_bytes[b] = i
        self._longest = max(map(len, self._by_bytes), default=1)

    def __call__(self, text) -> list[int]:
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        ids = self._tokenizer.encode(data.decode("utf-8", "replace"), parse_special=False)
        if b"".join(self.tokens[i] for i in ids) == data:
            return ids
        return self._longest_match(data)

    def _longest_match(self, data: bytes) -> list[int]:
        ids, at = [], 0
        while at < len(data):
            for n in range(min(self._longest, len(data) - at), 0, -1):
                token = self._by_bytes.get(data[at:at + n])
                if token is not None:
                    ids.append(token)
                    at += n
                    break
            else:  # a byte no token spells: skipped (the library then finds no tokens for it)
                at += 1
        return ids


def build_vocabulary(tokenizer, logits_size: int | None = None) -> Vocabulary:
    """Index `tokenizer`'s vocabulary for the matcher (about a second for 50k ids: build once per model).

    logits_size: the model's logits width when it exceeds the tokenizer's vocabulary."""
    import llguidance

    size = max(logits_size or 0, tokenizer.vocab_size)
    tokens = token_bytes_of(tokenizer)
    tokens += [b""] * (size - len(tokens))
    eos_ids = tuple(tokenizer.eos_ids)
    if not eos_ids:
        raise ValueError("the tokenizer names no end-of-sequence id; constrained decoding needs one")
    wrapper = llguidance.TokenizerWrapper(_Encoder(tokenizer, tokens, eos_ids[0]))
    ll = llguidance.LLTokenizer(wrapper, n_vocab=size, eos_token=list(eos_ids), slices=list(MASK_SLICES))
    return Vocabulary(size=size, token_bytes=tuple(tokens), eos_ids=eos_ids, ll_tokenizer=ll)


__all__ = ["MASK_SLICES", "SPECIAL_MARK", "Vocabulary", "build_vocabulary", "token_bytes_of"]
