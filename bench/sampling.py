"""Sampling throughput: TorchEngine (continuous, mixed-adapter batching) vs one-by-one `generate`.

16 concurrent requests over 8 LoRA adapters on the ~20 M "bench" model, each 32 prompt tokens
and 64 greedy new tokens (EOS ignored, so both sides generate exactly the same token count),
measured side by side in one run. The baseline is what a naive server does: transformers +
PEFT with all adapters loaded, `set_adapter`, then `generate` per request. Prints JSON.

    .venv/bin/python bench/sampling.py [--requests 16] [--adapters 8] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig

from lorafleet_rollout.torch_engine import TorchEngine
from lorafleet_rollout.types import LoraSpec, SampleRequest, SamplingSpec

REPO = Path(__file__).resolve().parents[1]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def bench_model(work: Path) -> tuple[Path, str]:
    try:
        from lorafleet_models.tiny import ensure_model
    except ImportError:
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=2048, hidden_size=512, num_hidden_layers=6, intermediate_size=1536,
            num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512,
        )  # fmt: skip
        AutoModelForCausalLM.from_config(config).save_pretrained(work / "model")
        return work / "model", "random 512/6/1536 Llama"
    return ensure_model("bench", REPO / ".cache" / "models"), "lorafleet_models bench preset"


def make_adapters(model_dir: Path, work: Path, n: int) -> list[Path]:
    folders = []
    for i in range(n):
        torch.manual_seed(100 + i)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False)
        get_peft_model(base, config).save_pretrained(work / f"a{i}")
        folders.append(work / f"a{i}")
    return folders


def baseline(model_dir: Path, adapters: list[Path], prompts: list[list[int]], new: int) -> float:
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, adapters[0], adapter_name="a0")
    for i, folder in enumerate(adapters[1:], start=1):
        model.load_adapter(folder, adapter_name=f"a{i}")
    model.eval()
    start = time.perf_counter()
    with torch.inference_mode():
        for r, prompt in enumerate(prompts):
            model.set_adapter(f"a{r % len(adapters)}")
            ids = torch.tensor([prompt])
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                min_new_tokens=new, do_sample=False, pad_token_id=0,
            )  # fmt: skip
            assert out.shape[1] == len(prompt) + new
    return time.perf_counter() - start


async def engine_run(
    model_dir: Path, adapters: list[Path], prompts: list[list[int]], new: int
) -> tuple[float, float]:
    engine = TorchEngine(model_dir, max_batch_size=len(prompts))
    await engine.start()
    for i, folder in enumerate(adapters):
        await engine.load_adapter(f"reg-{i}@1", folder, LoraSpec(8, 16))
    spec = SamplingSpec(max_tokens=new, temperature=0.0, disable_eos_stop=True)
    requests = [
        SampleRequest(f"reg-{r % len(adapters)}@1", tuple(p), spec) for r, p in enumerate(prompts)
    ]
    await engine.sample(requests[0])  # warm-up
    start = time.perf_counter()
    results = await asyncio.gather(*(engine.sample(r) for r in requests))
    elapsed = time.perf_counter() - start
    assert all(len(res.sequences[0].tokens) == new for res in results)
    start = time.perf_counter()
    await engine.sample(requests[0])
    single = time.perf_counter() - start
    await engine.close()
    return elapsed, single


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir, model_kind = bench_model(work)
        adapters = make_adapters(model_dir, work, args.adapters)
        gen = torch.Generator().manual_seed(0)
        prompts = [
            torch.randint(3, 2000, (args.prompt_tokens,), generator=gen).tolist()
            for _ in range(args.requests)
        ]
        engine_s, single_s = asyncio.run(engine_run(model_dir, adapters, prompts, args.new_tokens))
        baseline_s = baseline(model_dir, adapters, prompts, args.new_tokens)
    tokens = args.requests * args.new_tokens
    print(
        json.dumps(
            {
                "bench": "sampling",
                "model": model_kind,
                "requests": args.requests,
                "adapters": args.adapters,
                "prompt_tokens": args.prompt_tokens,
                "new_tokens": args.new_tokens,
                "torch_threads": torch.get_num_threads(),
                "torch_engine_tok_s": round(tokens / engine_s, 1),
                "one_by_one_generate_tok_s": round(tokens / baseline_s, 1),
                "speedup": round(baseline_s / engine_s, 2),
                "torch_engine_single_request_s": round(single_s, 3),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
