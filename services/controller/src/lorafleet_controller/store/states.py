"""Operation and registration states, defined once from the proto enums, for Python and Lua.

Operation states are stored as the numbers of `lorafleet.v1.OperationState`. Registration
states are stored as lowercase names: those of `lorafleet.v1.RegistrationState` plus
BINDING, a placement the trainer has not confirmed yet (reported as QUEUED), and PAGING, a
page-out in progress (reported as READY: it still holds its slot; see paging.py). `lua_prelude()`
emits both as Lua constants (`OP.QUEUED`, `REG.READY`, ...) so the scripts never restate them.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import IntEnum, StrEnum

from lorafleet.v1 import controller_pb2

_OP_PREFIX = "OPERATION_STATE_"
_REG_PREFIX = "REGISTRATION_STATE_"


class OpState(IntEnum):
    """`lorafleet.v1.OperationState` without UNSPECIFIED, by the proto's own numbers."""

    QUEUED = controller_pb2.OPERATION_STATE_QUEUED
    CLAIMED = controller_pb2.OPERATION_STATE_CLAIMED
    SUCCEEDED = controller_pb2.OPERATION_STATE_SUCCEEDED
    FAILED = controller_pb2.OPERATION_STATE_FAILED
    CANCELLED = controller_pb2.OPERATION_STATE_CANCELLED
    EXPIRED = controller_pb2.OPERATION_STATE_EXPIRED

    @property
    def label(self) -> str:
        return self.name.lower()


TERMINAL = frozenset({OpState.SUCCEEDED, OpState.FAILED, OpState.CANCELLED, OpState.EXPIRED})
OPEN = frozenset({OpState.QUEUED, OpState.CLAIMED})


class RegState(StrEnum):
    """A registration's stored state; `proto` is what the API reports."""

    QUEUED = "queued"
    BINDING = "binding"
    READY = "ready"
    UNAVAILABLE = "unavailable"
    RETIRED = "retired"
    PAGING = "paging"
    PAGED = "paged"

    @property
    def proto(self) -> controller_pb2.RegistrationState.ValueType:
        name = {RegState.BINDING: "QUEUED", RegState.PAGING: "READY"}.get(self, self.name)
        return controller_pb2.RegistrationState.Value(_REG_PREFIX + name)


def _names(items: Iterable[tuple[str, int]], prefix: str) -> set[str]:
    return {name.removeprefix(prefix) for name, number in items if number}


# A proto state added without a stored counterpart fails at import, not in production.
assert _names(controller_pb2.OperationState.items(), _OP_PREFIX) == {s.name for s in OpState}
assert _names(controller_pb2.RegistrationState.items(), _REG_PREFIX) <= {s.name for s in RegState}

# Kinds the scheduler batches per trainer (the `ready_data` queue); every other kind is control.
DATA_KINDS = (controller_pb2.OPERATION_KIND_FORWARD, controller_pb2.OPERATION_KIND_FORWARD_BACKWARD)


def lua_prelude() -> str:
    ops = ", ".join(f"{s.name} = {s.value}" for s in OpState)
    regs = ", ".join(f"{s.name} = '{s.value}'" for s in RegState)
    data = ", ".join(f"['{k}'] = true" for k in DATA_KINDS)
    sample = controller_pb2.OPERATION_KIND_SAMPLE
    return (
        f"local OP = {{ {ops} }}\nlocal REG = {{ {regs} }}\n"
        f"local DATA_KINDS = {{ {data} }}\nlocal SAMPLE_KIND = {sample}\n"
    )
