"""The prepared GPU check: one command, no network, one JSON (issue 15 item 5).

    python bench/gpu_check.py            # one CUDA GPU (an H200: under 8 minutes)
    python bench/gpu_check.py --smoke    # the same code on a small config (CPU or GPU)

Models are built from configs with seeded random weights (no downloads): Llama-3.1-8B shapes
(hidden 4096, MLP 14336, 32 heads / 8 KV heads, vocab 128256) truncated to `--layers` layers.
Each figure is measured side by side in this run:

- trainer: fwd_bwd + optim_step of one rank-16 slot on an 8 x 512 batch, bf16 base, through
  TrainerEngine vs in-process PEFT (speed ratio, and the logprob difference), a mixed batch
  of 8 slots x 1 row vs 1 slot x 8 rows, and the achieved TFLOP/s of the engine step against
  the chip's bf16 peak (`--peak-tflops`, 790 for an H200 SXM's dense bf16). Model FLOPs per
  step: 4 N T (forward, and backward to the activations only: the base is frozen) + the
  causal attention products (forward 2 T S h per layer, backward twice that); N = the base's
  matrix parameters without the embedding table, T tokens, S sequence length, h hidden size.
- rollout: the torch rollout engine's generated tokens/s, 16 concurrent greedy requests
  over 8 adapters, vs one-by-one HF generate + PEFT, both on the device the engine loads its
  weights on (reported; today it has no CUDA path, so it runs on the CPU with --rollout-layers
  layers).
- group: a world-size-1 trainer group through the distributed path (torch.distributed,
  FSDP2, GroupEngine) vs the plain engine: step-time ratio and logprob difference. Then
  (issue 22) a 2-rank group, data parallel (each rank computes its share of the rows): nccl
  over 2 GPUs (skipped with fewer), gloo with one thread per rank on a CPU (`--smoke`), as
  spawned rank processes; a mixed batch of 4 slots against one process (2 threads on a CPU):
  logprobs, gradients and state after 3 optimizer steps, step time world 2 / world 1, each
  rank's share of the forward tokens and of the base, and its GPU memory against the base.
- serving (`gpu_serving.py`): the real SGLang and vLLM servers serve a dense adapter (with
  lm_head) and an expert (MoE) adapter exported by our trainer; their logprobs against the
  trainer's (float32 on a CPU, bound 1e-4; the bf16 figure on a GPU). A part the machine
  cannot run reports "skipped:"/"refused:" with why instead of failing the check.
- quantized (issue 22 item 2): the trainer on an int8 and an fp8 base (`lorafleet.quantize`)
  against the unquantized bf16 engine: base bytes (and against float32), step-time ratio,
  logprobs against PEFT on the dequantized base (what the sampler serves) and the drift from
  the unquantized base; then (`gpu_serving.quantized_serving`) SGLang and vLLM started with
  --quantization fp8 against the fp8 trainer's logprobs.

`--sections serving` (comma-separated) re-runs only some sections.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from gpu_serving import quantized_serving, serving_section
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig

from lorafleet import quantize
from lorafleet.testing import free_port
from lorafleet_trainer.domain import (
    AdamParams,
    Datum,
    ForwardBackwardInput,
    ForwardBackwardItem,
    LoraSpec,
)
from lorafleet_trainer.engine import TrainerEngine
from lorafleet_trainer.quantized import base_nbytes

SECTIONS = ("trainer", "group", "rollout", "serving", "quantized")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 16, 32


def llama8b_config(layers: int, smoke: bool) -> LlamaConfig:
    if smoke:
        return LlamaConfig(
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=layers,
            num_attention_heads=8,
            num_key_value_heads=2,
            vocab_size=4096,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
        )
    return LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    )


def build(config: LlamaConfig, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """Seeded random weights, initialised directly on the device."""
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_seconds(fn, reps: int, device: str) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def batch(gen: torch.Generator, rows: int, seq: int, vocab: int) -> list[Datum]:
    return [
        Datum(
            torch.randint(0, vocab, (seq,), generator=gen).tolist(),
            {
                "target_tokens": torch.randint(0, vocab, (seq,), generator=gen),
                "weights": torch.ones(seq),
            },
        )
        for _ in range(rows)
    ]


def engine_step(engine, items: list[ForwardBackwardItem], step: list[int]) -> list:
    """One fwd_bwd over `items` and an optim_step of each slot (fresh operation ids)."""
    step[0] += 1
    items = [
        ForwardBackwardItem(f"fb{step[0]}-{i.slot}", i.slot, i.registration_id, i.input)
        for i in items
    ]
    outs = engine.forward_backward(items)
    for out in outs:
        if isinstance(out, Exception):
            raise out
    for i in items:
        engine.optim_step(f"s{step[0]}-{i.slot}", i.slot, i.registration_id, AdamParams())
    return outs


def peft_step(pm, optimizer, data: list[Datum], device: str) -> torch.Tensor:
    """The same step in plain PEFT: summed weighted log-likelihood, backward, AdamW."""
    ids = torch.tensor([d.tokens for d in data], device=device)
    logits = pm(input_ids=ids, use_cache=False).logits
    lp = torch.log_softmax(logits.float(), -1)
    targets = torch.stack([d.loss_fn_inputs["target_tokens"] for d in data]).to(device)
    lp_t = lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (-lp_t.sum()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return lp_t.detach()


def model_flops(config: LlamaConfig, base: torch.nn.Module, rows: int, seq: int) -> float:
    embed = base.get_input_embeddings().weight.numel()
    matrices = sum(p.numel() for p in base.parameters() if p.dim() == 2) - embed
    tokens = rows * seq
    attention = 3 * config.num_hidden_layers * 2 * tokens * seq * config.hidden_size
    return 4 * matrices * tokens + attention


def trainer_section(args, device: str, dtype: torch.dtype, work: Path) -> dict:
    config = llama8b_config(args.layers, args.smoke)
    base = build(config, device, dtype)
    reference = copy.deepcopy(base)
    flops = model_flops(config, base, args.rows, args.seq)
    engine = TrainerEngine(
        base, base_model="llama8b-truncated", num_slots=8, max_rank=RANK, storage_root=work
    )
    gen = torch.Generator().manual_seed(1)
    data = batch(gen, args.rows, args.seq, config.vocab_size)
    for slot in range(8):
        engine.bind(slot, f"r{slot}", LoraSpec(rank=RANK, alpha=ALPHA, seed=slot))
    counter = [0]
    one = [ForwardBackwardItem("", 0, "r0", ForwardBackwardInput(data, "cross_entropy"))]
    mixed = [
        ForwardBackwardItem("", s, f"r{s}", ForwardBackwardInput([d], "cross_entropy"))
        for s, d in enumerate(data[:8])
    ]
    engine_s = median_seconds(lambda: engine_step(engine, one, counter), args.reps, device)
    mixed_s = median_seconds(lambda: engine_step(engine, mixed, counter), args.reps, device)

    # PEFT holding slot 0's current adapter; compare logprobs first, then time its step.
    pm = get_peft_model(reference, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS))
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(pm, engine.layout.tensors(engine.slots.bindings[0]))
    params = [p for n, p in pm.named_parameters() if "lora_" in n]
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0)
    probe = ForwardBackwardInput(data[:1], "cross_entropy", forward_only=True)
    ours = engine.forward_backward([ForwardBackwardItem("", 0, "r0", probe)])[0].logprobs[0]
    with torch.no_grad():
        ids = torch.tensor([data[0].tokens], device=device)
        lp = torch.log_softmax(pm(input_ids=ids, use_cache=False).logits.float(), -1)[0]
        theirs = lp.gather(-1, data[0].loss_fn_inputs["target_tokens"].to(device).view(-1, 1))
    diff = float((ours.to(device) - theirs.view(-1)).abs().max())
    peft_s = median_seconds(lambda: peft_step(pm, optimizer, data, device), args.reps, device)
    achieved = flops / engine_s / 1e12
    return {
        "batch": f"{args.rows}x{args.seq}",
        "engine_step_s": round(engine_s, 4),
        "peft_step_s": round(peft_s, 4),
        "speed_vs_peft": round(peft_s / engine_s, 3),
        "logprob_max_abs_diff_vs_peft": diff,
        "mixed_8_slots_1_row_each_s": round(mixed_s, 4),
        "cross_slot_ratio": round(engine_s / mixed_s, 3),
        "model_tflop_per_step": round(flops / 1e12, 2),
        "achieved_tflops": round(achieved, 1),
        "fraction_of_peak": round(achieved / args.peak_tflops, 3),
    }


def quantized_section(args, device: str, dtype: torch.dtype, work: Path) -> dict:
    """Each quantized base against the unquantized one, on the same seeded weights."""
    config = llama8b_config(args.layers, args.smoke)
    gen = torch.Generator().manual_seed(1)
    data = batch(gen, args.rows, args.seq, config.vocab_size)
    probe = ForwardBackwardInput(data[:1], "cross_entropy", forward_only=True)
    one = [ForwardBackwardItem("", 0, "r0", ForwardBackwardInput(data, "cross_entropy"))]
    spec = LoraSpec(rank=RANK, alpha=ALPHA, seed=0)
    out: dict = {}
    float_lp, float_s, float_bytes = None, 0.0, 0
    for kind in (quantize.NONE, quantize.INT8, quantize.FP8):
        base = build(config, device, dtype)
        float32_bytes = sum(4 * p.numel() for p in base.parameters())
        reference = None
        if kind != quantize.NONE:  # PEFT on the dequantized weights: what a sampler serves
            reference = copy.deepcopy(base)
            quantize.dequantize_in_place(reference, kind)
        engine = TrainerEngine(
            base,
            base_model="llama8b-truncated",
            num_slots=1,
            max_rank=RANK,
            storage_root=work / f"q-{kind}",
            quantization=kind,
        )
        engine.bind(0, "r0", spec)
        lp = engine.forward_backward([ForwardBackwardItem("", 0, "r0", probe)])[0].logprobs[0]
        step = [0]  # fresh operation ids for every timed step
        seconds = median_seconds(lambda e=engine, c=step: engine_step(e, one, c), args.reps, device)
        nbytes = base_nbytes(engine.model)
        if kind == quantize.NONE:
            float_lp, float_s, float_bytes = lp, seconds, nbytes
            out[kind] = {"step_s": round(seconds, 4), "base_bytes": nbytes}
        else:
            assert reference is not None and float_lp is not None
            pm = get_peft_model(
                reference, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS)
            )
            with torch.no_grad():
                ids = torch.tensor([data[0].tokens], device=device)
                logits = pm(input_ids=ids, use_cache=False).logits.float()
                theirs = torch.log_softmax(logits, -1)[0].gather(
                    -1, data[0].loss_fn_inputs["target_tokens"].to(device).view(-1, 1)
                )
            out[kind] = {
                "step_s": round(seconds, 4),
                "step_time_ratio_vs_unquantized": round(seconds / float_s, 3),
                "base_bytes": nbytes,
                "base_bytes_ratio_vs_unquantized": round(nbytes / float_bytes, 4),
                "base_bytes_ratio_vs_float32": round(nbytes / float32_bytes, 4),
                "logprob_max_abs_diff_vs_peft_on_dequantized": float(
                    (lp.to(device) - theirs.view(-1)).abs().max()
                ),
                "logprob_max_abs_drift_vs_unquantized": float((lp - float_lp).abs().max()),
            }
            del pm, reference
        del engine, base
        if device == "cuda":
            torch.cuda.empty_cache()
    out["serving"] = asyncio.run(quantized_serving(device, work))
    return out


def group_section(args, device: str, dtype: torch.dtype, work: Path) -> dict:
    from lorafleet_trainer.group import GroupEngine, GroupEnv, launcher_env, load_group_engine

    config = llama8b_config(args.layers, args.smoke)
    folder = work / "group-model"
    build(config, device, dtype).save_pretrained(folder)
    os.environ.update(launcher_env(0, 1, free_port()))
    kwargs = {"num_slots": 1, "max_rank": RANK, "storage_root": work / "group-states"}
    sharded, group = load_group_engine(
        folder,
        GroupEnv.from_environ(),
        device=device,
        dtype=str(dtype).split(".")[-1],
        timeout=300.0,
        base_model="g",
        **kwargs,
    )
    driver = GroupEngine(sharded, group, keepalive=30.0, on_lost=lambda exc: os._exit(3))
    plain = TrainerEngine(
        AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device),
        base_model="g",
        **kwargs,
    )
    gen = torch.Generator().manual_seed(2)
    data = batch(gen, args.rows, args.seq, config.vocab_size)
    item = [ForwardBackwardItem("", 0, "r0", ForwardBackwardInput(data, "cross_entropy"))]
    times = {}
    logprobs = {}
    for name, engine in (("group", driver), ("plain", plain)):
        engine.bind(0, "r0", LoraSpec(rank=RANK, alpha=ALPHA, seed=3))
        counter = [0]
        logprobs[name] = engine_step(engine, item, counter)[0].logprobs[0]
        times[name] = median_seconds(
            lambda e=engine, c=counter: engine_step(e, item, c), args.reps, device
        )
    driver.close()
    group.close()
    return {
        "world_size": 1,
        "group_step_s": round(times["group"], 4),
        "plain_step_s": round(times["plain"], 4),
        "plain_over_group_speed": round(times["plain"] / times["group"], 3),
        "first_step_logprob_max_abs_diff": float(
            (logprobs["group"] - logprobs["plain"]).abs().max()
        ),
    }


TWO_RANK_SPECS = {  # a mixed batch: ranks 4 and 8, one slot with dropout, two losses
    0: LoraSpec(rank=4, alpha=8, seed=1),
    1: LoraSpec(rank=8, seed=2, dropout=0.1, target_modules=("q_proj", "v_proj", "o_proj")),
    2: LoraSpec(rank=4, seed=3),
    3: LoraSpec(rank=8, alpha=4, seed=4),
}
TWO_RANK_HP = AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=1.0)
COMPARED_STEPS = 3  # optimizer steps before logprobs, gradients and state are compared
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def two_rank_batch(step: int, rows: int, seq: int, vocab: int) -> list[ForwardBackwardItem]:
    """`rows` rows of unequal lengths over the 4 slots; step 1's slot 0 is a token-mean step."""
    gen = torch.Generator().manual_seed(100 + step)
    items = []
    for slot in TWO_RANK_SPECS:
        data = []
        for _ in range(max(1, rows // len(TWO_RANK_SPECS))):
            n = int(torch.randint(seq // 4, seq + 1, (1,), generator=gen))
            inputs = {"target_tokens": torch.randint(0, vocab, (n,), generator=gen)}
            if slot < 2:
                loss, inputs["weights"] = "cross_entropy", torch.rand(n, generator=gen)
            else:
                loss = "importance_sampling"
                inputs["logprobs"] = -torch.rand(n, generator=gen) * 8
                inputs["advantages"] = torch.randn(n, generator=gen)
            data.append(Datum(torch.randint(0, vocab, (n,), generator=gen).tolist(), inputs))
        tokens = sum(len(d.tokens) for d in data) if (step, slot) == (1, 0) else 0
        fb = ForwardBackwardInput(data, loss, group_tokens=tokens)
        items.append(ForwardBackwardItem(f"fb{step}", slot, f"r{slot}", fb))
    return items


def two_rank_steps(engine, args, vocab: int) -> dict:
    """COMPARED_STEPS recorded steps (logprobs, gradients, then state), then timed ones."""
    record: dict = {"logprobs": [], "grads": []}

    def step(k: int) -> None:
        outs = engine.forward_backward(two_rank_batch(k, args.rows, args.seq, vocab))
        for out in outs:
            if isinstance(out, Exception):
                raise out
        if k < COMPARED_STEPS:
            record["logprobs"].append([lp.cpu() for out in outs for lp in out.logprobs])
            grads = {}
            for slot in TWO_RANK_SPECS:
                b = engine.slots.bindings[slot]
                for name in b.targets:
                    grads[f"{slot}.{name}.A"] = b.a[name].grad.detach().cpu()
                    grads[f"{slot}.{name}.B"] = b.b[name].grad.detach().cpu()
            record["grads"].append(grads)
        for slot in TWO_RANK_SPECS:
            engine.optim_step(f"s{k}-{slot}", slot, f"r{slot}", TWO_RANK_HP)

    for slot, spec in TWO_RANK_SPECS.items():
        engine.bind(slot, f"r{slot}", spec)
    for k in range(COMPARED_STEPS):
        step(k)
    record["state"] = {
        slot: [p.detach().cpu() for p in engine.slots.bindings[slot].optimizer.params]
        + [t.cpu() for mv in engine.slots.bindings[slot].optimizer.moments().values() for t in mv]
        for slot in TWO_RANK_SPECS
    }
    counter = [COMPARED_STEPS]

    def timed() -> None:
        step(counter[0])
        counter[0] += 1

    record["step_s"] = median_seconds(timed, args.reps, args.device)
    return record


def two_rank_main(args) -> None:
    """A spawned rank (`--rank-of MODEL_DIR`): world 1 is the plain engine in one process.

    Ranks of world 2 run the distributed path (`load_group_engine`: FSDP2, data parallel);
    rank 0 drives it and writes the record, each rank its memory and forward token count.
    """
    from prometheus_client import REGISTRY

    from lorafleet_trainer.group import (
        GroupEngine,
        GroupEnv,
        load_group_engine,
        local_fraction,
        worker_loop,
    )

    torch.set_num_threads(args.threads)
    env = GroupEnv.from_environ()
    dtype = getattr(torch, args.dtype)
    storage = tempfile.mkdtemp(dir=args.out)
    kwargs = {"num_slots": len(TWO_RANK_SPECS), "max_rank": 8, "storage_root": Path(storage)}
    group = None
    if env is None:
        model = AutoModelForCausalLM.from_pretrained(args.rank_of, dtype=dtype).to(args.device)
        engine, rank, backend = TrainerEngine(model, base_model="g", **kwargs), 0, "none"
    else:
        engine, group = load_group_engine(
            args.rank_of,
            env,
            device=args.device,
            dtype=args.dtype,
            timeout=600.0,
            base_model="g",
            **kwargs,
        )
        rank, backend = env.rank, str(torch.distributed.get_backend())
    base = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    mine: dict = {
        "rank": rank,
        "backend": backend,
        "base_fraction_held": local_fraction(engine.model),
    }
    cuda = args.device == "cuda"
    if cuda:
        mine["allocated_at_rest_over_base"] = round(torch.cuda.memory_allocated() / base, 3)
        torch.cuda.reset_peak_memory_stats()
    if rank == 0:
        driver = (
            engine if group is None else GroupEngine(engine, group, 30.0, lambda e: os._exit(3))
        )
        torch.save(two_rank_steps(driver, args, engine.vocab_size), Path(args.out) / "record.pt")
        if group is not None:
            driver.close()
    else:
        worker_loop(engine, group)
    if cuda:
        mine["peak_allocated_over_base"] = round(torch.cuda.max_memory_allocated() / base, 3)
    labels = {"kind": "datum"}
    mine["forward_tokens"] = REGISTRY.get_sample_value(
        "lorafleet_trainer_forward_tokens_total", labels
    )
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(mine))
    if group is not None:
        group.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip teardown, where gloo's threads can abort the process (group_scenario)


def two_rank_section(args, device: str, dtype: torch.dtype, work: Path) -> dict:
    """World 2 (nccl on 2 GPUs, gloo on the CPU) against one process, the same steps.

    On the CPU both runs use the same total threads: one process of 2 against two ranks of 1.
    """
    from lorafleet_trainer.group import launcher_env

    world = 2
    if device == "cuda" and torch.cuda.device_count() < world:
        return {"skipped": f"{torch.cuda.device_count()} CUDA device(s): a 2-rank group needs 2"}
    config = llama8b_config(args.layers, args.smoke)
    folder = work / "two-rank-model"
    build(config, device, dtype).save_pretrained(folder)
    if device == "cuda":
        torch.cuda.empty_cache()  # the ranks' memory is measured on these devices
    clean = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    threads = 1 if device == "cpu" else max(1, (os.cpu_count() or 2) // world)
    runs: dict = {}
    for w in (1, world):
        out = work / f"two-rank-{w}"
        out.mkdir()
        argv = [sys.executable, __file__, "--rank-of", str(folder), "--out", str(out)]
        argv += ["--device", device, "--dtype", str(dtype).split(".")[-1]]
        argv += ["--rows", str(args.rows), "--seq", str(args.seq), "--reps", str(args.reps)]
        argv += ["--threads", str(threads * world // w if device == "cpu" else threads)]
        port = free_port()
        envs = [clean] if w == 1 else [{**clean, **launcher_env(r, w, port)} for r in range(w)]
        procs = [subprocess.Popen(argv, env=e) for e in envs]
        codes = [p.wait(timeout=1800) for p in procs]
        if codes != [0] * w:
            raise RuntimeError(f"world {w}: ranks exited {codes}")
        runs[w] = {
            "record": torch.load(out / "record.pt", weights_only=False),
            "ranks": [json.loads((out / f"rank{r}.json").read_text()) for r in range(w)],
        }
    got, want = runs[world]["record"], runs[1]["record"]

    def worst(pairs) -> float:
        return max(float((g.float() - w.float()).abs().max()) for g, w in pairs)

    ranks = runs[world]["ranks"]
    total = sum(r["forward_tokens"] for r in ranks)
    return {
        "world_size": world,
        "backend": ranks[0]["backend"],
        "threads_per_rank": threads,
        "threads_one_process": threads * world if device == "cpu" else threads,
        "batch": f"{len(TWO_RANK_SPECS)} slots (ranks 4, 8; dropout; cross_entropy,"
        f" importance_sampling; one token-mean step) x {args.rows} rows up to {args.seq} tokens",
        "compared_after_optimizer_steps": COMPARED_STEPS,
        "logprob_max_abs_diff_vs_one_process": worst(
            pair
            for g, w in zip(got["logprobs"], want["logprobs"], strict=True)
            for pair in zip(g, w, strict=True)
        ),
        "grad_max_abs_diff_vs_one_process": worst(
            (g[k], w[k]) for g, w in zip(got["grads"], want["grads"], strict=True) for k in w
        ),
        "state_max_abs_diff_vs_one_process": worst(
            (a, b)
            for s in want["state"]
            for a, b in zip(got["state"][s], want["state"][s], strict=True)
        ),
        "world1_step_s": round(want["step_s"], 4),
        "world2_step_s": round(got["step_s"], 4),
        "step_time_world2_over_world1": round(got["step_s"] / want["step_s"], 3),
        "forward_token_share_per_rank": [round(r["forward_tokens"] / total, 3) for r in ranks],
        "memory_per_rank": [
            {k: v for k, v in r.items() if k not in ("rank", "backend", "forward_tokens")}
            for r in ranks
        ],
        "memory_one_process": {
            k: v
            for k, v in runs[1]["ranks"][0].items()
            if k not in ("rank", "backend", "forward_tokens")
        },
    }


async def rollout_section(args, work: Path) -> dict:
    from lorafleet_rollout.torch_engine import TorchEngine
    from lorafleet_rollout.types import LoraSpec as RolloutLora
    from lorafleet_rollout.types import SampleRequest, SamplingSpec

    config = llama8b_config(args.rollout_layers, args.smoke)
    folder = work / "rollout-model"
    build(config, "cpu", torch.float32).save_pretrained(folder)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    cfg = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, init_lora_weights=False)
    pm = get_peft_model(base, cfg)
    gen = torch.Generator().manual_seed(100)
    adapters = []
    for i in range(8):  # one base, eight seeded random adapters
        with torch.no_grad():
            for name, p in pm.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        pm.save_pretrained(work / f"adapter{i}")
        adapters.append(work / f"adapter{i}")
    del pm, base
    engine = TorchEngine(folder, max_batch_size=16, max_lora_rank=RANK)
    await engine.start()
    device = str(engine._model().embed.device)
    for i, path in enumerate(adapters):
        await engine.load_adapter(f"a{i}", path, RolloutLora(RANK, ALPHA))
    gen = torch.Generator().manual_seed(4)
    prompts = [
        torch.randint(0, config.vocab_size, (args.prompt,), generator=gen).tolist()
        for _ in range(16)
    ]
    new = args.new_tokens
    spec = SamplingSpec(max_tokens=new, temperature=0.0, disable_eos_stop=True)
    requests = [SampleRequest(f"a{r % 8}", tuple(p), spec) for r, p in enumerate(prompts)]
    await engine.sample(requests[0])  # warm-up
    start = time.perf_counter()
    await asyncio.gather(*(engine.sample(r) for r in requests))
    engine_s = time.perf_counter() - start
    await engine.close()

    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    model = PeftModel.from_pretrained(base, adapters[0], adapter_name="a0")
    for i, path in enumerate(adapters[1:], start=1):
        model.load_adapter(path, adapter_name=f"a{i}")
    start = time.perf_counter()
    with torch.inference_mode():
        for r, prompt in enumerate(prompts):
            model.set_adapter(f"a{r % 8}")
            ids = torch.tensor([prompt], device=device)
            model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
    baseline_s = time.perf_counter() - start
    tokens = len(prompts) * new
    return {
        "device": device,
        "layers": args.rollout_layers,
        "requests": f"16 x ({args.prompt} prompt + {new} new), 8 adapters",
        "torch_engine_tok_s": round(tokens / engine_s, 1),
        "generate_peft_tok_s": round(tokens / baseline_s, 1),
        "speedup": round(baseline_s / engine_s, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="small config, any device")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rollout-layers", type=int, default=1)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--peak-tflops", type=float, default=790.0)
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated")
    # A spawned rank of the 2-rank group check (two_rank_section) and its settings.
    parser.add_argument("--rank-of", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--device", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of:
        two_rank_main(args)
    sections = args.sections.split(",")
    if unknown := set(sections) - set(SECTIONS):
        parser.error(f"--sections: unknown {sorted(unknown)}; choose from {list(SECTIONS)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        sys.exit("no CUDA device: run on a GPU machine, or --smoke for the small config")
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.smoke:
        args.seq, args.reps = min(args.seq, 64), min(args.reps, 2)
    started = time.perf_counter()
    result: dict = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "dtype": str(dtype).split(".")[-1],
        "torch": torch.__version__,
        "config": "smoke" if args.smoke else f"Llama-3.1-8B shapes x {args.layers} layers",
    }
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if "trainer" in sections:
            result["trainer"] = trainer_section(args, device, dtype, work)
        if cuda:
            torch.cuda.empty_cache()  # the section's models are gone with its frame
        if "group" in sections:
            result["group"] = group_section(args, device, dtype, work)
            result["group"]["two_ranks"] = two_rank_section(args, device, dtype, work)
        if "rollout" in sections:
            result["rollout"] = asyncio.run(rollout_section(args, work))
        if cuda:
            torch.cuda.empty_cache()  # the servers take their share of what is free
        if "serving" in sections:
            result["serving"] = asyncio.run(serving_section(device, work))
        if cuda:
            torch.cuda.empty_cache()
        if "quantized" in sections:
            result["quantized"] = quantized_section(args, device, dtype, work)
    result["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
