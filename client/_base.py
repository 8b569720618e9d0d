"""State and request preparation shared by :class:`Client` and :class:`AsyncClient`."""

from __future__ import annotations

from typing import Any

from grpc_health.v1 import health_pb2_grpc

from lmserve.v1 import lmserve_pb2 as pb
from lmserve.v1 import lmserve_pb2_grpc as pb_grpc

from ._channel import Connection, channel_options
from ._convert import build_generate_request, resolve_params
from ._retry import RetryPolicy
from .types import SamplingParams

# Sentinel: "use the client's default timeout" (None means "no timeout").
DEFAULT = object()


class ClientBase:
    """Holds connection settings, default timeout and retry policy; opens the channel; builds requests.

    Subclasses set ``_grpc`` to the ``grpc`` module (blocking) or ``grpc.aio``: that is the only
    difference in how the two clients connect.
    """

    _grpc: Any

    def __init__(
        self,
        target: str = "localhost:50051",
        *,
        tls: bool = False,
        ca_file: str | None = None,
        client_cert: str | None = None,
        client_key: str | None = None,
        token: str | None = None,
        timeout: float | None = None,
        max_retries: int = 3,
        retry_policy: RetryPolicy | None = None,
    ) -> None:
        self.connection = Connection(
            target=target, tls=tls, ca_file=ca_file, client_cert=client_cert, client_key=client_key, token=token
        )
        self.default_timeout = timeout
        self.retry_policy = retry_policy or RetryPolicy(max_retries=max_retries)
        self._metadata = self.connection.metadata()
        credentials = self.connection.credentials()
        if credentials is None:
            self._channel = self._grpc.insecure_channel(target, options=channel_options())
        else:
            self._channel = self._grpc.secure_channel(target, credentials, options=channel_options())
        self._stub = pb_grpc.TextGenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    @property
    def target(self) -> str:
        return self.connection.target

    def _timeout(self, timeout: Any) -> float | None:
        return self.default_timeout if timeout is DEFAULT else timeout

    @staticmethod
    def _generate_request(
        prompt: Any, params: SamplingParams | None, request_id: str, overrides: dict[str, Any],
        parse_special_tokens: bool = False,
    ) -> pb.GenerateRequest:
        return build_generate_request(prompt, resolve_params(params, overrides), request_id, parse_special_tokens)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(target={self.target!r}, tls={self.connection.uses_tls})"
