"""PEFT folder checks (peft_import.py): everything the folder tells is refused before any
change, naming the file or field. The whole import runs in tests/sdk/test_import_usage.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from safetensors.torch import save

from lorafleet import errors
from lorafleet_controller.peft_import import check_targets, choose_base, parse_adapter
from lorafleet_controller.registry import Replica

CFG = "files.adapter_config.json."
PREFIX = "base_model.model.model.layers.0.self_attn"


def _files(rank: int = 4, **config: Any) -> dict[str, bytes]:
    cfg = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 8,
        "target_modules": ["v_proj", "q_proj"],
        "base_model_name_or_path": "/models/tiny-x",
        "bias": "none",
        "use_dora": False,
        "use_rslora": False,
        **config,
    }
    tensors = {}
    for m in ("q_proj", "v_proj"):
        tensors[f"{PREFIX}.{m}.lora_A.weight"] = torch.zeros(rank, 16)
        tensors[f"{PREFIX}.{m}.lora_B.weight"] = torch.zeros(16, rank)
    return {
        "adapter_config.json": json.dumps(cfg).encode(),
        "adapter_model.safetensors": save(tensors),
        "README.md": b"ignored",
    }


def test_a_plain_lora_folder_becomes_a_lora_config() -> None:
    adapter = parse_adapter(_files(lora_dropout=0.1))
    assert adapter.base_model == "/models/tiny-x"
    lora = adapter.lora
    assert (lora.rank, lora.alpha, list(lora.target_modules)) == (4, 8.0, ["q_proj", "v_proj"])
    assert abs(lora.dropout - 0.1) < 1e-6


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"use_dora": True}, CFG + "use_dora"),
        ({"use_rslora": True}, CFG + "use_rslora"),
        ({"peft_type": "IA3"}, CFG + "peft_type"),
        ({"bias": "all"}, CFG + "bias"),
        ({"rank_pattern": {"q_proj": 8}}, CFG + "rank_pattern"),
        ({"modules_to_save": ["lm_head"]}, CFG + "modules_to_save"),
        ({"target_modules": ".*proj"}, CFG + "target_modules"),
        ({"target_modules": []}, CFG + "target_modules"),
        ({"lora_alpha": 0}, CFG + "lora_alpha"),
        ({"r": 8}, "files.adapter_model.safetensors"),  # the tensors are rank 4
    ],
)
def test_unsupported_configs_are_refused_naming_the_field(changes: dict, field: str) -> None:
    with pytest.raises(errors.InvalidArgument) as info:
        parse_adapter(_files(**changes))
    assert info.value.field == field


@pytest.mark.parametrize("missing", ["adapter_config.json", "adapter_model.safetensors"])
def test_missing_files_are_named(missing: str) -> None:
    files = _files()
    del files[missing]
    with pytest.raises(errors.InvalidArgument) as info:
        parse_adapter(files)
    assert info.value.field == f"files.{missing}"


def _trainer(base: str, hub: str) -> Replica:
    return Replica("trainer", "tr", "127.0.0.1:1", base, 4, "inc", 0, True, tokenizer_id=hub)


def test_base_model_and_targets_are_checked_against_the_fleet() -> None:
    trainers = [_trainer("lorafleet/tiny-x", "lorafleet/tiny-x")]
    adapter = parse_adapter(_files())
    assert choose_base(adapter, "", trainers) == "lorafleet/tiny-x"  # a local folder of it
    other = parse_adapter(_files(base_model_name_or_path="org/other"))
    with pytest.raises(errors.InvalidArgument) as info:
        choose_base(other, "", trainers)
    assert info.value.field == CFG + "base_model_name_or_path"
    with pytest.raises(errors.InvalidArgument) as info:
        choose_base(other, "lorafleet/tiny-x", trainers)
    assert info.value.field == CFG + "base_model_name_or_path"
    with pytest.raises(errors.InvalidArgument) as info:
        choose_base(adapter, "nope", trainers)
    assert info.value.field == "base_model"
    modules = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"]
    check_targets(adapter.lora, modules)
    bad = parse_adapter(_files(target_modules=["q_proj", "zz_proj"])).lora
    with pytest.raises(errors.InvalidArgument) as info:
        check_targets(bad, modules)
    assert info.value.field == CFG + "target_modules"
    assert "zz_proj" in info.value.message and "q_proj, v_proj" in info.value.message
