"""The torch engine's native decode kernels (`csrc/`: attention, shared-segment attention,
LoRA), built on first use.

Compiled together with the machine's C compiler (`$CC`, else gcc or cc) for this CPU
(`-march=native`) into the user cache (`$XDG_CACHE_HOME/lorafleet/kernels`, keyed by sources,
flags, compiler and CPU), loaded with ctypes (which drops the GIL for the call). Building
takes about a second, once per machine. Without a compiler, or if the build fails, `load()`
logs why and returns None, and the engine keeps its torch attention and LoRA: same results,
slower decoding.

Floating-point flags: reassociation lets the compiler vectorise the dot products; the
results differ from torch's by float rounding only (tests hold them to 1e-5).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(CSRC / name for name in ("decode_attention.c", "decode_shared.c", "decode_lora.c"))
FLAGS = (
    "-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
    "-fno-trapping-math", "-shared", "-fPIC",
)  # fmt: skip


class DecodeAttention:
    """The loaded kernel: one decode step's attention over each row's own columns."""

    def __init__(self, library: ctypes.CDLL) -> None:
        fn = library.decode_attention
        fn.restype = None
        pointer, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
        fn.argtypes = [pointer, pointer, pointer, pointer, pointer, i64, i64, pointer]
        fn.argtypes += [i32, i32, i32, i32, i64, i64, ctypes.c_float]
        fn.argtypes += [pointer, pointer, pointer, pointer]
        self._fn = fn

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        lengths: torch.Tensor,
        longest: int,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write this step's k and v [rows, kv_heads, dim] (rows may be strided) to column
        lengths - 1 of keys/values [>= rows, kv_heads, columns, dim] (one layer of the slot
        cache), then attend q [rows, kv_heads, group, dim] over each row's `lengths` [rows]
        (int32, at most `longest`) columns. Returns (out [rows, kv_heads, group, dim], peak
        and total [rows, kv_heads, group, 1]): the output and its log-sum-exp parts, to
        merge with a shared segment."""
        rows, kv_heads, group, dim = q.shape
        if not (
            q.dtype == k.dtype == v.dtype == keys.dtype == values.dtype == torch.float32
            and lengths.dtype == torch.int32
            and lengths.shape == (rows,)
            and keys.stride() == values.stride()
            and keys.stride()[2:] == (dim, 1)
            and keys.shape[0] >= rows
            and keys.shape[2] >= longest
            and k.shape == v.shape == (rows, kv_heads, dim)
            and k.stride()[1:] == v.stride()[1:] == (dim, 1)
        ):
            raise ValueError("decode_attention: unsupported dtypes, shapes or strides")
        q = q.contiguous()
        out = torch.empty_like(q)
        peak = q.new_empty(rows, kv_heads, group, 1)
        total = q.new_empty(rows, kv_heads, group, 1)
        scratch = q.new_empty(group * longest)
        self._fn(
            q.data_ptr(), keys.data_ptr(), values.data_ptr(), k.data_ptr(), v.data_ptr(),
            k.stride(0), v.stride(0), lengths.data_ptr(), rows, kv_heads, group, dim,
            keys.stride(0), keys.stride(1), scale,
            out.data_ptr(), peak.data_ptr(), total.data_ptr(), scratch.data_ptr(),
        )  # fmt: skip
        return out, peak, total


