"""Cancellation and deadlines free their KV slots; the requests left alone still get exact outputs."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest
from _server import read_all

from lmserve.client import Client, DeadlineExceededError
from lmserve.v1 import lmserve_pb2 as pb
from lmserve.v1 import lmserve_pb2_grpc as pb_grpc

STREAMS = 100
CANCELLED = 50
GREEDY = pb.SamplingParams(max_new_tokens=60)
LONG = pb.SamplingParams(max_new_tokens=100, ignore_eos=True)  # + the longest prefix fits in 128


@pytest.fixture(scope="module")
def server(trained_server, trained_server_flags):
    assert trained_server_flags["max_batch"] == 16 and trained_server_flags["max_queue"] >= STREAMS
    return trained_server


def ended(snapshot, status: str) -> float:
    return snapshot.total("lmserve_requests_total", status=status)


async def test_cancellation_storm_frees_every_slot(server, training_prompts):
    prefixes = [p for p, _ in training_prompts]
    before = server.metrics()
    rng = random.Random(20261129)
    cancel_after = {i: rng.randint(0, 10) for i in rng.sample(range(STREAMS), CANCELLED)}

    async with server.aio_channel() as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        reference = {}
        for prefix in prefixes:  # each request alone, before the storm
            res = await stub.Generate(pb.GenerateRequest(prompt=prefix, params=GREEDY), timeout=60)
            reference[prefix] = list(res.token_ids)

        async def complete(i):
            prefix = prefixes[i % len(prefixes)]
            msgs = await read_all(stub.GenerateStream(
                pb.GenerateRequest(request_id=f"keep-{i}", prompt=prefix, params=GREEDY), timeout=120))
            return prefix, msgs

        async def cancel(i, after):
            call = stub.GenerateStream(pb.GenerateRequest(
                request_id=f"cancel-{i}", prompt=prefixes[i % len(prefixes)], params=LONG), timeout=120)
            for _ in range(after):
                msg = await call.read()
                if msg is grpc.aio.EOF or msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    # a reader that falls behind gets chunks merged: this stream finished within `after`
                    # messages, before the cancel (counted ok, which the totals below allow)
                    assert msg is grpc.aio.EOF or msg.usage.completion_tokens == LONG.max_new_tokens
                    call.cancel()
                    return after
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call.read()
            assert await call.code() == grpc.StatusCode.CANCELLED
            return after

        results = await asyncio.gather(*(cancel(i, cancel_after[i]) if i in cancel_after else complete(i)
                                         for i in range(STREAMS)))

        kept = [r for r in results if isinstance(r, tuple)]
        assert len(kept) == STREAMS - CANCELLED
        for prefix, msgs in kept:
            assert [t for m in msgs for t in m.token_ids] == reference[prefix], prefix
            assert msgs[-1].finish_reason in (pb.FINISH_REASON_EOS, pb.FINISH_REASON_LENGTH)
            assert msgs[-1].usage.completion_tokens == len(reference[prefix])

        after = server.wait_idle(timeout=30)  # running, waiting and kv slots used all back to 0
        assert after.get("lmserve_kv_slots_capacity") == 16
        ok = ended(after, "ok") - ended(before, "ok")
        cancelled = ended(after, "cancelled") - ended(before, "cancelled")
        assert ok >= len(prefixes) + len(kept)  # the references, the kept streams, and maybe a cancel that lost a race
        assert ok + cancelled <= len(prefixes) + STREAMS
        # the engine still decodes exactly after the storm
        again = await stub.Generate(pb.GenerateRequest(prompt=prefixes[0], params=GREEDY), timeout=60)
        assert list(again.token_ids) == reference[prefixes[0]]
    assert "Traceback" not in server.log and " ERROR " not in server.log, server.log_tail()


def _duration_alone(stub, request) -> float:
    t0 = time.monotonic()
    res = stub.Generate(request, timeout=60)
    assert res.usage.completion_tokens == LONG.max_new_tokens
    return time.monotonic() - t0


def _budgets(stub, request, tries: int = 4):
    """Deadlines below what the generation needs alone: a quarter of its measured time, then a quarter of
    that for each call that still finished in time (a shared machine can speed up between the measurement
    and the call: no deadline passed then, and that is not what is tested)."""
    budget = _duration_alone(stub, request) / 4
    for _ in range(tries):
        yield budget
        budget /= 4
    raise AssertionError(f"the call finished within every deadline down to {budget * 4:.4f}s")


def test_stream_deadline_is_deadline_exceeded_and_frees_the_slot(server):
    request = pb.GenerateRequest(request_id="dl", prompt="A red fox", params=LONG)
    with server.channel() as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        for budget in _budgets(stub, request):
            before = server.metrics()
            received = []
            try:
                for msg in stub.GenerateStream(request, timeout=budget):
                    received.append(msg)
            except grpc.RpcError as exc:
                error = exc
                break
            server.wait_idle()  # finished within the budget: try a smaller one
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in received)
        after = server.wait_idle()
        ended_early = sum(ended(after, s) - ended(before, s) for s in ("deadline_exceeded", "cancelled"))
        if received:  # the request reached the engine: it ended early, and only once
            assert ended_early == 1
        else:  # the deadline may have passed before the engine saw the request
            assert ended_early <= 1
        assert ended(after, "ok") == ended(before, "ok")


def test_unary_deadline_is_deadline_exceeded_and_frees_the_slot(server):
    request = pb.GenerateRequest(prompt="The lighthouse keeper", params=LONG)
    with server.channel() as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        for budget in _budgets(stub, request):
            try:
                stub.Generate(request, timeout=budget)
            except grpc.RpcError as exc:
                error = exc
                break
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        server.wait_idle()
        with Client(server.target, max_retries=0) as client:
            for budget in _budgets(stub, request):  # the SDK raises its own error for the same status
                try:
                    client.generate("The lighthouse keeper", max_new_tokens=110, ignore_eos=True, timeout=budget)
                except DeadlineExceededError:
                    break
                server.wait_idle()
    server.wait_idle()
