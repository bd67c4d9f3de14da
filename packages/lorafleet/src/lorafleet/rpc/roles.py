"""Which certificate may call which RPC: the one table every server enforces.

A fleet certificate carries its holder's role in its common name: `<role>` (any replica of
that role: the chart's one certificate per kind) or `<role>/<name>` (one replica:
`lorafleet up` gives `trainer/trainer-0` its own). Operators are the common names in
LORAFLEET_TLS_ADMIN_NAMES (`lorafleet-admin`). A common name that is neither is no role and
may call nothing but health checks and reflection.

Why roles and not just "a fleet certificate": every process holds one, so without roles a
compromised gateway could mint itself API keys or register a fake trainer, and a compromised
trainer could act for any tenant. The rules:

- operator: everything on the controller except registering a replica (keys, fleet status,
  usage, page-outs, and every tenant RPC, to debug a tenant's run), and the read-only info of
  trainers and rollouts;
- gateway: the tenant RPCs (it resolves API keys, so it acts for tenants), never admin ones;
- trainer / rollout: RegisterReplica, as their own kind only, and as their own replica when
  the certificate names one;
- controller: the trainers' and rollouts' RPCs (it alone drives them).

`RULES` names every RPC of every lorafleet service one by one (a test checks the generated
descriptors against it) and the interceptor refuses a method that has no entry, so a new RPC
cannot ship callable by everyone, nor inherit a default nobody chose.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf.message import Message

from lorafleet.v1 import controller_pb2


class Role(enum.StrEnum):
    OPERATOR = "operator"
    GATEWAY = "gateway"
    CONTROLLER = "controller"
    TRAINER = "trainer"
    ROLLOUT = "rollout"


# Roles a common name can name itself as; operators are named by LORAFLEET_TLS_ADMIN_NAMES.
SERVICE_ROLES = frozenset(Role) - {Role.OPERATOR}
NAME_SEP = "/"


def common_name(role: Role, name: str = "") -> str:
    """The common name of a certificate for `role`, bound to replica `name` when given."""
    return f"{role}{NAME_SEP}{name}" if name else str(role)


@dataclass(frozen=True)
class Peer:
    """The verified caller: its certificate's common name, the role that name gives (None:
    no role) and the one replica it is bound to ("" = any replica of its role)."""

    common_name: str
    role: Role | None
    name: str = ""

    def __str__(self) -> str:
        return self.common_name or "no client certificate"


def peer_from_names(common_names: list[str], admin_names: tuple[str, ...]) -> Peer:
    """The role of a verified certificate's common name (gRPC reports one)."""
    if not common_names:
        return Peer("", None)
    common_name = common_names[0]
    if common_name in admin_names:
        return Peer(common_name, Role.OPERATOR)
    role, _, name = common_name.partition(NAME_SEP)
    if role in SERVICE_ROLES:
        return Peer(common_name, Role(role), name)
    return Peer(common_name, None)


# A check of the request itself, run before the handler: why the peer may not make this
# call (None: it may).
RequestCheck = Callable[[Message, Peer], str | None]


@dataclass(frozen=True)
class Rule:
    """Who may call: `roles`, or every verified certificate with `any_peer`; then `check`."""

    roles: frozenset[Role] = frozenset()
    check: RequestCheck | None = None
    any_peer: bool = False


REPLICA_ROLES = {
    controller_pb2.REPLICA_KIND_TRAINER: Role.TRAINER,
    controller_pb2.REPLICA_KIND_ROLLOUT: Role.ROLLOUT,
}


def _registers_itself(request: Message, peer: Peer) -> str | None:
    """A trainer certificate registers a trainer, a rollout's a rollout, and a certificate
    bound to one replica registers that replica only."""
    assert isinstance(request, controller_pb2.RegisterReplicaRequest)
    kind = controller_pb2.ReplicaKind.Name(request.kind)
    if REPLICA_ROLES.get(request.kind) != peer.role:
        return f"a {peer.role} certificate cannot register a replica of kind {kind}"
    if peer.name and request.replica_id != peer.name:
        return f"replica_id {request.replica_id!r} is not this certificate's ({peer.name!r})"
    return None


