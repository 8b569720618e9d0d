"""Errors raised by the lmserve SDK: one hierarchy built from gRPC status codes.

Every failed call raises a subclass of :class:`LmserveError`. Its ``code`` is the gRPC
status code, ``message`` the server's status message, and ``field_violations`` the
``(field, description)`` pairs of a ``google.rpc.BadRequest`` detail, when the server
attached one to an INVALID_ARGUMENT status.
"""

from __future__ import annotations

from typing import Iterable

import grpc
from google.rpc import error_details_pb2, status_pb2

STATUS_DETAILS_KEY = "grpc-status-details-bin"

__all__ = [
    "LmserveError",
    "InvalidRequestError",
    "OverloadedError",
    "UnavailableError",
    "DeadlineExceededError",
    "CancelledError",
    "UnauthenticatedError",
    "InternalError",
    "error_from_rpc",
]


class LmserveError(Exception):
    """Base of every SDK error.

    Attributes:
        code: gRPC status code of the failed call (None for client-side protocol errors).
        message: human-readable status message.
        field_violations: ``(field path, description)`` pairs from a BadRequest detail.
        retry_delay: seconds the server asked to wait before retrying (RetryInfo), if any.
    """

    def __init__(
        self,
        message: str,
        *,
        code: grpc.StatusCode | None = None,
        field_violations: Iterable[tuple[str, str]] = (),
        retry_delay: float | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field_violations = list(field_violations)
        self.retry_delay = retry_delay

    def __str__(self) -> str:
        head = f"{self.code.name}: {self.message}" if self.code is not None else self.message
        if not self.field_violations:
            return head
        fields = "; ".join(f"{field}: {why}" for field, why in self.field_violations)
        return f"{head} ({fields})"


class InvalidRequestError(LmserveError):
    """The server rejected the request as invalid (INVALID_ARGUMENT)."""


class OverloadedError(LmserveError):
    """The server's admission queue is full (RESOURCE_EXHAUSTED); retry later."""


class UnavailableError(LmserveError):
    """The server is unreachable, starting or draining (UNAVAILABLE)."""


class DeadlineExceededError(LmserveError):
    """The call's deadline expired (DEADLINE_EXCEEDED)."""


class CancelledError(LmserveError):
    """The call was cancelled (CANCELLED)."""


class UnauthenticatedError(LmserveError):
    """Missing or wrong credentials (UNAUTHENTICATED or PERMISSION_DENIED)."""


class InternalError(LmserveError):
    """Any other failure: INTERNAL, UNKNOWN, or an unexpected status."""


_CLASS_BY_CODE: dict[grpc.StatusCode, type[LmserveError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OverloadedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: CancelledError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: UnauthenticatedError,
}


def error_from_code(code: grpc.StatusCode, message: str) -> LmserveError:
    """The :class:`LmserveError` subclass for a status code (for failures that are not gRPC calls,
    e.g. an OpenAI-compatible server's HTTP status)."""
    return _CLASS_BY_CODE.get(code, InternalError)(message, code=code)


def error_from_rpc(error: grpc.RpcError) -> LmserveError:
    """Maps a failed gRPC call (sync or asyncio) to the matching :class:`LmserveError`.

    Rich status details are read from the ``grpc-status-details-bin`` trailing metadata.
    """
    code = _call_attr(error, "code")
    message = _call_attr(error, "details") or (code.name if code is not None else str(error))
    violations, retry_delay = _parse_details(_call_attr(error, "trailing_metadata") or ())
    cls = _CLASS_BY_CODE.get(code, InternalError)
    mapped = cls(message, code=code, field_violations=violations, retry_delay=retry_delay)
    mapped.__cause__ = error
    return mapped


def _call_attr(error: grpc.RpcError, name: str):
    getter = getattr(error, name, None)
    return getter() if callable(getter) else None


def _parse_details(trailing_metadata) -> tuple[list[tuple[str, str]], float | None]:
    """Returns BadRequest field violations and RetryInfo delay from the status details."""
    blob = next((v for k, v in trailing_metadata if k == STATUS_DETAILS_KEY), None)
    if not blob:
        return [], None
    status = status_pb2.Status()
    try:
        status.ParseFromString(blob)
    except Exception:  # malformed details must not hide the real error
        return [], None
    violations: list[tuple[str, str]] = []
    retry_delay = None
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations.extend((v.field, v.description) for v in bad.field_violations)
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            retry_delay = info.retry_delay.ToTimedelta().total_seconds()
    return violations, retry_delay
