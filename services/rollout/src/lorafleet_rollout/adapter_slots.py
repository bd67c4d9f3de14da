"""Which resident adapter lives in which slot of a model's LoRA stacks (`AdapterSlots`): every
stack holds every adapter's slot (slot number 0 is the base model: no LoRA), so a decode step
routes each row through its own adapter whatever the mix. Slots are grouped by rank class
(`lora.rank_class`), each class at its own rank, so an adapter costs its own rank whatever
else is resident. Adapters are laid out as whole slots off the decoding thread (`lay_out`)
and copied in on it (`install`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lorafleet.errors import InvalidArgument
from lorafleet_rollout.lora import (
    AdapterWeights,
    ExpertStacks,
    LoraStacks,
    SlotWeights,
    rank_class,
    slot_number,
    slot_place,
)

#: The LoRA stacks of one projection or expert bank.
Stacks = LoraStacks | ExpertStacks


@dataclass(frozen=True)
class LaidOut:
    """An adapter ready to install (`AdapterSlots.lay_out`): its rank class, and its weights
    per targeted stack."""

    rank: int
    stacks: dict[Stacks, SlotWeights]


class AdapterSlots:
    """The slots of the LoRA stacks `targets` names (PEFT target: module path, or
    "<experts module>.<bank>" -> its stacks, index within the fused projection).

    A rank class's stacks are sized to what it holds, within an eighth: a full class grows by
    an eighth, and a removal that leaves more than an eighth free compacts it (the adapters
    past the end move into the holes, then the stacks shrink). Why: the cache evicts whatever
    is least recently used, so each class's count drifts, and stacks that only grew held
    twice the resident adapters' own bytes after a Zipf run (bench/many_adapters.py); the
    cache's eviction prefers a victim of the incoming adapter's class (`rank_class`), so
    resizes stay rare. A resize copies the class's stacks once; a move is one copy per
    stack. Moves change slot numbers, so `layout` counts them: a decode batch's route is
    rebuilt when it changes."""

    def __init__(self, targets: dict[str, tuple[Stacks, int]]) -> None:
        self.targets = targets
        self._stacks = list(dict.fromkeys(stacks for stacks, _ in targets.values()))
        self.capacity: dict[int, int] = {}  # rank class -> its slots
        self._slots: dict[str, int] = {}  # adapter -> slot number
        self.layout = 0  # bumped whenever a resident adapter's slot number changes

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
        """The adapter's weights as whole slots of the stacks it targets, at its rank class.
        Reads only what is fixed after start-up, so it runs off the decoding thread."""
        self.check_targets(adapter)
        parts: dict[Stacks, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for module, weights in adapter.modules.items():
            stacks, j = self.targets[module]
            parts.setdefault(stacks, {})[j] = weights
        rank = rank_class(adapter.rank)
        return LaidOut(rank, {s: s.lay_out(p, rank) for s, p in parts.items()})

    def install(self, name: str, adapter: LaidOut) -> None:
        """Put a laid-out adapter in a free slot of its class: one copy per targeted stack,
        zeros only where the slot's previous tenant targeted a projection this one does not."""
        rank, capacity = adapter.rank, self.capacity.get(adapter.rank, 0)
        taken = {i for r, i in map(slot_place, self._slots.values()) if r == rank}
        index = min(set(range(capacity + 1)) - taken)
        if index == capacity:
            self._resize(rank, capacity + _slack(capacity))
        slot = slot_number(rank, index)
        for stacks in self._stacks:
            stacks.put(slot, adapter.stacks.get(stacks))
        self._slots[name] = slot

    def stack_bytes(self) -> int:
        """Memory of every stack's A and B, all classes: what the resident adapters cost."""
        return sum(t.nbytes for s in self._stacks for t in (*s.a.values(), *s.b.values()))

    def remove(self, name: str) -> None:
        slot = self._slots.pop(name)
        for stacks in self._stacks:
            stacks.release(slot)
        rank = slot_place(slot)[0]
        held = sorted(
            (slot_place(s)[1], other)
            for other, s in self._slots.items()
            if slot_place(s)[0] == rank
        )
        if not held or self.capacity[rank] - len(held) > _slack(self.capacity[rank]):
            self._compact(rank, held)

    def _compact(self, rank: int, held: list[tuple[int, str]]) -> None:
        """Move class `rank`'s adapters `held` ((index, name), by index) past the end of
        their count into its holes, then shrink it to that count (0: its stacks go)."""
        size = len(held)
        holes = iter(sorted(set(range(size)) - {index for index, _ in held}))
        for index, name in held:
            if index < size:
                continue
            old, new = self._slots[name], slot_number(rank, next(holes))
            for stacks in self._stacks:
                stacks.put(new, stacks.weights(old))
                stacks.release(old)
            self._slots[name] = new
            self.layout += 1
        self._resize(rank, size)

    def _resize(self, rank: int, capacity: int) -> None:
        if capacity:
            self.capacity[rank] = capacity
        else:
            del self.capacity[rank]
        for stacks in self._stacks:
            stacks.resize(rank, capacity)


def _slack(capacity: int) -> int:
    """Free slots a rank class of `capacity` may keep: an eighth, at least one."""
    return max(1, capacity // 8)
