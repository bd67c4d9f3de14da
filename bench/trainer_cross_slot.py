"""Cross-slot batching: 8 slots x (1 x 128) in one pass vs 1 slot x (8 x 128).

Both run in-process on the TrainerEngine (forward_backward + optim_step per slot), alternating
so noise hits both alike. Prints JSON; target ratio (cross-slot / single-slot tokens/s) >= 0.8.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from trainer_step import BATCH, RANK, SEQ, bench_model_dir, make_batch

from lorafleet_trainer.domain import (
    AdamParams,
    Datum,
    ForwardBackwardInput,
    ForwardBackwardItem,
    LoraSpec,
)
from lorafleet_trainer.engine import TrainerEngine


def main(steps: int = 5, warmup: int = 1) -> dict:
    model_dir, model_name = bench_model_dir()
    with tempfile.TemporaryDirectory() as storage:
        engine = TrainerEngine.from_pretrained(
            model_dir,
            device="cpu",
            dtype="float32",
            num_slots=BATCH + 1,
            max_rank=64,
            storage_root=Path(storage),
        )
        for slot in range(BATCH + 1):
            engine.bind(slot, f"r{slot}", LoraSpec(rank=RANK, seed=slot))
        ids, targets = make_batch(engine.vocab_size)
        data = [
            Datum(ids[i].tolist(), {"target_tokens": targets[i], "weights": torch.ones(SEQ)})
            for i in range(BATCH)
        ]
        hp = AdamParams()
        n = 0

        def single() -> None:
            nonlocal n
            n += 1
            item = ForwardBackwardItem(
                f"s{n}", BATCH, f"r{BATCH}", ForwardBackwardInput(data, "cross_entropy")
            )
            assert not isinstance(engine.forward_backward([item])[0], Exception)
            engine.optim_step(f"o{n}", BATCH, f"r{BATCH}", hp)

        def cross() -> None:
            nonlocal n
            n += 1
            items = [
                ForwardBackwardItem(
                    f"c{n}", s, f"r{s}", ForwardBackwardInput([data[s]], "cross_entropy")
                )
                for s in range(BATCH)
            ]
            assert not any(isinstance(r, Exception) for r in engine.forward_backward(items))
            for s in range(BATCH):
                engine.optim_step(f"o{n}", s, f"r{s}", hp)

        times: dict[str, list[float]] = {"single": [], "cross": []}
        for i in range(warmup + steps):
            for name, fn in (("single", single), ("cross", cross)):
                t0 = time.perf_counter()
                fn()
                if i >= warmup:
                    times[name].append(time.perf_counter() - t0)
    tokens = BATCH * SEQ
    single_tps = tokens / statistics.median(times["single"])
    cross_tps = tokens / statistics.median(times["cross"])
    return {
        "bench": "trainer_cross_slot",
        "model": model_name,
        "slots": BATCH,
        "seq": SEQ,
        "rank": RANK,
        "steps": steps,
        "single_slot_tokens_per_s": round(single_tps, 1),
        "cross_slot_tokens_per_s": round(cross_tps, 1),
        "ratio": round(cross_tps / single_tps, 3),
        "target_ratio": 0.8,
    }


if __name__ == "__main__":
    print(json.dumps(main()))
