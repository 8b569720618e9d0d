"""SIGTERM drains: health NOT_SERVING at once, new calls UNAVAILABLE, every call in flight finishes, exit 0."""

from __future__ import annotations

import asyncio
import re
import signal

import grpc
from _server import UNREACHABLE, async_wait_until

from lmserve.v1 import lmserve_pb2 as pb
from lmserve.v1 import lmserve_pb2_grpc as pb_grpc

SLOTS = 1
STREAMS = 16  # one decodes at a time, so most are still waiting in the queue when the signal arrives
GRACE = 60
LONG = pb.SamplingParams(max_new_tokens=100, ignore_eos=True)


async def read_all(call) -> list[pb.GenerateStreamResponse]:
    messages = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        messages.append(msg)
    return messages


async def test_sigterm_drains_in_flight_streams(start_server, trained_model_dir):
    server = start_server(trained_model_dir, threads=1, max_batch=SLOTS, grace_period=GRACE)
    async with server.aio_channel() as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        calls = [stub.GenerateStream(pb.GenerateRequest(request_id=f"d{i}", prompt="The baker", params=LONG),
                                     timeout=120) for i in range(STREAMS)]
        head = await calls[0].read()
        assert head is not grpc.aio.EOF

        def all_admitted_some_waiting() -> bool:
            m = server.metrics()
            waiting, running, done = (m.get("lmserve_waiting_requests"), m.get("lmserve_running_requests"),
                                      m.total("lmserve_requests_total"))
            return waiting + running + done == STREAMS and waiting >= 2

        await async_wait_until(all_admitted_some_waiting, 30, what="every stream admitted and some waiting")
        server.signal(signal.SIGTERM)

        await async_wait_until(lambda: server.health() == "NOT_SERVING", 10, what="NOT_SERVING after SIGTERM")
        assert await asyncio.to_thread(server.health, "lmserve.v1.TextGeneration") == "NOT_SERVING"
        try:
            await stub.Generate(pb.GenerateRequest(prompt="Hi", params=pb.SamplingParams(max_new_tokens=2)), timeout=30)
            raise AssertionError("a call made while draining was accepted")
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, (exc.code(), exc.details())

        rests = await asyncio.gather(*(read_all(c) for c in calls))
    outputs = []
    for i, rest in enumerate(rests):
        msgs = ([head] if i == 0 else []) + rest
        assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH, f"stream {i} was cut short"
        assert msgs[-1].usage.completion_tokens == LONG.max_new_tokens
        outputs.append([t for m in msgs for t in m.token_ids])
    assert all(o == outputs[0] for o in outputs) and len(outputs[0]) == LONG.max_new_tokens

    assert server.wait(timeout=GRACE) == 0
    assert server.health() == UNREACHABLE
    draining = re.search(r"draining: (\d+) call\(s\) in flight", server.log)
    assert draining and int(draining.group(1)) >= 2, server.log_tail()
    assert "Traceback" not in server.log and "grace period over" not in server.log
