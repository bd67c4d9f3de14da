"""MoE expert LoRA through the real tinker SDK: a fleet on the tiny Qwen3-MoE trains with
the default flags (the expert banks adapted, per expert), and the logprobs the SDK gets
after two steps equal PEFT (target_parameters) on the adapter the fleet saved."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
from pathlib import Path

import httpx
import pytest
import torch

from lorafleet.testing import child_env

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def moe_fleet(moe_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from lorafleet_cli.fleet import Fleet, FleetConfig

    run_dir = tmp_path_factory.mktemp("moe-fleet")
    with Fleet(FleetConfig(model_path=moe_model_dir, run_dir=run_dir, rollouts=0, slots=2)) as f:
        yield f


def test_per_expert_lora_through_the_sdk_equals_peft(
    moe_fleet, moe_model_dir: Path, sdk_python, tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    headers = {"X-API-Key": moe_fleet.api_key}
    caps = httpx.get(
        f"{moe_fleet.base_url}/api/v1/get_server_capabilities", headers=headers, timeout=30
    ).json()
    env = child_env(
        TINKER_BASE_URL=moe_fleet.base_url,
        TINKER_API_KEY=moe_fleet.api_key,
        SMOKE_BASE_MODEL=caps["supported_models"][0]["model_name"],
    )
    proc = subprocess.run(
        [str(sdk_python("0.38.0")), str(HERE / "moe_sdk_script.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("SMOKE OK ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    out = json.loads(lines[-1][len("SMOKE OK ") :])
    assert out["losses"][1] < out["losses"][0], out["losses"]

    run = f"{moe_fleet.base_url}/api/v1/training_runs/{out['model_id']}"
    reply = httpx.get(f"{run}/checkpoints/weights/s1/archive", headers=headers, timeout=60)
    assert reply.status_code == 200, reply.text
    archive = httpx.get(reply.json()["url"], timeout=60)
    with tarfile.open(fileobj=io.BytesIO(archive.content)) as tar:
        tar.extractall(tmp_path, filter="data")
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["experts.down_proj", "experts.gate_up_proj"], config

    ids = out["ids"]
    base = AutoModelForCausalLM.from_pretrained(moe_model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, tmp_path).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]])).logits[0].float()
    want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    got = torch.tensor(out["logprobs"])
    assert (got - want).abs().max() <= 1e-5
