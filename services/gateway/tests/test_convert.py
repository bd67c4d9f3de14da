"""convert.py: Tinker JSON / tinker_public protobuf ⇄ lorafleet.v1, checked against numpy."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pydantic
import pytest

from lorafleet import contract
from lorafleet.errors import InvalidArgument
from lorafleet.v1 import common_pb2 as pb
from lorafleet.validate_msgs import Limits
from lorafleet_gateway import convert, protocol
from lorafleet_gateway.errors import sent_field
from lorafleet_gateway.tinker_proto import tinker_public_pb2 as tpb


def td(**kw: object) -> protocol.TensorData:
    return protocol.TensorData.model_validate(kw)


def arr(t: pb.Tensor) -> np.ndarray:
    return convert.array(t)


def fb_json(data: list[dict], loss_fn: str = "cross_entropy") -> protocol.ForwardBackwardInput:
    return protocol.ForwardBackwardInput.model_validate({"data": data, "loss_fn": loss_fn})


def datum_json(tokens: list[int], **inputs: dict) -> dict:
    return {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
        "loss_fn_inputs": inputs,
    }


def fb_request_from_proto(raw: bytes) -> tuple[str, int, pb.ForwardBackwardInput]:
    model_id, seq_id, convert_input = convert.fb_request_parts_from_proto(raw)
    return model_id, seq_id, convert_input(Limits())


def raises(field: str):
    """pytest.raises(InvalidArgument) that also checks the named field."""

    class _Check:
        def __enter__(self):
            self.ctx = pytest.raises(InvalidArgument)
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            handled = self.ctx.__exit__(*exc)
            assert self.info.value.field == field, (self.info.value.field, str(self.info.value))
            return handled

    return _Check()


# --- JSON tensors -------------------------------------------------------------------------
def test_dense_json_tensor_keeps_values_dtype_and_shape() -> None:
    out = convert.array_from_json(td(data=[1, 2, 3, 4, 5, 6], dtype="int64", shape=[2, 3]), "x")
    assert out.dtype == np.int64 and out.shape == (2, 3)
    assert out.tolist() == [[1, 2, 3], [4, 5, 6]]
    one_d = convert.array_from_json(td(data=[0.5, -1.0], dtype="float32"), "x")
    assert one_d.dtype == np.float32 and one_d.tolist() == [0.5, -1.0]


def test_json_tensor_whose_shape_does_not_fit_is_rejected() -> None:
    with raises("w.shape"):
        convert.array_from_json(td(data=[1.0, 2.0, 3.0], dtype="float32", shape=[2, 2]), "w")


def test_json_int64_tensor_with_fraction_and_float_nan_are_rejected() -> None:
    with raises("t.data"):
        convert.array_from_json(td(data=[1, 2.5], dtype="int64"), "t")
    with raises("w.data"):
        convert.array_from_json(td(data=[1.0, math.nan], dtype="float32"), "w")
    with raises("w.data"):  # finite in float64, infinite in float32
        convert.array_from_json(td(data=[1e39], dtype="float32"), "w")


def test_sparse_csr_json_densifies_like_torch() -> None:
    dense = np.array([[0, 0, 3], [0, 0, 0], [1, 2, 0]], dtype=np.float32)
    rows, cols = np.nonzero(dense)
    crow = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=3))]).tolist()
    sparse = td(
        data=dense[rows, cols].tolist(),
        dtype="float32",
        shape=[3, 3],
        sparse_crow_indices=crow,
        sparse_col_indices=cols.tolist(),
    )
    np.testing.assert_array_equal(convert.array_from_json(sparse, "w"), dense)


@pytest.mark.parametrize(
    ("crow", "col", "field"),
    [
        ([0, 1, 1], [2], "w.sparse_crow_indices"),  # nrows + 1 entries expected (3 rows)
        ([0, 2, 1, 1], [0, 1], "w.sparse_crow_indices"),  # decreasing
        ([0, 1, 1, 2], [0, 3], "w.sparse_col_indices"),  # column out of range
        ([0, 1, 1, 2], [0], "w.sparse_col_indices"),  # one column index short
    ],
)
def test_bad_sparse_csr_is_rejected(crow: list[int], col: list[int], field: str) -> None:
    with raises(field):
        convert.array_from_json(
            td(
                data=[1.0, 2.0],
                dtype="float32",
                shape=[3, 3],
                sparse_crow_indices=crow,
                sparse_col_indices=col,
            ),
            "w",
        )


# --- proto tensors ------------------------------------------------------------------------
def test_proto_dense_int32_and_bfloat16_are_widened() -> None:
    ids = tpb.Tensor(dense=np.array([7, 8], "<i4").tobytes(), dtype=tpb.DTYPE_INT32, shape=[2])
    out = convert.array_from_proto(ids, "t")
    assert out.dtype == np.int64 and out.tolist() == [7, 8]
    halves = np.array([1.5, -2.25], np.float32).view(np.uint32) >> 16
    bf16 = tpb.Tensor(dense=halves.astype("<u2").tobytes(), dtype=tpb.DTYPE_BFLOAT16)
    assert convert.array_from_proto(bf16, "w").tolist() == [1.5, -2.25]


def test_proto_tensor_byte_length_must_match_dtype_and_shape() -> None:
    odd = tpb.Tensor(dense=b"\x00" * 6, dtype=tpb.DTYPE_FLOAT32)
    with raises("w.dense"):
        convert.array_from_proto(odd, "w")
    short = tpb.Tensor(dense=b"\x00" * 8, dtype=tpb.DTYPE_FLOAT32, shape=[3])
    with raises("w.shape"):
        convert.array_from_proto(short, "w")
    with raises("w.dtype"):
        convert.array_from_proto(tpb.Tensor(dense=b"", dtype=tpb.DTYPE_UNSPECIFIED), "w")


def test_proto_sparse_csr() -> None:
    t = tpb.Tensor(dtype=tpb.DTYPE_INT64, shape=[2, 4])
    t.sparse_csr.values = np.array([5, 6], "<i8").tobytes()
    t.sparse_csr.crow_indices = np.array([0, 1, 2], "<i8").tobytes()
    t.sparse_csr.col_indices = np.array([3, 0], "<i8").tobytes()
    assert convert.array_from_proto(t, "t").tolist() == [[0, 0, 0, 5], [6, 0, 0, 0]]


def test_proto_sparse_csr_refusals_name_the_proto_fields() -> None:
    """The SDK's protobuf names its CSR parts sparse_csr.crow_indices/col_indices, not the
    JSON's sparse_crow_indices/sparse_col_indices."""
    t = tpb.Tensor(dtype=tpb.DTYPE_INT64, shape=[2, 4])
    t.sparse_csr.values = np.array([5, 6], "<i8").tobytes()
    t.sparse_csr.crow_indices = np.array([0, 1], "<i8").tobytes()
    t.sparse_csr.col_indices = np.array([3, 0], "<i8").tobytes()
    with raises("t.sparse_csr.crow_indices"):
        convert.array_from_proto(t, "t")
    t.sparse_csr.crow_indices = np.array([0, 1, 2], "<i8").tobytes()
    t.sparse_csr.col_indices = np.array([3, 4], "<i8").tobytes()
    with raises("t.sparse_csr.col_indices"):
        convert.array_from_proto(t, "t")


