"""Integration fixtures: real `lmserve serve` processes on loopback ports (see _server.ServerProcess).

    start_session_server / start_module_server / start_server:
        factories (model, credentials=None, wait=True, **flags) -> ServerProcess, living as long as
        the test session / the test module / one test
    trained_server   one server of the small trained model shared by the whole session (TRAINED_SERVER_FLAGS);
                     tests that use it leave it idle (see ServerProcess.wait_idle)
    server, stub     that server checked idle at a module's start, and a gRPC stub on it for the module

Every server started through these factories is stopped (SIGTERM, then SIGKILL) at teardown.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import sentencepiece as spm
from _server import ServerProcess

from lmserve.v1 import lmserve_pb2_grpc as pb_grpc

# Servers stop fast in tests: a drain waits at most this long for in-flight calls.
TEST_GRACE_PERIOD = 5


class _Factory:
    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.servers: list[ServerProcess] = []

    def __call__(self, model, *, credentials=None, wait: bool = True, **flags) -> ServerProcess:
        flags.setdefault("grace_period", TEST_GRACE_PERIOD)
        srv = ServerProcess(model, credentials=credentials, log_dir=self.log_dir)
        self.servers.append(srv)
        srv.start(wait=wait, **flags)
        return srv

    def close(self) -> None:
        for srv in self.servers:
            srv.stop()


@pytest.fixture(scope="session")
def start_session_server(tmp_path_factory):
    """Factory for servers that live as long as the test session."""
    factory = _Factory(tmp_path_factory.mktemp("session-server-logs"))
    yield factory
    factory.close()


@pytest.fixture(scope="module")
def start_module_server(tmp_path_factory):
    """Factory for servers that live as long as the test module."""
    factory = _Factory(tmp_path_factory.mktemp("server-logs"))
    yield factory
    factory.close()


@pytest.fixture
def start_server(tmp_path):
    """Factory for servers that live as long as one test."""
    factory = _Factory(tmp_path)
    yield factory
    factory.close()


# The shared server's limits; context length is the fixture model's 128 tokens.
TRAINED_SERVER_FLAGS = dict(threads=1, max_batch=16, max_queue=512, max_new_tokens_cap=120,
                            max_receive_message_bytes=64 * 1024)


@pytest.fixture(scope="session")
def trained_server_flags() -> dict:
    return dict(TRAINED_SERVER_FLAGS)


@pytest.fixture(scope="session")
def trained_server(start_session_server, trained_model_dir) -> ServerProcess:
    """The trained model served with TRAINED_SERVER_FLAGS and /metrics, shared by every module that asks."""
    return start_session_server(trained_model_dir, **TRAINED_SERVER_FLAGS)


@pytest.fixture(scope="module")
def server(trained_server):
    """The shared trained-model server, checked idle at the start of a module."""
    trained_server.wait_idle()
    return trained_server


@pytest.fixture(scope="module")
def client(server):
    """An openai SDK client on the module's `server`'s HTTP API (a module may override it, as the Anthropic one does)."""
    import openai

    with openai.OpenAI(base_url=server.http_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model_id(client) -> str:
    """The id `client` finds first in /v1/models."""
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def stub(server):
    """A TextGeneration stub on the module's `server` (a module may override `server`)."""
    ch = server.channel()
    yield pb_grpc.TextGenerationStub(ch)
    ch.close()


@pytest.fixture(scope="module")
def sp(trained_model_dir):
    """The trained model's own sentencepiece model: an independent tokenizer oracle."""
    return spm.SentencePieceProcessor(model_file=str(trained_model_dir / "tokenizer.model"))


@pytest.fixture(scope="session")
def smollm2_http(start_session_server, smollm2_gguf_path):
    """SmolLM2 for the tool-calling and client-library tests, shared by their modules: up to 24 requests
    decode together (a set of schemas is sent at once)."""
    return start_session_server(smollm2_gguf_path, threads=2, max_batch=24, metrics_port=None)
