"""A fixed training scenario, run by test_group.py in one process and by a group of ranks.

As a script (one process per rank, launcher variables in the environment):
    python group_scenario.py MODEL_DIR STORAGE_DIR OUT_DIR [REFS]
rank 0 drives a GroupEngine through `run` (or, given REFS, a torch.save'd {slot: StateRef},
through `resume`) and writes its record to OUT_DIR/record.pt; every rank writes the share
of the base it holds and the datum tokens it computed to OUT_DIR/share-<rank>.json.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch
from prometheus_client import REGISTRY

from lorafleet.errors import LorafleetError
from lorafleet_trainer.domain import (
    AdamParams,
    Datum,
    ForwardBackwardInput,
    ForwardBackwardItem,
    LoraSpec,
)

SPECS = {
    0: LoraSpec(rank=4, alpha=8, seed=1),
    1: LoraSpec(rank=8, seed=2, dropout=0.1, target_modules=("q_proj", "v_proj", "o_proj")),
    2: LoraSpec(rank=4, seed=3),
    3: LoraSpec(rank=8, alpha=4, seed=4),
}
LOSSES = {
    0: "cross_entropy",
    1: "cross_entropy",
    2: "importance_sampling",
    3: "importance_sampling",
}
LENGTHS = {0: (9, 14), 1: (21, 6, 11), 2: (17,), 3: (8, 12, 5, 10)}  # unequal: a balanced split
TOKEN_MEAN = (1, 0)  # step 1's item of slot 0 normalises by its tokens (a jobs step)
HP = AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=1.0)
STEPS = 3


def batch_tokens() -> int:
    """Tokens in one step's batch (every step has the same lengths)."""
    return sum(sum(lengths) for lengths in LENGTHS.values())


def batch(step: int, vocab: int) -> list[ForwardBackwardItem]:
    gen = torch.Generator().manual_seed(100 + step)
    items = []
    for slot in SPECS:
        data = []
        for n in LENGTHS[slot]:
            tokens = torch.randint(0, vocab, (n,), generator=gen).tolist()
            inputs = {"target_tokens": torch.randint(0, vocab, (n,), generator=gen)}
            if LOSSES[slot] == "cross_entropy":
                inputs["weights"] = torch.rand(n, generator=gen)
            else:
                inputs["logprobs"] = -torch.rand(n, generator=gen) * 8
                inputs["advantages"] = torch.randn(n, generator=gen)
            data.append(Datum(tokens, inputs))
        group_tokens = sum(LENGTHS[slot]) if (step, slot) == TOKEN_MEAN else 0
        items.append(
            ForwardBackwardItem(
                f"fb{step}",
                slot,
                f"r{slot}",
                ForwardBackwardInput(data, LOSSES[slot], group_tokens=group_tokens),
            )
        )
    return items


def train(engine, first: int, last: int) -> dict:
    """Steps first..last-1 on bound slots: each step's logprobs and gradients, then state."""
    record: dict = {"logprobs": [], "grads": []}
    for step in range(first, last):
        outs = engine.forward_backward(batch(step, engine.vocab_size))
        record["logprobs"].append([lp for out in outs for lp in out.logprobs])
        grads = {}
        for slot in SPECS:
            b = engine.slots.bindings[slot]
            for name in b.targets:
                grads[f"{slot}.{name}.A"] = b.a[name].grad.clone()
                grads[f"{slot}.{name}.B"] = b.b[name].grad.clone()
        record["grads"].append(grads)
        for slot in SPECS:
            result = engine.optim_step(f"step{step}", slot, f"r{slot}", HP)
            assert result.applied
    record["state"] = state(engine)
    return record


def state(engine) -> dict:
    out = {}
    for slot in SPECS:
        b = engine.slots.bindings[slot]
        out[slot] = {
            "weights": [p.detach().clone() for p in b.optimizer.params],
            "moments": {i: (m.clone(), v.clone()) for i, (m, v) in b.optimizer.moments().items()},
            "steps": b.optimizer.steps,
        }
    return out


