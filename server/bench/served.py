"""Servers started as their own processes for a benchmark: lmserve, or a peer such as llama.cpp's
`llama-server`, each stopped when the `with` block ends."""

from __future__ import annotations

import contextlib
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


@dataclass(frozen=True)
class Served:
    grpc_target: str | None  # host:port of lmserve's gRPC API (None for a peer)
    http_url: str  # the OpenAI API's base URL, ending in /v1
    log: Path


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def lmserve(flags: list[str], startup_timeout: float = 900):
    """`lmserve serve` with these flags on free ports; yields a Served once the model is loaded."""
    log = Path(tempfile.mkstemp(prefix="bench-lmserve-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "lmserve.client.cli", "serve", "--port", "0", "--http-port", "-1",
           "--metrics-port", "0", *flags]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            text = log.read_text(errors="replace")
            grpc_port = re.search(r"lmserve bound \S+?:(\d+)", text)
            http = re.search(r"HTTP API listening on (http://\S+?:\d+)", text)
            if grpc_port and http and "ready in" in text:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"lmserve did not become ready:\n{text[-3000:]}")
            time.sleep(0.2)
        yield Served(f"127.0.0.1:{grpc_port.group(1)}", http.group(1) + "/v1", log)
    finally:
        _stop(proc)


def _free_port() -> int:
    # a benchmark, not a test: a port picked before the peer binds it is good enough here
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def llama_server(binary: Path, gguf: Path, flags: list[str], startup_timeout: float = 300):
    """llama.cpp's `llama-server` serving gguf on a free port; yields a Served once /health is 200."""
    port = _free_port()
    log = Path(tempfile.mkstemp(prefix="bench-llama-server-", suffix=".log")[1])
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), *flags]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not become ready:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.3)
        yield Served(None, f"http://127.0.0.1:{port}/v1", log)
    finally:
        _stop(proc)


__all__ = ["Served", "llama_server", "lmserve"]
