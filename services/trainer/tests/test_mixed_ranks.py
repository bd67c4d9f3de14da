"""Many slots of mixed ranks in one pass: each slot's logprobs and gradients equal its own
pass alone (≤ 1e-5 plus float32 reach, as test_exactness.py bounds them).

Sixteen slots of ranks {1, 2, 4, 8, 16} (several per rank, so each rank class runs batched
units, one-run classes run the 2-D kernels, and some classes have slots that skip a module)
with one to three rows each: the shape `bench/trainer_slots.py` measures, on the tiny model.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import torch

from lorafleet_trainer.domain import ForwardBackwardInput, ForwardBackwardItem, LoraSpec

# The bound and the datums of test_exactness.py (its one owner), loaded as group tests load
# their scenario: test files are not importable modules under --import-mode=importlib.
_spec = importlib.util.spec_from_file_location(
    "test_exactness", Path(__file__).resolve().parent / "test_exactness.py"
)
assert _spec is not None and _spec.loader is not None
exactness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(exactness)
assert_close, make_datum = exactness.assert_close, exactness.make_datum

RANKS = (1, 2, 4, 8, 16)
SLOTS = 16


def spec_of(slot: int, rank: int) -> LoraSpec:
    if slot % 5 == 3:  # a slot that adapts only some modules: zeros stand in for the others
        return LoraSpec(rank=rank, seed=slot, target_modules=("q_proj", "down_proj"))
    return LoraSpec(rank=rank, alpha=2.0 * rank + slot, seed=slot)


def test_mixed_rank_slots_in_one_pass_equal_each_slot_alone(make_engine, h) -> None:
    draw = random.Random(7)
    ranks = [draw.choice(RANKS) for _ in range(SLOTS)]
    gen = torch.Generator().manual_seed(7)
    data = {
        s: [make_datum(gen, draw.randint(3, 9), "cross_entropy") for _ in range(1 + s % 3)]
        for s in range(SLOTS)
    }
    mixed = make_engine(num_slots=SLOTS)
    for s, r in enumerate(ranks):
        mixed.bind(s, f"r{s}", spec_of(s, r))
        h.perturb(mixed, s, seed=500 + s)
    items = [
        ForwardBackwardItem(f"op{s}", s, f"r{s}", ForwardBackwardInput(data[s], "cross_entropy"))
        for s in draw.sample(range(SLOTS), SLOTS)
    ]
    results = mixed.forward_backward(items)
    together = {item.slot: out for item, out in zip(items, results, strict=True)}

    alone = make_engine(num_slots=1)
    for s, r in enumerate(ranks):
        alone.bind(0, f"a{s}", spec_of(s, r))
        h.perturb(alone, 0, seed=500 + s)
        (out,) = alone.forward_backward(
            [ForwardBackwardItem("op", 0, f"a{s}", ForwardBackwardInput(data[s], "cross_entropy"))]
        )
        for got, want in zip(together[s].logprobs, out.logprobs, strict=True):
            assert_close(got, want)
        grads, ref = h.slot_grads(mixed, s), h.slot_grads(alone, 0)
        assert grads.keys() == ref.keys()
        for key in grads:
            assert_close(grads[key], ref[key])
        alone.unbind(0, f"a{s}")
