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
from ..edge_errors import EdgeError, Failure, Problem
from ..engine.outputs import GenerationResult, Usage
from ..engine.request import RequestValidationError
from ..frontend import Frontend, new_request_id
from . import anthropic_messages
from .anthropic_messages import MessagesDialect
from .openai_responses_api import ResponsesDialect
from .response_store import ResponseStore
from .errors import problem_of, render, renamed
from .choices import admit, gather_all, merged
from .openai_requests import BodyError, FieldPolicy, OpenAIRequest, parse_body, translate
from .openai_responses import (DONE, StreamEvents, choice_body, completion_body, error_event, finish_name,
                               logprobs_of, total_usage)
from .reply import Reply
from .sse import EventStream, unless_disconnected

log = logging.getLogger("lmserve.http")
OPEN_PATHS = frozenset({"/health", "/ready"})
PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses",
         "/v1/models")  # probes need no token, as grpc.health.v1 needs none
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
                 read_timeout: float = 30.0, strict_fields: bool = False, responses_store: ResponseStore | None = None):
        self.frontend = frontend
        self.fields = FieldPolicy(strict_fields)
        self.tokens = BearerTokens(tokens) if tokens else None
        self.max_body_bytes = max_body_bytes
        self.read_timeout = read_timeout
        self.started = int(time.time())
        self.messages_dialect = MessagesDialect()
        self.responses_dialect = ResponsesDialect(responses_store or ResponseStore())
        routes = [Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/messages", self.messages, methods=["POST"]),
                  Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
                  Route("/v1/responses", self.responses, methods=["POST"]),
                  Route("/v1/responses/{response_id}", self.stored_response, methods=["GET", "DELETE"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
                  Route("/v1/load_lora_adapter", self.load_lora_adapter, methods=["POST"]),
                  Route("/v1/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/ready", self.ready, methods=["GET"])]
        self._routes = Starlette(routes=routes, exception_handlers={404: self._not_found, 405: self._not_allowed})
        self._generate_routes = {"/v1/chat/completions": self.chat, "/v1/completions": self.completions,
                                 "/v1/messages": self.messages, "/v1/responses": self.responses}

    async def app(self, scope, receive, send) -> None:
        """ASGI entry: bearer tokens first (probes are open), then the routes."""
        if scope["type"] == "http" and self.tokens is not None and scope["path"] not in OPEN_PATHS:
            if not self._authenticated(scope["headers"]):
                problem = Problem(Failure.UNAUTHENTICATED, "missing or invalid token (send Authorization: Bearer "
                                                           "TOKEN, or x-api-key: TOKEN)")
                await error_response(*self._render(scope["path"], problem))(scope, receive, send)
                return
        generate = self._generate_routes.get(scope["path"]) if scope["type"] == "http" else None
        if generate is not None and scope["method"] == "POST":
            # the hot path, straight to its handler: no router and no middleware wrapping every event's send
            response = await generate(Request(scope, receive))
            await response(scope, receive, send)
            return
        await self._routes(scope, receive, send)

    def _authenticated(self, headers) -> bool:
        """A token of the tokens file, as `Authorization: Bearer` (OpenAI's clients) or `x-api-key` (Anthropic's)."""
        for k, v in headers:
            if k == b"authorization" and self.tokens.accepts(v.decode("latin-1")):
                return True
            if k == b"x-api-key" and self.tokens.accepts("Bearer " + v.decode("latin-1")):
                return True
        return False

    @staticmethod
    def _render(path: str, problem: Problem, rid: str | None = None) -> tuple[int, bytes]:
        """(status, body) of a problem in the error shape of the API `path` belongs to."""
        if path.startswith(anthropic_messages.PATH):
            return anthropic_messages.error(problem, rid)
        return render(problem)

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
        adapter = self.frontend.adapter_of(req.model)
        if req.n > self.frontend.engine.max_batch:
            raise BodyError("n", f"at most {self.frontend.engine.max_batch} choices (--max-batch), got {req.n}")
        try:
            engine_request = self.frontend.request_for(replace(req.input, request_id=rid, adapter=adapter), rid, None,
                                                       "http")
        except RequestValidationError as exc:
            raise renamed(exc, req.names) from None
        return req, self.frontend.samples(engine_request, req.n)

    async def _whole(self, request: Request, req: OpenAIRequest, rid: str, created: int, samples: list, runs: list,
                     shared: Usage | None, headers: dict) -> Response:
        replies = [Reply(req.input.tools) for _ in runs] if req.reads_calls else None  # calls, read as they come

        async def collect(i: int) -> GenerationResult:
            result = GenerationResult(request_id=rid)
            async with contextlib.aclosing(runs[i]) as chunks:
                async for chunk in chunks:
                    result.add(chunk)
                    if replies is not None:
                        self._read(replies[i], chunk, samples[i])
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
                choices.append(choice_body(req, i, result.text, result.finish_reason, lps, replies and replies[i].calls))
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
        replies = [Reply(req.input.tools) for _ in runs] if req.reads_calls else None  # calls, read as they come
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
                    if replies is not None:
                        deltas = self._read(replies[i], chunk, samples[i])
                        for k, delta in enumerate(deltas):
                            yield events.delta(delta, lps if k == 0 else None, i)
                        if lps and not deltas:
                            yield events.piece("", lps, None, i)
                        if chunk.finished:
                            yield events.finish(finish_name(chunk.finish_reason, replies[i].calls), i)
                    elif chunk.text or chunk.finished or lps:
                        yield events.piece(chunk.text, lps, chunk.finish_reason, i)
                    if chunk.finished:
                        usages[i] = chunk.usage
            if req.include_usage:
                yield events.usage(total_usage(usages, shared))
        except Exception as exc:  # noqa: BLE001 - the stream has started: the error becomes an event
            yield error_event(problem_of(exc, req.names))
        yield DONE

    def _read(self, reply: Reply, chunk, sample) -> list:
        """A chunk read into its answer; an answer complete before the model ends it (a call repeating an
        earlier one) ends its request (its last chunk still comes)."""
        deltas = reply.read(chunk)
        if reply.due_end():
            self.frontend.end(sample)
        return deltas

    # ---- the one-answer dialects (Messages, Responses; each holds its own shapes) --------------
    async def messages(self, request: Request) -> Response:
        return await self._answer(request, self.messages_dialect)

    async def responses(self, request: Request) -> Response:
        return await self._answer(request, self.responses_dialect)

    async def stored_response(self, request: Request) -> Response:
        """GET (or DELETE) a response the Responses API stored."""
        response_id = request.path_params["response_id"]
        try:
            body = self.responses_dialect.stored(response_id)
        except EdgeError as exc:
            return error_response(*render(problem_of(exc)))
        if request.method == "DELETE":
            self.responses_dialect.store.delete(response_id)
            return json_response(json.dumps({"id": response_id, "object": "response", "deleted": True}).encode())
        return json_response(json.dumps(body, ensure_ascii=False).encode())

    async def _answer(self, request: Request, dialect) -> Response:
        """One answer in a dialect's shapes: `dialect.translate` (a body -> translate.Generation),
        `answer` (the whole body), `events` (the stream's events) and `error` (its error shape)."""
        rid = request.headers.get("x-request-id") or new_request_id()
        try:
            self.frontend.check_accepting()
            raw = await self._body(request)
            gen, sample = await self.frontend.offload(self._prepare_answer, dialect, raw, rid)
            (run,) = await admit([self.frontend.run(sample, announce=True)])
        except Exception as exc:  # noqa: BLE001 - the mapping point of this edge
            status, body = dialect.error(problem_of(exc), rid if _printable(rid) else None)
            return error_response(status, body, rid if _printable(rid) else None)
        headers = {"x-request-id": rid}
        reply = Reply(gen.input.tools)
        prompt_tokens = len(sample.prompt_ids)
        if gen.stream:
            return EventStream(self._answer_events(dialect, gen, rid, sample, run, reply), headers)
        try:
            if await unless_disconnected(request.receive, self._collect(run, reply, sample)) is None:
                return Response(status_code=499)  # the client left: its request was cancelled
        except Exception as exc:  # noqa: BLE001 - the mapping point of this edge
            return error_response(*dialect.error(problem_of(exc), rid), rid)
        return json_response(dialect.answer(gen, rid, reply, prompt_tokens), headers=headers)

    def _prepare_answer(self, dialect, raw: bytes, rid: str):
        """On a worker thread: body -> the dialect's Generation -> the engine Request."""
        gen = dialect.translate(parse_body(raw), self.fields)
        adapter = self.frontend.adapter_of(gen.model)
        try:
            return gen, self.frontend.request_for(replace(gen.input, request_id=rid, adapter=adapter), rid, None, "http")
        except RequestValidationError as exc:
            raise renamed(exc, gen.names) from None

    async def _collect(self, run, reply: Reply, sample) -> Reply:
        async with contextlib.aclosing(run) as chunks:
            async for chunk in chunks:
                self._read(reply, chunk, sample)
        return reply

    async def _answer_events(self, dialect, gen, rid: str, sample, run, reply: Reply):
        """A dialect's events of one streamed answer; an error after the start is the dialect's error event."""
        events = dialect.events(gen, rid, len(sample.prompt_ids))
        try:
            yield events.start()
            async with contextlib.aclosing(run) as chunks:
                async for chunk in chunks:
                    for delta in self._read(reply, chunk, sample):
                        yield events.delta(delta)
            yield events.end(reply)
        except Exception as exc:  # noqa: BLE001 - the stream has started: the error becomes an event
            yield events.error(problem_of(exc))

    async def count_tokens(self, request: Request) -> Response:
        """Anthropic's count_tokens: the prompt tokens a messages body would take, generating nothing."""
        try:
            self.frontend.check_ready()
            raw = await self._body(request)
            count = await self.frontend.offload(self._count, raw)
        except Exception as exc:  # noqa: BLE001 - the mapping point of this edge
            return error_response(*anthropic_messages.error(problem_of(exc)))
        return json_response(json.dumps({"input_tokens": count}).encode())

    def _count(self, raw: bytes) -> int:
        gen = anthropic_messages.translate(parse_body(raw), self.fields, counting=True)
        self.frontend.adapter_of(gen.model)
        try:
            return self.frontend.count_prompt(gen.input)
        except RequestValidationError as exc:
            raise renamed(exc, gen.names) from None

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
        """A base name's card, or an adapter's: its `parent` is the base model, `root` its files (vLLM's fields)."""
        card = {"id": name, "object": "model", "created": self.started, "owned_by": "lmserve",
                "context_length": self.frontend.engine.max_model_len, "root": name, "parent": None}
        adapter = next((a for a in self.frontend.adapters() if a.name == name), None)
        if name not in self.frontend.model_names and adapter is not None:
            card.update(root=str(adapter.path), parent=self.frontend.model_name)
        return card

    async def models(self, request: Request) -> Response:
        try:
            self.frontend.check_ready()
        except EdgeError as exc:
            return error_response(*render(problem_of(exc)))
        if "anthropic-version" in request.headers:  # Anthropic's clients send it on every request
            return json_response(anthropic_messages.models_body(self.frontend.model_names, self.started))
        names = [*self.frontend.model_names, *(a.name for a in self.frontend.adapters())]
        cards = [self._model_card(name) for name in dict.fromkeys(names)]
        return json_response(json.dumps({"object": "list", "data": cards}).encode())

    async def model(self, request: Request) -> Response:
        try:
            self.frontend.check_ready()
            model_id = request.path_params["model_id"]
            self.frontend.adapter_of(model_id)
        except EdgeError as exc:
            return error_response(*render(problem_of(exc)))
        if "anthropic-version" in request.headers:
            return json_response(json.dumps(anthropic_messages.model_card(model_id, self.started)).encode())
        return json_response(json.dumps(self._model_card(model_id)).encode())

    # ---- LoRA adapters at runtime (vLLM's paths and bodies; --lora-dir) -----------------------
    async def load_lora_adapter(self, request: Request) -> Response:
        """{"lora_name": ..., "lora_path": ..., "load_inplace": false}: the adapter read from inside --lora-dir."""
        try:
            self.frontend.check_ready()
            body = parse_body(await self._body(request))
            name, path = _string(body, "lora_name"), _string(body, "lora_path")
            inplace = body.get("load_inplace", False)
            if not isinstance(inplace, bool):
                raise BodyError("load_inplace", "must be a boolean")
            await self.frontend.offload(self.frontend.load_adapter, name, path, inplace)
        except Exception as exc:  # noqa: BLE001 - the mapping point of this edge
            return error_response(*render(problem_of(exc)))
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    async def unload_lora_adapter(self, request: Request) -> Response:
        """{"lora_name": ...}: the adapter forgotten; requests running with it finish with it."""
        try:
            self.frontend.check_ready()
            name = _string(parse_body(await self._body(request)), "lora_name")
            self.frontend.unload_adapter(name)
        except Exception as exc:  # noqa: BLE001 - the mapping point of this edge
            return error_response(*render(problem_of(exc)))
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")

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
        problem = Problem(Failure.NOT_FOUND, f"no such path: {request.url.path[:200]} (this server has "
                                             f"{', '.join(PATHS)})")
        return error_response(*self._render(request.url.path, problem))

    async def _not_allowed(self, request: Request, exc) -> Response:
        problem = Problem(Failure.INVALID_ARGUMENT, f"method {request.method} is not allowed on {request.url.path[:200]}")
        return json_response(self._render(request.url.path, problem)[1], 405)


def _string(body, name: str) -> str:
    if not isinstance(body, dict) or not isinstance(body.get(name), str) or not body[name]:
        raise BodyError(name, "is required: a non-empty string")
    return body[name]


def _too_large(limit: int) -> EdgeError:
    return EdgeError(Failure.TOO_LARGE, f"the request body is larger than {limit} bytes "
                                        "(--max-receive-message-bytes)")


def _printable(rid: str) -> bool:
    return len(rid) <= 128 and rid.isascii() and rid.isprintable()
