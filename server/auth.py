"""Bearer-token authentication for every RPC except health checks (and, through BearerTokens, HTTP requests)."""

from __future__ import annotations

import hmac
from pathlib import Path

import grpc

OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


def read_tokens(path: str | Path) -> tuple[str, ...]:
    """One token per line; blank lines and # comments ignored."""
    lines = Path(path).read_text().splitlines()
    tokens = tuple(t.strip() for t in lines if t.strip() and not t.strip().startswith("#"))
    if not tokens:
        raise ValueError(f"auth tokens file {path} holds no token")
    return tokens


class BearerTokens:
    """The accepted tokens; checks an `Authorization` value (both edges use this one check)."""

    def __init__(self, tokens: tuple[str, ...]):
        self._tokens = tuple(t.encode() for t in tokens)

    def accepts(self, authorization: str) -> bool:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        given = token.strip().encode()
        ok = False
        for t in self._tokens:  # compare against every token: time does not reveal which matched
            ok |= hmac.compare_digest(given, t)
        return ok


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, tokens: tuple[str, ...]):
        self._tokens = BearerTokens(tokens)

    def _authorized(self, metadata) -> bool:
        return self._tokens.accepts(dict(metadata or ()).get("authorization", ""))

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIXES) or self._authorized(details.invocation_metadata):
            return handler

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
            yield  # pragma: no cover - makes this an async generator

        kind = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
        make = kind[(handler.request_streaming, handler.response_streaming)]
        return make(deny_stream if handler.response_streaming else deny,
                    request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
