"""Decode-step time of two versions of the torch engine's decoder, interleaved in one process.
Prints JSON.

A whole-engine benchmark on a shared host swings by tens of percent between runs (others'
load), which hides the few percent a change to `decoder.py` might cost. Here the baseline
`decoder.py` (any file, e.g. `git show REV:services/rollout/src/lorafleet_rollout/decoder.py`)
and the current one are built on the same bench model with the same adapters and timed in
alternating blocks of decode steps, so load drift hits both; the result is the median of the
per-block ratios. 16 rows over 8 rank-8 adapters (q, v, down and lm_head) at 100 columns, as
in `sampling.py`'s workload.

    git show HEAD~1:services/rollout/src/lorafleet_rollout/decoder.py > /tmp/decoder_base.py
    .venv/bin/python bench/decoder_ab.py --baseline /tmp/decoder_base.py [--blocks 30]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from lorafleet_models.tiny import ensure_model
from lorafleet_rollout import decoder as current
from lorafleet_rollout.lora import AdapterWeights, make_route

REPO = Path(__file__).resolve().parents[1]
ROWS, COLUMNS, ADAPTERS, RANK = 16, 100, 8, 8


def load_baseline(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("decoder_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def build(module: ModuleType, model: Any) -> Any:
    """A decoder of `module` on `model` with ADAPTERS installed and its cache reserved."""
    dec = module.Decoder(model)
    shapes = {
        n: (m.in_features, m.out_features)
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    for i in range(ADAPTERS):
        gen = torch.Generator().manual_seed(i)
        modules = {
            name: (
                torch.randn(fan_in, RANK, generator=gen) * 0.01,
                torch.randn(RANK, fan_out, generator=gen) * 0.01,
            )
            for name, (fan_in, fan_out) in shapes.items()
            if name.endswith(("q_proj", "v_proj", "down_proj", "lm_head"))
        }
        dec.install(f"a{i}", dec.lay_out(AdapterWeights(RANK, modules)))
    dec.cache.reserve(ROWS, COLUMNS + 1)
    return dec


def step(dec: Any, route: Any) -> None:
    cols = torch.full((ROWS,), COLUMNS - 1)
    tokens = torch.arange(ROWS) + 5
    with torch.inference_mode():
        dec.decode(tokens, cols, cols, COLUMNS, route, [])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", type=Path, required=True, help="the other decoder.py")
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--steps", type=int, default=10, help="decode steps per block")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(
        ensure_model("bench", REPO / ".cache" / "models"), dtype=torch.float32
    ).eval()
    baseline = load_baseline(args.baseline)
    sides = {"baseline": build(baseline, model), "current": build(current, model)}
    route = make_route([1 + i % ADAPTERS for i in range(ROWS)])
    times: dict[str, list[float]] = {name: [] for name in sides}
    for dec in sides.values():  # warm-up: native kernels bound, pages touched
        for _ in range(3):
            step(dec, route)
    for block in range(args.blocks):
        order = list(sides) if block % 2 == 0 else list(reversed(sides))
        for name in order:
            start = time.perf_counter()
            for _ in range(args.steps):
                step(sides[name], route)
            times[name].append((time.perf_counter() - start) / args.steps)
    ratios = [c / b for c, b in zip(times["current"], times["baseline"], strict=True)]
    print(
        json.dumps(
            {
                "bench": "decoder_ab",
                "model": "lorafleet_models bench preset",
                "rows": ROWS,
                "columns": COLUMNS,
                "adapters": ADAPTERS,
                "rank": RANK,
                "threads": args.threads,
                "blocks": args.blocks,
                "steps_per_block": args.steps,
                "baseline_step_ms": round(statistics.median(times["baseline"]) * 1e3, 3),
                "current_step_ms": round(statistics.median(times["current"]) * 1e3, 3),
                "current_over_baseline": round(statistics.median(ratios), 4),
                "ratio_quartiles": [round(q, 4) for q in statistics.quantiles(ratios, n=4)],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
