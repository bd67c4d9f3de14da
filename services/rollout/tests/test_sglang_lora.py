"""Adapters published to SGLang: expert LoRA converted to SGLang's per-expert layout, and what
SGLang cannot serve refused before it reaches the server.

The reference is PEFT: the adapter is PEFT's own `target_parameters` export (what our trainer
writes), and the per-expert weights SGLang's loader builds from the converted folder (its key
mapping and normalisation, ported in `fake_sglang.py`) must give PEFT's merged expert weights.
The strict fake runs the tiny Qwen3-MoE with serve=False: the torch engine does not generate
with it, but the fake checks loads as SGLang does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest
import torch
from fake_sglang import (
    DEFAULT_TARGETS,
    FakeSGLang,
    get_normalized_target_modules,
    process_weights,
)
from peft import LoraConfig, PeftModel, get_peft_model
from rollout_helpers import load_base
from safetensors.torch import load_file
from transformers import AutoConfig

from lorafleet.errors import InvalidArgument
from lorafleet_rollout import sglang_api, sglang_server
from lorafleet_rollout.sglang_lora import ModelShape, ServerLora, publish

BANKS = ["experts.gate_up_proj", "experts.down_proj"]


@pytest.fixture(scope="module")
def moe_dir() -> Path:
    from lorafleet_models.tiny import ensure_model

    return ensure_model("tiny-moe", Path(__file__).resolve().parents[3] / ".cache" / "models")


def peft_adapter(
    model_dir: Path,
    out: Path,
    *,
    banks: list[str],
    modules: tuple[str, ...] = ("q_proj", "v_proj"),
    rank: int = 4,
) -> Path:
    """PEFT's export of a seeded random LoRA on `modules` and the given expert banks."""
    torch.manual_seed(11)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=list(modules),
        target_parameters=banks,
        init_lora_weights=False,
    )
    get_peft_model(load_base(model_dir), config).save_pretrained(out)
    return out


def shape_of(model_dir: Path) -> ModelShape:
    return ModelShape.from_config(AutoConfig.from_pretrained(model_dir))


def assert_peft_equal(weights: dict[str, torch.Tensor], moe_dir: Path, source: Path) -> None:
    """SGLang's normalised per-expert weights give PEFT's merged expert weights, and the q_proj
    LoRA's zero partners change nothing."""
    hf = AutoConfig.from_pretrained(moe_dir)
    config = json.loads((source / "adapter_config.json").read_text())
    scale, rank, inter = config["lora_alpha"] / config["r"], config["r"], hf.moe_intermediate_size
    base = load_base(moe_dir)
    merged = PeftModel.from_pretrained(load_base(moe_dir), source).merge_and_unload()
    for i in range(hf.num_hidden_layers):
        prefix = f"base_model.model.model.layers.{i}.mlp.experts"
        experts, ref = merged.model.layers[i].mlp.experts, base.model.layers[i].mlp.experts
        want_gate_up = experts.gate_up_proj - ref.gate_up_proj
        want_down = experts.down_proj - ref.down_proj
        for e in range(hf.num_experts):
            a = weights[f"{prefix}.{e}.gate_up_proj.lora_A.weight"]  # gate and up A, stacked
            b = weights[f"{prefix}.{e}.gate_up_proj.lora_B.weight"]
            gate_up = torch.cat((b[:inter] @ a[:rank], b[inter:] @ a[rank:])) * scale
            assert (gate_up - want_gate_up[e]).abs().max() <= 1e-6
            a = weights[f"{prefix}.{e}.down_proj.lora_A.weight"]
            b = weights[f"{prefix}.{e}.down_proj.lora_B.weight"]
            assert (b @ a * scale - want_down[e]).abs().max() <= 1e-6
        qkv_b = weights[f"base_model.model.model.layers.{i}.self_attn.qkv_proj.lora_B.weight"]
        q_rows = merged.model.layers[i].self_attn.q_proj.weight.shape[0]
        assert qkv_b[q_rows:].abs().max() == 0  # the k and v parts: no change


