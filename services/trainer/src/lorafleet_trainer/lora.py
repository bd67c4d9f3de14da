"""Grouped multi-slot LoRA on frozen base Linear layers.

Every base `nn.Linear` is wrapped once at start-up by `MultiLoraLinear`, which holds the
A/B weights of each bound slot that targets it. Before a forward pass the engine tells the
shared `Router` which batch rows belong to which slot; each wrapper then adds
`scale * B(A(dropout(x_rows)))` to exactly those rows (the same arithmetic as PEFT's
`lora_B(lora_A(dropout(x))) * scaling`). One pass over the shared base serves every slot,
and because a row only ever touches its own slot's A/B, backward gives each slot exactly
the gradient it would get alone.

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
import torch.nn.functional as F
from torch import nn

from lorafleet_trainer.dropout import keep_mask, mix32, module_key


@dataclass
class RowGroup:
    """A contiguous run of batch rows that goes through one slot's adapters."""

    slot: int
    size: int  # rows; groups tile the batch in order
    dropout_keys: torch.Tensor | None  # int64 per-row mask keys; None = no dropout


class Router:
    """The per-forward routing table shared by every wrapped Linear."""

    def __init__(self) -> None:
        self.groups: list[RowGroup] = []

    @contextlib.contextmanager
    def route(self, groups: list[RowGroup]) -> Iterator[None]:
        self.groups = groups
        try:
            yield
        finally:
            self.groups = []


@dataclass
class LoraWeights:
    """One slot's adapter on one module (float32 whatever the base dtype)."""

    A: nn.Parameter  # (rank, in_features)
    B: nn.Parameter  # (out_features, rank)
    scale: float
    dropout: float


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        groups = self.router.groups
        # Rows arrive sorted by slot, so each group is a split of the batch (a view, and one
        # cat in backward), not a gather/scatter.
        parts = x.split([g.size for g in groups]) if len(groups) > 1 else (x,)
        deltas: list[torch.Tensor | None] = []
        for group, xs in zip(groups, parts, strict=True):
            w = self.adapters.get(group.slot)
            if w is None:
                deltas.append(None)
                continue
            xs = xs.to(w.A.dtype)
            if group.dropout_keys is not None and w.dropout > 0:
                mask = keep_mask(group.dropout_keys, xs.shape[1], xs.shape[2], self.key, w.dropout)
                xs = xs * mask
            deltas.append((F.linear(F.linear(xs, w.A), w.B) * w.scale).to(out.dtype))
        if all(d is None for d in deltas):
            return out
        if len(deltas) == 1:
            return out + deltas[0]
        filled = [
            d if d is not None else out.new_zeros((g.size, *out.shape[1:]))
            for g, d in zip(groups, deltas, strict=True)
        ]
        return out + torch.cat(filled)


def wrap_linears(model: nn.Module, router: Router) -> dict[str, MultiLoraLinear]:
    """Replace every nn.Linear of `model` by a wrapper; returns them by original name."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    wrappers: dict[str, MultiLoraLinear] = {}
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        wrapper = MultiLoraLinear(getattr(parent, attr), name, router)
        setattr(parent, attr, wrapper)
        wrappers[name] = wrapper
    return wrappers


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
