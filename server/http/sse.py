"""Server-sent events over ASGI, and the watch that turns a client's disconnect into a cancel.

`EventStream` sends its events as they come, unbuffered (also through proxies: X-Accel-Buffering: no),
while a watcher waits on `receive()`; a disconnect cancels the stream's task, which closes the event
source, which cancels the engine request. `unless_disconnected` does the same for a whole response.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Awaitable, TypeVar

T = TypeVar("T")
HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
           (b"x-accel-buffering", b"no")]


async def _disconnected(receive) -> None:
    """Returns when the client has gone (the request body was read before)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream:
    """An ASGI response streaming `events` (bytes each) as text/event-stream."""

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str] | None = None):
        self.events = events
        self.headers = HEADERS + [(k.encode(), v.encode()) for k, v in (headers or {}).items()]

    async def __call__(self, scope, receive, send) -> None:
        task = asyncio.current_task()
        state = {"sending": True, "gone": False}

        async def watch() -> None:
            await _disconnected(receive)
            if state["sending"]:
                state["gone"] = True
                task.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            state["sending"] = False
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not state["gone"]:
                raise
            task.uncancel()  # the client left: a normal end for this handler
        finally:
            state["sending"] = False
            watcher.cancel()
            with contextlib.suppress(BaseException):
                await self.events.aclose()


async def unless_disconnected(receive, work: Awaitable[T]) -> T | None:
    """The result of `work`, or None (work cancelled) if the client disconnects first."""
    job = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({job, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        job.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if job.done():
        return job.result()
    job.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await job
    return None
