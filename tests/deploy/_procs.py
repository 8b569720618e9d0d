"""nginx and Prometheus as child processes on loopback, configured from the shipped deploy/ files.

The shipped configs name compose hosts (lmserve-1:50051, lmserve-1:8000, ...); the renderers here swap
only the addresses and file paths, so every other directive under test is the one that ships.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

HOST = "127.0.0.1"
UPSTREAM_SERVER = re.compile(r"^(\s*)server\s+lmserve-\d+:\d+([^;]*);\s*$", re.M)
UPSTREAM_BLOCK = re.compile(r"(upstream\s+(\w+)\s*\{)(.*?)(^\s*\})", re.S | re.M)
LISTEN = re.compile(r"^(\s*)listen\s+(\d+)(\s+http2)?\s*;", re.M)
GRPC_UPSTREAM, HTTP_UPSTREAM = "lmserve_backends", "lmserve_http"
GRPC_PORT, HTTP_PORT = 50051, 8000  # the shipped listeners


def owns_listener(pid: int, port: int) -> bool:
    """Whether process `pid` holds the socket listening on HOST:port (from /proc). nginx and Prometheus
    take a port picked free beforehand, which another process may have taken meanwhile: a check that
    something answers on the port could then reach that other process."""
    want = f"{HOST}:{port:04X}".replace("127.0.0.1", "0100007F")
    inodes = {fields[9] for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
              if (fields := line.split())[1] == want and fields[3] == "0A"}  # 0A: LISTEN
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False
    held = set()
    for fd in fds:
        try:
            held.add(os.readlink(fd))
        except OSError:  # closed meanwhile
            pass
    return any(f"socket:[{inode}]" in held for inode in inodes)


# ---------------------------------------------------------------- nginx


def render_nginx_conf(shipped: str, backends: list[str], listen_port: int, workdir: Path,
                      http_backends: list[str] | None = None, http_port: int | None = None) -> str:
    """The shipped nginx.conf with loopback backends and listeners, and temp/log paths in `workdir`.

    `backends`/`listen_port`: gRPC (upstream lmserve_backends, listen 50051); `http_backends`/
    `http_port`: the HTTP API (upstream lmserve_http, listen 8000; default: the gRPC backends, and the
    HTTP listener left out, for configs that only serve gRPC in a test)."""
    chosen = {GRPC_UPSTREAM: backends, HTTP_UPSTREAM: http_backends or backends}

    def upstream(m: re.Match) -> str:
        servers = UPSTREAM_SERVER.findall(m.group(3))
        if not servers:
            raise ValueError(f"no `server lmserve-N:PORT ...;` lines in upstream {m.group(2)}")
        indent, params = servers[0]
        lines = "\n".join(f"{indent}server {b}{params};" for b in chosen[m.group(2)])
        body = UPSTREAM_SERVER.sub("", m.group(3), count=len(servers) - 1)
        return m.group(1) + UPSTREAM_SERVER.sub(lines, body, count=1) + m.group(4)

    text, n = UPSTREAM_BLOCK.subn(upstream, shipped)
    if n != 2:
        raise ValueError(f"expected the upstreams {GRPC_UPSTREAM} and {HTTP_UPSTREAM}, found {n} upstream blocks")
    ports = {GRPC_PORT: listen_port, HTTP_PORT: http_port}
    found = [int(p) for _, p, _ in LISTEN.findall(text)]
    if sorted(found) != sorted(ports):
        raise ValueError(f"expected listeners on {sorted(ports)}, found {found}")
    if http_port is None:  # drop the HTTP server block: listening needs a port of its own
        start = text.index(f"listen {HTTP_PORT};")
        block = text.rindex("server {", 0, start)
        end = text.index("\n    }\n", start) + len("\n    }\n")
        text = text[:block] + text[end:]
    text = LISTEN.sub(lambda m: f"{m.group(1)}listen {HOST}:{ports[int(m.group(2))]}{m.group(3) or ''};", text)
    temp = "".join(f"    {kind}_temp_path {workdir / kind};\n" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    text = text.replace("http {\n", "http {\n" + temp, 1)
    text = text.replace("access_log /dev/stdout", f"access_log {workdir / 'access.log'}")
    text = text.replace("error_log /dev/stderr", f"error_log {workdir / 'error.log'}")
    return text.replace("worker_processes auto;", "worker_processes 1;")


class Nginx:
    """nginx in the foreground (`daemon off`) with a rendered config; stop() sends SIGQUIT (graceful)."""

    def __init__(self, binary: str, conf_text: str, workdir: Path, port: int):
        self.binary, self.workdir, self.port = binary, workdir, port
        self.conf = workdir / "nginx.conf"
        self.conf.write_text(conf_text)
        self.error_log = workdir / "error.log"
        self.access_log = workdir / "access.log"
        self.proc: subprocess.Popen | None = None

    def _cmd(self, *extra: str) -> list[str]:
        return [self.binary, "-p", str(self.workdir), "-c", str(self.conf), "-e", str(self.error_log),
                "-g", f"daemon off; pid {self.workdir / 'nginx.pid'};", *extra]

    def check(self) -> subprocess.CompletedProcess:
        """`nginx -t`: parse the config and open its files, without serving."""
        return subprocess.run(self._cmd("-t"), capture_output=True, text=True, timeout=30)

    def start(self, timeout: float = 60.0) -> "Nginx":
        self.proc = subprocess.Popen(self._cmd(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited with {self.proc.returncode}:\n{self.log()}")
            if owns_listener(self.proc.pid, self.port):
                return self
            time.sleep(0.05)
        raise RuntimeError(f"nginx did not listen on {HOST}:{self.port} within {timeout}s:\n{self.log()}")

    @property
    def target(self) -> str:
        return f"{HOST}:{self.port}"

    def log(self) -> str:
        return self.error_log.read_text(errors="replace") if self.error_log.exists() else ""

    def access_lines(self) -> list[str]:
        return self.access_log.read_text(errors="replace").splitlines() if self.access_log.exists() else []

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGQUIT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


# ---------------------------------------------------------------- Prometheus


def render_prometheus_config(shipped: str, metrics_targets: list[str], scrape_interval: str = "1s") -> str:
    """The shipped prometheus.yml with the lmserve job pointed at `metrics_targets`, scraping every
    `scrape_interval`; other jobs dropped (they name compose hosts), rule files kept."""
    cfg = yaml.safe_load(shipped)
    jobs = [j for j in cfg["scrape_configs"] if j["job_name"] == "lmserve"]
    if len(jobs) != 1:
        raise ValueError("the shipped config has no single `lmserve` scrape job")
    job = jobs[0]
    labels = {k: v for group in job.get("static_configs", []) for k, v in group.get("labels", {}).items()}
    job["static_configs"] = [{"targets": metrics_targets, **({"labels": labels} if labels else {})}]
    cfg["scrape_configs"] = [job]
    cfg["global"] = {**cfg.get("global", {}), "scrape_interval": scrape_interval,
                     "scrape_timeout": scrape_interval, "evaluation_interval": scrape_interval}
    return yaml.safe_dump(cfg, sort_keys=False)


class Prometheus:
    """A real Prometheus server: config and TSDB in `workdir`, web API on a loopback port."""

    def __init__(self, binary: str, config_text: str, workdir: Path, port: int):
        self.binary, self.workdir, self.port = binary, workdir, port
        self.config = workdir / "prometheus.yml"
        self.config.write_text(config_text)
        self.log_path = workdir / "prometheus.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self, timeout: float = 120.0) -> "Prometheus":
        cmd = [self.binary, f"--config.file={self.config}", f"--storage.tsdb.path={self.workdir / 'data'}",
               f"--web.listen-address={HOST}:{self.port}", "--storage.tsdb.retention.time=1h", "--log.level=warn"]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if owns_listener(self.proc.pid, self.port):
                    with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5) as r:
                        if r.status == 200:
                            return self
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"prometheus not ready within {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def api(self, path: str, **params) -> dict:
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:  # 400/422 carry a JSON error body
            return json.loads(e.read())

    def query(self, expr: str) -> dict:
        """Instant query; returns the API's JSON (status, data or error)."""
        return self.api("query", query=expr)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
