"""The OpenAI-compatible HTTP edge as an ASGI app (Starlette), over the same Frontend as gRPC.

    POST /v1/chat/completions, POST /v1/completions   (stream: SSE `data: {...}` events, then `data: [DONE]`)
    GET  /v1/models, /v1/models/{id}
    GET  /health (liveness: the engine loop runs and no step is stuck), /ready (503 while loading or draining)

Per request the event loop only reads the body (bounded by --max-receive-message-bytes and
--http-read-timeout) and moves events; parsing, translation, tokenizing and chat rendering run in one
hop on the Frontend's worker threads. A client that disconnects cancels its request (its KV is freed).
Errors are OpenAI's shape with the status of the shared table (server/edge_errors.py); one that happens
after a stream started is sent as an error event, then [DONE].
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import replace

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..auth import BearerTokens
from ..edge_errors import EdgeError, Failure
from ..engine.outputs import GenerationResult, Usage
from ..engine.request import RequestValidationError
from ..frontend import Frontend, new_request_id
from ..tools.parser import CallParser
from .errors import error_body, problem_of, render, renamed
from .choices import admit, gather_all, merged
from .openai_requests import BodyError, FieldPolicy, OpenAIRequest, check_model, parse_body, translate
from .openai_responses import (DONE, StreamEvents, choice_body, completion_body, error_event, finish_name,
                               logprobs_of, total_usage)
from .sse import EventStream, unless_disconnected

log = logging.getLogger("lmserve.http")
OPEN_PATHS = frozenset({"/health", "/ready"})  # probes need no token, as grpc.health.v1 needs none
JSON = "application/json"


def json_response(body: bytes, status: int = 200, headers: dict | None = None) -> Response:
    return Response(body, status_code=status, media_type=JSON, headers=headers)


def error_response(status: int, body: bytes, rid: str | None = None) -> Response:
    headers = {"retry-after": "1"} if status in (429, 503) else {}
    if status == 401:
        headers["www-authenticate"] = "Bearer"
    if rid:
        headers["x-request-id"] = rid
    return json_response(body, status, headers)


class OpenAIEdge:
    """The handlers; `app` is the ASGI application to serve."""

    def __init__(self, frontend: Frontend, tokens: tuple[str, ...] = (), max_body_bytes: int = 4 * 2**20,
                 read_timeout: float = 30.0, strict_fields: bool = False):
        self.frontend = frontend
        self.fields = FieldPolicy(strict_fields)
        self.tokens = BearerTokens(tokens) if tokens else None
        self.max_body_bytes = max_body_bytes
        self.read_timeout = read_timeout
        self.started = int(time.time())
        routes = [Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/ready", self.ready, methods=["GET"])]
        self._routes = Starlette(routes=routes, exception_handlers={404: self._not_found, 405: self._not_allowed})
        self._generate_routes = {"/v1/chat/completions": self.chat, "/v1/completions": self.completions}

    async def app(self, scope, receive, send) -> None:
        """ASGI entry: bearer tokens first (probes are open), then the routes."""
        if scope["type"] == "http" and self.tokens is not None and scope["path"] not in OPEN_PATHS:
            auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not self.tokens.accepts(auth.decode("latin-1")):
                body = error_body(Failure.UNAUTHENTICATED, "missing or invalid bearer token "
                                  "(send Authorization: Bearer TOKEN)")
                await error_response(401, body)(scope, receive, send)
                return
        generate = self._generate_routes.get(scope["path"]) if scope["type"] == "http" else None
        if generate is not None and scope["method"] == "POST":
            # the hot path, straight to its handler: no router and no middleware wrapping every event's send
            response = await generate(Request(scope, receive))
            await response(scope, receive, send)
            return
        await self._routes(scope, receive, send)

    # ---- generation ---------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def _generate(self, request: Request, chat: bool) -> Response:
        rid = request.headers.get("x-request-id") or new_request_id()
        names = None
        try:
            self.frontend.check_accepting()
            raw = await self._body(request)
            req, samples = await self.frontend.offload(self._prepare, raw, chat, rid)
            names = req.names
            # n samples of one prompt: the prompt computed once, its K/V copied from the prefix cache
            shared = await self.frontend.share_prompt(samples[0]) if len(samples) > 1 else None
            # admitted (a full queue, a drain: raised here, before any answer)
            runs = await admit([self.frontend.run(s, announce=True) for s in samples])
        except Exception as exc:  # noqa: BLE001 - the mapping point of this edge
            status, body = render(problem_of(exc, names))
            return error_response(status, body, rid if _printable(rid) else None)
        headers = {"x-request-id": rid}
        created = int(time.time())
        if req.stream:
            return EventStream(self._events(req, rid, created, samples, runs, shared), headers)
        return await self._whole(request, req, rid, created, samples, runs, shared, headers)

    def _prepare(self, raw: bytes, chat: bool, rid: str) -> tuple[OpenAIRequest, list]:
        """On a worker thread: body -> OpenAIRequest -> engine Requests, one per choice (the path gRPC
        requests take)."""
        req = translate(parse_body(raw), chat, self.fields)
        check_model(req.model, self.frontend.model_names)
        if req.n > self.frontend.engine.max_batch:
            raise BodyError("n", f"at most {self.frontend.engine.max_batch} choices (--max-batch), got {req.n}")
        try:
            engine_request = self.frontend.request_for(replace(req.input, request_id=rid), rid, None, "http")
        except RequestValidationError as exc:
            raise renamed(exc, req.names) from None
        return req, self.frontend.samples(engine_request, req.n)

    async def _whole(self, request: Request, req: OpenAIRequest, rid: str, created: int, samples: list, runs: list,
                     shared: Usage | None, headers: dict) -> Response:
        calls = [CallParser() for _ in runs] if req.reads_calls else None  # each choice's calls, read as they come

        async def collect(i: int) -> GenerationResult:
            result = GenerationResult(request_id=rid)
            async with contextlib.aclosing(runs[i]) as chunks:
                async for chunk in chunks:
                    result.add(chunk)
                    if calls is not None:
                        self._read_calls(calls[i], chunk, samples[i])
            return result

        try:
            results = await unless_disconnected(request.receive, gather_all([collect(i) for i in range(len(runs))]))
            if results is None:  # the client left: its requests were cancelled
                return Response(status_code=499)
            choices = []
            for i, result in enumerate(results):
                lps = None
                if req.logprobs:
                    lps = await self.frontend.offload(logprobs_of, self.frontend.tokenizer, result.logprobs, req.chat)
                choices.append(choice_body(req, i, result.text, result.finish_reason, lps, calls and calls[i]))
        except Exception as exc:  # noqa: BLE001 - the mapping point of this edge
            status, body = render(problem_of(exc, req.names))
            return error_response(status, body, rid)
        usage = total_usage([r.usage for r in results], shared)
        return json_response(completion_body(req, rid, created, choices, usage), headers=headers)

    async def _events(self, req: OpenAIRequest, rid: str, created: int, samples: list, runs: list,
                      shared: Usage | None):
        """The SSE events of a streamed answer; an error after the start is an event, then [DONE]."""
        events = StreamEvents(req, rid, created)
        offsets = [0] * len(runs)
        usages = [None] * len(runs)
        calls = [CallParser() for _ in runs] if req.reads_calls else None  # each choice's calls, read as they come
        try:
            if req.chat:
                for i in range(len(runs)):
                    yield events.role(i)
            async with contextlib.aclosing(merged(runs)) as chunks:
                async for i, chunk in chunks:
                    lps = None
                    if req.logprobs:
                        lps = await self.frontend.offload(logprobs_of, self.frontend.tokenizer, chunk.logprobs,
                                                          req.chat, offsets[i])
                        offsets[i] += len(chunk.text)
                    if calls is not None:
                        deltas = self._read_calls(calls[i], chunk, samples[i])
                        for k, delta in enumerate(deltas):
                            yield events.delta(delta, lps if k == 0 else None, i)
                        if lps and not deltas:
                            yield events.piece("", lps, None, i)
                        if chunk.finished:
                            yield events.finish(finish_name(chunk.finish_reason, calls[i]), i)
                    elif chunk.text or chunk.finished or lps:
                        yield events.piece(chunk.text, lps, chunk.finish_reason, i)
                    if chunk.finished:
                        usages[i] = chunk.usage
            if req.include_usage:
                yield events.usage(total_usage(usages, shared))
        except Exception as exc:  # noqa: BLE001 - the stream has started: the error becomes an event
            yield error_event(problem_of(exc, req.names))
        yield DONE

    def _read_calls(self, calls: CallParser, chunk, sample) -> list:
        """A chunk's text read for calls; a call repeating an earlier one ends the answer (its request is
        stopped, its last chunk still comes)."""
        repeated = calls.repeated
        deltas = calls.feed(chunk.text)
        if calls.repeated and not repeated and not chunk.finished:
            self.frontend.end(sample)
        return deltas + (calls.finish() if chunk.finished else [])

    async def _body(self, request: Request) -> bytes:
        """The request body, at most max_body_bytes, arriving within read_timeout."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise _too_large(self.max_body_bytes)
        parts, size = [], 0
        try:
            async with asyncio.timeout(self.read_timeout):
                async for part in request.stream():
                    size += len(part)
                    if size > self.max_body_bytes:
                        raise _too_large(self.max_body_bytes)
                    parts.append(part)
        except TimeoutError:
            raise EdgeError(Failure.REQUEST_TIMEOUT, f"the request body did not arrive within {self.read_timeout:g}s "
                                                     "(--http-read-timeout)") from None
        return b"".join(parts)

    # ---- models and probes ----------------------------------------------------------------
    def _model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.started, "owned_by": "lmserve",
                "context_length": self.frontend.engine.max_model_len}

    async def models(self, request: Request) -> Response:
        try:
            self.frontend.check_ready()
        except EdgeError as exc:
            return error_response(*render(problem_of(exc)))
        cards = [self._model_card(name) for name in self.frontend.model_names]
        return json_response(json.dumps({"object": "list", "data": cards}).encode())

    async def model(self, request: Request) -> Response:
        try:
            self.frontend.check_ready()
            model_id = request.path_params["model_id"]
            check_model(model_id, self.frontend.model_names)
        except EdgeError as exc:
            return error_response(*render(problem_of(exc)))
        return json_response(json.dumps(self._model_card(model_id)).encode())

    def _state(self) -> tuple[bool, bool, str]:
        """(alive, ready, what to say)."""
        engine = self.frontend.engine
        if engine is None:
            return True, False, "loading"
        h = engine.health()
        if not h.ok:
            return False, False, h.detail
        if self.frontend.draining:
            return True, False, "draining"
        return True, True, "ok"

    async def health(self, request: Request) -> Response:
        alive, _, detail = self._state()
        return json_response(json.dumps({"status": "ok" if alive else detail}).encode(), 200 if alive else 503)

    async def ready(self, request: Request) -> Response:
        _, ready, detail = self._state()
        return json_response(json.dumps({"status": detail}).encode(), 200 if ready else 503)

    async def _not_found(self, request: Request, exc) -> Response:
        return error_response(404, error_body(Failure.NOT_FOUND, f"no such path: {request.url.path[:200]} "
                                              "(this server has /v1/chat/completions, /v1/completions and /v1/models)"))

    async def _not_allowed(self, request: Request, exc) -> Response:
        return json_response(error_body(Failure.INVALID_ARGUMENT, f"method {request.method} is not allowed on "
                                         f"{request.url.path[:200]}"), 405)


def _too_large(limit: int) -> EdgeError:
    return EdgeError(Failure.TOO_LARGE, f"the request body is larger than {limit} bytes "
                                        "(--max-receive-message-bytes)")


def _printable(rid: str) -> bool:
    return len(rid) <= 128 and rid.isascii() and rid.isprintable()
