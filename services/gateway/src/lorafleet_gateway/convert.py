"""Tinker wire data (JSON and tinker_public protobuf) ⇄ lorafleet.v1 messages.

Inputs are validated completely before anything is sent on: every tensor's byte length must
match dtype × shape, sparse CSR structure must be consistent, floats must be finite, token
ids non-negative int32, and every loss input's leading dimension must equal the datum's
token count. Failures raise InvalidArgument naming the dotted field, e.g.
"forward_backward_input.data[2].loss_fn_inputs.weights". Tinker only has float32 and int64
on the JSON wire; proto int32/bfloat16 inputs are widened here so the trainer sees two dtypes.
Outputs become Tinker JSON (0.24.1) or tinker_public protobuf (BatchedTensor per field).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from lorafleet import contract, validate_msgs
from lorafleet.errors import InvalidArgument
from lorafleet.tensors import BY_NAME, WIRE_DTYPES, check_layout
from lorafleet.v1 import common_pb2 as pb
from lorafleet_gateway import protocol
from lorafleet_gateway.tinker_proto import tinker_public_pb2 as tpb

# Tinker's own protobuf dtypes, by the wire dtype name they share with lorafleet.tensors.
_TINKER_DTYPES = {
    tpb.DTYPE_FLOAT32: "float32",
    tpb.DTYPE_INT64: "int64",
    tpb.DTYPE_INT32: "int32",
    tpb.DTYPE_BFLOAT16: "bfloat16",
}


# --- small helpers ------------------------------------------------------------------------
def _bf16_to_f32(raw_u16: np.ndarray) -> np.ndarray:
    return (raw_u16.astype(np.uint32) << 16).view(np.float32)


def _finite(arr: np.ndarray, field: str) -> None:
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        bad = int(np.flatnonzero(~np.isfinite(arr.reshape(-1)))[0])
        raise InvalidArgument(f"non-finite value at flat index {bad}", field=field)


def _to_tensor(arr: np.ndarray) -> pb.Tensor:
    if arr.dtype.kind == "f":
        return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=arr.shape, data=arr.astype("<f4").tobytes())
    return pb.Tensor(dtype=pb.DTYPE_INT64, shape=arr.shape, data=arr.astype("<i8").tobytes())


def _shape(shape: Sequence[int] | None, count: int, field: str) -> tuple[int, ...]:
    if not shape:
        return (count,)
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"negative dimension in shape {list(shape)}", field=f"{field}.shape")
    if math.prod(shape) != count:
        raise InvalidArgument(
            f"{count} elements do not fill shape {list(shape)} ({math.prod(shape)} expected)",
            field=f"{field}.shape",
        )
    return tuple(shape)


def _densify(
    values: np.ndarray,
    crow: np.ndarray,
    col: np.ndarray,
    shape: Sequence[int] | None,
    field: str,
    names: tuple[str, str] = ("sparse_crow_indices", "sparse_col_indices"),
) -> np.ndarray:
    """Sparse CSR (values, crow_indices, col_indices) → the dense 2-D array, checked. `names`
    are the row-pointer and column fields as the body names them (JSON's by default)."""
    crow_field, col_field = (f"{field}.{name}" for name in names)
    if not shape or len(shape) != 2:
        raise InvalidArgument("sparse CSR tensors need a 2-D shape", field=f"{field}.shape")
    rows, cols = int(shape[0]), int(shape[1])
    if rows < 0 or cols < 0:
        raise InvalidArgument(f"negative dimension in shape {list(shape)}", field=f"{field}.shape")
    if len(crow) != rows + 1:
        raise InvalidArgument(
            f"expected {rows + 1} row pointers, got {len(crow)}",
            field=crow_field,
        )
    if crow[0] != 0 or np.any(np.diff(crow) < 0) or crow[-1] != len(values):
        raise InvalidArgument(
            "row pointers must start at 0, never decrease and end at nnz",
            field=crow_field,
        )
    if len(col) != len(values):
        raise InvalidArgument(
            f"{len(col)} column indices for {len(values)} values",
            field=col_field,
        )
    if len(col) and (col.min() < 0 or col.max() >= cols):
        raise InvalidArgument(f"column index out of range [0, {cols})", field=col_field)
    dense = np.zeros((rows, cols), dtype=values.dtype)
    dense[np.repeat(np.arange(rows), np.diff(crow)), col] = values
    return dense


# --- tensors in ---------------------------------------------------------------------------
def array_from_json(td: protocol.TensorData, field: str) -> np.ndarray:
    """TensorData JSON → a checked numpy array (float32 or int64)."""
    if td.dtype == "int64":
        if any(isinstance(x, float) and not x.is_integer() for x in td.data):
            raise InvalidArgument("int64 tensor holds a non-integer", field=f"{field}.data")
        try:
            values = np.asarray(td.data, dtype=np.int64)
        except OverflowError:
            raise InvalidArgument("value out of int64 range", field=f"{field}.data") from None
    else:
        with np.errstate(over="ignore"):  # overflow to inf is reported just below
            values = np.asarray(td.data, dtype=np.float64).astype(np.float32)
        _finite(values, f"{field}.data")
    if td.sparse_crow_indices is not None or td.sparse_col_indices is not None:
        if td.sparse_crow_indices is None or td.sparse_col_indices is None:
            raise InvalidArgument(
                "sparse CSR needs both sparse_crow_indices and sparse_col_indices", field=field
            )
        crow = np.asarray(td.sparse_crow_indices, dtype=np.int64)
        col = np.asarray(td.sparse_col_indices, dtype=np.int64)
        return _densify(values, crow, col, td.shape, field)
    return values.reshape(_shape(td.shape, values.size, field))


def _frombuffer(raw: bytes, le: str, field: str) -> np.ndarray:
    itemsize = np.dtype(le).itemsize
    if len(raw) % itemsize:
        raise InvalidArgument(
            f"{len(raw)} bytes is not a whole number of {itemsize}-byte elements", field=field
        )
    return np.frombuffer(raw, dtype=le)


def array_from_proto(t: tpb.Tensor, field: str) -> np.ndarray:
    """tinker_public.Tensor (dense or sparse_csr) → a checked float32/int64 numpy array."""
    name = _TINKER_DTYPES.get(t.dtype)
    if name is None:
        raise InvalidArgument(f"unsupported dtype {t.dtype}", field=f"{field}.dtype")
    le = WIRE_DTYPES[BY_NAME[name]].numpy_le
    encoding = t.WhichOneof("encoding")
    if encoding == "sparse_csr":
        values = _frombuffer(t.sparse_csr.values, le, f"{field}.sparse_csr.values")
        crow = _frombuffer(t.sparse_csr.crow_indices, "<i8", f"{field}.sparse_csr.crow_indices")
        col = _frombuffer(t.sparse_csr.col_indices, "<i8", f"{field}.sparse_csr.col_indices")
        names = ("sparse_csr.crow_indices", "sparse_csr.col_indices")
        arr = _densify(values, crow, col, list(t.shape), field, names)
    else:
        values = _frombuffer(t.dense, le, f"{field}.dense")
        arr = values.reshape(_shape(list(t.shape), values.size, field))
    if t.dtype == tpb.DTYPE_BFLOAT16:
        arr = _bf16_to_f32(arr)
    elif t.dtype == tpb.DTYPE_INT32:
        arr = arr.astype(np.int64)
    _finite(arr, field)
    return arr


# --- data in ------------------------------------------------------------------------------
def tokens_from_json(model_input: protocol.ModelInput, field: str) -> list[int]:
    tokens: list[int] = []
    for j, chunk in enumerate(model_input.chunks):
        if chunk.type != "encoded_text":
            raise InvalidArgument(
                f"chunk type {chunk.type!r} is not supported (text only)",
                field=f"{field}.chunks[{j}].type",
            )
        if chunk.tokens is None:
            raise InvalidArgument("missing", field=f"{field}.chunks[{j}].tokens")
        tokens.extend(chunk.tokens)
    if not tokens:
        raise InvalidArgument("needs at least one token", field=field)
    return tokens


def tokens_from_proto(chunks: Iterable[tpb.Chunk], field: str) -> list[int]:
    tokens: list[int] = []
    for j, chunk in enumerate(chunks):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise InvalidArgument(
                f"chunk type {kind!r} is not supported (text only)", field=f"{field}[{j}]"
            )
        ids = _frombuffer(chunk.encoded_text.tokens, "<i4", f"{field}[{j}].encoded_text.tokens")
        tokens.extend(ids.tolist())
    if not tokens:
        raise InvalidArgument("needs at least one token", field=field)
    return tokens


def _datum(tokens: list[int], inputs: Mapping[str, np.ndarray]) -> pb.Datum:
    datum = pb.Datum(tokens=tokens)
    for name, arr in inputs.items():
        datum.loss_fn_inputs[name].CopyFrom(_to_tensor(arr))
    return datum


# The message validator names v1 fields; a client is answered with its SDK's names
# (tinker-api.md §6-7): a datum's tokens are its `model_input`, a sample's `prompt_tokens`
# its `prompt`, `params` its `sampling_params`, stop ids and strings its one `stop` field. A
# token's position moves into the message, as these JSON fields are chunks or one value.
_SDK_NAMES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"(?P<at>.*data\[\d+\])\.tokens(?:\[(?P<i>\d+)\])?"), r"\g<at>.model_input"),
    (re.compile(r"prompt_tokens(?:\[(?P<i>\d+)\])?"), "prompt"),
    (re.compile(r"params\.stop_(?:token_ids|strings)(?:\[(?P<i>\d+)\])?"), "sampling_params.stop"),
    (re.compile(r"params\.(?P<rest>.+)"), r"sampling_params.\g<rest>"),
)


