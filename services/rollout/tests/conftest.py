"""Rollout test fixtures: a small real causal LM with a tokenizer, and real PEFT adapters.

Uses the shared tiny model (`lorafleet_models.tiny`) when it is available, otherwise builds a
random 64/2/128 Llama with a byte-level BPE tokenizer trained on the repo's corpus; either way
the model is real transformers code and the adapters are real PEFT folders.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout_helpers import build_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        from lorafleet_models.tiny import ensure_model
    except ImportError:
        return build_model(tmp_path_factory.mktemp("model"))
    return ensure_model("tiny", Path(__file__).resolve().parents[3] / ".cache" / "models")
