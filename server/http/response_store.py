"""The Responses API's stored responses: each kept with the conversation it ends, so that a request can
continue it by `previous_response_id`, and `GET /v1/responses/{id}` return it.

Bounded in count (--responses-store-max, the oldest dropped first) and in age (--responses-store-ttl
seconds); in memory only, so a restart forgets them and each replica keeps its own.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from ..inputs import ChatTurn


@dataclass(frozen=True)
class Stored:
    body: dict  # the response as answered
    turns: tuple[ChatTurn, ...]  # its conversation: the input (without instructions) and its output


class ResponseStore:
    """Thread-safe: the edge stores from the event loop and reads from worker threads."""

    def __init__(self, max_entries: int = 1000, ttl: float = 3600.0, clock=time.monotonic):
        self.max_entries, self.ttl, self.clock = max_entries, ttl, clock
        self._entries: OrderedDict[str, tuple[float, Stored]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, stored: Stored) -> None:
        if self.max_entries <= 0:
            return
        with self._lock:
            self._entries[response_id] = (self.clock() + self.ttl, stored)
            self._entries.move_to_end(response_id)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        """The stored response, or None when unknown or expired."""
        with self._lock:
            self._expire()
            entry = self._entries.get(response_id)
        return None if entry is None else entry[1]

    def delete(self, response_id: str) -> bool:
        with self._lock:
            self._expire()
            return self._entries.pop(response_id, None) is not None

    def _expire(self) -> None:
        now = self.clock()
        while self._entries:  # entries are in the order they expire (one ttl for all)
            key, (deadline, _) = next(iter(self._entries.items()))
            if deadline > now:
                break
            del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)