def sdk_named(check: Callable[[], None]) -> None:
    """Run one of `lorafleet.validate_msgs`' checks; its refusal names the SDK's field."""
    try:
        check()
    except InvalidArgument as exc:
        for pattern, name in _SDK_NAMES:
            if match := pattern.fullmatch(exc.field):
                at = match.groupdict().get("i")
                message = f"{exc.message} (position {at})" if at else exc.message
                raise InvalidArgument(message, field=match.expand(name)) from None
        raise


def fb_input_from_json(
    body: protocol.ForwardBackwardInput,
    field: str,
    forward_only: bool,
    limits: validate_msgs.Limits = validate_msgs.UNKNOWN,
) -> pb.ForwardBackwardInput:
    """The v1 message, checked against `limits` (the run's base model's, capabilities';
    none known: the rules that need them are left to the trainer)."""
    contract.loss_spec(body.loss_fn, f"{field}.loss_fn")
    data = []
    for i, d in enumerate(body.data):
        where = f"{field}.data[{i}]"
        tokens = tokens_from_json(d.model_input, f"{where}.model_input")
        inputs = {
            k: array_from_json(v, f"{where}.loss_fn_inputs.{k}")
            for k, v in d.loss_fn_inputs.items()
        }
        data.append(_datum(tokens, inputs))
    config = contract.loss_config(
        body.loss_fn, body.loss_fn_config or {}, f"{field}.loss_fn_config"
    )
    fb = pb.ForwardBackwardInput(
        data=data, loss_fn=body.loss_fn, loss_fn_config=config, forward_only=forward_only
    )
    sdk_named(lambda: validate_msgs.check_forward_backward(fb, limits, f"{field}."))
    return fb


