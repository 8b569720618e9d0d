"""The one place where exceptions become gRPC status codes, with google.rpc.BadRequest details."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from .engine import EngineUnavailableError
from .engine.request import RequestValidationError
from .engine.scheduler import QueueFullError

log = logging.getLogger("lmserve.grpc")


class EdgeError(Exception):
    """An error decided at the edge, carrying its status code (e.g. UNAVAILABLE while draining)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def _status(code: grpc.StatusCode, message: str, violations: list[tuple[str, str]] = ()) -> grpc.Status:
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=message)
    if violations:
        detail = any_pb2.Any()
        detail.Pack(error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=f, description=d) for f, d in violations]))
        status.details.append(detail)
    return rpc_status.to_status(status)


def to_status(exc: BaseException) -> grpc.Status:
    """Map an exception to the status a caller sees. Unknown errors say nothing of internals."""
    if isinstance(exc, RequestValidationError):
        return _status(grpc.StatusCode.INVALID_ARGUMENT, f"invalid request: {exc}", exc.violations)
    if isinstance(exc, QueueFullError):
        return _status(grpc.StatusCode.RESOURCE_EXHAUSTED, f"server overloaded: {exc}; retry later")
    if isinstance(exc, EngineUnavailableError):
        return _status(grpc.StatusCode.UNAVAILABLE, "server is not accepting requests (draining or restarting); retry")
    if isinstance(exc, EdgeError):
        return _status(exc.code, str(exc))
    log.error("internal error", exc_info=exc)
    return _status(grpc.StatusCode.INTERNAL, "internal server error")


def map_errors(handler):
    """Decorate a grpc.aio handler (coroutine or async generator) so exceptions become statuses."""
    if inspect.isasyncgenfunction(handler):
        @functools.wraps(handler)
        async def stream_wrapper(self, request, context):
            try:
                async for item in handler(self, request, context):
                    yield item
            except Exception as exc:  # noqa: BLE001 - this is the mapping point
                await _abort(context, exc)
        return stream_wrapper

    @functools.wraps(handler)
    async def unary_wrapper(self, request, context):
        try:
            return await handler(self, request, context)
        except Exception as exc:  # noqa: BLE001 - this is the mapping point
            await _abort(context, exc)
    return unary_wrapper


async def _abort(context, exc: Exception) -> None:
    """End the call with exc's status, unless the caller's deadline has already passed: gRPC then
    ends the call with DEADLINE_EXCEEDED itself, and a status sent now races that and fails inside
    grpc core (logged there as a server error with a traceback). The call is treated as cancelled."""
    if _already_aborted(exc):
        raise exc
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        raise asyncio.CancelledError("the caller's deadline passed") from exc
    await context.abort_with_status(to_status(exc))


def _already_aborted(exc: BaseException) -> bool:
    # context.abort raises this to unwind the handler; it must pass through untouched
    return type(exc).__name__ == "AbortError"
