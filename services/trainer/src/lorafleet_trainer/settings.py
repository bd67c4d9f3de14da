"""TrainerSettings: everything the trainer process reads from `LORAFLEET_TRAINER_*`.

Parsed before torch is imported, so a typo fails in milliseconds with one line naming the
variable rather than after a model load.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lorafleet import hub, quantize
from lorafleet.settings import setting
from lorafleet.staging import MAX_ADAPTER_BYTES

PREFIX = "LORAFLEET_TRAINER_"


@dataclass(frozen=True)
class TrainerSettings:
    model_path: Path = setting(doc="Local folder of the base causal LM (HF format, with config).")
    base_model_name: str = setting(
        "",
        doc="Hub id ('org/name') this replica serves the base model under; must equal the "
        "rollouts'. Default: the id the model folder records, else local/<folder name>.",
    )
    num_slots: int = setting(
        8, doc="Number of fixed LoRA slots held on the base model.", min=1, max=4096
    )
    max_rank: int = setting(64, doc="Largest LoRA rank a slot may be bound with.", min=1, max=4096)
    storage_root: Path = setting(
        Path(".cache/trainer-states"), doc="Folder for saved states (save_state/load_state)."
    )
    shared_adapter_root: Path | None = setting(
        None,
        doc="Absolute folder the controller and every rollout mount at the same path: a "
        "publish writes the adapter there and rollouts read it by reference (no bytes through "
        "the controller). Unset = adapters stream through the controller.",
    )
    max_adapter_bytes: int = setting(
        MAX_ADAPTER_BYTES,
        doc="Largest adapter an import may stream in (all files).",
        min=1024,
        max=1 << 40,
    )
    device: str = setting(
        "auto", doc="Torch device; auto = cuda when present.", choices=("auto", "cpu", "cuda")
    )
    dtype: str = setting(
        "auto",
        doc="Base weights dtype; auto = float32 on CPU, bfloat16 on GPU.",
        choices=("auto", "float32", "bfloat16"),
    )
    quantization: str = setting(
        quantize.NONE,
        doc="How the frozen base is stored (lorafleet.quantize): none = as loaded; int8 = "
        "weight-only, one scale per output row; fp8 = e4m3, one scale per matrix. Every "
        "trainer and rollout of a base model must run the same one (chart model.quantization; "
        "the controller refuses a replica that differs).",
        choices=quantize.QUANTIZATIONS,
    )
    replica_id: str = setting("trainer-0", doc="Name this replica reports to the controller.")
    max_applied_ops: int = setting(
        1024, doc="Applied operation ids (and results) remembered per slot.", min=16, max=1_000_000
    )
    snapshot_every_steps: int = setting(
        10,
        doc="Snapshot a slot automatically every this many optimizer steps (the restore point "
        "of replay after a trainer loss; written off the critical path). 0 = by time only.",
        min=0,
        max=1_000_000,
    )
    snapshot_every_seconds: float = setting(
        300.0,
        doc="Also snapshot a slot at its first optimizer step this long after its last "
        "snapshot. 0 = by steps only; both 0 = no snapshots (replay from initial weights).",
        min=0.0,
        max=30 * 86400.0,
    )
    torch_threads: int = setting(
        0, doc="torch intra-op threads; 0 = torch's default.", min=0, max=1024
    )
    group_timeout_seconds: float = setting(
        120.0,
        doc="Trainer groups (launched by torchrun): how long a collective may wait for a rank "
        "before the replica is declared lost and exits.",
        min=5.0,
        max=86400.0,
    )
    group_reshard_after_forward: str = setting(
        "auto",
        doc="Trainer groups: free a layer's gathered base weights after its forward (true) "
        "or keep them for its backward (false: one all-gather per layer per step instead of "
        "two, at the cost of holding the whole base for the length of a step). auto = true "
        "on cuda, where the shard is what lets the model fit, false on cpu, where the gather "
        "over gloo costs a quarter of a step and host memory is what a step holds anyway.",
        choices=("auto", "true", "false"),
    )
    group_keepalive_seconds: float = setting(
        5.0,
        doc="Trainer groups: rank 0 pings idle ranks this often (well under the timeout).",
        min=0.1,
        max=3600.0,
    )

    @property
    def served_base_model(self) -> str:
        """The hub id clients load the tokenizer by (lorafleet.hub owns the rule)."""
        return hub.served_name(self.model_path, self.base_model_name)
