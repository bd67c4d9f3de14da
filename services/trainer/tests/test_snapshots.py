"""Automatic slot snapshots: restoring the newest one and re-running the operations after it
gives exactly the uninterrupted state (the trainer's half of replay after a trainer loss)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorafleet.errors import AlreadyExists, FailedPrecondition
from lorafleet.testing import payload_bytes
from lorafleet.v1 import common_pb2, trainer_pb2
from lorafleet_trainer.domain import ForwardBackwardInput, ForwardBackwardItem
from lorafleet_trainer.servicer import TrainerServicer
from lorafleet_trainer.snapshots import KEEP, PREFIX, Snapshotter

from .test_state import HP, SPEC, batch, train

STEPS = 9


def _steps(servicer: TrainerServicer, slot: int, reg: str, steps: range) -> None:
    """test_state.train's steps, with optim_step through the servicer (the snapshot hook)."""
    for step in steps:
        for k in range(2):
            inp = ForwardBackwardInput(batch(10 * step + k), "cross_entropy")
            item = ForwardBackwardItem(f"fb{step}.{k}", slot, reg, inp)
            (out,) = servicer.engine.forward_backward([item])
            assert not isinstance(out, Exception)
        result, _ = servicer._optim_step(f"step{step}", slot, reg, HP)
        assert result.applied


def test_newest_snapshot_plus_later_ops_equals_uninterrupted(make_engine, h) -> None:
    engine = make_engine()
    snapshots = Snapshotter(engine, every_steps=2, every_seconds=0)
    servicer = TrainerServicer(engine, "trainer-0", snapshots)
    engine.bind(0, "reg", SPEC)
    _steps(servicer, 0, "reg", range(STEPS))
    snapshots.close()  # every capture is written
    op, ref = snapshots.latest(0, "reg")
    covered = int(op.removeprefix("step"))
    kept = sorted(p.name for p in (engine.storage_root / "reg").iterdir())
    assert all(name.startswith(PREFIX) for name in kept) and 1 <= len(kept) <= KEEP
    assert snapshots.latest(0, "other") is None  # only the slot's current registration

    restored = make_engine()
    restored.storage_root = engine.storage_root
    restored.bind(3, "reg", SPEC)
    restored.load_state("restore", 3, "reg", ref, True)
    assert restored.slots.bindings[3].optimizer.steps == covered + 1
    assert f"step{covered}" in restored.slots.bindings[3].ops  # applied ids travel along
    for step in range(covered + 1, STEPS):
        train(restored, 3, "reg", step)
    a, b = h.adapter_tensors(engine, 0), h.adapter_tensors(restored, 3)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_repeated_step_ids_and_disabled_snapshots_capture_nothing(make_engine) -> None:
    engine = make_engine()
    off = TrainerServicer(engine, "trainer-0", Snapshotter(engine, 0, 0))
    engine.bind(0, "reg", SPEC)
    _steps(off, 0, "reg", range(3))
    off.snapshots.close()
    assert off.snapshots.latest(0, "reg") is None
    assert not Path(engine.storage_root / "reg").exists()
    on = TrainerServicer(engine, "trainer-0", Snapshotter(engine, 1, 0))
    _, snap = on._optim_step("step2", 0, "reg", HP)  # a repeated id: its first result
    on.snapshots.close()
    assert snap is None and on.snapshots.latest(0, "reg") is None


async def test_a_request_for_another_trainer_process_changes_nothing(make_engine) -> None:
    """A call addressed to a previous incarnation (a retry that outlived its trainer) is
    refused by the restarted one, which may be rebuilding that very slot by replay."""
    engine = make_engine()
    servicer = TrainerServicer(engine, "trainer-0")
    engine.bind(0, "reg", SPEC)
    item = ForwardBackwardItem("fb", 0, "reg", ForwardBackwardInput(batch(1), "cross_entropy"))
    stale = "0" * 32
    calls = [
        (
            servicer.ForwardBackward,
            trainer_pb2.ForwardBackwardRequest(
                items=[
                    trainer_pb2.ForwardBackwardItem(
                        operation_id=item.operation_id,
                        slot=0,
                        registration_id="reg",
                        payload=payload_bytes(
                            common_pb2.ForwardBackwardInput(loss_fn="cross_entropy")
                        ),
                    )
                ],
                incarnation=stale,
            ),
        ),
        (
            servicer.OptimStep,
            trainer_pb2.OptimStepRequest(
                operation_id="step", slot=0, registration_id="reg", incarnation=stale
            ),
        ),
        (
            servicer.SaveState,
            trainer_pb2.SaveStateRequest(
                operation_id="save", slot=0, registration_id="reg", name="s", incarnation=stale
            ),
        ),
        (
            servicer.LoadState,
            trainer_pb2.LoadStateRequest(
                operation_id="load", slot=0, registration_id="reg", incarnation=stale
            ),
        ),
    ]
    for method, request in calls:
        with pytest.raises(FailedPrecondition) as refused:
            await method(request, None)
        assert refused.value.reason == "STALE_INCARNATION"
    binding = engine.slots.bindings[0]
    assert binding.ops.ids() == [] and not binding.optimizer.has_gradients()
    (out,) = engine.forward_backward([item])  # this process's own calls still work
    assert not isinstance(out, Exception)


def test_a_save_rerun_after_its_trainer_was_lost_answers_with_the_state_it_wrote(
    make_engine,
) -> None:
    """save_state in flight when its trainer died runs again on the trainer that rebuilt the
    run: the folder that save already wrote is its answer, not a taken name."""
    first = make_engine()
    first.bind(0, "reg", SPEC)
    train(first, 0, "reg", 0)
    saved = first.save_state("reg#3", 0, "reg", "s", True)
    again = make_engine()
    again.storage_root = first.storage_root
    again.bind(1, "reg", SPEC)
    assert again.save_state("reg#3", 1, "reg", "s", True) == saved
    with pytest.raises(AlreadyExists):  # another operation still finds the name taken
        again.save_state("reg#9", 1, "reg", "s", True)
