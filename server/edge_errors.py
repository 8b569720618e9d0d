"""The one error table of both edges: what each failure is called in gRPC and in the HTTP/OpenAI API.

`describe(exc)` classifies any exception once (engine errors, edge decisions, bugs); grpc_errors.py
renders the result as a gRPC status, server/http/errors.py as an HTTP status with OpenAI's error body.
Unknown errors are logged here and say nothing of internals to the caller.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from .engine import EngineUnavailableError
from .engine.adapters import AdapterNotFoundError
from lmserve.model.linear.lora import AdapterError
from .engine.errors import RequestValidationError
from .engine.scheduler import QueueFullError

log = logging.getLogger("lmserve.errors")


class Failure(enum.Enum):
    """A kind of failure: (gRPC status code name, HTTP status, OpenAI error type)."""

    INVALID_ARGUMENT = ("INVALID_ARGUMENT", 400, "invalid_request_error")
    UNAUTHENTICATED = ("UNAUTHENTICATED", 401, "authentication_error")
    NOT_FOUND = ("NOT_FOUND", 404, "not_found_error")
    TOO_LARGE = ("RESOURCE_EXHAUSTED", 413, "invalid_request_error")  # gRPC's own word for an oversized message
    REQUEST_TIMEOUT = ("DEADLINE_EXCEEDED", 408, "invalid_request_error")  # a body that arrives too slowly
    RESOURCE_EXHAUSTED = ("RESOURCE_EXHAUSTED", 429, "rate_limit_error")
    UNAVAILABLE = ("UNAVAILABLE", 503, "service_unavailable_error")
    DEADLINE_EXCEEDED = ("DEADLINE_EXCEEDED", 504, "timeout_error")
    CANCELLED = ("CANCELLED", 499, "cancelled_error")  # 499: the client closed the request (nginx's code)
    INTERNAL = ("INTERNAL", 500, "server_error")

    @property
    def grpc_code_name(self) -> str:
        return self.value[0]

    @property
    def http_status(self) -> int:
        return self.value[1]

    @property
    def openai_type(self) -> str:
        return self.value[2]


class EdgeError(Exception):
    """An error decided at an edge (draining, a deadline passed, an unknown model...).

    `failure` is a Failure, or anything with a `.name` naming one (a grpc.StatusCode works).
    `param` names the offending request field, when there is one."""

    def __init__(self, failure, message: str, param: str | None = None):
        super().__init__(message)
        self.failure = failure if isinstance(failure, Failure) else Failure[failure.name]
        self.param = param

    @property
    def code(self):  # the gRPC status code name, as older callers read it
        return self.failure.grpc_code_name


@dataclass(frozen=True)
class Problem:
    """What a caller is told: the kind, a message a person can act on, and the fields at fault."""

    failure: Failure
    message: str
    violations: tuple[tuple[str, str], ...] = ()
    param: str | None = None


def describe(exc: BaseException) -> Problem:
    """Classify an exception; unknown ones are logged (with traceback) and reported as INTERNAL."""
    if isinstance(exc, RequestValidationError):
        first = exc.violations[0][0] if exc.violations else None
        return Problem(Failure.INVALID_ARGUMENT, f"invalid request: {exc}", tuple(exc.violations), first)
    if isinstance(exc, QueueFullError):
        return Problem(Failure.RESOURCE_EXHAUSTED, f"server overloaded: {exc}; retry later")
    if isinstance(exc, EngineUnavailableError):
        return Problem(Failure.UNAVAILABLE, "server is not accepting requests (draining or restarting); retry")
    if isinstance(exc, EdgeError):
        return Problem(exc.failure, str(exc), (), exc.param)
    if isinstance(exc, AdapterNotFoundError):
        return Problem(Failure.NOT_FOUND, str(exc), (), "model")
    if isinstance(exc, AdapterError):  # an adapter's files: what is wrong with them, never a traceback
        return Problem(Failure.INVALID_ARGUMENT, str(exc), (), "lora_path")
    log.error("internal error", exc_info=exc)
    return Problem(Failure.INTERNAL, "internal server error")
