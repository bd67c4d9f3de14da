"""The trainer's quantized frozen base: Linear and Embedding modules that hold codes.

`quantize_base` swaps every base `nn.Linear` (the ones `MultiLoraLinear` wraps, lm_head
included) and `nn.Embedding` for a module holding `lorafleet.quantize`'s codes and scales as
buffers, so the base's memory is about a quarter of float32's. Each forward dequantizes one
matrix into a temporary and multiplies by it; the LoRA A/B added on top stay float32 and are
untouched. Backward dequantizes again instead of keeping the temporary (`_DequantLinear`):
autograd would otherwise save every layer's float weight until backward, a whole float32
base at the peak. The rollout's CPU engine multiplies by the same dequantized values
(`lorafleet.quantize.dequantize_in_place`), which is what keeps its logprobs equal to ours.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from lorafleet import quantize
from lorafleet.quantize import Quantized


class _DequantLinear(torch.autograd.Function):
    """x @ W.T (+ bias) with W dequantized from codes in forward and again in backward."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        codes: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(codes, scale)
        return F.linear(x, Quantized(codes, scale).dequantize(x.dtype), bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        codes, scale = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        return grad @ Quantized(codes, scale).dequantize(grad.dtype), None, None, None


# torch declares Function.apply without annotations; this is its signature for _DequantLinear.
_dequant_linear = cast(
    Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor],
    _DequantLinear.apply,
)


class QuantizedLinear(nn.Module):
    """A frozen Linear whose weight is codes and scales (buffers: never trained)."""

    codes: torch.Tensor
    scale: torch.Tensor

    def __init__(self, linear: nn.Linear, weight: Quantized) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.register_buffer("codes", weight.codes)
        self.register_buffer("scale", weight.scale)
        self.bias = linear.bias  # frozen like the rest of the base

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _dequant_linear(x, self.codes, self.scale, self.bias)


class QuantizedEmbedding(nn.Module):
    """A frozen Embedding whose table is codes and scales; a lookup dequantizes its rows."""

    codes: torch.Tensor
    scale: torch.Tensor

    def __init__(self, embedding: nn.Embedding, weight: Quantized) -> None:
        super().__init__()
        self.num_embeddings = embedding.num_embeddings
        self.embedding_dim = embedding.embedding_dim
        self.padding_idx = embedding.padding_idx
        self.dtype = embedding.weight.dtype
        self.register_buffer("codes", weight.codes)
        self.register_buffer("scale", weight.scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return Quantized(self.codes, self.scale).rows(ids, self.dtype)


def quantize_base(model: nn.Module, kind: str) -> None:
    """Swap every Linear and Embedding of `model` for its quantized module, in place (codes
    are made where the weight is). Modules that shared a weight (tied embeddings and lm_head)
    share one set of codes."""
    if kind == quantize.NONE:
        return
    weights = quantize.quantize_model(model, kind)
    for name, module in quantize.matrices(model):
        swapped: nn.Module
        if isinstance(module, nn.Embedding):
            swapped = QuantizedEmbedding(module, weights[name])
        else:
            assert isinstance(module, nn.Linear)  # what quantize.matrices lists
            swapped = QuantizedLinear(module, weights[name])
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, swapped)


def base_nbytes(model: nn.Module) -> int:
    """Bytes of the base's parameters and buffers, each storage counted once."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return total
