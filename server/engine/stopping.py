"""Stop strings matched on streamed text across token boundaries."""

from __future__ import annotations


class StopStringMatcher:
    """Feeds on text deltas; releases only text that can no longer start a stop string.

    The stop string itself is never released. Text that could be the beginning of a stop string
    is held back until the next delta decides it (or `flush` releases it at the end).
    """

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.pending = ""  # text received but not released: at most the longest stop string's length
        self.stopped = False
        self.matched: str | None = None  # the stop string that matched

    def push(self, delta: str) -> str:
        """Add a delta; return the text now safe to release. Sets `stopped` on a match.

        Work is bounded by the delta plus the longest stop string, however long the stream."""
        if self.stopped:
            return ""
        if not self.stops:
            return delta
        text = self.pending + delta
        hits = [(i, s) for i, s in ((text.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            cut, self.matched = min(hits, key=lambda h: h[0])
            self.pending, self.stopped = "", True
            return text[:cut]
        keep = self._held_suffix(text)
        self.pending = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """Release what was held back (the stream ended without a match)."""
        if self.stopped:
            return ""
        out, self.pending = self.pending, ""
        return out

    def _held_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
