"""Internal gRPC under `lorafleet up` is mutual TLS with roles: strangers are refused,
services cannot call admin RPCs, a trainer cannot pose as another replica or act for a
tenant, and the run's keys and certificates are readable by their owner only."""

from __future__ import annotations

import json
import stat
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import trustme

from lorafleet.rpc.channel import make_blocking_channel
from lorafleet.settings import TlsSettings
from lorafleet.tls import TlsIdentity, identity_from_settings
from lorafleet.v1 import (
    controller_pb2,
    controller_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)

# One read-only call per internal service: (member, call on a channel), and the process
# whose certificate may make it.
CALLERS = {"controller": "gateway", "trainer-0": "controller", "rollout-0": "controller"}
CALLS: dict[str, Callable[[grpc.Channel], object]] = {
    "controller": lambda ch: controller_pb2_grpc.ControllerServiceStub(ch).GetCapabilities(
        controller_pb2.GetCapabilitiesRequest(), timeout=10
    ),
    "trainer-0": lambda ch: trainer_pb2_grpc.TrainerServiceStub(ch).GetTrainerInfo(
        trainer_pb2.GetTrainerInfoRequest(), timeout=10
    ),
    "rollout-0": lambda ch: rollout_pb2_grpc.RolloutServiceStub(ch).GetRolloutInfo(
        rollout_pb2.GetRolloutInfoRequest(), timeout=10
    ),
}
ADMIN_CALLS: dict[str, Callable[[controller_pb2_grpc.ControllerServiceStub], object]] = {
    "CreateApiKey": lambda stub: stub.CreateApiKey(
        controller_pb2.CreateApiKeyRequest(tenant="victim", label="stolen"), timeout=10
    ),
    "ListApiKeys": lambda stub: stub.ListApiKeys(
        controller_pb2.ListApiKeysRequest(tenant="local"), timeout=10
    ),
    "RevokeApiKey": lambda stub: stub.RevokeApiKey(
        controller_pb2.RevokeApiKeyRequest(key_id="any"), timeout=10
    ),
    "GetFleetStatus": lambda stub: stub.GetFleetStatus(
        controller_pb2.GetFleetStatusRequest(), timeout=10
    ),
    # A service that could declare a trainer failed could strand every run waiting on it.
    "ReportReplicaFailed": lambda stub: stub.ReportReplicaFailed(
        controller_pb2.ReportReplicaFailedRequest(replica_id="trainer-0", reason="forged"),
        timeout=10,
    ),
}


def _identity(fleet: object, name: str) -> TlsIdentity:
    files = fleet.certs[name]  # type: ignore[attr-defined]
    identity = identity_from_settings(TlsSettings(files.ca_file, files.cert_file, files.key_file))
    assert identity is not None
    return identity


def _address(fleet: object, member: str) -> str:
    return f"127.0.0.1:{fleet.member(member).port}"  # type: ignore[attr-defined]


@pytest.mark.parametrize("member", sorted(CALLS))
def test_callers_without_the_runs_certificate_are_refused(
    shared_fleet: object, member: str
) -> None:
    address = _address(shared_fleet, member)
    ca = _identity(shared_fleet, "gateway").ca
    stranger = trustme.CA().issue_cert("127.0.0.1", common_name="lorafleet-admin")
    foreign = TlsIdentity(
        ca=ca,
        cert=b"".join(c.bytes() for c in stranger.cert_chain_pems),
        key=stranger.private_key_pem.bytes(),
    )
    channels = {
        "plaintext": grpc.insecure_channel(address),
        "no client certificate": grpc.secure_channel(
            address, grpc.ssl_channel_credentials(root_certificates=ca)
        ),
        "certificate from another CA": make_blocking_channel(address, tls=foreign),
    }
    for how, channel in channels.items():
        with channel, pytest.raises(grpc.RpcError) as info:
            CALLS[member](channel)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, how

    with make_blocking_channel(address, tls=_identity(shared_fleet, CALLERS[member])) as channel:
        assert CALLS[member](channel) is not None


def test_service_certificates_cannot_call_admin_rpcs(shared_fleet: object) -> None:
    address = _address(shared_fleet, "controller")
    callers = {
        "gateway": "gateway",
        "trainer-0": "trainer/trainer-0",
        "rollout-0": "rollout/rollout-0",
        "controller": "controller",
    }
    for process, common_name in callers.items():
        with make_blocking_channel(address, tls=_identity(shared_fleet, process)) as ch:
            stub = controller_pb2_grpc.ControllerServiceStub(ch)
            for name, call in ADMIN_CALLS.items():
                with pytest.raises(grpc.RpcError) as info:
                    call(stub)
                assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, (process, name)
                assert f"{name} needs an operator certificate (caller: {common_name})" in str(
                    info.value.details()
                )
    with make_blocking_channel(address, tls=_identity(shared_fleet, "lorafleet-admin")) as ch:
        stub = controller_pb2_grpc.ControllerServiceStub(ch)
        listed = stub.ListApiKeys(controller_pb2.ListApiKeysRequest(tenant="victim"), timeout=10)
        assert list(listed.keys) == []  # nothing was minted by the refused calls
        status = stub.GetFleetStatus(controller_pb2.GetFleetStatusRequest(), timeout=10)
        assert status.replicas and not any(r.failed for r in status.replicas)  # not forged