def fb_request_parts_from_proto(
    raw: bytes,
) -> tuple[str, int, Callable[[validate_msgs.Limits], pb.ForwardBackwardInput]]:
    """Parse the envelope (model_id, seq_id) now; convert the payload when called with the
    run's limits, so a refused payload can still spend its seq_id."""
    request = tpb.ForwardBackwardRequest()
    try:
        request.ParseFromString(raw)
    except Exception:  # protobuf raises DecodeError (or RuntimeWarning-ish) on garbage
        raise InvalidArgument(
            "not a valid tinker_public.ForwardBackwardRequest", field="body"
        ) from None
    if not request.model_id:
        raise InvalidArgument("missing", field="model_id")
    if request.seq_id < 0:
        raise InvalidArgument("must be >= 0", field="seq_id")
    return request.model_id, request.seq_id, lambda limits: _fb_input_from_proto(request, limits)


def _fb_input_from_proto(
    request: tpb.ForwardBackwardRequest, limits: validate_msgs.Limits
) -> pb.ForwardBackwardInput:
    contract.loss_spec(request.loss_fn, "loss_fn")
    data = []
    for i, d in enumerate(request.data):
        where = f"data[{i}]"
        tokens = tokens_from_proto(d.model_input, f"{where}.model_input")
        inputs = {
            k: array_from_proto(v, f"{where}.loss_fn_inputs.{k}")
            for k, v in d.loss_fn_inputs.items()
        }
        data.append(_datum(tokens, inputs))
    if request.loss_fn_config_v2:
        config = {}
        for key, value in request.loss_fn_config_v2.items():
            if value.WhichOneof("value") != "number":
                raise InvalidArgument(
                    "only numeric loss config values are supported",
                    field=f"loss_fn_config_v2.{key}",
                )
            config[key] = value.number
        config = contract.loss_config(request.loss_fn, config, "loss_fn_config_v2")
    else:
        config = contract.loss_config(request.loss_fn, request.loss_fn_config, "loss_fn_config")
    fb = pb.ForwardBackwardInput(
        data=data, loss_fn=request.loss_fn, loss_fn_config=config, forward_only=request.forward_only
    )
    sdk_named(lambda: validate_msgs.check_forward_backward(fb, limits))
    return fb


