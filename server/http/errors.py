"""Errors of the HTTP edge in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

The status and type come from the one table (server/edge_errors.py, shared with gRPC); field names in
messages are the OpenAI parameter names, not the proto's (`params.max_new_tokens` -> `max_tokens`).
"""

from __future__ import annotations

import json

from ..edge_errors import Failure, Problem, describe
from ..engine.request import RequestValidationError

# proto field (as inputs.py names it) -> OpenAI parameter; a missing one keeps its name less "params."
_PARAMS = {"params.max_new_tokens": "max_tokens", "params.logprobs": "logprobs", "token_ids": "prompt",
           "request_id": "x-request-id", "input": "prompt", "params.json_schema": "response_format.json_schema.schema",
           "params.json_object": "response_format"}


class OpenAINames:
    """How one request names its parameters (chat says top_logprobs for what completions call logprobs)."""

    def __init__(self, chat: bool, max_tokens_name: str = "max_tokens"):
        self.map = dict(_PARAMS, **{"params.max_new_tokens": max_tokens_name})
        if chat:
            self.map.update({"params.logprobs": "top_logprobs", "prompt": "messages", "token_ids": "messages"})

    def __call__(self, field: str) -> str:
        head, sep, rest = field.partition("[")
        name = self.map.get(head, head.removeprefix("params."))
        return name + sep + rest


def renamed(exc: RequestValidationError, names: OpenAINames) -> RequestValidationError:
    """The same violations under OpenAI's parameter names (in their descriptions too)."""
    max_name = names("params.max_new_tokens")
    return RequestValidationError([(names(f), d.replace("max_new_tokens", max_name)) for f, d in exc.violations])


def error_body(failure: Failure, message: str, param: str | None = None, code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": failure.openai_type, "param": param,
                                 "code": code if code is not None else _code(failure)}}).encode()


def problem_of(exc: BaseException, names: OpenAINames | None = None) -> Problem:
    """The Problem of an exception, fields named as OpenAI names them."""
    if isinstance(exc, RequestValidationError) and names is not None:
        exc = renamed(exc, names)
    return describe(exc)


def render(problem: Problem) -> tuple[int, bytes]:
    """(HTTP status, body) of a problem."""
    return problem.failure.http_status, error_body(problem.failure, problem.message, problem.param)


_CODES = {Failure.INVALID_ARGUMENT: "invalid_value", Failure.UNAUTHENTICATED: "invalid_api_key",
          Failure.NOT_FOUND: "not_found", Failure.TOO_LARGE: "request_too_large",
          Failure.REQUEST_TIMEOUT: "request_timeout",
          Failure.RESOURCE_EXHAUSTED: "rate_limit_exceeded", Failure.UNAVAILABLE: "service_unavailable",
          Failure.DEADLINE_EXCEEDED: "timeout", Failure.CANCELLED: "cancelled", Failure.INTERNAL: "internal_error"}


def _code(failure: Failure) -> str:
    return _CODES[failure]
