"""The SGLang launch rule (lorafleet_rollout.sglang_server), without starting a server: the flags
and environment every real-server test and `lorafleet up --engine sglang` rely on, and the
refusals that must come at once rather than after a start-up timeout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lorafleet_rollout import sglang_server
from lorafleet_rollout.sglang_server import SGLangServer


def _flag(command: list[str], name: str) -> list[str]:
    """The values after `name` up to the next flag."""
    i = command.index(name)
    values = []
    for arg in command[i + 1 :]:
        if arg.startswith("--"):
            break
        values.append(arg)
    return values


def test_cpu_profile_serves_lm_head_unscaled_logprobs_and_sleeps_when_idle(
    model_dir: Path,
) -> None:
    server = SGLangServer(model_dir, 31000, max_lora_rank=16, device="cpu")
    command = server.command()
    assert "lm_head" in _flag(command, "--lora-target-modules")  # the SDK's default adapter
    assert _flag(command, "--max-lora-rank") == ["16"]
    assert _flag(command, "--device") == ["cpu"] and _flag(command, "--dtype") == ["float32"]
    assert "--sleep-on-idle" in command  # else the idle scheduler spins a whole core
    env = server.env({"PYTHONPATH": "/elsewhere"})
    assert env["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert env["PYTHONPATH"].split(":") == [str(sglang_server.CPU_SHIMS), "/elsewhere"]
    assert (sglang_server.CPU_SHIMS / "sgl_kernel" / "__init__.py").exists()


def test_cuda_profile_has_no_cpu_shims(model_dir: Path) -> None:
    server = SGLangServer(model_dir, 31000, device="cuda")
    command, env = server.command(), server.env({})
    assert "--device" not in command and "lm_head" in _flag(command, "--lora-target-modules")
    assert env["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"
    assert "PYTHONPATH" not in env and "SGLANG_USE_CPU_ENGINE" not in env


def test_missing_interpreter_names_the_setup_script(model_dir: Path, tmp_path: Path) -> None:
    server = SGLangServer(model_dir, 31000, python=tmp_path / "absent" / "python")
    with pytest.raises(FileNotFoundError, match=r"setup_sglang_venv\.sh"):
        server.start(tmp_path / "log")
    assert not (tmp_path / "log").exists()  # refused before anything started


def test_moe_models_are_refused_on_the_cpu_backend(model_dir: Path, tmp_path: Path) -> None:
    """SGLang's LoRA MoE layer runs experts through Triton, which kills the CPU scheduler on
    its first batch: refuse at once, naming why."""
    moe = tmp_path / "moe"
    shutil.copytree(model_dir, moe)
    config = json.loads((moe / "config.json").read_text())
    (moe / "config.json").write_text(json.dumps({**config, "num_local_experts": 8}))
    python = tmp_path / "python"
    python.touch()
    with pytest.raises(ValueError, match=r"mixture-of-experts.*Triton"):
        SGLangServer(moe, 31000, python=python, device="cpu").check()
    SGLangServer(moe, 31000, python=python, device="cuda").check()
    SGLangServer(model_dir, 31000, python=python, device="cpu").check()


def test_quantization_maps_to_the_servers_flag(model_dir: Path, tmp_path: Path) -> None:
    """fp8 is SGLang's own online quantization (the trainer's "fp8" weights); it has no int8
    weight-only one, so an int8 fleet is refused at once rather than served other weights."""
    assert "--quantization" not in SGLangServer(model_dir, 31000).command()
    fp8 = SGLangServer(model_dir, 31000, device="cuda", quantization="fp8")
    assert _flag(fp8.command(), "--quantization") == ["fp8"]
    python = tmp_path / "python"
    python.touch()
    with pytest.raises(ValueError, match=r"quantization 'int8': SGLang serves fp8"):
        SGLangServer(model_dir, 31000, python=python, quantization="int8").check()
