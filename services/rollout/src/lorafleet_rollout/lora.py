"""Multi-adapter LoRA for generation: each row of one forward pass through its own adapter.

Why not PEFT's `adapter_names=[...]`: in every LoRA layer it loops over the adapters present
(Python index lists, a sub-batch gather, two Linear calls and an index_put per adapter); with
16 rows over 8 adapters on the 20 M bench model the engine ran ~1.5x slower through it than
through grouped matmuls (bench/sampling.py). Here every projection of the decoder
(`projection.Projection`, q/k/v and gate/up fused) holds the resident adapters' weights as two
stacks per rank class, A^T [slots, in, n*R] and (scale * B)^T [slots, n*R, W], n the fused
sub-projections, R the class's rank (`rank_class`: a power of two, at least 4) and W the
widest sub-projection's outputs; sub-projection j owns rank columns [j*R, j*R + r), whose B
rows hold its own out_j output columns from column 0 (not a zero block for the others'
outputs: that tripled q/k/v's B), everything else is zero (the padding adds exact zeros).
Why classes: with one stack at the largest resident
rank, one rank-64 adapter made every rank-4 one cost rank 64 in memory and in every decode
step; per class an adapter costs its own rank, within 2x (bench/rank_mix.py). A slot number
(`slot_number`) names the class and the index in it; 0 is the base model.

A prefill runs one adapter: matmuls on its slot's views (one per sub-projection), no copy.
A decode step runs a `Route`, built once per batch composition (not per token), split by rank
class. With the native kernels (`kernels.DecodeLora`) it is one call per projection and class
over the rows grouped by slot, reading each slot's stacks in place. Without them, each class's
rows are cut into equal chunks of one adapter each: one gather of the rows, `bmm`s over the
chunks (one for A, one per sub-projection for B) and one `index_add_` back, whatever the
number of adapters; the chunk-stacked weights are cached per route, so steady decode steps
gather no weights at all.

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


#: Bits of a slot number that name its rank class (log2 of the class's rank); the rest is the
#: slot's index among the class's slots.
_CLASS_BITS = 5
_CLASS_MASK = (1 << _CLASS_BITS) - 1


def rank_class(rank: int) -> int:
    """The stack rank an adapter of largest rank `rank` is kept at: the power of two at or
    above it, at least 4 (ranks 1-4 share one class, so small adapters do not split decode
    work over many classes)."""
    return max(4, 1 << (rank - 1).bit_length())


def slot_number(rank: int, index: int) -> int:
    """The slot number of index `index` of rank class `rank` (never 0: classes are >= 4)."""
    return index << _CLASS_BITS | (rank.bit_length() - 1)


def slot_place(slot: int) -> tuple[int, int]:
    """(rank class, index in it) of a slot number."""
    return 1 << (slot & _CLASS_MASK), slot >> _CLASS_BITS


def _kept(slot: int, rank: int, capacity: int) -> bool:
    """Whether `slot` survives rank class `rank` being resized to `capacity` slots."""
    slot_rank, index = slot_place(slot)
    return slot_rank != rank or index < capacity


@dataclass(frozen=True, eq=False)
class SlotWeights:
    """An adapter's weights for one projection's stacks (`LoraStacks.lay_out`): the whole slot
    laid out at its class's rank `rank`, A^T [in, n*rank] and B^T [n*rank, out]."""

    rank: int
    a: torch.Tensor
    b: torch.Tensor


def _slot_weights(
    a: dict[int, torch.Tensor], b: dict[int, torch.Tensor], used: set[int], slot: int
) -> SlotWeights | None:
    if slot not in used:
        return None
    rank, index = slot_place(slot)
    return SlotWeights(rank, a[rank][index], b[rank][index])


@dataclass(frozen=True, eq=False)
class Chunks:
    """The rows of a batch whose adapters are of rank class `rank`, as equal chunks of `width`
    rows of one slot each.

    `rows` [chunks * width] indexes the batch; `slots` [chunks] names each chunk's index in
    the class's stacks; `keep` [chunks * width, 1] zeroes the padding entries of short chunks
    (None when there are none). Padding entries repeat a real row, so adding their (zero)
    output changes nothing. `order` and `order_slots` (int32) list the rows grouped by slot,
    with each one's index, for the native kernel. `members`: the slot numbers present.
    """

    rank: int
    slots: torch.Tensor
    rows: torch.Tensor
    keep: torch.Tensor | None
    width: int
    members: frozenset[int]
    order: torch.Tensor
    order_slots: torch.Tensor


