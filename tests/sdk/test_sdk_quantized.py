"""A fleet on a quantized base, through the real tinker SDK: `lorafleet up --quantization int8`
starts trainer and rollout with it (`LORAFLEET_TRAINER_QUANTIZATION`,
`LORAFLEET_ROLLOUT_QUANTIZATION`; chart `model.quantization`).

The trainer holds int8 codes and the torch engine serves the same weights dequantized
(`lorafleet.quantize`), so every sampled logprob and the sampler's compute_logprobs equal the
trainer's forward pass on the same tokens as closely as they do unquantized (≤ 1e-4, the
bound of test_sdk_sglang.py, whose SDK script this reuses), and the quickstart still teaches
its fact.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

#: The quickstart below may run 900 s on a loaded machine; its item's timeout is above that.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
TOL = 1e-4
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fleet(make_fleet: Callable[..., AbstractContextManager[object]]) -> Iterator[object]:
    with make_fleet(slots=4, quantization="int8") as running:  # lorafleet up --quantization
        yield running


def test_capabilities_report_the_quantization(target: Any) -> None:
    models = target.get("/api/v1/get_server_capabilities").json()["supported_models"]
    assert [m["quantization"] for m in models] == ["int8"]


def test_trainer_and_rollout_report_it_to_discovery(fleet: Any) -> None:
    """GetTrainerInfo and GetRolloutInfo carry it: discovery admits replicas from them."""
    from lorafleet.v1 import rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc

    with fleet.admin_channel(f"127.0.0.1:{fleet.member('trainer-0').port}") as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        assert (
            stub.GetTrainerInfo(trainer_pb2.GetTrainerInfoRequest(), timeout=30).quantization
            == "int8"
        )
    with fleet.admin_channel(f"127.0.0.1:{fleet.member('rollout-0').port}") as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        assert (
            stub.GetRolloutInfo(rollout_pb2.GetRolloutInfoRequest(), timeout=30).quantization
            == "int8"
        )


def test_sampler_logprobs_equal_the_trainers_on_the_quantized_base(
    target: Any,
    run_sdk: Callable[..., dict],
    sampler_matches_trainer: Callable[[dict, float], float],
) -> None:
    out = run_sdk("0.38.0", "sglang_script.py", target)
    assert out["losses"][-1] < out["losses"][0], out["losses"]
    worst = sampler_matches_trainer(out, TOL)
    print(f"largest |sampler - trainer| logprob on the int8 base: {worst:.2e}")


def test_the_quickstart_learns_its_fact_on_the_quantized_base(
    fleet: Any, sdk_python: Callable[[str], Path], tmp_path: Path
) -> None:
    env = dict(
        os.environ,
        TINKER_BASE_URL=fleet.base_url,
        TINKER_API_KEY=fleet.api_key,
        TINKER_TELEMETRY="0",
        HF_HUB_OFFLINE="1",
        QUICKSTART_STEPS="40",
        QUICKSTART_LR="3e-3",
        QUICKSTART_PLOT=str(tmp_path / "loss.png"),
    )
    out = subprocess.run(
        [str(sdk_python("0.38.0")), str(REPO / "examples" / "quickstart.py")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, f"quickstart failed:\n{out.stdout}\n{out.stderr[-4000:]}"
    assert "OK: the model learned the fact" in out.stdout
    after = re.search(r"after training:.*A: '(.*)'", out.stdout)
    assert after and "Dima" in after.group(1)


def test_up_refuses_int8_with_sglang_at_once(
    make_fleet: Callable[..., Any], tmp_path: Path
) -> None:
    """SGLang has no int8 weight-only mode: refused before any process starts, not served
    on other weights than the trainer's."""
    from lorafleet_cli.fleet import FleetError

    python = tmp_path / "python"
    python.touch()
    fleet = make_fleet(engine="sglang", sglang_python=python, quantization="int8")
    with pytest.raises(FleetError, match="quantization 'int8': SGLang serves fp8"):
        fleet.start()
    assert fleet.members == []
    assert fleet.redis is None
