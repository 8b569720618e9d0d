"""A request's n choices as concurrent engine requests: admitted all or none, then collected together
(`gather_all`) or streamed as one sequence of (choice index, chunk) in arrival order (`merged`).

Leaving early (a client gone, an error in one choice) closes every choice's chunk stream, which cancels
its engine request and frees its KV. One choice (n = 1, the usual case) costs no task or queue.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Awaitable, TypeVar

T = TypeVar("T")
_END = object()


async def admit(runs: list[AsyncIterator]) -> list[AsyncIterator]:
    """Start each run (a Frontend.run with announce=True) until its request is queued; when one is refused
    (a full queue, a drain), the ones already queued are cancelled and the refusal raised."""
    started = []
    try:
        for run in runs:
            started.append(run)
            await run.__anext__()
    except BaseException:
        for run in started:
            with contextlib.suppress(BaseException):
                await run.aclose()
        raise
    return runs


async def gather_all(work: list[Awaitable[T]]) -> list[T]:
    """Every result, in order; the first failure cancels the rest (asyncio.gather would leave them running)."""
    if len(work) == 1:
        return [await work[0]]
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def merged(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(index, item) from every stream as items arrive; an error in one ends them all."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    queue.put_nowait((i, item, None))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, who raises it
            queue.put_nowait((i, _END, exc))
        else:
            queue.put_nowait((i, _END, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is _END:
                left -= 1
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