class DecodeShared:
    """The loaded kernel: one decode step's attention over shared segments, merged in place
    into the rows' own (`DecodeAttention`'s out, peak and total)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        fn = library.decode_shared
        fn.restype = None
        pointer, i32 = ctypes.c_void_p, ctypes.c_int32
        fn.argtypes = [pointer, i32, i32, i32, ctypes.c_float, i32, *[pointer] * 10]
        self._fn = fn
        self._scratch = library.decode_shared_scratch
        self._scratch.restype = ctypes.c_int64
        self._scratch.argtypes = [ctypes.c_int64, i32, i32]

    def bind(
        self,
        segments: Sequence[tuple[Sequence[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]],
        kv_heads: int,
        group: int,
        dim: int,
        scale: float,
    ) -> _BoundShared:
        """A call `run(layer, q, out, peak, total)` for segments given as (per layer (keys,
        values) [kv_heads, n, dim], the rows [m] reading it). Segments and rows are checked
        here, once per batch composition; a step pays only for its five tensors."""
        layers = len(segments[0][0]) if segments else 0
        keys = torch.zeros(layers, len(segments), dtype=torch.int64)
        values, strides = torch.zeros_like(keys), torch.zeros_like(keys)
        lengths: list[int] = []
        ids: list[int] = []
        starts, scratch = [0], 0
        held: list[torch.Tensor] = []
        for s, (per_layer, rows) in enumerate(segments):
            n = per_layer[0][0].shape[1] if per_layer else 0
            if len(per_layer) != layers or n < 1 or rows.dim() != 1 or rows.numel() < 1:
                raise ValueError("decode_shared: unsupported segment layers or rows")
            for i, (k, v) in enumerate(per_layer):
                if not (
                    k.dtype == v.dtype == torch.float32
                    and k.shape == v.shape == (kv_heads, n, dim)
                    and k.stride() == v.stride()
                    and k.stride()[1:] == (dim, 1)
                ):
                    raise ValueError("decode_shared: unsupported segment keys or values")
                keys[i, s], values[i, s], strides[i, s] = k.data_ptr(), v.data_ptr(), k.stride(0)
                held += (k, v)  # the call reads them through pointers: keep them alive
            lengths.append(n)
            ids.extend(int(r) for r in rows)
            starts.append(len(ids))
            scratch = max(scratch, self._scratch(rows.numel() * group, n, dim))
        if not ids or min(ids) < 0:
            raise ValueError("decode_shared: no segments, or a negative row")
        tensors = (
            keys, values, strides, torch.tensor(lengths, dtype=torch.int32),
            torch.tensor(starts, dtype=torch.int32), torch.tensor(ids, dtype=torch.int32),
            torch.empty(scratch),
        )  # fmt: skip
        return _BoundShared(self._fn, (kv_heads, group, dim), scale, max(ids) + 1, tensors, held)


class _BoundShared:
    """`DecodeShared.bind`'s call: holds the checked tensors (alive) and their pointers."""

    def __init__(
        self, fn: Any, shape: tuple[int, int, int], scale: float, rows: int,
        tensors: tuple[torch.Tensor, ...], held: list[torch.Tensor],
    ) -> None:  # fmt: skip
        keys, values, strides, lengths, starts, ids, scratch = tensors
        self._fn, self._shape, self._rows, self._tensors = fn, shape, rows, (*tensors, *held)
        self._layers = [
            (keys[i].data_ptr(), values[i].data_ptr(), strides[i].data_ptr())
            for i in range(keys.shape[0])
        ]
        self._head = (*shape, scale, keys.shape[1])
        self._tail = (lengths.data_ptr(), starts.data_ptr(), ids.data_ptr())
        self._scratch = scratch.data_ptr()

    def __call__(
        self, layer: int, q: torch.Tensor, out: torch.Tensor, peak: torch.Tensor,
        total: torch.Tensor,
    ) -> None:  # fmt: skip
        if not (
            q.dtype == out.dtype == peak.dtype == total.dtype == torch.float32
            and q.is_contiguous() and out.is_contiguous()
            and peak.is_contiguous() and total.is_contiguous()
            and q.shape == out.shape
            and q.shape[1:] == self._shape
            and peak.numel() == total.numel() == q.numel() // self._shape[2]
            and q.shape[0] >= self._rows
        ):  # fmt: skip
            raise ValueError("decode_shared: unsupported q, out, peak or total")
        self._fn(q.data_ptr(), *self._head, *self._layers[layer], *self._tail, out.data_ptr(),
                 peak.data_ptr(), total.data_ptr(), self._scratch)  # fmt: skip


