"""The running batch's KV cache, for continuous batching on transformers' Cache API.

Rows are left-padded to one shared length L: `mask` [B, L] marks real positions, so each row
attends only to its own tokens, and `next_pos` [B] is each row's next position id. Newly
prefilled rows join by left-padding whichever side is shorter and concatenating along the
batch; finished rows leave by index selection; leading columns that are padding in every
row are dropped, so the cache never grows beyond the longest live sequence.

Each layer's keys and values live in a buffer with spare columns (`SlabLayer`): a decode step
writes its one column in place. transformers' DynamicLayer concatenates instead, which copies
the whole cache on every token (O(n^2) bytes over a generation). Buffers are rebuilt only when
the batch's rows change, sized for the tokens the live rows may still generate (bounded, so
an open-ended request does not reserve its whole context up front; past that they double).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DynamicLayer

#: Spare columns reserved on a rebuild are at most the live length plus this.
_MIN_SPARE = 64


def _spare(length: int, room: int) -> int:
    return max(0, min(room, length + _MIN_SPARE))


class SlabLayer(DynamicLayer):
    """A DynamicLayer whose `keys`/`values` are views [..., :length, :] of larger buffers."""

    def __init__(self) -> None:
        super().__init__()
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None

    def load(self, keys: torch.Tensor, values: torch.Tensor, spare: int) -> None:
        """Hold these live keys/values in fresh buffers with `spare` free columns."""
        length = keys.shape[-2]
        shape = (*keys.shape[:-2], length + spare, keys.shape[-1])
        self._kbuf = keys.new_empty(shape)
        self._vbuf = values.new_empty(shape)
        self._kbuf[..., :length, :] = keys
        self._vbuf[..., :length, :] = values
        self.keys = self._kbuf[..., :length, :]
        self.values = self._vbuf[..., :length, :]
        self.device = keys.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._kbuf is None or self._vbuf is None:  # prefill: exact size, rebuilt right after
            self.load(key_states, value_states, 0)
            return self.keys, self.values
        length = self.keys.shape[-2]
        end = length + key_states.shape[-2]
        if end > self._kbuf.shape[-2]:  # past the reservation: double
            self.load(self.keys, self.values, max(end, 2 * length) - length)
        self._kbuf[..., length:end, :] = key_states
        self._vbuf[..., length:end, :] = value_states
        self.keys = self._kbuf[..., :end, :]
        self.values = self._vbuf[..., :end, :]
        return self.keys, self.values


def new_cache() -> Cache:
    """An empty cache of SlabLayers (one per model layer, created on first use)."""
    return Cache(layer_class_to_replicate=SlabLayer)


def _pad_left(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    if n == 0:
        return t
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([t.new_zeros(shape), t], dim=dim)


@dataclass
class KVBatch:
    cache: Cache
    mask: torch.Tensor
    next_pos: torch.Tensor
    layers: list[SlabLayer] = field(init=False)

    def __post_init__(self) -> None:
        self.layers = list(self.cache.layers)  # type: ignore[arg-type]

    @property
    def size(self) -> int:
        return int(self.mask.shape[0])

    @property
    def length(self) -> int:
        return int(self.mask.shape[1])

    def extend(self, other: KVBatch, room: int) -> None:
        """Append `other`'s rows (consumes it); `room` = most tokens any live row may add."""
        length = max(self.length, other.length)
        mine_pad, theirs_pad = length - self.length, length - other.length
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            keys = torch.cat(
                [_pad_left(mine.keys, mine_pad, -2), _pad_left(theirs.keys, theirs_pad, -2)]
            )
            values = torch.cat(
                [_pad_left(mine.values, mine_pad, -2), _pad_left(theirs.values, theirs_pad, -2)]
            )
            mine.load(keys, values, _spare(length, room))
        self.mask = torch.cat(
            [_pad_left(self.mask, mine_pad, 1), _pad_left(other.mask, theirs_pad, 1)]
        )
        self.next_pos = torch.cat([self.next_pos, other.next_pos])

    def select(self, rows: torch.Tensor, room: int) -> None:
        """Keep (or repeat) the given rows, in that order, and drop all-padding columns."""
        mask = self.mask.index_select(0, rows)
        used = mask.any(dim=0).nonzero()
        start = int(used[0]) if used.numel() else self.length
        self.mask = mask[:, start:]
        self.next_pos = self.next_pos.index_select(0, rows)
        spare = _spare(self.length, room)
        for layer in self.layers:
            layer.load(
                layer.keys[..., start:, :].index_select(0, rows),
                layer.values[..., start:, :].index_select(0, rows),
                spare,
            )

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
