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
backward.

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
        if not any(g.slot in self.adapters for c in routing.classes for g in c.groups):
            return out
        xs = x.to(torch.float32)
        if routing.dropout is not None:
            xs = xs * routing.dropout.mask(self.key, x.shape[1], x.shape[2])
        classes = routing.classes
        if len(classes) == 1:  # no split: its backward is a full-size cat
            return self._add_delta(classes[0], xs, out)
        sizes = [c.rows for c in classes]
        return torch.cat(
            [
                self._add_delta(c, xc, oc)
                for c, xc, oc in zip(classes, xs.split(sizes), out.split(sizes), strict=True)
            ]
        )

    def _add_delta(self, c: RankClass, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out + scale * B(A(x))` for the rows of one rank class, unit by unit."""
        found = [self.adapters.get(g.slot) for g in c.groups]
        if all(w is None for w in found):
            return out
        if any(w is None for w in found):
            zero = LoraWeights(
                x.new_zeros(c.rank, self.in_features), x.new_zeros(self.out_features, c.rank)
            )
            weights = [zero if w is None else w for w in found]
        else:
            weights = [w for w in found if w is not None]
        a = torch.stack([w.A for w in weights])  # (groups, rank, in)
        b = torch.stack([w.B for w in weights])  # (groups, out, rank)
        if c.unit_group is not None:
            a, b = a[c.unit_group], b[c.unit_group]
        x = x.reshape(c.units, -1, self.in_features)
        base = out.reshape(c.units, -1, self.out_features).to(torch.float32)
        if c.units == 1:
            # One run of rows: the plain 2-D kernels of F.linear (PEFT's), since bmm takes a
            # naive path for tiny products whose rounding differs from mm's.
            h = torch.mm(x[0], a[0].t()) * c.scales[0]
            y = torch.addmm(base[0], h, b[0].t())
        else:
            y = torch.baddbmm(base, torch.bmm(x, a.transpose(1, 2)) * c.scales, b.transpose(1, 2))
        return y.view(out.shape).to(out.dtype)


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
