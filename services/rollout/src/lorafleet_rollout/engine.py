"""RolloutEngine: the one interface the service drives, whatever generates the tokens.

A Protocol rather than a base class: the torch, SGLang and vLLM engines share no code by
inheritance, only this shape. Engines receive validated requests (`lorafleet.validate_msgs`) and
already-verified adapter folders (see `adapters.py`); identity, versions, refcounts and
capacity are the service's job, never the engine's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from lorafleet_rollout.types import EngineInfo, LoraSpec, SampleRequest, SampleResult

#: An adapter arrives either as a PEFT folder (adapter_config.json + adapter_model.safetensors)
#: or, when the trainer shares the host, as PEFT-keyed tensors.
AdapterSource = Path | dict[str, torch.Tensor]


@runtime_checkable
class RolloutEngine(Protocol):
    def info(self) -> EngineInfo:
        """Engine kind, base model and limits (context length, vocab, largest LoRA rank)."""
        ...

    async def start(self) -> None:
        """Load the model or connect to the server; return when requests can be served."""
        ...

    async def close(self) -> None: ...

    async def load_adapter(self, adapter_id: str, source: AdapterSource, lora: LoraSpec) -> None:
        """Make `adapter_id` selectable. Never pauses requests on other adapters."""
        ...

    async def unload_adapter(self, adapter_id: str) -> None: ...

    async def sample(self, request: SampleRequest) -> SampleResult: ...
