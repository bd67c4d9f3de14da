"""Built folders: byte-identical from a seed, offline-loadable, with their build record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lorafleet import hub
from lorafleet.errors import InvalidArgument
from lorafleet_models.build import BUILD_RECORD, build_model

SHORT = 20  # pre-training steps for the rebuild test: same code path as the full build


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_rebuild_is_byte_identical(tmp_path: Path) -> None:
    a = build_model("tiny", tmp_path / "a", seed=3, steps=SHORT)
    b = build_model("tiny", tmp_path / "b", seed=3, steps=SHORT)
    assert a == b
    files_a, files_b = folder_bytes(tmp_path / "a"), folder_bytes(tmp_path / "b")
    assert set(files_a) >= {"config.json", "generation_config.json", "model.safetensors"}
    assert files_a == files_b
    other = build_model("tiny", tmp_path / "c", seed=4, steps=SHORT)
    assert other.final_pretrain_loss != a.final_pretrain_loss
    assert (tmp_path / "c" / "model.safetensors").read_bytes() != files_a["model.safetensors"]


@pytest.mark.slow
def test_full_build_matches_cached_folder(tmp_path: Path, tiny_model_dir: Path) -> None:
    build_model("tiny", tmp_path / "full")
    cached = folder_bytes(tiny_model_dir)
    # The cache adds the served name, which names the cache folder (lorafleet.hub).
    assert json.loads(cached.pop(hub.RECORD)) == {"hub_id": f"lorafleet/{tiny_model_dir.name}"}
    assert folder_bytes(tmp_path / "full") == cached


def test_build_record_and_config(tiny_model_dir: Path) -> None:
    record = json.loads((tiny_model_dir / BUILD_RECORD).read_text())
    assert record["preset"] == "tiny" and record["seed"] == 0 and record["steps"] == 400
    assert record["final_pretrain_loss"] < 1.5  # a random model sits near ln(2048) ≈ 7.6
    assert 0.5e6 < record["num_parameters"] < 1.5e6
    assert len(record["corpus_sha256"]) == len(record["code_sha256"]) == 64
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == 2048 and config["max_position_embeddings"] == 512
    generation = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [3, 0]  # <|im_end|> ends a chat turn, then end-of-text


def test_bad_arguments_change_nothing(tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep")
    with pytest.raises(InvalidArgument) as e:
        build_model("tiny", tmp_path / "full", steps=1)
    assert e.value.field == "dir"
    assert os.listdir(tmp_path / "full") == ["x"]
    with pytest.raises(InvalidArgument) as e:
        build_model("huge", tmp_path / "new")
    assert e.value.field == "preset"
    with pytest.raises(InvalidArgument) as e:
        build_model("tiny", tmp_path / "new", steps=-1)
    assert e.value.field == "steps"
    assert not (tmp_path / "new").exists()


OFFLINE_LOAD = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
chat = [{"role": "user", "content": "Hello!"}]
ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt",
                              return_dict=True)
out = model.generate(**ids, max_new_tokens=12, do_sample=False)
print(json.dumps({"answer": tok.decode(out[0, ids["input_ids"].shape[1]:]),
                  "dtype": str(model.dtype), "class": type(model).__name__}))
"""


def test_loads_offline_in_a_fresh_process(tiny_model_dir: Path) -> None:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": "/nonexistent",
    }
    proc = subprocess.run(
        [sys.executable, "-c", OFFLINE_LOAD, str(tiny_model_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["class"] == "LlamaForCausalLM" and result["dtype"] == "torch.float32"
    # The pre-trained model knows the chat format: it greets back and ends its turn.
    assert result["answer"].startswith("Hello")
    assert result["answer"].endswith("<|im_end|>")


@pytest.mark.parametrize(
    ("preset", "architecture"),
    [("tiny-moe", "Qwen3MoeForCausalLM"), ("tiny-phi3", "Phi3ForCausalLM")],
)
def test_other_architectures_build_and_load(tmp_path: Path, preset, architecture) -> None:
    """The MoE and fused-projection presets: same pipeline, their own transformers class."""
    from transformers import AutoModelForCausalLM

    record = build_model(preset, tmp_path / preset, seed=1, steps=3)
    config = json.loads((tmp_path / preset / "config.json").read_text())
    assert config["architectures"] == [architecture]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / preset)
    assert sum(p.numel() for p in model.parameters()) == record.num_parameters
    if preset == "tiny-moe":
        assert config["num_local_experts"] == 8 and config["num_experts_per_tok"] == 2
        assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (8, 192, 128)
    else:
        assert model.model.layers[0].self_attn.qkv_proj.out_features == 128 + 2 * 64
