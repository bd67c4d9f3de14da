"""Where an MoE decode goes in the torch engine (tiny Qwen3-MoE, 8 experts, top-2). Prints JSON.

16 concurrent greedy requests (32 prompt, 64 new tokens, EOS ignored) over two rank-8 adapters
that target attention, lm_head and both expert banks per expert, and the same on the base model
alone. Reports tokens/s of each, and the share of the engine's time spent in the MoE blocks
(`moe.Moe`: routing, one GEMM per hit expert, combining) and, within them, in the per-expert
LoRA (`lora.ExpertStacks.add`: gathering each pair's A and B, two bmm). Those shares say whether
a native grouped kernel would pay: the MoE path is torch ops only.

    .venv/bin/python bench/moe_decode.py [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from lorafleet_models.tiny import ensure_model
from lorafleet_rollout import lora, moe
from lorafleet_rollout.torch_engine import TorchEngine
from lorafleet_rollout.types import LoraSpec, SampleRequest, SamplingSpec

REPO = Path(__file__).resolve().parents[1]
TIMES: dict[str, float] = {"moe": 0.0, "expert_lora": 0.0}


def _timed(cls: type, name: str, key: str) -> None:
    """Accumulate the wall time of cls.name into TIMES[key] (the decode runs on one thread)."""
    inner: Callable[..., Any] = getattr(cls, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            TIMES[key] += time.perf_counter() - start

    setattr(cls, name, wrapper)


def make_adapter(model_dir: Path, out: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    config = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        init_lora_weights=False,
    )
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    get_peft_model(base, config).save_pretrained(out, save_embedding_layers=False)
    return out


async def one_round(engine: TorchEngine, adapters: list[str | None]) -> dict[str, float]:
    spec = SamplingSpec(max_tokens=64, temperature=0.0, disable_eos_stop=True)
    requests = [
        SampleRequest(adapters[i % len(adapters)], tuple(range(10 + i, 42 + i)), spec)
        for i in range(16)
    ]
    TIMES.update(moe=0.0, expert_lora=0.0)
    start = time.perf_counter()
    results = await asyncio.gather(*(engine.sample(r) for r in requests))
    wall = time.perf_counter() - start
    tokens = sum(len(s.tokens) for r in results for s in r.sequences)
    return {
        "tok_s": tokens / wall,
        "moe_share": TIMES["moe"] / wall,
        "expert_lora_share": TIMES["expert_lora"] / wall,
    }


async def run(rounds: int) -> dict[str, Any]:
    model_dir = ensure_model("tiny-moe", REPO / ".cache" / "models")
    _timed(moe.Moe, "__call__", "moe")
    _timed(lora.ExpertStacks, "add", "expert_lora")
    engine = TorchEngine(model_dir, max_batch_size=16)
    await engine.start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in (1, 2):
                folder = make_adapter(model_dir, Path(tmp) / f"a{i}", i)
                await engine.load_adapter(f"a{i}@1", folder, LoraSpec(8, 16))
        await one_round(engine, [None])  # warm-up
        sides: dict[str, list[dict[str, float]]] = {"adapters": [], "base": []}
        for _ in range(rounds):  # alternate, so drift on a shared host hits both
            sides["adapters"].append(await one_round(engine, ["a1@1", "a2@1"]))
            sides["base"].append(await one_round(engine, [None]))
    finally:
        await engine.close()
    return {
        side: {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
        for side, runs in sides.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads; 0 = default")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    report = {
        "bench": "moe_decode",
        "model": "lorafleet_models tiny-moe preset (8 experts, top-2)",
        "requests": 16,
        "prompt_tokens": 32,
        "new_tokens": 64,
        "adapters": "2 x rank 8: q/k/v/o, lm_head, both expert banks",
        "torch_threads": torch.get_num_threads(),
        "rounds": args.rounds,
        **asyncio.run(run(args.rounds)),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
