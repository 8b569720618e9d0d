"""Admission control: with one slot and a queue of two, excess streams get RESOURCE_EXHAUSTED before any message."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from _server import read_stream

from lmserve.client import Client, OverloadedError
from lmserve.v1 import lmserve_pb2 as pb
from lmserve.v1 import lmserve_pb2_grpc as pb_grpc

MAX_QUEUE = 2
LONG = pb.SamplingParams(max_new_tokens=110, ignore_eos=True)


@pytest.fixture(scope="module")
def server(start_module_server, trained_model_dir):
    return start_module_server(trained_model_dir, threads=1, max_batch=1, max_queue=MAX_QUEUE)



async def test_excess_streams_are_rejected_before_any_message(server):
    async with server.aio_channel() as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        first = stub.GenerateStream(pb.GenerateRequest(request_id="r0", prompt="The baker", params=LONG), timeout=120)
        head = await first.read()  # r0 now holds the only slot for ~110 decode steps
        assert head is not grpc.aio.EOF and head.request_id == "r0"

        calls = [stub.GenerateStream(pb.GenerateRequest(request_id=f"r{i}", prompt="The baker", params=LONG),
                                     timeout=120) for i in range(1, 6)]
        results = await asyncio.gather(read_stream(first), *(read_stream(c) for c in calls))

    rejected = [(msgs, err) for msgs, err in results if err is not None]
    admitted = [msgs for msgs, err in results if err is None]
    assert len(rejected) == 5 - MAX_QUEUE and len(admitted) == 1 + MAX_QUEUE
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


def test_server_accepts_again_once_the_queue_drains(server):
    with Client(server.target, timeout=60, max_retries=0) as client:
        result = client.generate("The baker", max_new_tokens=5, ignore_eos=True)
    assert result.usage.completion_tokens == 5
    server.wait_idle()


def test_sdk_maps_overload_to_overloaded_error(server):
    with server.channel() as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        holders = [stub.GenerateStream(pb.GenerateRequest(prompt="The baker", params=LONG), timeout=120)
                   for _ in range(1 + MAX_QUEUE)]
        next(holders[0])  # running
        try:
            with Client(server.target, timeout=60, max_retries=0) as client:
                with pytest.raises(OverloadedError):
                    for _ in range(10):  # the queued calls may not have arrived yet: keep asking
                        client.generate("The baker", max_new_tokens=1)
        finally:
            for call in holders:
                call.cancel()
    server.wait_idle()
