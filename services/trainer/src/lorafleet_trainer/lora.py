"""Grouped multi-slot LoRA on frozen base Linear layers.

Every base `nn.Linear` is wrapped once at start-up by `MultiLoraLinear`, which holds the
A/B weights of each bound slot that targets it. Before a forward pass the engine tells the
shared `Router` which batch rows belong to which slot; each wrapper then adds
`scale * B(A(dropout(x_rows)))` to exactly those rows (PEFT's
`lora_B(lora_A(dropout(x))) * scaling`, with the scale applied to the rank-sized middle
instead of the output). One pass over the shared base serves every slot, and because a row
only ever touches its own slot's A/B, backward gives each slot exactly the gradient it would
get alone.

The LoRA path of a mixed batch is a pair of batched matmuls per rank, not a loop over
slots. The engine sorts rows by slot and slots by rank; each run of equal-rank slots (a
`RankClass`, usually the whole batch) is cut into equal runs of rows ("units": the gcd of
its group sizes), the A/B of its slots are stacked, and `bmm` runs every unit against its own
slot's weights. Ranks are never padded: a zero-padded rank changes which GEMM kernel runs
and so the rounding, and gradients must match PEFT to 1e-5. Per-slot weights stay separate
tensors, so per-slot AdamW and the state files are unchanged. The earlier per-slot loop paid a
split, a full-size scale and a full-size cat per slot and module in forward and again in
backward. Every class of one module runs inside one autograd node (`_MixedDelta`): with 64
slots of six ranks, autograd's own stack/bmm/cat graph cost a full-size cat per module and a
strided copy of every slot's A and B gradient (`bench/trainer_slots.py`).

We write this instead of using PEFT's `adapter_names=` because PEFT refuses mixed batches in
training mode, ties `requires_grad` to the active adapter, and draws dropout and init from
the global RNG; here every slot trains at once with seeded init and hashed dropout. PEFT
stays the reference in tests and the file format on disk.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lorafleet_trainer.dropout import RowDropout, mix32, module_key


@dataclass
class RowGroup:
    """A contiguous run of batch rows that goes through one slot's adapters."""

    slot: int
    size: int  # rows; groups tile the batch in order
    rank: int  # the slot's LoRA rank
    scale: float  # the slot's alpha / rank
    dropout: float = 0.0  # drop probability; 0 = no dropout (forward-only rows, p = 0)
    dropout_keys: list[int] | None = None  # per-row mask keys, required when dropout > 0


