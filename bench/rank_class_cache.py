"""The adapter cache's eviction against the torch engine's rank classes, simulated on the
real code. Prints JSON.

`AdapterRegistry.victim` (adapters.py) picks what to evict; `AdapterSlots` (adapter_slots.py)
keeps each rank class's stacks within an eighth of what it holds, compacting a class a removal
leaves emptier. Plain LRU evicts any class, so one class shrinks while the incoming adapter's
grows: a resize (a copy of the class's stacks) on most loads. Preferring a victim of the
incoming adapter's class among the least recently used third reuses its slot. This drives
both through the same request stream (no model: stacks of a 64-wide projection, so it runs
in seconds) and reports the hit rate, the stacks' bytes over the loaded adapters' own (max
and mean over the second half) and the slot-rank units copied per load (a rank-r slot moved
or kept through a resize costs r).

  independent  Zipf(1.0) over `--adapters` adapters, ranks drawn from {4..64} independently
               of popularity
  shift        the hottest adapters are the rank-64 ones, then half way the rank-4 ones:
               the worst case for preferring a class (its old members are still hot)

    .venv/bin/python bench/rank_class_cache.py [--adapters 1000] [--loaded 64]
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable

import torch

from lorafleet_rollout.adapter_slots import AdapterSlots
from lorafleet_rollout.adapters import AdapterRegistry, Resident
from lorafleet_rollout.lora import AdapterWeights, LoraStacks, rank_class
from lorafleet_rollout.types import LoraSpec

RANKS = (4, 8, 16, 32, 64)
WIDTH = 64


def simulate(
    args: argparse.Namespace, scenario: str, prefer: Callable[[int], int] | None
) -> dict[str, float]:
    rng = random.Random(args.seed)
    ranks = [rng.choice(RANKS) for _ in range(args.adapters)]
    weights = [1.0 / (k + 1) for k in range(args.adapters)]

    def popularity(sign: int) -> list[int]:  # most popular first
        if scenario == "independent":
            order = list(range(args.adapters))
            rng.shuffle(order)
            return order
        return sorted(range(args.adapters), key=lambda i: sign * ranks[i] + rng.random())

    order = popularity(-1)
    stacks = LoraStacks(WIDTH, (WIDTH,))
    slots = AdapterSlots({"m": (stacks, 0)})
    registry = AdapterRegistry(max_loaded=args.loaded, max_stored=args.adapters)
    for i, rank in enumerate(ranks):
        registry.add(Resident(f"r{i}", 1, LoraSpec(rank, 2 * rank), {}))
    zero = {r: (torch.zeros(WIDTH, r), torch.zeros(r, WIDTH)) for r in RANKS}

    def own() -> int:  # the loaded adapters' own bytes: A and B at their rank
        return sum(2 * WIDTH * e.rank * 4 for e in registry.resident.values() if e.loaded)

    copied = loads = hits = 0
    ratios: list[float] = []
    for step in range(args.requests):
        if scenario == "shift" and step == args.requests // 2:
            order = popularity(1)
        i = order[rng.choices(range(args.adapters), weights=weights)[0]]
        entry = registry.acquire(f"r{i}", 1)
        assert entry is not None
        if entry.loaded:
            hits += 1
        else:
            loads += 1
            before = (dict(slots.capacity), slots.layout)
            if registry.loaded_count() >= registry.max_loaded:
                victim = registry.victim("", entry.rank, prefer)
                assert victim is not None
                victim.loaded = False
                slots.remove(victim.adapter_id)
            adapter = AdapterWeights(entry.rank, {"m": zero[entry.rank]})
            slots.install(entry.adapter_id, slots.lay_out(adapter))
            entry.loaded = True
            copied += sum(
                min(n, slots.capacity.get(r, 0)) * r
                for r, n in before[0].items()
                if slots.capacity.get(r, 0) != n
            )
            copied += (slots.layout - before[1]) * WIDTH  # moves: at most the largest rank
        registry.release(entry)
        if step >= args.requests // 2:
            ratios.append(slots.stack_bytes() / own())
    return {
        "hit_rate": round(hits / args.requests, 4),
        "memory_vs_own_max": round(max(ratios), 3),
        "memory_vs_own_mean": round(sum(ratios) / len(ratios), 3),
        "rank_units_copied_per_load": round(copied / max(1, loads), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=1000)
    parser.add_argument("--loaded", type=int, default=64)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    report: dict[str, object] = {"bench": "rank_class_cache", **vars(args)}
    for scenario in ("independent", "shift"):
        report[scenario] = {
            "plain_lru": simulate(args, scenario, None),
            "prefer_class": simulate(args, scenario, rank_class),
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