@pytest.mark.parametrize(
    ("v1", "sdk", "position"),
    [
        ("forward_input.data[2].tokens[7]", "forward_input.data[2].model_input", "7"),
        ("data[0].tokens", "data[0].model_input", None),
        ("prompt_tokens[3]", "prompt", "3"),
        ("params.stop_token_ids[1]", "sampling_params.stop", "1"),
        ("params.stop_strings[0]", "sampling_params.stop", "0"),
        ("params.top_p", "sampling_params.top_p", None),
        ("data[0].loss_fn_inputs.weights", "data[0].loss_fn_inputs.weights", None),
        ("num_samples", "num_samples", None),
    ],
)
def test_validator_refusals_name_the_sdk_fields(v1: str, sdk: str, position: str | None) -> None:
    def check() -> None:
        raise InvalidArgument("bad", field=v1)

    with raises(sdk) as info:
        convert.sdk_named(check)
    assert (f"(position {position})" in info.value.message) == (position is not None)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": {"chunks": []}, "sampling_params": {"stop": [1.5]}}, "sampling_params.stop"),
        ({"prompt": {"chunks": []}, "sampling_params": {"stop": {"a": 1}}}, "sampling_params.stop"),
        ({"prompt": {"chunks": [{"tokens": [2**40]}]}}, "prompt.chunks[0].tokens[0]"),
        ({"sampling_params": {}}, "prompt"),
    ],
)
def test_schema_refusals_name_the_json_field_not_the_union_member(body: dict, field: str) -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        protocol.SampleRequest.model_validate(body)
    assert sent_field(info.value.errors()[0], body) == field


