"""Paths of the repository's deploy files, and the shared test modules loaded by path
(tests/ is not a package): the integration server harness and the trained-model plugin."""

from __future__ import annotations

import contextlib
import importlib.util
import signal
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "deploy"


def load_by_path(name: str, path: Path):
    """Import `path` as module `name`, reusing it when something already did."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


server_harness = load_by_path("_server", REPO_ROOT / "tests" / "integration" / "_server.py")
trained_model = load_by_path("lmserve_tests_trained_model", REPO_ROOT / "tests" / "fixtures" / "trained_model.py")


@contextlib.contextmanager
def replica_pair(model_dir, log_dir, **flags):
    """Two servers of one model started side by side; after, any still running gets SIGTERM (a
    graceful drain, as an orchestrator does), then both are stopped."""
    servers = [server_harness.ServerProcess(model_dir, log_dir=log_dir) for _ in range(2)]
    try:
        for srv in servers:
            srv.start(wait=False, **flags)
        for srv in servers:
            srv.wait_ready()
        yield servers
    finally:
        for srv in servers:
            if srv.running:
                srv.signal(signal.SIGTERM)
        for srv in servers:
            srv.stop()
