"""The PEFT layout of LoRA on fused MoE expert banks: the one rule the trainer writes and every
rollout reader (torch engine, SGLang driver) reads.

transformers stores an MoE layer's experts as 3-D parameters of one module (`gate_up_proj`
(experts, 2 * intermediate, hidden), `down_proj` (experts, hidden, intermediate)). PEFT adapts
them as `target_parameters`, and its files lay them out as:

- Keys: one lora_A/lora_B pair per targeted bank, keyed by the experts module. PEFT nests one
  ParamWrapper per targeted parameter of a module, in the module's parameter order, the last one
  outermost, so the i-th of k targeted banks sits under k-1-i `.base_layer` hops.
- Tensors: lora_A is (experts * rank, in), expert-major row blocks; lora_B is
  (out, rank * experts) with expert-interleaved columns (PEFT reads it as (out, rank, experts)).

Keeping this here means a change to PEFT's layout is made once and the trainer's export and
the readers cannot drift apart. Torch-free on purpose (tensor methods only), like
`lorafleet.tensors`, so the package does not depend on torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

#: The fused expert parameters PEFT `target_parameters` LoRA can target.
EXPERT_BANKS = ("gate_up_proj", "down_proj")
_HOP = ".base_layer"


def bank_prefix(module_key: str, index: int, count: int) -> str:
    """The key prefix (key without `.lora_A.weight`) of the `index`-th of `count` targeted banks
    of the experts module keyed `module_key`."""
    return module_key + _HOP * (count - 1 - index)


def split_hops(prefix: str) -> tuple[str, int]:
    """(module key, `.base_layer` hops) of a key prefix; inverse of `bank_prefix`."""
    hops = 0
    while prefix.endswith(_HOP):
        prefix, hops = prefix.removesuffix(_HOP), hops + 1
    return prefix, hops


def bank_at(hops: int, targeted: Sequence[str]) -> str | None:
    """Which of a module's `targeted` banks (in parameter order) a prefix with `hops` hops
    names, or None if it names none."""
    index = len(targeted) - 1 - hops
    return targeted[index] if 0 <= index < len(targeted) else None


def to_peft(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """PEFT's lora_A (experts * rank, in) and lora_B (out, rank * experts) from per-expert
    A (experts, rank, in) and B (experts, out, rank)."""
    experts, rank, fan_in = a.shape
    return a.reshape(experts * rank, fan_in), b.permute(1, 2, 0).reshape(b.shape[1], -1)


def from_peft(a: Tensor, b: Tensor, experts: int) -> tuple[Tensor, Tensor]:
    """Per-expert A (experts, rank, in) and B (experts, out, rank) of PEFT's lora_A and lora_B
    (views where the inputs are contiguous); inverse of `to_peft`."""
    rank = a.shape[0] // experts
    return a.reshape(experts, rank, a.shape[1]), b.reshape(b.shape[0], rank, experts).permute(
        2, 0, 1
    )
