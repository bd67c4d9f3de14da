"""Grouped multi-slot LoRA on frozen base Linear layers.

Every base `nn.Linear` is wrapped once at start-up by `MultiLoraLinear`, which holds the
A/B weights of each bound slot that targets it. Before a forward pass the engine tells the
shared `Router` which batch rows belong to which slot; each wrapper then adds
`scale * B(A(dropout(x_rows)))` to exactly those rows (PEFT's
`lora_B(lora_A(dropout(x))) * scaling`, with the scale applied to the rank-sized middle
instead of the output). One pass over the shared base serves every slot, and because a row
only ever touches its own slot's A/B, backward gives each slot exactly the gradient it would
get alone.

A slot's result must not depend on which other slots share its pass (composition
independence): the controller checks a run that shared its passes against the same run
alone (paging, recovery replay), a trainer group checks against one process, and AdamW
magnifies any last-bit difference in a gradient near zero into a visible one. So a slot's
LoRA products run over its own rows only, the same calls whatever else is in the batch, and
each A/B gradient is the float32 rounding of the float64 sum of its rows' own products, so
it does not depend on how its rows are split between ranks either (`_SlotDeltas`). An
earlier design batched equal-rank slots into `bmm`s over "units" of the gcd of their row
counts: a slot's rounding then changed with its neighbours' row counts (that bmm rounds
unlike mm, a batch of one takes yet another path, and a slot's units were summed
afterwards). The loop over slots costs no full-size copies: all slots of one module
run in one autograd node that adds each delta in place and hands back each gradient in the
parameter's own layout (`bench/trainer_slots.py`). Ranks are never padded (a padded rank
changes the GEMM kernel and so the rounding; gradients must match PEFT to 1e-5), and
per-slot weights stay separate tensors, so per-slot AdamW and the state files are unchanged.

What stays outside this module is the base model's own computation: it sees the padded
batch, and on the CPU its rounding of a token can depend on the batch's width (a GEMM tiles
a short tail of rows differently; the backward differs across widths too). A slot is
bit-identical beside any neighbours that leave the width unchanged (its longest row is the
batch's longest), and equal to float rounding otherwise.

We write this instead of using PEFT's `adapter_names=` because PEFT refuses mixed batches in
training mode, ties `requires_grad` to the active adapter, and draws dropout and init from
the global RNG; here every slot trains at once with seeded init and hashed dropout. PEFT
stays the reference in tests and the file format on disk.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

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
class Routing:
    """How one forward's batch maps onto slots, computed once and read by every wrapper."""

    groups: list[RowGroup]  # tile the batch in order
    starts: list[int]  # each group's first row
    dropout: RowDropout | None  # None when no row has dropout

    @classmethod
    def build(cls, groups: list[RowGroup], device: torch.device) -> Routing:
        starts = [0]
        for g in groups[:-1]:
            starts.append(starts[-1] + g.size)
        dropout = None
        if any(g.dropout > 0 for g in groups):
            keys = [k for g in groups for k in (g.dropout_keys or [0] * g.size)]
            p = [g.dropout for g in groups for _ in range(g.size)]
            dropout = RowDropout(keys, p, device)
        return cls(groups, starts, dropout)


