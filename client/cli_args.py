"""Command-line plumbing shared by the client subcommands (`lmserve generate`, `lmserve bench`, ...)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

DEFAULT_TARGET = "localhost:50051"
TARGET_ENV = "LMSERVE_TARGET"
TOKEN_ENV = "LMSERVE_TOKEN"
TOKEN_FILE_ENV = "LMSERVE_TOKEN_FILE"


class CliUsageError(Exception):
    """A bad command-line value found after parsing (exit code 2)."""


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    """--target/--tls/--ca-file/--client-cert/--client-key/--token/--timeout."""
    group = parser.add_argument_group("connection")
    group.add_argument("-t", "--target", default=os.environ.get(TARGET_ENV, DEFAULT_TARGET),
                       help=f"server address host:port (default: ${TARGET_ENV} or {DEFAULT_TARGET})")
    group.add_argument("--tls", action="store_true", help="use TLS, verified with the system roots or --ca-file")
    group.add_argument("--ca-file", help="PEM file of root certificates that sign the server's certificate")
    group.add_argument("--client-cert", help="PEM client certificate chain for mutual TLS")
    group.add_argument("--client-key", help="PEM client private key for mutual TLS")
    group.add_argument("--token", default=os.environ.get(TOKEN_ENV),
                       help=f"bearer token sent as 'authorization' metadata (default: ${TOKEN_ENV}); "
                            "--token-file keeps it out of the process list")
    group.add_argument("--token-file", default=os.environ.get(TOKEN_FILE_ENV),
                       help=f"file whose first non-blank line is the bearer token (default: ${TOKEN_FILE_ENV})")
    group.add_argument("--timeout", type=float, default=None, help="seconds allowed per call (default: none)")


def read_token_file(path: str) -> str:
    """The first non-blank line of a token file (CliUsageError if there is none or it cannot be read)."""
    try:
        lines = Path(path).expanduser().read_text().splitlines()
    except OSError as e:
        raise CliUsageError(f"cannot read the token file: {e}") from e
    token = next((line.strip() for line in lines if line.strip()), None)
    if token is None:
        raise CliUsageError(f"the token file {path} holds no token")
    return token


def client_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Client constructor keywords from the connection flags."""
    token = args.token
    token_file = getattr(args, "token_file", None)
    if token_file:
        if token and token != os.environ.get(TOKEN_ENV):
            raise CliUsageError("give --token or --token-file, not both")
        token = read_token_file(token_file)
    return dict(tls=args.tls, ca_file=args.ca_file, client_cert=args.client_cert,
                client_key=args.client_key, token=token, timeout=args.timeout)