# --- data ---------------------------------------------------------------------------------
def test_json_forward_backward_input_becomes_v1() -> None:
    body = fb_json(
        [
            datum_json(
                [1, 2, 3],
                target_tokens={"data": [2, 3, 4], "dtype": "int64"},
                weights={"data": [0.0, 1.0, 1.0], "dtype": "float32"},
            )
        ]
    )
    out = convert.fb_input_from_json(body, "forward_backward_input", False)
    assert out.loss_fn == "cross_entropy" and not out.forward_only
    (d,) = out.data
    assert list(d.tokens) == [1, 2, 3]
    assert arr(d.loss_fn_inputs["target_tokens"]).tolist() == [2, 3, 4]
    assert d.loss_fn_inputs["weights"].dtype == pb.DTYPE_FLOAT32


def test_leading_dimension_must_equal_token_count() -> None:
    body = fb_json([datum_json([1, 2, 3], target_tokens={"data": [2, 3], "dtype": "int64"})])
    with raises("fb.data[0].loss_fn_inputs.target_tokens"):
        convert.fb_input_from_json(body, "fb", False)


def test_unknown_loss_missing_inputs_and_non_text_chunks_are_rejected() -> None:
    target = {"data": [2], "dtype": "int64"}
    with raises("fb.loss_fn"):
        convert.fb_input_from_json(
            fb_json([datum_json([1], target_tokens=target)], "nope"), "fb", False
        )
    with raises("fb.data[0].loss_fn_inputs.logprobs"):
        convert.fb_input_from_json(
            fb_json([datum_json([1], target_tokens=target)], "ppo"), "fb", False
        )
    image = {"model_input": {"chunks": [{"type": "image"}]}, "loss_fn_inputs": {}}
    with raises("fb.data[0].model_input.chunks[0].type"):
        convert.fb_input_from_json(fb_json([image]), "fb", False)
    with raises("fb.data[0].loss_fn_inputs.target_tokens.dtype"):
        convert.fb_input_from_json(
            fb_json([datum_json([1], target_tokens={"data": [2.0], "dtype": "float32"})]),
            "fb",
            False,
        )


def test_rows_and_tokens_of_one_operation_are_capped_naming_data() -> None:
    """Limits.max_rows / max_tokens (the gateway's MAX_ROWS_PER_OPERATION and
    MAX_TOKENS_PER_OPERATION); 0 = no cap."""
    target = {"data": [2, 3, 4], "dtype": "int64"}
    body = fb_json([datum_json([1, 2, 3], target_tokens=target)] * 4)  # 4 rows, 12 tokens
    for limits in (Limits(max_rows=3), Limits(max_tokens=11)):
        with raises("fb.data"):
            convert.fb_input_from_json(body, "fb", False, limits)
    for limits in (Limits(max_rows=4, max_tokens=12), Limits()):
        assert len(convert.fb_input_from_json(body, "fb", False, limits).data) == 4
    raw = _proto_request().SerializeToString()
    _, _, convert_input = convert.fb_request_parts_from_proto(raw)
    with raises("data"):
        convert_input(Limits(max_tokens=1))


