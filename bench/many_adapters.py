"""Serving many adapters from one rollout: the adapter cache, measured side by side in one run.
Prints JSON.

Issue 35's figures. One `RolloutCore` over `TorchEngine` (the rollout's own code path: cache,
eviction, one load per version) on the ~20 M bench model, with `--adapters` (1,000) published
versions of ranks drawn from {4, 8, 16, 32, 64} and `--loaded` (64) of them in the engine at
once. Each workload is `--requests` greedy requests (`--prompt` prompt tokens, `--new` new tokens,
EOS ignored) with `--concurrency` in flight, and runs in alternating rounds with the one-adapter
baseline so load drift on a shared host hits both sides:

  one      every request on one adapter (the baseline)
  hot      uniform over `--loaded` adapters, all loaded (goal >= 0.8 of one)
  zipf     Zipf(1.0) over every adapter, cold at the start of the run (goal >= 0.5 of one)

Reported per workload: tokens/s (median round) and the ratio to `one` in the same round; for
zipf, loads per request and the engine's load time p50/p99 (file read, lay-out and install of
one version). And the engine's LoRA memory: the bytes of its adapter stacks over the sum of the
loaded adapters' own bytes (goal <= 1.1).

    .venv/bin/python bench/many_adapters.py [--adapters 1000] [--loaded 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from sampling import bench_model

from lorafleet.digests import sha256_file
from lorafleet_rollout.core import Limits, RolloutCore
from lorafleet_rollout.torch_engine import TorchEngine
from lorafleet_rollout.types import LoraSpec, SampleRequest, SamplingSpec

RANKS = (4, 8, 16, 32, 64)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def linear_shapes(model_dir: Path) -> dict[str, tuple[int, int]]:
    """PEFT module path -> (in, out) of every targeted Linear (read from the config alone)."""
    config = json.loads((model_dir / "config.json").read_text())
    h, inter, layers = (
        config["hidden_size"],
        config["intermediate_size"],
        config["num_hidden_layers"],
    )
    heads, kv = (
        config["num_attention_heads"],
        config.get("num_key_value_heads") or config["num_attention_heads"],
    )
    kv_out = h // heads * kv
    per_layer = {
        "self_attn.q_proj": (h, h),
        "self_attn.k_proj": (h, kv_out),
        "self_attn.v_proj": (h, kv_out),
        "self_attn.o_proj": (h, h),
        "mlp.gate_proj": (h, inter),
        "mlp.up_proj": (h, inter),
        "mlp.down_proj": (inter, h),
    }
    return {
        f"model.layers.{i}.{name}": shape
        for i in range(layers)
        for name, shape in per_layer.items()
    }


def write_adapter(folder: Path, shapes: dict[str, tuple[int, int]], rank: int, seed: int) -> int:
    """A PEFT adapter folder of random rank-`rank` weights; returns its weights' bytes."""
    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (fan_in, fan_out) in shapes.items():
        prefix = f"base_model.model.{module}"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.02
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.02
    save_file(tensors, folder / "adapter_model.safetensors")
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(TARGETS),
        "lora_dropout": 0.0,
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return sum(t.numel() * t.element_size() for t in tensors.values())


class TimedEngine(TorchEngine):
    """The torch engine, timing each adapter load (what a cold sample waits for)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.load_seconds: list[float] = []

    async def load_adapter(self, adapter_id, source, lora) -> None:  # type: ignore[no-untyped-def]
        started = time.perf_counter()
        await super().load_adapter(adapter_id, source, lora)
        self.load_seconds.append(time.perf_counter() - started)


def stage(folder: Path, staged: Path) -> dict[str, str]:
    """A copy of the adapter as a push stages it, and its files' digests."""
    shutil.copytree(folder, staged)
    return {f.name: sha256_file(f) for f in folder.iterdir()}


async def publish(core: RolloutCore, i: int, folder: Path, rank: int, work: Path) -> None:
    staged = work / f"staged-{i}"
    digests = await asyncio.to_thread(stage, folder, staged)
    await core.load_adapter(f"reg-{i}", 1, LoraSpec(rank, 2 * rank), staged, digests)