def _replicas(fleet: object) -> dict[str, int]:
    with make_blocking_channel(
        _address(fleet, "controller"), tls=_identity(fleet, "lorafleet-admin")
    ) as ch:
        status = controller_pb2_grpc.ControllerServiceStub(ch).GetFleetStatus(
            controller_pb2.GetFleetStatusRequest(), timeout=10
        )
    return {r.replica_id: r.kind for r in status.replicas}


def _sessions(fleet: object, tenant: str) -> list[str]:
    with make_blocking_channel(
        _address(fleet, "controller"), tls=_identity(fleet, "lorafleet-admin")
    ) as ch:
        listed = controller_pb2_grpc.ControllerServiceStub(ch).ListSessions(
            controller_pb2.ListSessionsRequest(tenant=tenant), timeout=10
        )
    return sorted(listed.session_ids)


def test_a_trainer_cannot_pose_as_another_replica_or_act_for_a_tenant(shared_fleet: object) -> None:
    """A trainer's certificate registers trainer-0 and nothing else (not a rollout, not
    another trainer), and no tenant RPC admits it; a gateway's registers nothing. Every refusal
    is PERMISSION_DENIED naming why, and leaves the replica table and sessions as they were."""
    tenant = shared_fleet.config.tenant  # type: ignore[attr-defined]
    replicas, sessions = _replicas(shared_fleet), _sessions(shared_fleet, tenant)
    register = controller_pb2.RegisterReplicaRequest
    trainer, rollout = controller_pb2.REPLICA_KIND_TRAINER, controller_pb2.REPLICA_KIND_ROLLOUT
    fake = {"address": "127.0.0.1:1", "base_model": "fake", "num_slots": 1}
    refused = {
        ("trainer-0", "register a rollout"): (
            lambda s: s.RegisterReplica(
                register(kind=rollout, replica_id="rollout-9", **fake), timeout=10
            ),
            "a trainer certificate cannot register a replica of kind REPLICA_KIND_ROLLOUT",
        ),
        ("trainer-0", "register another trainer"): (
            lambda s: s.RegisterReplica(
                register(kind=trainer, replica_id="trainer-9", **fake), timeout=10
            ),
            "replica_id 'trainer-9' is not this certificate's ('trainer-0')",
        ),
        ("trainer-0", "open a tenant's session"): (
            lambda s: s.CreateSession(
                controller_pb2.CreateSessionRequest(tenant=tenant), timeout=10
            ),
            "CreateSession needs a gateway or operator certificate (caller: trainer/trainer-0)",
        ),
        ("trainer-0", "read a tenant's sessions"): (
            lambda s: s.ListSessions(controller_pb2.ListSessionsRequest(tenant=tenant), timeout=10),
            "ListSessions needs a gateway or operator certificate",
        ),
        ("rollout-0", "register a trainer"): (
            lambda s: s.RegisterReplica(
                register(kind=trainer, replica_id="rollout-0", **fake), timeout=10
            ),
            "a rollout certificate cannot register a replica of kind REPLICA_KIND_TRAINER",
        ),
        ("gateway", "register a fake trainer"): (
            lambda s: s.RegisterReplica(
                register(kind=trainer, replica_id="trainer-9", **fake), timeout=10
            ),
            "RegisterReplica needs a rollout or trainer certificate (caller: gateway)",
        ),
    }
    address = _address(shared_fleet, "controller")
    for (process, what), (call, why) in refused.items():
        with (
            make_blocking_channel(address, tls=_identity(shared_fleet, process)) as ch,
            pytest.raises(grpc.RpcError) as info,
        ):
            call(controller_pb2_grpc.ControllerServiceStub(ch))
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, (process, what)
        assert why in str(info.value.details()), (process, what)
    assert _replicas(shared_fleet) == replicas
    assert _sessions(shared_fleet, tenant) == sessions


def test_keys_and_certificates_are_owner_only(shared_fleet: object) -> None:
    run_dir: Path = shared_fleet.config.run_dir  # type: ignore[attr-defined]
    mode = lambda path: stat.S_IMODE(path.stat().st_mode)  # noqa: E731
    assert mode(run_dir) == 0o700
    assert mode(run_dir / "tls") == 0o700
    keys = sorted((run_dir / "tls").glob("*.key"))
    assert [k.stem for k in keys] == [
        "controller",
        "gateway",
        "lorafleet-admin",
        "rollout-0",
        "trainer-0",
    ]
    assert {mode(k) for k in keys} == {0o600}
    state_file = run_dir / "fleet.json"
    assert mode(state_file) == 0o600
    assert json.loads(state_file.read_text())["api_key"] == shared_fleet.api_key  # type: ignore[attr-defined]
