"""Stop strings matched on streamed text across token boundaries."""

from __future__ import annotations


class StopStringMatcher:
    """Feeds on text deltas; releases only text that can no longer start a stop string.

    The stop string itself is never released. Text that could be the beginning of a stop string
    is held back until the next delta decides it (or `flush` releases it at the end).
    """

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.text = ""
        self.sent = 0  # text[:sent] has been released
        self.stopped = False
        self.matched: str | None = None  # the stop string that matched

    def push(self, delta: str) -> str:
        """Add a delta; return the text now safe to release. Sets `stopped` on a match."""
        if self.stopped:
            return ""
        self.text += delta
        if not self.stops:
            out, self.sent = self.text[self.sent:], len(self.text)
            return out
        hits = [(i, s) for i, s in ((self.text.find(s, self.sent), s) for s in self.stops) if i >= 0]
        if hits:
            cut, self.matched = min(hits, key=lambda h: h[0])
            out, self.sent, self.stopped = self.text[self.sent:cut], cut, True
            return out
        keep = self._held_suffix()
        end = len(self.text) - keep
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def flush(self) -> str:
        """Release what was held back (the stream ended without a match)."""
        if self.stopped:
            return ""
        out, self.sent = self.text[self.sent:], len(self.text)
        return out

    def _held_suffix(self) -> int:
        """Length of the longest unreleased suffix that is a proper prefix of some stop string."""
        tail = self.text[self.sent:]
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(tail)), best, -1):
                if tail.endswith(s[:k]):
                    best = k
                    break
        return best
