"""asyncio client for the lmserve TextGeneration service."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Awaitable, Callable, TypeVar

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2

from lmserve.v1 import lmserve_pb2 as pb

from ._base import DEFAULT, ClientBase
from ._convert import (
    build_tokenize_request,
    parse_generate_response,
    parse_model_info,
    parse_stream_response,
    parse_tokenize_response,
)
from .errors import error_from_rpc
from .types import GenerationResult, ModelInfo, SamplingParams, StreamChunk, TokenizeResult

T = TypeVar("T")

__all__ = ["AsyncClient"]


class AsyncClient(ClientBase):
    """asyncio lmserve client with the same surface as :class:`~lmserve.client.Client`.

    Create it inside a running event loop. Methods are coroutines, except :meth:`stream`,
    which returns an async iterator: ``async for chunk in client.stream("Hi"): ...``.
    Use ``async with`` or await :meth:`close`.
    """

    _grpc = grpc.aio

    # ------------------------------------------------------------ public API

    async def generate(
        self,
        prompt: Any,
        params: SamplingParams | None = None,
        *,
        timeout: Any = DEFAULT,
        request_id: str = "",
        parse_special_tokens: bool = False,
        **sampling: Any,
    ) -> GenerationResult:
        """Generates a completion and returns it when finished."""
        request = self._generate_request(prompt, params, request_id, sampling, parse_special_tokens)
        return parse_generate_response(await self._unary(self._stub.Generate, request, timeout))

    def stream(
        self,
        prompt: Any,
        params: SamplingParams | None = None,
        *,
        timeout: Any = DEFAULT,
        request_id: str = "",
        parse_special_tokens: bool = False,
        **sampling: Any,
    ) -> AsyncIterator[StreamChunk]:
        """Streams a completion chunk by chunk; the last chunk has ``finish_reason`` set.

        The request is validated now; the call starts on the first iteration. Closing the
        iterator early (``await it.aclose()``, or dropping it) cancels the call.
        """
        request = self._generate_request(prompt, params, request_id, sampling, parse_special_tokens)
        return self._stream(request, self._timeout(timeout))

    async def tokenize(
        self, text: Any, *, add_generation_prompt: bool = True, parse_special_tokens: bool = False,
        timeout: Any = DEFAULT,
    ) -> TokenizeResult:
        """Tokenizes text, or chat messages rendered with the model's chat template."""
        request = build_tokenize_request(text, add_generation_prompt, parse_special_tokens)
        return parse_tokenize_response(await self._unary(self._stub.Tokenize, request, timeout))

    async def model_info(self, *, timeout: Any = DEFAULT) -> ModelInfo:
        """Describes the served model and the server's limits."""
        return parse_model_info(await self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout))

    async def health(self, service: str = "", *, timeout: Any = DEFAULT) -> str:
        """Standard gRPC health status: "SERVING", "NOT_SERVING" or "UNKNOWN"; a service the server does not know raises InternalError (NOT_FOUND)."""
        try:
            reply = await self._health.Check(
                health_pb2.HealthCheckRequest(service=service),
                timeout=self._timeout(timeout), metadata=self._metadata,
            )
        except grpc.RpcError as e:
            raise error_from_rpc(e) from e
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def close(self) -> None:
        """Closes the channel, cancelling calls in flight."""
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ------------------------------------------------------------ I/O

    async def _unary(self, method: Callable[..., Awaitable[T]], request: Any, timeout: Any) -> T:
        state = self.retry_policy.start(self._timeout(timeout))
        while True:
            try:
                return await method(request, timeout=state.attempt_timeout(), metadata=self._metadata)
            except grpc.RpcError as e:
                delay = state.after_failure(error_from_rpc(e), received=False)
            await asyncio.sleep(delay)

    async def _stream(self, request: pb.GenerateRequest, timeout: float | None) -> AsyncIterator[StreamChunk]:
        state = self.retry_policy.start(timeout)
        while True:
            call = self._stub.GenerateStream(request, timeout=state.attempt_timeout(), metadata=self._metadata)
            received = False
            try:
                async for message in call:
                    received = True
                    yield parse_stream_response(message)
                return
            except grpc.RpcError as e:
                delay = state.after_failure(error_from_rpc(e), received=received)
            finally:
                call.cancel()  # no-op once finished; frees the server slot on early close
            await asyncio.sleep(delay)
