"""Multi-adapter LoRA for generation: each row of one forward pass through its own adapter.

Why not PEFT's `adapter_names=[...]`: in every LoRA layer it loops over the adapters present
(Python index lists, a sub-batch gather, two Linear calls and an index_put per adapter); with
16 rows over 8 adapters on the 20 M bench model the engine ran ~1.5x slower through it than
through grouped matmuls (bench/sampling.py). Here every projection of the decoder
(`projection.Projection`, q/k/v and gate/up fused) holds all resident adapters' weights as two
stacks, A^T [slots, in, n*R] and (scale * B)^T [slots, n*R, out], n the fused sub-projections
and R the largest resident rank; sub-projection j owns rank columns [j*R, j*R + r) and its own
output columns, everything else is zero (the padding adds exact zeros). Slot 0 stays zero.

A prefill runs one adapter: two matmuls on its slot's views, no copy. A decode step runs a
`Route`, built once per batch composition (not per token). With the native kernels
(`kernels.DecodeLora`) it is one call per projection over the rows grouped by slot, reading
each slot's stacks in place. Without them, the route cuts the LoRA rows into equal chunks of
one adapter each: one gather of the rows, two `bmm`s over the chunks and one `index_add_`
back, whatever the number of adapters; the chunk-stacked weights are cached per route, so
steady decode steps gather no weights at all.

The result is PEFT's `base(x) + lora_B(lora_A(x)) * scaling` (same per-module rank, alpha and
rsLoRA rules, `adapter_weights`), up to float rounding; tests hold it to 1e-4 in logprob.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from peft import LoraConfig
from peft.utils.other import get_pattern_key

from lorafleet import peft_experts
from lorafleet.errors import InvalidArgument
from lorafleet_rollout.kernels import DecodeLora
from lorafleet_rollout.peft_io import WEIGHTS_FILE, Banks, target_of


@dataclass(frozen=True)
class AdapterWeights:
    """One adapter ready to install: module path -> (A^T [in, r], (scale * B)^T [r, out]);
    an expert bank ("<experts module>.<parameter>") -> per expert, [experts, in, r] and
    [experts, r, out]."""

    rank: int
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]


def adapter_weights(
    config: LoraConfig, tensors: dict[str, torch.Tensor], banks: Banks | None = None
) -> AdapterWeights:
    """Pair the PEFT tensors per module and fold in PEFT's scaling; raise before any change.

    Expects tensors already checked by `peft_io.check_fits` (names, shapes, finiteness), with
    the same `banks`. An expert bank's rank is per expert (PEFT's `r`; its lora_A holds
    experts * r rows), and its scale is PEFT's alpha / r like any module's.
    """
    if getattr(config, "alora_invocation_tokens", None):
        raise InvalidArgument("activated LoRA (aLoRA) adapters are not supported", field="config")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, kind = target_of(key, config, banks or {})
        pairs.setdefault(module, {})[kind] = tensor
    # PEFT types both patterns Optional: a config saved with `null` loads them as None.
    rank_pattern = config.rank_pattern or {}
    alpha_pattern = config.alpha_pattern or {}
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"lora_A", "lora_B"}:
            raise InvalidArgument(
                f"{module} has {sorted(pair)} but needs both lora_A and lora_B", field=WEIGHTS_FILE
            )
        a, b = pair["lora_A"], pair["lora_B"]
        experts = _experts(module, banks or {})
        n = experts or 1
        rank = rank_pattern.get(get_pattern_key(list(rank_pattern), module), config.r)
        alpha = alpha_pattern.get(get_pattern_key(list(alpha_pattern), module), config.lora_alpha)
        if a.shape[0] != rank * n or b.shape[1] != rank * n:
            raise InvalidArgument(
                f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not have "
                f"the configured rank {rank}",
                field=WEIGHTS_FILE,
            )
        scale = alpha / math.sqrt(rank) if config.use_rslora else alpha / rank
        a, b = a.to(torch.float32), b.to(torch.float32) * scale
        if experts is not None:  # per expert (`lorafleet.peft_experts`), transposed views
            a3, b3 = peft_experts.from_peft(a, b, experts)
            modules[module] = (a3.transpose(1, 2), b3.transpose(1, 2))
        else:  # transposed views: `LoraStacks.lay_out` copies them into place once
            modules[module] = (a.t(), b.t())
    return AdapterWeights(max(a.shape[-1] for a, _ in modules.values()), modules)


def _experts(target: str, banks: Banks) -> int | None:
    """How many experts an expert bank target has (None: a Linear)."""
    module, _, param = target.rpartition(".")
    bank = banks.get(module, {}).get(param)
    return None if bank is None else bank[0]


@dataclass(frozen=True, eq=False)
class SlotWeights:
    """An adapter's weights for one projection's stacks (`LoraStacks.lay_out`): its parts,
    and the whole slot laid out at stack rank `rank`, A^T [in, n*rank] and B^T [n*rank, out]."""

    parts: dict[int, tuple[torch.Tensor, torch.Tensor]]
    rank: int
    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True, eq=False)
class Route:
    """Which rows of a batch go through which adapter slot, as equal chunks of `width` rows.

    `rows` [chunks * width] indexes the batch; `slots` [chunks] names each chunk's slot; `keep`
    [chunks * width, 1] zeroes the padding entries of short chunks (None when there are
    none). Padding entries repeat a real row, so adding their (zero) output changes nothing.
    `order` and `order_slots` (int32) list the LoRA rows grouped by slot, with each one's
    slot, for the native kernel.
    """

    slots: torch.Tensor
    rows: torch.Tensor
    keep: torch.Tensor | None
    width: int
    members: frozenset[int]
    order: torch.Tensor
    order_slots: torch.Tensor


def make_route(row_slots: list[int]) -> Route | None:
    """A route for a batch whose row i uses slot row_slots[i] (0 = base model)."""
    groups: dict[int, list[int]] = {}
    for row, slot in enumerate(row_slots):
        if slot:
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
        None if all(keep) else torch.tensor(keep)[:, None],
        width,
        frozenset(groups),
        torch.tensor([r for members in groups.values() for r in members], dtype=torch.int32),
        torch.tensor([s for s, members in groups.items() for _ in members], dtype=torch.int32),
    )


#: What a route needs per projection, made once per batch composition: the native kernel's
#: bound call, or the torch path's chunk-stacked weights (None: no row's adapter is here).
_Prepared = Callable[[torch.Tensor, torch.Tensor], None] | tuple[torch.Tensor, torch.Tensor] | None


class LoraStacks:
    """The stacked LoRA weights of one (possibly fused) projection, for every slot."""

    def __init__(
        self, in_features: int, outs: tuple[int, ...], native: DecodeLora | None = None
    ) -> None:
        self.native = native
        self.in_features = in_features
        self.outs = outs
        self.offsets = tuple(sum(outs[:j]) for j in range(len(outs)))
        self.out_features = sum(outs)
        self.rank = 0
        self.a = torch.zeros(1, in_features, 0)
        self.b = torch.zeros(1, 0, self.out_features)
        self.used: set[int] = set()  # slots whose adapter targets this projection
        self.stale: set[int] = set()  # released slots still holding a gone adapter's weights
        self.columns = self._columns()
        self._cached: tuple[Route, _Prepared] | None = None

    def resize(self, capacity: int, rank: int) -> None:
        n = len(self.outs)
        a = self.a.new_zeros(capacity, self.in_features, n * rank)
        b = self.b.new_zeros(capacity, n * rank, self.out_features)
        s, r = min(capacity, self.a.shape[0]), min(rank, self.rank)
        for j in range(n):
            a[:s, :, j * rank : j * rank + r] = self.a[:s, :, j * self.rank : j * self.rank + r]
            b[:s, j * rank : j * rank + r] = self.b[:s, j * self.rank : j * self.rank + r]
        self.a, self.b, self.rank, self._cached = a, b, rank, None
        self.columns = self._columns()

    def _columns(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The output columns each rank column reaches: sub-projection j's own, [lo, hi)."""
        subs = [j for j in range(len(self.outs)) for _ in range(self.rank)]
        lo = torch.tensor([self.offsets[j] for j in subs], dtype=torch.int32)
        return lo, lo + torch.tensor([self.outs[j] for j in subs], dtype=torch.int32)

    def lay_out(
        self, parts: dict[int, tuple[torch.Tensor, torch.Tensor]], rank: int
    ) -> SlotWeights:
        """One adapter's weights for this projection as a whole slot at stack rank `rank`:
        sub-projection j -> (A^T [in, r], B^T [r, out_j]) placed, the rest zero. Pure, so it
        runs on the adapter-prep thread; installing is then one copy per stack."""
        n = len(self.outs)
        a = torch.zeros(self.in_features, n * rank)
        b = torch.zeros(n * rank, self.out_features)
        for j, (pa, pb) in parts.items():
            start, off = j * rank, self.offsets[j]
            a[:, start : start + pa.shape[1]] = pa
            b[start : start + pb.shape[0], off : off + self.outs[j]] = pb
        return SlotWeights(parts, rank, a, b)

    def put(self, slot: int, weights: SlotWeights | None) -> None:
        """Write slot's weights (None: the adapter does not target this projection)."""
        if weights is None:
            if slot in self.stale or slot in self.used:
                self.a[slot].zero_()
                self.b[slot].zero_()
            self.used.discard(slot)
        else:
            if weights.rank != self.rank:  # the stacks' rank changed since it was laid out
                weights = self.lay_out(weights.parts, self.rank)
            self.a[slot].copy_(weights.a)
            self.b[slot].copy_(weights.b)
            self.used.add(slot)
        self.stale.discard(slot)
        if self._cached is not None and slot in self._cached[0].members:
            self._cached = None  # a publish elsewhere leaves the running batch's weights cached

    def release(self, slot: int) -> None:
        """Slot's adapter is gone. Its weights stay until the slot's next `put` (no route
        names a released slot, so nothing reads them): a removal writes nothing."""
        if slot in self.used:
            self.used.discard(slot)
            self.stale.add(slot)

    def add_one(self, out: torch.Tensor, x: torch.Tensor, slot: int) -> None:
        """out [M, out] += LoRA of slot for rows x [M, in] (a prefill: one adapter)."""
        if slot in self.used:
            out.addmm_(x @ self.a[slot], self.b[slot])

    def add_routed(self, out: torch.Tensor, x: torch.Tensor, route: Route) -> None:
        """out [B, out] += each row's LoRA for x [B, in] (a decode step: one token per row)."""
        if self._cached is None or self._cached[0] is not route:
            prepared: _Prepared = None
            if not self.used.isdisjoint(route.members):
                if self.native is not None:
                    prepared = self.native.bind(
                        self.a, self.b, route.order, route.order_slots, self.columns
                    )
                else:
                    prepared = (
                        self.a.index_select(0, route.slots),
                        self.b.index_select(0, route.slots),
                    )
            self._cached = (route, prepared)
        prepared = self._cached[1]
        if prepared is None:
            return
        if callable(prepared):
            prepared(out, x)
            return
        a, b = prepared
        rows = x.index_select(0, route.rows)
        if route.keep is not None:
            rows = rows * route.keep
        h = torch.bmm(rows.view(a.shape[0], route.width, self.in_features), a)
        out.index_add_(0, route.rows, torch.bmm(h, b).view(-1, self.out_features))


