"""Connection settings shared by the sync and asyncio clients: TLS, auth, channel options."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from lmserve import __version__

AUTH_METADATA_KEY = "authorization"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Ping an idle connection every 60 s during calls so that long, quiet streams (a request
# waiting in the server's queue) survive NATs and load balancers; give up after 20 s.
KEEPALIVE_TIME_MS = 60_000
KEEPALIVE_TIMEOUT_MS = 20_000


@dataclass(frozen=True)
class Connection:
    """Where and how to connect.

    TLS is used when ``tls`` is true or any certificate file is given. Without
    ``ca_file`` the system's root certificates verify the server. ``client_cert`` and
    ``client_key`` (PEM files) enable mutual TLS and must be given together. ``token``
    is sent as ``authorization: Bearer <token>`` metadata on every call.
    """

    target: str = "localhost:50051"
    tls: bool = False
    ca_file: str | None = None
    client_cert: str | None = None
    client_key: str | None = None
    token: str | None = None

    def __post_init__(self) -> None:
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("client_cert and client_key must be given together")

    @property
    def uses_tls(self) -> bool:
        return self.tls or any(p is not None for p in (self.ca_file, self.client_cert))

    def credentials(self) -> grpc.ChannelCredentials | None:
        """TLS channel credentials, or None for a plaintext channel."""
        if not self.uses_tls:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file),
            private_key=_read(self.client_key),
            certificate_chain=_read(self.client_cert),
        )

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Per-call metadata: the bearer token, if any."""
        if not self.token:
            return ()
        return ((AUTH_METADATA_KEY, f"Bearer {self.token}"),)


def channel_options() -> list[tuple[str, object]]:
    """gRPC channel arguments for long-lived streaming calls."""
    return [
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.primary_user_agent", f"lmserve-python/{__version__}"),
    ]


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).expanduser().read_bytes()
