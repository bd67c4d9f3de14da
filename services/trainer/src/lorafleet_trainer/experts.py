"""Per-expert multi-slot LoRA on fused mixture-of-experts banks.

transformers stores the experts of an MoE layer (Qwen3-MoE, Mixtral, ...) as two 3-D
parameters on one module: `gate_up_proj` (experts, 2 * intermediate, hidden) and
`down_proj` (experts, hidden, intermediate). No `nn.Linear` exists there, so the Linear
wrapper of `lora.py` cannot reach them; this module wraps the experts module instead and
runs its forward itself, expert by expert, adding each token's own slot's LoRA delta on the
expert the router sent it to.

Each targeted bank of a slot holds either one adapter per expert (A: (experts, rank, in),
B: (experts, out, rank); PEFT's `target_parameters` LoRA, so the exported adapter is what
PEFT builds and loads) or, with `LoraSpec.share_experts`, one adapter shared by all experts
(A: (rank, in), B: (out, rank)), exported as that adapter repeated per expert (equal
logits in PEFT). The delta is `scale * B_e(A_e(x))` on the rows of x routed to expert e,
which equals PEFT's merged `(W_e + scale * B_e A_e) x`. PEFT refuses dropout on these
banks (its merged form cannot apply it), so registrations asking for both are refused.

Only the layout transformers' `use_experts_implementation` calls standard is adapted
(concatenated [gate; up], not transposed, no bias, gated, no post-expert norm); anything
else is reported as not adaptable by `sites.py` rather than skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast

import torch
from torch import nn
from torch.nn import functional as F

from lorafleet import peft_experts
from lorafleet.errors import FailedPrecondition
from lorafleet_trainer.lora import LoraWeights, Router, RowGroup, init_weights

BANKS = peft_experts.EXPERT_BANKS


class _StandardExperts(Protocol):
    """The parts of a transformers experts module that `is_standard_experts` checked."""

    gate_up_proj: nn.Parameter
    down_proj: nn.Parameter

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor: ...


def is_standard_experts(module: nn.Module) -> bool:
    """The fused-bank layout this wrapper knows how to run (see the module docstring)."""
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, nn.Parameter)
        and isinstance(down, nn.Parameter)
        and gate_up.dim() == 3
        and down.dim() == 3
        and getattr(module, "has_gate", False) is True
        and getattr(module, "is_concatenated", False) is True
        and getattr(module, "is_transposed", True) is False
        and getattr(module, "has_bias", True) is False
        and getattr(module, "has_post_expert_norm", True) is False
        and hasattr(module, "_apply_gate")
    )


class ExpertBank:
    """One fused 3-D parameter of an experts module, as a LoRA target (a "site")."""

    def __init__(self, owner: MultiLoraExperts, param: str) -> None:
        self.owner = owner
        self.param = param
        experts, out_features, in_features = getattr(owner.base, param).shape
        self.num_experts = int(experts)
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.adapters: dict[int, LoraWeights] = {}

    def init_weights(
        self, seed: int, name: str, rank: int, shared: bool, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Seeded A (PEFT's uniform bound, per expert), B = 0; see `lora.init_weights`."""
        experts = 1 if shared else self.num_experts
        a, _ = init_weights(seed, name, rank * experts, self.in_features, 1, device)
        b = torch.zeros(experts, self.out_features, rank, device=device)
        if shared:
            return a, b[0]
        return a.view(experts, rank, self.in_features), b

    def to_peft(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """PEFT ParamWrapper's lora_A (experts*rank, in) and lora_B (out, rank*experts).

        The layout is `lorafleet.peft_experts`'; a shared adapter is written as the same block
        for every expert.
        """
        e = self.num_experts
        if a.dim() == 2:  # shared
            a, b = a.expand(e, *a.shape), b.expand(e, *b.shape)
        return peft_experts.to_peft(a, b)

    def from_peft(
        self, a: torch.Tensor, b: torch.Tensor, shared: bool, key: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of `to_peft`; a shared slot accepts only an adapter equal across experts."""
        a3, b3 = peft_experts.from_peft(a, b, self.num_experts)
        if not shared:
            return a3, b3
        if not (torch.equal(a3, a3[:1].expand_as(a3)) and torch.equal(b3, b3[:1].expand_as(b3))):
            raise FailedPrecondition(
                f"{key} differs between experts but the slot shares one adapter across experts",
                field="adapter",
                reason="SHARED_EXPERTS_MISMATCH",
            )
        return a3[0], b3[0]


class MultiLoraExperts(nn.Module):
    """Replaces an experts module; runs it with each token's slot LoRA on each bank."""

    def __init__(self, base: nn.Module, router: Router) -> None:
        super().__init__()
        self.base = base
        self.router = router
        self.banks = {p: ExpertBank(self, p) for p in BANKS}
        self.num_experts = self.banks["gate_up_proj"].num_experts

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        routing = self.router.routing
        groups = [] if routing is None else routing.groups
        if not any(g.slot in bank.adapters for bank in self.banks.values() for g in groups):
            out: torch.Tensor = self.base(hidden_states, top_k_index, top_k_weights)
            return out
        # hidden_states is the (rows * seq, hidden) flattening of the routed batch: token t
        # belongs to row t // seq, and rows tile the groups in order.
        rows = sum(g.size for g in groups)
        seq = hidden_states.shape[0] // rows
        sizes = torch.tensor([g.size * seq for g in groups], device=hidden_states.device)
        ordinal = torch.arange(len(groups), device=sizes.device)
        group_of_token = torch.repeat_interleave(ordinal, sizes)
        base = cast(_StandardExperts, self.base)  # checked by is_standard_experts before wrapping
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = F.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert in hit[:, 0].tolist():
            top_k_pos, token_idx = torch.where(mask[expert])
            n = token_idx.numel()
            # Zero rows up to a multiple of ROW_QUANTUM: every GEMM of this expert then
            # rounds a token's row as it would among any other tokens (see ROW_QUANTUM).
            pad = -n % ROW_QUANTUM
            x = F.pad(hidden_states[token_idx], (0, 0, 0, pad))
            token_group = F.pad(group_of_token[token_idx], (0, pad), value=-1)
            h = self._with_lora("gate_up_proj", expert, x, token_group, groups)
            h = base._apply_gate(h)
            y = self._with_lora("down_proj", expert, h, token_group, groups)[:n]
            y = y * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out

    def _with_lora(
        self,
        param: str,
        expert: int,
        x: torch.Tensor,
        token_group: torch.Tensor,
        groups: list[RowGroup],
    ) -> torch.Tensor:
        """`x @ W_e^T` plus, on each slot's tokens, `scale * B_e(A_e(x))` (float32)."""
        bank = self.banks[param]
        y = F.linear(x, getattr(self.base, param)[expert])
        deltas = []
        xs = x.to(torch.float32)
        for gi, g in enumerate(groups):
            w = bank.adapters.get(g.slot)
            if w is None:
                continue
            sel = (token_group == gi).nonzero()[:, 0]
            if sel.numel() == 0:
                continue
            n = sel.numel()
            xg = F.pad(xs[sel], (0, 0, 0, -n % ROW_QUANTUM))
            per_expert = w.A.dim() == 3
            a, b = (w.A[expert], w.B[expert]) if per_expert else (w.A, w.B)
            where = (expert if per_expert else None, w.A, w.B, self.router)
            d = _expert_delta(xg, a, b, g.scale, where)[:n]
            deltas.append((sel, d))
        if not deltas:
            return y
        yf = y.to(torch.float32)
        for sel, d in deltas:
            yf = yf.index_add(0, sel, d)
        return yf.to(y.dtype)


# CPU GEMMs (oneDNN/MKL) take another kernel, and another split over threads, for a few rows
# than for many: measured on the bench host, a row of `F.linear` over M rows differs in its
# last bits from the same row over 300 rows for M < 8 (one thread) and for M = 9..11 (two
# threads), and never once M is a multiple of 8, at 1 or 2 threads. An expert's tokens are
# whatever the router sent it, so their count differs between a trainer group's ranks and one
# process; padding it to a multiple of 8 with zero rows makes every token's products the same.
ROW_QUANTUM = 8


class _ExpertDelta(torch.autograd.Function):
    """`scale * (x A^T) B^T` for one slot's tokens on one expert, with weight gradients that
    do not depend on which other tokens share the pass.

    The forward and the input gradient are the plain `mm`s (over row counts padded to
    ROW_QUANTUM). A's and B's gradients are sums over the slot's tokens routed to the expert,
    which a trainer group splits between ranks differently from one process: each is summed
    in float64 (every float32 product is exact there) and rounded once, and what the rounding
    dropped goes to `Router.residuals`, so the ranks' sums join to one process's gradient (as
    lora._SlotDeltas does for Linear sites). An adapter shared by all experts adds the experts'
    rounded gradients in float32 (autograd's accumulation), so there a group equals one
    process to float rounding only."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        scale: float,
        where: tuple[int | None, torch.Tensor, torch.Tensor, Router],
    ) -> torch.Tensor:
        h = torch.mm(x, a.t()) * scale
        ctx.scale, ctx.where = scale, where
        ctx.save_for_backward(x, a, b, h)
        return torch.mm(h, b.t())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, a, b, h = ctx.saved_tensors
        expert, full_a, full_b, router = ctx.where
        g_h = torch.mm(grad, b) * ctx.scale
        grad_x = torch.mm(g_h, a) if ctx.needs_input_grad[0] else None
        grads = []
        for full, lhs, rhs in ((full_a, g_h, x), (full_b, grad, h)):
            exact = torch.mm(lhs.t().to(torch.float64), rhs.to(torch.float64))
            rounded = exact.to(torch.float32)
            router.add_residual(full, exact - rounded, expert)
            grads.append(rounded)
        return grad_x, grads[0], grads[1], None, None


# torch declares Function.apply without annotations: (x, a, b, scale, where) -> delta.
_expert_delta = cast(Callable[..., torch.Tensor], _ExpertDelta.apply)
