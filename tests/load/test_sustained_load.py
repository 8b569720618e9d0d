"""Sustained closed-loop load: 32 streams for about 12 s, twice the server's 16 slots.

Every request must complete with the memorized continuation (batching under load changes no
greedy token), and the server's /metrics must count exactly what the clients received.
"""

from __future__ import annotations

import asyncio
import time

from lmserve.client import AsyncClient

CONCURRENCY = 32
DURATION = 12.0  # seconds during which workers start new requests
MAX_NEW_TOKENS = 100  # more than any continuation: every request ends with EOS


async def test_closed_loop_completes_every_request_and_matches_metrics(busy_server, server_flags, training_prompts):
    assert CONCURRENCY > server_flags["busy"]["max_batch"]  # some requests always wait for a slot
    before = busy_server.wait_idle()
    records = []
    stop_at = time.monotonic() + DURATION

    async with AsyncClient(busy_server.target, timeout=120, max_retries=0) as client:
        async def worker(w: int) -> None:
            i = w
            while time.monotonic() < stop_at:
                prefix, continuation = training_prompts[i % len(training_prompts)]
                chunks = [c async for c in client.stream(prefix, max_new_tokens=MAX_NEW_TOKENS,
                                                          request_id=f"w{w}-{i}")]
                records.append((prefix, continuation, chunks))
                i += CONCURRENCY

        await asyncio.gather(*(worker(w) for w in range(CONCURRENCY)))  # any error fails the test
    after = busy_server.wait_idle(timeout=60)

    assert len(records) >= CONCURRENCY
    prompt_tokens = completion_tokens = 0
    for prefix, continuation, chunks in records:
        last = chunks[-1]
        assert "".join(c.text for c in chunks) == continuation, prefix
        assert last.finish_reason == "eos" and all(not c.is_last for c in chunks[:-1])
        assert last.usage.completion_tokens == sum(len(c.token_ids) for c in chunks)
        prompt_tokens += last.usage.prompt_tokens
        completion_tokens += last.usage.completion_tokens

    def delta(sample: str, **labels: str) -> float:
        return after.total(sample, **labels) - before.total(sample, **labels)

    assert delta("lmserve_requests_total") == len(records)
    assert delta("lmserve_requests_total", status="ok", finish_reason="eos") == len(records)
    assert delta("lmserve_generated_tokens_total") == completion_tokens
    assert delta("lmserve_prompt_tokens_total") == prompt_tokens
    assert delta("lmserve_request_generated_tokens_count") == len(records)
    # requests were decoded together: far fewer engine steps than generated tokens
    assert delta("lmserve_engine_step_duration_seconds_count") * 2 < completion_tokens
