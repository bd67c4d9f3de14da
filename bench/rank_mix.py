"""Decode speed and LoRA stack memory of a mix of adapter ranks, side by side in one run.
Prints JSON.

Issue 35 item 3: "any mix of ranks at the cost of its own rank". Three decoders on the ~20 M
bench model (bench/sampling.py's, built locally from a seed), 16 rows over 8 adapters (2 rows
each, q/k/v/o/gate/up/down) at 100 columns, timed in alternating blocks of decode steps so
load drift on a shared host hits every side; each side's figure is the median block.

  a           8 adapters of rank 4
  b           7 of rank 4 and 1 of rank 64, each in its rank class's stacks (`lora.rank_class`)
  b_one_stack the same 8 laid out at rank 64, zero-padded: the single stack at the largest
              resident rank that every slot paid before rank classes (same kernels)

The goal: b's step time close to a's, its stack bytes proportional to the sum of its own ranks
(92 vs 32 rank columns per projection: 2.875x).

    .venv/bin/python bench/rank_mix.py [--blocks 20] [--steps 10] [--threads 1] [--torch-ops]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from sampling import bench_model
from transformers import AutoModelForCausalLM

from lorafleet_rollout.decoder import Decoder
from lorafleet_rollout.lora import AdapterWeights, LoraStacks, Route, make_route

ROWS, COLUMNS, ADAPTERS = 16, 100, 8
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def adapter(shapes: dict[str, tuple[int, int]], seed: int, rank: int, pad: int) -> AdapterWeights:
    """Random rank-`rank` weights on TARGETS, zero-padded to rank `pad` (exact zeros: the same
    deltas at a larger stack rank)."""
    gen = torch.Generator().manual_seed(seed)
    modules = {}
    for name, (fan_in, fan_out) in shapes.items():
        a, b = torch.zeros(fan_in, pad), torch.zeros(pad, fan_out)
        a[:, :rank] = torch.randn(fan_in, rank, generator=gen) * 0.01
        b[:rank] = torch.randn(rank, fan_out, generator=gen) * 0.01
        modules[name] = (a, b)
    return AdapterWeights(pad, modules)


def build(model: torch.nn.Module, ranks: list[int], pad: int, native: bool) -> Decoder:
    dec = Decoder(model, native=native)
    shapes = {
        n: (m.in_features, m.out_features)
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and n.endswith(TARGETS)
    }
    for i, rank in enumerate(ranks):
        weights = adapter(shapes, i, rank, max(rank, pad))
        dec.install(f"a{i}", dec.lay_out(weights))
    dec.cache.reserve(ROWS, COLUMNS + 1)
    return dec


def stack_bytes(dec: Decoder) -> int:
    stacks = {id(s): s for s, _ in dec.targets.values() if isinstance(s, LoraStacks)}
    return sum(t.nbytes for s in stacks.values() for t in (*s.a.values(), *s.b.values()))


def step(dec: Decoder, route: Route | None) -> torch.Tensor:
    cols = torch.full((ROWS,), COLUMNS - 1)
    tokens = torch.arange(ROWS) + 5
    with torch.inference_mode():
        return dec.decode(tokens, cols, cols, COLUMNS, route, [])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--steps", type=int, default=10, help="decode steps per block")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--torch-ops", action="store_true", help="no native kernels")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, _ = bench_model(Path(tmp))  # the bench model sampling.py measures
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    native = not args.torch_ops
    mixed = [4] * (ADAPTERS - 1) + [64]
    sides = {
        "a": build(model, [4] * ADAPTERS, 0, native),
        "b": build(model, mixed, 0, native),
        "b_one_stack": build(model, mixed, 64, native),
    }
    # One route per side, as the engine makes one per batch composition (not per step).
    routes = {
        name: make_route([dec.slot(f"a{i % ADAPTERS}") for i in range(ROWS)])
        for name, dec in sides.items()
    }
    # warm-up: native kernels bound, pages touched
    logits = {name: step(dec, routes[name]) for name, dec in sides.items()}
    assert torch.allclose(logits["b"], logits["b_one_stack"], atol=1e-4)  # same deltas
    times: dict[str, list[float]] = {name: [] for name in sides}
    for block in range(args.blocks):
        names = list(sides)
        for name in names[block % 3 :] + names[: block % 3]:
            start = time.perf_counter()
            for _ in range(args.steps):
                step(sides[name], routes[name])
            times[name].append((time.perf_counter() - start) / args.steps)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    held = {name: stack_bytes(dec) for name, dec in sides.items()}
    print(
        json.dumps(
            {
                "bench": "rank_mix",
                "model": "lorafleet_models bench preset (bench/sampling.py bench_model)",
                "path": "torch" if args.torch_ops else "native",
                "rows": ROWS,
                "columns": COLUMNS,
                "threads": args.threads,
                "blocks": args.blocks,
                "steps_per_block": args.steps,
                "step_ms": {n: round(v, 3) for n, v in ms.items()},
                "tokens_per_s": {n: round(ROWS * 1e3 / v, 1) for n, v in ms.items()},
                "lora_stack_bytes": held,
                "b_over_a_step_time": round(ms["b"] / ms["a"], 4),
                "b_over_a_bytes": round(held["b"] / held["a"], 4),
                "b_one_stack_over_a_step_time": round(ms["b_one_stack"] / ms["a"], 4),
                "b_one_stack_over_a_bytes": round(held["b_one_stack"] / held["a"], 4),
                "own_rank_sum_ratio": round(sum(mixed) / (4 * ADAPTERS), 4),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
