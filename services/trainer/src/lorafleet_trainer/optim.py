"""Per-slot AdamW with two-pass gradient preparation.

Each slot owns one `torch.optim.AdamW` over exactly its own A and B tensors (two parameter
groups), built from the slot's tensor list, never by filtering on requires_grad, so a step
on one slot cannot touch another. Hyperparameters come with every call.

Gradients accumulate over forward_backward calls as one float64 sum per tensor
(`accumulate`), and `p.grad` is always that sum rounded to float32 once: three calls then a
step equal one call with the same data bit for bit, where adding each call's float32
gradient to the last would round once per call (SkyRL's accumulation test measured that at
2e-6). The sum costs a float64 copy of the slot's LoRA gradients while they are pending.

Pass 1 sums the squared gradient norm in float64; any non-finite value vetoes the step,
clears this slot's gradients and leaves weights, moments and the step count untouched.
Pass 2 applies one combined clip scale; then AdamW steps. Decoupled weight decay in
torch's AdamW already uses the pre-update value and the uncorrected learning rate, which is
exactly the A-only decay rule; LoRA+ is a larger learning rate on the B group.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from lorafleet.contract import check_adam
from lorafleet_trainer.domain import AdamParams, LoraSpec, OptimStepResult

NO_GRADIENT_NOTE = "no accumulated gradient: nothing to apply"
VETO_NOTE = "non-finite gradient: step vetoed, gradients cleared, weights and moments unchanged"


def validate_adam(p: AdamParams) -> None:
    """Finite and in range (the contract's rule), checked before anything moves."""
    check_adam(dataclasses.asdict(p))


class SlotOptimizer:
    def __init__(
        self, spec: LoraSpec, a_params: list[torch.Tensor], b_params: list[torch.Tensor]
    ) -> None:
        self.spec = spec
        self.a_params = a_params
        self.b_params = b_params
        self.steps = 0
        # By index in `params`: the float64 sum of the pending gradient, which p.grad rounds.
        self._exact: dict[int, torch.Tensor] = {}
        self._opt = torch.optim.AdamW(
            [{"params": a_params}, {"params": b_params}], lr=0.0, weight_decay=0.0, foreach=True
        )

    @property
    def params(self) -> list[torch.Tensor]:
        return self.a_params + self.b_params

    def has_gradients(self) -> bool:
        return any(p.grad is not None for p in self.params)

    def clear_gradients(self) -> None:
        for p in self.params:
            p.grad = None
        self._exact.clear()

    def accumulate(self, index: int, call: torch.Tensor) -> None:
        """Add one call's gradient of `params[index]` (float64, the parameter's shape) to the
        pending sum and make `p.grad` its float32 rounding."""
        p = self.params[index]
        total = self._exact.get(index)
        if total is None:
            total = call if p.grad is None else call + p.grad.to(torch.float64)
        else:
            total = total.add_(call)
        self._exact[index] = total
        p.grad = total.to(p.dtype)

    def step(self, hp: AdamParams) -> OptimStepResult:
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return OptimStepResult(metrics={}, applied=False, note=NO_GRADIENT_NOTE)
        # One float64 reduction over all gradients: squares of float32 values cannot overflow
        # float64, so the norm is finite exactly when every gradient entry is.
        flat = torch.cat([g.reshape(-1) for g in grads]).double()
        norm = math.sqrt(float(torch.dot(flat, flat)))
        if not math.isfinite(norm):
            self.clear_gradients()
            return OptimStepResult(metrics={"vetoed": 1.0}, applied=False, note=VETO_NOTE)
        # The run's default clip (user_metadata lorafleet.max_grad_norm_default) applies when
        # the call leaves grad_clip_norm unset; a set 0 means no clipping (juno's 0).
        spec = self.spec
        clip = spec.max_grad_norm_default if hp.grad_clip_norm is None else hp.grad_clip_norm
        a_only = (
            spec.a_only_weight_decay if hp.a_only_weight_decay is None else hp.a_only_weight_decay
        )
        if clip > 0 and norm > clip:
            torch._foreach_mul_(grads, clip / (norm + 1e-6))
        group_a, group_b = self._opt.param_groups
        for group, lr, wd in (
            (group_a, hp.learning_rate, hp.weight_decay),
            (
                group_b,
                hp.learning_rate * self.spec.b_lr_ratio,
                0.0 if a_only else hp.weight_decay,
            ),
        ):
            group.update(lr=lr, betas=(hp.beta1, hp.beta2), eps=hp.eps, weight_decay=wd)
        self._opt.step()
        self.clear_gradients()
        self.steps += 1
        return OptimStepResult(
            metrics={
                "grad_norm": norm,
                "learning_rate": hp.learning_rate,
                "step": float(self.steps),
            },
            applied=True,
        )

    def moments(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """(exp_avg, exp_avg_sq) by parameter index in `params`; empty before the first step."""
        out = {}
        for i, p in enumerate(self.params):
            state = self._opt.state.get(p)
            if state:
                out[i] = (state["exp_avg"], state["exp_avg_sq"])
        return out

    def restore(self, steps: int, moments: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Replace the moments and step count (from a saved state); clears nothing else."""
        self._opt.state.clear()
        for i, (m, v) in moments.items():
            p = self.params[i]
            self._opt.state[p] = {
                "step": torch.tensor(float(steps), dtype=torch.float32),
                "exp_avg": m.to(p.device, p.dtype).clone(),
                "exp_avg_sq": v.to(p.device, p.dtype).clone(),
            }
        self.steps = steps
