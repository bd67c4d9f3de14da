"""One contract: the gateway, the controller and the trainer accept exactly the losses and
AdamParams ranges of `lorafleet.contract`, probed through each service's own validation (not
by comparing lists), and every gateway route says in the OpenAPI what it returns."""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from lorafleet import contract, validate_msgs
from lorafleet.errors import InvalidArgument
from lorafleet.v1 import common_pb2 as pb
from lorafleet.v1 import controller_pb2 as cpb
from lorafleet.validate_msgs import Limits
from lorafleet_gateway import convert, protocol
from lorafleet_gateway.app import build_app
from lorafleet_gateway.settings import GatewaySettings

PROBE_LOSSES = (*contract.LOSS_NAMES, *contract.REFUSED_LOSSES, "nope", "CROSS_ENTROPY", "")
# Per AdamParams field: values on both sides of each bound, and the non-finite ones.
PROBE_VALUES = (-1.0, -1e-12, 0.0, 1e-12, 0.5, 1.0 - 1e-9, 1.0, 2.0, math.inf, -math.inf, math.nan)


def _accepts(check: Callable[[], object]) -> bool:
    try:
        check()
    except InvalidArgument:
        return False
    return True


def _adam_probes() -> list[dict[str, float]]:
    return [
        {**contract.ADAM_DEFAULTS, name: value}
        for name in contract.ADAM_DEFAULTS
        for value in PROBE_VALUES
    ]


def _contract_adam(values: dict[str, float]) -> bool:
    return _accepts(lambda: contract.check_adam(values))


def _datum(loss: str) -> dict:
    spec = contract.LOSSES.get(loss, contract.LOSSES["importance_sampling"])
    inputs = {
        name: {"data": [1], "dtype": "int64"}
        if name in contract.INT_INPUTS
        else {"data": [0.5], "dtype": "float32"}
        for name in spec.required
    }
    return {"model_input": {"chunks": [{"tokens": [3]}]}, "loss_fn_inputs": inputs}


def test_gateway_accepts_exactly_the_contract_losses_and_adam_ranges() -> None:
    for loss in PROBE_LOSSES:
        body = protocol.ForwardBackwardInput.model_validate(
            {"data": [_datum(loss)], "loss_fn": loss}
        )
        accepted = _accepts(lambda body=body: convert.fb_input_from_json(body, "in", False))
        assert accepted == (loss in contract.LOSSES), loss
    for values in _adam_probes():
        params = protocol.AdamParams.model_validate(values)
        accepted = _accepts(lambda params=params: convert.adam_from_json(params))
        assert accepted == _contract_adam(values), values


def test_gateway_refuses_dimuon_with_the_contract_reason() -> None:
    body = protocol.ForwardBackwardInput.model_validate(
        {"data": [_datum("dimuon")], "loss_fn": "dimuon"}
    )
    with pytest.raises(InvalidArgument) as info:
        convert.fb_input_from_json(body, "forward_backward_input", False)
    assert info.value.field == "forward_backward_input.loss_fn"
    assert info.value.message == contract.REFUSED_LOSSES["dimuon"]


def test_controller_accepts_the_contract_adam_ranges() -> None:
    validate = pytest.importorskip("lorafleet_controller.validate")
    for values in _adam_probes():
        payload = cpb.OperationPayload(optim_step=pb.AdamParams(**values))
        assert (validate.validate(payload) is None) == _contract_adam(values), values


def _proto_datum(loss: str) -> pb.Datum:
    spec = contract.LOSSES.get(loss, contract.LOSSES["importance_sampling"])
    inputs = {
        name: pb.Tensor(dtype=pb.DTYPE_INT64, shape=[1], data=(1).to_bytes(8, "little"))
        if name in contract.INT_INPUTS
        else pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1], data=b"\x00\x00\x00?")
        for name in spec.required
    }
    return pb.Datum(tokens=[3], loss_fn_inputs=inputs)


def test_the_message_validator_accepts_exactly_the_contract_losses() -> None:
    """The one forward(_backward) validator the gateway and the trainer both run (the
    controller no longer restates it: its validate.py checks optim_step and the rest)."""
    for loss in PROBE_LOSSES:
        fb = pb.ForwardBackwardInput(loss_fn=loss, data=[_proto_datum(loss)])
        accepted = _accepts(lambda fb=fb: validate_msgs.check_forward_backward(fb, Limits()))
        assert accepted == (loss in contract.LOSSES), loss


def test_trainer_accepts_exactly_the_contract_losses_and_adam_ranges() -> None:
    losses = pytest.importorskip("lorafleet_trainer.losses")
    optim = pytest.importorskip("lorafleet_trainer.optim")
    domain = pytest.importorskip("lorafleet_trainer.domain")
    for loss in PROBE_LOSSES:
        call = SimpleNamespace(loss_fn=loss, loss_fn_config={}, group_tokens=0)
        accepted = _accepts(lambda call=call: losses.parse_loss_config(call))
        assert accepted == (loss in contract.LOSSES), loss
    for values in _adam_probes():
        params = domain.AdamParams(**values)
        accepted = _accepts(lambda params=params: optim.validate_adam(params))
        assert accepted == _contract_adam(values), values


def test_every_route_documents_its_response() -> None:
    schema = build_app(GatewaySettings(), b"k" * 32).openapi()
    undocumented = []
    for path, methods in schema["paths"].items():
        for method, operation in methods.items():
            content = operation["responses"].get("200", {}).get("content", {})
            # a schema of a title alone is what FastAPI writes for `-> Any`: no model
            if not content or not all(
                set(media.get("schema", {})) - {"title", "description"}
                for media in content.values()
            ):
                undocumented.append(f"{method.upper()} {path}")
    assert len(schema["paths"]) > 30 and not undocumented, undocumented