OPERATOR = frozenset({Role.OPERATOR})
TENANT = frozenset({Role.GATEWAY, Role.OPERATOR})
DRIVER = frozenset({Role.CONTROLLER})
INSPECT = frozenset({Role.CONTROLLER, Role.OPERATOR})


def _service(name: str, **rules: Rule) -> dict[str, Rule]:
    """`/<service>/<method>` -> rule, each method named: a method left out has no entry."""
    return {f"/{name}/{method}": rule for method, rule in rules.items()}


_tenant, _operator, _driver, _inspect = Rule(TENANT), Rule(OPERATOR), Rule(DRIVER), Rule(INSPECT)
_anyone = Rule(any_peer=True)

# One entry per method, written out: a new RPC gets none until someone decides who may call it.
RULES: dict[str, Rule] = {
    **_service(
        "lorafleet.v1.ControllerService",
        Authenticate=_tenant,
        CreateApiKey=_operator,
        ListApiKeys=_operator,
        RevokeApiKey=_operator,
        CreateSession=_tenant,
        SessionHeartbeat=_tenant,
        FinishSession=_tenant,
        GetSession=_tenant,
        ListSessions=_tenant,
        CreateRegistration=_tenant,
        GetRegistration=_tenant,
        ListRegistrations=_tenant,
        DeleteRegistration=_tenant,
        SubmitOperation=_tenant,
        GetOperation=_tenant,
        AckOperation=_tenant,
        CreateSampler=_tenant,
        GetSampler=_tenant,
        SubmitSample=_tenant,
        ListCheckpoints=_tenant,
        GetCheckpoint=_tenant,
        DeleteCheckpoint=_tenant,
        UpdateCheckpoint=_tenant,
        DownloadCheckpoint=_tenant,
        ImportPeftAdapter=_tenant,
        GetUsage=_operator,
        PageOutRegistration=_operator,
        GetCapabilities=_tenant,
        RegisterReplica=Rule(frozenset({Role.TRAINER, Role.ROLLOUT}), _registers_itself),
        GetFleetStatus=_operator,
        ReportReplicaFailed=_operator,
    ),
    **_service(
        "lorafleet.v1.JobService",
        CreateJob=_tenant,
        GetJob=_tenant,
        ListJobs=_tenant,
        CancelJob=_tenant,
        ResetDefaultRun=_tenant,
    ),
    **_service(
        "lorafleet.v1.TrainerService",
        GetTrainerInfo=_inspect,
        ListSlots=_inspect,
        BindSlot=_driver,
        UnbindSlot=_driver,
        ForwardBackward=_driver,
        OptimStep=_driver,
        SaveState=_driver,
        LoadState=_driver,
        ExportAdapter=_driver,
        WriteSharedAdapter=_driver,
        ImportAdapter=_driver,
        ExportTokenizer=_driver,
        PruneSnapshots=_driver,
    ),
    **_service(
        "lorafleet.v1.RolloutService",
        GetRolloutInfo=_inspect,
        LoadAdapter=_driver,
        UnloadAdapter=_driver,
        ListAdapters=_inspect,
        Sample=_driver,
    ),
    # Every server's health and reflection: whether it serves and what it serves.
    **_service("grpc.health.v1.Health", Check=_anyone, Watch=_anyone, List=_anyone),
    **_service("grpc.reflection.v1alpha.ServerReflection", ServerReflectionInfo=_anyone),
}


def refusal(method: str, peer: Peer, request: Message | None = None) -> str | None:
    """Why `peer` may not call `method` (with `request`, for rules that check it), or None."""
    rule = RULES.get(method)
    short = method.rsplit("/", 1)[-1]
    if rule is None:
        return f"{short} has no role entry in lorafleet.rpc.roles: nobody may call it"
    if not rule.any_peer and peer.role not in rule.roles:
        wanted = " or ".join(sorted(rule.roles))
        article = "an" if wanted[0] in "aeiou" else "a"
        return f"{short} needs {article} {wanted} certificate (caller: {peer})"
    if rule.check is not None and request is not None:
        why = rule.check(request, peer)
        if why is not None:
            return f"{short}: {why} (caller: {peer})"
    return None
