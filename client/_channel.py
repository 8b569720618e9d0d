"""Connection settings shared by the sync and asyncio clients: TLS, auth, channel options."""

from __future__ import annotations

import ipaddress
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from lmserve import __version__

AUTH_METADATA_KEY = "authorization"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Ping an idle connection every 60 s during calls so that long, quiet streams (a request
# waiting in the server's queue) survive NATs and load balancers; give up after 20 s.
KEEPALIVE_TIME_MS = 60_000
KEEPALIVE_TIMEOUT_MS = 20_000


class PlaintextTokenWarning(UserWarning):
    """A bearer token is about to travel unencrypted to a host other than this machine."""


_warned_targets: set[str] = set()
_warned_lock = threading.Lock()


@dataclass(frozen=True)
class Connection:
    """Where and how to connect.

    TLS is used when ``tls`` is true or any certificate file is given. Without
    ``ca_file`` the system's root certificates verify the server. ``client_cert`` and
    ``client_key`` (PEM files) enable mutual TLS and must be given together. ``token``
    is sent as ``authorization: Bearer <token>`` metadata on every call; it never
    appears in the repr, and sending it without TLS to a host other than this machine
    raises a :class:`PlaintextTokenWarning` (once per target).
    """

    target: str = "localhost:50051"
    tls: bool = False
    ca_file: str | None = None
    client_cert: str | None = None
    client_key: str | None = None
    token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("client_cert and client_key must be given together")
        if self.token and not self.uses_tls and not is_loopback_target(self.target):
            with _warned_lock:
                first = self.target not in _warned_targets
                _warned_targets.add(self.target)
            if first:
                warnings.warn(f"the bearer token is sent without TLS to {self.target}: anyone on the path can read "
                              "it; use tls=True or ca_file", PlaintextTokenWarning, stacklevel=4)

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


def is_loopback_target(target: str) -> bool:
    """Whether a gRPC target names only this machine (localhost, 127.0.0.0/8, ::1 or a unix socket)."""
    t = target.strip()
    if t.startswith(("unix:", "unix-abstract:")):
        return True
    for prefix in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if t.startswith(prefix):
            t = t[len(prefix):]
            break
    hosts = []
    for address in t.split(","):  # ipv4:/ipv6: targets may list several addresses
        address = address.strip()
        if address.startswith("["):
            hosts.append(address[1:address.find("]")] if "]" in address else address[1:])
        elif address.count(":") == 1:
            hosts.append(address.rsplit(":", 1)[0])
        else:
            hosts.append(address)  # no port, or a bare IPv6 address
    return bool(hosts) and all(_is_loopback_host(h) for h in hosts)


def _is_loopback_host(host: str) -> bool:
    host = host.lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
