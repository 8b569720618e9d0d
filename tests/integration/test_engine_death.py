"""A server whose engine loop dies: the calls in flight end at once with UNAVAILABLE (retryable), new
calls are refused, and the process exits non-zero so an orchestrator
restarts it. The server runs in this process (real gRPC on loopback, the trained model), so the
test can make the engine's scheduling fail mid-generation, the way a bug or a broken device would."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from _server import HOST
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lmserve.server.app import EXIT_ENGINE_DIED, Server
from lmserve.server.config import ServerSettings
from lmserve.server.engine import EngineSettings
from lmserve.v1 import lmserve_pb2 as pb
from lmserve.v1 import lmserve_pb2_grpc as pb_grpc


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the loop dies, by design
async def test_a_dead_engine_loop_fails_calls_unavailable_and_exits_non_zero(trained_model_dir):
    settings = ServerSettings(model=str(trained_model_dir), host=HOST, port=0, metrics_port=0, http_port=0,
                              device="cpu", dtype="float32", compile="false", grace_period=30,
                              engine=EngineSettings(max_batch=4))
    server = Server(settings)
    run = asyncio.create_task(server.run_until_signal())
    async with grpc.aio.insecure_channel(f"{HOST}:{server.port}") as ch:
        stub, health = pb_grpc.TextGenerationStub(ch), health_pb2_grpc.HealthStub(ch)
        loop = asyncio.get_running_loop()
        end = loop.time() + 300  # loading, on a machine that may be busy
        while (await health.Check(health_pb2.HealthCheckRequest(), timeout=10)).status \
                != health_pb2.HealthCheckResponse.SERVING:
            assert loop.time() < end and not run.done(), "the server never became SERVING"
            await asyncio.sleep(0.05)
        engine = server.engine

        real_schedule = engine.scheduler.schedule

        def broken_schedule():  # once only the long request is left, a few tokens in, the loop breaks
            running = engine.scheduler.running
            if not engine.scheduler.waiting and len(running) == 1 and len(running[0].output_ids) >= 3 \
                    and running[0].request.params.max_new_tokens == 100:
                raise RuntimeError("injected: the engine failed while scheduling")
            return real_schedule()

        engine.scheduler.schedule = broken_schedule
        short = stub.GenerateStream(pb.GenerateRequest(prompt="The baker", params=pb.SamplingParams(
            max_new_tokens=2, ignore_eos=True)), timeout=60)
        long = stub.GenerateStream(pb.GenerateRequest(prompt="A red fox", params=pb.SamplingParams(
            max_new_tokens=100, ignore_eos=True)), timeout=60)  # no call may wait for its deadline

        async def outcome(call):
            got = []
            try:
                async for m in call:
                    got.append(m)
            except grpc.aio.AioRpcError as exc:
                return got, exc.code(), exc.details()
            return got, grpc.StatusCode.OK, ""

        (short_msgs, short_code, _), (long_msgs, long_code, long_details) = await asyncio.wait_for(
            asyncio.gather(outcome(short), outcome(long)), 20)
        exit_code = await asyncio.wait_for(run, 40)
    assert short_code == grpc.StatusCode.OK and short_msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert long_code == grpc.StatusCode.UNAVAILABLE, (long_code, long_details)
    assert "retry" in long_details and "injected" not in long_details  # nothing internal leaks
    assert sum(len(m.token_ids) for m in long_msgs) < 100
    assert not engine.health().alive
    assert exit_code == EXIT_ENGINE_DIED != 0
