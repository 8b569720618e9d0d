"""Assemble and run the server: gRPC (service, health, reflection) and the OpenAI-compatible HTTP API
on one event loop and one engine, metrics, graceful drain of both edges."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from lmserve.v1 import lmserve_pb2, lmserve_pb2_grpc

from .auth import BearerAuthInterceptor, read_tokens
from .config import ServerSettings, served_names
from .frontend import Frontend
from .service import TextGenerationService

log = logging.getLogger("lmserve.server")
SERVICE_NAME = lmserve_pb2.DESCRIPTOR.services_by_name["TextGeneration"].full_name
# A health service name for liveness probes: SERVING while the process and its engine loop are alive
# and no step is stuck, draining included (a drain only turns "" and SERVICE_NAME NOT_SERVING).
LIVENESS_SERVICE = "liveness"
HEALTH_CHECK_INTERVAL = 0.5
# Exit status when the engine loop died: an orchestrator restarts the process.
EXIT_ENGINE_DIED = 3


READY_LINE_CHARS = 200  # the ready line's most characters (for hosts of up to an IPv6 address's length)


def ready_line(host: str, port: int, *, tls: bool, http_port: int | None, metrics: tuple[str, int] | None,
               model: str, mode: str, kv_gib: float, kv_dtype: str, seconds: float) -> str:
    """The line logged when the server is ready: where it listens (the HTTP API on `host` too, metrics
    on their (host, port): a port alone on `host`), what it serves, its KV memory and how long the
    start took. A model name too long for READY_LINE_CHARS keeps its end (the file or directory name).
    Why each choice was made goes on its own INFO lines and in `lmserve info`."""
    where = "off" if metrics is None else f":{metrics[1]}" if metrics[0] == host else f"{metrics[0]}:{metrics[1]}"
    head = (f"lmserve listening on {host}:{port} ({'TLS' if tls else 'plaintext'}), "
            f"HTTP {f':{http_port}' if http_port else 'off'}, metrics {where}; model ")
    tail = f", {mode}, KV {kv_gib:.1f} GiB {kv_dtype}, ready in {seconds:.1f}s"
    room = max(READY_LINE_CHARS - len(head) - len(tail), 8)
    if len(model) > room:
        model = "..." + model[len(model) - room + 3:]
    return head + model + tail


def process_age() -> float | None:
    """Seconds since this process started (Linux: /proc/self/stat against /proc/uptime), or None."""
    import os

    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def startup_line(phases: dict[str, float], age: float | None) -> str:
    """Where a start's seconds went: each phase (loader.load_model's and the engine's), and the time since
    the process started (imports, binding and the phases together), when known."""
    text = "start-up: " + ", ".join(f"{name} {seconds:.1f}s" for name, seconds in phases.items())
    return text + (f"; {age:.1f}s since the process started" if age is not None else "")


def grpc_options(s: ServerSettings) -> list[tuple[str, int]]:
    opts = [
        ("grpc.max_receive_message_length", s.max_receive_message_bytes),
        ("grpc.max_send_message_length", 64 * 2**20),
        # keepalive for long streams behind load balancers: ping idle connections, accept client pings
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.so_reuseport", 0),
        ("grpc.max_concurrent_streams", s.max_concurrent_streams),
    ]
    # connection lifetimes: an aged connection gets GOAWAY, so the client reconnects (and resolves or
    # is balanced anew, reaching replicas added since); its calls get the grace period to finish
    if s.max_connection_age:
        opts += [("grpc.max_connection_age_ms", int(s.max_connection_age * 1000)),
                 ("grpc.max_connection_age_grace_ms", int(s.max_connection_age_grace * 1000))]
    if s.max_connection_idle:
        opts.append(("grpc.max_connection_idle_ms", int(s.max_connection_idle * 1000)))
    return opts


class BoundedHealthServicer(health.aio.HealthServicer):
    """grpc.health.v1 with a cap on concurrent Watch calls (each holds a stream open indefinitely)."""

    def __init__(self, max_watchers: int):
        super().__init__()
        self.max_watchers = max_watchers
        self.watchers = 0

    async def Watch(self, request, context):
        if self.watchers >= self.max_watchers:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"too many health watchers (at most {self.max_watchers}); use Check or retry later")
        self.watchers += 1
        try:
            await super().Watch(request, context)
        finally:
            self.watchers -= 1


def read_chat_template(path: str) -> str:
    """The text of a --chat-template file, compiled once in the templates' sandbox to check it; ValueError
    (a one-line startup error) when it cannot be read or does not compile."""
    from lmserve.model.text.chat_template import ChatTemplate, ChatTemplateError

    try:
        source = Path(path).read_text(encoding="utf-8")
        ChatTemplate(source)
    except (OSError, UnicodeDecodeError, ChatTemplateError) as exc:
        raise ValueError(f"--chat-template {path}: {exc}") from None
    return source


def server_credentials(s: ServerSettings) -> grpc.ServerCredentials | None:
    if not s.tls_cert:
        return None
    key, cert = Path(s.tls_key).read_bytes(), Path(s.tls_cert).read_bytes()
    ca = Path(s.tls_client_ca).read_bytes() if s.tls_client_ca else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


class Server:
    """One lmserve process: start() binds and loads, run_until_signal() serves and drains."""

    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.frontend = Frontend(settings)  # what both edges share: one engine, one pool, one drain
        self.service = TextGenerationService(settings, self.frontend)
        self.health = BoundedHealthServicer(settings.max_health_watchers)  # aio: the blocking one pins threads
        self.engine = None
        self.metrics = None
        self.exit_code = 0
        self._metrics_http = None
        self._stop = asyncio.Event()
        self._watchdog: asyncio.Task | None = None
        tokens = read_tokens(settings.auth_tokens_file) if settings.auth_tokens_file else ()
        interceptors = [BearerAuthInterceptor(tokens)] if tokens else []
        # calls beyond maximum_concurrent_rpcs are answered RESOURCE_EXHAUSTED by grpc itself
        self.grpc = grpc.aio.server(options=grpc_options(settings), interceptors=interceptors,
                                    maximum_concurrent_rpcs=settings.max_concurrent_rpcs)
        lmserve_pb2_grpc.add_TextGenerationServicer_to_server(self.service, self.grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.grpc)
        addr = f"{settings.host}:{settings.port}"
        creds = server_credentials(settings)
        self.port = self.grpc.add_secure_port(addr, creds) if creds else self.grpc.add_insecure_port(addr)
        # read and compiled now, so that a bad file fails the start before the model loads
        self.chat_template = read_chat_template(settings.chat_template) if settings.chat_template else None
        self.http = None
        if settings.http_port:
            from .http.app import OpenAIEdge
            from .http.response_store import ResponseStore
            from .http.server import HttpServer

            edge = OpenAIEdge(self.frontend, tokens, max_body_bytes=settings.max_receive_message_bytes,
                              read_timeout=settings.http_read_timeout, strict_fields=settings.strict_openai_fields,
                              responses_store=ResponseStore(settings.responses_store_max, settings.responses_store_ttl))
            self.http = HttpServer(settings, edge.app)

    @property
    def http_port(self) -> int | None:
        """The HTTP API's bound port (None: disabled)."""
        return None if self.http is None else self.http.port

    async def _set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def _set_liveness(self, alive: bool) -> None:
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING if alive
                              else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def start(self) -> None:
        """Listen at once (health says NOT_SERVING, liveness SERVING), then load the model off the event loop."""
        await self._set_health(False)
        await self._set_liveness(True)
        await self.grpc.start()
        log.info("lmserve bound %s:%d; loading %s", self.settings.host, self.port, self.settings.model)
        if self.http is not None:
            await self.http.start()
            log.info("HTTP API listening on %s://%s:%d (loading the model)", "https" if self.settings.tls_cert else "http",
                     self.settings.host, self.http_port)
        t0 = time.monotonic()
        self.engine, self.metrics = await asyncio.to_thread(self._load)
        s = self.settings
        default = self.engine.loaded.config.name if s.model.endswith((".gguf", "/")) else s.model
        self.service.attach(self.engine, *(served_names(s.served_model_name) if s.served_model_name else (default,)))
        self.service.on_stream_idle_timeout = self.metrics.stream_idle_timeouts.inc
        if s.metrics_port:
            self._metrics_http = self.metrics.serve(s.metrics_port, s.metrics_host or s.host)
        await self._set_health(True)
        self._watchdog = asyncio.create_task(self._watch_engine())
        self._log_choices()
        lm = self.engine.loaded
        log.info("%s", ready_line(
            s.host, self.port, tls=bool(s.tls_cert), http_port=self.http_port,
            metrics=(s.metrics_host or s.host, s.metrics_port) if s.metrics_port else None,
            model=self.service.model_name, mode=f"{lm.mode} on {lm.device.type}",
            kv_gib=self.engine.kv_cache_bytes / 2**30, kv_dtype=self.engine.kv_choice.name, seconds=time.monotonic() - t0))

    def _log_choices(self) -> None:
        """What was chosen at start and why, one INFO line each (`lmserve info` shows them too), and where
        the start's seconds went."""
        lm, engine = self.engine.loaded, self.engine
        log.info("%s", startup_line({**lm.phases, **getattr(engine, "phases", {})}, process_age()))
        log.info("kernels: %s", lm.kernels)
        log.info("precision: %s %s", lm.mode, lm.choice)
        log.info("KV cache: %.1f GiB in %s (%s)", engine.kv_cache_bytes / 2**30, engine.kv_choice.name,
                 engine.kv_choice.reason)
        log.info("steps: %s, max batch %d, speculation %s", "overlapped" if engine.overlap else "sequential",
                 engine.max_batch, engine.speculation_summary())

    def _load(self):
        import torch

        from lmserve.model.loader import load_model

        from .engine import Engine
        from .metrics import Metrics

        s = self.settings
        if s.threads:
            torch.set_num_threads(s.threads)
        loaded = load_model(s.model, dtype=s.dtype, device=s.device, models_dir=s.models_dir,
                            quantization=s.quantization, batch_invariant=s.batch_invariant, cache_dir=s.cache_dir,
                            compile="false" if s.engine.serves_adapters else s.compile)  # adapters: eager layers
        if self.chat_template is not None:
            loaded.tokenizer.use_chat_template(self.chat_template)
        engine = Engine(loaded, s.engine)
        metrics = Metrics(engine, s.model)
        return engine.start(), metrics

    async def _watch_engine(self) -> None:
        """Health follows the engine: NOT_SERVING when its loop is dead or stuck, or while draining.
        A dead loop (its requests have already ended UNAVAILABLE) stops the server with a non-zero exit
        status, so that an orchestrator restarts it."""
        while True:
            h = self.engine.health()
            await self._set_health(h.ok and not self.service.draining)
            await self._set_liveness(h.ok)  # a step stuck for minutes is worth a restart; a drain is not
            if not h.ok:
                log.error("engine unhealthy: %s", h.detail)
            if not h.alive:
                await self._set_liveness(False)
                log.critical("the engine loop is dead; stopping (exit status %d) so the process is restarted",
                             EXIT_ENGINE_DIED)
                self.exit_code = EXIT_ENGINE_DIED
                self.request_stop()
                return
            await asyncio.sleep(HEALTH_CHECK_INTERVAL)

    def request_stop(self) -> None:
        self._stop.set()

    async def drain_and_stop(self) -> None:
        """NOT_SERVING, refuse new calls (UNAVAILABLE), let in-flight ones finish within the grace period."""
        s = self.settings
        self.service.draining = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        await self._set_health(False)
        if self.engine is not None:
            self.engine.stop_accepting()
        log.info("draining: %d call(s) in flight, grace period %.0fs", self.service.in_flight, s.grace_period)
        await self.service.wait_idle(s.grace_period)
        if self.service.in_flight:  # unfinished, or streams whose reader stopped reading (not waited for)
            log.warning("grace period over with %d call(s) still in flight", self.service.in_flight)
        if self.engine is not None:
            # what is still running ends with UNAVAILABLE (retryable before its first token)
            await asyncio.to_thread(self.engine.shutdown)
            await self.service.wait_idle(5.0)  # let the handlers send those statuses
        await self.health.enter_graceful_shutdown()  # ends open Watch streams with NOT_SERVING
        if self.http is not None:
            await self.http.stop()
        await self.grpc.stop(grace=1.0)
        await self.service.wait_idle(2.0, stalled_too=True)  # handlers of calls stop() cancelled unwind
        self.service.close()
        if self._metrics_http is not None:
            self._metrics_http[0].shutdown()
        log.info("stopped")

    async def run_until_signal(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        try:
            await self.start()
        except BaseException:  # a model that does not load: close the listeners inside the loop, then say why
            if self.http is not None:
                await self.http.stop()
            await self.grpc.stop(grace=None)
            raise
        await self._stop.wait()
        await self.drain_and_stop()
        return self.exit_code


def serve(settings: ServerSettings) -> int:
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def main() -> int:  # the grpc.aio server must be created inside the running loop
        return await Server(settings).run_until_signal()

    return asyncio.run(main())
