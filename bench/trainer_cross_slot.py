"""Cross-slot batching: 8 slots x (1 x 128) in one pass vs 1 slot x (8 x 128).

Both run in-process on the TrainerEngine (forward_backward + optim_step per slot), alternating
so noise hits both alike. Target ratio (cross-slot / single-slot tokens/s) >= 0.8.

`--legacy` also runs a second engine patched back to the previous implementation (a per-slot
loop of split / F.linear / scale / cat in every wrapped Linear, and a per-tensor gradient norm
in optim_step), interleaved with the current one, so the before/after figures come from the
same noisy time window. That old path lives only here. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from trainer_step import BATCH, RANK, SEQ, bench_model_dir, make_batch

from lorafleet_trainer.domain import (
    AdamParams,
    Datum,
    ForwardBackwardInput,
    ForwardBackwardItem,
    LoraSpec,
    OptimStepResult,
)
from lorafleet_trainer.engine import TrainerEngine
from lorafleet_trainer.optim import SlotOptimizer


def _legacy_forward(self, x: torch.Tensor) -> torch.Tensor:
    """The previous MultiLoraLinear.forward (no dropout: the bench trains without it)."""
    out = self.base(x)
    groups = self.router.routing.groups
    parts = x.split([g.size for g in groups]) if len(groups) > 1 else (x,)
    deltas = []
    for group, xs in zip(groups, parts, strict=True):
        w = self.adapters.get(group.slot)
        if w is None:
            deltas.append(None)
            continue
        deltas.append((F.linear(F.linear(xs.to(w.A.dtype), w.A), w.B) * group.scale).to(out.dtype))
    if all(d is None for d in deltas):
        return out
    if len(deltas) == 1:
        return out + deltas[0]
    filled = [
        d if d is not None else out.new_zeros((g.size, *out.shape[1:]))
        for g, d in zip(groups, deltas, strict=True)
    ]
    return out + torch.cat(filled)


def _legacy_step(self: SlotOptimizer, hp: AdamParams) -> OptimStepResult:
    """The previous SlotOptimizer.step: a per-tensor float64 norm and finiteness check."""
    grads = [p.grad for p in self.params if p.grad is not None]
    sq = torch.zeros((), dtype=torch.float64)
    for g in grads:
        sq += g.double().square().sum()
    norm = math.sqrt(float(sq))
    assert math.isfinite(norm) and all(bool(torch.isfinite(g).all()) for g in grads)
    if hp.grad_clip_norm > 0 and norm > hp.grad_clip_norm:
        for g in grads:
            g.mul_(hp.grad_clip_norm / (norm + 1e-6))
    for group in self._opt.param_groups:
        group.update(lr=hp.learning_rate, betas=(hp.beta1, hp.beta2), eps=hp.eps)
    self._opt.step()
    self._opt.zero_grad(set_to_none=True)
    self.steps += 1
    return OptimStepResult(metrics={"grad_norm": norm}, applied=True)


def make_engine(model_dir: Path, storage: Path, legacy: bool) -> TrainerEngine:
    engine = TrainerEngine.from_pretrained(
        model_dir,
        device="cpu",
        dtype="float32",
        num_slots=BATCH + 1,
        max_rank=64,
        storage_root=storage,
    )
    for slot in range(BATCH + 1):
        engine.bind(slot, f"r{slot}", LoraSpec(rank=RANK, seed=slot))
        if legacy:
            opt = engine.slots.bindings[slot].optimizer
            opt.step = types.MethodType(_legacy_step, opt)
    if legacy:
        for wrapper in engine.wrappers.values():
            wrapper.forward = types.MethodType(_legacy_forward, wrapper)
    return engine


def loops(engine: TrainerEngine, data: list[Datum]) -> dict[str, Callable[[], None]]:
    hp = AdamParams()
    n = 0

    def single() -> None:
        nonlocal n
        n += 1
        item = ForwardBackwardItem(
            f"s{n}", BATCH, f"r{BATCH}", ForwardBackwardInput(data, "cross_entropy")
        )
        assert not isinstance(engine.forward_backward([item])[0], Exception)
        assert engine.optim_step(f"o{n}", BATCH, f"r{BATCH}", hp).applied

    def cross() -> None:
        nonlocal n
        n += 1
        items = [
            ForwardBackwardItem(
                f"c{n}", s, f"r{s}", ForwardBackwardInput([data[s]], "cross_entropy")
            )
            for s in range(BATCH)
        ]
        assert not any(isinstance(r, Exception) for r in engine.forward_backward(items))
        for s in range(BATCH):
            assert engine.optim_step(f"o{n}", s, f"r{s}", hp).applied

    return {"single": single, "cross": cross}


def main(steps: int = 5, warmup: int = 1, legacy: bool = False) -> dict:
    model_dir, model_name = bench_model_dir()
    with tempfile.TemporaryDirectory() as storage:
        engines = {"": make_engine(model_dir, Path(storage), legacy=False)}
        if legacy:
            engines["legacy_"] = make_engine(model_dir, Path(storage), legacy=True)
        ids, targets = make_batch(engines[""].vocab_size)
        data = [
            Datum(ids[i].tolist(), {"target_tokens": targets[i], "weights": torch.ones(SEQ)})
            for i in range(BATCH)
        ]
        fns = {
            prefix + name: fn
            for prefix, engine in engines.items()
            for name, fn in loops(engine, data).items()
        }
        times: dict[str, list[float]] = {name: [] for name in fns}
        for i in range(warmup + steps):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                if i >= warmup:
                    times[name].append(time.perf_counter() - t0)
    tps = {name: BATCH * SEQ / statistics.median(t) for name, t in times.items()}
    out = {
        "bench": "trainer_cross_slot",
        "model": model_name,
        "slots": BATCH,
        "seq": SEQ,
        "rank": RANK,
        "steps": steps,
        "single_slot_tokens_per_s": round(tps["single"], 1),
        "cross_slot_tokens_per_s": round(tps["cross"], 1),
        "ratio": round(tps["cross"] / tps["single"], 3),
        "target_ratio": 0.8,
    }
    if legacy:
        out |= {
            "legacy_single_slot_tokens_per_s": round(tps["legacy_single"], 1),
            "legacy_cross_slot_tokens_per_s": round(tps["legacy_cross"], 1),
            "legacy_ratio": round(tps["legacy_cross"] / tps["legacy_single"], 3),
            "cross_slot_speedup": round(tps["cross"] / tps["legacy_cross"], 3),
            "single_slot_speedup": round(tps["single"] / tps["legacy_single"], 3),
        }
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--legacy", action="store_true", help="also time the previous path")
    args = parser.parse_args()
    print(json.dumps(main(args.steps, args.warmup, args.legacy)))
