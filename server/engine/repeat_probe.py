"""Ending an output where the model starts to write an earlier part of it again, word for word.

Small models offered parallel tool calls write their call, then the same call again and again until the
token limit; the edge drops the repeats, but only after each was generated in full (two calls' worth of
tokens for one call). A request names the text that begins each part and the text that ends it
(`SamplingParams.repeat_marker`: a tool call's trigger and its closing tag). Where the part the model
has just begun so far equals the start of an earlier one, the rest of that earlier part is drafted and
verified in one step, as speculation verifies any draft (greedy rows only: a row's token is the argmax
of its logits, which verification computes exactly as decoding would). All of it accepted: decoding
would write the earlier part again to the letter, so the output ends where the repeat begins (the
drafted tokens are never recorded). Any of it rejected: the accepted tokens and the model's own next
token are kept, as for any draft, and the part is new.

Parts are matched on tokens: a part's body is the tokens after the token that completes its begin, up to
the token that completes its end. Text is attributed to the token whose detokenizing produced it; a
boundary placed a token off only makes a draft that is rejected or never offered, never a wrong
output (an accepted draft is what decoding writes).
"""

from __future__ import annotations

from collections import deque

_RECENT = 64  # (token, end of its text) pairs kept to place a marker's first character


class _Finder:
    """Where a string occurs in text pushed piece by piece: (first, last) character of each occurrence."""

    def __init__(self, text: str):
        self.text = text
        self._tail = ""  # the text not yet searched whole: an occurrence may begin in it
        self._chars = 0

    def push(self, piece: str) -> list[tuple[int, int]]:
        base = self._chars - len(self._tail)  # where the tail starts in the whole text
        self._chars += len(piece)
        self._tail += piece
        found, m, after = [], len(self.text), 0
        while (pos := self._tail.find(self.text, after)) != -1:
            found.append((base + pos, base + pos + m - 1))
            after = pos + m
        self._tail = self._tail[max(after, len(self._tail) - (m - 1)):]
        return found


class RepeatProbe:
    """One sequence's parts, found in its output text as it is detokenized (not thread-safe): each begins
    with `begin` and ends with the first `end` after it."""

    def __init__(self, begin: str, end: str):
        if not begin or not end:
            raise ValueError("a repeat probe needs the text that begins a part and the text that ends it")
        self._begin, self._end = _Finder(begin), _Finder(end)
        self._chars = 0
        self._ends: deque[tuple[int, int]] = deque(maxlen=_RECENT)  # (output index, text end) per token
        self.begins: list[int] = []  # per part: the output index of the token holding its begin's first character
        self.bodies: list[int] = []  # per part: the output index after the token completing its begin
        # per part ended (by number): the output index after the token completing its end
        self.ends: dict[int, int] = {}
        self.probed = False  # the step being launched verifies a probe (scheduler sets, processor clears)

    def push(self, index: int, text: str) -> None:
        """Output token `index` added `text` (in order, every token, empty text too)."""
        self._chars += len(text)
        self._ends.append((index, self._chars))
        for first, last in self._begin.push(text):
            self.begins.append(self._token_at(first))
            self.bodies.append(self._token_at(last) + 1)
        for first, last in self._end.push(text):  # the latest part's end, if it has none yet
            part = len(self.begins) - 1
            if part >= 0 and part not in self.ends and self._token_at(first) >= self.bodies[part]:
                self.ends[part] = self._token_at(last) + 1

    def _token_at(self, char: int) -> int:
        for index, end in self._ends:
            if char < end:
                return index
        return self._ends[-1][0]

    @property
    def due(self) -> bool:
        """A part has begun after an ended one, and has not ended yet."""
        return len(self.begins) >= 2 and len(self.begins) - 1 not in self.ends and bool(self.ends)

    def draft(self, output: list[int]) -> tuple[int, ...]:
        """The rest of an ended earlier part whose body the latest part's body begins like, or ()."""
        if not self.due:
            return ()
        cur = output[self.bodies[-1]:]
        for j in sorted(self.ends, reverse=True):
            earlier = output[self.bodies[j]: self.ends[j]]
            if len(cur) < len(earlier) and earlier[: len(cur)] == cur:
                return tuple(earlier[len(cur):])
        return ()