def adam_from_json(params: protocol.AdamParams | None, field: str = "adam_params") -> pb.AdamParams:
    """AdamParams (Tinker's defaults for a bare request), all finite and in range: a NaN
    learning rate would poison a slot."""
    values = {**contract.ADAM_DEFAULTS, **(params.model_dump() if params else {})}
    contract.check_adam(values, field)
    if not values["grad_clip_norm"]:
        # The SDK always sends 0 ("no clip" by default): the run's max_grad_norm_default, if
        # it set one, applies (proto: unset). Managed jobs set an explicit 0 instead.
        del values["grad_clip_norm"]
    return pb.AdamParams(**values)


def lora_from_json(
    config: protocol.LoraConfig,
    options: contract.LoraOptions,
    field: str = "lora_config",
) -> pb.LoraConfig:
    """Tinker's LoraConfig plus the `lorafleet.*` options of the run's user_metadata.

    Explicit `target_modules` mean exactly those modules and the train_* flags are ignored
    (the trainer's rule), so the flags only need one set when no module is named."""
    flags = config.train_attn or config.train_mlp or config.train_unembed
    if not (flags or options.target_modules):
        raise InvalidArgument(
            "at least one of train_attn, train_mlp, train_unembed must be true, or name "
            f"modules with user_metadata {contract.METADATA_PREFIX}target_modules",
            field=field,
        )
    return pb.LoraConfig(
        rank=config.rank,
        seed=config.seed or 0,
        train_attn=config.train_attn,
        train_mlp=config.train_mlp,
        train_unembed=config.train_unembed,
        alpha=options.alpha,
        dropout=options.dropout,
        target_modules=options.target_modules,
        exclude_modules=options.exclude_modules,
        lora_plus_ratio=options.lora_plus_ratio,
        a_only_weight_decay=options.a_only_weight_decay,
        max_grad_norm_default=options.max_grad_norm_default,
    )