def _proto_request(**kw: object) -> tpb.ForwardBackwardRequest:
    req = tpb.ForwardBackwardRequest(model_id="s:train:0", seq_id=4, loss_fn="ppo", **kw)
    d = req.data.add()
    d.model_input.add().encoded_text.tokens = np.array([3, 4], "<i4").tobytes()
    for name, values in {"logprobs": [-1.0, -2.0], "advantages": [1.0, 1.0]}.items():
        d.loss_fn_inputs[name].CopyFrom(
            tpb.Tensor(dense=np.array(values, "<f4").tobytes(), dtype=tpb.DTYPE_FLOAT32, shape=[2])
        )
    d.loss_fn_inputs["target_tokens"].CopyFrom(
        tpb.Tensor(dense=np.array([4, 5], "<i8").tobytes(), dtype=tpb.DTYPE_INT64, shape=[2])
    )
    return req


def test_proto_request_prefers_loss_fn_config_v2() -> None:
    req = _proto_request(forward_only=True, loss_fn_config={"clip_low_threshold": 0.5})
    req.loss_fn_config_v2["clip_low_threshold"].number = 0.8
    model_id, seq_id, fb = fb_request_from_proto(req.SerializeToString())
    assert (model_id, seq_id, fb.forward_only) == ("s:train:0", 4, True)
    # v2 wins; the loss's other config keys get the contract's defaults.
    assert dict(fb.loss_fn_config) == {
        "clip_low_threshold": 0.8,
        "clip_high_threshold": contract.DEFAULT_CLIP_HIGH,
    }
    assert list(fb.data[0].tokens) == [3, 4]
    req.loss_fn_config_v2["mode"].text = "x"
    with raises("loss_fn_config_v2.mode"):
        fb_request_from_proto(req.SerializeToString())


def test_garbage_protobuf_is_rejected() -> None:
    with raises("body"):
        fb_request_from_proto(b"\xff\xff\xff\xff")
    with raises("data[0].model_input[0].encoded_text.tokens"):
        req = _proto_request()
        req.data[0].model_input[0].encoded_text.tokens = b"\x01\x02\x03"
        fb_request_from_proto(req.SerializeToString())


def test_adam_params_must_be_finite_and_in_range() -> None:
    ok = convert.adam_from_json(protocol.AdamParams(learning_rate=1e-3))
    assert ok.learning_rate == 1e-3 and ok.beta2 == 0.95
    with raises("adam_params.learning_rate"):
        convert.adam_from_json(protocol.AdamParams(learning_rate=math.nan))
    with raises("adam_params.beta1"):
        convert.adam_from_json(protocol.AdamParams(beta1=1.0))
    with raises("adam_params.eps"):
        convert.adam_from_json(protocol.AdamParams(eps=math.inf))


def test_sampling_params_stop_forms() -> None:
    def conv(stop: object) -> pb.SamplingParams:
        return convert.sampling_params_from_json(protocol.SamplingParams(stop=stop))

    assert list(conv("\n").stop_strings) == ["\n"]
    assert list(conv([5, 6]).stop_token_ids) == [5, 6]
    assert conv([]).disable_eos_stop and not conv(None).disable_eos_stop


# --- outputs ------------------------------------------------------------------------------
def _v1(values: np.ndarray) -> pb.Tensor:
    dtype = pb.DTYPE_FLOAT32 if values.dtype.kind == "f" else pb.DTYPE_INT64
    return pb.Tensor(dtype=dtype, shape=values.shape, data=values.tobytes())


def _decode_batched(out: tpb.ForwardBackwardOutput, name: str) -> list[np.ndarray]:
    """What the SDK's response_conv does: split data at byte offsets, restore shapes."""
    per_datum = []
    for record in out.loss_fn_outputs:
        bt = record.fields[name]
        offsets = np.frombuffer(bt.offsets, "<i8")
        assert len(offsets) == record.num_datums + 1
        le = "<f4" if bt.dtype == tpb.DTYPE_FLOAT32 else "<i8"
        trailing = tuple(bt.trailing_shape)
        for a, b in itertools.pairwise(offsets):
            values = np.frombuffer(bt.data[a:b], le)
            per_datum.append(values.reshape((-1, *trailing)))
    return per_datum