def converted(moe_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(PEFT export, its SGLang layout); q_proj alone, so a zero v_proj must join it."""
    source = peft_adapter(moe_dir, tmp_path / "peft", banks=BANKS, modules=("q_proj",))
    dest = tmp_path / "sglang"
    publish(source, dest, ServerLora.from_flags(list(DEFAULT_TARGETS), 64), shape_of(moe_dir))
    return source, dest


def test_converted_expert_lora_equals_peft(moe_dir: Path, tmp_path: Path) -> None:
    """Through the fake's port of SGLang's loader."""
    source, dest = converted(moe_dir, tmp_path)
    config = json.loads((dest / "adapter_config.json").read_text())
    assert "target_parameters" not in config
    assert set(config["target_modules"]) == {"q_proj", "gate_up_proj", "down_proj"}
    layers, _ = process_weights(
        load_file(str(dest / "adapter_model.safetensors")),
        get_normalized_target_modules(config["target_modules"]),
        AutoConfig.from_pretrained(moe_dir).num_hidden_layers,
    )
    assert_peft_equal({n: w for layer in layers for n, w in layer.items()}, moe_dir, source)


def sglang_loads(folder: Path, model_dir: Path, out: Path) -> dict:
    """SGLang 0.5.23's own loading code on `folder` (sglang_loader_check.py in .venvs/sglang)."""
    python = sglang_server.DEFAULT_PYTHON
    assert python.exists(), f"no {python}: run services/rollout/tests/setup_sglang_venv.sh"
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": str(sglang_server.CPU_SHIMS)}
    done = subprocess.run(
        [
            str(python),
            str(Path(__file__).with_name("sglang_loader_check.py")),
            str(folder),
            str(model_dir),
            str(out),
            ",".join(DEFAULT_TARGETS),
            "64",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_sglang_own_loader_takes_the_conversion(moe_dir: Path, tmp_path: Path) -> None:
    """SGLang's code maps every converted weight to a module (the per-expert ones to its MoE
    buffers) and its normalised weights equal PEFT; PEFT's own layout would not load."""
    source, dest = converted(moe_dir, tmp_path)
    report = sglang_loads(dest, moe_dir, tmp_path / "loaded.safetensors")
    assert report["supported"] and "load_error" not in report and report["unmapped"] == []
    assert set(report["buffers"].values()) == {"qkv_proj", "gate_up_proj_moe", "down_proj_moe"}
    assert_peft_equal(load_file(str(tmp_path / "loaded.safetensors")), moe_dir, source)
    raw = peft_adapter(moe_dir, tmp_path / "raw", banks=BANKS)
    report = sglang_loads(raw, moe_dir, tmp_path / "raw.safetensors")
    assert any(".mlp.experts.base_layer.lora_A" in n for n in report["unmapped"])


async def test_strict_fake_loads_converted_and_refuses_peft_layout(
    moe_dir: Path, tmp_path: Path
) -> None:
    source = peft_adapter(moe_dir, tmp_path / "peft", banks=BANKS)
    dest = tmp_path / "sglang"
    publish(source, dest, ServerLora.from_flags(list(DEFAULT_TARGETS), 64), shape_of(moe_dir))
    with FakeSGLang(moe_dir, serve=False) as fake:
        async with httpx.AsyncClient(base_url=fake.url, timeout=60) as http:
            raw = await http.post(
                "/load_lora_adapter", json={"lora_name": "raw", "lora_path": str(source)}
            )
            body = sglang_api.LoraUpdateResult.model_validate_json(raw.content)
            assert raw.status_code == 400 and not body.success
            assert "did not match any target module" in (body.error_message or "")
            assert "mlp.experts.base_layer.lora_A.weight" in (body.error_message or "")
            q_only = peft_adapter(moe_dir, tmp_path / "q", banks=[], modules=("q_proj",))
            no_v = await http.post(
                "/load_lora_adapter", json={"lora_name": "q", "lora_path": str(q_only)}
            )
            assert no_v.status_code == 400 and "v_proj.lora_A.weight" in no_v.text  # KeyError
            ok = await http.post(
                "/load_lora_adapter", json={"lora_name": "ok", "lora_path": str(dest)}
            )
            assert ok.status_code == 200, ok.text
            assert (await http.get("/health")).status_code == 200
    # Without down_proj among its targets the server would not wrap the MoE layers: refused.
    gate_only = ServerLora.from_flags(["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"], 64)
    with pytest.raises(InvalidArgument, match="down_proj"):
        publish(source, tmp_path / "refused", gate_only, shape_of(moe_dir))
    assert not (tmp_path / "refused").exists()


def test_one_bank_converts_and_odd_layouts_are_refused(moe_dir: Path, tmp_path: Path) -> None:
    server = ServerLora.from_flags(list(DEFAULT_TARGETS), 64)
    source = peft_adapter(moe_dir, tmp_path / "down", banks=["experts.down_proj"])
    publish(source, tmp_path / "ok", server, shape_of(moe_dir))
    keys = load_file(str(tmp_path / "ok" / "adapter_model.safetensors"))
    assert {k.split(".experts.")[1].split(".", 1)[1] for k in keys if ".experts." in k} == {
        "down_proj.lora_A.weight",
        "down_proj.lora_B.weight",
    }
    # The same export against a model with other expert shapes is not guessed at.
    with pytest.raises(InvalidArgument, match="expert banks"):
        other = dataclasses.replace(shape_of(moe_dir), moe_intermediate=64)
        publish(source, tmp_path / "no", server, other)
    with pytest.raises(InvalidArgument, match="max-lora-rank 2"):
        publish(source, tmp_path / "no", ServerLora.from_flags(None, 2), shape_of(moe_dir))
    config = json.loads((source / "adapter_config.json").read_text())
    (source / "adapter_config.json").write_text(
        json.dumps({**config, "target_parameters": ["experts.w1"]})
    )
    with pytest.raises(InvalidArgument, match=r"experts\.w1"):
        publish(source, tmp_path / "no", server, shape_of(moe_dir))
    assert not (tmp_path / "no").exists()


@pytest.mark.slow
def test_sglang_own_loader_takes_fused_phi3_projections(tmp_path: Path) -> None:
    """Phi-3's fused qkv_proj / gate_up_proj LoRA (one A for all parts, as our trainer adapts
    them) pass unchanged: SGLang gives every stacked part that same A, so it applies B A."""
    from lorafleet_models.tiny import ensure_model

    phi3 = ensure_model("tiny-phi3", Path(__file__).resolve().parents[3] / ".cache" / "models")
    source = peft_adapter(phi3, tmp_path / "peft", banks=[], modules=("qkv_proj", "gate_up_proj"))
    dest = tmp_path / "sglang"
    publish(source, dest, ServerLora.from_flags(list(DEFAULT_TARGETS), 64), shape_of(phi3))
    exported = load_file(str(source / "adapter_model.safetensors"))
    assert load_file(str(dest / "adapter_model.safetensors")).keys() == exported.keys()
    report = sglang_loads(dest, phi3, tmp_path / "loaded.safetensors")
    assert report["supported"] and "load_error" not in report and report["unmapped"] == []
    assert set(report["buffers"].values()) == {"qkv_proj", "gate_up_proj"}
    loaded = load_file(str(tmp_path / "loaded.safetensors"))
    for key, parts in (("qkv_proj", 3), ("gate_up_proj", 2)):
        name = f"base_model.model.model.layers.0.mlp.{key}.lora_A.weight"
        if key == "qkv_proj":
            name = name.replace(".mlp.", ".self_attn.")
        assert torch.equal(loaded[name], exported[name].repeat(parts, 1))
        b = name.replace("lora_A", "lora_B")
        assert torch.equal(loaded[b], exported[b])
