"""The edge under careless and hostile clients, on real servers of the trained model:

* health answers promptly while clients send the largest inputs (tokenizing runs on worker threads);
* a stream whose reader stopped reading is cancelled after --stream-idle-timeout, its slot freed,
  and counted in lmserve_stream_idle_timeouts_total;
* a per-server cap on concurrent calls and on health watchers answers RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import grpc
from _server import async_wait_until, read_stream
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lmserve.v1 import lmserve_pb2 as pb
from lmserve.v1 import lmserve_pb2_grpc as pb_grpc

BIG_CHARS = 1_000_000  # characters per request in the responsiveness test
CLIENTS = 6
HEALTH_BOUND = 1.0  # seconds at least; the goal is 100 ms, the bound is loose for a shared 2-core machine
# a connection that reads little ahead, so the server's writes really wait for the reader
SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0), ("grpc.use_local_subchannel_pool", 1)]
BULKY = pb.SamplingParams(max_new_tokens=120, ignore_eos=True, logprobs=20)


async def test_health_answers_while_clients_send_maximal_inputs(start_server, trained_model_dir):
    server = start_server(trained_model_dir, threads=1, metrics_port=None, max_input_chars=BIG_CHARS,
                          max_receive_message_bytes=8 * 2**20)
    text = ("The baker woke long before sunrise, 你好 🍵 " * (BIG_CHARS // 40))[:BIG_CHARS]
    big = [("grpc.max_receive_message_length", 256 * 2**20), ("grpc.max_send_message_length", 16 * 2**20)]
    async with server.aio_channel(options=big) as heavy, server.aio_channel() as light:
        stub, health = pb_grpc.TextGenerationStub(heavy), health_pb2_grpc.HealthStub(light)
        await health.Check(health_pb2.HealthCheckRequest(), timeout=10)  # connected

        async def hostile(i):
            if i == 0:  # one Tokenize (its 10 MB answer is decoded by this test's own loop, so only one)
                return await stub.Tokenize(pb.TokenizeRequest(text=text), timeout=300)
            try:  # tokenized in full, then refused: far more tokens than the context holds
                await stub.Generate(pb.GenerateRequest(prompt=text), timeout=300)
            except grpc.aio.AioRpcError as exc:
                return exc.code()

        load_started = time.perf_counter()
        load = asyncio.gather(*(hostile(i) for i in range(CLIENTS)))
        latencies = []
        while not load.done():
            t0 = time.perf_counter()
            reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=30)
            latencies.append(time.perf_counter() - t0)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            await asyncio.sleep(0.02)
        results = await load
        load_seconds = time.perf_counter() - load_started
    print(f"\nhealth under load: {len(latencies)} checks, median {statistics.median(latencies) * 1000:.1f} ms, "
          f"max {max(latencies) * 1000:.1f} ms, load {load_seconds:.1f} s")
    assert len(latencies) >= 10, "the load ended too soon to measure anything"
    # An event loop that tokenized would hold a check for a whole input's tokenizing: CLIENTS inputs on 2
    # input workers, about 2 / CLIENTS of the load each. Half that is the bound where it exceeds
    # HEALTH_BOUND, so a machine busy with other jobs, which slows the load and the checks alike, cannot
    # fail a server whose loop stayed free.
    assert max(latencies) < max(HEALTH_BOUND, load_seconds / CLIENTS)
    assert len(results[0].token_ids) > 100_000
    assert results[1:] == [grpc.StatusCode.INVALID_ARGUMENT] * (CLIENTS - 1)


async def test_a_stream_nobody_reads_is_cancelled_and_its_slot_freed(start_server, trained_model_dir):
    server = start_server(trained_model_dir, threads=1, max_batch=2, stream_idle_timeout=2)
    request = pb.GenerateRequest(prompt="The baker", params=BULKY)
    before = await asyncio.to_thread(server.metrics)
    assert before.get("lmserve_stream_idle_timeouts_total") == 0
    async with server.aio_channel(options=SMALL_WINDOW) as slow, server.aio_channel() as fast:
        stalled = pb_grpc.TextGenerationStub(slow).GenerateStream(request, timeout=120)
        head = await stalled.read()  # running; now nobody reads it
        assert head.finish_reason == pb.FINISH_REASON_UNSPECIFIED
        t0 = time.monotonic()
        idle = await async_wait_until(lambda: server.metrics().get("lmserve_stream_idle_timeouts_total") == 1,
                                      timeout=60, what="the idle stream to be timed out")
        print(f"\nstalled stream timed out {time.monotonic() - t0:.1f}s after its last read")
        # its engine request ended (cancelled, or finished while its output waited) and the slot is free
        after = await asyncio.to_thread(server.wait_idle)
        assert after.total("lmserve_requests_total") == 1
        # the server serves others in full meanwhile
        reference = await pb_grpc.TextGenerationStub(fast).Generate(request, timeout=60)
        assert reference.usage.completion_tokens == BULKY.max_new_tokens
        # a reader that comes back gets what was sent, then the reason the stream ended
        rest, err = await read_stream(stalled)
    assert idle
    assert err is not None and err.code() == grpc.StatusCode.CANCELLED and "stream-idle-timeout" in err.details()
    got = [t for m in [head, *rest] for t in m.token_ids]
    assert 0 < len(got) < BULKY.max_new_tokens and got == list(reference.token_ids[: len(got)])
    assert "cancelling stream" in server.log and "Traceback" not in server.log


async def test_a_reader_that_keeps_reading_slowly_is_not_cut_off(start_server, trained_model_dir):
    # a read every 0.1 s against a 10 s limit: a margin no busy machine eats
    server = start_server(trained_model_dir, threads=1, max_batch=2, stream_idle_timeout=10, metrics_port=None)
    async with server.aio_channel(options=SMALL_WINDOW) as slow:
        call = pb_grpc.TextGenerationStub(slow).GenerateStream(
            pb.GenerateRequest(prompt="The baker", params=pb.SamplingParams(max_new_tokens=40, ignore_eos=True,
                                                                           logprobs=20)), timeout=120)
        msgs = []
        while (msg := await call.read()) is not grpc.aio.EOF:
            msgs.append(msg)
            await asyncio.sleep(0.1)  # slow, but never 10 s without a read
    assert await call.code() == grpc.StatusCode.OK
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH and msgs[-1].usage.completion_tokens == 40


async def test_concurrent_call_and_health_watcher_caps(start_server, trained_model_dir):
    server = start_server(trained_model_dir, threads=1, max_batch=1, metrics_port=None, max_concurrent_rpcs=3,
                          max_health_watchers=2)
    watch_req = health_pb2.HealthCheckRequest(service="lmserve.v1.TextGeneration")
    async with server.aio_channel() as ch, server.aio_channel(options=SMALL_WINDOW) as slow:
        stub, health = pb_grpc.TextGenerationStub(ch), health_pb2_grpc.HealthStub(ch)
        watches = [health.Watch(watch_req, timeout=60) for _ in range(2)]
        for w in watches:
            assert (await w.read()).status == health_pb2.HealthCheckResponse.SERVING
        _, err = await read_stream(health.Watch(watch_req, timeout=30))  # a third watcher: over its own cap
        assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
        assert "health watchers" in err.details()

        # two watchers and a stream its reader does not read: three calls in progress, the cap
        stalled = pb_grpc.TextGenerationStub(slow).GenerateStream(pb.GenerateRequest(prompt="The baker", params=BULKY),
                                                                   timeout=60)
        await stalled.read()
        try:
            await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
            raise AssertionError("a call beyond --max-concurrent-rpcs was served")
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (exc.code(), exc.details())
        stalled.cancel()
        for w in watches:
            w.cancel()
        info = None  # the cap's places come back: calls are served again
        for _ in range(100):
            try:
                info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
                break
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                await asyncio.sleep(0.1)
    assert info is not None
    assert (info.limits.max_concurrent_rpcs, info.limits.max_health_watchers) == (3, 2)
    assert server.health() == "SERVING"