@dataclass(frozen=True, eq=False)
class Route:
    """Which rows of a batch go through which adapter slot: `classes`, one `Chunks` per rank
    class present, and `row_slots` [rows], each row's slot number (0: the base model), for the
    expert banks' per-pair LoRA."""

    classes: tuple[Chunks, ...]
    row_slots: torch.Tensor


def make_route(row_slots: list[int]) -> Route | None:
    """A route for a batch whose row i uses slot row_slots[i] (0 = base model)."""
    classes: dict[int, dict[int, list[int]]] = {}
    for row, slot in enumerate(row_slots):
        if slot:
            classes.setdefault(slot_place(slot)[0], {}).setdefault(slot, []).append(row)
    if not classes:
        return None
    return Route(
        tuple(_chunks(rank, groups) for rank, groups in sorted(classes.items())),
        torch.tensor(row_slots),
    )


def _chunks(rank: int, groups: dict[int, list[int]]) -> Chunks:
    """The `Chunks` of one class's rows, `groups`: slot number -> its rows."""
    # Chunks of ceil(rows / adapters): at most ~2x padded rows, at most ~2x chunks.
    width = -(-sum(map(len, groups.values())) // len(groups))
    slots: list[int] = []
    rows: list[int] = []
    keep: list[float] = []
    for slot, members in groups.items():
        for start in range(0, len(members), width):
            chunk = members[start : start + width]
            slots.append(slot_place(slot)[1])
            rows.extend(chunk + [chunk[0]] * (width - len(chunk)))
            keep.extend([1.0] * len(chunk) + [0.0] * (width - len(chunk)))
    return Chunks(
        rank,
        torch.tensor(slots),
        torch.tensor(rows),
        None if all(keep) else torch.tensor(keep)[:, None],
        width,
        frozenset(groups),
        torch.tensor([r for members in groups.values() for r in members], dtype=torch.int32),
        torch.tensor(
            [slot_place(s)[1] for s, members in groups.items() for _ in members],
            dtype=torch.int32,
        ),
    )


#: What a route needs per projection and class, made once per batch composition: the native
#: kernel's bound call, or the torch path's chunk-stacked weights.
_Prepared = Callable[[torch.Tensor, torch.Tensor], None] | tuple[torch.Tensor, torch.Tensor]


class LoraStacks:
    """The stacked LoRA weights of one (possibly fused) projection, for every slot: per rank
    class resident, `a[rank]` [slots, in, n*rank] and `b[rank]` [slots, n*rank, out]."""

    def __init__(
        self, in_features: int, outs: tuple[int, ...], native: DecodeLora | None = None
    ) -> None:
        self.native = native
        self.in_features = in_features
        self.outs = outs
        self.offsets = tuple(sum(outs[:j]) for j in range(len(outs)))
        self.out_features = sum(outs)
        #: B's row length: sub-projection j's rank columns hold only its own out_j columns
        #: (from 0), not a zero block for every other sub-projection's outputs.
        self.width = max(outs)
        self.a: dict[int, torch.Tensor] = {}
        self.b: dict[int, torch.Tensor] = {}
        self.columns: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.used: set[int] = set()  # slots whose adapter targets this projection
        self.stale: set[int] = set()  # released slots still holding a gone adapter's weights
        self._cached: tuple[Route, list[tuple[Chunks, _Prepared]]] | None = None

    def resize(self, rank: int, capacity: int) -> None:
        """Give rank class `rank` `capacity` slots (0: none, its stacks go), keeping the
        weights of those it had."""
        n = len(self.outs)
        old_a, old_b = self.a.pop(rank, None), self.b.pop(rank, None)
        self.columns.pop(rank, None)
        self.stale = {s for s in self.stale if _kept(s, rank, capacity)}
        self._cached = None
        if not capacity:
            return
        a = torch.zeros(capacity, self.in_features, n * rank)
        b = torch.zeros(capacity, n * rank, self.width)
        if old_a is not None and old_b is not None:
            s = min(capacity, old_a.shape[0])
            a[:s], b[:s] = old_a[:s], old_b[:s]
        self.a[rank], self.b[rank], self.columns[rank] = a, b, self._columns(rank)

    def _columns(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The output columns each rank column reaches: sub-projection j's own, [lo, hi)."""
        subs = [j for j in range(len(self.outs)) for _ in range(rank)]
        lo = torch.tensor([self.offsets[j] for j in subs], dtype=torch.int32)
        return lo, lo + torch.tensor([self.outs[j] for j in subs], dtype=torch.int32)

    def lay_out(
        self, parts: dict[int, tuple[torch.Tensor, torch.Tensor]], rank: int
    ) -> SlotWeights:
        """One adapter's weights for this projection as a whole slot of rank class `rank`:
        sub-projection j -> (A^T [in, r], B^T [r, out_j]) placed at rank columns [j*rank, ...)
        (B's from column 0), the rest zero. Pure, so it runs on the adapter-prep thread;
        installing is then one copy per stack."""
        n = len(self.outs)
        a = torch.zeros(self.in_features, n * rank)
        b = torch.zeros(n * rank, self.width)
        for j, (pa, pb) in parts.items():
            start = j * rank
            a[:, start : start + pa.shape[1]] = pa
            b[start : start + pb.shape[0], : self.outs[j]] = pb
        return SlotWeights(rank, a, b)

    def _expand(self, out: torch.Tensor, h: torch.Tensor, b: torch.Tensor, rank: int) -> None:
        """out [..., out] += each sub-projection's h [..., n*rank] columns times its B rows
        (b [..., n*rank, width]); `out` and `h` 2-D, or `b` batched with `h` [chunks, w, nR]."""
        for j, (off, size) in enumerate(zip(self.offsets, self.outs, strict=True)):
            cols = slice(j * rank, (j + 1) * rank)
            out[..., off : off + size] += h[..., cols] @ b[..., cols, :size]

    def weights(self, slot: int) -> SlotWeights | None:
        """Slot's weights, as views (None: its adapter does not target this projection), for
        moving it to another slot of its class with `put`."""
        return _slot_weights(self.a, self.b, self.used, slot)

    def put(self, slot: int, weights: SlotWeights | None) -> None:
        """Write slot's weights (None: the adapter does not target this projection)."""
        rank, index = slot_place(slot)
        if weights is None:
            if slot in self.stale or slot in self.used:
                self.a[rank][index].zero_()
                self.b[rank][index].zero_()
            self.used.discard(slot)
        else:
            self.a[rank][index].copy_(weights.a)
            self.b[rank][index].copy_(weights.b)
            self.used.add(slot)
        self.stale.discard(slot)
        if self._cached is not None and any(slot in c.members for c in self._cached[0].classes):
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
            rank, index = slot_place(slot)
            b = self.b[rank][index]
            if len(self.outs) == 1:
                out.addmm_(x @ self.a[rank][index], b)
            else:
                self._expand(out, x @ self.a[rank][index], b, rank)

    def add_routed(self, out: torch.Tensor, x: torch.Tensor, route: Route) -> None:
        """out [B, out] += each row's LoRA for x [B, in] (a decode step: one token per row)."""
        if self._cached is None or self._cached[0] is not route:
            prepared = [
                (chunks, self._prepare(chunks))
                for chunks in route.classes
                if not self.used.isdisjoint(chunks.members)
            ]
            self._cached = (route, prepared)
        for chunks, ready in self._cached[1]:
            if callable(ready):
                ready(out, x)
                continue
            a, b = ready
            rows = x.index_select(0, chunks.rows)
            if chunks.keep is not None:
                rows = rows * chunks.keep
            h = torch.bmm(rows.view(a.shape[0], chunks.width, self.in_features), a)
            if len(self.outs) == 1:
                y = torch.bmm(h, b)
            else:
                y = h.new_zeros(a.shape[0], chunks.width, self.out_features)
                self._expand(y, h, b, chunks.rank)
            out.index_add_(0, chunks.rows, y.view(-1, self.out_features))

    def _prepare(self, chunks: Chunks) -> _Prepared:
        a, b = self.a[chunks.rank], self.b[chunks.rank]
        if self.native is not None:
            return self.native.bind(
                a, b, chunks.order, chunks.order_slots, self.columns[chunks.rank], self.out_features
            )
        return a.index_select(0, chunks.slots), b.index_select(0, chunks.slots)


class ExpertStacks:
    """The per-expert LoRA of one MoE expert bank (`gate_up_proj` or `down_proj`), for every
    slot: per rank class resident, A^T `a[rank]` [slots, experts, in, rank] and (scale * B)^T
    `b[rank]` [slots, experts, rank, out], zero beyond an adapter's own rank and for slots
    that do not target the bank (the padding adds exact zeros), as `LoraStacks` does for a
    Linear.

    The delta of a (token, expert) pair is `scale * B_e(A_e(x))` of its row's adapter, the
    trainer's `experts.MultiLoraExperts` and PEFT's merged `(W_e + scale * B_e A_e) x`.
    Computed with torch ops: one gather of the pairs' (slot, expert) weights and two `bmm`s
    per bank and class (~18 % of a tiny-MoE decode with two adapters; a grouped native kernel
    reading the stacks in place, like `DecodeLora`, would pay here: see `moe.Moe`).
    """

    def __init__(self, experts: int, in_features: int, out_features: int) -> None:
        self.experts = experts
        self.in_features = in_features
        self.out_features = out_features
        self.a: dict[int, torch.Tensor] = {}
        self.b: dict[int, torch.Tensor] = {}
        self.used: set[int] = set()
        self.stale: set[int] = set()
        #: [slot numbers] bool: the slot's adapter targets this bank (pairs of others skip it).
        self.active = torch.zeros(1, dtype=torch.bool)

    def resize(self, rank: int, capacity: int) -> None:
        """As `LoraStacks.resize`."""
        old_a, old_b = self.a.pop(rank, None), self.b.pop(rank, None)
        self.stale = {s for s in self.stale if _kept(s, rank, capacity)}
        if capacity:
            a = torch.zeros(capacity, self.experts, self.in_features, rank)
            b = torch.zeros(capacity, self.experts, rank, self.out_features)
            if old_a is not None and old_b is not None:
                s = min(capacity, old_a.shape[0])
                a[:s], b[:s] = old_a[:s], old_b[:s]
            self.a[rank], self.b[rank] = a, b
        size = 1 + max((slot_number(r, len(a) - 1) for r, a in self.a.items()), default=0)
        active = torch.zeros(size, dtype=torch.bool)
        kept = min(size, len(self.active))
        active[:kept] = self.active[:kept]
        self.active = active

    def lay_out(
        self, parts: dict[int, tuple[torch.Tensor, torch.Tensor]], rank: int
    ) -> SlotWeights:
        """One adapter's bank, (A^T [experts, in, r], B^T [experts, r, out]), at its class's
        rank `rank`. Pure, so it runs on the adapter-prep thread."""
        pa, pb = parts[0]
        a = torch.zeros(self.experts, self.in_features, rank)
        b = torch.zeros(self.experts, rank, self.out_features)
        a[:, :, : pa.shape[-1]] = pa
        b[:, : pb.shape[1]] = pb
        return SlotWeights(rank, a, b)

    def weights(self, slot: int) -> SlotWeights | None:
        """As `LoraStacks.weights`."""
        return _slot_weights(self.a, self.b, self.used, slot)

    def put(self, slot: int, weights: SlotWeights | None) -> None:
        """Write slot's weights (None: the adapter does not target this bank)."""
        rank, index = slot_place(slot)
        if weights is None:
            if slot in self.stale or slot in self.used:
                self.a[rank][index].zero_()
                self.b[rank][index].zero_()
            self.used.discard(slot)
        else:
            self.a[rank][index].copy_(weights.a)
            self.b[rank][index].copy_(weights.b)
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
        s, e, xs = (
            slots.index_select(0, live),
            experts.index_select(0, live),
            x.index_select(0, live),
        )
        for rank, a in self.a.items():
            pairs, sr, er, xr = live, s, e, xs
            if len(self.a) > 1:  # this class's pairs only
                pick = ((s & _CLASS_MASK) == rank.bit_length() - 1).nonzero()[:, 0]
                pairs, sr, er, xr = (t.index_select(0, pick) for t in (live, s, e, xs))
            index = sr >> _CLASS_BITS
            h = torch.bmm(xr[:, None], a[index, er])
            out.index_add_(0, pairs, torch.bmm(h, self.b[rank][index, er])[:, 0])
