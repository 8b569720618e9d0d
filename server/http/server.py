"""uvicorn inside the lmserve process: the same event loop as grpc.aio, so both edges share one engine.

The socket is bound when the server is built (`--http-port -1`: any free port; `port` tells which), it
starts listening before the model loads (/health answers, /ready says loading) and stops after the
drain. lmserve handles SIGTERM itself (app.py), so uvicorn installs no signal handlers here.

Slow or idle clients cannot pin the server: a request's headers must arrive within --http-read-timeout
of the connection opening or of the request's first byte (then its body within as long, see app.py),
an idle keep-alive connection closes after --http-keep-alive-timeout, and at most
--http-max-connections connections (and requests) are served at once (beyond: 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..config import ServerSettings

log = logging.getLogger("lmserve.http")
SHUTDOWN_SECONDS = 2.0  # after the drain, for connections to close


class _TimedHeadersProtocol(HttpToolsProtocol):
    """HTTP/1.1 (httptools) that closes a connection whose request headers take too long."""

    read_timeout = 30.0
    _header_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.read_timeout, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


class _Embedded(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the process's own handlers drain both edges
        yield


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"the HTTP API cannot bind {host}:{port}: {exc.strerror} (--http-port)") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class HttpServer:
    """One uvicorn server for `app` on the settings' host and --http-port."""

    def __init__(self, settings: ServerSettings, app):
        self.settings = s = settings
        self.sock = bind(s.host, max(s.http_port, 0))
        self.port = self.sock.getsockname()[1]
        protocol = type("HttpProtocol", (_TimedHeadersProtocol,), {"read_timeout": s.http_read_timeout})
        tls = {}
        if s.tls_cert:
            tls = dict(ssl_certfile=s.tls_cert, ssl_keyfile=s.tls_key)
            if s.tls_client_ca:
                tls.update(ssl_ca_certs=s.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        config = uvicorn.Config(app, interface="asgi3", http=protocol, lifespan="off", log_config=None, log_level="warning",
                                access_log=False, proxy_headers=False, server_header=False,
                                limit_concurrency=s.http_max_connections + 1,  # uvicorn refuses at >= its limit
                                timeout_keep_alive=s.http_keep_alive_timeout,
                                timeout_graceful_shutdown=SHUTDOWN_SECONDS, **tls)
        self.server = _Embedded(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self._task.done():  # failed to start (a bad certificate, say): say why
                self._task.result()
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Stop listening, close connections (their streams ended with the drain), wait for it."""
        if self._task is None:
            self.sock.close()
            return
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), SHUTDOWN_SECONDS + 3)
        except (TimeoutError, asyncio.TimeoutError):
            self.server.force_exit = True
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self._task, 2)
