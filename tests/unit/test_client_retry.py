"""Retry policy: backoff bounds, and retrying only before the first streamed chunk."""

import random

import grpc
import pytest
from _client_fakes import Failure, LoopbackServer, Script

from lmserve.client import AsyncClient, Client, RetryPolicy, errors

FAST = RetryPolicy(max_retries=3, initial_backoff=0.001, max_backoff=0.01)
UNAVAILABLE = Failure(grpc.StatusCode.UNAVAILABLE, "draining")
OVERLOADED = Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")


def test_backoff_stays_within_the_exponential_cap():
    policy = RetryPolicy(initial_backoff=0.1, max_backoff=2.0, multiplier=3.0)
    rng = random.Random(0)
    for attempt in range(1, 12):
        cap = min(2.0, 0.1 * 3.0 ** (attempt - 1))
        samples = [policy.backoff(attempt, rng) for _ in range(200)]
        assert all(0.0 <= s <= cap for s in samples)
        assert max(samples) > 0.5 * cap  # full jitter actually spreads over the range


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _err(code, retry_delay=None):
    return errors.LmserveError("x", code=code, retry_delay=retry_delay)


def test_retry_state_decisions():
    clock = FakeClock()
    state = RetryPolicy(max_retries=2).start(None, clock=clock, rng=random.Random(0))
    state.attempt_timeout()
    assert state.after_failure(_err(grpc.StatusCode.UNAVAILABLE), received=False) >= 0
    with pytest.raises(errors.LmserveError):  # tokens already received: never replay
        state.after_failure(_err(grpc.StatusCode.UNAVAILABLE), received=True)
    with pytest.raises(errors.LmserveError):  # not a retryable code
        state.after_failure(_err(grpc.StatusCode.INVALID_ARGUMENT), received=False)
    state.attempt_timeout()
    state.after_failure(_err(grpc.StatusCode.RESOURCE_EXHAUSTED), received=False)
    state.attempt_timeout()  # third attempt = second retry, the last one allowed
    with pytest.raises(errors.LmserveError):
        state.after_failure(_err(grpc.StatusCode.UNAVAILABLE), received=False)


def test_retry_state_respects_server_delay_and_overall_timeout():
    clock = FakeClock()
    state = RetryPolicy(max_retries=5, initial_backoff=0.01).start(10.0, clock=clock, rng=random.Random(0))
    assert state.attempt_timeout() == pytest.approx(10.0)
    assert state.after_failure(_err(grpc.StatusCode.UNAVAILABLE, retry_delay=3.0), received=False) >= 3.0
    clock.now += 4.0
    assert state.attempt_timeout() == pytest.approx(6.0)  # remaining budget, not a fresh 10 s
    with pytest.raises(errors.LmserveError):  # a 7 s server delay would overrun the 6 s left
        state.after_failure(_err(grpc.StatusCode.UNAVAILABLE, retry_delay=7.0), received=False)
    clock.now += 7.0
    with pytest.raises(errors.DeadlineExceededError):
        state.attempt_timeout()


@pytest.mark.parametrize("method", ["generate", "stream", "tokenize", "model_info"])
def test_sync_retries_transient_failures_before_any_chunk(method):
    with LoopbackServer(Script(fail_first=[UNAVAILABLE, OVERLOADED])) as srv:
        with Client(srv.target, retry_policy=FAST) as client:
            call = {
                "generate": lambda: client.generate("x").text,
                "stream": lambda: "".join(c.text for c in client.stream("x")),
                "tokenize": lambda: client.tokenize("Hello world").text,
                "model_info": lambda: client.model_info().model_name,
            }[method]
            result = call()
        assert sum(srv.servicer.attempts.values()) == 3
    assert result == ("fake" if method == "model_info" else "Hello world")


async def test_async_retries_transient_failures_before_any_chunk():
    with LoopbackServer(Script(fail_first=[UNAVAILABLE, OVERLOADED])) as srv:
        async with AsyncClient(srv.target, retry_policy=FAST) as client:
            chunks = [c async for c in client.stream("x")]
        assert srv.servicer.attempts["GenerateStream"] == 3
    assert "".join(c.text for c in chunks) == "Hello world"
    assert chunks[-1].finish_reason == "stop"


def test_gives_up_after_max_retries():
    with LoopbackServer(Script(fail_first=[OVERLOADED] * 10)) as srv:
        with Client(srv.target, retry_policy=RetryPolicy(max_retries=2, initial_backoff=0.001)) as client:
            with pytest.raises(errors.OverloadedError):
                client.generate("x")
        assert srv.servicer.attempts["Generate"] == 3


def test_invalid_argument_is_never_retried():
    failure = Failure(grpc.StatusCode.INVALID_ARGUMENT, "bad")
    with LoopbackServer(Script(fail_first=[failure] * 3)) as srv, Client(srv.target, retry_policy=FAST) as client:
        with pytest.raises(errors.InvalidRequestError):
            client.generate("x")
        assert srv.servicer.attempts["Generate"] == 1


def test_sync_stream_failing_after_tokens_is_not_retried():
    script = Script(abort_after_chunks=UNAVAILABLE)
    with LoopbackServer(script) as srv, Client(srv.target, retry_policy=FAST) as client:
        received = []
        with pytest.raises(errors.UnavailableError):
            for chunk in client.stream("x"):
                received.append(chunk.text)
        assert srv.servicer.attempts["GenerateStream"] == 1
    assert received == script.stream_words  # every chunk before the failure was delivered, once


async def test_async_stream_failing_after_tokens_is_not_retried():
    script = Script(abort_after_chunks=OVERLOADED)
    with LoopbackServer(script) as srv:
        async with AsyncClient(srv.target, retry_policy=FAST) as client:
            received = []
            with pytest.raises(errors.OverloadedError):
                async for chunk in client.stream("x"):
                    received.append(chunk.text)
        assert srv.servicer.attempts["GenerateStream"] == 1
    assert received == script.stream_words


def test_server_cancel_is_retried_but_a_local_cancel_is_not():
    from lmserve.client._retry import is_retryable
    from lmserve.client.errors import CancelledError

    assert is_retryable(CancelledError("CANCELLED", code=grpc.StatusCode.CANCELLED))  # replica stopping
    assert not is_retryable(CancelledError("Locally cancelled by application!", code=grpc.StatusCode.CANCELLED))
