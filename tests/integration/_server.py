"""A real `lmserve serve` process on loopback ports, for integration tests.

    with ServerProcess(model_dir, log_dir=tmp_path) as srv:
        srv.start(max_batch=4, metrics_port=None)     # flags as ServerSettings names; waits for SERVING
        stub = TextGenerationStub(srv.channel())
        snapshot = srv.metrics()                      # parsed /metrics
        srv.http_url                                  # the OpenAI-compatible HTTP API, e.g. http://127.0.0.1:PORT/v1

Servers run on the CPU unless a test passes `device` (the same everywhere, GPU host or not).
The process runs in its own session with LMSERVE_* variables removed from its environment,
logs to a file (``srv.log``), and is stopped with SIGTERM, then SIGKILL after a timeout.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

HOST = "127.0.0.1"
UNREACHABLE = "UNREACHABLE"  # health state when no server answers on the port
BIND_ERRORS = ("Failed to bind", "Address already in use", "address already in use")


class ServerStartError(RuntimeError):
    """The server exited or never became SERVING; the message ends with its log."""


def free_port() -> int:
    """A port free right now on the loopback interface (another process may still take it before it is
    bound: use it only where a bind that loses that race fails loudly and is retried)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_until(predicate: Callable[[], object], timeout: float = 10.0, interval: float = 0.05, what: str = "condition"):
    """Poll until predicate() is truthy and return its value; TimeoutError naming `what` otherwise."""
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


async def async_wait_until(predicate: Callable[[], object], timeout: float = 10.0, interval: float = 0.05,
                           what: str = "condition"):
    """wait_until for async tests: the blocking predicate runs in a thread, so the event loop (and the
    grpc.aio calls it drives) keeps running while we wait."""
    import asyncio

    end = time.monotonic() + timeout
    while True:
        value = await asyncio.to_thread(predicate)
        if value:
            return value
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(interval)


class MetricsSnapshot:
    """One scrape of /metrics, parsed with prometheus_client's own parser."""

    def __init__(self, text: str):
        self.text = text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples = [s for f in self.families.values() for s in f.samples]

    def get(self, sample: str, default: float | None = None, **labels: str) -> float:
        """Value of the sample with this name and exactly these labels (e.g. lmserve_requests_total)."""
        for s in self.samples:
            if s.name == sample and s.labels == labels:
                return s.value
        if default is not None:
            return default
        raise KeyError(f"no sample {sample}{labels or ''} in /metrics")

    def total(self, sample: str, **label_filter: str) -> float:
        """Sum over every sample of this name whose labels include `label_filter`."""
        return sum(s.value for s in self.samples
                   if s.name == sample and all(s.labels.get(k) == v for k, v in label_filter.items()))

    def labels(self, sample: str) -> list[dict[str, str]]:
        return [s.labels for s in self.samples if s.name == sample]


