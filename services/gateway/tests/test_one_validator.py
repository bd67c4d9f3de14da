"""One validator per v1 message (issue 23): the gateway and the service that acts refuse the
same bad input naming the same field, because both run `lorafleet.validate_msgs`.

Forward/backward: the gateway's conversion of a JSON body (what answers the 400) against the
trainer's path for the same v1 message (its gRPC conversion, then the engine's
prepare_input with a real engine's vocabulary and context length). Samples: a real fleet's
/asample 400 against a real RolloutCore on the same tiny model with the same num_samples
limit.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from lorafleet.errors import InvalidArgument
from lorafleet.tensors import BY_NAME
from lorafleet.testing import wait_until_async
from lorafleet.v1 import common_pb2 as pb
from lorafleet_gateway import convert, protocol

LIMIT = 3
TARGETS = {"data": [1, 2], "dtype": "int64", "shape": [2]}
WEIGHTS = {"data": [1.0, 1.0], "dtype": "float32", "shape": [2]}

# (loss_fn, tokens, loss_fn_inputs as Tinker JSON tensors, the field both refuse)
FB_CASES: list[tuple[str, list[int], dict[str, dict], str]] = [
    ("cross_entropy", [3, 4], {"weights": WEIGHTS}, "data[0].loss_fn_inputs.target_tokens"),
    (
        "cross_entropy",
        [3, 4],
        {"target_tokens": TARGETS, "weights": {**WEIGHTS, "data": [1.0], "shape": [1]}},
        "data[0].loss_fn_inputs.weights",
    ),
    (
        "cross_entropy",
        [3, 4],
        {"target_tokens": {"data": [1.0, 2.0], "dtype": "float32", "shape": [2]}},
        "data[0].loss_fn_inputs.target_tokens.dtype",
    ),
    (
        "cross_entropy",
        [3, 4],
        {"target_tokens": {**TARGETS, "data": [1, -2]}},
        "data[0].loss_fn_inputs.target_tokens[1]",
    ),
    ("cross_entropy", [3, -4], {"target_tokens": TARGETS}, "data[0].tokens[1]"),
    # Deployment limits (the tiny model's vocabulary, 2048, and positions, 512), which the
    # gateway takes from capabilities and the trainer from its model.
    ("cross_entropy", [3, 2048], {"target_tokens": TARGETS}, "data[0].tokens[1]"),
    (
        "cross_entropy",
        [3] * 513,
        {"target_tokens": {"data": [1] * 513, "dtype": "int64", "shape": [513]}},
        "data[0].tokens",
    ),
    (
        "importance_sampling",
        [3, 4],
        {"target_tokens": TARGETS, "logprobs": WEIGHTS},
        "data[0].loss_fn_inputs.advantages",
    ),
    # Shapes past the leading dimension: one value per position, top-K targets only for
    # cross_entropy, weights shaped like the targets (the trainer's rules before issue 23).
    (
        "importance_sampling",
        [3, 4],
        {"target_tokens": TARGETS, "logprobs": WEIGHTS, "advantages": {**WEIGHTS, "shape": [2, 1]}},
        "data[0].loss_fn_inputs.advantages",
    ),
    (
        "ppo",
        [3, 4],
        {
            "target_tokens": {**TARGETS, "data": [1, 2, 1, 2], "shape": [2, 2]},
            "logprobs": WEIGHTS,
            "advantages": WEIGHTS,
        },
        "data[0].loss_fn_inputs.target_tokens",
    ),
    (
        "cross_entropy",
        [3, 4],
        {"target_tokens": {**TARGETS, "data": [1, 2, 1, 2], "shape": [2, 2]}, "weights": WEIGHTS},
        "data[0].loss_fn_inputs.weights",
    ),
]


def sdk_field(field: str) -> str:
    """The SDK's name of a v1 field (what the gateway answers): tokens are model_input."""
    return re.sub(r"\.tokens(\[\d+\])?$", ".model_input", field)


