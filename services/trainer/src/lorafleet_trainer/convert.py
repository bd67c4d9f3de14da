"""Proto ⇄ domain conversion for the trainer (tensors travel as dtype + shape + LE bytes)."""

from __future__ import annotations

import dataclasses

import torch
from google.protobuf.message import DecodeError

from lorafleet.errors import InvalidArgument
from lorafleet.tensors import WIRE_DTYPES, check_layout
from lorafleet.v1 import common_pb2, controller_pb2, trainer_pb2
from lorafleet_trainer import domain

# The wire dtype table is lorafleet.tensors'; torch shares its dtype names.
_TO_TORCH: dict[int, torch.dtype] = {
    code: getattr(torch, d.name) for code, d in WIRE_DTYPES.items()
}
_FROM_TORCH = {v: common_pb2.DType.ValueType(k) for k, v in _TO_TORCH.items()}


def tensor_from_proto(t: common_pb2.Tensor, field: str) -> torch.Tensor:
    """The tensor, its layout checked by the wire table's one rule (`lorafleet.tensors`)."""
    dims = check_layout(t.dtype, t.shape, len(t.data), field)
    dtype = _TO_TORCH[t.dtype]
    if not t.data:
        return torch.zeros(dims, dtype=dtype)
    return torch.frombuffer(bytearray(t.data), dtype=dtype).reshape(dims)


def tensor_to_proto(t: torch.Tensor) -> common_pb2.Tensor:
    t = t.detach().to("cpu").contiguous()
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    return common_pb2.Tensor(
        dtype=_FROM_TORCH[t.dtype], shape=list(t.shape), data=raw.numpy().tobytes()
    )


def spec_from_proto(c: common_pb2.LoraConfig) -> domain.LoraSpec:
    return domain.LoraSpec(
        rank=c.rank,
        alpha=float(c.alpha),
        dropout=float(c.dropout),
        seed=int(c.seed),
        target_modules=tuple(c.target_modules),
        exclude_modules=tuple(c.exclude_modules),
        train_attn=c.train_attn,
        train_mlp=c.train_mlp,
        train_unembed=c.train_unembed,
        lora_plus_ratio=float(c.lora_plus_ratio),
        a_only_weight_decay=c.a_only_weight_decay,
        max_grad_norm_default=float(c.max_grad_norm_default),
    )


def spec_to_proto(s: domain.LoraSpec) -> common_pb2.LoraConfig:
    return common_pb2.LoraConfig(
        rank=s.rank,
        alpha=s.alpha,
        dropout=s.dropout,
        seed=s.seed,
        target_modules=list(s.target_modules),
        exclude_modules=list(s.exclude_modules),
        train_attn=s.train_attn,
        train_mlp=s.train_mlp,
        train_unembed=s.train_unembed,
        lora_plus_ratio=s.lora_plus_ratio,
        a_only_weight_decay=s.a_only_weight_decay,
        max_grad_norm_default=s.max_grad_norm_default,
    )


def slot_to_proto(info: domain.SlotInfo) -> trainer_pb2.SlotInfo:
    msg = trainer_pb2.SlotInfo(
        slot=info.slot,
        registration_id=info.registration_id,
        optim_steps=info.optim_steps,
        has_pending_gradients=info.has_pending_gradients,
        tokens_trained=info.tokens_trained,
    )
    if info.spec is not None:
        msg.lora_config.CopyFrom(spec_to_proto(info.spec))
    return msg


def fb_input_from_proto(inp: common_pb2.ForwardBackwardInput) -> domain.ForwardBackwardInput:
    """The domain input, decoded only: the engine checks it with the contract's one
    validator of the message against its vocabulary and context length (`prepare_input`),
    as the gateway does against capabilities."""
    data = [
        domain.Datum(
            tokens=list(d.tokens),
            loss_fn_inputs={
                k: tensor_from_proto(v, f"data[{j}].loss_fn_inputs.{k}")
                for k, v in d.loss_fn_inputs.items()
            },
            context=list(d.context),
            window=d.window,
        )
        for j, d in enumerate(inp.data)
    ]
    return domain.ForwardBackwardInput(
        data=data,
        loss_fn=inp.loss_fn,
        loss_fn_config=dict(inp.loss_fn_config),
        forward_only=inp.forward_only,
        group_tokens=int(inp.group_tokens),
    )


def fb_input_from_payload(body: bytes) -> domain.ForwardBackwardInput:
    """The domain input of a ForwardBackwardItem's payload: the serialized OperationPayload
    the gateway wrote, parsed here once. A `forward` payload runs forward-only."""
    try:
        payload = controller_pb2.OperationPayload.FromString(body)
    except DecodeError as exc:
        raise InvalidArgument(f"not a serialized OperationPayload: {exc}", field="payload") from exc
    which = payload.WhichOneof("kind")
    if which == "forward":
        return dataclasses.replace(fb_input_from_proto(payload.forward), forward_only=True)
    if which == "forward_backward":
        return fb_input_from_proto(payload.forward_backward)
    raise InvalidArgument(
        f"a forward_backward item carries a {which or 'empty'} payload", field="payload"
    )


def fb_result(out: domain.ForwardBackwardOutput) -> tuple[bytes, int]:
    """The serialized OperationResult the controller stores and returns as it is, and the
    target tokens it covers (what usage bills as trained or forward tokens)."""
    result = controller_pb2.OperationResult(forward_backward=fb_output_to_proto(out))
    return result.SerializeToString(), sum(lp.numel() for lp in out.logprobs)


def fb_output_to_proto(out: domain.ForwardBackwardOutput) -> common_pb2.ForwardBackwardOutput:
    return common_pb2.ForwardBackwardOutput(
        outputs=[
            common_pb2.DatumOutput(
                outputs={"logprobs": tensor_to_proto(lp), "elementwise_loss": tensor_to_proto(el)}
            )
            for lp, el in zip(out.logprobs, out.elementwise_loss, strict=True)
        ],
        metrics=out.metrics,
    )


def adam_from_proto(p: common_pb2.AdamParams) -> domain.AdamParams:
    return domain.AdamParams(
        learning_rate=p.learning_rate,
        beta1=p.beta1,
        beta2=p.beta2,
        eps=p.eps,
        weight_decay=p.weight_decay,
        grad_clip_norm=p.grad_clip_norm if p.HasField("grad_clip_norm") else None,
        a_only_weight_decay=p.a_only_weight_decay if p.HasField("a_only_weight_decay") else None,
    )


def optim_to_proto(r: domain.OptimStepResult) -> common_pb2.OptimStepOutput:
    return common_pb2.OptimStepOutput(metrics=r.metrics, applied=r.applied, note=r.note)


def ref_to_proto(r: domain.StateRef) -> common_pb2.BlobRef:
    return common_pb2.BlobRef(uri=r.uri, sha256=r.sha256, size_bytes=r.size_bytes)


def ref_from_proto(r: common_pb2.BlobRef) -> domain.StateRef:
    return domain.StateRef(uri=r.uri, sha256=r.sha256, size_bytes=r.size_bytes)
