"""Publish pacing: the CPU budget's arithmetic, and the engine holding a publish that
outruns it while it decodes (never while idle)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from rollout_helpers import make_adapter

from lorafleet_rollout.pacing import CpuBudget
from lorafleet_rollout.torch_engine import TorchEngine
from lorafleet_rollout.types import LoraSpec, SampleRequest, SamplingSpec


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_budget_charges_spending_refills_at_its_share_and_caps_at_burst() -> None:
    clock = Clock()
    budget = CpuBudget(0.1, 0.05, clock)
    assert budget.wait(7.0) == 0.0  # the first reading only sets the baseline
    assert budget.wait(7.04) == 0.0  # 0.04 s spent of a 0.05 s burst
    assert budget.wait(7.09) == pytest.approx(0.4)  # 0.04 s in debt, repaid at 0.1 s/s
    clock.now += 0.2
    assert budget.wait(7.09) == pytest.approx(0.2)  # 0.02 s repaid, 0.02 s to go
    clock.now += 10.0
    assert budget.wait(7.09) == 0.0 and budget.tokens == pytest.approx(0.05)  # capped
    assert budget.wait(7.5) == pytest.approx(3.6)  # one large publish: 0.36 s in debt
    budget.refill(7.5)  # nothing decodes: spending slows no one
    assert budget.tokens == pytest.approx(0.05) and budget.wait(7.5) == 0.0


def test_budget_refuses_nonsense_settings() -> None:
    for share, burst in ((0.0, 1.0), (1.5, 1.0), (0.1, 0.0)):
        with pytest.raises(ValueError):
            CpuBudget(share, burst)


async def test_a_publish_over_budget_waits_while_decoding_and_never_while_idle(
    model_dir: Path, tmp_path: Path
) -> None:
    engine = TorchEngine(model_dir, publish_cpu_share=1e-4, publish_cpu_burst=1e-6)
    await engine.start()
    folder = make_adapter(model_dir, tmp_path / "a", seed=1)
    spec = LoraSpec(4, 8)
    try:
        # Idle: publishes run at once, however far over budget (one costs milliseconds of
        # CPU, the budget repays 0.1 ms a second).
        for i in range(3):
            await asyncio.wait_for(engine.load_adapter(f"idle{i}@1", folder, spec), 60)
        long = SampleRequest(
            None, (5, 17, 33), SamplingSpec(max_tokens=400, temperature=0.0, disable_eos_stop=True)
        )
        sampling = asyncio.ensure_future(engine.sample(long))
        await asyncio.sleep(0.05)  # decoding has started
        assert engine._batch.seqs and not sampling.done()
        # Decoding: the bucket (burst 1 µs) holds at most one publish, so of two publishes
        # in a row at most one runs mid-sample; the other waits for decoding to end (its
        # debt would take ~10 s or more to repay). Unpaced, both take milliseconds.
        mid_sample = []
        for i in range(2):
            await asyncio.wait_for(engine.load_adapter(f"busy{i}@1", folder, spec), 120)
            mid_sample.append(not sampling.done())
        assert mid_sample.count(True) <= 1, "publishes over budget ran while decoding"
        assert len((await sampling).sequences[0].tokens) == 400
    finally:
        await engine.close()
