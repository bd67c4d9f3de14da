"""RolloutSettings: everything the rollout process reads from `LORAFLEET_ROLLOUT_*`.

Parsed before torch is imported, so a typo fails in milliseconds with one line naming the
variable rather than after a model load.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lorafleet import hub, quantize
from lorafleet.settings import setting
from lorafleet.staging import MAX_ADAPTER_BYTES

PREFIX = "LORAFLEET_ROLLOUT_"


@dataclass(frozen=True)
class RolloutSettings:
    model_path: Path = setting(
        doc="Base model: a local HF folder (torch engine loads it; SGLang/vLLM were started "
        "with it and it names the tokenizer)."
    )
    base_model_name: str = setting(
        "",
        doc="Hub id ('org/name') this replica serves the base model under; must equal the "
        "trainers'. Default: the id the model folder records, else local/<folder name>.",
    )
    engine: str = setting("torch", doc="Inference engine.", choices=("torch", "sglang", "vllm"))
    engine_url: str = setting(
        "", doc="Base URL of the SGLang/vLLM server (for example http://127.0.0.1:30000)."
    )
    engine_launch: bool = setting(
        False, doc="sglang only: start the SGLang server as a child process at engine_url."
    )
    served_model_name: str = setting(
        "base", doc="vllm only: the --served-model-name of the base model."
    )
    max_loaded_adapters: int = setting(
        16,
        doc="Adapter versions loaded in the engine at once (all registrations; SGLang's "
        "--max-loaded-loras binds if smaller). More are served: the least recently used idle "
        "one is evicted to load another.",
        min=1,
        max=4096,
    )
    max_stored_adapters: int = setting(
        1024,
        doc="Adapter versions this replica keeps on disk, loaded or not; past it idle ones "
        "leave (least recently used first) and the controller pushes them again when sampled.",
        min=1,
        max=1_000_000,
    )
    max_queued_requests: int = setting(
        256,
        doc="Sample requests in progress or waiting; beyond it RESOURCE_EXHAUSTED.",
        min=1,
        max=1_000_000,
    )
    max_batch_size: int = setting(
        32, doc="torch only: sequences decoded together in one step.", min=1, max=4096
    )
    prefix_cache_bytes: int = setting(
        256 << 20,
        doc="torch only: bytes of prompt-prefix keys/values kept for reuse across requests "
        "(LRU); 0 = no prefix cache.",
        min=0,
        max=1 << 40,
    )
    warm_memory_bytes: int = setting(
        0,
        doc="torch only: bytes of heap faulted in at start-up and kept for the first batches' "
        "keys/values and activations (as vLLM allocates its KV cache space at start-up); "
        "0 = none.",
        min=0,
        max=1 << 40,
    )
    favour_decoding: bool = setting(
        True,
        doc="torch only: run every thread but the decoding one at niceness 10, so staging and "
        "installing published adapters, and RPC handling, use only the CPU decoding leaves.",
    )
    publish_cpu_share: float = setting(
        0.02,
        doc="torch only: CPU share (of one core) that taking in published adapters may use "
        "while the engine decodes; a publisher pushing faster is paced to it (see pacing.py). "
        "0 = unpaced.",
        min=0.0,
        max=1.0,
    )
    prefill_chunk_tokens: int = setting(
        512,
        doc="torch only: prompt tokens prefilled between two decode steps, so a long prompt "
        "never stalls the running batch for long.",
        min=16,
        max=1 << 20,
    )
    max_num_samples: int = setting(16, doc="Largest num_samples of one request.", min=1, max=1024)
    max_lora_rank: int = setting(64, doc="Largest LoRA rank accepted.", min=1, max=4096)
    max_adapter_bytes: int = setting(
        MAX_ADAPTER_BYTES, doc="Largest adapter upload (all files).", min=1024, max=1 << 40
    )
    adapter_dir: Path = setting(
        Path(".cache/rollout-adapters"),
        doc="Where pushed adapters are kept while resident; SGLang/vLLM must read this path.",
    )
    shared_adapter_root: Path | None = setting(
        None,
        doc="Absolute folder the trainer writes published adapters to, mounted here at the same "
        "path: this replica reads and verifies them itself (no bytes through the controller). "
        "Unset = adapters arrive as streamed chunks only.",
    )
    quantization: str = setting(
        quantize.NONE,
        doc="How the frozen base is stored (lorafleet.quantize): none = as loaded; int8 = "
        "weight-only, one scale per output row; fp8 = e4m3, one scale per matrix. Every "
        "trainer and rollout of a base model must run the same one (chart model.quantization; "
        "the controller refuses a replica that differs). The torch "
        "engine serves the dequantized weights; SGLang and vLLM take fp8 (--quantization fp8).",
        choices=quantize.QUANTIZATIONS,
    )
    replica_id: str = setting("rollout-0", doc="Name this replica reports to the controller.")
    torch_threads: int = setting(
        0, doc="torch intra-op threads; 0 = torch's default.", min=0, max=1024
    )

    @property
    def served_base_model(self) -> str:
        """The hub id clients load the tokenizer by (lorafleet.hub owns the rule)."""
        return hub.served_name(self.model_path, self.base_model_name)
