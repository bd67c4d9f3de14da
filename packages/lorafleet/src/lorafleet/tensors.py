"""Wire dtypes: the one table from `lorafleet.v1.DType` to dtype names and byte layouts.

Tensors travel as dtype + shape + little-endian bytes. The gateway decodes them with numpy,
the trainer and rollout with torch; both look the dtype up here by name (`float32`, ...),
which numpy and torch share, so the two sides cannot disagree on what a dtype means.
Torch-free on purpose.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lorafleet.errors import InvalidArgument
from lorafleet.v1 import common_pb2


@dataclass(frozen=True)
class WireDType:
    """One wire dtype: its name (a numpy and torch attribute, except bfloat16 which numpy
    lacks), its little-endian numpy layout (bfloat16 travels as raw uint16) and item size."""

    name: str
    numpy_le: str
    itemsize: int


WIRE_DTYPES: dict[int, WireDType] = {
    common_pb2.DTYPE_FLOAT32: WireDType("float32", "<f4", 4),
    common_pb2.DTYPE_INT64: WireDType("int64", "<i8", 8),
    common_pb2.DTYPE_INT32: WireDType("int32", "<i4", 4),
    common_pb2.DTYPE_BFLOAT16: WireDType("bfloat16", "<u2", 2),
    common_pb2.DTYPE_FLOAT64: WireDType("float64", "<f8", 8),
}
BY_NAME: dict[str, int] = {d.name: code for code, d in WIRE_DTYPES.items()}


def wire_dtype(code: int, field: str) -> WireDType:
    found = WIRE_DTYPES.get(code)
    if found is None:
        raise InvalidArgument(f"unsupported dtype {code}", field=f"{field}.dtype")
    return found


def check_layout(code: int, shape: Sequence[int], nbytes: int, field: str) -> tuple[int, ...]:
    """The tensor's shape, after checking that `nbytes` fills it exactly (an empty shape is a
    vector of whatever length the bytes give)."""
    dtype = wire_dtype(code, field)
    dims = tuple(int(s) for s in shape) or (nbytes // dtype.itemsize,)
    if any(d < 0 for d in dims):
        raise InvalidArgument(f"negative dimension in shape {list(dims)}", field=f"{field}.shape")
    expected = math.prod(dims) * dtype.itemsize
    if nbytes != expected:
        raise InvalidArgument(
            f"{nbytes} bytes do not match shape {list(dims)} of {dtype.name} ({expected} bytes)",
            field=f"{field}.data",
        )
    return dims
