"""SIGTERM drains: health NOT_SERVING at once, new calls UNAVAILABLE, every call in flight finishes, exit 0.

Also the health Watch RPC, whose subscribers must neither starve the server nor keep it from exiting.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess

import grpc
from _server import UNREACHABLE, read_stream
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lmserve.v1 import lmserve_pb2 as pb
from lmserve.v1 import lmserve_pb2_grpc as pb_grpc

SLOTS = 1
STREAMS = 10  # one decodes at a time, so most are still waiting in the queue when the signal arrives
GRACE = 60
LONG = pb.SamplingParams(max_new_tokens=80, ignore_eos=True)



async def test_sigterm_drains_in_flight_streams(start_server, trained_model_dir):
    server = start_server(trained_model_dir, threads=1, max_batch=SLOTS, grace_period=GRACE)
    async with server.aio_channel() as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)  # connected: the streams start together
        calls = [stub.GenerateStream(pb.GenerateRequest(request_id=f"d{i}", prompt="The baker", params=LONG),
                                     timeout=120) for i in range(STREAMS)]
        head = await calls[0].read()  # the first stream is decoding; the others were sent with it
        assert head is not grpc.aio.EOF
        server.signal(signal.SIGTERM)

        states = [await asyncio.to_thread(server.health)]
        try:
            await stub.Generate(pb.GenerateRequest(prompt="Hi", params=pb.SamplingParams(max_new_tokens=2)), timeout=30)
            raise AssertionError("a call made after SIGTERM was accepted")
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, (exc.code(), exc.details())
        states.append(await asyncio.to_thread(server.health, "lmserve.v1.TextGeneration"))
        liveness = await asyncio.to_thread(server.health, "liveness")  # a drain is no reason to restart it
        results = await asyncio.gather(*(read_stream(c) for c in calls))
    assert states == ["NOT_SERVING", "NOT_SERVING"], "health while draining"
    assert liveness == "SERVING"

    outputs = []
    for i, (rest, err) in enumerate(results):
        msgs = ([head] if i == 0 else []) + rest
        if err is not None:  # only a call that had not reached the server before the signal may be refused
            assert err.code() == grpc.StatusCode.UNAVAILABLE and msgs == [], (i, err.code(), len(msgs))
            continue
        assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH, f"stream {i} was cut short"
        assert msgs[-1].usage.completion_tokens == LONG.max_new_tokens
        outputs.append([t for m in msgs for t in m.token_ids])
    assert all(o == outputs[0] for o in outputs) and len(outputs[0]) == LONG.max_new_tokens

    assert server.wait(timeout=GRACE) == 0
    assert server.health() == UNREACHABLE
    draining = re.search(r"draining: (\d+) call\(s\) in flight", server.log)
    assert draining, server.log_tail()
    in_flight = int(draining.group(1))
    assert 1 <= in_flight <= len(outputs), server.log_tail()  # every call in flight at the signal completed
    assert "Traceback" not in server.log and "grace period over" not in server.log


async def test_calls_left_when_the_grace_period_ends_fail_retryably(start_server, trained_model_dir):
    """--grace-period 1 with ~STREAMS x 80 decode steps queued: the process still exits 0, and every call it
    could not finish fails with UNAVAILABLE (a waiting one before any message), never a non-retryable code."""
    server = start_server(trained_model_dir, threads=1, max_batch=SLOTS, grace_period=1)
    async with server.aio_channel() as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        calls = [stub.GenerateStream(pb.GenerateRequest(prompt="The baker", params=LONG), timeout=120)
                 for _ in range(STREAMS)]
        head = await calls[0].read()
        assert head is not grpc.aio.EOF
        server.signal(signal.SIGTERM)
        results = await asyncio.gather(*(read_stream(c) for c in calls))
    assert server.wait(timeout=60) == 0

    cut = 0
    for i, (msgs, err) in enumerate(results):
        if err is None:
            assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
            tokens = sum(len(m.token_ids) for m in msgs) + (len(head.token_ids) if i == 0 else 0)
            assert tokens == LONG.max_new_tokens
            continue
        cut += 1
        assert err.code() == grpc.StatusCode.UNAVAILABLE, (i, err.code(), err.details())
        assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in msgs)
    over = re.search(r"grace period over with (\d+) call\(s\) still in flight", server.log)
    draining = re.search(r"draining: (\d+) call\(s\) in flight", server.log)
    assert draining, server.log_tail()
    # a call still being converted when the signal came never reached the engine: it is refused (UNAVAILABLE,
    # no message), and is not among those the grace period cut
    refused = STREAMS - int(draining.group(1))
    assert cut <= (int(over.group(1)) if over else 0) + refused, server.log_tail()
    assert "Traceback" not in server.log


async def test_a_stream_whose_reader_stopped_does_not_hold_up_the_drain(start_server, trained_model_dir):
    """Its writes wait on the reader, not on the engine: the drain ends without waiting the grace period.
    The grace period is far longer than any drain takes here, however busy the machine: a drain that waited
    for the reader would not end within EXIT_WITHIN."""
    stalled_grace, exit_within = 3600, 300
    server = start_server(trained_model_dir, threads=1, max_batch=2, grace_period=stalled_grace,
                          stream_idle_timeout=3600)
    small_window = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
    bulky = pb.SamplingParams(max_new_tokens=120, ignore_eos=True, logprobs=20)
    async with server.aio_channel(options=small_window) as slow:
        stalled = pb_grpc.TextGenerationStub(slow).GenerateStream(pb.GenerateRequest(prompt="The baker", params=bulky),
                                                                   timeout=3600)
        assert (await stalled.read()) is not grpc.aio.EOF  # running; nobody reads it from here on
        # the engine finished it: what is left of it waits on the reader (its ~60 KB do not fit the window)
        await asyncio.to_thread(server.wait_idle, 120)
        server.signal(signal.SIGTERM)
        try:
            code = await asyncio.to_thread(server.wait, exit_within)
        except subprocess.TimeoutExpired:
            raise AssertionError("the drain waited for a reader that stopped reading") from None
        finally:
            stalled.cancel()
    assert code == 0
    assert re.search(r"grace period over with 1 call\(s\) still in flight", server.log), server.log_tail()
    assert "Traceback" not in server.log


def watch(channel, timeout):
    return health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=timeout)


def test_cancelled_health_watches_leave_health_checks_working(start_server, trained_model_dir):
    server = start_server(trained_model_dir, threads=1, metrics_port=None)
    try:
        for _ in range(8):  # more than a small worker pool holds
            with server.channel() as ch:
                call = watch(ch, timeout=10)
                assert next(call).status == health_pb2.HealthCheckResponse.SERVING
                call.cancel()
            assert server.health(timeout=5) == "SERVING"
    finally:
        server.kill()


def test_health_watcher_sees_not_serving_and_the_server_still_exits(start_server, trained_model_dir):
    server = start_server(trained_model_dir, threads=1, metrics_port=None)
    try:
        with server.channel() as ch:
            call = watch(ch, timeout=60)
            assert next(call).status == health_pb2.HealthCheckResponse.SERVING
            server.signal(signal.SIGTERM)
            assert next(call).status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert server.wait(timeout=15) == 0
    finally:
        server.kill()
