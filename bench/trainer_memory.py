"""Memory: RSS with 64 bound rank-8 slots (weights + both AdamW moments allocated) vs
base + 64 x (adapter + 2 moments).

Each measurement runs in its own child process. The base child loads the engine and runs one
tiny step on one slot (so the autograd/optimizer runtime is paid), then unbinds it; the slots
child does the same and then binds 64 slots and steps each once. Target: measured / expected
<= 1.2.

    python bench/trainer_memory.py [MODEL_DIR]  # ~/.cache/lorafleet/models/smollm2-135m-instruct
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from trainer_step import bench_model_dir

from lorafleet_trainer.domain import (
    AdamParams,
    Datum,
    ForwardBackwardInput,
    ForwardBackwardItem,
    LoraSpec,
)
from lorafleet_trainer.engine import TrainerEngine

SLOTS, RANK = 64, 8


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def train_once(engine: TrainerEngine, slot: int) -> None:
    data = [Datum(list(range(8)), {"target_tokens": torch.arange(1, 9), "weights": torch.ones(8)})]
    item = ForwardBackwardItem(
        f"fb{slot}", slot, f"r{slot}", ForwardBackwardInput(data, "cross_entropy")
    )
    assert not isinstance(engine.forward_backward([item])[0], Exception)
    assert engine.optim_step(f"s{slot}", slot, f"r{slot}", AdamParams()).applied


def child(mode: str, model_dir: str) -> dict:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as storage:
        engine = TrainerEngine.from_pretrained(
            Path(model_dir),
            device="cpu",
            dtype="float32",
            num_slots=SLOTS + 1,
            max_rank=RANK,
            storage_root=Path(storage),
        )
        engine.bind(SLOTS, f"r{SLOTS}", LoraSpec(rank=RANK))
        train_once(engine, SLOTS)
        engine.unbind(SLOTS, f"r{SLOTS}")
        per_slot = 0
        if mode == "slots":
            for slot in range(SLOTS):
                engine.bind(slot, f"r{slot}", LoraSpec(rank=RANK, seed=slot))
                train_once(engine, slot)
            params = engine.slots.bindings[0].optimizer.params
            per_slot = 3 * sum(p.numel() * p.element_size() for p in params)
        return {"rss": rss_bytes(), "per_slot_bytes": per_slot}


def main(model: str | None = None) -> dict:
    """`model`: a model folder (for example the SmolLM2 import); default the ~20M bench model."""
    model_dir, model_name = (Path(model), Path(model).name) if model else bench_model_dir()
    out = {}
    for mode in ("base", "slots"):
        proc = subprocess.run(
            [sys.executable, __file__, "--child", mode, str(model_dir)],
            check=True,
            capture_output=True,
            text=True,
        )
        out[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = out["base"]["rss"] + SLOTS * out["slots"]["per_slot_bytes"]
    return {
        "bench": "trainer_memory",
        "model": model_name,
        "slots": SLOTS,
        "rank": RANK,
        "base_rss_mib": round(out["base"]["rss"] / 2**20, 1),
        "per_slot_mib": round(out["slots"]["per_slot_bytes"] / 2**20, 3),
        "expected_rss_mib": round(expected / 2**20, 1),
        "measured_rss_mib": round(out["slots"]["rss"] / 2**20, 1),
        "ratio": round(out["slots"]["rss"] / expected, 3),
        "target_ratio": 1.2,
    }


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3])))
    else:
        print(json.dumps(main(sys.argv[1] if len(sys.argv) > 1 else None)))
