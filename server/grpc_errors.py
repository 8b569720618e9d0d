"""Where exceptions become gRPC statuses, with google.rpc.BadRequest details (the table: edge_errors.py)."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from .edge_errors import EdgeError, describe

__all__ = ["EdgeError", "map_errors", "to_status"]
log = logging.getLogger("lmserve.grpc")


def _status(code: grpc.StatusCode, message: str, violations=()) -> grpc.Status:
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=message)
    if violations:
        detail = any_pb2.Any()
        detail.Pack(error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=f, description=d) for f, d in violations]))
        status.details.append(detail)
    return rpc_status.to_status(status)


def to_status(exc: BaseException) -> grpc.Status:
    """Map an exception to the status a caller sees (the table is edge_errors.Failure)."""
    problem = describe(exc)
    return _status(grpc.StatusCode[problem.failure.grpc_code_name], problem.message, problem.violations)


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
