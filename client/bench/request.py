"""One timed, streamed request of the load generator, through any client that has ``stream()``
(lmserve's gRPC AsyncClient, or the OpenAI-compatible OpenAIStreamClient)."""

from __future__ import annotations

import time
from typing import Any

from .stats import RequestRecord
from ..errors import LmserveError
from ..types import SamplingParams


async def timed_request(client, prompt: Any, params: SamplingParams, timeout: float | None, run_start: float,
                        text: list[str] | None = None) -> RequestRecord:
    """Stream one request and time each piece; `text`, when given, collects the answer's pieces.

    A piece counts its token ids; a piece with text but no ids (an OpenAI stream does not say) counts
    as one token, and the last piece is corrected so the total matches the server's usage."""
    start = time.perf_counter()
    events: list[tuple[float, int]] = []
    prompt_tokens = 0
    completion_tokens = None
    error = None
    try:
        async for chunk in client.stream(prompt, params, timeout=timeout):
            n = len(chunk.token_ids) or (1 if chunk.text else 0)
            if n:
                events.append((time.perf_counter() - start, n))
            if text is not None:
                text.append(chunk.text)
            if chunk.usage is not None:
                prompt_tokens = chunk.usage.prompt_tokens
                completion_tokens = chunk.usage.completion_tokens
    except LmserveError as e:
        error = e.code.name if e.code is not None else type(e).__name__
    if error is None and events and completion_tokens is not None:
        counted = sum(k for _, k in events)
        if counted != completion_tokens:
            t, k = events[-1]
            events[-1] = (t, max(1, k + completion_tokens - counted))
    return RequestRecord(start=start - run_start, e2e=time.perf_counter() - start, events=events,
                         prompt_tokens=prompt_tokens, error=error)
