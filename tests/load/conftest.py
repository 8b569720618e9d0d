"""Load-test fixtures: real servers of the trained model on loopback (see integration/_server.py).

    busy_server    16 slots and a queue of 64: sustained closed-loop load, a stalled reader
    small_server   2 slots and a queue of 3: bursts beyond the admission bound

Both start together, once per session, and stop (SIGTERM, then SIGKILL) at its end. The trained model
fixtures come from tests/fixtures/trained_model.py through the top-level conftest.
"""

from __future__ import annotations

import pytest
from integration._server import ServerProcess

# Context length of the trained model is 128 tokens: a short prompt plus 120 new tokens fits.
# the stalled-reader test holds unread streams open on purpose: they must outlive it, not be timed out
COMMON_FLAGS = dict(threads=1, max_new_tokens_cap=120, grace_period=5, stream_idle_timeout=600)
SERVER_FLAGS = {
    "busy": dict(COMMON_FLAGS, max_batch=16, max_queue=64),
    "small": dict(COMMON_FLAGS, max_batch=2, max_queue=3),
}


@pytest.fixture(scope="session")
def load_servers(trained_model_dir, tmp_path_factory) -> dict[str, ServerProcess]:
    log_dir = tmp_path_factory.mktemp("load-server-logs")
    servers = {name: ServerProcess(trained_model_dir, log_dir=log_dir) for name in SERVER_FLAGS}
    try:
        for name, srv in servers.items():
            srv.start(wait=False, **SERVER_FLAGS[name])
        for srv in servers.values():
            srv.wait_ready()
        yield servers
    finally:
        for srv in servers.values():
            srv.stop()


@pytest.fixture(scope="session")
def server_flags() -> dict[str, dict]:
    return {name: dict(flags) for name, flags in SERVER_FLAGS.items()}


@pytest.fixture
def busy_server(load_servers) -> ServerProcess:
    srv = load_servers["busy"]
    srv.wait_idle()
    return srv


@pytest.fixture
def small_server(load_servers) -> ServerProcess:
    srv = load_servers["small"]
    srv.wait_idle()
    return srv
