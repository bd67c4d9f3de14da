"""Run by the SGLang server's interpreters (this folder is on their PYTHONPATH only).

Without CUDA, `pin_memory` becomes a no-op: SGLang's LoRA layers (`srt/lora/layers.py`) pin
host memory unconditionally, and torch raises "pin_memory=True requires a CUDA or other
accelerator backend", which kills the scheduler at start-up. Pinning only speeds up host to
device copies, which do not exist on the CPU backend.
"""

from __future__ import annotations

import functools

import torch

_FACTORIES = (
    "empty",
    "zeros",
    "ones",
    "full",
    "tensor",
    "arange",
    "rand",
    "randn",
    "randint",
    "empty_strided",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
)


def _without_pin_memory(factory):  # type: ignore[no-untyped-def]
    @functools.wraps(factory)
    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return wrapper


if not torch.cuda.is_available():
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    for _name in _FACTORIES:
        setattr(torch, _name, _without_pin_memory(getattr(torch, _name)))
