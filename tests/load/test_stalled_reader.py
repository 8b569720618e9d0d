"""Readers that stop draining their streams do not hold up anyone else.

Baseline: eight SDK streams complete alone. Then the same eight run while three other streams
sit open and unread after their first message (the calls stay open, nothing is cancelled). The
stalled streams use their own connection with a 1 KiB HTTP/2 read-ahead and no window probing,
and ask for 20 log-probability alternatives per token, so the server's writes to them really do
block on flow control (with the SDK's default windows the whole output would simply be buffered).

The eight must complete within the same bound with the same tokens; the stalled calls must still
be open then; afterwards one drains to its full, exact length (its pending tokens merged into fewer
messages than tokens), the others are cancelled, and every slot is free.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from integration._server import read_all

from lmserve.client import AsyncClient
from lmserve.v1 import lmserve_pb2 as pb
from lmserve.v1 import lmserve_pb2_grpc as pb_grpc

OTHERS = 8
STALLED = 3
BOUND = 120.0  # seconds allowed to the eight streams, with or without stalled readers
MAX_NEW_TOKENS = 100
BULKY = pb.SamplingParams(max_new_tokens=120, ignore_eos=True, logprobs=20)
SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0),
                ("grpc.use_local_subchannel_pool", 1)]


async def run_others(client: AsyncClient, prompts) -> list[list]:
    async def one(i: int) -> list:
        prefix, _ = prompts[i % len(prompts)]
        return [c async for c in client.stream(prefix, max_new_tokens=MAX_NEW_TOKENS, request_id=f"o{i}")]

    return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(OTHERS))), BOUND)


async def test_stalled_readers_do_not_stall_other_streams(busy_server, training_prompts):
    prompts = training_prompts[::2]
    request = pb.GenerateRequest(prompt="The baker", params=BULKY)
    async with AsyncClient(busy_server.target, timeout=300, max_retries=0) as client, \
            busy_server.aio_channel(options=SMALL_WINDOW) as slow_channel:
        slow = pb_grpc.TextGenerationStub(slow_channel)
        reference = await slow.Generate(request, timeout=60)
        baseline = await run_others(client, prompts)
        before = await asyncio.to_thread(busy_server.wait_idle)

        stalled = [slow.GenerateStream(request, timeout=300) for _ in range(STALLED)]
        heads = [await call.read() for call in stalled]  # each call is running; now nobody reads them
        with_stall = await run_others(client, prompts)

        for i, (alone, loaded) in enumerate(zip(baseline, with_stall)):
            prefix, continuation = prompts[i % len(prompts)]
            assert [t for c in loaded for t in c.token_ids] == [t for c in alone for t in c.token_ids], prefix
            assert "".join(c.text for c in loaded) == continuation and loaded[-1].finish_reason == "eos"
        assert all(not call.done() for call in stalled), "a stalled call ended while nobody read it"
        assert all(h.finish_reason == pb.FINISH_REASON_UNSPECIFIED for h in heads)

        # the first stalled stream drains to its full, exact length; the others are cancelled
        drained = [heads[0], *await read_all(stalled[0])]
        assert await stalled[0].code() == grpc.StatusCode.OK
        assert [t for m in drained for t in m.token_ids] == list(reference.token_ids)
        assert "".join(m.text for m in drained) == reference.text
        # what piled up while nobody read came as merged messages, not one queued message per token
        assert len(drained) < len(reference.token_ids)
        assert drained[-1].finish_reason == pb.FINISH_REASON_LENGTH
        got, want = drained[-1].usage, reference.usage  # cached_prompt_tokens differs: the later request hits the earlier one's prefix
        assert (got.prompt_tokens, got.completion_tokens) == (want.prompt_tokens, want.completion_tokens)
        logprobs = [lp for m in drained for lp in m.logprobs]
        assert all(len(lp.top) == BULKY.logprobs for lp in logprobs)  # every alternative arrived
        # batching with other requests moves float rounding a little, never the chosen tokens
        assert [lp.logprob for lp in logprobs] == pytest.approx([lp.logprob for lp in reference.logprobs], abs=1e-3)
        for call in stalled[1:]:
            call.cancel()
            assert await call.code() == grpc.StatusCode.CANCELLED

    after = await asyncio.to_thread(busy_server.wait_idle)  # every KV slot is free again
    assert after.get("lmserve_kv_slots_used") == 0
    served = after.total("lmserve_requests_total") - before.total("lmserve_requests_total")
    assert served == OTHERS + STALLED  # each stalled request ended exactly once
