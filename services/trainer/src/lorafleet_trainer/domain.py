"""Plain request/response types of the trainer engine (no grpc, no proto).

The servicer converts proto messages into these and back; the engine and its tests speak
only these, so the engine can be driven in-process by tests and benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lorafleet import contract
from lorafleet.contract import ADAM_DEFAULTS


@dataclass(frozen=True)
class LoraSpec:
    """A registration's LoRA configuration, as the controller sends it."""

    rank: int
    alpha: float = 0.0  # 0 = DEFAULT_ALPHA
    dropout: float = 0.0
    seed: int = 0
    target_modules: tuple[str, ...] = ()
    exclude_modules: tuple[str, ...] = ()
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = False
    lora_plus_ratio: float = 0.0  # as on the wire: 0 = unset = 1.0 (contract.b_lr_ratio)
    a_only_weight_decay: bool = False
    # Clip norm of an optim_step that leaves grad_clip_norm unset; 0 = no default.
    max_grad_norm_default: float = 0.0
    # MoE expert banks: one adapter shared by every expert instead of one per expert.
    share_experts: bool = False

    @property
    def effective_alpha(self) -> float:
        return contract.effective_alpha(self.alpha)

    @property
    def scale(self) -> float:
        return self.effective_alpha / self.rank

    @property
    def b_lr_ratio(self) -> float:
        return contract.b_lr_ratio(self.lora_plus_ratio)


@dataclass
class Datum:
    """One Tinker datum: input tokens and per-position loss inputs.

    `context` (trainer-only, no SDK field) makes the datum a truncated-BPTT window: the
    tokens of its document's earlier windows, attended to through keys/values computed
    without gradient (see `lorafleet_trainer.bptt`); it has no targets of its own. `window`
    makes it one even without context (a document's first window), so its keys/values are
    kept for the next.
    """

    tokens: list[int]
    loss_fn_inputs: dict[str, torch.Tensor]
    context: list[int] = field(default_factory=list)
    window: bool = False


@dataclass
class ForwardBackwardInput:
    data: list[Datum]
    loss_fn: str
    loss_fn_config: dict[str, float] = field(default_factory=dict)
    forward_only: bool = False
    # Token-mean normalisation over an accumulation group (trainer-only, no SDK field): the
    # total prediction tokens of every chunk of the group. When > 0 the gradient this call
    # accumulates is that of loss / group_tokens, so once the group's chunks are in, the slot
    # holds sum(grad loss) / group_tokens, which optim_step then clips. 0 = Tinker's sum.
    group_tokens: int = 0


@dataclass
class ForwardBackwardItem:
    """One slot's share of a cross-slot batch, executing one ledger operation."""

    operation_id: str
    slot: int
    registration_id: str
    input: ForwardBackwardInput


@dataclass
class ForwardBackwardOutput:
    logprobs: list[torch.Tensor]  # per datum, shaped like its target_tokens
    metrics: dict[str, float]
    # Per datum, like logprobs: each target token's term of the (unscaled) summed loss.
    elementwise_loss: list[torch.Tensor]


@dataclass(frozen=True)
class AdamParams:
    learning_rate: float = ADAM_DEFAULTS["learning_rate"]
    beta1: float = ADAM_DEFAULTS["beta1"]
    beta2: float = ADAM_DEFAULTS["beta2"]
    eps: float = ADAM_DEFAULTS["eps"]
    weight_decay: float = ADAM_DEFAULTS["weight_decay"]
    # None (unset on the wire): the run's max_grad_norm_default; a set 0 means no clipping.
    grad_clip_norm: float | None = ADAM_DEFAULTS["grad_clip_norm"]
    # None: the run's a_only_weight_decay; managed jobs set True (juno: B is never decayed).
    a_only_weight_decay: bool | None = None


@dataclass
class OptimStepResult:
    metrics: dict[str, float]
    applied: bool
    note: str = ""


@dataclass(frozen=True)
class StateRef:
    """Where a saved state lives and what its manifest must hash to."""

    uri: str
    sha256: str
    size_bytes: int


@dataclass(frozen=True)
class SlotInfo:
    slot: int
    registration_id: str  # "" = free
    spec: LoraSpec | None
    optim_steps: int
    has_pending_gradients: bool
    tokens_trained: int
