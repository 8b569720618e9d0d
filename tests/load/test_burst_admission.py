"""A burst beyond the admission bound: exactly the excess is refused, nothing admitted is lost.

The small server has 2 slots and a queue of 3, so 5 requests fit. Each request asks for 120
tokens, so the whole burst arrives while the first admitted requests are still decoding: the
test checks that ordering before it counts.
"""

from __future__ import annotations

import asyncio
import time

from lmserve.client import AsyncClient, OverloadedError

BURST = 14
LONG = dict(max_new_tokens=120, ignore_eos=True)


async def test_burst_refuses_exactly_the_excess(small_server, server_flags):
    flags = server_flags["small"]
    capacity = flags["max_batch"] + flags["max_queue"]
    assert BURST > capacity
    async with AsyncClient(small_server.target, timeout=120, max_retries=0) as client:
        reference = (await client.generate("The baker", **LONG)).token_ids
        before = await asyncio.to_thread(small_server.wait_idle)

        async def one(i: int):
            chunks = []
            try:
                async for chunk in client.stream("The baker", request_id=f"b{i}", **LONG):
                    chunks.append(chunk)
            except OverloadedError as error:
                return "refused", chunks, time.monotonic(), error
            return "done", chunks, time.monotonic(), None

        for _ in range(3):
            outcomes = await asyncio.gather(*(one(i) for i in range(BURST)))
            after = await asyncio.to_thread(small_server.wait_idle)
            refused = [o for o in outcomes if o[0] == "refused"]
            done = [o for o in outcomes if o[0] == "done"]
            if refused and max(t for _, _, t, _ in refused) < min(t for _, _, t, _ in done):
                break
            # a request finished before the whole burst was admitted (a busy machine delayed the client),
            # freeing a place: the counts below would not hold, so the burst is sent again
            before = after
        else:
            raise AssertionError("in 3 bursts a request always finished before the burst was admitted")
        assert len(refused) == BURST - capacity and len(done) == capacity
        for _, chunks, _, error in refused:
            assert chunks == [] and error.code.name == "RESOURCE_EXHAUSTED"
        for _, chunks, _, _ in done:  # every admitted request finishes whole and exact
            assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == LONG["max_new_tokens"]
            assert [t for c in chunks for t in c.token_ids] == reference

        def delta(sample: str, **labels: str) -> float:
            return after.total(sample, **labels) - before.total(sample, **labels)

        assert delta("lmserve_requests_total") == capacity  # refusals are not counted as served
        assert delta("lmserve_requests_total", status="ok", finish_reason="length") == capacity
        assert delta("lmserve_generated_tokens_total") == capacity * LONG["max_new_tokens"]

        again = await client.generate("The baker", max_new_tokens=5, ignore_eos=True)  # admitting again
        assert again.token_ids == reference[:5]
