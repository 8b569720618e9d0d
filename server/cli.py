"""`lmserve serve`: registered on the single `lmserve` command. Imports no torch until run."""

from __future__ import annotations

import argparse
import sys


def add_subcommands(subparsers) -> None:
    from .config import add_arguments

    p = subparsers.add_parser(
        "serve", help="serve a model over gRPC and an OpenAI-compatible HTTP API (default: SmolLM2-135M-Instruct, "
                      "pulled if missing)",
        description="Load a model and serve it: TextGeneration over gRPC (with grpc.health.v1 and reflection) "
                    "on --port, the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
                    "/v1/models) on --http-port, and Prometheus metrics on --metrics-port. Every flag can also "
                    "be set with the LMSERVE_* variable shown.")
    add_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .config import settings_from_args

    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        print(f"lmserve serve: {exc}", file=sys.stderr)
        return 2
    from .app import serve

    try:
        return serve(settings)
    except Exception as exc:  # noqa: BLE001 - startup failures print one clear line
        from lmserve.model.errors import ModelLoadError

        if isinstance(exc, (ModelLoadError, OSError, ValueError)):
            print(f"lmserve serve: {exc}", file=sys.stderr)
            return 1
        raise