@dataclass
class RankClass:
    """Consecutive groups whose slots share one LoRA rank, run as one pair of batched matmuls.

    The rows are cut into `units` equal runs (the gcd of the group sizes), each of one group.
    """

    rank: int
    rows: int
    groups: list[RowGroup]
    units: int
    unit_group: torch.Tensor | None  # group index of each unit; None when unit i is group i
    scales: torch.Tensor  # (units, 1, 1) float32: each unit's LoRA scale

    @classmethod
    def build(cls, rank: int, groups: list[RowGroup], device: torch.device) -> RankClass:
        unit = math.gcd(*(g.size for g in groups))
        owner = [i for i, g in enumerate(groups) for _ in range(g.size // unit)]
        unit_group = None
        if len(owner) != len(groups):
            unit_group = torch.tensor(owner, dtype=torch.int64, device=device)
        scales = torch.tensor(
            [groups[i].scale for i in owner], dtype=torch.float32, device=device
        ).view(-1, 1, 1)
        return cls(rank, sum(g.size for g in groups), groups, len(owner), unit_group, scales)


@dataclass
class Routing:
    """How one forward's batch maps onto slots, computed once and read by every wrapper."""

    classes: list[RankClass]  # tile the batch in order
    dropout: RowDropout | None  # None when no row has dropout

    @classmethod
    def build(cls, groups: list[RowGroup], device: torch.device) -> Routing:
        runs: list[tuple[int, list[RowGroup]]] = []
        for g in groups:
            if runs and runs[-1][0] == g.rank:
                runs[-1][1].append(g)
            else:
                runs.append((g.rank, [g]))
        dropout = None
        if any(g.dropout > 0 for g in groups):
            keys = [k for g in groups for k in (g.dropout_keys or [0] * g.size)]
            p = [g.dropout for g in groups for _ in range(g.size)]
            dropout = RowDropout(keys, p, device)
        return cls([RankClass.build(r, members, device) for r, members in runs], dropout)


class Router:
    """The per-forward routing shared by every wrapped Linear."""

    def __init__(self) -> None:
        self.routing: Routing | None = None

    @contextlib.contextmanager
    def route(self, groups: list[RowGroup], device: torch.device) -> Iterator[None]:
        self.routing = Routing.build(groups, device)
        try:
            yield
        finally:
            self.routing = None


@dataclass
class LoraWeights:
    """One slot's adapter on one module (float32 whatever the base dtype): the slot table's
    trainable Parameters, or plain zeros standing in for an absent slot within a forward."""

    A: torch.Tensor  # (rank, in_features)
    B: torch.Tensor  # (out_features, rank)


class MultiLoraLinear(nn.Module):
    def __init__(self, base: nn.Linear, name: str, router: Router) -> None:
        super().__init__()
        self.base = base
        self.name = name
        self.key = module_key(name)
        self.router = router
        # A plain dict, not a ModuleDict: slot weights are owned by the slot table and must
        # never appear in the base model's parameters or state_dict.
        self.adapters: dict[int, LoraWeights] = {}

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def init_weights(
        self, seed: int, name: str, rank: int, shared: bool, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Seeded A, B = 0 (`shared` is for expert banks: a Linear is one "expert")."""
        return init_weights(seed, name, rank, self.in_features, self.out_features, device)

    @staticmethod
    def to_peft(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """PEFT's lora_A/lora_B are the slot's A/B as they are."""
        return a, b

    @staticmethod
    def from_peft(
        a: torch.Tensor, b: torch.Tensor, shared: bool, key: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return a, b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        routing = self.router.routing
        if routing is None:
            raise RuntimeError(f"{self.name} ran outside Router.route(): no rows are routed")
        weights: list[torch.Tensor] = []
        present: list[tuple[RankClass, int, bool]] = []  # (class, first row, has an adapter)
        start = 0
        for c in routing.classes:
            found = [self.adapters.get(g.slot) for g in c.groups]
            has = any(w is not None for w in found)
            if has:
                zero = None
                if not all(found):  # absent slots add nothing: zeros of the class's rank
                    zero = LoraWeights(
                        x.new_zeros(c.rank, self.in_features, dtype=torch.float32),
                        x.new_zeros(self.out_features, c.rank, dtype=torch.float32),
                    )
                ws = [w or zero for w in found]
                weights += [w.A for w in ws if w is not None]
                weights += [w.B for w in ws if w is not None]
            present.append((c, start, has))
            start += c.rows
        if not weights:
            return out
        xs = x.to(torch.float32)
        if routing.dropout is not None:
            xs = xs * routing.dropout.mask(self.key, x.shape[1], x.shape[2])
        return _MixedDelta.apply(out.contiguous(), xs, present, *weights)


class _MixedDelta(torch.autograd.Function):
    """`out + scale * B(A(x))` for every rank class of the batch, written into `out`.

    One autograd node per module instead of a stack, bmm, scale, baddbmm and cat per class:
    the forward adds each class's delta in place (no full-size cat), and the backward hands
    each slot its A and B gradients as contiguous slices of one buffer per class in the
    parameters' own layout, which autograd takes as they are (the stack/transpose path gave
    strided views that it copied one by one). The products are the same: `mm` for a class of
    one run of rows (PEFT's kernels), `bmm` over the units of a larger one."""

    @staticmethod
    def forward(
        ctx: Any,
        out: torch.Tensor,
        x: torch.Tensor,
        present: list[tuple[RankClass, int, bool]],
        *weights: torch.Tensor,
    ) -> torch.Tensor:
        in_f, out_f = x.shape[-1], out.shape[-1]
        saved: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = []
        i = 0
        for c, start, has in present:
            if not has:
                saved.append(None)
                continue
            n = len(c.groups)
            a, b = torch.stack(weights[i : i + n]), torch.stack(weights[i + n : i + 2 * n])
            i += 2 * n
            if c.unit_group is not None:
                a, b = a[c.unit_group], b[c.unit_group]
            xc = x[start : start + c.rows].reshape(c.units, -1, in_f)
            oc = out[start : start + c.rows].view(c.units, -1, out_f)
            # A float32 base output takes the delta in place (the same gemm, accumulating
            # into it); another dtype gets the float32 sum rounded once, as PEFT's does.
            o32 = oc if oc.dtype == torch.float32 else oc.to(torch.float32)
            if c.units == 1:
                # One run of rows: the plain 2-D kernels of F.linear (PEFT's), since bmm takes
                # a naive path for tiny products whose rounding differs from mm's.
                h = torch.mm(xc[0], a[0].t()).mul_(c.scales[0]).unsqueeze(0)
                o32[0].addmm_(h[0], b[0].t())
            else:
                h = torch.bmm(xc, a.transpose(1, 2)).mul_(c.scales)
                o32.baddbmm_(h, b.transpose(1, 2))
            if o32 is not oc:
                oc.copy_(o32)
            saved.append((a, b, h))
        ctx.saved = saved
        ctx.present = present
        ctx.save_for_backward(x)
        ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        in_f, out_f = x.shape[-1], grad.shape[-1]
        need_x = ctx.needs_input_grad[1]
        grad_x = torch.empty_like(x) if need_x else None
        grads: list[torch.Tensor | None] = []
        for (c, start, _), kept in zip(ctx.present, ctx.saved, strict=True):
            if kept is None:
                if grad_x is not None:  # rows of slots without an adapter here
                    grad_x[start : start + c.rows].zero_()
                continue
            a, b, h = kept
            xc = x[start : start + c.rows].reshape(c.units, -1, in_f)
            gc = grad[start : start + c.rows].reshape(c.units, -1, out_f).to(torch.float32)
            # The products autograd's mm/bmm backward runs, in its orientation: another
            # rounds differently, which AdamW amplifies where a gradient is near zero. mm's
            # backward gives a column-major operand (A^T, B^T) its gradient in A's and B's
            # own layout; bmm's gives A^T and B^T, copied once per class into that layout.
            if c.units == 1:
                g_b = torch.mm(gc[0].t(), h[0]).unsqueeze(0)
                g_h = torch.mm(gc[0], b[0]).mul_(c.scales[0])
                g_a = torch.mm(g_h.t(), xc[0]).unsqueeze(0)
                if grad_x is not None:
                    grad_x[start : start + c.rows].view(-1, in_f).copy_(torch.mm(g_h, a[0]))
            else:
                g_b = torch.bmm(h.transpose(1, 2), gc).transpose(1, 2).contiguous()
                g_hu = torch.bmm(gc, b).mul_(c.scales)
                g_a = torch.bmm(xc.transpose(1, 2), g_hu).transpose(1, 2).contiguous()
                if grad_x is not None:
                    gx = grad_x[start : start + c.rows].view(c.units, -1, in_f)
                    torch.bmm(g_hu, a, out=gx)
            n = len(c.groups)
            if c.unit_group is not None:  # the units of one group sum into its slot
                g_a = g_a.new_zeros(n, *g_a.shape[1:]).index_add_(0, c.unit_group, g_a)
                g_b = g_b.new_zeros(n, *g_b.shape[1:]).index_add_(0, c.unit_group, g_b)
            grads += list(g_a.unbind()) + list(g_b.unbind())
        return (grad, grad_x, None, *grads)


def init_weights(
    seed: int, module: str, rank: int, in_features: int, out_features: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's kaiming_uniform(a=sqrt(5)) bound), B = 0.

    Drawn from a generator seeded by (seed, module), so init is a pure function of the seed.
    """
    gen = torch.Generator().manual_seed(
        (mix32(seed & 0xFFFFFFFF) << 32 | mix32((seed >> 32) ^ module_key(module))) & (2**63 - 1)
    )
    bound = 1.0 / math.sqrt(in_features)
    a = (torch.rand(rank, in_features, generator=gen, dtype=torch.float32) * 2 - 1) * bound
    b = torch.zeros(out_features, rank, dtype=torch.float32)
    return a.to(device), b.to(device)
