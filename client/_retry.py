"""Retry policy shared by the sync and asyncio clients.

Only UNAVAILABLE and RESOURCE_EXHAUSTED are retried (plus CANCELLED sent by a server that is
shutting down, never a cancel of our own), with exponential backoff and full jitter, and only
while nothing was received: once a stream delivered a chunk, a failure
is raised to the caller (replaying would duplicate tokens). A call's timeout bounds all
its attempts together, backoff sleeps included.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import grpc

from .errors import DeadlineExceededError, LmserveError

RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})
LOCAL_CANCEL_DETAILS = "Locally cancelled"  # grpc's text when this process cancelled the call


def is_retryable(error: LmserveError) -> bool:
    """UNAVAILABLE, RESOURCE_EXHAUSTED, or CANCELLED by the server (a replica stopping mid-handshake)."""
    if error.code in RETRYABLE_CODES:
        return True
    return error.code == grpc.StatusCode.CANCELLED and LOCAL_CANCEL_DETAILS not in (error.message or "")


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter.

    Attempt n (1-based) that fails waits uniformly in
    ``[0, min(max_backoff, initial_backoff * multiplier ** (n - 1))]``, but at least the
    server's RetryInfo delay when one was sent.
    """

    max_retries: int = 3
    initial_backoff: float = 0.1
    max_backoff: float = 5.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.initial_backoff < 0 or self.max_backoff < 0 or self.multiplier < 1:
            raise ValueError("backoffs must be >= 0 and multiplier >= 1")

    def backoff(self, attempt: int, rng: random.Random) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        cap = min(self.max_backoff, self.initial_backoff * self.multiplier ** (attempt - 1))
        return rng.uniform(0.0, cap)

    def start(self, timeout: float | None, *, clock=time.monotonic, rng: random.Random | None = None) -> "RetryState":
        """Begins one logical call bounded by ``timeout`` seconds (None: unbounded)."""
        return RetryState(self, timeout, clock, rng or random.Random())


class RetryState:
    """Bookkeeping for one logical call across its attempts."""

    def __init__(self, policy: RetryPolicy, timeout: float | None, clock, rng: random.Random) -> None:
        self._policy = policy
        self._clock = clock
        self._rng = rng
        self._deadline = None if timeout is None else clock() + timeout
        self.attempt = 0

    def attempt_timeout(self) -> float | None:
        """Starts the next attempt; returns its gRPC timeout (the time left), or None."""
        self.attempt += 1
        if self._deadline is None:
            return None
        left = self._deadline - self._clock()
        if left <= 0:
            raise DeadlineExceededError("deadline expired before the call could be retried",
                                        code=grpc.StatusCode.DEADLINE_EXCEEDED)
        return left

    def after_failure(self, error: LmserveError, *, received: bool) -> float:
        """Returns the delay before the next attempt, or raises ``error`` when it must not be retried.

        ``received`` says whether the failed attempt delivered any response message.
        """
        if received or not is_retryable(error) or self.attempt > self._policy.max_retries:
            raise error
        delay = self._policy.backoff(self.attempt, self._rng)
        if error.retry_delay is not None:
            delay = max(delay, error.retry_delay)
        if self._deadline is not None and self._clock() + delay >= self._deadline:
            raise error  # waiting would overrun the caller's timeout
        return delay
