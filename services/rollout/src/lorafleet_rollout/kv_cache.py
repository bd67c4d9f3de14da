"""Where decoding rows keep keys and values: each row's own slot (`SlotCache`), and prompt
prefixes several rows read once per step (`Segment`)."""

from __future__ import annotations

import torch


class SlotCache:
    """Keys and values of the decoding sequences: one buffer [layers, 2, slots, kv_heads,
    capacity, head], seen per layer as `keys[i]` and `values[i]` [slots, kv_heads, capacity,
    head] (contiguous views).

    Row i of the running batch lives in slot i; a finished row's slot is refilled by moving
    the last rows down (a copy of those rows only), and a step writes one column per row in
    place. One buffer means filling, moving or regrowing is one copy for every layer. Buffers
    grow (slots by doubling) zero-filled: masked columns must hold finite values, as
    0 * inf would poison the attention output; later they hold earlier rows' keys and
    values (a refilled slot, a buffer kept from the last batch), finite too.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self.shape = (layers, kv_heads, head_dim)
        self.dtype = dtype
        self.store: torch.Tensor | None = None
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.slots = 0
        self.capacity = 0

    def reserve(self, slots: int, capacity: int, used: int | None = None) -> None:
        """Room for `slots` rows of `capacity` columns; rows from `slots` on are free (the
        live rows come first). Live rows keep their first `used` columns (None: all); a
        regrowth sizes columns by that, not by the old capacity, so one long row that has
        since moved onto a shared segment does not size every slot. Growing slots doubles
        them; growing only columns sizes the rows by those asked for, not by an earlier
        batch's: after 128 short rows, 4 rows of 1,500 columns had regrown all 256 slots to
        1,500 columns (9.6 GB zero-filled, 9.5 s before the first token; measured)."""
        if slots <= self.slots and capacity <= self.capacity:
            return
        new_slots = max(slots, 2 * self.slots) if slots > self.slots else slots
        live = min(self.slots, new_slots)
        kept = self.capacity if used is None else min(used, self.capacity)
        new_cap = max(capacity, kept)  # callers ask with spare columns
        layers, heads, dim = self.shape
        fresh = torch.zeros(layers, 2, new_slots, heads, new_cap, dim, dtype=self.dtype)
        if self.store is not None:
            fresh[:, :, :live, :, :kept] = self.store[:, :, :live, :, :kept]
        self._use(fresh)
        self.slots, self.capacity = new_slots, new_cap

    def _use(self, store: torch.Tensor | None) -> None:
        self.store = store
        self.keys = [] if store is None else list(store[:, 0].unbind())
        self.values = [] if store is None else list(store[:, 1].unbind())

    def fill(self, rows: slice, kv: torch.Tensor) -> None:
        """Copy one sequence's keys/values [layers, 2, kv_heads, length, head] into rows."""
        assert self.store is not None
        self.store[:, :, rows, :, : kv.shape[3]] = kv[:, :, None]

    def move(self, dst: torch.Tensor, src: torch.Tensor, length: int) -> None:
        """Copy rows `src` onto rows `dst` (first `length` columns)."""
        assert self.store is not None
        self.store[:, :, dst, :, :length] = self.store[:, :, src, :, :length]

    def shift(self, row: int, columns: int, length: int) -> None:
        """Drop row's first `columns` columns of `length`: columns [columns, length) move to 0."""
        assert self.store is not None
        moved = self.store[:, :, row, :, columns:length].clone()
        self.store[:, :, row, :, : length - columns] = moved

    def clear(self) -> None:
        self._use(None)
        self.slots, self.capacity = 0, 0


class Segment:
    """Keys/values of a prompt prefix shared by several decoding rows (the samples of one
    request, or requests whose prompts share a cached prefix); per layer [kv_heads, length,
    dim]. Rows attend to it through `attention.merge_shared`, their slots hold only what follows."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.layers = list(zip(keys, values, strict=True))
        self.length = keys[0].shape[1]
