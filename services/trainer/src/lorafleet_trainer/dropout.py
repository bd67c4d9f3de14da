"""Stateless hashed dropout masks for the LoRA path.

A mask bit is a pure function of (seed, optimizer step, accumulation ordinal, token
position, module, input feature). Nothing is drawn from a global RNG, so two runs that make
the same calls produce bit-identical adapters, whatever else ran in between, and the
masks do not depend on how datums were grouped into batches.

The hash is a 32-bit integer mixer evaluated in int64 arithmetic: every operand stays below
2**32 and the multiplier below 2**31, so no product overflows int64 and torch gives the
same bits on every device.
"""

from __future__ import annotations

import zlib

import torch

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B


def mix32(x: int) -> int:
    """The scalar form of `mix32_tensor`, for per-row keys computed in Python."""
    x &= _M32
    x = (((x >> 16) ^ x) * _MUL) & _M32
    x = (((x >> 16) ^ x) * _MUL) & _M32
    return (x >> 16) ^ x


def mix32_tensor(x: torch.Tensor) -> torch.Tensor:
    x = (((x >> 16) ^ x) * _MUL) & _M32
    x = (((x >> 16) ^ x) * _MUL) & _M32
    return (x >> 16) ^ x


def row_key(seed: int, optim_step: int, ordinal: int) -> int:
    """Key of one datum's masks: its slot seed, the slot's step count and its ordinal."""
    h = mix32(seed & _M32)
    h = mix32(h ^ ((seed >> 32) & _M32))
    h = mix32(h ^ (optim_step & _M32))
    return mix32(h ^ (ordinal & _M32))


def module_key(module_name: str) -> int:
    """Layer and projection identity: a stable hash of the module's full name."""
    return zlib.crc32(module_name.encode())


class RowDropout:
    """The dropout of one forward pass: each batch row's mask key and drop probability.

    Built once per forward and asked for a mask by every wrapped Linear, so a batch that mixes
    slots with different probabilities (or rows without dropout: p = 0 keeps everything,
    exactly) costs one vectorised hash per module instead of one per slot.
    """

    def __init__(self, row_keys: list[int], p: list[float], device: torch.device) -> None:
        self.keys = torch.tensor(row_keys, dtype=torch.int64, device=device).view(-1, 1, 1)
        self.thresholds = torch.tensor(
            [int(q * 2**32) for q in p], dtype=torch.int64, device=device
        ).view(-1, 1, 1)
        self.keep_scale = torch.tensor(
            [1.0 / (1.0 - q) for q in p], dtype=torch.float32, device=device
        ).view(-1, 1, 1)

    def mask(self, module: int, seq_len: int, features: int) -> torch.Tensor:
        """Inverted-dropout multiplier of shape (rows, seq_len, features): 0 or 1/(1-p)."""
        device = self.keys.device
        h = mix32_tensor(self.keys ^ module)
        pos = torch.arange(seq_len, device=device, dtype=torch.int64).view(1, -1, 1)
        h = mix32_tensor(h ^ pos)
        feat = torch.arange(features, device=device, dtype=torch.int64).view(1, 1, -1)
        h = mix32_tensor(h ^ mix32_tensor(feat + 0x9E3779B))
        return (h >= self.thresholds).to(torch.float32) * self.keep_scale
