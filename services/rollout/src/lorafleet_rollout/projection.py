"""Linear layers in the torch engine's decode layout: weights packed once for oneDNN
(`pack`, `linear`), fused projections with their LoRA stacks (`Projection`), and the gated MLP
(`Mlp`). Read from a transformers model's modules, which are untyped, so every attribute
read here is checked (`child`, `detached_weight`)."""

from __future__ import annotations

from typing import TypeVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from lorafleet_rollout import kernels
from lorafleet_rollout.lora import LoraStacks, Route

_M = TypeVar("_M", bound=nn.Module)

#: Rows [first, last) of a prefill batch that go through adapter slot `slot` (others: base).
Spans = list[tuple[int, int, int]]


#: oneDNN's prepacked fp32 GEMM: decode is weight-bandwidth bound at a few dozen rows, and
#: a weight packed once into oneDNN's blocked layout streams faster than MKL's `x @ W`, which
#: repacks W on every call (decode steps of the bench model ~1.2x faster, measured side by
#: side; vLLM's CPU backend does the same).
_ONEDNN = torch.backends.mkldnn.is_available()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A linear weight [out, in] in the layout `linear` multiplies fastest."""
    if _ONEDNN:
        # torch.ops finds operators at run time, so mypy sees their results as Any.
        return cast(torch.Tensor, torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 16))
    return weight.t().contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, in] times a `pack`ed weight (+ bias): [M, out]."""
    if _ONEDNN:
        out = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return cast(torch.Tensor, out)  # a torch.ops result (see `pack`)
    return x @ weight if bias is None else torch.addmm(bias, x, weight)


class Projection:
    """A (fused) linear layer: packed weight, optional bias, and its LoRA stacks."""

    def __init__(self, linears: list[nn.Linear], native: kernels.DecodeLora | None) -> None:
        self.weight = pack(torch.cat([m.weight.detach() for m in linears]))
        biases = [m.bias for m in linears]
        self.bias = (
            None
            if all(b is None for b in biases)
            else torch.cat(
                [
                    m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features)
                    for m in linears
                ]
            )
        )
        self.lora = LoraStacks(
            linears[0].in_features, tuple(m.out_features for m in linears), native
        )

    def __call__(self, x: torch.Tensor, adapter: Route | Spans | None) -> torch.Tensor:
        out = linear(x, self.weight, self.bias)
        if isinstance(adapter, Route):
            self.lora.add_routed(out, x, adapter)
        elif adapter:
            for first, last, slot in adapter:
                self.lora.add_one(out[first:last], x[first:last], slot)
        return out


def fused_linears(owner: nn.Module, fused: str, parts: tuple[str, ...]) -> list[nn.Linear]:
    """The Linears of a fused projection: Phi-3's one `fused` Linear, else the `parts`
    (concatenated here in the same output order)."""
    one = getattr(owner, fused, None)
    return [one] if isinstance(one, nn.Linear) else [child(owner, n, nn.Linear) for n in parts]


def child(owner: nn.Module, name: str, kind: type[_M]) -> _M:
    """owner.name, checked to be a `kind` (nn.Module attributes are untyped)."""
    found = getattr(owner, name)
    if not isinstance(found, kind):
        raise TypeError(f"{type(owner).__name__}.{name} is not a {kind.__name__}")
    return found


class Mlp:
    """A gated MLP: gate and up as one GEMM (Phi-3 stores them fused already), then down."""

    def __init__(self, mlp: nn.Module, native: kernels.DecodeLora | None) -> None:
        self.gate_up_linears = fused_linears(mlp, "gate_up_proj", ("gate_proj", "up_proj"))
        self.down_linear = child(mlp, "down_proj", nn.Linear)
        self.gate_up = Projection(self.gate_up_linears, native)
        self.down = Projection([self.down_linear], native)

    def projections(self) -> list[tuple[Projection, list[nn.Linear]]]:
        return [(self.gate_up, self.gate_up_linears), (self.down, [self.down_linear])]

    def __call__(
        self, x: torch.Tensor, adapter: Route | Spans | None, slots: torch.Tensor | None
    ) -> torch.Tensor:
        gate, up = self.gate_up(x, adapter).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up, adapter)


def detached_weight(module: nn.Module) -> torch.Tensor:
    """A module's weight for the decode layout; checked, as nn.Module attributes are untyped."""
    weight = module.weight
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(module).__name__}.weight is not a tensor")
    return weight.detach()
