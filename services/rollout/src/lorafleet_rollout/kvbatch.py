"""The running batch's KV cache, for continuous batching on a transformers DynamicCache.

Rows are left-padded to one shared length L: `mask` [B, L] marks real positions, so each row
attends only to its own tokens, and `next_pos` [B] is each row's next position id. Newly
prefilled rows join by left-padding whichever side is shorter and concatenating along the
batch; finished rows leave by index selection; leading columns that are padding in every
row are dropped, so the cache never grows beyond the longest live sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache


def _pad_left(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    if n == 0:
        return t
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([t.new_zeros(shape), t], dim=dim)


@dataclass
class KVBatch:
    cache: DynamicCache
    mask: torch.Tensor
    next_pos: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.mask.shape[0])

    @property
    def length(self) -> int:
        return int(self.mask.shape[1])

    def _pad(self, n: int) -> None:
        for layer in self.cache.layers:
            layer.keys = _pad_left(layer.keys, n, dim=-2)
            layer.values = _pad_left(layer.values, n, dim=-2)
        self.mask = _pad_left(self.mask, n, dim=1)

    def extend(self, other: KVBatch) -> None:
        """Append `other`'s rows (consumes it)."""
        length = max(self.length, other.length)
        self._pad(length - self.length)
        other._pad(length - other.length)
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.keys = torch.cat([mine.keys, theirs.keys], dim=0)
            mine.values = torch.cat([mine.values, theirs.values], dim=0)
        self.mask = torch.cat([self.mask, other.mask], dim=0)
        self.next_pos = torch.cat([self.next_pos, other.next_pos], dim=0)

    def select(self, rows: torch.Tensor) -> None:
        """Keep (or repeat) the given rows, in that order, and drop all-padding columns."""
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, rows)
            layer.values = layer.values.index_select(0, rows)
        self.mask = self.mask.index_select(0, rows)
        self.next_pos = self.next_pos.index_select(0, rows)
        used = self.mask.any(dim=0).nonzero()
        start = int(used[0]) if used.numel() else self.length
        if start:
            for layer in self.cache.layers:
                layer.keys = layer.keys[..., start:, :]
                layer.values = layer.values[..., start:, :]
            self.mask = self.mask[:, start:]

    def step_inputs(self) -> dict[str, torch.Tensor]:
        """Attention mask, position ids and cache positions for one decode step."""
        self.mask = torch.cat([self.mask, self.mask.new_ones((self.size, 1))], dim=1)
        positions = self.next_pos[:, None]
        self.next_pos = self.next_pos + 1
        return {
            "attention_mask": self.mask,
            "position_ids": positions,
            "cache_position": torch.tensor([self.length - 1]),
        }