class ExpertStacks:
    """The per-expert LoRA of one MoE expert bank (`gate_up_proj` or `down_proj`), for every
    slot: A^T [slots, experts, in, R] and (scale * B)^T [slots, experts, R, out], R the largest
    resident rank, zero beyond an adapter's own rank and for slots that do not target the
    bank (the padding adds exact zeros), as `LoraStacks` does for a Linear.

    The delta of a (token, expert) pair is `scale * B_e(A_e(x))` of its row's adapter, the
    trainer's `experts.MultiLoraExperts` and PEFT's merged `(W_e + scale * B_e A_e) x`.
    Computed with torch ops: one gather of the pairs' (slot, expert) weights and two `bmm`s
    per bank (~18 % of a tiny-MoE decode with two adapters; a grouped native kernel reading
    the stacks in place, like `DecodeLora`, would pay here: see `moe.Moe`).
    """

    def __init__(self, experts: int, in_features: int, out_features: int) -> None:
        self.experts = experts
        self.in_features = in_features
        self.out_features = out_features
        self.rank = 0
        self.a = torch.zeros(1, experts, in_features, 0)
        self.b = torch.zeros(1, experts, 0, out_features)
        self.used: set[int] = set()
        self.stale: set[int] = set()
        #: [slots] bool: the slot's adapter targets this bank (pairs of other slots skip it).
        self.active = torch.zeros(1, dtype=torch.bool)

    def resize(self, capacity: int, rank: int) -> None:
        a = self.a.new_zeros(capacity, self.experts, self.in_features, rank)
        b = self.b.new_zeros(capacity, self.experts, rank, self.out_features)
        s, r = min(capacity, self.a.shape[0]), min(rank, self.rank)
        a[:s, :, :, :r] = self.a[:s, :, :, :r]
        b[:s, :, :r] = self.b[:s, :, :r]
        active = torch.zeros(capacity, dtype=torch.bool)
        active[:s] = self.active[:s]
        self.a, self.b, self.rank, self.active = a, b, rank, active

    def lay_out(
        self, parts: dict[int, tuple[torch.Tensor, torch.Tensor]], rank: int
    ) -> SlotWeights:
        """One adapter's bank, (A^T [experts, in, r], B^T [experts, r, out]), at stack rank
        `rank`. Pure, so it runs on the adapter-prep thread."""
        pa, pb = parts[0]
        a = torch.zeros(self.experts, self.in_features, rank)
        b = torch.zeros(self.experts, rank, self.out_features)
        a[:, :, : pa.shape[-1]] = pa
        b[:, : pb.shape[1]] = pb
        return SlotWeights(parts, rank, a, b)

    def put(self, slot: int, weights: SlotWeights | None) -> None:
        """Write slot's weights (None: the adapter does not target this bank)."""
        if weights is None:
            if slot in self.stale or slot in self.used:
                self.a[slot].zero_()
                self.b[slot].zero_()
            self.used.discard(slot)
        else:
            if weights.rank != self.rank:
                weights = self.lay_out(weights.parts, self.rank)
            self.a[slot].copy_(weights.a)
            self.b[slot].copy_(weights.b)
            self.used.add(slot)
        self.stale.discard(slot)
        self.active[slot] = weights is not None

    def release(self, slot: int) -> None:
        """Slot's adapter is gone; its weights stay until the slot's next `put`."""
        if slot in self.used:
            self.used.discard(slot)
            self.stale.add(slot)
        self.active[slot] = False

    def add(
        self, out: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, experts: torch.Tensor
    ) -> None:
        """out [P, out] += each pair's LoRA for x [P, in]: pair p's row uses slot slots[p]
        (0 = the base model) and was routed to expert experts[p]."""
        if not self.used:
            return
        live = self.active.index_select(0, slots).nonzero()[:, 0]
        if live.numel() == 0:
            return
        s, e = slots.index_select(0, live), experts.index_select(0, live)
        h = torch.bmm(x.index_select(0, live)[:, None], self.a[s, e])
        out.index_add_(0, live, torch.bmm(h, self.b[s, e])[:, 0])
