"""One validator per v1 request message that crosses a service boundary (issue 23).

`check_forward_backward` (a `ForwardBackwardInput`, forward or forward_backward) and
`check_sample` (a sample request: the rollout's `SampleRequest`, the controller's
`SubmitSampleRequest`, which carry the same fields) are called at exactly two places each:
the gateway, so bad input is a 400 naming the field before anything is admitted, and the
service that acts on the message (trainer, rollout), which must not trust its caller. Both
refuse with the same field names (the v1 proto's), so a client sees the same refusal
whichever hop caught it. The proto3 defaults are read as the rollout reads them: num_samples
0 means 1 and top_p 0 means 1.0.

Deployment limits (vocabulary, context length, num_samples) are arguments, never constants:
the gateway takes them from the controller's capabilities, the acting service from its own
model and settings. A limit of 0 means "not known at this hop" and skips that rule; the
acting service always knows all of them. The caps on one operation's size (rows, tokens)
are the gateway's settings, checked there before admission. Torch-free on purpose: the
gateway imports this.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from lorafleet import contract
from lorafleet.errors import InvalidArgument
from lorafleet.tensors import WIRE_DTYPES, check_layout
from lorafleet.v1 import common_pb2

# An engine can report at most this many top-k prompt logprobs per position.
MAX_TOPK_PROMPT_LOGPROBS = 1024


@dataclass(frozen=True)
class Limits:
    """What the serving deployment accepts; 0 = unknown here (the rule is skipped)."""

    vocab_size: int = 0
    max_context_length: int = 0
    max_num_samples: int = 0
    max_rows: int = 0  # data rows of one forward(_backward)
    max_tokens: int = 0  # their tokens, context included


# Nothing known at this hop: only the rules that need no deployment limit are checked.
UNKNOWN = Limits()


def _check_ids(ids: Sequence[int], vocab_size: int, field: str) -> None:
    for i, tok in enumerate(ids):
        if tok < 0 or (vocab_size and tok >= vocab_size):
            where = f"[0, {vocab_size})" if vocab_size else "the vocabulary (>= 0)"
            raise InvalidArgument(f"token {tok} is outside {where}", field=f"{field}[{i}]")


def proto_array(t: common_pb2.Tensor, field: str) -> np.ndarray:
    """A v1 wire tensor as numpy, its layout checked (bfloat16 widened to float32, so its
    values are checked as numbers, not as the raw uint16 bits it travels as)."""
    dims = check_layout(t.dtype, t.shape, len(t.data), field)
    arr = np.frombuffer(t.data, dtype=WIRE_DTYPES[t.dtype].numpy_le).reshape(dims)
    if t.dtype == common_pb2.DTYPE_BFLOAT16:
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr


class DatumLike(Protocol):
    """The fields of a v1 `Datum` (or the trainer's domain Datum) the validator reads."""

    @property
    def tokens(self) -> Sequence[int]: ...
    @property
    def context(self) -> Sequence[int]: ...
    @property
    def loss_fn_inputs(self) -> Mapping[str, Any]: ...


class ForwardBackwardLike(Protocol):
    """A v1 `ForwardBackwardInput`, or the trainer's domain one (torch tensors)."""

    @property
    def loss_fn(self) -> str: ...
    @property
    def loss_fn_config(self) -> Mapping[str, float]: ...
    @property
    def group_tokens(self) -> int: ...
    @property
    def data(self) -> Sequence[DatumLike]: ...


def check_forward_backward(
    fb: ForwardBackwardLike,
    limits: Limits,
    prefix: str = "",
    as_array: Callable[[Any, str], np.ndarray] = proto_array,
) -> None:
    """Raise InvalidArgument naming the first bad field of a forward(_backward) input.
    `prefix` is where the message sits in the caller's request (the gateway's JSON bodies
    nest it, e.g. `forward_input.`); the names after it are the v1 message's. `as_array`
    reads one loss input as numpy: wire tensors by default, the trainer's torch tensors
    when it checks an input that did not come over the wire."""
    spec = contract.loss_spec(fb.loss_fn, f"{prefix}loss_fn")
    contract.loss_config(fb.loss_fn, dict(fb.loss_fn_config), f"{prefix}loss_fn_config")
    group = fb.group_tokens
    if isinstance(group, bool) or not isinstance(group, int) or group < 0:
        raise InvalidArgument(
            f"{group!r} must be an integer >= 0 (0 = plain sum)", field=f"{prefix}group_tokens"
        )
    if not fb.data:
        raise InvalidArgument("at least one datum is required", field=f"{prefix}data")
    _check_size(fb.data, limits, f"{prefix}data")
    for i, datum in enumerate(fb.data):
        where = f"{prefix}data[{i}]"
        n = len(datum.tokens)
        if not n:
            raise InvalidArgument("must not be empty", field=f"{where}.tokens")
        if limits.max_context_length and n + len(datum.context) > limits.max_context_length:
            raise InvalidArgument(
                f"{n} tokens after {len(datum.context)} of context exceed the context length "
                f"{limits.max_context_length}",
                field=f"{where}.tokens",
            )
        _check_ids(datum.tokens, limits.vocab_size, f"{where}.tokens")
        _check_ids(datum.context, limits.vocab_size, f"{where}.context")
        _check_inputs(spec, datum.loss_fn_inputs, n, limits, f"{where}.loss_fn_inputs", as_array)


def _check_size(data: Sequence[DatumLike], limits: Limits, field: str) -> None:
    """At most `max_rows` rows and `max_tokens` tokens in one operation: one step's work
    and memory on a trainer stay bounded whatever fits in a payload."""
    if limits.max_rows and len(data) > limits.max_rows:
        raise InvalidArgument(
            f"{len(data)} rows exceed the {limits.max_rows} one operation may carry; split the "
            "batch",
            field=field,
        )
    tokens = sum(len(d.tokens) + len(d.context) for d in data)
    if limits.max_tokens and tokens > limits.max_tokens:
        raise InvalidArgument(
            f"{tokens} tokens (context included) exceed the {limits.max_tokens} one operation "
            "may carry; split the batch",
            field=field,
        )


def _check_inputs(
    spec: contract.LossSpec,
    given: Mapping[str, Any],
    n: int,
    limits: Limits,
    where: str,
    as_array: Callable[[Any, str], np.ndarray],
) -> None:
    """One datum's loss inputs: each required one present, target ids in the vocabulary,
    (N,) per input token (targets (N, K) for a top-K loss, weights shaped like the
    targets), numbers finite."""
    for name in spec.required:
        if name not in given:
            raise InvalidArgument(f"{spec.name} needs it", field=f"{where}.{name}")
    arrays = {name: as_array(tensor, f"{where}.{name}") for name, tensor in given.items()}
    targets = arrays["target_tokens"]
    for name, arr in arrays.items():
        field = f"{where}.{name}"
        if arr.ndim == 0 or arr.shape[0] != n:
            raise InvalidArgument(
                f"leading dimension of shape {list(arr.shape)} != {n} input tokens", field=field
            )
        if name in contract.INT_INPUTS:
            if arr.dtype.kind not in "iu":
                raise InvalidArgument("must be an integer tensor", field=f"{field}.dtype")
            _check_ids(arr.reshape(-1).tolist(), limits.vocab_size, field)
        elif arr.size and not np.isfinite(arr.astype(np.float64)).all():
            raise InvalidArgument("contains a non-finite value", field=field)
        if name not in spec.inputs:
            continue  # a key no built-in loss reads (the SDK's own extras): ignored
        want = (
            ((n,), (n, arr.shape[-1]))
            if name == "target_tokens" and spec.topk_targets
            else (targets.shape,)
            if name == "weights"
            else ((n,),)
        )
        if arr.shape not in want or not arr.size:
            shapes = " or ".join(str(list(w)) for w in want)
            raise InvalidArgument(
                f"shape {list(arr.shape)} must be {shapes} (one entry per input token)",
                field=field,
            )


class SamplingParamsLike(Protocol):
    @property
    def max_tokens(self) -> int: ...
    @property
    def temperature(self) -> float: ...
    @property
    def top_p(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def stop_token_ids(self) -> Sequence[int]: ...
    @property
    def stop_strings(self) -> Sequence[str]: ...


class SampleLike(Protocol):
    """The fields every sample request message shares (v1 SampleRequest, SubmitSampleRequest
    and the rollout's domain SampleRequest)."""

    @property
    def prompt_tokens(self) -> Sequence[int]: ...
    @property
    def num_samples(self) -> int: ...
    @property
    def topk_prompt_logprobs(self) -> int: ...
    @property
    def params(self) -> SamplingParamsLike: ...


def check_sample(request: SampleLike, limits: Limits) -> None:
    """Raise InvalidArgument naming the first bad field of a sample request."""
    p = request.params
    prompt = request.prompt_tokens
    if not prompt:
        raise InvalidArgument("the prompt is empty", field="prompt_tokens")
    _check_ids(prompt, limits.vocab_size, "prompt_tokens")
    n = request.num_samples or 1  # proto3: 0 is unset, which means 1
    if limits.max_num_samples:
        contract.check_num_samples(n, limits.max_num_samples)
    elif n < 1:
        raise InvalidArgument(f"{n} must be >= 1", field="num_samples")
    if p.max_tokens < 0:
        raise InvalidArgument(f"{p.max_tokens} is negative", field="params.max_tokens")
    if limits.max_context_length and len(prompt) + max(p.max_tokens, 1) > limits.max_context_length:
        raise InvalidArgument(
            f"prompt ({len(prompt)} tokens) + max_tokens ({p.max_tokens}) exceeds the context "
            f"length {limits.max_context_length}",
            field="params.max_tokens",
        )
    if not math.isfinite(p.temperature) or p.temperature < 0:
        raise InvalidArgument(
            f"{p.temperature} must be a finite number >= 0", field="params.temperature"
        )
    top_p = p.top_p or 1.0  # proto3: 0 is unset, Tinker's default 1.0
    if not math.isfinite(top_p) or not 0 < top_p <= 1:
        raise InvalidArgument(f"{top_p} is outside (0, 1]", field="params.top_p")
    if p.top_k < -1:
        raise InvalidArgument(f"{p.top_k} must be -1 or 0 (off) or >= 1", field="params.top_k")
    _check_ids(p.stop_token_ids, limits.vocab_size, "params.stop_token_ids")
    for i, text in enumerate(p.stop_strings):
        if not text:
            raise InvalidArgument("empty stop string", field=f"params.stop_strings[{i}]")
    top = min(limits.vocab_size or MAX_TOPK_PROMPT_LOGPROBS, MAX_TOPK_PROMPT_LOGPROBS)
    if not 0 <= request.topk_prompt_logprobs <= top:
        raise InvalidArgument(
            f"{request.topk_prompt_logprobs} is outside [0, {top}]", field="topk_prompt_logprobs"
        )