async def run(core: RolloutCore, picks: list[int], args: argparse.Namespace) -> float:
    """tokens/s of greedy requests on the adapters `picks`, `args.concurrency` at a time."""
    spec = SamplingSpec(args.new, temperature=0.0, disable_eos_stop=True)
    gate = asyncio.Semaphore(args.concurrency)
    prompt = tuple(range(3, 3 + args.prompt))

    async def one(n: int, i: int) -> None:
        async with gate:
            # a distinct prompt per request: no request is served from another's prefix cache
            tokens = (n % 200 + 3, *prompt)
            await core.sample(f"reg-{i}", 1, SampleRequest(None, tokens, spec))

    started = time.perf_counter()
    await asyncio.gather(*(one(n, i) for n, i in enumerate(picks)))
    return len(picks) * args.new / (time.perf_counter() - started)


def zipf(n: int, count: int, rng: random.Random) -> list[int]:
    weights = [1.0 / (k + 1) for k in range(n)]
    order = list(range(n))
    rng.shuffle(order)  # popularity independent of rank and of publish order
    return [order[k] for k in rng.choices(range(n), weights=weights, k=count)]


def lora_bytes(engine: TorchEngine) -> int:
    """Bytes of the engine's LoRA stacks (every rank class's A and B, every projection)."""
    return engine._model().stack_bytes()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    torch.set_num_threads(args.threads)
    rng = random.Random(2026)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir, model_desc = bench_model(work)
        shapes = linear_shapes(model_dir)
        ranks = [rng.choice(RANKS) for _ in range(args.adapters)]
        own = {}
        for i, rank in enumerate(ranks):
            own[i] = write_adapter(work / f"src{i}", shapes, rank, seed=i)
        engine = TimedEngine(model_dir)
        limits = Limits(
            max_loaded_adapters=args.loaded,
            max_queued_requests=args.requests + args.concurrency,
            max_num_samples=1,
            max_stored_adapters=args.adapters,
        )
        core = RolloutCore(engine, limits, work / "resident")
        await core.start()
        try:
            started = time.perf_counter()
            for i, rank in enumerate(ranks):
                await publish(core, i, work / f"src{i}", rank, work)
            publish_s = time.perf_counter() - started
            hot = list(range(args.adapters - args.loaded, args.adapters))  # loaded last
            rounds: list[dict[str, float]] = []
            zipf_loads = 0
            for _ in range(args.rounds):
                one = await run(core, [hot[0]] * args.requests, args)
                spread = await run(core, [hot[n % len(hot)] for n in range(args.requests)], args)
                before = len(engine.load_seconds)
                cold = await run(core, zipf(args.adapters, args.requests, rng), args)
                zipf_loads += len(engine.load_seconds) - before
                # back to the hot set for the next round (its loads are not timed as zipf's)
                await run(core, hot, args)
                rounds.append({"one": one, "hot": spread, "zipf": cold})
            loaded = [
                int(r.registration_id.split("-")[1]) for r in core.list_adapters() if r.loaded
            ]
            memory = lora_bytes(engine) / sum(own[i] for i in loaded)
        finally:
            await core.close()

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    def ratio(key: str) -> float:
        return statistics.median(r[key] / r["one"] for r in rounds)

    loads = engine.load_seconds
    return {
        "bench": "many_adapters",
        "model": model_desc,
        "adapters": args.adapters,
        "loaded": args.loaded,
        "ranks": dict(sorted({r: ranks.count(r) for r in RANKS}.items())),
        "requests": args.requests,
        "concurrency": args.concurrency,
        "prompt_tokens": args.prompt,
        "new_tokens": args.new,
        "threads": args.threads,
        "publish_seconds_per_adapter": publish_s / args.adapters,
        "one_tokens_per_s": median("one"),
        "hot_tokens_per_s": median("hot"),
        "zipf_tokens_per_s": median("zipf"),
        "hot_vs_one": ratio("hot"),
        "zipf_vs_one": ratio("zipf"),
        "zipf_loads_per_request": zipf_loads / (args.rounds * args.requests),
        "load_p50_ms": 1e3 * pct(loads, 0.5),
        "load_p99_ms": 1e3 * pct(loads, 0.99),
        "lora_memory_vs_own": memory,
        "rounds": rounds,
        "goals": {"hot_vs_one": ">= 0.8", "zipf_vs_one": ">= 0.5", "lora_memory_vs_own": "<= 1.1"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=1000)
    parser.add_argument("--loaded", type=int, default=64)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    print(json.dumps(asyncio.run(main_async(parser.parse_args())), indent=2))


if __name__ == "__main__":
    main()
