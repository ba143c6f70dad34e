"""The wire contract: generated code is fresh, and reflection answers what ghz/grpcurl ask."""

from __future__ import annotations

import asyncio
import filecmp
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from hsched import rpc
from hsched.v1 import gateway_pb2, gateway_pb2_grpc, placer_pb2, placer_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent


def test_every_service_implements_every_method_of_its_contract():
    """The generated base servicers answer UNIMPLEMENTED (protoc's `raise NotImplementedError`); each service
    overrides every method, so that code is never reached."""
    from services.gateway.server import GatewayServicer
    from services.placer.server import PlacerServicer
    from services.selector.server import SelectorServicer
    from services.thermal.server import ThermalServicer

    for servicer in (GatewayServicer, PlacerServicer, SelectorServicer, ThermalServicer):
        base = servicer.__bases__[0]
        service = sys.modules[base.__module__.replace("_pb2_grpc", "_pb2")].DESCRIPTOR.services_by_name[
            servicer.__name__.removesuffix("Servicer")]
        missing = [m.name for m in service.methods if getattr(servicer, m.name) is getattr(base, m.name)]
        assert not missing, f"{servicer.__name__} leaves {missing} to the generated UNIMPLEMENTED stub"


def test_generated_code_is_not_stale(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), str(tmp_path)], check=True,
                   capture_output=True)
    fresh = tmp_path / "hsched" / "v1"
    generated = sorted(p.name for p in fresh.iterdir())
    assert "gateway_pb2_grpc.py" in generated and len(generated) == 15  # 5 protos × (pb2, pyi, grpc)
    stale = [name for name in generated if not filecmp.cmp(fresh / name, ROOT / "src" / "hsched" / "v1" / name,
                                                           shallow=False)]
    assert not stale, f"regenerate with `python scripts/gen_protos.py`: {stale} differ from protos/"


@pytest.fixture
async def server():
    srv, port, _ = await rpc.start_server(
        lambda s: (gateway_pb2_grpc.add_GatewayServicer_to_server(gateway_pb2_grpc.GatewayServicer(), s),
                   placer_pb2_grpc.add_PlacerServicer_to_server(placer_pb2_grpc.PlacerServicer(), s)),
        ["hsched.v1.Gateway", "hsched.v1.Placer"])
    yield f"127.0.0.1:{port}"
    await srv.stop(0)


def _ask(target: str, method: str, request: reflection_pb2.ServerReflectionRequest):
    with grpc.insecure_channel(target) as ch:
        call = ch.stream_stream(method, request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        return next(iter(call(iter([request]), timeout=5)))


async def test_reflection_resolves_a_method_symbol_like_ghz_and_grpcurl(server):
    # ghz/grpcurl --call hsched.v1.Gateway/Submit ask for the file containing "hsched.v1.Gateway.Submit"
    def resolve():
        db = ProtoReflectionDescriptorDatabase(grpc.insecure_channel(server))
        services = db.get_services()
        method_file = db.FindFileContainingSymbol("hsched.v1.Gateway.Submit")
        return services, method_file

    services, method_file = await asyncio.to_thread(resolve)
    assert {"hsched.v1.Gateway", "hsched.v1.Placer", "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection"} <= set(services)
    assert method_file.name == "hsched/v1/gateway.proto"
    assert [m.name for m in method_file.service[0].method] == ["Submit", "Get", "List", "Watch", "Release", "SubmitJob", "GetJob",
                                                           "ListJobs", "CancelJob", "ListDatacenters",
                                                           "GetDatacenter", "DescribeTask", "SetNodesSchedulable"]


@pytest.mark.parametrize("method", ["/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"])
async def test_reflection_answers_on_v1_and_v1alpha(server, method):
    request = reflection_pb2.ServerReflectionRequest(file_containing_symbol="hsched.v1.Placer.Place")
    reply = await asyncio.to_thread(_ask, server, method, request)
    files = [descriptor_pb2.FileDescriptorProto.FromString(b) for b in reply.file_descriptor_response.file_descriptor_proto]
    assert {f.name for f in files} == {"hsched/v1/placer.proto", "hsched/v1/common.proto"}  # with its dependency
    missing = reflection_pb2.ServerReflectionRequest(file_containing_symbol="hsched.v1.Placer.NoSuchMethod")
    reply = await asyncio.to_thread(_ask, server, method, missing)
    assert reply.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


async def test_health_reports_each_service_serving(server):
    def check(name: str) -> int:
        with grpc.insecure_channel(server) as ch:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status

    for name in ("", "hsched.v1.Gateway", "hsched.v1.Placer"):
        assert await asyncio.to_thread(check, name) == health_pb2.HealthCheckResponse.SERVING
    assert gateway_pb2.DESCRIPTOR.package == placer_pb2.DESCRIPTOR.package == "hsched.v1"
