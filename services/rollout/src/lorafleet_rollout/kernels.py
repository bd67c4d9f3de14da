"""The torch engine's native decode kernels (`csrc/`: attention, shared-segment attention,
LoRA), compiled when the package is built and loaded here.

The package build (`services/rollout/setup.py`) compiles one library per CPU variant
(`kernel_abi.VARIANTS`: portable x86-64-v3, and x86-64-v4 with AVX-512) after checking the
ctypes declarations against `csrc/kernels.h`; `load()` picks the best variant this CPU runs
(from its flags), checks that the library was built from the sources beside it, and binds
the declarations of `kernel_abi.SIGNATURES` (ctypes drops the GIL for each call). Nothing is
compiled at run time, so no request waits for a compiler and every process loads the same
code. Without a library (installed without a compiler, another machine type) `load()` logs
why and returns None, and the engine keeps its torch attention and LoRA: same results within
float rounding, slower decoding. `path()` names what runs, for logs and metrics.

Floating point: no -ffast-math class flags; results differ from torch's by the order of
float operations only (tests hold them to 1e-5).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import logging
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lorafleet_rollout import kernel_abi

log = logging.getLogger(__name__)

#: path() without native kernels.
TORCH = "torch"


class DecodeAttention:
    """The loaded kernel: one decode step's attention over each row's own columns."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = _bind(library, "decode_attention")

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
            q.data_ptr(),
            keys.data_ptr(),
            values.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            k.stride(0),
            v.stride(0),
            lengths.data_ptr(),
            rows,
            kv_heads,
            group,
            dim,
            keys.stride(0),
            keys.stride(1),
            scale,
            out.data_ptr(),
            peak.data_ptr(),
            total.data_ptr(),
            scratch.data_ptr(),
        )
        return out, peak, total


class DecodeShared:
    """The loaded kernel: one decode step's attention over shared segments, merged in place
    into the rows' own (`DecodeAttention`'s out, peak and total)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = _bind(library, "decode_shared")
        self._scratch = _bind(library, "decode_shared_scratch")

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
            keys,
            values,
            strides,
            torch.tensor(lengths, dtype=torch.int32),
            torch.tensor(starts, dtype=torch.int32),
            torch.tensor(ids, dtype=torch.int32),
            torch.empty(scratch),
        )
        return _BoundShared(self._fn, (kv_heads, group, dim), scale, max(ids) + 1, tensors, held)


class _BoundShared:
    """`DecodeShared.bind`'s call: holds the checked tensors (alive) and their pointers."""

    def __init__(
        self,
        fn: Any,
        shape: tuple[int, int, int],
        scale: float,
        rows: int,
        tensors: tuple[torch.Tensor, ...],
        held: list[torch.Tensor],
    ) -> None:
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
        self,
        layer: int,
        q: torch.Tensor,
        out: torch.Tensor,
        peak: torch.Tensor,
        total: torch.Tensor,
    ) -> None:
        if not (
            q.dtype == out.dtype == peak.dtype == total.dtype == torch.float32
            and q.is_contiguous()
            and out.is_contiguous()
            and peak.is_contiguous()
            and total.is_contiguous()
            and q.shape == out.shape
            and q.shape[1:] == self._shape
            and peak.numel() == total.numel() == q.numel() // self._shape[2]
            and q.shape[0] >= self._rows
        ):
            raise ValueError("decode_shared: unsupported q, out, peak or total")
        self._fn(
            q.data_ptr(),
            *self._head,
            *self._layers[layer],
            *self._tail,
            out.data_ptr(),
            peak.data_ptr(),
            total.data_ptr(),
            self._scratch,
        )


class DecodeLora:
    """The loaded kernel: one decode step's LoRA, each row through its own slot's weights."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = _bind(library, "decode_lora")

    def bind(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        order: torch.Tensor,
        slots: torch.Tensor,
        columns: tuple[torch.Tensor, torch.Tensor],
        out_features: int,
    ) -> Callable[[torch.Tensor, torch.Tensor], None]:
        """A call `run(out, x)` doing out [B, out_features] += x[r] @ a[slot] @ b[slot] for
        each row r = order[e] of slot slots[e] (int32 [n], rows grouped by slot), with the
        stacks a [S, in, nr] and b [S, nr, width] of `lora.LoraStacks`: rank column k reaches
        output columns [columns[0][k], columns[1][k]), its B row holding them from column 0.
        Everything but x and out is checked here, once per batch composition, so a decode
        step pays only for x and out."""
        slot_count, _, nr = a.shape
        width = b.shape[2]
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
            and bool(((lo >= 0) & (lo <= hi) & (hi <= out_features) & (hi - lo <= width)).all())
        ):
            raise ValueError("decode_lora: unsupported stacks, rows or columns")
        return _BoundLora(self._fn, out_features, a, b, order, slots, lo, hi)


class _BoundLora:
    """`DecodeLora.bind`'s call: holds the checked tensors (alive) and their pointers."""

    def __init__(self, fn: Any, out_features: int, *tensors: torch.Tensor) -> None:
        a, b, order, slots, lo, hi = tensors
        self._fn, self._tensors = fn, tensors
        self._in, self._out = a.shape[1], out_features
        self._rows = int(order.max()) + 1 if order.numel() else 0
        self._head = (a.data_ptr(), b.data_ptr(), a.shape[1], a.shape[2], b.shape[2])
        self._tail = (
            order.data_ptr(),
            slots.data_ptr(),
            order.shape[0],
            lo.data_ptr(),
            hi.data_ptr(),
        )

    def __call__(self, out: torch.Tensor, x: torch.Tensor) -> None:
        if not (
            x.dtype == out.dtype == torch.float32
            and x.shape[1] == self._in
            and out.shape[1] == self._out
            and x.stride(1) == out.stride(1) == 1
            and min(x.shape[0], out.shape[0]) >= self._rows
        ):
            raise ValueError("decode_lora: unsupported x or out")
        self._fn(*self._head, x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), *self._tail)


