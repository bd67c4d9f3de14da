"""Engine-neutral request and result types of the rollout service.

The servicer converts protos into these and back; every engine (torch, SGLang, vLLM) speaks
only these, so engines never see protobufs and the validation rules live in one place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

StopReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingSpec:
    """Tinker's SamplingParams. `max_tokens` 0 means: up to the context length."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    disable_eos_stop: bool = False
    seed: int | None = None


@dataclass(frozen=True)
class SampleRequest:
    """One sampling call on one engine adapter id (None = the base model)."""

    adapter_id: str | None
    prompt_tokens: tuple[int, ...]
    params: SamplingSpec = field(default_factory=SamplingSpec)
    num_samples: int = 1
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0


@dataclass(frozen=True)
class SampledSequence:
    """Generated tokens with the plain log-softmax logprob of each (len equal to tokens)."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    stop_reason: StopReason


@dataclass(frozen=True)
class SampleResult:
    sequences: tuple[SampledSequence, ...]
    #: One per prompt token, the first NaN; empty unless requested.
    prompt_logprobs: tuple[float, ...] = ()
    #: One per prompt token, the first empty; each a tuple of (token_id, logprob), best first.
    topk_prompt_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    #: Prompt tokens served from the engine's prefix cache, not computed (the torch engine's
    #: count; 0 where an engine does not say). What a FLOP count of the work done needs.
    cached_prompt_tokens: int = 0


@dataclass(frozen=True)
class LoraSpec:
    """What the engine needs to know about an adapter before loading it."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...] = ()


@dataclass(frozen=True)
class EngineInfo:
    engine: str
    base_model: str
    max_context_length: int
    vocab_size: int
    max_lora_rank: int
    #: Adapters the engine can hold at once by its own configuration (SGLang's
    #: --max-loaded-loras); 0 when only the service's setting bounds it.
    max_loaded_adapters: int = 0
    #: How the engine groups loaded adapters by rank in memory (the torch engine's
    #: `lora.rank_class`), so the cache evicts within a group where it can; None: one group.
    rank_class: Callable[[int], int] | None = None
