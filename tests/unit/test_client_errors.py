"""gRPC status -> SDK error mapping, through real calls to a loopback servicer."""

import grpc
import pytest
from _client_fakes import Failure, LoopbackServer, Script, unused_port

from lmserve.client import AsyncClient, Client, errors

# The mapping the SDK documents, written out independently of client/errors.py.
EXPECTED = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidRequestError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.OverloadedError,
    grpc.StatusCode.UNAVAILABLE: errors.UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceededError,
    grpc.StatusCode.CANCELLED: errors.CancelledError,
    grpc.StatusCode.UNAUTHENTICATED: errors.UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: errors.UnauthenticatedError,
    grpc.StatusCode.INTERNAL: errors.InternalError,
    grpc.StatusCode.UNKNOWN: errors.InternalError,
    grpc.StatusCode.FAILED_PRECONDITION: errors.InternalError,
    grpc.StatusCode.UNIMPLEMENTED: errors.InternalError,
}

VIOLATIONS = [("params.temperature", "must be >= 0"), ("prompt", "must not be empty")]


@pytest.mark.parametrize("code", list(EXPECTED))
def test_each_status_code_maps_to_its_error_class(code):
    with LoopbackServer(Script(fail_first=[Failure(code, f"boom {code.name}")])) as srv:
        with Client(srv.target, max_retries=0) as client:
            with pytest.raises(errors.LmserveError) as info:
                client.model_info()
    err = info.value
    assert type(err) is EXPECTED[code]
    assert err.code == code
    assert err.message == f"boom {code.name}"
    assert isinstance(err.__cause__, grpc.RpcError)


def test_bad_request_field_violations_are_recovered_sync():
    failure = Failure(grpc.StatusCode.INVALID_ARGUMENT, "invalid request", violations=VIOLATIONS)
    with LoopbackServer(Script(fail_first=[failure])) as srv, Client(srv.target) as client:
        with pytest.raises(errors.InvalidRequestError) as info:
            client.generate("", temperature=-1.0)
    assert info.value.field_violations == VIOLATIONS
    assert "params.temperature: must be >= 0" in str(info.value)


async def test_bad_request_field_violations_are_recovered_async_stream():
    failure = Failure(grpc.StatusCode.INVALID_ARGUMENT, "invalid request", violations=VIOLATIONS)
    with LoopbackServer(Script(fail_first=[failure])) as srv:
        async with AsyncClient(srv.target) as client:
            with pytest.raises(errors.InvalidRequestError) as info:
                async for _ in client.stream("x"):
                    pass
    assert info.value.field_violations == VIOLATIONS


def test_retry_info_is_recovered():
    failure = Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", retry_seconds=0.25)
    with LoopbackServer(Script(fail_first=[failure])) as srv, Client(srv.target, max_retries=0) as client:
        with pytest.raises(errors.OverloadedError) as info:
            client.generate("x")
    assert info.value.retry_delay == pytest.approx(0.25)
    assert info.value.field_violations == []


def test_unreachable_server_is_unavailable():
    with unused_port() as port, Client(f"127.0.0.1:{port}", max_retries=0, timeout=10) as client:
        with pytest.raises(errors.UnavailableError):
            client.generate("x")


def test_client_deadline_maps_to_deadline_exceeded():
    with LoopbackServer(Script(stream_forever=True)) as srv, Client(srv.target) as client:
        with pytest.raises(errors.DeadlineExceededError):
            for _ in client.stream("x", timeout=0.2):
                pass


def test_malformed_status_details_do_not_hide_the_error():
    class Broken(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.INTERNAL

        def details(self):
            return "oops"

        def trailing_metadata(self):
            return (("grpc-status-details-bin", b"\xff\xff not a status"),)

    err = errors.error_from_rpc(Broken())
    assert type(err) is errors.InternalError and err.message == "oops" and err.field_violations == []
