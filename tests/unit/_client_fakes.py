"""A scripted TextGeneration servicer on a real loopback grpc.aio server, for SDK tests.

The server runs in its own thread and event loop, so sync and asyncio clients can both
call it. It records every request and its metadata, and can fail the first attempts,
abort mid-stream, or stream slowly until cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass, field

import grpc
import grpc.aio
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from lmserve.v1 import lmserve_pb2 as pb
from lmserve.v1 import lmserve_pb2_grpc as pb_grpc


@dataclass
class Failure:
    """An abort: status code, message, optional BadRequest violations and RetryInfo seconds."""

    code: grpc.StatusCode
    message: str = "scripted failure"
    violations: list[tuple[str, str]] = field(default_factory=list)
    retry_seconds: float | None = None

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        status = status_pb2.Status(code=getattr(code_pb2, self.code.name), message=self.message)
        if self.violations:
            bad = error_details_pb2.BadRequest(
                field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(field=f, description=d) for f, d in self.violations
                ]
            )
            status.details.add().Pack(bad)
        if self.retry_seconds is not None:
            info = error_details_pb2.RetryInfo()
            info.retry_delay.FromNanoseconds(int(self.retry_seconds * 1e9))
            status.details.add().Pack(info)
        return (("grpc-status-details-bin", status.SerializeToString()),)


@dataclass
class Script:
    """What the fake does. Attempts are counted per RPC method."""

    fail_first: list[Failure] = field(default_factory=list)  # one per failing attempt
    stream_words: list[str] = field(default_factory=lambda: ["Hel", "lo", " world"])
    abort_after_chunks: Failure | None = None  # abort mid-stream after all words
    stream_forever: bool = False  # keep streaming until cancelled
    prompt_tokens: int = 5


class FakeTextGeneration(pb_grpc.TextGenerationServicer):
    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[tuple[str, object]] = []
        self.metadata: list[dict[str, str]] = []
        self.attempts: dict[str, int] = {}
        self.cancelled = threading.Event()

    async def _admit(self, method: str, request, context) -> None:
        self.requests.append((method, request))
        self.metadata.append({k: v for k, v in context.invocation_metadata() if isinstance(v, str)})
        n = self.attempts.get(method, 0)
        self.attempts[method] = n + 1
        if n < len(self.script.fail_first):
            failure = self.script.fail_first[n]
            await context.abort(failure.code, failure.message, trailing_metadata=failure.trailing_metadata())

    async def Generate(self, request, context):
        await self._admit("Generate", request, context)
        words = self.script.stream_words
        return pb.GenerateResponse(
            request_id=request.request_id or "srv-1",
            text="".join(words),
            token_ids=list(range(len(words))),
            finish_reason=pb.FINISH_REASON_LENGTH,
            usage=pb.Usage(prompt_tokens=self.script.prompt_tokens, completion_tokens=len(words)),
            timing=pb.Timing(queue_seconds=0.01, time_to_first_token_seconds=0.02, total_seconds=0.03),
        )

    async def GenerateStream(self, request, context):
        await self._admit("GenerateStream", request, context)
        # The RPC's end before the stream's, not only CancelledError in here: a cancel that lands while
        # grpc awaits a write outside this generator never raises inside it.
        finished = []
        context.add_done_callback(lambda _: None if finished else self.cancelled.set())
        rid = request.request_id or "srv-1"
        try:
            for i, word in enumerate(self.script.stream_words):
                yield pb.GenerateStreamResponse(request_id=rid, text=word, token_ids=[i])
            if self.script.abort_after_chunks is not None:
                f = self.script.abort_after_chunks
                await context.abort(f.code, f.message, trailing_metadata=f.trailing_metadata())
            i = len(self.script.stream_words)
            while self.script.stream_forever:
                yield pb.GenerateStreamResponse(request_id=rid, text=".", token_ids=[i])
                i += 1
                await asyncio.sleep(0.005)
            n = len(self.script.stream_words)
            yield pb.GenerateStreamResponse(
                request_id=rid,
                finish_reason=pb.FINISH_REASON_STOP,
                matched_stop="\n",
                usage=pb.Usage(prompt_tokens=self.script.prompt_tokens, completion_tokens=n),
                timing=pb.Timing(queue_seconds=0.0, time_to_first_token_seconds=0.1, total_seconds=0.2),
            )
            finished.append(True)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def Tokenize(self, request, context):
        await self._admit("Tokenize", request, context)
        text = request.text if request.WhichOneof("input") == "text" else "|".join(
            f"{m.role}:{m.content}" for m in request.messages.messages
        )
        return pb.TokenizeResponse(token_ids=[ord(c) for c in text], tokens=list(text), text=text)

    async def GetModelInfo(self, request, context):
        await self._admit("GetModelInfo", request, context)
        return pb.GetModelInfoResponse(
            model_name="fake", architecture="llama", context_length=2048, vocab_size=49152,
            dtype="float32", device="cpu", eos_token_ids=[2], max_new_tokens_limit=512,
            max_batch_size=8, default_max_new_tokens=64, bos_token_id=1, has_chat_template=True,
            num_parameters=135_000_000, server_version="0.1.0",
        )


class LoopbackServer:
    """Runs a FakeTextGeneration (and grpc.health.v1) on 127.0.0.1 in a background loop."""

    def __init__(self, script: Script | None = None, health_status: str = "SERVING",
                 server_credentials: grpc.ServerCredentials | None = None) -> None:
        self.servicer = FakeTextGeneration(script or Script())
        self.health_status = health_status
        self.server_credentials = server_credentials
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: grpc.aio.Server | None = None
        self.port = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def localhost_target(self) -> str:
        """The address by host name, for TLS certificates issued to "localhost"."""
        return f"localhost:{self.port}"

    async def _start(self) -> None:
        self._server = grpc.aio.server()
        pb_grpc.add_TextGenerationServicer_to_server(self.servicer, self._server)
        health_servicer = health.aio.HealthServicer()
        await health_servicer.set("", health_pb2.HealthCheckResponse.ServingStatus.Value(self.health_status))
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self._server)
        if self.server_credentials is None:
            self.port = self._server.add_insecure_port("127.0.0.1:0")
        else:
            self.port = self._server.add_secure_port("127.0.0.1:0", self.server_credentials)
        await self._server.start()

    def __enter__(self) -> "LoopbackServer":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def __exit__(self, *exc_info: object) -> None:
        asyncio.run_coroutine_threadsafe(self._server.stop(grace=None), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


@contextlib.contextmanager
def unused_port():
    """A loopback port with nothing listening on it, for as long as the `with` block runs: the port is
    bound here and never listened on, so no other process can take it meanwhile."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]
