"""The native decode kernels' binary interface, owned here: the ctypes signature of every
exported C function, the build variants and their compiler flags, the digest that ties a
built library to its sources, and the check of the signatures against `csrc/kernels.h`.

Why a module of its own, without torch: the package build (`services/rollout/setup.py`)
loads this file by path to compile the kernels and to refuse a header whose declarations
differ from these (a changed C signature is then a build error, not memory corruption at run
time); `kernels.py` binds the same declarations at run time. One list, read by both.
"""

from __future__ import annotations

import ctypes
import hashlib
import re
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")
HEADER = CSRC / "kernels.h"
#: Everything a build reads: the exported header, the internal one, the sources.
HEADERS = (HEADER, CSRC / "vector.h")
SOURCES = tuple(
    CSRC / name for name in ("decode_attention.c", "decode_shared.c", "decode_lora.c", "abi.c")
)

_P, _I32, _I64, _F32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float
_CString = ctypes.c_char_p
#: name -> (restype, argtypes): what `kernels.py` declares to ctypes. Pointers of any element
#: type are c_void_p (the Python side passes `tensor.data_ptr()`).
SIGNATURES: dict[str, tuple[type | None, tuple[type, ...]]] = {
    "decode_attention": (
        None,
        (*[_P] * 5, _I64, _I64, _P, *[_I32] * 4, _I64, _I64, _F32, *[_P] * 4),
    ),
    "decode_shared": (None, (_P, _I32, _I32, _I32, _F32, _I32, *[_P] * 10)),
    "decode_shared_scratch": (_I64, (_I64, _I32, _I32)),
    "decode_lora": (None, (_P, _P, _I32, _I32, _I32, _P, _I64, _P, _I64, _P, _P, _I32, _P, _P)),
    "lorafleet_kernels_digest": (_CString, ()),
}

#: Build variants by machine, best first: (name, compiler flags, /proc/cpuinfo flags the CPU
#: needs). x86-64-v3 (AVX2 + FMA, every x86 server since 2015) is the portable baseline;
#: x86-64-v4 adds AVX-512 where the CPU has it. No flag that changes a value: results follow
#: the C source's order of operations (reductions are explicit vector partial sums,
#: `csrc/vector.h`, so the compiler needs no licence to reassociate). Three flags of the
#: -ffast-math set are kept because they change no value the kernels produce:
#: -fno-math-errno (libm calls need not set errno), -fno-trapping-math (no floating-point
#: trap is observed) and -fno-signed-zeros (only a zero's sign may differ, and the kernels
#: never divide by a value that can be zero nor test a sign). Together they let the compiler
#: inline floorf and keep the shared-segment kernel's exp and max in vector registers
#: (`decode_shared.c`: 2-3x its speed, measured). The exactness tests (native vs torch
#: within 1e-5, native vs PEFT) pass with them; -fassociative-math, which changes sums, is
#: not used.
_V3_CPU = ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "abm")
_V4_CPU = (*_V3_CPU, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
VARIANTS: dict[str, tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...]] = {
    "x86_64": (
        ("x86-64-v4", ("-march=x86-64-v4", "-mtune=generic"), _V4_CPU),
        ("x86-64-v3", ("-march=x86-64-v3", "-mtune=generic"), _V3_CPU),
    ),
}
#: Flags every variant shares, after Python's own (setuptools adds those first): -fno-wrapv
#: undoes Python's -fwrapv, which kept the compiler from assuming that loop indices do not
#: overflow (the shared-segment kernel ran at half speed with it, measured).
COMMON_FLAGS = (
    "-O3",
    "-std=gnu11",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fno-signed-zeros",
    "-fvisibility=hidden",
    "-fno-wrapv",
)


def module_name(variant: str) -> str:
    """The library's module name inside the package for a variant: `_kernels_x86_64_v3`."""
    return "_kernels_" + variant.replace("-", "_")


def variant_flags(variant: str) -> tuple[str, ...]:
    """Every compiler flag of a variant (COMMON_FLAGS, then its own)."""
    for name, flags, _cpu in (v for machine in VARIANTS.values() for v in machine):
        if name == variant:
            return (*COMMON_FLAGS, *flags)
    raise KeyError(variant)