def veto(engine) -> dict:
    """One more step whose last slot-3 row has an infinite importance ratio (sampling
    logprobs of -1e30). In a group that row is rank 1's (rows go largest rank first, split by
    tokens), so the driver sees the non-finite gradient only through the all-reduce: slot 3's
    step is vetoed on every rank and nothing of it moves, while the other slots step."""
    items = batch(STEPS + 1, engine.vocab_size)  # (STEPS is the resumed step's)
    poisoned = items[3].input.data[-1].loss_fn_inputs
    poisoned["logprobs"] = torch.full_like(poisoned["logprobs"], -1e30)
    engine.forward_backward(items)
    before = state(engine)[3]
    applied = {
        slot: engine.optim_step(f"veto{slot}", slot, f"r{slot}", HP).applied for slot in SPECS
    }
    return {"applied": applied, "before": before, "state": state(engine)}


def run(engine) -> dict:
    """Bind; import where refused (slot 1 takes slot 0's export: another rank) and where
    accepted (slot 0 its own); train STEPS steps, then the vetoed step; save each slot as
    "after"."""
    for slot, spec in SPECS.items():
        engine.bind(slot, f"r{slot}", spec)
    with tempfile.TemporaryDirectory() as tmp:
        engine.export_adapter(0, "r0", Path(tmp))
        try:
            engine.import_adapter("import", 1, "r1", Path(tmp))
        except LorafleetError as exc:
            refused = exc.reason
        engine.import_adapter("import", 0, "r0", Path(tmp))
    record = train(engine, 0, STEPS)
    record["veto"] = veto(engine)
    record["refused_import"] = refused
    record["refs"] = {
        slot: engine.save_state("save", slot, f"r{slot}", "after", True) for slot in SPECS
    }
    return record


def resume(engine, refs: dict) -> dict:
    """Bind, load each slot's saved state (with moments), train step STEPS."""
    for slot, spec in SPECS.items():
        engine.bind(slot, f"r{slot}", spec)
        engine.load_state("load", slot, f"r{slot}", refs[slot], True)
    return train(engine, STEPS, STEPS + 1)


def main() -> None:
    from lorafleet_trainer.group import (
        GroupEngine,
        GroupEnv,
        load_group_engine,
        local_fraction,
        worker_loop,
    )

    model_dir, storage, out = (Path(a) for a in sys.argv[1:4])
    refs = torch.load(sys.argv[4], weights_only=False) if len(sys.argv) > 4 else None
    torch.set_num_threads(1)
    env = GroupEnv.from_environ()
    engine, group = load_group_engine(
        model_dir,
        env,
        device="cpu",
        dtype="float32",
        timeout=60.0,
        base_model="tiny",
        num_slots=len(SPECS),
        max_rank=8,
        storage_root=storage,
    )
    fraction = local_fraction(engine.model)
    if env.rank != 0:
        worker_loop(engine, group)
    else:
        driver = GroupEngine(engine, group, keepalive=2.0, on_lost=lambda exc: os._exit(3))
        torch.save(run(driver) if refs is None else resume(driver, refs), out / "record.pt")
        driver.close()
    # The datum tokens this rank's forwards computed (the service's own counter).
    forward = REGISTRY.get_sample_value("lorafleet_trainer_forward_tokens_total", {"kind": "datum"})
    share = {"rank": env.rank, "fraction": fraction, "forward_tokens": forward}
    (out / f"share-{env.rank}.json").write_text(json.dumps(share))
    group.close()
    # Exit as the service does (`__main__`, `serve_worker`): everything is written and the
    # group destroyed, so skip interpreter teardown, where gloo's threads can still drop
    # tensors that need the GIL and abort the process (seen once on a loaded CI machine:
    # rank 0 exited -6, "terminate called without an active exception", after rank 1 had
    # its stop, so after all of its work).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
