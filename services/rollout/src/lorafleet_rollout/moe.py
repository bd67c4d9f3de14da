"""The torch engine's sparse MoE block (`Moe`): top-k routing, one GEMM per hit expert, and
per-expert LoRA on the fused expert banks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from lorafleet.errors import InvalidArgument
from lorafleet_rollout import kernels
from lorafleet_rollout.lora import ExpertStacks, Route
from lorafleet_rollout.projection import (
    Mlp,
    Projection,
    Spans,
    child,
    detached_weight,
    linear,
    pack,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Moe:
    """A sparse MoE block (Qwen3-MoE; Qwen2-MoE adds a gated shared expert), as transformers
    runs it: router softmax (float32) over experts, top-k, renormalised when the config's
    `norm_topk_prob` says so, each expert a gated MLP on its fused [gate; up] bank, outputs
    weighted and summed per token. Per-expert LoRA on either bank (`ExpertStacks`, the
    trainer's target_parameters adapters); the router takes none (the trainer cannot adapt
    its raw weight either), the shared expert's Linears take LoRA like any MLP's.

    The (token, expert) pairs are sorted by expert once, so each expert is one GEMM over its
    rows and the LoRA of every pair is one gathered `bmm` per bank, whatever the mix of
    adapters. Torch ops only, and this is where a native kernel would pay next: on the tiny
    MoE (16 rows decoding, bench/moe_decode.py, one thread) these blocks took ~48 % of the
    engine's time on the base model and ~57 % with two adapters, the per-expert LoRA ~18 %
    (its gather copies each pair's A and B). Most of it is per-op overhead at small sizes
    (argsort, bincount, one GEMM per hit expert per layer): a grouped kernel over the pairs,
    reading the banks and stacks in place like `kernels.DecodeLora`, would remove both.
    """

    def __init__(
        self, block: nn.Module, config: PretrainedConfig, native: kernels.DecodeLora | None
    ) -> None:
        experts = child(block, "experts", nn.Module)
        if not _standard_experts(experts):
            raise InvalidArgument(
                f"{type(experts).__name__}: expert banks other than transformers' fused "
                "[gate; up] / down layout are not supported by the torch engine",
                field="model_path",
            )
        gate_up, down = (_tensor(experts, bank) for bank in ("gate_up_proj", "down_proj"))
        self.num_experts, inter2, hidden = (int(n) for n in gate_up.shape)
        self.top_k = int(config.num_experts_per_tok)
        self.norm_topk = bool(getattr(config, "norm_topk_prob", False))
        self.router = pack(detached_weight(child(block, "gate", nn.Module)))
        self.gate_up = [pack(w) for w in gate_up]
        self.down = [pack(w) for w in down]
        self.gate_up_lora = ExpertStacks(self.num_experts, hidden, inter2)
        self.down_lora = ExpertStacks(self.num_experts, inter2 // 2, hidden)
        shared = getattr(block, "shared_expert", None)
        self.shared = None if shared is None else Mlp(shared, native)
        shared_gate = getattr(block, "shared_expert_gate", None)
        self.shared_gate = None if shared_gate is None else Projection([shared_gate], native)
        self.shared_gate_linear = shared_gate

    def projections(self) -> list[tuple[Projection, list[nn.Linear]]]:
        out = [] if self.shared is None else self.shared.projections()
        if self.shared_gate is not None and self.shared_gate_linear is not None:
            out.append((self.shared_gate, [self.shared_gate_linear]))
        return out

    def __call__(
        self, x: torch.Tensor, adapter: Route | Spans | None, slots: torch.Tensor | None
    ) -> torch.Tensor:
        """x [M, hidden] normalised; slots [M] each row's adapter slot (None: all base)."""
        probs = torch.softmax(linear(x, self.router, None), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)  # pairs by expert, tokens in order within one
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token = order // self.top_k
        xs = x.index_select(0, token)
        h = _per_expert(self.gate_up, xs, counts)
        pair_slots = None if slots is None else slots.index_select(0, token)
        experts = flat.index_select(0, order)
        if pair_slots is not None:
            self.gate_up_lora.add(h, xs, pair_slots, experts)
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up
        y = _per_expert(self.down, h, counts)
        if pair_slots is not None:
            self.down_lora.add(y, h, pair_slots, experts)
        y.mul_(weights.reshape(-1).index_select(0, order).to(y.dtype)[:, None])
        out = torch.zeros_like(x).index_add_(0, token, y)
        if self.shared is not None:
            shared = self.shared(x, adapter, slots)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x, adapter)) * shared
            out = out + shared
        return out


def _per_expert(weights: list[torch.Tensor], x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Rows x [P, in] sorted by expert, counts[e] of them for expert e: each run through its
    expert's packed weight, one GEMM per expert hit."""
    out: torch.Tensor | None = None
    start = 0
    for expert, n in enumerate(counts):
        if not n:
            continue
        y = linear(x[start : start + n], weights[expert], None)
        if out is None:
            out = x.new_empty(x.shape[0], y.shape[1])
        out[start : start + n] = y
        start += n
    assert out is not None  # every pair has an expert
    return out


def _tensor(owner: nn.Module, name: str) -> torch.Tensor:
    """owner.name detached, checked to be a tensor."""
    value = getattr(owner, name)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{type(owner).__name__}.{name} is not a tensor")
    return value.detach()


def _standard_experts(module: nn.Module) -> bool:
    """transformers' fused expert layout: 3-D [gate; up] and down banks, not transposed, no
    bias (the layout the trainer adapts, `lorafleet_trainer.experts.is_standard_experts`)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, torch.Tensor)
        and isinstance(down, torch.Tensor)
        and gate_up.dim() == 3
        and down.dim() == 3
        and getattr(module, "is_transposed", False) is False
        and getattr(module, "has_bias", False) is False
        and getattr(module, "is_concatenated", True) is True
        and getattr(module, "has_gate", True) is True
        and getattr(module, "has_post_expert_norm", False) is False
    )
