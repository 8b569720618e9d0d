"""lmserve client SDK: sync and asyncio clients for the lmserve gRPC service.

    from lmserve.client import Client

    with Client("localhost:50051") as client:
        for chunk in client.stream("Once upon a time", max_new_tokens=32):
            print(chunk.text, end="", flush=True)

This package never imports torch.
"""

from . import errors, types
from .aio import AsyncClient
from .errors import (
    CancelledError,
    DeadlineExceededError,
    InternalError,
    InvalidRequestError,
    LmserveError,
    OverloadedError,
    UnauthenticatedError,
    UnavailableError,
)
from ._channel import PlaintextTokenWarning
from ._retry import RetryPolicy
from .sync import Client
from .types import (
    ChatMessage,
    GenerationResult,
    ModelInfo,
    SamplingParams,
    StreamChunk,
    Timing,
    TokenizeResult,
    TokenLogprob,
    TopLogprob,
    Usage,
)

__all__ = [
    "Client",
    "AsyncClient",
    "RetryPolicy",
    "PlaintextTokenWarning",
    "errors",
    "types",
    "LmserveError",
    "InvalidRequestError",
    "OverloadedError",
    "UnavailableError",
    "DeadlineExceededError",
    "CancelledError",
    "UnauthenticatedError",
    "InternalError",
    "ChatMessage",
    "SamplingParams",
    "GenerationResult",
    "StreamChunk",
    "TokenizeResult",
    "ModelInfo",
    "Usage",
    "Timing",
    "TokenLogprob",
    "TopLogprob",
]