def sources_digest(variant: str) -> str:
    """What a built library must match: its sources, headers, flags and variant (hex)."""
    digest = hashlib.sha256(variant.encode())
    parts = (
        *(f.read_bytes() for f in (*HEADERS, *SOURCES)),
        " ".join(variant_flags(variant)).encode(),
    )
    for part in parts:
        digest.update(len(part).to_bytes(8, "little") + part)
    return digest.hexdigest()[:32]


_C_TYPES: dict[str, type | None] = {
    "void": None,
    "float": _F32,
    "int32_t": _I32,
    "int64_t": _I64,
}


def _ctype(declaration: str) -> type | None:
    """The ctypes type of one C parameter or return type ("const float *q" -> c_void_p)."""
    text = re.sub(r"\bconst\b", " ", declaration).strip()
    if "*" in text:
        base = text.split("*", 1)[0].strip()
        return _CString if base == "char" else _P
    base = text.rsplit(None, 1)[0] if len(text.split()) > 1 else text
    if base not in _C_TYPES:
        raise ValueError(f"kernels.h: unsupported C type {declaration!r}")
    return _C_TYPES[base]


def header_signatures(text: str) -> dict[str, tuple[type | None, tuple[type, ...]]]:
    """The exported prototypes of `kernels.h` as ctypes signatures."""
    text = re.sub(r"/\*.*?\*/|//[^\n]*|^\s*#[^\n]*", " ", text, flags=re.S | re.M)
    text = text.replace("LORAFLEET_EXPORT", " ")
    found: dict[str, tuple[type | None, tuple[type, ...]]] = {}
    for statement in text.split(";"):
        match = re.fullmatch(r"\s*([\w\s\*]+?)\b(\w+)\s*\(([^)]*)\)\s*", statement)
        if match is None:
            if statement.strip():
                raise ValueError(f"kernels.h: not a prototype: {statement.strip()!r}")
            continue
        result, name, params = match.groups()
        parameters = [p for p in (q.strip() for q in params.split(",")) if p and p != "void"]
        argtypes = tuple(_ctype(p) for p in parameters)
        if None in argtypes:
            raise ValueError(f"kernels.h: {name} has a void parameter")
        found[name] = (_ctype(result), argtypes)  # type: ignore[assignment]
    return found


def _type_name(t: type | None) -> str:
    """A C spelling of a ctypes type, for messages (ctypes' own names are platform aliases:
    c_int64 prints as c_long)."""
    names: dict[type, str] = {
        _P: "a pointer",
        _I32: "int32_t",
        _I64: "int64_t",
        _F32: "float",
        _CString: "char *",
    }
    return "void" if t is None else names.get(t, t.__name__)


def check_header(text: str) -> None:
    """Raise ValueError naming each function whose C declaration in `text` differs from its
    ctypes declaration in SIGNATURES (or exists on one side only)."""
    declared = header_signatures(text)
    problems = [
        f"{n}: in kernel_abi.SIGNATURES, not in kernels.h"
        for n in SIGNATURES.keys() - declared.keys()
    ]
    problems += [
        f"{n}: in kernels.h, not in kernel_abi.SIGNATURES"
        for n in declared.keys() - SIGNATURES.keys()
    ]
    for name in sorted(SIGNATURES.keys() & declared.keys()):
        (want_result, want_args), (got_result, got_args) = SIGNATURES[name], declared[name]
        if want_result is not got_result:
            problems.append(
                f"{name}: returns {_type_name(got_result)} in kernels.h, "
                f"{_type_name(want_result)} in kernel_abi.SIGNATURES"
            )
        if len(want_args) != len(got_args):
            problems.append(
                f"{name}: {len(got_args)} parameters in kernels.h, "
                f"{len(want_args)} in kernel_abi.SIGNATURES"
            )
            continue
        for i, (want, got) in enumerate(zip(want_args, got_args, strict=True)):
            if want is not got:
                problems.append(
                    f"{name}: parameter {i} is {_type_name(got)} in kernels.h, "
                    f"{_type_name(want)} in kernel_abi.SIGNATURES"
                )
    if problems:
        raise ValueError("native kernel signatures disagree:\n  " + "\n  ".join(problems))
