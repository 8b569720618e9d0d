"""The inference engine: scheduler, model runner, sampler, output processing and the engine thread.

Imports no grpc. The gRPC edge (server/service.py and friends) talks to it through `Engine`'s
submit / generate / cancel / stats API and the names re-exported here. They are imported on first
use, so that `lmserve.server.engine.settings` (plain dataclasses) can be read without torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Engine": "engine", "EngineHealth": "engine", "EngineStats": "engine", "EngineUnavailableError": "engine",
    "GenerationChunk": "outputs", "GenerationResult": "outputs",
    "FinishReason": "request", "Request": "request", "RequestValidationError": "errors", "SamplingParams": "request",
    "QueueFullError": "scheduler", "EngineSettings": "settings",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
