"""Run one of llama.cpp's converters (`convert_hf_to_gguf.py`, `convert_lora_to_gguf.py`) on
a lorafleet model folder: `python llama_cpp_convert.py LLAMA_CPP_DIR SCRIPT [ARGS...]`.

Run with the project's python (torch, transformers, safetensors are there), so the llama.cpp
venv needs none of them; LLAMA_CPP_DIR is the converters' folder that
bench/setup_llama_cpp_venv.sh copies from the llama-cpp-python sdist.

Why a wrapper: convert_hf_to_gguf.py names a BPE tokenizer's pre-tokenizer by hashing the ids
its tokenizer gives a fixed test string, and knows only the hashes of tokenizers published on
the Hugging Face hub (convert_hf_to_gguf_update.py downloads them to list them). The bench
model's tokenizer is trained locally (lorafleet_models.tokenizer), so its vocabulary, and the
hash, are its own and the converter refuses it. Its pre-tokenizer is GPT-2's exactly: a
byte-level split with GPT-2's regex and no prefix space, which llama.cpp implements as "gpt-2".
The wrapper names it so when tokenizer.json says just that, and leaves every other tokenizer
to the converter's own detection.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path
from typing import Any

#: tokenizer.json's pre_tokenizer of GPT-2 (and of lorafleet_models.tokenizer).
GPT2_PRE_TOKENIZER = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}


def is_gpt2_pre_tokenizer(model_dir: Path) -> bool:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return False
    pre = json.loads(path.read_text()).get("pre_tokenizer") or {}
    return all(pre.get(key) == value for key, value in GPT2_PRE_TOKENIZER.items())


def main() -> None:
    llama_cpp_dir, script, *args = sys.argv[1:]
    root = Path(llama_cpp_dir)
    sys.path[:0] = [str(root), str(root / "gguf-py")]
    from conversion.base import TextModel  # llama.cpp's converter package, on the path above

    detect = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self: Any, tokenizer: Any) -> str:
        if is_gpt2_pre_tokenizer(Path(self.dir_model)):
            return "gpt-2"
        return detect(self, tokenizer)

    TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [str(root / script), *args]
    runpy.run_path(str(root / script), run_name="__main__")


if __name__ == "__main__":
    main()
