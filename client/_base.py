"""State and request preparation shared by :class:`Client` and :class:`AsyncClient`."""

from __future__ import annotations

from typing import Any

from lmserve.v1 import lmserve_pb2 as pb

from ._channel import Connection
from ._convert import build_generate_request, resolve_params
from ._retry import RetryPolicy
from .types import SamplingParams

# Sentinel: "use the client's default timeout" (None means "no timeout").
DEFAULT = object()


class ClientBase:
    """Holds connection settings, default timeout and retry policy; builds requests."""

    def __init__(
        self,
        target: str,
        *,
        tls: bool,
        ca_file: str | None,
        client_cert: str | None,
        client_key: str | None,
        token: str | None,
        timeout: float | None,
        max_retries: int,
        retry_policy: RetryPolicy | None,
    ) -> None:
        self.connection = Connection(
            target=target, tls=tls, ca_file=ca_file, client_cert=client_cert, client_key=client_key, token=token
        )
        self.default_timeout = timeout
        self.retry_policy = retry_policy or RetryPolicy(max_retries=max_retries)
        self._metadata = self.connection.metadata()

    @property
    def target(self) -> str:
        return self.connection.target

    def _timeout(self, timeout: Any) -> float | None:
        return self.default_timeout if timeout is DEFAULT else timeout

    @staticmethod
    def _generate_request(
        prompt: Any, params: SamplingParams | None, request_id: str, overrides: dict[str, Any]
    ) -> pb.GenerateRequest:
        return build_generate_request(prompt, resolve_params(params, overrides), request_id)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(target={self.target!r}, tls={self.connection.uses_tls})"
