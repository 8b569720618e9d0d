"""Servers started as their own processes for a benchmark: lmserve (or a stand-in that starts the same
way), or a peer such as llama.cpp's `llama-server`, each stopped when the `with` block ends."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

LMSERVE = (sys.executable, "-m", "lmserve.client.cli", "serve")


@dataclass(frozen=True)
class Served:
    grpc_target: str | None  # host:port of lmserve's gRPC API (None for a peer)
    http_url: str | None  # the OpenAI API's base URL, ending in /v1 (None: not served)
    metrics_url: str | None  # lmserve's /metrics (None: not served)
    log: Path
    pid: int
    ready_seconds: float  # from the process's start to serving

    def memory(self) -> dict[str, int]:
        """The server process's resident memory now and at its peak, as the kernel counts it."""
        return process_memory(self.pid)

    def metrics(self) -> dict[str, float]:
        """The unlabelled samples of one /metrics scrape, by name."""
        from prometheus_client.parser import text_string_to_metric_families

        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}


def process_memory(pid: int | str = "self") -> dict[str, int]:
    """Resident bytes of a live process from the kernel's own accounting (/proc/<pid>/status): now
    (VmRSS) and its peak since it started (VmHWM, the high-water mark ru_maxrss reports at exit)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            number, unit = value.split()
            fields[key] = int(number) * {"kB": 1024}[unit]
    return {"resident_bytes": fields["VmRSS"], "peak_resident_bytes": fields["VmHWM"]}


class StartFailed(RuntimeError):
    """A server that exited, or was not ready in time, before serving."""

    def __init__(self, name: str, returncode: int | None, seconds: float, log_tail: str, memory: dict | None):
        how = "timed out" if returncode is None else f"exited with status {returncode}"
        super().__init__(f"{name} did not become ready ({how} after {seconds:.0f}s):\n{log_tail}")
        self.returncode, self.seconds, self.log_tail, self.memory = returncode, seconds, log_tail, memory

    def record(self) -> dict:
        """What a report keeps of the failure: how it ended, the log's last lines, the last memory read."""
        return {"failed": "timed out" if self.returncode is None else f"exited with status {self.returncode}",
                "seconds": round(self.seconds, 1), "log_tail": self.log_tail.splitlines()[-12:],
                "memory_last_read": self.memory}


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _free_port() -> int:
    # a benchmark, not a test: a port picked before the server binds it is good enough here
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serving(target: str) -> bool:
    from lmserve.client import Client, LmserveError

    try:
        with Client(target, timeout=2, max_retries=0) as client:
            return client.health() == "SERVING"
    except LmserveError:
        return False


@contextlib.contextmanager
def _started(name: str, cmd: list[str], ready, startup_timeout: float, env: dict[str, str] | None = None):
    """Process `cmd` (in this environment, `env` added), its output in a log file, until the `with` block
    ends. `ready(log, pid, t0)` is polled until it returns the Served (None: not serving yet); a process
    that exits first fails."""
    log = Path(tempfile.mkstemp(prefix=f"bench-{name}-", suffix=".log")[1])
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    memory = None  # the last reading while it started: what a process killed for memory had reached
    try:
        deadline = time.monotonic() + startup_timeout
        while (served := ready(log, proc.pid, t0)) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise StartFailed(name, proc.returncode, time.perf_counter() - t0,
                                  log.read_text(errors="replace")[-3000:], memory)
            with contextlib.suppress(OSError, KeyError):  # gone, or a zombie without memory
                memory = process_memory(proc.pid)
            time.sleep(0.2)
        yield served
    finally:
        _stop(proc)
        log.unlink(missing_ok=True)


def lmserve(flags: list[str], *, http: bool = True, metrics: bool = False, command=LMSERVE,
            startup_timeout: float = 900, env: dict[str, str] | None = None):
    """`lmserve serve` (or `command`, which logs the same startup lines) with these flags, gRPC and the
    HTTP API on free ports it reports, /metrics when asked, `env` added to its environment; yields a
    Served once health says SERVING."""
    metrics_port = _free_port() if metrics else 0  # the server logs no port it picked for /metrics
    cmd = [*command, "--port", "0", "--http-port", "-1" if http else "0", "--metrics-port", str(metrics_port),
           *flags]

    def ready(log: Path, pid: int, t0: float) -> Served | None:
        text = log.read_text(errors="replace")
        grpc_port = re.search(r"lmserve bound \S+?:(\d+)", text)
        http_url = re.search(r"HTTP API listening on (http://\S+?:\d+)", text)
        if not grpc_port or (http and not http_url) or not _serving(f"127.0.0.1:{grpc_port.group(1)}"):
            return None
        return Served(f"127.0.0.1:{grpc_port.group(1)}", http_url.group(1) + "/v1" if http else None,
                      f"http://127.0.0.1:{metrics_port}/metrics" if metrics else None, log, pid,
                      time.perf_counter() - t0)

    return _started("lmserve", cmd, ready, startup_timeout, env)


def llama_server(binary: Path, gguf: Path, flags: list[str], startup_timeout: float = 300):
    """llama.cpp's `llama-server` serving gguf on a free port; yields a Served once /health is 200."""
    port = _free_port()

    def ready(log: Path, pid: int, t0: float) -> Served | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status != 200:
                    return None
        except OSError:
            return None
        return Served(None, f"http://127.0.0.1:{port}/v1", None, log, pid, time.perf_counter() - t0)

    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), *flags]
    return _started("llama-server", cmd, ready, startup_timeout)


__all__ = ["Served", "StartFailed", "llama_server", "lmserve", "process_memory"]
