"""Tinker's loss functions: their inputs (checked by the contract's one validator), their terms.

Every loss is computed as one term per target token; a datum's loss is the plain sum of its
terms, and the terms themselves are returned as the datum's `elementwise_loss` output (next
to `logprobs`), so the outputs sum to the loss by construction. All losses are token-level
sums, never means (tinker-api.md §7.3, §9.3): K chunked calls must accumulate exactly the
gradient of one large call. With r = exp(logp - sampling_logp) and A the advantages, the
term of target token t is:

- cross_entropy:        -logp_t * w_t; targets (N,) or top-K (N, K), one term per target;
                        omitted weights are ones of the target's shape (the hosted service's
                        default), negative weights allowed.
- importance_sampling:  -r_t * A_t
- ppo:                  -min(r_t * A_t, clip(r_t, lo, hi) * A_t)
- cispo:                -sg(clip(r_t, lo, hi)) * logp_t * A_t
- dro:                  -logp_t * A_t + beta / 2 * (logp_t - sampling_logp_t) ** 2
                        (the DRO objective as in the Tinker docs; beta from loss_fn_config)
- gspo:                 s = exp(sum_t m_t (logp_t - sampling_logp_t) / max(1, sum_t m_t)) is
                        one sequence-level ratio per datum, m the `sequence_ratio_mask`
                        (default: every position); token t's share is
                        -m_t * min(s * A_t, clip(s, lo, hi) * A_t). Masked tokens (m_t = 0)
                        have a zero share, and every token's share depends on the whole
                        sequence through s, so its gradient is not "this token's" alone.

lo/hi come from loss_fn_config clip_low_threshold / clip_high_threshold; names, inputs and
defaults are `lorafleet.contract`'s, the one owner of the loss rules.

Two trainer-only options ride with a call (the managed-jobs feature sets them; the SDK has
no field for them): `ForwardBackwardInput.group_tokens` (token-mean normalisation over an
accumulation group) and `Datum.context` (a truncated-BPTT window's earlier context, see
`lorafleet_trainer.bptt`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from lorafleet.contract import (
    DEFAULT_CLIP_HIGH,
    DEFAULT_CLIP_LOW,
    DEFAULT_DRO_BETA,
    loss_config,
    loss_spec,
)
from lorafleet.validate_msgs import Limits, check_forward_backward
from lorafleet_trainer.domain import ForwardBackwardInput


@dataclass
class PreparedDatum:
    """A validated datum, its tensors in canonical dtypes."""

    tokens: list[int]
    target_tokens: torch.Tensor  # int64, (N,) or (N, K)
    weights: torch.Tensor | None = None  # float32, like target_tokens (cross_entropy)
    sampling_logprobs: torch.Tensor | None = None  # float32 (N,) (RL losses)
    advantages: torch.Tensor | None = None  # float32 (N,)
    ratio_mask: torch.Tensor | None = None  # float32 (N,) (gspo)
    context: list[int] = field(default_factory=list)  # earlier BPTT context, no targets
    window: bool = False  # a BPTT window even without context (bptt.py)


@dataclass(frozen=True)
class LossConfig:
    loss_fn: str
    clip_low: float = DEFAULT_CLIP_LOW
    clip_high: float = DEFAULT_CLIP_HIGH
    beta: float = DEFAULT_DRO_BETA
    # Factor on the gradient this call accumulates (never on its reported loss or outputs):
    # 1 / group_tokens under token-mean normalisation, else exactly 1.
    grad_scale: float = 1.0


def parse_loss_config(inp: ForwardBackwardInput) -> LossConfig:
    """The call's loss and its config, defaults filled in from the contract."""
    cfg = loss_config(inp.loss_fn, inp.loss_fn_config)
    return LossConfig(
        inp.loss_fn,
        clip_low=cfg.get("clip_low_threshold", DEFAULT_CLIP_LOW),
        clip_high=cfg.get("clip_high_threshold", DEFAULT_CLIP_HIGH),
        beta=cfg.get("beta", DEFAULT_DRO_BETA),
        grad_scale=1.0 / inp.group_tokens if inp.group_tokens else 1.0,
    )


def _numpy(t: torch.Tensor, field: str) -> np.ndarray:
    """A loss input as the shared validator reads it (numpy has no bfloat16: widened)."""
    t = t.detach().cpu()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def prepare_input(
    inp: ForwardBackwardInput, limits: Limits
) -> tuple[LossConfig, list[PreparedDatum]]:
    """Validate one forward_backward input completely with the contract's one validator of
    the message (`lorafleet.validate_msgs`, the gateway's too) against this trainer's
    vocabulary and context length, then convert it; mutates nothing."""
    check_forward_backward(inp, limits, as_array=_numpy)
    cfg = parse_loss_config(inp)
    spec = loss_spec(inp.loss_fn)
    prepared = []
    for datum in inp.data:
        given = datum.loss_fn_inputs
        targets = given["target_tokens"].to(torch.int64)
        d = PreparedDatum(
            list(datum.tokens), targets, context=list(datum.context), window=datum.window
        )
        values = {
            key: given[key].to(torch.float32)
            for key in spec.inputs
            if key != "target_tokens" and key in given
        }
        if inp.loss_fn == "cross_entropy":
            d.weights = values.get("weights", torch.ones(targets.shape, dtype=torch.float32))
        else:
            d.sampling_logprobs = values["logprobs"]
            d.advantages = values["advantages"]
            d.ratio_mask = values.get("sequence_ratio_mask")
        prepared.append(d)
    return cfg, prepared


def per_token_loss(cfg: LossConfig, logp: torch.Tensor, d: PreparedDatum) -> torch.Tensor:
    """Each target token's term of the datum's loss (shaped like `logp`, i.e. like
    target_tokens), differentiable; the datum's loss is exactly `.sum()` of it."""
    if cfg.loss_fn == "cross_entropy":
        return -(logp * _prepared(d.weights, "weights"))
    old = _prepared(d.sampling_logprobs, "sampling_logprobs")
    adv = _prepared(d.advantages, "advantages")
    if cfg.loss_fn == "dro":
        return -(logp * adv) + cfg.beta / 2 * (logp - old) ** 2
    if cfg.loss_fn == "gspo":
        mask = d.ratio_mask if d.ratio_mask is not None else torch.ones_like(logp)
        mean = ((logp - old) * mask).sum() / mask.sum().clamp_min(1.0)
        s = torch.exp(mean)
        return -(mask * torch.minimum(s * adv, s.clamp(cfg.clip_low, cfg.clip_high) * adv))
    ratio = torch.exp(logp - old)
    if cfg.loss_fn == "importance_sampling":
        return -(ratio * adv)
    clipped = ratio.clamp(cfg.clip_low, cfg.clip_high)
    if cfg.loss_fn == "ppo":
        return -torch.minimum(ratio * adv, clipped * adv)
    return -(clipped.detach() * logp * adv)  # cispo


def _prepared(value: torch.Tensor | None, name: str) -> torch.Tensor:
    """An input `prepare_input` fills for this loss; None means the datum skipped it."""
    if value is None:
        raise ValueError(f"PreparedDatum.{name} is unset: the datum was not prepared for this loss")
    return value


def elementwise_output(terms: torch.Tensor) -> torch.Tensor:
    """The `elementwise_loss` output: the detached terms, with -0.0 (from -(logp * 0)) turned
    into 0.0 by adding +0.0, so a zero-weight token reads exactly 0.0, sign bit included."""
    return terms.detach() + 0.0
