"""A job's result describes the adapter it leaves: after early stopping restored the best
pass's snapshot, `final_train_loss` (juno's finalTrainLoss) is that pass's train loss, not
the last pass's."""

from __future__ import annotations

from lorafleet_controller.jobs import loop, stopping
from lorafleet_controller.jobs.params import JobKind
from lorafleet_controller.jobs.units import Plan, Unit


def _cursor(best_path: str) -> loop.Cursor:
    cur = loop.Cursor(seq=9, passes=3, updates=6, initial_loss=3.0, train_loss=0.5)
    cur.stopper = stopping.Stopper(best=1.1, best_pass=1, bad_passes=2)
    cur.history = [
        {"pass": 1, "train_loss": 1.5, "validation_loss": 1.1},
        {"pass": 2, "train_loss": 0.9, "validation_loss": 1.4},
        {"pass": 3, "train_loss": 0.5, "validation_loss": 1.8},
    ]
    cur.stop_reason = stopping.PATIENCE
    cur.best_path = best_path
    return cur


PLAN = Plan(train=(Unit(0, ()),), validation=(Unit(1, ()),), group_count=2, unit_count=2)


def test_final_train_loss_is_the_restored_pass() -> None:
    out = loop.result(JobKind.QA, PLAN, _cursor("tinker://r:train:0/weights/best-1"), "p")
    assert out["restored_checkpoint"] == "tinker://r:train:0/weights/best-1"
    assert out["best_pass"] == 1 and out["final_train_loss"] == 1.5


def test_without_a_restore_it_is_the_last_pass() -> None:
    out = loop.result(JobKind.QA, PLAN, _cursor(""), "p")
    assert out["final_train_loss"] == 0.5
