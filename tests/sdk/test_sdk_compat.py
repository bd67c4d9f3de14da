"""The official tinker SDK (0.24.1 and 0.38.0) and tinker-cookbook 0.6.1 against a real fleet.

Everything here is real: the fleet (Redis, controller, trainer, rollout, gateway) runs as
processes on loopback, the SDK runs in its own venv as a user would, and numbers are checked
against an in-process transformers + PEFT computation on the downloaded adapter.
Run: .venv/bin/pytest tests/sdk -m slow -x -q   (build the venvs first: tests/sdk/setup_venvs.sh)
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
Target = Any  # tests/sdk/conftest.py:Target
RunSdk = Callable[..., dict]
TEXT = "The capital of France is Paris."


def test_reference_flow_0380_and_logprobs_match_peft(
    target: Target,
    tmp_path: Path,
    run_sdk: RunSdk,
    download_adapter: Callable[..., set[str]],
    peft_logprobs: Callable[..., list[float]],
) -> None:
    out = run_sdk("0.38.0", "compat_script.py", target)
    assert out["model_id"].endswith(":train:0") and out["model_id2"].endswith(":train:1")
    # Resuming from save_state reproduces the saved weights exactly.
    assert out["resumed_logprobs"] == pytest.approx(out["at_save_logprobs"], abs=1e-5)
    names = download_adapter(target, out["model_id"], "weights/s1", tmp_path)
    assert {"adapter_config.json", "adapter_model.safetensors", "checkpoint_complete"} <= names
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(target.model_dir).encode(TEXT)
    reference = peft_logprobs(target.model_dir, tmp_path, ids)
    assert out["at_save_logprobs"] == pytest.approx(reference, abs=1e-5)


def test_reference_flow_0241_with_proto_flags(target: Target, run_sdk: RunSdk) -> None:
    out = run_sdk("0.24.1", "compat_script.py", target)
    assert out["resumed_logprobs"] == pytest.approx(out["at_save_logprobs"], abs=1e-5)


def test_reference_flow_0241_with_default_json_config(json_target: Target, run_sdk: RunSdk) -> None:
    config = httpx.post(f"{json_target.base_url}/api/v1/client/config", json={}, timeout=10)
    assert "proto_write_fwdbwd" not in config.json()
    out = run_sdk("0.24.1", "compat_script.py", json_target)
    assert out["resumed_logprobs"] == pytest.approx(out["at_save_logprobs"], abs=1e-5)


def test_sdk_teaches_a_name_and_greedy_sampling_recalls_it(target: Target, run_sdk: RunSdk) -> None:
    out = run_sdk("0.38.0", "name_script.py", target)
    assert out["losses"][-1] < 0.5, out["losses"]
    assert "Dima" in out["answer"], out


def _cookbook(python: Path, target: Target, module: str, args: list[str], log_dir: Path) -> None:
    if not (python.parent.parent / ".cookbook").exists():
        pytest.skip("tinker-cookbook not installed: run tests/sdk/setup_venvs.sh")
    common = [
        f"model_name={target.base_model}",  # the served (hub) name, unchanged
        "renderer_name=role_colon",
        f"base_url={target.base_url}",
        f"log_path={log_dir}",
        "behavior_if_log_dir_exists=delete",
        "eval_every=0",
        "save_every=0",
    ]
    proc = subprocess.run(
        [str(python), "-m", module, *common, *args],
        env=target.env(TINKER_TELEMETRY="0"),
        capture_output=True,
        text=True,
        timeout=900,
        cwd=HERE,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]


def test_cookbook_chat_sl_recipe(
    target: Target, tmp_path: Path, sdk_python: Callable[[str], Path]
) -> None:
    python = sdk_python("0.38.0")
    data = subprocess.run(
        [
            str(python),
            "-c",
            "import tinker_cookbook, pathlib; print(pathlib.Path("
            "tinker_cookbook.__file__).parent / 'example_data' / 'conversations.jsonl')",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    args = [f"dataset={data}", "batch_size=8", "max_steps=2", "max_length=256"]
    _cookbook(python, target, "tinker_cookbook.recipes.chat_sl.train", args, tmp_path / "sl")


def test_cookbook_math_rl_arithmetic_recipe(
    target: Target, tmp_path: Path, sdk_python: Callable[[str], Path]
) -> None:
    args = [
        "env=arithmetic",
        "loss_fn=importance_sampling",
        "group_size=4",
        "groups_per_batch=4",
        "max_tokens=5",
        "max_steps=2",
    ]
    python = sdk_python("0.38.0")
    _cookbook(python, target, "tinker_cookbook.recipes.math_rl.train", args, tmp_path / "rl")
