"""Admission reads a payload's kind from its bytes and never parses the tensors.

The gateway serialises an OperationPayload once; the controller hashes, stores and forwards
those bytes (validate.admit) and parses only the control payloads it acts on.
"""

from __future__ import annotations

import pytest

from lorafleet import errors
from lorafleet.v1 import common_pb2, controller_pb2
from lorafleet_controller import validate

K = controller_pb2
FB = common_pb2.ForwardBackwardInput(
    data=[common_pb2.Datum(tokens=list(range(300)))], loss_fn="cross_entropy"
)
PAYLOADS = {
    K.OPERATION_KIND_FORWARD: K.OperationPayload(forward=FB),
    K.OPERATION_KIND_FORWARD_BACKWARD: K.OperationPayload(forward_backward=FB),
    K.OPERATION_KIND_OPTIM_STEP: K.OperationPayload(
        optim_step=common_pb2.AdamParams(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-12)
    ),
    K.OPERATION_KIND_SAVE_STATE: K.OperationPayload(save_state=K.SaveStatePayload(name="a")),
    K.OPERATION_KIND_LOAD_STATE: K.OperationPayload(
        load_state=K.LoadStatePayload(path="tinker://r:train:0/weights/a")
    ),
    K.OPERATION_KIND_SAVE_WEIGHTS_FOR_SAMPLER: K.OperationPayload(
        save_weights_for_sampler=K.SaveWeightsForSamplerPayload(name="s")
    ),
}


def _bytes(payload: controller_pb2.OperationPayload) -> bytes:
    return payload.SerializeToString(deterministic=True)


@pytest.mark.parametrize("kind", sorted(PAYLOADS))
def test_the_kind_is_read_from_the_first_tag(kind: int) -> None:
    body = _bytes(PAYLOADS[kind])
    assert validate.wire_kind(body) == kind == validate.payload_kind(PAYLOADS[kind])
    checked = validate.admit(body)
    assert (checked.kind, checked.rejection) == (kind, None)
    # the digest is the one the parsed payload always had, so a record admitted before the
    # payload travelled as bytes still matches its retry
    assert checked.digest == validate.digest(PAYLOADS[kind])


def test_anything_but_one_field_has_no_kind() -> None:
    fb = _bytes(PAYLOADS[K.OPERATION_KIND_FORWARD_BACKWARD])
    save = _bytes(PAYLOADS[K.OPERATION_KIND_SAVE_STATE])
    for body in (b"", fb[:-1], fb + save, save + fb, b"\xff" + fb[1:], b"\x12\xff"):
        assert validate.wire_kind(body) == K.OPERATION_KIND_UNSPECIFIED, body[:8]


def test_tensor_payloads_are_admitted_unparsed() -> None:
    """A forward_backward whose tensors do not even parse is admitted as it is: parsing it
    is the trainer's job, which refuses it with the operation's error."""
    body = b"\x12\x03\xff\xff\xff"  # field 2 (forward_backward), 3 bytes that are no message
    checked = validate.admit(body)
    assert (checked.kind, checked.rejection) == (K.OPERATION_KIND_FORWARD_BACKWARD, None)


def test_control_payloads_are_checked() -> None:
    bad = validate.admit(_bytes(K.OperationPayload(save_state=K.SaveStatePayload(name=".."))))
    assert isinstance(bad.rejection, errors.InvalidArgument) and bad.rejection.field == "name"
    empty = validate.admit(b"")
    assert isinstance(empty.rejection, errors.InvalidArgument)
    assert empty.rejection.field == "payload"
    two = _bytes(PAYLOADS[K.OPERATION_KIND_SAVE_STATE]) + _bytes(
        PAYLOADS[K.OPERATION_KIND_OPTIM_STEP]
    )
    refused = validate.admit(two)
    assert isinstance(refused.rejection, errors.InvalidArgument)
    assert refused.rejection.field == "payload"


def test_a_sampler_save_hashes_without_the_ids_an_sdk_remints() -> None:
    def save(seq: int) -> bytes:
        sw = K.SaveWeightsForSamplerPayload(sampler_session_id="s", sampling_session_seq_id=seq)
        return _bytes(K.OperationPayload(save_weights_for_sampler=sw))

    assert validate.admit(save(1)).digest == validate.admit(save(2)).digest
