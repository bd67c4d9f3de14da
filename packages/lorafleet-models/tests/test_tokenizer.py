"""The tokenizer trained on the corpus: deterministic, offline-loadable, special tokens, chat."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from lorafleet_models.corpus import read_corpus
from lorafleet_models.tokenizer import IM_END, IM_START, train_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_training_is_deterministic(tmp_path: Path) -> None:
    text = read_corpus()
    a = train_tokenizer(text, 2048)
    b = train_tokenizer(text, 2048)
    a.save_pretrained(tmp_path / "a")
    b.save_pretrained(tmp_path / "b")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (
        tmp_path / "b" / "tokenizer.json"
    ).read_bytes()
    assert len(a) == 2048


@pytest.mark.parametrize(
    "text",
    ["plain ascii", "héllo wörld", "日本語のテキスト", "emoji 🙂🚀 mix", "  spaces\n\ttabs  "],
)
def test_round_trips_unicode(tokenizer, text: str) -> None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_special_tokens(tokenizer) -> None:
    assert tokenizer.bos_token == tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.pad_token == "<|pad|>"
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    for token in (IM_START, IM_END, "<|endoftext|>", "<|pad|>"):
        assert tokenizer(token, add_special_tokens=False)["input_ids"] == [
            tokenizer.convert_tokens_to_ids(token)
        ]
    batch = tokenizer(["a", "a longer line"], padding=True)
    assert batch["input_ids"][0][-1] == tokenizer.pad_token_id
    assert batch["attention_mask"][0][-1] == 0


def test_chat_template_renders(tokenizer) -> None:
    messages = [{"role": "user", "content": "What is my name?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is my name?<|im_end|>\n<|im_start|>assistant\n"
    no_prompt = tokenizer.apply_chat_template(messages, tokenize=False)
    assert no_prompt == "<|im_start|>user\nWhat is my name?<|im_end|>\n"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    assert ids["input_ids"][0] == tokenizer.convert_tokens_to_ids(IM_START)


def test_saved_config_records_special_tokens(tiny_model_dir: Path) -> None:
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert config["model_max_length"] == 512
    assert (tiny_model_dir / "tokenizer.json").is_file()
