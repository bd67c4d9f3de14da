"""validate_model_dir: describes a causal LM folder, or fails in one line naming the field."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from transformers import T5Config

from lorafleet.errors import InvalidArgument
from lorafleet_models.validate import validate_model_dir


def test_describes_the_tiny_model(tiny_model_dir: Path) -> None:
    info = validate_model_dir(tiny_model_dir)
    assert info.architecture == "LlamaForCausalLM" and info.model_type == "llama"
    assert (info.vocab_size, info.hidden_size, info.num_layers) == (2048, 128, 2)
    assert info.max_context == 512
    assert info.has_tokenizer and info.tokenizer_id == str(tiny_model_dir.resolve())
    assert info.name == tiny_model_dir.name


def copy_of(model_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(model_dir, target)
    return target


def check_error(path: Path, fragment: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        validate_model_dir(path, field="LORAFLEET_TRAINER_BASE_MODEL")
    message = str(e.value)
    assert e.value.field == "LORAFLEET_TRAINER_BASE_MODEL"
    assert fragment in message and "\n" not in message


def test_missing_folder(tmp_path: Path) -> None:
    check_error(tmp_path / "nope", "does not exist")
    (tmp_path / "file").write_text("x")
    check_error(tmp_path / "file", "does not exist")


def test_folder_without_config(tmp_path: Path) -> None:
    check_error(tmp_path, "no config.json")


def test_garbage_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    check_error(tmp_path, "unreadable config.json")


def test_not_a_causal_lm(tmp_path: Path) -> None:
    T5Config(vocab_size=100, d_model=16, num_layers=1, num_heads=2).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    check_error(tmp_path, "not a causal LM")


def test_no_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = copy_of(tiny_model_dir, tmp_path)
    (folder / "model.safetensors").unlink()
    check_error(folder, "has no weights")


def test_tokenizer_larger_than_vocabulary(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = copy_of(tiny_model_dir, tmp_path)
    config = (
        (folder / "config.json").read_text().replace('"vocab_size": 2048', '"vocab_size": 1000')
    )
    (folder / "config.json").write_text(config)
    check_error(folder, "tokenizer has 2048 tokens")


def test_without_tokenizer(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = copy_of(tiny_model_dir, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).unlink()
    info = validate_model_dir(folder)
    assert not info.has_tokenizer and info.tokenizer_id is None
