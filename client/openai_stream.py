"""A small asyncio client for OpenAI-compatible streaming completions, for ``lmserve bench load --api openai``.

It speaks HTTP/1.1 with keep-alive over asyncio streams (no dependency beyond the standard library),
sends `/v1/chat/completions` for chat prompts and `/v1/completions` for text or token ids, and reads
the SSE events. It offers what the load generator uses of :class:`~lmserve.client.aio.AsyncClient`:
``stream(prompt, params, timeout)`` yielding :class:`~lmserve.client.types.StreamChunk` (text deltas;
the last one carries ``usage`` when the server sends it) and ``model_info()``. An OpenAI stream does
not say which tokens a piece holds: chunks carry no token ids, and the load generator counts one token
per text piece, corrected to the server's usage count at the end. HTTP errors become the SDK's error
classes by status (429 -> OverloadedError, 503 -> UnavailableError, ...), so reports name them alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from typing import Any, AsyncIterator
from urllib.parse import urlsplit

import grpc

from .errors import LmserveError, error_from_code
from .types import ChatMessage, SamplingParams, StreamChunk, Usage

_STATUS_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
                 403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
                 408: grpc.StatusCode.DEADLINE_EXCEEDED, 413: grpc.StatusCode.INVALID_ARGUMENT,
                 429: grpc.StatusCode.RESOURCE_EXHAUSTED, 499: grpc.StatusCode.CANCELLED,
                 503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}
_FINISH = {"stop": "eos", "length": "length"}


def http_error(status: int, body: bytes) -> LmserveError:
    """The SDK error for an HTTP error status, with the server's message."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body[:200].decode(errors="replace") or f"HTTP {status}"
    code = _STATUS_CODES.get(status, grpc.StatusCode.INTERNAL if status >= 500 else grpc.StatusCode.UNKNOWN)
    return error_from_code(code, f"HTTP {status}: {message}")


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    def close(self) -> None:
        self.writer.close()

    async def request(self, method: str, target: str, host: str, headers: dict[str, str], body: bytes) -> None:
        head = [f"{method} {target} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        self.writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        await self.writer.drain()

    async def response_head(self) -> tuple[int, dict[str, str]]:
        status_line = await self.reader.readline()
        if not status_line:
            raise ConnectionResetError("the server closed the connection")
        status = int(status_line.split()[1])
        headers = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return status, headers

    async def body_parts(self, headers: dict[str, str]) -> AsyncIterator[bytes]:
        """The body as it arrives (chunked, or Content-Length bytes, or until the connection ends)."""
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                try:
                    size = int((await self.reader.readline()).split(b";")[0], 16)
                    if size == 0:
                        await self.reader.readline()  # the empty trailer
                        return
                    data = await self.reader.readexactly(size)
                    await self.reader.readexactly(2)
                except (ValueError, asyncio.IncompleteReadError):  # the stream ended or was cut mid-chunk
                    raise ConnectionResetError("the server closed the connection mid-response") from None
                yield data
        elif "content-length" in headers:
            yield await self.reader.readexactly(int(headers["content-length"]))
        else:
            while data := await self.reader.read(65536):
                yield data


class OpenAIStreamClient:
    """Streams completions from an OpenAI-compatible server at `url` (e.g. http://host:8000/v1)."""

    def __init__(self, url: str, token: str | None = None, model: str | None = None, ca_file: str | None = None,
                 timeout: float | None = None, ignore_eos_field: bool = True):
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"--url must be http:// or https://, got {url!r}")
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.base = parts.path.rstrip("/") or "/v1"
        self.ssl = ssl.create_default_context(cafile=ca_file) if parts.scheme == "https" else None
        self.model = model
        self.timeout = timeout
        self.ignore_eos_field = ignore_eos_field  # lmserve, vLLM and llama.cpp's server read `ignore_eos`
        self._headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._idle: list[_Connection] = []

    async def __aenter__(self) -> "OpenAIStreamClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        while self._idle:
            self._idle.pop().close()

    async def _connect(self, fresh: bool = False) -> _Connection:
        """An idle keep-alive connection (those the server has closed meanwhile are dropped), or a new one."""
        while self._idle and not fresh:
            conn = self._idle.pop()
            if not conn.reader.at_eof():
                return conn
            conn.close()
        reader, writer = await asyncio.open_connection(self.host, self.port, ssl=self.ssl, limit=2**20)
        return _Connection(reader, writer)

    async def _call(self, method: str, path: str, payload: Any = None) -> tuple[_Connection, int, dict]:
        body = b"" if payload is None else json.dumps(payload).encode()
        # an idle keep-alive connection the server closed before its close reached us: once more on a new
        # one (not another idle one, which may have been closed with it)
        for attempt in (0, 1):
            conn = await self._connect(fresh=attempt == 1)
            try:
                await conn.request(method, self.base + path, self.host, self._headers, body)
                status, headers = await conn.response_head()
                return conn, status, headers
            except (ConnectionError, asyncio.IncompleteReadError):
                conn.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _release(self, conn: _Connection, headers: dict[str, str]) -> None:
        if headers.get("connection", "").lower() == "close":
            conn.close()
        else:
            self._idle.append(conn)

    async def model_info(self, timeout: float | None = None):
        """The served model's id (the first of /models) becomes the requests' model; returns None
        (an OpenAI server reports no lmserve ModelInfo)."""
        async with asyncio.timeout(timeout or self.timeout):
            conn, status, headers = await self._call("GET", "/models")
            body = b"".join([part async for part in conn.body_parts(headers)])
        self._release(conn, headers)
        if status != 200:
            raise http_error(status, body)
        if self.model is None:
            self.model = json.loads(body)["data"][0]["id"]
        return None

    def _payload(self, prompt: Any, params: SamplingParams) -> tuple[str, dict]:
        body: dict[str, Any] = {"model": self.model, "stream": True, "stream_options": {"include_usage": True},
                                "max_tokens": params.max_new_tokens, "temperature": params.temperature}
        if params.seed is not None:
            body["seed"] = params.seed
        if params.ignore_eos and self.ignore_eos_field:
            body["ignore_eos"] = True
        if isinstance(prompt, str):
            return "/completions", {**body, "prompt": prompt}
        if prompt and all(isinstance(t, int) for t in prompt):
            return "/completions", {**body, "prompt": list(prompt)}
        messages = [m if isinstance(m, dict) else {"role": m.role, "content": m.content}
                    for m in (ChatMessage(*m) if isinstance(m, tuple) else m for m in prompt)]
        return "/chat/completions", {**body, "messages": messages}

    async def stream(self, prompt: Any, params: SamplingParams, timeout: float | None = None
                     ) -> AsyncIterator[StreamChunk]:
        """Text pieces as they arrive; the last chunk has the finish reason and the server's usage."""
        if self.model is None:
            await self.model_info(timeout)
        path, payload = self._payload(prompt, params)
        limit = timeout if timeout is not None else self.timeout
        conn = None
        done = False
        try:
            async with asyncio.timeout(limit):
                conn, status, headers = await self._call("POST", path, payload)
                if status != 200:
                    body = b"".join([part async for part in conn.body_parts(headers)])
                    self._release(conn, headers)
                    conn = None
                    raise http_error(status, body)
                rid, finish, usage, pending = "", None, None, b""
                async for part in conn.body_parts(headers):
                    pending += part
                    *events, pending = pending.split(b"\n\n")
                    for event in events:
                        data = event.partition(b"data:")[2].strip()
                        if not data:
                            continue
                        if data == b"[DONE]":
                            done = True
                            continue
                        obj = json.loads(data)
                        if "error" in obj:
                            raise error_from_code(grpc.StatusCode.INTERNAL, f"error event: {obj['error'].get('message')}")
                        rid = obj.get("id", rid)
                        if obj.get("usage"):
                            u = obj["usage"]
                            usage = Usage(u["prompt_tokens"], u["completion_tokens"],
                                          (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                        for choice in obj.get("choices") or ():
                            text = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                            finish = choice.get("finish_reason") or finish
                            if text:
                                yield StreamChunk(request_id=rid, text=text, token_ids=[])
                if not done:
                    raise error_from_code(grpc.StatusCode.UNAVAILABLE, "the stream ended without [DONE]")
                self._release(conn, headers)
                conn = None
                yield StreamChunk(request_id=rid, text="", token_ids=[], finish_reason=_FINISH.get(finish, finish),
                                  usage=usage)
        except TimeoutError:
            raise error_from_code(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {limit}s") from None
        except (ConnectionError, asyncio.IncompleteReadError, OSError) as exc:
            raise error_from_code(grpc.StatusCode.UNAVAILABLE, f"connection failed: {exc}") from None
        finally:
            if conn is not None:  # left early or failed mid-stream: the connection's state is unknown
                with contextlib.suppress(Exception):
                    conn.close()