class DecodeLora:
    """The loaded kernel: one decode step's LoRA, each row through its own slot's weights."""

    def __init__(self, library: ctypes.CDLL) -> None:
        fn = library.decode_lora
        fn.restype = None
        pointer, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
        fn.argtypes = [pointer, pointer, i32, i32, i32, pointer, i64, pointer, i64]
        fn.argtypes += [pointer, pointer, i32, pointer, pointer]
        self._fn = fn

    def bind(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        order: torch.Tensor,
        slots: torch.Tensor,
        columns: tuple[torch.Tensor, torch.Tensor],
    ) -> Callable[[torch.Tensor, torch.Tensor], None]:
        """A call `run(out, x)` doing out [B, out] += x[r] @ a[slot] @ b[slot] for each row
        r = order[e] of slot slots[e] (int32 [n], rows grouped by slot), with the stacks
        a [S, in, nr] and b [S, nr, out] of `lora.LoraStacks`, rank column k reaching output
        columns [columns[0][k], columns[1][k]). Everything but x and out is checked here,
        once per batch composition, so a decode step pays only for x and out."""
        slot_count, _, nr = a.shape
        out_features = b.shape[2]
        lo, hi = columns
        if not (
            a.dtype == b.dtype == torch.float32
            and a.is_contiguous()
            and b.is_contiguous()
            and b.shape[:2] == (slot_count, nr)
            and order.dtype == slots.dtype == lo.dtype == hi.dtype == torch.int32
            and order.is_contiguous()
            and slots.is_contiguous()
            and order.shape == slots.shape
            and order.dim() == 1
            and lo.shape == hi.shape == (nr,)
            and bool(((slots >= 0) & (slots < slot_count)).all())
            and bool((order >= 0).all())
            and bool(((lo >= 0) & (lo <= hi) & (hi <= out_features)).all())
        ):
            raise ValueError("decode_lora: unsupported stacks, rows or columns")
        return _BoundLora(self._fn, a, b, order, slots, lo, hi)


class _BoundLora:
    """`DecodeLora.bind`'s call: holds the checked tensors (alive) and their pointers."""

    def __init__(self, fn: Any, *tensors: torch.Tensor) -> None:
        a, b, order, slots, lo, hi = tensors
        self._fn, self._tensors = fn, tensors
        self._in, self._out = a.shape[1], b.shape[2]
        self._rows = int(order.max()) + 1 if order.numel() else 0
        self._head = (a.data_ptr(), b.data_ptr(), a.shape[1], a.shape[2], b.shape[2])
        self._tail = (order.data_ptr(), slots.data_ptr(), order.shape[0], lo.data_ptr(),
                      hi.data_ptr())  # fmt: skip

    def __call__(self, out: torch.Tensor, x: torch.Tensor) -> None:
        if not (
            x.dtype == out.dtype == torch.float32
            and x.shape[1] == self._in
            and out.shape[1] == self._out
            and x.stride(1) == out.stride(1) == 1
            and min(x.shape[0], out.shape[0]) >= self._rows
        ):
            raise ValueError("decode_lora: unsupported x or out")
        self._fn(*self._head, x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0),
                 *self._tail)  # fmt: skip


@dataclass(frozen=True)
class Kernels:
    attention: DecodeAttention
    shared: DecodeShared
    lora: DecodeLora


@functools.cache
def load() -> Kernels | None:
    """The kernels for this machine, building them if needed; None if they cannot be built."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        log.warning("no C compiler: the torch engine decodes with its torch kernels (slower)")
        return None
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lorafleet"
    key = hashlib.sha256()
    for part in (*(f.read_bytes() for f in SOURCES), " ".join(FLAGS).encode(), compiler.encode(),
                 _cpu()):  # fmt: skip
        key.update(part)
    target = cache / "kernels" / f"decode-{key.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                subprocess.run(
                    [compiler, *FLAGS, "-o", str(built), *map(str, SOURCES), "-lm"],
                    check=True, capture_output=True, text=True, timeout=300,
                )  # fmt: skip
                os.replace(built, target)  # atomic: concurrent builders race harmlessly
        library = ctypes.CDLL(str(target))
        return Kernels(DecodeAttention(library), DecodeShared(library), DecodeLora(library))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        log.warning("building the decode kernels failed, decoding with torch: %s", detail)
        return None


def _cpu() -> bytes:
    """What -march=native depends on: the machine type and the CPU's model and flags."""
    described = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            lines = [line for line in info if line.startswith(("model name", "flags"))]
        described += "".join(sorted(set(lines)))
    except OSError:
        pass
    return described.encode()