def _proto_tensor(t: dict) -> pb.Tensor:
    arr = np.asarray(t["data"], dtype=t["dtype"]).reshape(t["shape"])
    return pb.Tensor(
        dtype=BY_NAME[t["dtype"]],
        shape=list(arr.shape),
        data=arr.astype(arr.dtype.newbyteorder("<")).tobytes(),
    )


@pytest.fixture(scope="module")
def trainer_limits(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """What the trainer's servicer checks a ForwardBackwardInput against: its engine's
    vocabulary and context length (a real engine on the tiny model)."""
    from lorafleet.validate_msgs import Limits
    from lorafleet_trainer.engine import TrainerEngine

    engine = TrainerEngine.from_pretrained(
        tiny_model_dir,
        device="cpu",
        num_slots=1,
        max_rank=8,
        storage_root=tmp_path_factory.mktemp("s"),
    )
    return Limits(engine.vocab_size, engine.max_length)


@pytest.mark.parametrize(("loss_fn", "tokens", "inputs", "field"), FB_CASES)
def test_forward_backward_same_field_at_gateway_and_trainer(
    trainer_limits: Any, loss_fn: str, tokens: list[int], inputs: dict[str, dict], field: str
) -> None:
    trainer_convert = pytest.importorskip("lorafleet_trainer.convert")
    losses = pytest.importorskip("lorafleet_trainer.losses")
    body = protocol.ForwardBackwardInput.model_validate(
        {
            "loss_fn": loss_fn,
            "data": [
                {
                    "model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
                    "loss_fn_inputs": inputs,
                }
            ],
        }
    )
    with pytest.raises(InvalidArgument) as at_gateway:
        convert.fb_input_from_json(body, "forward_backward_input", False, trainer_limits)
    assert at_gateway.value.field == f"forward_backward_input.{sdk_field(field)}", at_gateway.value

    message = pb.ForwardBackwardInput(
        loss_fn=loss_fn,
        data=[
            pb.Datum(tokens=tokens, loss_fn_inputs={k: _proto_tensor(v) for k, v in inputs.items()})
        ],
    )
    with pytest.raises(InvalidArgument) as at_trainer:
        losses.prepare_input(trainer_convert.fb_input_from_proto(message), trainer_limits)
    assert at_trainer.value.field == field, at_trainer.value


# (the /asample body's changes, the rollout's SampleRequest fields, the v1 field the rollout
# refuses, the SDK's field the gateway's 400 names for the same rule)
SAMPLE_CASES: list[tuple[dict, dict, str, str]] = [
    ({"num_samples": LIMIT + 1}, {"num_samples": LIMIT + 1}, "num_samples", "num_samples"),
    (
        {"sampling_params": {"max_tokens": 100_000}},
        {"max_tokens": 100_000},
        "params.max_tokens",
        "sampling_params.max_tokens",
    ),
    (
        {"sampling_params": {"temperature": -1.0}},
        {"temperature": -1.0},
        "params.temperature",
        "sampling_params.temperature",
    ),
    ({"sampling_params": {"top_k": -2}}, {"top_k": -2}, "params.top_k", "sampling_params.top_k"),
    (
        {"sampling_params": {"stop": [""]}},
        {"stop_strings": ("",)},
        "params.stop_strings[0]",
        "sampling_params.stop",
    ),
    (
        {"sampling_params": {"stop": [3, -1]}},
        {"stop_token_ids": (3, -1)},
        "params.stop_token_ids[1]",
        "sampling_params.stop",
    ),
    (
        {"topk_prompt_logprobs": 2000},
        {"topk_prompt_logprobs": 2000},
        "topk_prompt_logprobs",
        "topk_prompt_logprobs",
    ),
    (
        {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, -1]}]}},
        {"prompt_tokens": (5, -1)},
        "prompt_tokens[1]",
        "prompt",
    ),
]


