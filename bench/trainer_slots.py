"""Many bound slots of mixed ranks in one pass vs one slot with the same rows.

For K in 1, 8, 64, 128: K slots bound with ranks drawn (seeded) from {1, 4, 8, 16, 32, 64},
each contributing one 128-token row, in one forward_backward, against one slot with the same
K rows. The single slot's rank is the mean of the drawn ranks (rounded), so both do about
the same LoRA FLOPs. Both run in-process on the TrainerEngine on the ~20M bench model,
alternating so that the machine's noise hits both alike; medians of `--steps` timed passes
after `--warmup`, and the range of the steps' own ratios (each step times both back to
back). The optimizer steps (one per slot) are timed apart from the pass.

FLOPs are those torch runs, counted once per configuration by
`torch.utils.flop_counter.FlopCounterMode` (matmuls and attention, forward and backward), and
the achieved FLOP/s is set against a GEMM peak measured in the same run: the best of
`--peak-repeats` float32 1024^3 `torch.mm` calls on the same threads.

    python bench/trainer_slots.py [--slots 1,8,64,128] [--steps 3] [--warmup 1] [--threads N]

Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode
from trainer_step import bench_model_dir

from lorafleet_trainer.domain import (
    AdamParams,
    Datum,
    ForwardBackwardInput,
    ForwardBackwardItem,
    LoraSpec,
)
from lorafleet_trainer.engine import TrainerEngine

RANKS = (1, 4, 8, 16, 32, 64)
SEQ = 128
HP = AdamParams(learning_rate=1e-4)


def gemm_peak(repeats: int, n: int = 1024) -> float:
    """FLOP/s of the best float32 n^3 matmul of `repeats` (after one warm-up)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = min(_timed(lambda: torch.mm(a, b)) for _ in range(repeats))
    return 2 * n**3 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rows(k: int, vocab: int, seed: int) -> list[Datum]:
    gen = torch.Generator().manual_seed(seed)
    return [
        Datum(
            torch.randint(0, vocab, (SEQ,), generator=gen).tolist(),
            {
                "target_tokens": torch.randint(0, vocab, (SEQ,), generator=gen),
                "weights": torch.ones(SEQ),
            },
        )
        for _ in range(k)
    ]


def flops_of(fn) -> int:
    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return counter.get_total_flops()


def measure(engine: TrainerEngine, k: int, steps: int, warmup: int) -> dict:
    """K mixed-rank slots (slots 0..k-1) against one slot (the last) with the same rows."""
    draw = random.Random(k)
    ranks = [draw.choice(RANKS) for _ in range(k)]
    single_slot = len(engine.slots) - 1
    single_rank = max(1, round(sum(ranks) / k))
    for s, r in enumerate(ranks):
        engine.bind(s, f"m{k}-{s}", LoraSpec(rank=r, seed=s))
    engine.bind(single_slot, f"s{k}", LoraSpec(rank=single_rank, seed=k))
    data = rows(k, engine.vocab_size, k)
    n = 0

    def mixed_fb() -> None:
        items = [
            ForwardBackwardItem(
                f"m{n}", s, f"m{k}-{s}", ForwardBackwardInput([data[s]], "cross_entropy")
            )
            for s in range(k)
        ]
        assert not any(isinstance(r, Exception) for r in engine.forward_backward(items))

    def mixed_opt() -> None:
        for s in range(k):
            assert engine.optim_step(f"mo{n}", s, f"m{k}-{s}", HP).applied

    def single_fb() -> None:
        item = ForwardBackwardItem(
            f"s{n}", single_slot, f"s{k}", ForwardBackwardInput(data, "cross_entropy")
        )
        assert not isinstance(engine.forward_backward([item])[0], Exception)

    def single_opt() -> None:
        assert engine.optim_step(f"so{n}", single_slot, f"s{k}", HP).applied

    flops = {}
    for name, fb, opt in (("mixed", mixed_fb, mixed_opt), ("single", single_fb, single_opt)):
        n += 1
        flops[name] = flops_of(fb)
        opt()
    times: dict[str, list[float]] = {"mixed": [], "single": [], "mixed_opt": [], "single_opt": []}
    for i in range(warmup + steps):
        for name, fb, opt in (("mixed", mixed_fb, mixed_opt), ("single", single_fb, single_opt)):
            n += 1
            t_fb, t_opt = _timed(fb), _timed(opt)
            if i >= warmup:
                times[name].append(t_fb)
                times[name + "_opt"].append(t_opt)
    for s in range(k):
        engine.unbind(s, f"m{k}-{s}")
    engine.unbind(single_slot, f"s{k}")
    med = {name: statistics.median(t) for name, t in times.items()}
    tokens = k * SEQ
    return {
        "slots": k,
        "ranks": {r: ranks.count(r) for r in RANKS if r in ranks},
        "single_rank": single_rank,
        "rows": k,
        "mixed_fb_s": round(med["mixed"], 4),
        "single_fb_s": round(med["single"], 4),
        "mixed_tokens_per_s": round(tokens / med["mixed"], 1),
        "single_tokens_per_s": round(tokens / med["single"], 1),
        "fb_ratio": round(med["single"] / med["mixed"], 3),
        # Each timed step's own single/mixed ratio (the two run back to back): the spread.
        "fb_ratio_range": [
            round(min(s / m for s, m in zip(times["single"], times["mixed"], strict=True)), 3),
            round(max(s / m for s, m in zip(times["single"], times["mixed"], strict=True)), 3),
        ],
        "mixed_optim_s": round(med["mixed_opt"], 4),
        "single_optim_s": round(med["single_opt"], 4),
        "step_ratio": round(
            (med["single"] + med["single_opt"]) / (med["mixed"] + med["mixed_opt"]), 3
        ),
        "mixed_gflop": round(flops["mixed"] / 1e9, 2),
        "single_gflop": round(flops["single"] / 1e9, 2),
        "mixed_gflop_per_s": round(flops["mixed"] / med["mixed"] / 1e9, 2),
        "single_gflop_per_s": round(flops["single"] / med["single"] / 1e9, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", default="1,8,64,128")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--peak-repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [int(k) for k in args.slots.split(",")]
    model_dir, model_name = bench_model_dir()
    peak_before = gemm_peak(args.peak_repeats)
    results = []
    with tempfile.TemporaryDirectory() as storage:
        engine = TrainerEngine.from_pretrained(
            model_dir,
            device="cpu",
            dtype="float32",
            num_slots=max(sizes) + 1,
            max_rank=max(RANKS),
            storage_root=Path(storage),
        )
        for k in sizes:
            results.append(measure(engine, k, args.steps, args.warmup))
    # Best of the peaks before and after: the machine's noise only ever lowers a figure.
    peak = max(peak_before, gemm_peak(args.peak_repeats))
    for r in results:
        r["mixed_of_peak"] = round(r["mixed_gflop_per_s"] * 1e9 / peak, 3)
        r["single_of_peak"] = round(r["single_gflop_per_s"] * 1e9 / peak, 3)
    out = {
        "bench": "trainer_slots",
        "model": model_name,
        "seq": SEQ,
        "threads": args.threads,
        "steps": args.steps,
        "gemm_peak_gflop_per_s": round(peak / 1e9, 2),
        "results": results,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
