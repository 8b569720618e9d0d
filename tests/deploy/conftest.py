"""Deployment test fixtures: the trained test model, lmserve servers (tests/integration/_server.py),
and the system programs (nginx, prometheus) that deploy/ci/install-test-deps.sh installs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from _repo import server_harness, trained_model

INSTALL_HINT = "run deploy/ci/install-test-deps.sh (apt-get installs nginx and prometheus)"

trained_model_dir = trained_model.trained_model_dir  # re-exported fixture (session scope)


def system_program(name: str, *fallbacks: str) -> str:
    """Absolute path of a system program; fails (never skips) with the install hint when absent."""
    found = shutil.which(name) or next((p for p in fallbacks if Path(p).is_file()), None)
    if not found:
        pytest.fail(f"{name} is not installed: {INSTALL_HINT}", pytrace=False)
    return found


@pytest.fixture(scope="session")
def nginx_bin() -> str:
    return system_program("nginx", "/usr/sbin/nginx")


@pytest.fixture(scope="session")
def prometheus_bin() -> str:
    return system_program("prometheus", "/usr/bin/prometheus")


@pytest.fixture(scope="session")
def promtool_bin() -> str:
    return system_program("promtool", "/usr/bin/promtool")


@pytest.fixture
def start_server(tmp_path):
    """Factory: start(model, **flags) -> a SERVING ServerProcess, stopped at teardown (SIGTERM, then SIGKILL)."""
    servers = []

    def start(model, **flags):
        flags.setdefault("grace_period", 5)
        srv = server_harness.ServerProcess(model, log_dir=tmp_path)
        servers.append(srv)
        srv.start(**flags)
        return srv

    yield start
    for srv in servers:
        srv.stop()
