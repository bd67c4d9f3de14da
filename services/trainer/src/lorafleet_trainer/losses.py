"""Tinker's loss functions: validation of their inputs and their per-datum sums.

All losses are token-level sums, never means (tinker-api.md §7.3, §9.3): K chunked calls
must accumulate exactly the gradient of one large call. With r = exp(logp - sampling_logp)
and A the advantages:

- cross_entropy:        -(logp * weights).sum(); targets (N,) or top-K (N, K).
- importance_sampling:  -(r * A).sum()
- ppo:                  -min(r * A, clip(r, lo, hi) * A).sum()
- cispo:                -(sg(clip(r, lo, hi)) * logp * A).sum()
- dro:                  -(logp * A).sum() + beta / 2 * ((logp - sampling_logp) ** 2).sum()
                        (the DRO objective as in the Tinker docs; beta from loss_fn_config,
                        default 0.05)
- gspo:                 s = exp(mean over m of (logp - sampling_logp)) per datum, where m is
                        `sequence_ratio_mask` (default: every position);
                        -(m * min(s * A, clip(s, lo, hi) * A)).sum()

lo/hi come from loss_fn_config clip_low_threshold / clip_high_threshold (default 0.8/1.2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lorafleet.errors import InvalidArgument
from lorafleet_trainer.domain import ForwardBackwardInput

SUPPORTED_LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo")
RL_LOSSES = SUPPORTED_LOSSES[1:]
CLIPPED = ("ppo", "cispo", "gspo")
DEFAULT_CLIP_LOW = 0.8
DEFAULT_CLIP_HIGH = 1.2
DEFAULT_DRO_BETA = 0.05


@dataclass
class PreparedDatum:
    """A validated datum, its tensors in canonical dtypes."""

    tokens: list[int]
    target_tokens: torch.Tensor  # int64, (N,) or (N, K)
    weights: torch.Tensor | None = None  # float32, like target_tokens (cross_entropy)
    sampling_logprobs: torch.Tensor | None = None  # float32 (N,) (RL losses)
    advantages: torch.Tensor | None = None  # float32 (N,)
    ratio_mask: torch.Tensor | None = None  # float32 (N,) (gspo)


@dataclass(frozen=True)
class LossConfig:
    loss_fn: str
    clip_low: float = DEFAULT_CLIP_LOW
    clip_high: float = DEFAULT_CLIP_HIGH
    beta: float = DEFAULT_DRO_BETA


def _finite_number(cfg: dict[str, float], key: str, default: float) -> float:
    value = cfg.get(key, default)
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgument(
            f"must be a finite number, got {value!r}", field=f"loss_fn_config.{key}"
        )
    return float(value)


def parse_loss_config(loss_fn: str, cfg: dict[str, float]) -> LossConfig:
    if loss_fn not in SUPPORTED_LOSSES:
        raise InvalidArgument(
            f"unsupported loss {loss_fn!r}; supported: {', '.join(SUPPORTED_LOSSES)}",
            field="loss_fn",
        )
    lo = _finite_number(cfg, "clip_low_threshold", DEFAULT_CLIP_LOW)
    hi = _finite_number(cfg, "clip_high_threshold", DEFAULT_CLIP_HIGH)
    beta = _finite_number(cfg, "beta", DEFAULT_DRO_BETA)
    if lo < 0:
        raise InvalidArgument("must be >= 0", field="loss_fn_config.clip_low_threshold")
    if hi < lo:
        raise InvalidArgument(
            "must be >= clip_low_threshold", field="loss_fn_config.clip_high_threshold"
        )
    if beta < 0:
        raise InvalidArgument("must be >= 0", field="loss_fn_config.beta")
    return LossConfig(loss_fn, lo, hi, beta)


def _tensor(
    inputs: dict[str, torch.Tensor],
    key: str,
    field: str,
    *,
    integer: bool,
    shape: tuple[int, ...] | None,
) -> torch.Tensor:
    t = inputs.get(key)
    if t is None:
        raise InvalidArgument("required for this loss", field=f"{field}.{key}")
    if integer and (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool):
        raise InvalidArgument(f"must be an integer tensor, got {t.dtype}", field=f"{field}.{key}")
    if shape is not None and tuple(t.shape) != shape:
        raise InvalidArgument(
            f"shape {list(t.shape)} must be {list(shape)} (one entry per input token)",
            field=f"{field}.{key}",
        )
    if integer:
        return t.to(torch.int64)
    t = t.to(torch.float32)
    if not bool(torch.isfinite(t).all()):
        raise InvalidArgument("contains a non-finite value", field=f"{field}.{key}")
    return t


def prepare_input(
    inp: ForwardBackwardInput, vocab_size: int, max_length: int
) -> tuple[LossConfig, list[PreparedDatum]]:
    """Validate one forward_backward input completely; raises InvalidArgument, mutates nothing."""
    cfg = parse_loss_config(inp.loss_fn, inp.loss_fn_config)
    if not inp.data:
        raise InvalidArgument("at least one datum is required", field="data")
    prepared = []
    for j, datum in enumerate(inp.data):
        field = f"data[{j}]"
        n = len(datum.tokens)
        if n == 0:
            raise InvalidArgument("must not be empty", field=f"{field}.tokens")
        if n > max_length:
            raise InvalidArgument(
                f"{n} tokens exceed the context length {max_length}", field=f"{field}.tokens"
            )
        bad = next((t for t in datum.tokens if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidArgument(
                f"token id {bad} is outside the vocabulary [0, {vocab_size})",
                field=f"{field}.tokens",
            )
        fin = f"{field}.loss_fn_inputs"
        targets = _tensor(datum.loss_fn_inputs, "target_tokens", fin, integer=True, shape=None)
        allowed_rank = (1, 2) if cfg.loss_fn == "cross_entropy" else (1,)
        if targets.dim() not in allowed_rank or targets.shape[0] != n or targets.numel() == 0:
            want = "(N,) or (N, K)" if cfg.loss_fn == "cross_entropy" else "(N,)"
            raise InvalidArgument(
                f"shape {list(targets.shape)} must be {want} with N = {n} input tokens",
                field=f"{fin}.target_tokens",
            )
        if bool(((targets < 0) | (targets >= vocab_size)).any()):
            raise InvalidArgument(
                f"a target id is outside the vocabulary [0, {vocab_size})",
                field=f"{fin}.target_tokens",
            )
        d = PreparedDatum(tokens=list(datum.tokens), target_tokens=targets)
        if cfg.loss_fn == "cross_entropy":
            d.weights = _tensor(
                datum.loss_fn_inputs, "weights", fin, integer=False, shape=tuple(targets.shape)
            )
        else:
            d.sampling_logprobs = _tensor(
                datum.loss_fn_inputs, "logprobs", fin, integer=False, shape=(n,)
            )
            d.advantages = _tensor(
                datum.loss_fn_inputs, "advantages", fin, integer=False, shape=(n,)
            )
            if cfg.loss_fn == "gspo" and "sequence_ratio_mask" in datum.loss_fn_inputs:
                d.ratio_mask = _tensor(
                    datum.loss_fn_inputs, "sequence_ratio_mask", fin, integer=False, shape=(n,)
                )
        prepared.append(d)
    return cfg, prepared


def datum_loss(cfg: LossConfig, logp: torch.Tensor, d: PreparedDatum) -> torch.Tensor:
    """The summed loss of one datum given its target logprobs (shaped like target_tokens)."""
    if cfg.loss_fn == "cross_entropy":
        return -(logp * d.weights).sum()
    old, adv = d.sampling_logprobs, d.advantages
    if cfg.loss_fn == "dro":
        return -(logp * adv).sum() + cfg.beta / 2 * ((logp - old) ** 2).sum()
    if cfg.loss_fn == "gspo":
        mask = d.ratio_mask if d.ratio_mask is not None else torch.ones_like(logp)
        mean = ((logp - old) * mask).sum() / mask.sum().clamp_min(1.0)
        s = torch.exp(mean)
        return -(mask * torch.minimum(s * adv, s.clamp(cfg.clip_low, cfg.clip_high) * adv)).sum()
    ratio = torch.exp(logp - old)
    if cfg.loss_fn == "importance_sampling":
        return -(ratio * adv).sum()
    clipped = ratio.clamp(cfg.clip_low, cfg.clip_high)
    if cfg.loss_fn == "ppo":
        return -torch.minimum(ratio * adv, clipped * adv).sum()
    return -(clipped.detach() * logp * adv).sum()  # cispo