class Router:
    """The per-forward routing shared by every wrapped Linear."""

    def __init__(self) -> None:
        self.routing: Routing | None = None
        # While a trainer group's pass collects them: what each LoRA gradient lost in its
        # rounding to float32, in float64 by id(parameter), so that the ranks' partial sums
        # add up exactly (batch_pass._join_gradients). None: not collected (one process).
        self.residuals: dict[int, torch.Tensor] | None = None

    def add_residual(self, param: torch.Tensor, rest: torch.Tensor, index: int | None) -> None:
        """Collect what `param`'s gradient (its `index` block, or all of it) lost in its
        rounding to float32, while a trainer group's pass collects residuals."""
        if self.residuals is None:
            return
        total = self.residuals.get(id(param))
        if total is None:
            total = self.residuals[id(param)] = param.new_zeros(param.shape, dtype=torch.float64)
        (total if index is None else total[index]).add_(rest)

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
    trainable Parameters."""

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
        out: torch.Tensor = self.base(x)
        routing = self.router.routing
        if routing is None:
            raise RuntimeError(f"{self.name} ran outside Router.route(): no rows are routed")
        present: list[tuple[RowGroup, int]] = []  # (group, first row) of slots adapting here
        weights: list[torch.Tensor] = []
        for g, start in zip(routing.groups, routing.starts, strict=True):
            if (w := self.adapters.get(g.slot)) is not None:
                present.append((g, start))
                weights += [w.A, w.B]
        if not present:
            return out
        xs = x.to(torch.float32)
        if routing.dropout is not None:
            xs = xs * routing.dropout.mask(self.key, x.shape[1], x.shape[2])
        return _slot_deltas(out.contiguous(), xs, present, self.router, *weights)


class _SlotDeltas(torch.autograd.Function):
    """`out + scale * B(A(x))` on each slot's rows, written into `out`, in one autograd node.

    A slot's products run over its own rows only, the same calls whatever shares the pass:
    2-D `mm`s (PEFT's kernels, in the orientation F.linear and autograd's mm backward use),
    and for its weight gradients one `bmm` entry per row, which rounds as that row's `mm`
    would. A `bmm` over several slots' tokens (`x A^T` and the like) does not: its rounding
    differs from `mm`'s and depends on the batch count (a batch of one takes another path),
    and cutting a slot's rows into units summed afterwards reorders its reduction.
    Each A/B gradient is the float32 rounding of the float64 sum of its rows' own products,
    so it does not depend on how the rows are split either: a trainer group that cuts a slot
    between ranks sums the ranks' float64 sums (`Router.residuals`) and gets one process's
    gradient, where AdamW would otherwise magnify a last-bit difference in a gradient near
    zero. The forward adds each delta in place (no full-size cat); the backward hands back
    the gradients in A's and B's own layout, which autograd takes as they are."""

    @staticmethod
    def forward(
        ctx: Any,
        out: torch.Tensor,
        x: torch.Tensor,
        present: list[tuple[RowGroup, int]],
        router: Router,
        *weights: torch.Tensor,
    ) -> torch.Tensor:
        in_f, out_f = x.shape[-1], out.shape[-1]
        hidden: list[torch.Tensor] = []
        for (g, start), a, b in zip(present, weights[::2], weights[1::2], strict=True):
            xg = x[start : start + g.size].reshape(-1, in_f)
            og = out[start : start + g.size].view(-1, out_f)
            # A float32 base output takes the delta in place (the same gemm, accumulating
            # into it); another dtype gets the float32 sum rounded once, as PEFT's does.
            o32 = og if og.dtype == torch.float32 else og.to(torch.float32)
            h = torch.mm(xg, a.t()).mul_(g.scale)
            o32.addmm_(h, b.t())
            if o32 is not og:
                og.copy_(o32)
            hidden.append(h)
        ctx.hidden, ctx.present, ctx.router, ctx.params = hidden, present, router, weights
        ctx.save_for_backward(x, *weights)
        ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *weights = ctx.saved_tensors
        in_f, out_f = x.shape[-1], grad.shape[-1]
        residuals: dict[int, torch.Tensor] | None = ctx.router.residuals
        grad_x = None
        if ctx.needs_input_grad[1]:  # rows of slots without an adapter here get zeros
            grad_x = x.new_empty(x.shape)
            if sum(g.size for g, _ in ctx.present) < x.shape[0]:
                grad_x.zero_()
        grads: list[torch.Tensor] = []
        for i, ((g, start), h) in enumerate(zip(ctx.present, ctx.hidden, strict=True)):
            a, b = weights[2 * i], weights[2 * i + 1]
            xg = x[start : start + g.size].reshape(-1, in_f)
            gg = grad[start : start + g.size].reshape(-1, out_f).to(torch.float32)
            g_h = torch.mm(gg, b).mul_(g.scale)
            if grad_x is not None:
                torch.mm(g_h, a, out=grad_x[start : start + g.size].view(-1, in_f))
            for param, lhs, rhs in ((ctx.params[2 * i], g_h, xg), (ctx.params[2 * i + 1], gg, h)):
                if g.size == 1:  # one row: its own product, nothing to sum
                    grads.append(torch.mm(lhs.t(), rhs))
                    continue
                exact = _row_products(lhs, rhs, g.size).sum(0, dtype=torch.float64)
                rounded = exact.to(torch.float32)
                if residuals is not None:
                    rest, key = exact - rounded, id(param)
                    residuals[key] = residuals[key] + rest if key in residuals else rest
                grads.append(rounded)
        return (grad, grad_x, None, None, *grads)


# torch declares Function.apply without annotations; this is its signature for _SlotDeltas
# (out, x, present, router, then each present slot's A and B).
_slot_deltas = cast(Callable[..., torch.Tensor], _SlotDeltas.apply)


def _row_products(lhs: torch.Tensor, rhs: torch.Tensor, rows: int) -> torch.Tensor:
    """`lhs_r^T @ rhs_r` for each of `rows` equal runs of tokens: a weight gradient's share
    of each batch row, in A's and B's own layout (autograd's mm backward for the column-major
    A^T, B^T). A `bmm` of this orientation rounds each entry as `mm` rounds it alone, so a
    row's share is the same whichever other rows of its slot run beside it."""
    return torch.bmm(
        lhs.reshape(rows, -1, lhs.shape[-1]).transpose(1, 2), rhs.reshape(rows, -1, rhs.shape[-1])
    )


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
