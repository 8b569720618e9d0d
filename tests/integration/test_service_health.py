"""grpc.health.v1 for both service names across start-up, and server reflection.

Health during a drain and the Watch RPC are tested in test_drain.py, each on a server of its own.
"""

from __future__ import annotations

import grpc
import pytest
from _server import UNREACHABLE
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from lmserve.v1 import lmserve_pb2 as pb

SERVICE = "lmserve.v1.TextGeneration"


@pytest.fixture(scope="module")
def channel(trained_server):
    ch = trained_server.channel()
    yield ch
    ch.close()


def test_start_up_goes_from_not_serving_to_serving(trained_server):
    """Polled from the moment the process was spawned: unreachable or NOT_SERVING, then SERVING."""
    *before, last = trained_server.health_history
    assert last == "SERVING"
    assert before and set(before) <= {UNREACHABLE, "NOT_SERVING"}, trained_server.health_history


@pytest.mark.parametrize("service", ["", SERVICE])
def test_both_service_names_are_serving(channel, service):
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_unknown_service_is_not_found(channel):
    with pytest.raises(grpc.RpcError) as info:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="no.Such"), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_describes_the_service(channel):
    db = ProtoReflectionDescriptorDatabase(channel)
    services = set(db.get_services())
    assert {SERVICE, "grpc.health.v1.Health"} <= services
    pool = DescriptorPool(db)
    served = pool.FindServiceByName(SERVICE)
    local = pb.DESCRIPTOR.services_by_name["TextGeneration"]
    assert {m.name for m in served.methods} == {m.name for m in local.methods}
    for m in local.methods:
        remote = served.methods_by_name[m.name]
        assert (remote.input_type.full_name, remote.output_type.full_name) == (m.input_type.full_name,
                                                                               m.output_type.full_name)
        assert remote.server_streaming == m.server_streaming
    request = pool.FindMessageTypeByName("lmserve.v1.GenerateRequest")
    assert {f.name for f in request.fields} == {f.name for f in pb.GenerateRequest.DESCRIPTOR.fields}
