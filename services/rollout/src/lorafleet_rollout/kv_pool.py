"""Keys/values buffers of prompts and decode segments, kept for the next ones.

A prompt's keys/values buffer is big (a 1,000-token prompt of the bench model is ~25 MB) and
short-lived: a fresh one each cost ~12 % of workload (c) (4 x 1,500-token prompts,
bench/sampling.py --vs-vllm) in page faults and unmapping, and (d)'s first pass ran ~20 %
slower than later ones (glibc maps buffers this big afresh until its threshold adapts; over
32 MB, always). So finished buffers are kept, up to `SPARE_KV_BYTES`, and reused whole.
"""

from __future__ import annotations

import math

import torch

#: Bytes of prompt and segment keys/values buffers kept for the next ones (the engine
#: releases them with its idle decode cache).
SPARE_KV_BYTES = 1 << 30


class KvPool:
    """Spare flat buffers, handed out as views of the shape asked for. Used by one thread."""

    def __init__(self) -> None:
        self.spare: list[torch.Tensor] = []

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A keys/values buffer: the smallest spare one that is big enough (its pages are
        mapped already), else a new one. Uninitialised."""
        need = math.prod(shape)
        fits = [i for i, spare in enumerate(self.spare) if spare.numel() >= need]
        if not fits:
            return torch.empty(shape, dtype=dtype)
        spare = self.spare.pop(min(fits, key=lambda i: self.spare[i].numel()))
        return spare[:need].view(shape)

    def give(self, kv: torch.Tensor) -> None:
        """Keep kv's memory for `take` (nothing may read kv any more)."""
        self.spare.append(kv.new_empty(0).set_(kv.untyped_storage()))
        while sum(t.untyped_storage().nbytes() for t in self.spare) > SPARE_KV_BYTES:
            self.spare.pop(0)

    def clear(self) -> None:
        self.spare.clear()
