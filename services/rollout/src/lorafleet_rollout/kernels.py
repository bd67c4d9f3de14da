"""The torch engine's native kernel (`csrc/decode_attention.c`), built on first use.

Compiled with the machine's C compiler (`$CC`, else gcc or cc) for this CPU (`-march=native`)
into the user cache (`$XDG_CACHE_HOME/lorafleet/kernels`, keyed by source, flags, compiler
and CPU), loaded with ctypes (which drops the GIL for the call). Building takes about a
second, once per machine. Without a compiler, or if the build fails, `load()` logs why and
returns None, and the engine keeps its torch attention: same results, slower decoding.

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
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.c"
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


@functools.cache
def load() -> DecodeAttention | None:
    """The kernel for this machine, building it if needed; None if it cannot be built."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        log.warning("no C compiler: the torch engine decodes with torch attention (slower)")
        return None
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lorafleet"
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), compiler.encode(), _cpu()):
        key.update(part)
    target = cache / "kernels" / f"decode_attention-{key.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                subprocess.run(
                    [compiler, *FLAGS, "-o", str(built), str(SOURCE), "-lm"],
                    check=True, capture_output=True, text=True, timeout=300,
                )  # fmt: skip
                os.replace(built, target)  # atomic: concurrent builders race harmlessly
        return DecodeAttention(ctypes.CDLL(str(target)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        log.warning("building %s failed, decoding with torch attention: %s", SOURCE.name, detail)
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
