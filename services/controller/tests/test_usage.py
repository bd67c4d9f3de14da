"""Usage accounting against real Redis: counted once with the outcome, residency, storage."""

from __future__ import annotations

import pytest

from lorafleet.v1 import common_pb2, controller_pb2, rollout_pb2
from lorafleet_controller import ledger as L
from lorafleet_controller.catalog import TRAINING, Catalog
from lorafleet_controller.store import OpState, StaleEpoch, Store
from lorafleet_controller.usage import (
    Effects,
    Usage,
    forward_effects,
    optim_effects,
    sample_effects,
)

from .conftest import Domain

FB = controller_pb2.OPERATION_KIND_FORWARD_BACKWARD
FWD = controller_pb2.OPERATION_KIND_FORWARD


class Tick:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def _run(d: Domain, rid: str, seq: int, state: OpState, effects: Effects) -> bool:
    opid = L.operation_id(rid, seq)
    await d.ledger.submit("t1", rid, seq, FB, b"p%d" % seq, f"d{seq}")
    assert await d.ledger.claim(opid) is not None
    return await d.ledger.complete(opid, state, b"r", effects=effects)


async def test_usage_is_counted_once_with_the_outcome(domain: Domain) -> None:
    rid = await domain.ready_registration(tenant="t1")
    usage = Usage(domain.store, domain.registry)
    effects = forward_effects(FB, 5 + 7) + optim_effects(common_pb2.OptimStepOutput(applied=True))
    assert await _run(domain, rid, 1, OpState.SUCCEEDED, effects)
    # A repeated completion (a re-dispatch, or the sweeper) is not recorded, nor counted.
    assert not await domain.ledger.complete(
        L.operation_id(rid, 1), OpState.SUCCEEDED, b"r", effects=effects
    )
    (t1,) = await usage.totals("t1")
    assert (t1.tokens_trained, t1.optim_steps, t1.tokens_forward) == (12, 1, 0)
    # A vetoed step, a forward and a sample count as what they are.
    assert optim_effects(common_pb2.OptimStepOutput(applied=False)) == []
    assert forward_effects(FWD, 3) == [("usage", "tokens_forward", 3)]
    sample = common_pb2.SampleOutput()
    sample.sequences.add(tokens=[1, 2, 3])
    sample.sequences.add(tokens=[4])
    prompt = rollout_pb2.SampleRequest(prompt_tokens=[9, 9]).SerializeToString()
    assert sample_effects(prompt, sample) == [
        ("usage", "tokens_prompt", 2),
        ("usage", "tokens_sampled", 4),
    ]
    (t2,) = await usage.totals("t2")
    assert t2.tokens_trained == 0 and [u.tenant for u in await usage.totals()] == ["t1"]


async def test_adapter_seconds_and_stored_bytes(domain: Domain) -> None:
    rid = await domain.ready_registration(tenant="t1")
    clock = Tick()
    usage = Usage(domain.store, domain.registry, clock)
    await usage.tick()  # the first tick only starts the clock
    clock.now = 3.0
    await usage.tick()
    clock.now = 500.0  # a gap longer than MAX_TICK_SECONDS (no leader) is not billed
    await usage.tick()
    (t1,) = await usage.totals("t1")
    assert t1.adapter_seconds == 3.0
    catalog = Catalog(domain.store, domain.clock)
    await catalog.add(
        tinker_path=f"tinker://{rid}/weights/a",
        tenant="t1",
        type=TRAINING,
        base_model="tiny",
        lora=common_pb2.LoraConfig(rank=4),
        size_bytes=1234,
    )
    (t1,) = await usage.totals("t1")
    assert t1.stored_bytes == 1234


async def test_a_deposed_leader_bills_no_residency(domain: Domain) -> None:
    """Two controllers that both believe they lead would bill every slot-second twice; the
    deposed one's tick is refused and bills nothing, the new leader's counts."""
    await domain.ready_registration(tenant="t1")
    clock = Tick()
    old = Usage(domain.store, domain.registry, clock)
    await old.tick()
    new_store = Store(domain.client, domain.settings.key_prefix, domain.settings.ledger_groups)
    await new_store.take_epoch()
    new = Usage(new_store, domain.registry, clock)
    await new.tick()
    clock.now = 2.0
    with pytest.raises(StaleEpoch):
        await old.tick()
    await new.tick()
    (t1,) = await new.totals("t1")
    assert t1.adapter_seconds == 2.0