def sampling_params_from_json(params: protocol.SamplingParams) -> pb.SamplingParams:
    """Tinker SamplingParams → v1. stop=None: EOS only; stop=[]: not even EOS (0.38 docs)."""
    out = pb.SamplingParams(
        max_tokens=params.max_tokens or 0,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
    )
    if params.seed is not None:
        out.seed = params.seed
    stop = params.stop
    if isinstance(stop, str):
        out.stop_strings.append(stop)
    elif isinstance(stop, list):
        if not stop:
            out.disable_eos_stop = True
        elif isinstance(stop[0], str):
            out.stop_strings.extend(stop)
        else:  # ids are checked with the request (validate_msgs.check_sample)
            out.stop_token_ids.extend(stop)
    return out


def metadata(values: Mapping[str, Any] | None) -> dict[str, str]:
    """Tinker user_metadata (any JSON values) → map<string, string>."""
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in (values or {}).items()}


# --- outputs ------------------------------------------------------------------------------
def array(t: pb.Tensor, field: str = "tensor") -> np.ndarray:
    """A v1 Tensor → numpy (bfloat16 widened to float32, float64 narrowed to float32)."""
    dims = check_layout(t.dtype, t.shape, len(t.data), field)
    arr = np.frombuffer(t.data, dtype=WIRE_DTYPES[t.dtype].numpy_le).reshape(dims)
    if t.dtype == pb.DTYPE_BFLOAT16:
        return _bf16_to_f32(arr)
    if t.dtype == pb.DTYPE_FLOAT64:
        return arr.astype(np.float32)
    if t.dtype == pb.DTYPE_INT32:
        return arr.astype(np.int64)
    return arr


def tensor_json(arr: np.ndarray) -> dict[str, Any]:
    is_float = arr.dtype.kind == "f"
    return {
        "data": arr.reshape(-1).tolist(),
        "dtype": "float32" if is_float else "int64",
        "shape": list(arr.shape),
    }


def finite_metrics(metrics: Mapping[str, float], field: str) -> dict[str, float]:
    """The metrics, or InvalidArgument naming the first non-finite one (JSON has no inf)."""
    for key, value in metrics.items():
        if not math.isfinite(value):
            raise InvalidArgument(f"non-finite value {value}", field=f"{field}.{key}")
    return dict(metrics)


def fb_output_json(out: pb.ForwardBackwardOutput) -> dict[str, Any]:
    """ForwardBackwardOutput as 0.24.1 parses it from JSON (§7.4); every output the trainer
    returns per datum (logprobs, elementwise_loss) passes through. Non-finite values are
    InvalidArgument naming the field: JSON cannot carry them."""
    outputs = []
    for i, datum in enumerate(out.outputs):
        record = {}
        for name, tensor in datum.outputs.items():
            where = f"loss_fn_outputs[{i}].{name}"
            arr = array(tensor, where)
            _finite(arr, where)
            record[name] = tensor_json(arr)
        outputs.append(record)
    return {
        "loss_fn_output_type": "ArrayRecord",
        "loss_fn_outputs": outputs,
        "metrics": finite_metrics(out.metrics, "metrics"),
    }


def _signature(outputs: Mapping[str, np.ndarray]) -> tuple[Any, ...]:
    return tuple((k, a.dtype.kind, a.shape[1:]) for k, a in sorted(outputs.items()))


