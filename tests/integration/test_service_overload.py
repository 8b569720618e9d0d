"""Admission control: with one slot and a queue of two, excess streams get RESOURCE_EXHAUSTED before any message."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from _server import read_stream, wait_until

from lmserve.client import Client, OverloadedError
from lmserve.v1 import lmserve_pb2 as pb
from lmserve.v1 import lmserve_pb2_grpc as pb_grpc

MAX_QUEUE = 2
# held as long as the context allows, one token a step: the trained model's memorised, repeating text
# would otherwise let speculation finish a holder in a fraction of the steps and empty the queue early
LONG = pb.SamplingParams(max_new_tokens=110, ignore_eos=True, disable_speculation=True)


@pytest.fixture(scope="module")
def server(start_module_server, trained_model_dir):
    return start_module_server(trained_model_dir, threads=1, max_batch=1, max_queue=MAX_QUEUE)



async def test_excess_streams_are_rejected_before_any_message(server):
    for _ in range(3):
        async with server.aio_channel() as channel:
            stub = pb_grpc.TextGenerationStub(channel)
            first = stub.GenerateStream(pb.GenerateRequest(request_id="r0", prompt="The baker", params=LONG),
                                        timeout=120)
            head = await first.read()  # r0 now holds the only slot for ~110 decode steps
            assert head is not grpc.aio.EOF and head.request_id == "r0"

            calls = [stub.GenerateStream(pb.GenerateRequest(request_id=f"r{i}", prompt="The baker", params=LONG),
                                         timeout=120) for i in range(1, 6)]
            results = await asyncio.gather(read_stream(first), *(read_stream(c) for c in calls))

        rejected = [(msgs, err) for msgs, err in results if err is not None]
        admitted = [msgs for msgs, err in results if err is None]
        for msgs, err in rejected:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (err.code(), err.details())
            assert msgs == [], "a rejected stream received messages"
            assert "overloaded" in err.details()

        admitted[0].insert(0, head)
        outputs = []
        for msgs in admitted:
            assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert msgs[-1].usage.completion_tokens == LONG.max_new_tokens
            outputs.append([t for m in msgs for t in m.token_ids])
        assert all(o == outputs[0] for o in outputs), "same greedy request, different tokens"
        assert len(outputs[0]) == LONG.max_new_tokens
        server.wait_idle()
        if len(rejected) == 5 - MAX_QUEUE:
            break
        # r0 finished before all five calls arrived (a busy machine delayed this client), so a place was
        # free for one of them: the count above does not hold for this run, which runs again
    else:
        raise AssertionError("r0 never held the slot until the other calls arrived, in 3 runs")
    assert len(admitted) == 1 + MAX_QUEUE


def test_server_accepts_again_once_the_queue_drains(server):
    with Client(server.target, timeout=60, max_retries=0) as client:
        result = client.generate("The baker", max_new_tokens=5, ignore_eos=True)
    assert result.usage.completion_tokens == 5
    server.wait_idle()


def test_sdk_maps_overload_to_overloaded_error(server):
    """With the slot and the queue held by three long streams, the next call is refused, as OverloadedError.
    A holder is not held up by its reader, so a client delayed by a busy machine may find a place freed
    (or the queue not yet full): such a run is inconclusive and runs again. The client's channel is made
    and used before the holders start, so that once the queue is seen full the call is one RPC away."""
    outcomes = []
    with Client(server.target, timeout=60, max_retries=0) as client:
        client.generate("The baker", max_new_tokens=1)  # connected, the channel ready
        server.wait_idle()
        for _ in range(6):
            with server.channel() as channel:
                stub = pb_grpc.TextGenerationStub(channel)
                holders = [stub.GenerateStream(pb.GenerateRequest(prompt="The baker", params=LONG), timeout=120)
                           for _ in range(1 + MAX_QUEUE)]
                next(holders[0])  # running
                try:
                    full = _queue_fills(server)
                    try:
                        client.generate("The baker", max_new_tokens=1)
                        outcomes.append(f"admitted (queue seen full: {full})")
                    except OverloadedError as exc:
                        outcomes.append("refused")
                        assert exc.code.name == "RESOURCE_EXHAUSTED" and "overloaded" in exc.message
                finally:
                    for call in holders:
                        call.cancel()
            server.wait_idle()
            if outcomes[-1] == "refused":
                break
        else:
            raise AssertionError(f"no call was refused while the queue was held: {outcomes}")


def _queue_fills(server, timeout: float = 60.0) -> bool:
    """Wait until MAX_QUEUE requests wait for the slot; False if the holders never filled it."""
    try:
        wait_until(lambda: server.metrics().get("lmserve_waiting_requests") >= MAX_QUEUE, timeout, 0.02,
                   "the queue to fill")
        return True
    except TimeoutError:
        return False
