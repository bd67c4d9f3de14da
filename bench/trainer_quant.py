"""Trainer on a quantized frozen base vs float32: step time, base memory, logprob drift.

One step = forward_backward (cross_entropy, batch 8 x 128) + optim_step (AdamW), rank-8 LoRA
on attention, MLP and lm_head of the ~20M "bench" model, in-process engines (one per
setting, loaded side by side; the steps alternate between them so a shared machine's load
hits all alike). Reported per setting: the median step time and its ratio to float32's, the
bytes of the base's parameters and buffers (each storage once) and their ratio to float32's,
and the largest |logprob - float32 logprob| on the batch before training (what quantizing
the base costs in fidelity; the sampler serves the same weights, so it does not add to the
sampler/trainer gap). Prints JSON.

    python bench/trainer_quant.py [--kinds int8,fp8] [--steps 6] [--warmup 2] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_step import BATCH, RANK, SEQ, bench_model_dir, make_batch


def load(model_dir: Path, storage: Path, kind: str):
    from lorafleet_trainer.domain import LoraSpec
    from lorafleet_trainer.engine import TrainerEngine

    engine = TrainerEngine.from_pretrained(
        model_dir,
        device="cpu",
        dtype="float32",
        num_slots=1,
        max_rank=RANK,
        storage_root=storage / kind,
        quantization=kind,
    )
    engine.bind(0, "bench", LoraSpec(rank=RANK, alpha=32, seed=0))
    return engine


def step(engine, ids: torch.Tensor, targets: torch.Tensor, n: int, forward_only: bool = False):
    from lorafleet_trainer.domain import (
        AdamParams,
        Datum,
        ForwardBackwardInput,
        ForwardBackwardItem,
    )

    data = [
        Datum(ids[i].tolist(), {"target_tokens": targets[i], "weights": torch.ones(SEQ)})
        for i in range(BATCH)
    ]
    item = ForwardBackwardItem(
        f"fb-{n}",
        0,
        "bench",
        ForwardBackwardInput(data, "cross_entropy", forward_only=forward_only),
    )
    (out,) = engine.forward_backward([item])
    if not forward_only:
        engine.optim_step(f"step-{n}", 0, "bench", AdamParams(learning_rate=1e-4))
    return out


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="int8,fp8", help="quantizations beside float32")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from lorafleet_trainer.quantized import base_nbytes

    model_dir, model_name = bench_model_dir()
    kinds = ["none", *[k for k in args.kinds.split(",") if k]]
    with tempfile.TemporaryDirectory() as storage:
        engines = {k: load(model_dir, Path(storage), k) for k in kinds}
        ids, targets = make_batch(engines["none"].vocab_size)
        before = {k: step(e, ids, targets, 0, forward_only=True) for k, e in engines.items()}
        times: dict[str, list[float]] = {k: [] for k in kinds}
        for i in range(args.warmup + args.steps):
            for k, engine in engines.items():
                t0 = time.perf_counter()
                step(engine, ids, targets, i + 1)
                if i >= args.warmup:
                    times[k].append(time.perf_counter() - t0)
    base_bytes = {k: base_nbytes(e.model) for k, e in engines.items()}
    median = {k: statistics.median(v) for k, v in times.items()}
    ref = before["none"].logprobs
    result = {
        "bench": "trainer_quant",
        "model": model_name,
        "batch": [BATCH, SEQ],
        "rank": RANK,
        "threads": args.threads,
        "steps": args.steps,
        "kernel": "dequantize one matrix per matmul (forward and again in backward), float32 GEMM",
        "settings": {
            k: {
                "step_seconds_median": round(median[k], 4),
                "step_time_ratio_vs_float32": round(median[k] / median["none"], 3),
                "base_bytes": base_bytes[k],
                "base_bytes_ratio_vs_float32": round(base_bytes[k] / base_bytes["none"], 4),
                "max_abs_logprob_diff_vs_float32": max(
                    (a - b).abs().max().item() for a, b in zip(before[k].logprobs, ref, strict=True)
                ),
            }
            for k in kinds
        },
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
