"""Blocking client for the lmserve TextGeneration service."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, Callable, TypeVar

import grpc
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

__all__ = ["Client"]


class Client(ClientBase):
    """Synchronous lmserve client.

    ``prompt`` arguments accept a string, a list of token ids, or a list of chat messages
    (:class:`~lmserve.client.types.ChatMessage`, ``{"role", "content"}`` dicts or
    ``(role, content)`` pairs). Sampling parameters come from ``params`` with keyword
    overrides (``client.generate("Hi", max_new_tokens=8, temperature=0.7)``).

    ``timeout`` (seconds) bounds each call including its retries; per-call ``timeout=``
    overrides it (None: no limit). UNAVAILABLE and RESOURCE_EXHAUSTED are retried up to
    ``max_retries`` times with jittered exponential backoff, but never after a stream
    delivered its first chunk. Failures raise :class:`~lmserve.client.errors.LmserveError`
    subclasses.

    Use as a context manager, or call :meth:`close`.
    """

    _grpc = grpc

    # ------------------------------------------------------------ public API

    def generate(
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
        response = self._unary(self._stub.Generate, request, timeout)
        return parse_generate_response(response)

    def stream(
        self,
        prompt: Any,
        params: SamplingParams | None = None,
        *,
        timeout: Any = DEFAULT,
        request_id: str = "",
        parse_special_tokens: bool = False,
        **sampling: Any,
    ) -> Iterator[StreamChunk]:
        """Streams a completion chunk by chunk; the last chunk has ``finish_reason`` set.

        The request is validated now; the call starts on the first ``next()``. Closing the
        iterator early (``close()``, or dropping it) cancels the call on the server.
        """
        request = self._generate_request(prompt, params, request_id, sampling, parse_special_tokens)
        return self._stream(request, self._timeout(timeout))

    def tokenize(
        self, text: Any, *, add_generation_prompt: bool = True, parse_special_tokens: bool = False,
        timeout: Any = DEFAULT,
    ) -> TokenizeResult:
        """Tokenizes text, or chat messages rendered with the model's chat template."""
        request = build_tokenize_request(text, add_generation_prompt, parse_special_tokens)
        return parse_tokenize_response(self._unary(self._stub.Tokenize, request, timeout))

    def model_info(self, *, timeout: Any = DEFAULT) -> ModelInfo:
        """Describes the served model and the server's limits."""
        return parse_model_info(self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout))

    def health(self, service: str = "", *, timeout: Any = DEFAULT) -> str:
        """Standard gRPC health status: "SERVING", "NOT_SERVING" or "UNKNOWN"; a service the server does not know raises InternalError (NOT_FOUND).

        Not retried: it reports the server's state now. An unreachable server raises
        :class:`~lmserve.client.errors.UnavailableError`.
        """
        try:
            reply = self._health.Check(
                health_pb2.HealthCheckRequest(service=service),
                timeout=self._timeout(timeout), metadata=self._metadata,
            )
        except grpc.RpcError as e:
            raise error_from_rpc(e) from e
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def close(self) -> None:
        """Closes the channel, cancelling calls in flight."""
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------ I/O

    def _unary(self, method: Callable[..., T], request: Any, timeout: Any) -> T:
        state = self.retry_policy.start(self._timeout(timeout))
        while True:
            try:
                return method(request, timeout=state.attempt_timeout(), metadata=self._metadata)
            except grpc.RpcError as e:
                delay = state.after_failure(error_from_rpc(e), received=False)
            time.sleep(delay)

    def _stream(self, request: pb.GenerateRequest, timeout: float | None) -> Iterator[StreamChunk]:
        state = self.retry_policy.start(timeout)
        while True:
            call = self._stub.GenerateStream(request, timeout=state.attempt_timeout(), metadata=self._metadata)
            received = False
            try:
                for message in call:
                    received = True
                    yield parse_stream_response(message)
                return
            except grpc.RpcError as e:
                delay = state.after_failure(error_from_rpc(e), received=received)
            finally:
                call.cancel()  # no-op once finished; frees the server slot on early close
            time.sleep(delay)
