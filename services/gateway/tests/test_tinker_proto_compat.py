"""Our vendored tinker_public schema against the compiled module inside each real SDK.

Two checks per SDK version: every field the SDK's descriptor declares exists in ours with
the same number, type, repetition, oneof and message type (names may differ: 0.24.1's
TopkPromptLogprobs is our TopkLogprobs), and messages built from the same dict serialize to
identical bytes.
"""

from __future__ import annotations

import base64
import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from google.protobuf import json_format

from lorafleet_gateway.tinker_proto import tinker_public_pb2 as ours

VERSIONS = ("0.24.1", "0.38.0")
RENAMED = {"TopkPromptLogprobs": "TopkLogprobs"}

_DUMP = r"""
import base64, json, sys
from google.protobuf import json_format
from tinker.proto import tinker_public_pb2 as pb
def fields(d):
    return {f.number: [f.type, f.is_repeated, f.message_type.name if f.message_type else "",
                       f.containing_oneof.name if f.containing_oneof else ""] for f in d.fields}
messages = {n: fields(d) for n, d in pb.DESCRIPTOR.message_types_by_name.items()}
samples = json.loads(sys.stdin.read())
encoded = {}
for name, body in samples.items():
    if name in pb.DESCRIPTOR.message_types_by_name:
        msg = json_format.ParseDict(body, getattr(pb, name)(), ignore_unknown_fields=True)
        encoded[name] = base64.b64encode(msg.SerializeToString(deterministic=True)).decode()
print(json.dumps({"messages": messages, "encoded": encoded}))
"""

# Bodies in proto3 JSON form, covering scalars, bytes, maps, oneofs and optionals.
SAMPLES = {
    "ForwardBackwardRequest": {
        "modelId": "s:train:0",
        "seqId": 3,
        "lossFn": "ppo",
        "forwardOnly": True,
        "lossFnConfig": {"clip_low_threshold": 0.8},
        "data": [
            {
                "modelInput": [{"encodedText": {"tokens": "AQAAAAIAAAA="}}],
                "lossFnInputs": {
                    "weights": {"dense": "AACAPw==", "dtype": "DTYPE_FLOAT32", "shape": ["1"]},
                    "target_tokens": {
                        "sparseCsr": {
                            "values": "AQAAAAAAAAA=",
                            "crowIndices": "AAAAAAAAAAABAAAAAAAAAA==",
                            "colIndices": "AAAAAAAAAAA=",
                        },
                        "dtype": "DTYPE_INT64",
                        "shape": ["1", "1"],
                    },
                },
            }
        ],
    },
    "ForwardBackwardOutput": {
        "lossFnOutputType": "ArrayRecord",
        "metrics": {"loss:sum": 2.5},
        "lossFnOutputs": [
            {
                "typeTag": "ArrayRecord",
                "numDatums": "1",
                "fields": {
                    "logprobs": {
                        "data": "AACAvw==",
                        "offsets": "AAAAAAAAAAAEAAAAAAAAAA==",
                        "dtype": "DTYPE_FLOAT32",
                        "trailingShape": [],
                    }
                },
            }
        ],
    },
    "SampleResponse": {
        "sequences": [
            {"stopReason": "STOP_REASON_LENGTH", "tokens": "BQAAAA==", "logprobs": "AAAAvw=="}
        ],
        "promptLogprobs": "AADAfw==",
        "promptCacheHitTokens": 2,
        "topkPromptLogprobs": {"tokenIds": "AQAAAA==", "logprobs": "AACAvw==", "k": 1},
    },
}


def _sdk(python: Path) -> dict:
    out = subprocess.run(
        [str(python), "-c", _DUMP],
        input=json.dumps(SAMPLES),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_sdk_field_matches_ours(version: str, sdk_python: Callable[[str], Path]) -> None:
    sdk = _sdk(sdk_python(version))
    for name, fields in sdk["messages"].items():
        descriptor = ours.DESCRIPTOR.message_types_by_name[RENAMED.get(name, name)]
        mine = {f.number: f for f in descriptor.fields}
        for number, (ftype, repeated, message, oneof) in fields.items():
            field = mine.get(int(number))
            assert field is not None, f"{name}: field {number} missing"
            assert (field.type, field.is_repeated) == (ftype, repeated), f"{name}.{field.name}"
            mine_message = field.message_type.name if field.message_type else ""
            assert RENAMED.get(message, message) == mine_message, f"{name}.{field.name}"
            assert (field.containing_oneof.name if field.containing_oneof else "") == oneof


@pytest.mark.parametrize("version", VERSIONS)
def test_same_bytes_as_the_sdk(version: str, sdk_python: Callable[[str], Path]) -> None:
    sdk = _sdk(sdk_python(version))
    assert set(sdk["encoded"]) == set(SAMPLES)
    for name, body in SAMPLES.items():
        msg = json_format.ParseDict(body, getattr(ours, name)(), ignore_unknown_fields=True)
        assert base64.b64decode(sdk["encoded"][name]) == msg.SerializeToString(deterministic=True)
