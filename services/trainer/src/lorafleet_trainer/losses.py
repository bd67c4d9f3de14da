"""Tinker's loss functions: validation of their inputs, and their per-token terms.

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

import torch

from lorafleet.contract import (
    DEFAULT_CLIP_HIGH,
    DEFAULT_CLIP_LOW,
    DEFAULT_DRO_BETA,
    INT_INPUTS,
    loss_config,
    loss_spec,
)
from lorafleet.errors import InvalidArgument
from lorafleet_trainer.domain import ForwardBackwardInput

# Losses whose targets may be top-K (N, K); every other input is one value per position.
TOPK_LOSSES = ("cross_entropy",)


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
    if isinstance(inp.group_tokens, bool) or not isinstance(inp.group_tokens, int):
        raise InvalidArgument(f"must be an integer, got {inp.group_tokens!r}", field="group_tokens")
    if inp.group_tokens < 0:
        raise InvalidArgument(
            f"must be >= 0 (0 = plain sum), got {inp.group_tokens}", field="group_tokens"
        )
    return LossConfig(
        inp.loss_fn,
        clip_low=cfg.get("clip_low_threshold", DEFAULT_CLIP_LOW),
        clip_high=cfg.get("clip_high_threshold", DEFAULT_CLIP_HIGH),
        beta=cfg.get("beta", DEFAULT_DRO_BETA),
        grad_scale=1.0 / inp.group_tokens if inp.group_tokens else 1.0,
    )


def _tensor(
    t: torch.Tensor,
    key: str,
    field: str,
    *,
    shape: tuple[int, ...] | None,
) -> torch.Tensor:
    integer = key in INT_INPUTS
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


def _check_ids(ids: list[int], vocab_size: int, field: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidArgument(
            f"token id {bad} is outside the vocabulary [0, {vocab_size})", field=field
        )


def prepare_input(
    inp: ForwardBackwardInput, vocab_size: int, max_length: int
) -> tuple[LossConfig, list[PreparedDatum]]:
    """Validate one forward_backward input completely; raises InvalidArgument, mutates nothing."""
    cfg = parse_loss_config(inp)
    spec = loss_spec(inp.loss_fn)
    if not inp.data:
        raise InvalidArgument("at least one datum is required", field="data")
    prepared = []
    for j, datum in enumerate(inp.data):
        field = f"data[{j}]"
        n = len(datum.tokens)
        if n == 0:
            raise InvalidArgument("must not be empty", field=f"{field}.tokens")
        if n + len(datum.context) > max_length:
            raise InvalidArgument(
                f"{n} tokens after {len(datum.context)} of context exceed the context length"
                f" {max_length}",
                field=f"{field}.tokens",
            )
        _check_ids(datum.tokens, vocab_size, f"{field}.tokens")
        _check_ids(datum.context, vocab_size, f"{field}.context")
        fin = f"{field}.loss_fn_inputs"
        given = datum.loss_fn_inputs
        missing = next((k for k in spec.required if k not in given), None)
        if missing is not None:
            raise InvalidArgument("required for this loss", field=f"{fin}.{missing}")
        targets = _tensor(given["target_tokens"], "target_tokens", fin, shape=None)
        topk = inp.loss_fn in TOPK_LOSSES
        if (
            targets.dim() not in ((1, 2) if topk else (1,))
            or targets.shape[0] != n
            or targets.numel() == 0
        ):
            want = "(N,) or (N, K)" if topk else "(N,)"
            raise InvalidArgument(
                f"shape {list(targets.shape)} must be {want} with N = {n} input tokens",
                field=f"{fin}.target_tokens",
            )
        if bool(((targets < 0) | (targets >= vocab_size)).any()):
            raise InvalidArgument(
                f"a target id is outside the vocabulary [0, {vocab_size})",
                field=f"{fin}.target_tokens",
            )
        d = PreparedDatum(
            list(datum.tokens), targets, context=list(datum.context), window=datum.window
        )
        per_target = tuple(targets.shape)
        values = {
            key: _tensor(given[key], key, fin, shape=per_target if key == "weights" else (n,))
            for key in spec.inputs
            if key != "target_tokens" and key in given
        }
        if inp.loss_fn == "cross_entropy":
            d.weights = values.get("weights", torch.ones(per_target, dtype=torch.float32))
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
