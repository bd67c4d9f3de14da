"""The slot table: which registration each fixed slot holds, with its weights and state.

A free slot holds nothing: no weights, no gradients, no optimizer state. Binding creates
seeded weights and an empty optimizer; unbinding drops them all.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from torch import nn

from lorafleet.errors import FailedPrecondition, InvalidArgument
from lorafleet_trainer.bptt import Carried
from lorafleet_trainer.domain import LoraSpec, SlotInfo
from lorafleet_trainer.optim import SlotOptimizer

# Stands in for the result of an operation known (from a loaded state) to have been applied
# whose result this process never saw.
RESULT_UNKNOWN: Any = object()


class OpLog:
    """Bounded LRU of applied operation ids and their first results."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._results: OrderedDict[str, Any] = OrderedDict()

    def __contains__(self, op_id: str) -> bool:
        return op_id in self._results

    def get(self, op_id: str) -> Any:
        self._results.move_to_end(op_id)
        return self._results[op_id]

    def record(self, op_id: str, result: Any) -> None:
        self._results[op_id] = result
        self._results.move_to_end(op_id)
        while len(self._results) > self.capacity:
            self._results.popitem(last=False)

    def ids(self) -> list[str]:
        return list(self._results)

    def restore(self, ids: list[str]) -> None:
        for op_id in ids:
            if op_id not in self._results:
                self.record(op_id, RESULT_UNKNOWN)


@dataclass
class Binding:
    """What a bound slot holds."""

    registration_id: str
    spec: LoraSpec
    targets: tuple[str, ...]
    a: dict[str, nn.Parameter]  # by module name
    b: dict[str, nn.Parameter]
    optimizer: SlotOptimizer
    ops: OpLog
    pending_datums: int = 0  # backward datums since the last optim_step (dropout ordinal)
    tokens_trained: int = 0
    carried: Carried | None = None  # the last truncated-BPTT window's keys/values (bptt.py)


class SlotTable:
    def __init__(self, num_slots: int) -> None:
        self.bindings: list[Binding | None] = [None] * num_slots

    def __len__(self) -> int:
        return len(self.bindings)

    def check_index(self, slot: int, field_name: str = "slot") -> None:
        if not 0 <= slot < len(self.bindings):
            raise InvalidArgument(
                f"slot {slot} is outside [0, {len(self.bindings)})", field=field_name
            )

    def leased(self, slot: int, registration_id: str, field_prefix: str = "") -> Binding:
        """The binding of `slot`, which must be bound to `registration_id` (the lease)."""
        self.check_index(slot, field_prefix + "slot")
        b = self.bindings[slot]
        if b is None:
            raise FailedPrecondition(
                f"slot {slot} is not bound", field=field_prefix + "slot", reason="SLOT_UNBOUND"
            )
        if b.registration_id != registration_id:
            raise FailedPrecondition(
                f"slot {slot} is bound to another registration",
                field=field_prefix + "registration_id",
                reason="LEASE_MISMATCH",
            )
        return b

    def info(self, slot: int) -> SlotInfo:
        b = self.bindings[slot]
        if b is None:
            return SlotInfo(slot, "", None, 0, False, 0)
        return SlotInfo(
            slot,
            b.registration_id,
            b.spec,
            b.optimizer.steps,
            b.optimizer.has_gradients(),
            b.tokens_trained,
        )
