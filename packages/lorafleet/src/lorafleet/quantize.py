"""The frozen base's weight quantization: the one owner of its names and of its maths.

A trainer and a rollout of one base model must compute with the same weights, or the
sampler's logprobs drift from the trainer's and RL pays for it. So both quantize here, and
deterministically (elementwise ops only, round half to even): `quantize` turns a matrix into
codes and float32 scales, `Quantized.dequantize` turns them back into the weight both engines
multiply by. The trainer keeps the codes (one byte a weight) and dequantizes one matrix at a
time inside its matmul (`lorafleet_trainer.quantized`); the CPU rollout engine dequantizes
once at load (`dequantize_in_place`) and packs the result like any float weight, so its
oneDNN GEMMs and C kernels run unchanged on exactly the trainer's values. The sampler's
memory is therefore not reduced on CPU; on a GPU the serving engine quantizes itself
(`sglang_server`: `--quantization fp8`, the same per-matrix e4m3 weights as "fp8" here).

Which matrices: every `nn.Linear` and `nn.Embedding` (`matrices`). Tied embeddings and
lm_head are one matrix, quantized once; int8's per-output-row scale is then per vocabulary
row, so the embedding lookup and the tied lm_head read the same codes. Expert banks (3-D),
norms and biases stay as loaded.

Why torch's own ops, not torchao nor `torch._weight_int8pack_mm`: measured here (one
thread, a 1024x512 activation times the bench model's 512x1536 weight, torch 2.13 CPU):
float32 linear 45 ms, dequantize + float32 linear 45 ms (the dequantize 0.8 ms),
`_weight_int8pack_mm` 1536 ms (no fast CPU kernel for float32 activations); backward
g @ W 29 ms against 44-49 ms dequantized (the codes are re-read rather than a float copy
kept). torchao's int8 weight-only layout in eager mode is the same dequantize-then-mm or
that op, behind a tensor subclass and a wheel pinned to torch's ABI: a dependency that buys
nothing on CPU, and one more thing to keep in step with SGLang's and vLLM's torch pins.

Torch is imported inside the functions: the settings of both services validate their
`quantization` against `QUANTIZATIONS` before torch is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

NONE = "none"
INT8 = "int8"
FP8 = "fp8"
#: "none": the weights as loaded; "int8": weight-only, symmetric, one scale per output row
#: (the CPU path); "fp8": e4m3 codes with one scale per matrix (SGLang's and vLLM's online
#: `--quantization fp8` weights). A setting of each replica, never of a registration: every
#: trainer and rollout of a base model must run the same one (the controller refuses a
#: replica that differs).
QUANTIZATIONS = (NONE, INT8, FP8)
#: The `--quantization` flag of SGLang and vLLM for each setting they serve: their online fp8
#: quantizes weights per matrix to e4m3 as `quantize` does (they also quantize activations
#: on GPUs with fp8 GEMMs, which the trainer does not: bench/gpu_check.py measures the gap).
#: Neither quantizes a float checkpoint to int8 weight-only, so "int8" is the torch engine's.
ENGINE_FLAGS = {FP8: "fp8"}
_INT8_MAX = 127.0
_FP8_MAX = 448.0  # the largest finite float8_e4m3fn


@dataclass(frozen=True)
class Quantized:
    """One matrix's codes ([out, in] int8 or float8_e4m3fn) and float32 scales ([out, 1] for
    int8, [1, 1] for fp8): weight ~= codes * scale."""

    codes: torch.Tensor
    scale: torch.Tensor

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight both engines compute with: float32 codes times scales, then `dtype`."""
        import torch

        weight = self.codes.to(torch.float32) * self.scale
        return weight if dtype is None else weight.to(dtype)

    def rows(self, index: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """`dequantize()[index]` without dequantizing the other rows (an embedding lookup);
        elementwise the same products, so the same values."""
        import torch

        scale = self.scale[index] if self.scale.shape[0] > 1 else self.scale
        weight = self.codes[index].to(torch.float32) * scale
        return weight if dtype is None else weight.to(dtype)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes


def quantize(weight: torch.Tensor, kind: str) -> Quantized:
    """Codes and scales of a 2-D weight. int8: scale = max|row| / 127 (a zero row gets 1),
    codes = round(w / scale); fp8: scale = max|w| / 448, codes = e4m3(w / scale)."""
    import torch

    w = weight.detach().to(torch.float32)
    if kind == INT8:
        amax = w.abs().amax(dim=1, keepdim=True)
        scale = torch.where(amax > 0, amax / _INT8_MAX, torch.ones_like(amax))
        codes = torch.round(w / scale).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    elif kind == FP8:
        amax = w.abs().amax().reshape(1, 1)
        scale = torch.where(amax > 0, amax / _FP8_MAX, torch.ones_like(amax))
        codes = (w / scale).clamp_(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    else:
        raise ValueError(f"quantization {kind!r} is not one of {QUANTIZATIONS}")
    return Quantized(codes, scale)


def matrices(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module whose weight is quantized (Linear and Embedding), by module name."""
    from torch import nn

    return [
        (name, module)
        for name, module in model.named_modules()
        if name and isinstance(module, nn.Linear | nn.Embedding)
    ]


def quantize_model(model: nn.Module, kind: str) -> dict[str, Quantized]:
    """The quantized weight of every module of `matrices(model)`, by module name; modules
    that share one weight (tied embeddings) share one `Quantized`."""
    by_weight: dict[int, Quantized] = {}
    out: dict[str, Quantized] = {}
    for name, module in matrices(model):
        weight = _weight(module)
        if id(weight) not in by_weight:
            by_weight[id(weight)] = quantize(weight, kind)
        out[name] = by_weight[id(weight)]
    return out


def dequantize_in_place(model: nn.Module, kind: str) -> None:
    """Replace every quantized matrix's weight by its dequantized values, in its own dtype:
    an engine that multiplies float weights then computes with the trainer's values."""
    import torch

    if kind == NONE:
        return
    done: set[int] = set()
    quantized = quantize_model(model, kind)
    with torch.no_grad():
        for name, module in matrices(model):
            weight = _weight(module)
            if id(weight) not in done:
                weight.copy_(quantized[name].dequantize(weight.dtype))
                done.add(id(weight))


def _weight(module: nn.Module) -> torch.Tensor:
    """A listed module's weight (nn.Module attributes are untyped)."""
    import torch

    weight = module.weight
    assert isinstance(weight, torch.Tensor), type(module).__name__
    return weight
