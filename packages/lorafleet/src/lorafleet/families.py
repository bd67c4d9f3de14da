"""Which base models the rollout's torch engine serves: one rule, read from config.json.

The trainer adapts any transformers causal LM whose matrices are Linears or standard fused
expert banks; the torch engine (`lorafleet_rollout.decoder`) implements its forward pass per
architecture. Whatever it does not implement must be refused before a fleet starts, not
discovered when the first sample fails or the rollout exits mid-start. Both the rollout (at
model load) and `lorafleet up` (before starting any process) ask `torch_engine_refusal`, so
the two can never disagree. Torch-free, so the CLI checks a folder without importing torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lorafleet.errors import InvalidArgument

#: config.json `model_type`s the torch engine's decoder implements.
TORCH_ENGINE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "phi3")
#: Rotary variants computed by the model's own rotary module from position alone (dynamic
#: and long-rope variants change with the sequence length, which the decoder does not follow).
_ROPE_TYPES = ("default", "linear", "llama3")


def torch_engine_refusal(config: Mapping[str, Any]) -> str | None:
    """Why the torch engine cannot serve a model with this config.json, or None if it can."""
    model_type = config.get("model_type")
    if model_type not in TORCH_ENGINE_FAMILIES:
        return (
            f"the torch engine serves {', '.join(TORCH_ENGINE_FAMILIES)} models, not "
            f"{model_type!r}; serve this model with an SGLang or vLLM rollout engine"
        )
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if rope else "default"
    if not str(rope_type).startswith(_ROPE_TYPES):
        return f"rope type {rope_type!r} is not supported by the torch engine"
    act = config.get("hidden_act", "silu")
    if act != "silu":
        return f"hidden_act {act!r} is not supported by the torch engine (only silu)"
    return None


def check_torch_servable(model_path: Path) -> None:
    """Raise InvalidArgument (field model_path) unless the torch engine serves this folder."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise InvalidArgument(
            f"{model_path}: no readable config.json ({exc})", field="model_path"
        ) from None
    why = torch_engine_refusal(config)
    if why is not None:
        raise InvalidArgument(f"{model_path}: {why}", field="model_path")
