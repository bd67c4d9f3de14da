"""The SDK flow through `lorafleet up --engine sglang`: the real SGLang server (its CPU backend
here, `.venvs/sglang` from services/rollout/tests/setup_sglang_venv.sh) beside the rollout.

The tinker SDK trains an adapter (lm_head included: `train_unembed` defaults to true), saves
it for the sampler and samples through SGLang; every sampled logprob and the sampler's
compute_logprobs must equal the trainer's forward pass on the same tokens (≤ 1e-4, float32),
at temperature 1, at 0.7 (SGLang reports the model's own logprobs, not the tempered ones) and
greedy. Without the SGLang venv the fleet refuses to start and the test fails.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

#: The fleet's start deadline with a real SGLang server (seconds), and each item's
#: pytest-timeout above it: the first item's timeout also covers the module's fleet start,
#: which on a loaded machine can take minutes (issue 40).
START_SECONDS = 900
pytestmark = [pytest.mark.slow, pytest.mark.timeout(START_SECONDS + 600)]
TOL = 1e-4


@pytest.fixture(scope="module")
def fleet(make_fleet: Callable[..., AbstractContextManager[object]]) -> Iterator[object]:
    with make_fleet(engine="sglang", slots=4, start_timeout=START_SECONDS) as running:
        yield running


def test_sdk_samples_through_sglang_with_the_trainers_logprobs(
    fleet: Any,
    target: Any,
    run_sdk: Callable[..., dict],
    sampler_matches_trainer: Callable[[dict, float], float],
) -> None:
    out = run_sdk("0.38.0", "sglang_script.py", target)
    served = fleet.member("sglang-0").log.read_text()  # the samples really came from SGLang
    assert '"POST /load_lora_adapter HTTP/1.1" 200' in served
    assert '"POST /generate HTTP/1.1" 200' in served
    assert out["losses"][-1] < out["losses"][0], out["losses"]
    sampler_matches_trainer(out, TOL)
    assert out["samples"]["greedy"][0]["tokens"] == out["samples"]["greedy"][1]["tokens"]


def test_up_refuses_at_once_without_an_sglang_interpreter(
    make_fleet: Callable[..., Any], tmp_path: Path
) -> None:
    from lorafleet_cli.fleet import FleetError

    fleet = make_fleet(engine="sglang", sglang_python=tmp_path / "absent" / "python")
    with pytest.raises(FleetError, match=r"no SGLang interpreter at .*setup_sglang_venv\.sh"):
        fleet.start()
    assert fleet.members == []  # nothing but the private Redis started, and it was stopped
    assert fleet.redis is None
