"""The TextGeneration servicer: proto <-> engine through the shared Frontend, streamed. Thin by design.

The event loop does no work whose size a client chooses: the checks and conversion of inputs.py
(tokenizing, chat rendering, id validation) and id decoding run on the Frontend's worker threads,
the same path the HTTP edge takes.
A stream whose reader stops taking messages is cancelled after `stream_idle_timeout` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import AsyncIterator, Callable

import grpc

import lmserve
from lmserve.v1 import lmserve_pb2 as pb
from lmserve.v1 import lmserve_pb2_grpc as pb_grpc

from .engine import request as limits
from .config import ServerSettings
from .engine import Engine
from .frontend import Frontend, new_request_id
from .grpc_errors import map_errors
from .inputs import GenerateInput, precheck_tokenize
from .engine.outputs import GenerationChunk, GenerationResult
from .engine.errors import RequestValidationError
from .engine.request import FinishReason

log = logging.getLogger("lmserve.service")
# While draining, a stream whose write has waited this long for its reader is not waited for.
STALLED_WRITE_SECONDS = 1.0

FINISH = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.DEADLINE: pb.FINISH_REASON_DEADLINE,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}


__all__ = ["TextGenerationService", "new_request_id"]


class TextGenerationService(pb_grpc.TextGenerationServicer):
    def __init__(self, settings: ServerSettings | None = None, frontend: Frontend | None = None):
        self.settings = settings or ServerSettings()
        self.frontend = frontend or Frontend(self.settings)  # shared with the HTTP edge when there is one
        self.stream_idle_timeouts = 0
        self.on_stream_idle_timeout: Callable[[], None] | None = None  # set to count them in /metrics
        self._writing: dict[int, tuple[float, asyncio.Task]] = {}  # stream -> (when its pending write started, handler)
        self._idle_expired: set[int] = set()  # streams the idle watch cancelled
        self._idle_watch: asyncio.Task | None = None

    # the shared state lives in the Frontend; these read it
    engine = property(lambda self: self.frontend.engine)
    in_flight = property(lambda self: self.frontend.in_flight)
    tokenizer = property(lambda self: self.frontend.tokenizer)
    model_name = property(lambda self: self.frontend.model_name)
    limits = property(lambda self: self.frontend.limits)
    inputs = property(lambda self: self.frontend.inputs)

    @property
    def draining(self) -> bool:
        return self.frontend.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.frontend.draining = value

    def attach(self, engine: Engine, model_name: str, *aliases: str) -> None:
        """Start answering with this engine (until then every RPC is UNAVAILABLE: the model is loading)."""
        self.frontend.attach(engine, model_name, *aliases)

    def close(self) -> None:
        self.frontend.close()
        if self._idle_watch is not None:
            self._idle_watch.cancel()

    def _check_ready(self) -> None:
        self.frontend.check_ready()

    async def _offload(self, fn, *args):
        return await self.frontend.offload(fn, *args)

    async def _logprobs(self, chunk_lps) -> list[pb.TokenLogprob]:
        return await self._offload(self.inputs.logprobs, chunk_lps) if chunk_lps else []

    @staticmethod
    def _final_fields(c: GenerationChunk | GenerationResult) -> dict:
        out = {"finish_reason": FINISH[c.finish_reason], "matched_stop": c.matched_stop or ""}
        if c.usage:
            out["usage"] = pb.Usage(prompt_tokens=c.usage.prompt_tokens, completion_tokens=c.usage.completion_tokens,
                                    cached_prompt_tokens=c.usage.cached_prompt_tokens,
                                    draft_tokens=c.usage.draft_tokens, accepted_draft_tokens=c.usage.accepted_draft_tokens)
        if c.timings:
            out["timing"] = pb.Timing(queue_seconds=c.timings.queue_seconds,
                                      time_to_first_token_seconds=c.timings.time_to_first_token_seconds,
                                      total_seconds=c.timings.total_seconds)
        return out

    async def _chunks(self, req: pb.GenerateRequest, context, rid: str) -> AsyncIterator[GenerationChunk]:
        self.frontend.check_accepting()
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        request = await self._offload(self.frontend.request_for, GenerateInput.from_proto(req), rid, deadline, "grpc")
        async with contextlib.aclosing(self.frontend.run(request)) as chunks:
            async for chunk in chunks:
                yield chunk

    # ---- RPCs -----------------------------------------------------------------------
    @map_errors
    async def Generate(self, request: pb.GenerateRequest, context) -> pb.GenerateResponse:
        rid = request.request_id or new_request_id()
        result = GenerationResult(request_id=rid)
        async with contextlib.aclosing(self._chunks(request, context, rid)) as chunks:
            async for chunk in chunks:
                result.add(chunk)
        return pb.GenerateResponse(request_id=rid, text=result.text, token_ids=result.token_ids,
                                   logprobs=await self._logprobs(result.logprobs), **self._final_fields(result))

    @map_errors
    async def GenerateStream(self, request: pb.GenerateRequest, context) -> None:
        rid = request.request_id or new_request_id()
        async with contextlib.aclosing(self._chunks(request, context, rid)) as chunks:
            async for chunk in chunks:  # one message per chunk: a reader behind gets its pending tokens merged
                msg = pb.GenerateStreamResponse(request_id=rid, text=chunk.text, token_ids=chunk.token_ids)
                if chunk.logprobs:  # converted on a worker thread; most streams ask for none
                    msg.logprobs.extend(await self._logprobs(chunk.logprobs))
                if chunk.finished:
                    msg.MergeFrom(pb.GenerateStreamResponse(**self._final_fields(chunk)))
                await self._write(context, msg, rid)

    async def _write(self, context, msg: pb.GenerateStreamResponse, rid: str) -> None:
        """Send one message; a reader that takes none for stream_idle_timeout seconds loses the stream.

        The handler then ends (closing _chunks cancels the engine request and frees its slot). The
        CANCELLED status is queued behind the unread messages, so a reader that comes back reads them
        and then learns why the stream ended; gRPC cannot reset the stream from here, so one that never
        comes back holds only its transport buffers, until it disconnects, its deadline passes or its
        connection reaches --max-connection-age."""
        timeout = self.settings.stream_idle_timeout
        key = id(context)
        self._writing[key] = (time.monotonic(), asyncio.current_task())
        if timeout and self._idle_watch is None:
            self._idle_watch = asyncio.get_running_loop().create_task(self._watch_idle(timeout))
        try:
            await context.write(msg)
        except asyncio.CancelledError:
            if key not in self._idle_expired:
                raise
            self._idle_expired.discard(key)
            asyncio.current_task().uncancel()
            self.stream_idle_timeouts += 1
            if self.on_stream_idle_timeout is not None:
                self.on_stream_idle_timeout()
            log.warning("cancelling stream %s: its reader took no message for %gs", rid, timeout)
            with contextlib.suppress(TimeoutError):  # completes (raising AbortError) only if the reader is back
                await asyncio.wait_for(context.abort(
                    grpc.StatusCode.CANCELLED, f"stream cancelled: the reader took no message for {timeout:g}s "
                                               "(--stream-idle-timeout)"), STALLED_WRITE_SECONDS)
            raise asyncio.CancelledError("stream idle timeout") from None
        except Exception as exc:  # noqa: BLE001 - a failed write means the call is over (cancelled, server stopping)
            raise asyncio.CancelledError("the call ended before this message could be sent") from exc
        finally:
            self._writing.pop(key, None)

    async def _watch_idle(self, timeout: float) -> None:
        """One watch for every stream (a timer per message would cost each write a task): a write
        pending for longer than the idle timeout has its handler cancelled, which _write turns into
        the stream's end."""
        while True:
            await asyncio.sleep(min(1.0, timeout / 4))
            now = time.monotonic()
            for key, (started, task) in list(self._writing.items()):
                if now - started > timeout and key not in self._idle_expired:
                    self._idle_expired.add(key)
                    task.cancel()

    @map_errors
    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        self._check_ready()
        precheck_tokenize(request, self.limits)
        return await self._offload(self.inputs.tokenize, request)

    @map_errors
    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.GetModelInfoResponse:
        self._check_ready()
        lm, cfg, s = self.engine.loaded, self.engine.loaded.config, self.engine.settings
        info = pb.GetModelInfoResponse(
            model_name=self.model_name, architecture=cfg.model_type, context_length=self.engine.max_model_len,
            vocab_size=cfg.vocab_size, dtype=str(lm.dtype).removeprefix("torch."), device=str(lm.device),
            eos_token_ids=list(self.tokenizer.eos_ids), max_new_tokens_limit=s.max_new_tokens_cap,
            max_batch_size=self.engine.max_batch, default_max_new_tokens=s.default_max_new_tokens,
            has_chat_template=bool(self.tokenizer.chat_template),
            num_parameters=lm.num_parameters, server_version=lmserve.__version__, limits=self._server_limits(),
            quantization=lm.plan.mode.quantization if lm.plan else "none", kernels=lm.kernels,
            precision_choice=lm.choice, kv_cache_dtype=self.engine.kv_choice.name,
            kv_cache_choice=self.engine.kv_choice.reason, speculation=self.engine.speculation_summary())
        if self.tokenizer.bos_id is not None:
            info.bos_token_id = self.tokenizer.bos_id
        if self.engine.verify_cost is not None:
            info.speculation_verify_cost = self.engine.verify_cost
        info.adapters.extend(self._adapter_info(a) for a in self.frontend.adapters())
        return info

    def _adapter_info(self, a) -> pb.LoraAdapterInfo:
        return pb.LoraAdapterInfo(name=a.name, path=str(a.path), rank=a.rank, parent=self.model_name)

    @map_errors
    async def LoadLoraAdapter(self, request: pb.LoadLoraAdapterRequest, context) -> pb.LoadLoraAdapterResponse:
        self._check_ready()
        if not request.path:
            raise RequestValidationError([("path", "is required: a directory inside --lora-dir")])
        known = await self._offload(self.frontend.load_adapter, request.name, request.path)
        return pb.LoadLoraAdapterResponse(adapter=self._adapter_info(known))

    @map_errors
    async def UnloadLoraAdapter(self, request: pb.UnloadLoraAdapterRequest, context) -> pb.UnloadLoraAdapterResponse:
        self._check_ready()
        self.frontend.unload_adapter(request.name)
        return pb.UnloadLoraAdapterResponse()

    def _server_limits(self) -> pb.ServerLimits:
        s, lim = self.settings, self.limits
        return pb.ServerLimits(
            max_request_id_chars=lim.max_request_id_chars, max_input_chars=lim.max_input_chars,
            max_messages=lim.max_messages, max_prompt_tokens=lim.max_prompt_tokens,
            max_stop_strings=limits.MAX_STOP_STRINGS, max_stop_string_chars=limits.MAX_STOP_STRING_CHARS,
            max_stop_token_ids=limits.MAX_STOP_TOKEN_IDS, max_logprobs=limits.MAX_LOGPROBS,
            greedy_temperature_below=limits.GREEDY_TEMPERATURE,
            min_repetition_penalty=limits.REPETITION_PENALTY_RANGE[0],
            max_repetition_penalty=limits.REPETITION_PENALTY_RANGE[1],
            max_abs_additive_penalty=limits.MAX_ABS_ADDITIVE_PENALTY, max_queue=self.engine.settings.max_queue,
            max_concurrent_rpcs=s.max_concurrent_rpcs, max_concurrent_streams=s.max_concurrent_streams,
            stream_idle_timeout_seconds=s.stream_idle_timeout, max_receive_message_bytes=s.max_receive_message_bytes,
            max_health_watchers=s.max_health_watchers)

    def busy(self) -> int:
        """Calls a drain waits for: those in flight, less streams stuck on a reader that stopped reading."""
        now = time.monotonic()
        return self.in_flight - sum(1 for t, _ in list(self._writing.values()) if now - t > STALLED_WRITE_SECONDS)

    async def wait_idle(self, timeout: float, stalled_too: bool = False) -> bool:
        """Wait until no Generate call is in flight but stalled streams (or none at all: `stalled_too`);
        False if the timeout passed first."""
        def busy() -> int:
            return self.in_flight if stalled_too else self.busy()

        end = time.monotonic() + timeout
        while busy() > 0 and time.monotonic() < end:
            await asyncio.sleep(0.05)
        return busy() <= 0
