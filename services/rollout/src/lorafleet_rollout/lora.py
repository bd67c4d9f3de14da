"""Grouped multi-adapter LoRA for generation: each row of one forward pass through its own adapter.

Why not PEFT's `adapter_names=[...]`: in every LoRA layer it loops over the adapters present
(Python index lists, a sub-batch gather, two Linear calls and an index_put per adapter); with
16 rows over 8 adapters on the 20 M bench model the whole engine ran ~1.5x slower through it
than through this (bench/sampling.py, before/after in one session). Here every targeted
base Linear is wrapped once by `StackedLoraLinear`, holding all resident adapters' weights as
two stacks, A^T [slots, in, R] and (scale * B)^T [slots, R, out], R the largest resident
rank (smaller ranks are zero-padded: the padding adds exact zeros). A `Route`, built once
per batch composition (not per token), cuts the LoRA rows into equal chunks of one adapter
each; a forward is then one gather of the rows, two `bmm`s over the chunks and one
`index_add_` back, whatever the number of adapters. The chunk-stacked weights are cached per
route, so steady decode steps gather no weights at all.

The result is PEFT's `base(x) + lora_B(lora_A(x)) * scaling` (same per-module rank, alpha
and rsLoRA rules, `adapter_weights`), up to float rounding; tests hold it to 1e-4 in logprob.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from peft import LoraConfig
from peft.utils.other import get_pattern_key
from torch import nn

from lorafleet.errors import InvalidArgument
from lorafleet_rollout.peft_io import WEIGHTS_FILE
from lorafleet_rollout.types import BASE_ADAPTER

_PREFIX = "base_model.model."


@dataclass(frozen=True)
class AdapterWeights:
    """One adapter ready to install: module path -> (A^T [in, r], (scale * B)^T [r, out])."""

    rank: int
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]


def adapter_weights(config: LoraConfig, tensors: dict[str, torch.Tensor]) -> AdapterWeights:
    """Pair the PEFT tensors per module and fold in PEFT's scaling; raise before any change.

    Expects tensors already checked by `peft_io.check_fits` (names, shapes, finiteness).
    """
    if getattr(config, "alora_invocation_tokens", None):
        raise InvalidArgument("activated LoRA (aLoRA) adapters are not supported", field="config")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        stem = key.removeprefix(_PREFIX)
        module, _, kind = stem.removesuffix(".weight").rpartition(".")
        pairs.setdefault(module, {})[kind] = tensor
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"lora_A", "lora_B"}:
            raise InvalidArgument(
                f"{module} has {sorted(pair)} but needs both lora_A and lora_B", field=WEIGHTS_FILE
            )
        a, b = pair["lora_A"], pair["lora_B"]
        rank = config.rank_pattern.get(get_pattern_key(config.rank_pattern, module), config.r)
        alpha = config.alpha_pattern.get(
            get_pattern_key(config.alpha_pattern, module), config.lora_alpha
        )
        if a.shape[0] != rank or b.shape[1] != rank:
            raise InvalidArgument(
                f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not have "
                f"the configured rank {rank}",
                field=WEIGHTS_FILE,
            )
        scale = alpha / math.sqrt(rank) if config.use_rslora else alpha / rank
        modules[module] = (
            a.to(torch.float32).t().contiguous(),
            (b.to(torch.float32) * scale).t().contiguous(),
        )
    return AdapterWeights(max(a.shape[1] for a, _ in modules.values()), modules)


@dataclass(frozen=True, eq=False)
class Route:
    """Which rows of a batch go through which adapter slot, as equal chunks of `width` rows.

    `rows` [chunks * width] indexes the batch; `slots` [chunks] names each chunk's slot; `keep`
    [chunks * width, 1, 1] zeroes the padding entries of short chunks (None when there are
    none). Padding entries repeat a real row, so adding their (zero) output changes nothing.
    """

    slots: torch.Tensor
    rows: torch.Tensor
    keep: torch.Tensor | None
    width: int
    members: frozenset[int]


def make_route(row_slots: list[int | None]) -> Route | None:
    """A route for a batch whose row i uses slot row_slots[i] (None = base model)."""
    groups: dict[int, list[int]] = {}
    for row, slot in enumerate(row_slots):
        if slot is not None:
            groups.setdefault(slot, []).append(row)
    if not groups:
        return None
    # Chunks of ceil(rows / adapters): at most ~2x padded rows, at most ~2x chunks.
    width = -(-sum(map(len, groups.values())) // len(groups))
    slots: list[int] = []
    rows: list[int] = []
    keep: list[float] = []
    for slot, members in groups.items():
        for start in range(0, len(members), width):
            chunk = members[start : start + width]
            slots.append(slot)
            rows.extend(chunk + [chunk[0]] * (width - len(chunk)))
            keep.extend([1.0] * len(chunk) + [0.0] * (width - len(chunk)))
    return Route(
        torch.tensor(slots),
        torch.tensor(rows),
        None if all(keep) else torch.tensor(keep)[:, None, None],
        width,
        frozenset(groups),
    )


class StackedLoraLinear(nn.Module):
    """A frozen base Linear plus the stacked LoRA weights of every resident adapter."""

    def __init__(self, base: nn.Linear, bank: LoraBank) -> None:
        super().__init__()
        self.base = base
        self.bank = bank
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.a = torch.zeros(bank.capacity, self.in_features, bank.rank)
        self.b = torch.zeros(bank.capacity, bank.rank, self.out_features)
        self.used: set[int] = set()  # slots whose adapter targets this module
        self._cached: tuple[Route, tuple[torch.Tensor, torch.Tensor] | None] | None = None

    def resize(self, capacity: int, rank: int) -> None:
        a = self.a.new_zeros(capacity, self.in_features, rank)
        b = self.b.new_zeros(capacity, rank, self.out_features)
        s, r = min(capacity, self.a.shape[0]), min(rank, self.a.shape[2])
        a[:s, :, :r] = self.a[:s, :, :r]
        b[:s, :r] = self.b[:s, :r]
        self.a, self.b, self._cached = a, b, None

    def put(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Write (or, with None, zero) one slot's weights."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        if weights is None:
            self.used.discard(slot)
        else:
            a, b = weights
            self.a[slot, :, : a.shape[1]] = a
            self.b[slot, : b.shape[0]] = b
            self.used.add(slot)
        if self._cached is not None and slot in self._cached[0].members:
            self._cached = None  # a publish elsewhere leaves the running batch's weights cached

    def _chunk_weights(self, route: Route) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self._cached is None or self._cached[0] is not route:
            weights = None
            if not self.used.isdisjoint(route.members):
                weights = (self.a.index_select(0, route.slots), self.b.index_select(0, route.slots))
            self._cached = (route, weights)
        return self._cached[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        route = self.bank.active
        if route is None or not self.used:
            return out
        weights = self._chunk_weights(route)
        if weights is None:
            return out
        a, b = weights
        rows = x.reshape(x.shape[0], -1, self.in_features).index_select(0, route.rows)
        rows = rows.to(a.dtype)
        if route.keep is not None:
            rows = rows * route.keep
        tokens = rows.shape[1]
        chunks = a.shape[0]
        h = torch.bmm(rows.view(chunks, route.width * tokens, self.in_features), a)
        delta = torch.bmm(h, b).view(-1, tokens, self.out_features)
        flat = out.view(out.shape[0], tokens, self.out_features)
        flat.index_add_(0, route.rows, delta.to(out.dtype))
        return out


class LoraBank:
    """Resident adapters of one model, by name, each in one slot of every targeted Linear.

    Only the scheduler thread touches it (installs and removals run between forward passes).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.capacity = 4
        self.rank = 1
        self.active: Route | None = None
        self._modules: dict[str, StackedLoraLinear] = {}
        self._slots: dict[str, int] = {}
        self._ranks: dict[str, int] = {}
        self._touched: dict[str, tuple[str, ...]] = {}

    def __contains__(self, name: str) -> bool:
        return name == BASE_ADAPTER or name in self._slots

    def route(self, names: list[str]) -> Route | None:
        return make_route([None if n == BASE_ADAPTER else self._slots[n] for n in names])

    def install(self, name: str, adapter: AdapterWeights) -> None:
        free = sorted(set(range(self.capacity + 1)) - set(self._slots.values()))
        slot = free[0]
        capacity = self.capacity if slot < self.capacity else 2 * self.capacity
        self._reshape(capacity, max(self.rank, adapter.rank))
        for module, weights in adapter.modules.items():
            self._wrapped(module).put(slot, weights)
        self._slots[name] = slot
        self._ranks[name] = adapter.rank
        self._touched[name] = tuple(adapter.modules)

    def remove(self, name: str) -> None:
        slot = self._slots.pop(name)
        del self._ranks[name]
        for module in self._touched.pop(name):
            self._modules[module].put(slot, None)
        self._reshape(self.capacity, max(self._ranks.values(), default=1))

    def _reshape(self, capacity: int, rank: int) -> None:
        if (capacity, rank) == (self.capacity, self.rank):
            return
        self.capacity, self.rank = capacity, rank
        for wrapper in self._modules.values():
            wrapper.resize(capacity, rank)

    def _wrapped(self, path: str) -> StackedLoraLinear:
        if path not in self._modules:
            parent_path, _, attr = path.rpartition(".")
            parent = self.model.get_submodule(parent_path) if parent_path else self.model
            wrapper = StackedLoraLinear(getattr(parent, attr), self)
            setattr(parent, attr, wrapper)
            self._modules[path] = wrapper
        return self._modules[path]