def fb_output_proto(out: pb.ForwardBackwardOutput) -> bytes:
    """tinker_public.ForwardBackwardOutput: one ArrayRecord per run of datums that share
    field names, dtypes and trailing shapes; each field a BatchedTensor with byte offsets."""
    result = tpb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=out.metrics)
    datums = [
        {k: array(t, f"loss_fn_outputs[{i}].{k}") for k, t in d.outputs.items()}
        for i, d in enumerate(out.outputs)
    ]
    groups: list[list[dict[str, np.ndarray]]] = []
    for datum in datums:
        if groups and _signature(groups[-1][0]) == _signature(datum):
            groups[-1].append(datum)
        else:
            groups.append([datum])
    for group in groups:
        record = result.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(group))
        for name in group[0]:
            parts = [d[name] for d in group]
            is_float = parts[0].dtype.kind == "f"
            le = "<f4" if is_float else "<i8"
            blobs = [p.astype(le).tobytes() for p in parts]
            field = record.fields[name]
            field.dtype = tpb.DTYPE_FLOAT32 if is_float else tpb.DTYPE_INT64
            field.data = b"".join(blobs)
            field.offsets = np.cumsum([0] + [len(b) for b in blobs]).astype("<i8").tobytes()
            field.trailing_shape.extend(parts[0].shape[1:])
    return result.SerializeToString()


_STOP = {pb.STOP_REASON_STOP: "stop", pb.STOP_REASON_LENGTH: "length"}
EMPTY_TOPK = (0, -99999.0)


def _topk_rows(out: pb.SampleOutput) -> list[list[tuple[int, float]]]:
    return [
        list(zip(row.token_ids, row.logprobs, strict=False)) for row in out.topk_prompt_logprobs
    ]


def sample_output_json(out: pb.SampleOutput) -> dict[str, Any]:
    """SampleResponse as 0.24.1 parses it from JSON (§7.5). NaN marks a missing prompt
    logprob (None); any other non-finite value is InvalidArgument naming the field."""
    for i, seq in enumerate(out.sequences):
        _finite(np.asarray(seq.logprobs, dtype=np.float64), f"sequences[{i}].logprobs")
    prompt_lps = [None if math.isnan(x) else x for x in out.prompt_logprobs] or None
    if any(x is not None and math.isinf(x) for x in prompt_lps or ()):
        raise InvalidArgument("non-finite value", field="prompt_logprobs")
    if prompt_lps:
        prompt_lps[0] = None
    topk = [rows or None for rows in _topk_rows(out)] or None
    if topk:
        topk[0] = None
    return {
        "type": "sample",
        "sequences": [
            {
                "tokens": list(s.tokens),
                "logprobs": list(s.logprobs),
                "stop_reason": _STOP.get(s.stop_reason, "length"),
            }
            for s in out.sequences
        ],
        "prompt_logprobs": prompt_lps,
        "topk_prompt_logprobs": topk,
        "prompt_cache_hit_tokens": 0,
    }


def sample_output_proto(out: pb.SampleOutput) -> bytes:
    """tinker_public.SampleResponse: int32 tokens, float32 logprobs, NaN for missing."""
    result = tpb.SampleResponse()
    for s in out.sequences:
        result.sequences.add(
            stop_reason=tpb.STOP_REASON_STOP
            if s.stop_reason == pb.STOP_REASON_STOP
            else tpb.STOP_REASON_LENGTH,
            tokens=np.asarray(s.tokens, dtype="<i4").tobytes(),
            logprobs=np.asarray(s.logprobs, dtype="<f4").tobytes(),
        )
    if len(out.prompt_logprobs):
        lps = np.asarray(out.prompt_logprobs, dtype="<f4")
        lps[0] = np.nan
        result.prompt_logprobs = lps.tobytes()
    rows = _topk_rows(out)
    if rows:
        k = max(len(r) for r in rows)
        ids = np.full((len(rows), k), EMPTY_TOPK[0], dtype="<i4")
        lps = np.full((len(rows), k), EMPTY_TOPK[1], dtype="<f4")
        for i, row in enumerate(rows[1:], start=1):  # position 0 has no prediction
            for j, (tok, lp) in enumerate(row):
                ids[i, j], lps[i, j] = tok, lp
        topk = result.topk_prompt_logprobs
        topk.token_ids, topk.logprobs = ids.tobytes(), lps.tobytes()
        topk.k, topk.length = k, len(rows)
    return result.SerializeToString()
