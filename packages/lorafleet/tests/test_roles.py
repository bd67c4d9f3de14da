"""Each RPC only for the roles it admits (`lorafleet.rpc.roles`), through the shared server.

The server here registers every method of every lorafleet service with a handler that only
records that it ran (the real servicers' rules are the table's, not theirs), so the grid
below proves which certificates reach which handler, and that a refused call never does.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import trustme
from google.protobuf import message_factory
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

import lorafleet.v1
from lorafleet.rpc import roles
from lorafleet.rpc.channel import make_channel
from lorafleet.rpc.server import RunningServer, ServiceSpec, start_server
from lorafleet.settings import ServerSettings
from lorafleet.tls import TlsIdentity
from lorafleet.v1 import controller_pb2

SERVICE_MODULES = [
    importlib.import_module(f"lorafleet.v1.{m.name}")
    for m in pkgutil.iter_modules(lorafleet.v1.__path__)
    if m.name.endswith("_pb2")
]
SERVICES = [s for mod in SERVICE_MODULES for s in mod.DESCRIPTOR.services_by_name.values()]
UNLISTED = "/lorafleet.v1.ControllerService/NotInTheTable"


def _identity(ca: trustme.CA, common_name: str) -> TlsIdentity:
    cert = ca.issue_cert("127.0.0.1", "localhost", common_name=common_name)
    return TlsIdentity(
        ca=ca.cert_pem.bytes(),
        cert=b"".join(c.bytes() for c in cert.cert_chain_pems),
        key=cert.private_key_pem.bytes(),
    )


def test_every_rpc_of_every_lorafleet_service_has_a_role_entry() -> None:
    """A new RPC without an entry fails here (and is refused at run time, below)."""
    methods = {f"/{s.full_name}/{m.name}" for s in SERVICES for m in s.methods}
    assert {s.full_name for s in SERVICES} >= {
        "lorafleet.v1.ControllerService",
        "lorafleet.v1.JobService",
        "lorafleet.v1.TrainerService",
        "lorafleet.v1.RolloutService",
    }
    assert methods - set(roles.RULES) == set()
    served = [
        *SERVICES,
        health_pb2.DESCRIPTOR.services_by_name["Health"],
        reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"],
    ]
    every = {f"/{s.full_name}/{m.name}" for s in served for m in s.methods}
    assert set(roles.RULES) == every  # and no entry for a method that no longer exists
    # Admin RPCs are the operator's alone; nothing admits every role by accident.
    for name in ("CreateApiKey", "ListApiKeys", "RevokeApiKey", "GetFleetStatus", "GetUsage"):
        assert roles.RULES[f"/lorafleet.v1.ControllerService/{name}"].roles == {roles.Role.OPERATOR}
    assert all(
        not rule.any_peer for method, rule in roles.RULES.items() if method.startswith("/lorafleet")
    )


def _add_everything(calls: list[str]) -> Any:
    """An add_fn registering every lorafleet method with a handler that records its call."""

    def add(servicer: object, server: grpc.aio.Server) -> None:
        handlers = []
        for service in SERVICES:
            table = {}
            for m in service.methods:
                path = f"/{service.full_name}/{m.name}"
                request = message_factory.GetMessageClass(m.input_type)
                response = message_factory.GetMessageClass(m.output_type)
                table[m.name] = _handler(path, m, request, response, calls)
            handlers.append(grpc.method_handlers_generic_handler(service.full_name, table))
        unlisted = grpc.unary_unary_rpc_method_handler(
            _recorder(UNLISTED, controller_pb2.GetCapabilitiesResponse, calls),
            controller_pb2.GetCapabilitiesRequest.FromString,
            controller_pb2.GetCapabilitiesResponse.SerializeToString,
        )
        handlers.append(
            grpc.method_handlers_generic_handler(
                "lorafleet.v1.ControllerService", {"NotInTheTable": unlisted}
            )
        )
        server.add_generic_rpc_handlers(tuple(handlers))

    return add


def _recorder(path: str, response: type[Message], calls: list[str]) -> Any:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Message:
        calls.append(path)
        return response()

    return unary


def _handler(
    path: str, method: Any, request: type[Message], response: type[Message], calls: list[str]
) -> grpc.RpcMethodHandler:
    codec = {
        "request_deserializer": request.FromString,
        "response_serializer": response.SerializeToString,
    }
    if method.client_streaming:

        async def drain(requests: AsyncIterator[Message], context: Any) -> Message:
            calls.append(path)
            async for _ in requests:
                pass
            return response()

        return grpc.stream_unary_rpc_method_handler(drain, **codec)
    if method.server_streaming:

        async def stream(req: Message, context: Any) -> AsyncIterator[Message]:
            calls.append(path)
            yield response()

        return grpc.unary_stream_rpc_method_handler(stream, **codec)
    return grpc.unary_unary_rpc_method_handler(_recorder(path, response, calls), **codec)


@pytest.fixture
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def calls() -> list[str]:
    return []


@pytest.fixture
async def server(ca: trustme.CA, calls: list[str]) -> AsyncIterator[RunningServer]:
    spec = ServiceSpec(None, _add_everything(calls), "lorafleet.v1.ControllerService")
    running = await start_server(ServerSettings(port=0), [spec], tls=_identity(ca, "controller"))
    try:
        yield running
    finally:
        await running.stop()


def _register(kind: int, replica_id: str) -> controller_pb2.RegisterReplicaRequest:
    return controller_pb2.RegisterReplicaRequest(kind=kind, replica_id=replica_id)


TRAINER = controller_pb2.REPLICA_KIND_TRAINER
ROLLOUT = controller_pb2.REPLICA_KIND_ROLLOUT
C = "/lorafleet.v1.ControllerService/"
# (certificate common name, method, request or None for the method's empty one, refusal
# text or None when the call goes through).
GRID = [
    ("gateway", C + "CreateSession", None, None),
    ("gateway", "/lorafleet.v1.JobService/CreateJob", None, None),
    ("gateway", C + "DownloadCheckpoint", None, None),
    ("gateway", C + "CreateApiKey", None, "CreateApiKey needs an operator certificate"),
    ("gateway", C + "ReportReplicaFailed", None, "needs an operator certificate"),
    ("gateway", C + "RegisterReplica", _register(TRAINER, "fake"), "needs a rollout or trainer"),
    ("gateway", "/lorafleet.v1.TrainerService/ForwardBackward", None, "needs a controller"),
    ("lorafleet-admin", C + "CreateApiKey", None, None),
    ("lorafleet-admin", C + "GetOperation", None, None),
    ("lorafleet-admin", C + "RegisterReplica", _register(TRAINER, "t"), "rollout or trainer"),
    ("lorafleet-admin", "/lorafleet.v1.TrainerService/GetTrainerInfo", None, None),
    ("lorafleet-admin", "/lorafleet.v1.TrainerService/ImportAdapter", None, "needs a controller"),
    ("trainer/trainer-0", C + "RegisterReplica", _register(TRAINER, "trainer-0"), None),
    (
        "trainer/trainer-0",
        C + "RegisterReplica",
        _register(ROLLOUT, "trainer-0"),
        "a trainer certificate cannot register a replica of kind REPLICA_KIND_ROLLOUT",
    ),
    (
        "trainer/trainer-0",
        C + "RegisterReplica",
        _register(TRAINER, "trainer-1"),
        "replica_id 'trainer-1' is not this certificate's ('trainer-0')",
    ),
    ("trainer", C + "RegisterReplica", _register(TRAINER, "any-trainer"), None),
    ("trainer", C + "RegisterReplica", _register(ROLLOUT, "r"), "cannot register a replica"),
    ("trainer/trainer-0", C + "CreateSession", None, "needs a gateway or operator certificate"),
    ("trainer/trainer-0", "/lorafleet.v1.JobService/ListJobs", None, "gateway or operator"),
    ("trainer", C + "GetFleetStatus", None, "needs an operator certificate"),
    ("rollout/rollout-0", C + "RegisterReplica", _register(ROLLOUT, "rollout-0"), None),
    ("rollout/rollout-0", C + "RegisterReplica", _register(TRAINER, "rollout-0"), "TRAINER"),
    ("rollout", "/lorafleet.v1.RolloutService/Sample", None, "needs a controller"),
    ("controller", "/lorafleet.v1.TrainerService/ForwardBackward", None, None),
    ("controller", "/lorafleet.v1.TrainerService/ImportAdapter", None, None),
    ("controller", "/lorafleet.v1.TrainerService/ExportAdapter", None, None),
    ("controller", "/lorafleet.v1.RolloutService/LoadAdapter", None, None),
    ("controller", C + "CreateApiKey", None, "needs an operator certificate"),
    ("controller", C + "CreateSession", None, "gateway or operator"),
    ("intruder", C + "GetCapabilities", None, "(caller: intruder)"),
    ("lorafleet-admin", UNLISTED, None, "NotInTheTable has no role entry"),
]


def _method(path: str) -> Any:
    service, name = path.strip("/").split("/")
    return next(s for s in SERVICES if s.full_name == service).methods_by_name[name]


async def _call(channel: grpc.aio.Channel, path: str, request: Message | None) -> None:
    if path == UNLISTED:
        method: Any = None
        request_type: type[Message] = controller_pb2.GetCapabilitiesRequest
        response_type: type[Message] = controller_pb2.GetCapabilitiesResponse
    else:
        method = _method(path)
        request_type = message_factory.GetMessageClass(method.input_type)
        response_type = message_factory.GetMessageClass(method.output_type)
    request = request if request is not None else request_type()
    codec = {
        "request_serializer": request_type.SerializeToString,
        "response_deserializer": response_type.FromString,
    }
    if method is not None and method.client_streaming:
        await channel.stream_unary(path, **codec)(iter([request]), timeout=10)
    elif method is not None and method.server_streaming:
        async for _ in channel.unary_stream(path, **codec)(request, timeout=10):
            pass
    else:
        await channel.unary_unary(path, **codec)(request, timeout=10)


@pytest.mark.parametrize(("common_name", "path", "request_", "refused"), GRID)
async def test_each_rpc_admits_only_its_roles(
    server: RunningServer,
    ca: trustme.CA,
    calls: list[str],
    common_name: str,
    path: str,
    request_: Message | None,
    refused: str | None,
) -> None:
    identity = _identity(ca, common_name)
    async with make_channel(f"127.0.0.1:{server.port}", tls=identity) as channel:
        if refused is None:
            await _call(channel, path, request_)
            assert calls == [path]
            return
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _call(channel, path, request_)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert refused in str(info.value.details())
    assert calls == []  # the handler never ran: nothing changed


async def test_any_fleet_certificate_checks_health(server: RunningServer, ca: trustme.CA) -> None:
    """Health (and reflection) answer every certificate of the fleet, even one of no role."""
    async with make_channel(f"127.0.0.1:{server.port}", tls=_identity(ca, "intruder")) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        async for update in stub.Watch(health_pb2.HealthCheckRequest(), timeout=10):
            assert update.status == health_pb2.HealthCheckResponse.SERVING
            break


def test_common_names_give_roles() -> None:
    admins = ("lorafleet-admin",)
    assert roles.peer_from_names(["lorafleet-admin"], admins) == roles.Peer(
        "lorafleet-admin", roles.Role.OPERATOR
    )
    assert roles.peer_from_names(["trainer/trainer-3"], admins) == roles.Peer(
        "trainer/trainer-3", roles.Role.TRAINER, "trainer-3"
    )
    assert roles.peer_from_names(["gateway"], admins).role == roles.Role.GATEWAY
    # An operator's name is configured, never claimed: "operator" names no role.
    assert roles.peer_from_names(["operator"], admins).role is None
    assert roles.peer_from_names([], admins).role is None