class ServerProcess:
    """One `lmserve serve` subprocess. See the module docstring.

    Args:
        model: model path or catalog name (--model).
        credentials: channel credentials for TLS servers (used by health probes and channel()).
        log_dir: directory for the log file (default: a fresh temporary directory).
        env: extra environment variables for the process.
        startup_timeout: seconds start() waits for SERVING.
        stop_timeout: seconds stop() waits after SIGTERM before SIGKILL.
    """

    def __init__(self, model: str | os.PathLike, *, credentials: grpc.ChannelCredentials | None = None,
                 log_dir: str | os.PathLike | None = None, env: dict[str, str] | None = None,
                 startup_timeout: float = 120.0, stop_timeout: float = 30.0,
                 command: list[str] | None = None, cwd: str | os.PathLike | None = None):
        self.model = str(model)
        self.command = list(command or [sys.executable, "-m", "lmserve.client.cli"])
        self.cwd = cwd
        self.credentials = credentials
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="lmserve-it-"))
        self.extra_env = dict(env or {})
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._http_port: int | None = None
        self.log_path: Path | None = None
        self.health_history: list[str] = []  # distinct consecutive health states seen while starting
        self._probe: grpc.Channel | None = None

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self, *, wait: bool = True, attempts: int = 3, **flags) -> str | None:
        """Spawn the server with these flags (ServerSettings names; None leaves a flag out) and return its target.

        The gRPC server binds port 0 and logs the port it got. `metrics_port=None` disables /metrics; by
        default a free port is chosen, and a start that loses that port to another process is retried on a
        fresh one. With wait=False, call wait_ready() yourself (the target is known once the port is bound,
        and start returns None).
        """
        if self.proc is not None:
            raise RuntimeError("this ServerProcess was already started")
        for attempt in range(attempts):  # only the metrics port can lose a race: gRPC binds port 0
            self._spawn(dict(flags))
            if not wait:
                return None
            try:
                self.wait_ready()
                return self.target
            except ServerStartError:
                if self.proc.poll() is None or not any(m in self.log for m in BIND_ERRORS) or attempt == attempts - 1:
                    raise
                self._reset()
        raise AssertionError("unreachable")

    def _spawn(self, flags: dict) -> None:
        self.port = None  # the server binds port 0 and logs the port it got (see _bound_port)
        want_metrics = flags.pop("metrics_port", 0) is not None
        # the HTTP API binds a port of the system's choosing, read back from the log (http_port=0 disables it)
        flags.setdefault("http_port", -1)
        self._http_port = None
        flags.setdefault("device", "cpu")  # the same everywhere; CUDA servers are asked for by name
        if flags["device"] == "cpu":  # the token-exact reference mode the tests' expectations are computed in,
            flags.setdefault("dtype", "float32")  # eager (no compiler run at each start)
            flags.setdefault("compile", "false")
        self.metrics_port = free_port() if want_metrics else None
        args = [*self.command, "serve", "--model", self.model, "--host", HOST,
                "--port", "0", "--metrics-port", str(self.metrics_port or 0)]
        for name, value in flags.items():
            if isinstance(value, (list, tuple)):  # a flag taking one or more values (--lora-modules)
                args += ["--" + name.replace("_", "-"), *map(str, value)]
            elif value is not None:
                args += ["--" + name.replace("_", "-"), str(value)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("LMSERVE_")}
        env.update(PYTHONUNBUFFERED="1", **self.extra_env)
        fd, path = tempfile.mkstemp(prefix="server-", suffix=".log", dir=self.log_dir)
        self.log_path = Path(path)
        with os.fdopen(fd, "wb") as log:
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=env, cwd=self.cwd, start_new_session=True)
        self.health_history = []

    def _reset(self) -> None:
        self.kill()
        self._close_probe()
        self.proc = None

    def _bound_port(self) -> int | None:
        """The gRPC port this process bound, from its log line `lmserve bound HOST:PORT`; None until then."""
        if self.port is None:
            found = re.search(rf"lmserve bound {re.escape(HOST)}:(\d+)", self.log)
            self.port = int(found.group(1)) if found else None
        return self.port

    def wait_ready(self, timeout: float | None = None) -> list[str]:
        """Poll grpc.health.v1 until SERVING; returns the distinct states seen (also in health_history)."""
        end = time.monotonic() + (timeout or self.startup_timeout)
        while True:
            state = self.health(timeout=1.0)
            if not self.health_history or self.health_history[-1] != state:
                self.health_history.append(state)
            if state == "SERVING":
                return self.health_history
            if self.proc.poll() is not None:
                raise ServerStartError(f"server exited with {self.proc.returncode} before serving\n{self.log_tail()}")
            if time.monotonic() > end:
                raise ServerStartError(f"server not SERVING after {timeout or self.startup_timeout:.0f}s "
                                       f"(states seen: {self.health_history})\n{self.log_tail()}")
            time.sleep(0.05)

    def signal(self, sig: int) -> None:
        """Send a signal to the server process (only to it, by pid)."""
        self.proc.send_signal(sig)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the process to exit and return its exit code (subprocess.TimeoutExpired on timeout)."""
        return self.proc.wait(timeout)

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited after `timeout` (default stop_timeout). Returns the exit code."""
        self._close_probe()
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_timeout if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- addresses and clients -----------------------------------------------------------
    @property
    def target(self) -> str:
        if self._bound_port() is None:
            raise RuntimeError(f"the server has not bound its port yet\n{self.log_tail()}")
        return f"{HOST}:{self.port}"

    @property
    def http_port(self) -> int:
        """The HTTP API's port, as the server logged it when it bound it."""
        if self._http_port is None:
            found = wait_until(lambda: re.search(r"HTTP API listening on https?://[^\s:]+:(\d+)", self.log),
                               self.startup_timeout, 0.05, "the server to log its HTTP port")
            self._http_port = int(found.group(1))
        return self._http_port

    @property
    def http_url(self) -> str:
        """Base URL of the OpenAI-compatible API (http://127.0.0.1:PORT/v1)."""
        scheme = "http" if self.credentials is None else "https"
        return f"{scheme}://{HOST}:{self.http_port}/v1"

    @property
    def metrics_url(self) -> str | None:
        return None if self.metrics_port is None else f"http://{HOST}:{self.metrics_port}/metrics"

    def channel(self, credentials: grpc.ChannelCredentials | None = ..., options=()) -> grpc.Channel:
        """A new sync channel to the server (the caller closes it); credentials default to the server's."""
        creds = self.credentials if credentials is ... else credentials
        if creds is None:
            return grpc.insecure_channel(self.target, options=list(options))
        return grpc.secure_channel(self.target, creds, options=list(options))

    def aio_channel(self, credentials: grpc.ChannelCredentials | None = ..., options=()) -> grpc.aio.Channel:
        """A new grpc.aio channel, to be created inside the running event loop."""
        creds = self.credentials if credentials is ... else credentials
        if creds is None:
            return grpc.aio.insecure_channel(self.target, options=list(options))
        return grpc.aio.secure_channel(self.target, creds, options=list(options))

    def health(self, service: str = "", timeout: float = 2.0) -> str:
        """SERVING / NOT_SERVING / SERVICE_UNKNOWN, or UNREACHABLE when nothing answers (or the port is not
        bound yet)."""
        if self._bound_port() is None:
            return UNREACHABLE
        if self._probe is None:
            self._probe = self.channel()
        try:
            reply = health_pb2_grpc.HealthStub(self._probe).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return UNREACHABLE
            raise
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def _close_probe(self) -> None:
        if self._probe is not None:
            self._probe.close()
            self._probe = None

    def metrics(self, timeout: float = 10.0) -> MetricsSnapshot:
        """Scrape and parse /metrics."""
        if self.metrics_url is None:
            raise RuntimeError("this server was started without a metrics port")
        with urllib.request.urlopen(self.metrics_url, timeout=timeout) as resp:
            return MetricsSnapshot(resp.read().decode())

    def wait_idle(self, timeout: float = 20.0) -> MetricsSnapshot:
        """Wait until /metrics shows no running or waiting request and no KV slot in use; returns a scrape
        taken after that one. (One scrape reads the counters before the live gauges: a request that ends
        in between is missing from its counters though the gauges say idle; the next scrape counts it.)"""
        def idle():
            m = self.metrics()
            busy = (m.get("lmserve_running_requests"), m.get("lmserve_waiting_requests"), m.get("lmserve_kv_slots_used"))
            return busy == (0, 0, 0)
        wait_until(idle, timeout, 0.1, "an idle engine (running, waiting, kv slots used all 0)")
        return self.metrics()

    def until_cancelled(self, scenario: Callable[[], object], attempts: int = 4):
        """Run `scenario` (it starts one request and cancels it while it streams) until the server
        counts that request as cancelled; returns (before, after, what scenario returned) of that run.
        The small test model can generate its remaining tokens before a cancel sent from a loaded
        machine arrives: such a run ends normally and is tried again. A cancel that never reaches
        the server ends normally every time, and fails."""
        outcomes = []
        for _ in range(attempts):
            before = self.wait_idle()
            result = scenario()
            after = self.wait_idle()  # the request is counted and its slot free again
            ended = {status: n for status in {lb["status"] for lb in after.labels("lmserve_requests_total")}
                     if (n := after.total("lmserve_requests_total", status=status)
                         - before.total("lmserve_requests_total", status=status))}
            if ended == {"cancelled": 1}:
                return before, after, result
            assert ended == {"ok": 1}, f"one request should end, cancelled (or finished first): {ended}"
            outcomes.append(ended)
        raise AssertionError(f"the cancel never reached the server in {attempts} runs: {outcomes}")

    # ---- logs -----------------------------------------------------------------------------
    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def log_tail(self, chars: int = 6000) -> str:
        text = self.log
        return f"--- server log {self.log_path} (last {chars} chars) ---\n{text[-chars:]}"


def field_violations(error: grpc.RpcError) -> list[tuple[str, str]]:
    """(field, description) pairs of the google.rpc.BadRequest detail of a failed call, [] if none."""
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    status = rpc_status.from_call(error)
    out = []
    for detail in status.details if status else ():
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            out += [(v.field, v.description) for v in bad.field_violations]
    return out


async def read_stream(call) -> tuple[list, "grpc.aio.AioRpcError | None"]:
    """Read a grpc.aio stream to its end: (messages, the error that ended it or None)."""
    messages = []
    try:
        while (msg := await call.read()) is not grpc.aio.EOF:
            messages.append(msg)
    except grpc.aio.AioRpcError as exc:
        return messages, exc
    return messages, None


async def read_all(call) -> list:
    """Read a grpc.aio stream to its end; an error that ends it is raised."""
    messages, exc = await read_stream(call)
    if exc is not None:
        raise exc
    return messages