def test_forward_backward_output_proto_and_json_agree() -> None:
    rng = np.random.default_rng(0)
    lps = [rng.standard_normal(n).astype(np.float32) for n in (3, 5)]
    topk = rng.standard_normal((4, 2)).astype(np.float32)  # an (N, K) output starts a new record
    out = pb.ForwardBackwardOutput(metrics={"loss:sum": 1.25})
    for values in [*lps, topk]:
        out.outputs.add().outputs["logprobs"].CopyFrom(_v1(values))
    proto = tpb.ForwardBackwardOutput.FromString(convert.fb_output_proto(out))
    assert dict(proto.metrics) == {"loss:sum": 1.25}
    assert [r.num_datums for r in proto.loss_fn_outputs] == [2, 1]
    assert list(proto.loss_fn_outputs[1].fields["logprobs"].trailing_shape) == [2]
    decoded = _decode_batched(proto, "logprobs")
    for got, want in zip(decoded, [*lps, topk], strict=True):
        np.testing.assert_array_equal(got, want)
    as_json = convert.fb_output_json(out)
    assert as_json["loss_fn_output_type"] == "ArrayRecord"
    assert as_json["loss_fn_outputs"][2]["logprobs"]["shape"] == [4, 2]
    assert as_json["loss_fn_outputs"][0]["logprobs"]["data"] == lps[0].tolist()


def test_sample_output_proto_and_json() -> None:
    out = pb.SampleOutput(prompt_logprobs=[math.nan, -1.5, -0.25])
    out.sequences.add(tokens=[5, 6], logprobs=[-0.5, -0.75], stop_reason=pb.STOP_REASON_STOP)
    out.sequences.add(tokens=[7], logprobs=[-1.0], stop_reason=pb.STOP_REASON_LENGTH)
    out.topk_prompt_logprobs.add()
    out.topk_prompt_logprobs.add(token_ids=[9, 3], logprobs=[-0.1, -2.0])
    out.topk_prompt_logprobs.add(token_ids=[4], logprobs=[-0.2])
    proto = tpb.SampleResponse.FromString(convert.sample_output_proto(out))
    assert [s.stop_reason for s in proto.sequences] == [
        tpb.STOP_REASON_STOP,
        tpb.STOP_REASON_LENGTH,
    ]
    assert np.frombuffer(proto.sequences[0].tokens, "<i4").tolist() == [5, 6]
    assert np.frombuffer(proto.sequences[0].logprobs, "<f4").tolist() == [-0.5, -0.75]
    prompt = np.frombuffer(proto.prompt_logprobs, "<f4")
    assert math.isnan(prompt[0]) and prompt[1:].tolist() == [-1.5, -0.25]
    topk = proto.topk_prompt_logprobs
    assert (topk.k, topk.length) == (2, 3)
    ids = np.frombuffer(topk.token_ids, "<i4").reshape(3, 2)
    assert ids.tolist() == [[0, 0], [9, 3], [4, 0]]
    assert np.frombuffer(topk.logprobs, "<f4").reshape(3, 2)[2, 1] == np.float32(-99999.0)
    as_json = convert.sample_output_json(out)
    assert as_json["prompt_logprobs"] == [None, -1.5, -0.25]
    assert as_json["sequences"][1] == {"tokens": [7], "logprobs": [-1.0], "stop_reason": "length"}
    assert as_json["topk_prompt_logprobs"][1] == [(9, pytest.approx(-0.1)), (3, -2.0)]


def test_named_target_modules_need_no_train_flag() -> None:
    """Explicit target_modules mean exactly those modules (the flags are ignored), so all
    flags off is refused only when no module is named."""
    off = protocol.LoraConfig(rank=2, train_attn=False, train_mlp=False, train_unembed=False)
    with pytest.raises(InvalidArgument) as info:
        convert.lora_from_json(off, contract.LoraOptions())
    assert info.value.field == "lora_config"
    named = contract.LoraOptions(target_modules=("q_proj",))
    assert list(convert.lora_from_json(off, named).target_modules) == ["q_proj"]
