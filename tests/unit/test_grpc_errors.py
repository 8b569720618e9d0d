"""The error-mapping edge when the caller's deadline has already passed.

gRPC ends such a call with DEADLINE_EXCEEDED on its own; a status the edge sends at the same time
races that inside grpc core and, when it loses, core logs the failed send as a server error with
a traceback (seen once in a full CI run). The race cannot be forced through a real server, so
this test drives the decorator with a context that reports the deadline as passed and records
what the edge tries to send.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from lmserve.server.grpc_errors import EdgeError, map_errors


class RecordingContext:
    def __init__(self, remaining: float | None):
        self.remaining = remaining
        self.sent: list[grpc.Status] = []

    def time_remaining(self):
        return self.remaining

    async def abort_with_status(self, status):
        self.sent.append(status)
        raise RuntimeError("aborted")  # stands for grpc's AbortError: the handler stops here


class Handlers:
    @map_errors
    async def unary(self, request, context):
        raise EdgeError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed before it finished")

    @map_errors
    async def stream(self, request, context):
        raise EdgeError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed before it finished")
        yield


async def run(kind: str, context) -> None:
    if kind == "unary":
        await Handlers().unary(None, context)
    else:
        async for _ in Handlers().stream(None, context):
            pass


@pytest.mark.parametrize("kind", ["unary", "stream"])
async def test_after_the_deadline_no_status_is_sent_and_the_call_counts_as_cancelled(kind):
    context = RecordingContext(remaining=0.0)
    with pytest.raises(asyncio.CancelledError):
        await run(kind, context)
    assert context.sent == []


@pytest.mark.parametrize("kind", ["unary", "stream"])
@pytest.mark.parametrize("remaining", [None, 0.5])
async def test_before_the_deadline_the_mapped_status_is_sent(kind, remaining):
    context = RecordingContext(remaining=remaining)
    with pytest.raises(RuntimeError, match="aborted"):
        await run(kind, context)
    assert [s.code for s in context.sent] == [grpc.StatusCode.DEADLINE_EXCEEDED]
    assert context.sent[0].details == "the request's deadline passed before it finished"