@pytest.fixture(scope="module")
def fleet(make_fleet: Callable[..., AbstractContextManager[object]]) -> Iterator[object]:
    rollout_env = {"LORAFLEET_ROLLOUT_MAX_NUM_SAMPLES": str(LIMIT)}
    with make_fleet(trainers=1, rollouts=1, slots=1, extra_env={"rollout": rollout_env}) as f:
        yield f


@pytest.fixture
async def rollout(tiny_model_dir: Path, tmp_path: Path) -> Any:
    """A rollout core like the fleet's: the torch engine on the same model, the same limit."""
    from lorafleet_rollout.core import Limits, RolloutCore
    from lorafleet_rollout.torch_engine import TorchEngine

    core = RolloutCore(
        TorchEngine(tiny_model_dir), Limits(max_num_samples=LIMIT), tmp_path / "resident"
    )
    await core.start()
    try:
        yield core
    finally:
        await core.close()


async def test_sample_same_field_at_gateway_and_rollout(fleet: object, rollout: Any) -> None:
    from lorafleet_rollout.types import SampleRequest, SamplingSpec

    base_url, key = fleet.base_url, fleet.api_key  # type: ignore[attr-defined]
    async with httpx.AsyncClient(
        base_url=f"{base_url}/api/v1", headers={"X-API-Key": key}, timeout=60
    ) as c:
        caps = (await c.get("/get_server_capabilities")).json()["supported_models"]
        base = next(m["model_name"] for m in caps if m["sampleable"])
        session = (await c.post("/create_session", json={"tags": [], "sdk_version": "t"})).json()
        created = await c.post(
            "/create_sampling_session",
            json={
                "session_id": session["session_id"],
                "sampling_session_seq_id": 0,
                "base_model": base,
            },
        )
        sampler = created.json()["sampling_session_id"]
        for seq, (case, fields, field, sdk) in enumerate(SAMPLE_CASES, start=1):
            change = dict(case)
            body: dict[str, Any] = {
                "sampling_session_id": sampler,
                "seq_id": seq,
                "num_samples": 1,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]},
                "sampling_params": {"max_tokens": 1},
            }
            params = {**body["sampling_params"], **change.pop("sampling_params", {})}
            body.update(change, sampling_params=params)
            refused = await c.post("/asample", json=body)
            assert refused.status_code == 400, refused.text
            assert refused.json()["field"] == sdk, refused.json()

            spec_fields = {
                k: v for k, v in fields.items() if k in SamplingSpec.__dataclass_fields__
            }
            request = SampleRequest(
                None,
                fields.get("prompt_tokens", (5, 6)),
                SamplingSpec(**{"max_tokens": 1, **spec_fields}),
                num_samples=fields.get("num_samples", 1),
                topk_prompt_logprobs=fields.get("topk_prompt_logprobs", 0),
            )
            with pytest.raises(InvalidArgument) as at_rollout:
                await rollout.sample("", 0, request)
            assert at_rollout.value.field == field, at_rollout.value

        # The vocabulary (the tiny model's 2048) is the trainers' report in capabilities.
        seqs = iter(range(len(SAMPLE_CASES) + 1, 10**6))

        async def out_of_vocab() -> httpx.Response | None:
            prompt = {"chunks": [{"type": "encoded_text", "tokens": [5, 2048]}]}
            body = {"sampling_session_id": sampler, "seq_id": next(seqs), "prompt": prompt}
            reply = await c.post("/asample", json={**body, "sampling_params": {"max_tokens": 1}})
            # Admitted only while the gateway's cached capabilities predate the trainer's
            # report (the rollout refuses it then): the next seq_id tries again.
            return reply if reply.status_code == 400 else None

        refused = await wait_until_async(out_of_vocab, "/asample refuses a token outside")
        assert refused.json()["field"] == "prompt", refused.json()
    with pytest.raises(InvalidArgument) as at_rollout:
        await rollout.sample("", 0, SampleRequest(None, (5, 2048), SamplingSpec(max_tokens=1)))
    assert at_rollout.value.field == "prompt_tokens[1]", at_rollout.value
