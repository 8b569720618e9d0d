"""The event-loop side of a request's output: a buffer the engine thread fills once per step.

The engine hands a step's chunks to each event loop in one `call_soon_threadsafe`; each lands in
its request's `ChunkStream`. A reader that keeps up takes one chunk per step. A reader that falls
behind (a slow client, flow control) finds its pending chunks merged into one, so what a stream
holds is at most its request's own output, never a queue of one message per token.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Callable, Iterable

from .outputs import GenerationChunk, merge_chunks


class ChunkStream:
    """One request's pending output, read with `await get()`; lives on its event loop."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.loop = loop
        self._pending: GenerationChunk | None = None
        self._waiter: asyncio.Future | None = None

    def put(self, chunk: GenerationChunk) -> None:
        """Add a chunk (on the loop); merged with what the reader has not taken yet."""
        self._pending = chunk if self._pending is None else merge_chunks(self._pending, chunk)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> GenerationChunk:
        while self._pending is None:
            self._waiter = self.loop.create_future()
            await self._waiter
        chunk, self._pending = self._pending, None
        return chunk


def _put_all(items: list[tuple[ChunkStream, GenerationChunk]]) -> None:
    for stream, chunk in items:
        stream.put(chunk)


def hand_off(items: Iterable[tuple[ChunkStream, GenerationChunk]],
             on_closed_loop: Callable[[ChunkStream], None]) -> None:
    """Give each event loop its streams' chunks in one call (called on the engine thread)."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
    for stream, chunk in items:
        by_loop[stream.loop].append((stream, chunk))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # the loop is closed: nobody is listening
            for stream, _ in batch:
                on_closed_loop(stream)