def _bind(library: ctypes.CDLL, name: str) -> Any:
    """The library's function `name` with its declaration from `kernel_abi.SIGNATURES` (the
    one the package build checked against `csrc/kernels.h`)."""
    fn = getattr(library, name)
    fn.restype, argtypes = kernel_abi.SIGNATURES[name]
    fn.argtypes = list(argtypes)
    return fn


@dataclass(frozen=True)
class Kernels:
    variant: str  # the build variant loaded, "x86-64-v4" or "x86-64-v3"
    attention: DecodeAttention
    shared: DecodeShared
    lora: DecodeLora


def load() -> Kernels | None:
    """The kernels for this CPU, or None (logged once, with why; `path()` says "torch")."""
    return _load()[0]


def path() -> str:
    """What decodes in this process: the native variant ("x86-64-v4", "x86-64-v3") or
    "torch"."""
    kernels = load()
    return kernels.variant if kernels is not None else TORCH


def unavailable_reason() -> str:
    """Why `load()` returned None ("" when it did not)."""
    return _load()[1]


def runnable_variants() -> list[str]:
    """The build variants this CPU can run, best first (`kernel_abi.VARIANTS`)."""
    cpu = _cpu_flags()
    variants = kernel_abi.VARIANTS.get(platform.machine(), ())
    return [name for name, _flags, needs in variants if cpu.issuperset(needs)]


class KernelsUnavailable(RuntimeError):
    """A variant's library is missing, does not load, or was built from other sources."""


def load_variant(variant: str) -> Kernels:
    """One variant's kernels (the CPU must run it: see `runnable_variants`)."""
    found = _library_file(variant)
    if found is None:
        raise KernelsUnavailable(
            f"no {variant} kernel library in this install (it was built without a working "
            "C compiler: reinstall lorafleet-rollout where gcc or cc exists)"
        )
    try:
        library = ctypes.CDLL(str(found))
        built = _bind(library, "lorafleet_kernels_digest")().decode()
    except (OSError, AttributeError) as exc:
        raise KernelsUnavailable(f"{found.name} does not load: {exc}") from exc
    expected = _expected_digest(variant)
    if expected is not None and built != expected:
        raise KernelsUnavailable(
            f"{found.name} was built from other sources or flags than those beside it "
            "(reinstall lorafleet-rollout, or `make venv`, to rebuild the kernels)"
        )
    return Kernels(variant, DecodeAttention(library), DecodeShared(library), DecodeLora(library))


@functools.cache
def _load() -> tuple[Kernels | None, str]:
    runnable = runnable_variants()
    if not kernel_abi.VARIANTS.get(platform.machine()):
        reason = f"no native kernels are built for {platform.machine()!r}"
    elif not runnable:
        reason = "this CPU lacks the flags of every native variant (needs at least x86-64-v3)"
    else:
        try:
            return load_variant(runnable[0]), ""
        except KernelsUnavailable as exc:
            reason = str(exc)
    log.warning("native decode kernels unavailable, decoding with torch (slower): %s", reason)
    return None, reason


def _library_file(variant: str) -> Path | None:
    """The built library of a variant beside this module (an extension module's file name)."""
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = here / (kernel_abi.module_name(variant) + suffix)
        if candidate.exists():
            return candidate
    return None


def _expected_digest(variant: str) -> str | None:
    """The digest a library of this variant must carry, from the sources shipped beside it
    (None where they are not shipped: nothing to compare)."""
    if not all(f.exists() for f in (*kernel_abi.HEADERS, *kernel_abi.SOURCES)):
        return None
    return kernel_abi.sources_digest(variant)


def _cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo; empty where unreadable)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()
