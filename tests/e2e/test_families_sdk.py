"""`lorafleet up --model <folder>` on the families beyond the dense Llama shape, through the
real tinker SDK: the tiny Qwen3-MoE (the trainer's per-expert LoRA, served by the torch
engine's MoE path) and the tiny Phi-3 (fused qkv_proj / gate_up_proj). The fleet starts,
trains, saves for the sampler and samples; every sampled logprob and the sampler's
compute_logprobs equal the trainer's forward pass on the same tokens within 1e-4. A model
family the torch engine does not serve is refused by `up` at once, naming why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from lorafleet.testing import child_env

REPO = Path(__file__).resolve().parents[2]
LORAFLEET = [sys.executable, "-m", "lorafleet_cli.main"]
TOL = 1e-4


def _cli(args: list[str], home: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, LORAFLEET_HOME=str(home), HF_HUB_OFFLINE="1")
    return subprocess.run(
        [*LORAFLEET, *args], env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-phi3"])
def test_up_trains_and_samples_with_the_trainers_logprobs(
    preset: str, sdk_python, tmp_path: Path
) -> None:
    from lorafleet_models.tiny import ensure_model

    # The trainer tests' builds (tiny-phi3 briefly pre-trained), cached per machine.
    steps = 20 if preset == "tiny-phi3" else None
    model = ensure_model(preset, REPO / ".cache" / "models", steps=steps)
    python = sdk_python("0.38.0")
    up = _cli(
        [
            "up",
            "--detach",
            "--model",
            str(model),
            "--slots",
            "2",
            "--run-dir",
            str(tmp_path / "run"),
        ],
        tmp_path,
        timeout=600,
    )
    assert up.returncode == 0, up.stderr
    try:
        exports = dict(
            line.removeprefix("export ").split("=", 1) for line in up.stdout.splitlines()
        )
        base_url, api_key = exports["TINKER_BASE_URL"], exports["TINKER_API_KEY"]
        caps = httpx.get(
            f"{base_url}/api/v1/get_server_capabilities", headers={"X-API-Key": api_key}, timeout=30
        ).json()
        env = child_env(
            TINKER_BASE_URL=base_url,
            TINKER_API_KEY=api_key,
            SMOKE_BASE_MODEL=caps["supported_models"][0]["model_name"],
        )
        proc = subprocess.run(
            [str(python), str(Path(__file__).with_name("families_sdk_script.py"))],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        down = _cli(["down"], tmp_path, timeout=120)
    assert down.returncode == 0, down.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("SMOKE OK ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    out = json.loads(lines[-1][len("SMOKE OK ") :])
    assert out["losses"][-1] < out["losses"][0], out["losses"]
    n_prompt = len(out["prompt"])
    for name, sequences in out["samples"].items():
        assert len(sequences) == 2, name
        for seq in sequences:
            n = len(seq["tokens"])
            assert n == len(seq["logprobs"]) > 0, name
            trainer = seq["trainer_logprobs"]  # log p(full[t+1] | full[:t+1])
            assert len(trainer) == n_prompt + n - 1
            assert seq["logprobs"] == pytest.approx(trainer[n_prompt - 1 :], abs=TOL), name
            assert seq["sampler_prompt_logprobs"][0] is None
            assert seq["sampler_prompt_logprobs"][1:] == pytest.approx(trainer, abs=TOL), name
    assert out["samples"]["greedy"][0]["tokens"] == out["samples"]["greedy"][1]["tokens"]


def test_up_refuses_a_family_the_torch_engine_does_not_serve(tmp_path: Path) -> None:
    """A real GPT-2 folder (a causal LM the trainer loads): `up` refuses before starting
    anything, with the families rule's message, and leaves no run behind."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "gpt2"
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0
    )
    GPT2LMHeadModel(config).save_pretrained(folder)
    up = _cli(["up", "--model", str(folder), "--run-dir", str(tmp_path / "run")], tmp_path, 120)
    assert up.returncode == 1
    (line,) = up.stderr.strip().splitlines()
    assert "'gpt2'" in line and "torch engine serves" in line and "qwen3_moe" in line, line
    assert not (tmp_path / "run" / "fleet.json").exists()
