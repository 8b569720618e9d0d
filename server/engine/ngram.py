"""Prompt-lookup drafts: the next tokens guessed from an earlier occurrence of the current suffix.

Text that repeats what a request was given (an edit of the code it quotes, a passage it cites, an
answer built from a document) continues the way the earlier occurrence did. For each sequence the
proposer keeps an index of its n-grams (n = min_n..max_n) over prompt + output, updated as tokens
are recorded (O(max_n) dictionary writes per token, never a rescan), and drafts the tokens that
followed the latest earlier occurrence of the longest suffix it finds.

Once a draft comes from somewhere, the proposer keeps a pointer into that source (the copy) and
follows it while the output agrees. A quote rarely agrees to the letter: the model adds a comma,
renames a variable, drops a word. Where the output leaves the copy, the pointer realigns without
waiting for a new n-gram: a token found among the next `REALIGN` source tokens resumes the copy
after it (a dropped or replaced token), and if nothing else matches, one draft assumes the token was
inserted and resumes where the copy stood. Each costs O(REALIGN) work a step.

Tokens are matched by word class: a word with its leading space and the same word without it (`The`
at a sentence's start, ` The` inside one) are one class (word_classes, from the tokenizer), so an
answer that quotes a document's sentence from within its own finds it. Drafts are still the source's
own tokens.

A request may also name the text it expects to repeat (a `reference`: OpenAI's predicted output,
e.g. the file an edit rewrites). Its tokens are indexed before the prompt, behind a separator no
token equals, and the first draft copies its beginning.

Draft length adapts to the sequence's own record. The first draft is short (`first` tokens, 4 by
default): on text that repeats nothing it is rejected, and a long one would cost a dear verifying
step for nothing (a short answer pays for it in full). The length doubles after a draft accepted
whole, up to `max_draft`, and falls to what was accepted plus one otherwise; after `patience` drafts
in a row with nothing accepted the sequence stops drafting for `cooldown` tokens, then tries one token
again. The engine verifies drafts (runner.py, scheduler.py, sampler.py); beside the guesses this
module holds only the rule for how much of a verified draft is kept (`kept`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from lmserve.model.text.tokenizer import SENTENCEPIECE_ERRORS

REALIGN = 3  # source tokens searched for the output's latest token where the output left its copy
SEPARATOR = -1  # between a reference and the sequence: never a token, so no n-gram matches across it


@dataclass(frozen=True)
class Speculation:
    """Prompt-lookup speculation settings (EngineSettings.speculation resolved by the engine)."""

    max_draft: int = 8  # tokens drafted per sequence and step at most
    max_batch: int = 4  # draft only while at most this many sequences decode (a full step gains little)
    min_n: int = 2
    max_n: int = 4
    # a request's first draft: verifying 4 drafts cost 1.2x a decode step against 1.1x for 2 on the
    # 2-core Zen 5 EPYC (bfloat16+int8), and a whole first draft of 4 saves twice the steps
    first: int = 4
    classes: Sequence[int] | None = field(default=None, repr=False, compare=False)  # word_classes(tokenizer)

    def __post_init__(self):
        if self.max_draft < 1 or self.max_batch < 1 or self.first < 1 or not 1 <= self.min_n <= self.max_n:
            raise ValueError("speculation needs max_draft >= 1, max_batch >= 1, first >= 1 and 1 <= min_n <= max_n")

    @staticmethod
    def verifiable(params) -> bool:
        """Drafts are verified for plain greedy requests only: a row's token is then the argmax of its
        logits, which verification computes exactly as decoding would. Sampled rows would need rejection
        sampling to keep their seeded streams, and penalised rows a tally per draft position."""
        return (params.temperature == 0 and params.repetition_penalty == 1.0
                and not params.presence_penalty and not params.frequency_penalty)

    @staticmethod
    def applies(params) -> bool:
        """Speculation drafts for this request: it allows them and they can be verified."""
        return params.speculate and Speculation.verifiable(params)

    def proposer(self, tokens: list[int], reference=()) -> "NgramProposer":
        return NgramProposer(tokens, self.max_draft, self.min_n, self.max_n, first=self.first, reference=reference,
                             classes=self.classes)


def word_classes(tokenizer, vocab_size: int) -> tuple[int, ...] | None:
    """Each token id's class for matching: the id of the same text without its leading space where the
    vocabulary holds both (` The` -> `The`), else the id itself; None when no token pairs up. Byte-level
    vocabularies are read from their token bytes, sentencepiece ones from their pieces (`▁The`), also where
    they have a byte table (Gemma's, whose runs of literal spaces would pair up by their bytes)."""
    table = getattr(tokenizer, "token_bytes", None)
    if getattr(tokenizer, "utf8_errors", None) == SENTENCEPIECE_ERRORS:
        table = None
    classes = list(range(vocab_size))
    if table is not None:
        ids: dict[bytes, int] = {}
        for i, b in enumerate(table[:vocab_size]):
            ids.setdefault(b, i)
        pairs = ((i, ids.get(b[1:])) for i, b in enumerate(table[:vocab_size]) if len(b) > 1 and b[:1] == b" ")
    else:
        pieces = [tokenizer.id_to_token(i) for i in range(vocab_size)]
        pairs = ((i, tokenizer.token_to_id(p[1:])) for i, p in enumerate(pieces)
                 if p is not None and len(p) > 1 and p[0] == "\u2581")
    found = False
    for i, j in pairs:
        if j is not None and j < vocab_size:
            classes[i], found = j, True
    return tuple(classes) if found else None


def kept(tokens: list[int], ok: list[bool], first: int, draft) -> int:
    """How many drafted tokens a verifying row keeps: the longest prefix equal to the tokens its rows
    chose (rows first .. first + len(draft)), each followed by a row that chose one at all. The tokens
    recorded are then rows first .. first + kept: the kept drafts and the model's own next token."""
    n = 0
    while n < len(draft) and tokens[first + n] == draft[n] and ok[first + n + 1]:
        n += 1
    return n


class NgramProposer:
    """One sequence's n-gram index and draft-length state (Sequence.draft, owned by the scheduler)."""

    def __init__(self, tokens: list[int], max_draft: int = 8, min_n: int = 2, max_n: int = 4,
                 patience: int = 3, cooldown: int = 16, first: int = 2, reference=(), classes: Sequence[int] | None = None):
        if not 1 <= min_n <= max_n or max_draft < 1:
            raise ValueError("need 1 <= min_n <= max_n and max_draft >= 1")
        self.max_draft, self.min_n, self.max_n = max_draft, min_n, max_n
        self.patience, self.cooldown = patience, cooldown
        self.tokens: list[int] = []
        self._classes = classes
        self._keys: list[int] = []  # each token's word class: what n-grams and the copy compare
        # n-gram -> position just after its latest occurrence, for occurrences ending before the last token
        self._index: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]
        self.length = max(1, min(first, max_draft))  # the next draft's length
        self._misses = 0  # drafts in a row with nothing accepted
        self._resting = 0  # tokens still to wait before drafting again
        self._copy: int | None = None  # position of the source token the output is expected to repeat next
        self._following = False  # the latest token was the copy's (the pointer advanced past it)
        self._inserted_tried = False  # the "token inserted" draft was tried since the output left this copy
        self.drafted_total = 0
        self.accepted_total = 0
        self._separator = len(reference) if reference else -1  # drafts stop before it
        if reference:
            self.extend([*reference, SEPARATOR])
        self.extend(tokens)
        if reference:  # the output is expected to start where the reference does
            self._copy, self._following = 0, True

    def extend(self, tokens) -> None:
        """Tokens appended to the sequence (prompt at first, then each recorded output token)."""
        classes = self._classes
        for tok in tokens:
            self._index_last()
            key = classes[tok] if classes is not None and 0 <= tok < len(classes) else tok
            copy = self._copy
            self._following = copy is not None and copy < len(self._keys) and self._keys[copy] == key
            if self._following:
                self._copy, self._inserted_tried = copy + 1, False
            self.tokens.append(tok)
            self._keys.append(key)
            if self._resting:
                self._resting -= 1

    def _index_last(self) -> None:
        """Index the n-grams ending at the current last token (so a lookup of the suffix finds an
        earlier occurrence, never the suffix itself)."""
        t, end = self._keys, len(self._keys)
        for n in range(self.min_n, min(self.max_n, end) + 1):
            self._index[n][tuple(t[end - n: end])] = end

    def match(self) -> int | None:
        """Where the tokens after the latest earlier occurrence of the longest suffix (max_n down to
        min_n) start, or None when no suffix occurred before."""
        t, end = self._keys, len(self._keys)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            after = self._index[n].get(tuple(t[end - n:]))
            if after is not None:
                return after
        return None

    def _source(self) -> int | None:
        """Where the next draft is copied from: the copy while the output follows it; else the copy
        realigned past the latest token (found among the next REALIGN source tokens); else the
        longest-suffix match; else, once, the copy as it stands (the latest token was inserted)."""
        t, end, copy = self._keys, len(self._keys), self._copy
        live = copy is not None and copy < end - 1  # a copy with a source token left to draft
        if live:
            if self._following:
                return copy
            for q in range(copy, min(end - 1, copy + REALIGN)):
                if t[q] == t[-1]:
                    return q + 1
        after = self.match()
        if after is not None:
            return after
        if live and not self._inserted_tried:
            self._inserted_tried = True
            return copy
        return None

    def propose(self, limit: int) -> list[int]:
        """Up to min(limit, the adapted length) tokens to verify; [] when there is nothing to copy or
        drafting rests."""
        k = min(limit, self.length)
        if k <= 0 or self._resting:
            return []
        start = self._source()
        if start is None:
            return []
        if start != self._copy:  # a new source: its own divergence may be tried as an insertion
            self._copy, self._inserted_tried = start, False
        if start <= self._separator < start + k:  # a reference's end
            k = self._separator - start
        return self.tokens[start: start + k]  # may run into the suffix itself: a repeating pattern

    def accepted(self, drafted: int, accepted: int) -> None:
        """The outcome of a verified draft: adapt the next draft's length."""
        if drafted <= 0:
            return
        self.drafted_total += drafted
        self.accepted_total += accepted
        if accepted == drafted:
            self.length, self._misses = min(self.max_draft, 2 * drafted), 0
            return
        self.length = max(1, accepted + 1)
        self._misses = self._misses + 1 if accepted == 0 else 0
        if self._misses >= self.patience:
            self._misses, self._resting, self.length = 0, self.cooldown, 1
