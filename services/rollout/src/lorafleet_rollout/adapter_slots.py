"""Which resident adapter lives in which slot of a model's LoRA stacks (`AdapterSlots`): every
stack holds every adapter's slot (slot 0 is the base model: no LoRA), so a decode step routes
each row through its own adapter whatever the mix. Adapters are laid out as whole slots off the
decoding thread (`lay_out`) and copied in on it (`install`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lorafleet.errors import InvalidArgument
from lorafleet_rollout.lora import AdapterWeights, ExpertStacks, LoraStacks, SlotWeights

#: The LoRA stacks of one projection or expert bank.
Stacks = LoraStacks | ExpertStacks


@dataclass(frozen=True)
class LaidOut:
    """An adapter ready to install (`AdapterSlots.lay_out`): its largest rank, and its weights
    per targeted stack."""

    rank: int
    stacks: dict[Stacks, SlotWeights]


class AdapterSlots:
    """The slots of the LoRA stacks `targets` names (PEFT target: module path, or
    "<experts module>.<bank>" -> its stacks, index within the fused projection). Stacks grow
    by doubling their slots; their rank is the largest resident adapter's."""

    def __init__(self, targets: dict[str, tuple[Stacks, int]]) -> None:
        self.targets = targets
        self._stacks = list(dict.fromkeys(stacks for stacks, _ in targets.values()))
        self.capacity = 1  # slots, slot 0 (the base model) included
        self.rank = 0
        self._slots: dict[str, int] = {}
        self._ranks: dict[str, int] = {}

    def check_targets(self, adapter: AdapterWeights) -> None:
        for module in adapter.modules:
            if module not in self.targets:
                raise InvalidArgument(
                    f"LoRA on {module} is not supported by the torch engine (only attention, "
                    "MLP, expert bank and lm_head projections)",
                    field="adapter_model.safetensors",
                )

    def slot(self, name: str | None) -> int:
        return 0 if name is None else self._slots[name]

    def __contains__(self, name: str | None) -> bool:
        return name is None or name in self._slots

    def lay_out(self, adapter: AdapterWeights) -> LaidOut:
        """The adapter's weights as whole slots of the stacks it targets, laid out at the
        rank the stacks will have once it is in. Reads only what is fixed after start-up
        (and the current rank, re-checked by `install`), so it runs off the decoding thread."""
        self.check_targets(adapter)
        parts: dict[Stacks, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for module, weights in adapter.modules.items():
            stacks, j = self.targets[module]
            parts.setdefault(stacks, {})[j] = weights
        rank = max(self.rank, adapter.rank)
        return LaidOut(adapter.rank, {s: s.lay_out(p, rank) for s, p in parts.items()})

    def install(self, name: str, adapter: LaidOut) -> None:
        """Put a laid-out adapter in a free slot: one copy per targeted stack, zeros only
        where the slot's previous tenant targeted a projection this one does not."""
        free = sorted(set(range(1, self.capacity + 1)) - set(self._slots.values()))
        slot = free[0]
        capacity = self.capacity if slot < self.capacity else max(4, 2 * self.capacity)
        self._reshape(capacity, max(self.rank, adapter.rank))
        for stacks in self._stacks:
            stacks.put(slot, adapter.stacks.get(stacks))
        self._slots[name] = slot
        self._ranks[name] = adapter.rank

    def remove(self, name: str) -> None:
        slot = self._slots.pop(name)
        del self._ranks[name]
        for stacks in self._stacks:
            stacks.release(slot)
        self._reshape(self.capacity, max(self._ranks.values(), default=0))

    def _reshape(self, capacity: int, rank: int) -> None:
        if (capacity, rank) == (self.capacity, self.rank):
            return
        self.capacity, self.rank = capacity, rank
        for stacks in self._stacks:
            stacks.resize(capacity, rank)
