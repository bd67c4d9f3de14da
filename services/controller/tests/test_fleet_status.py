"""The fleet status view (`lorafleet status`'s source) against real Redis: who holds a slot
and since when, and which runs are shown apart, each with its state as the store records it
(a state the view does not name, PAGED, shows as it is) and its reason."""

from __future__ import annotations

from lorafleet import contract, errors
from lorafleet.v1 import common_pb2, controller_pb2
from lorafleet_cli.status import run_reason, run_state
from lorafleet_controller import convert
from lorafleet_controller.clients import Pool
from lorafleet_controller.fleet import Fleet
from lorafleet_controller.registry import Replica
from lorafleet_controller.store import RegState

from .conftest import Domain

K = controller_pb2


async def _run(d: Domain, seq: int, base: str = "tiny") -> str:
    rec, _ = await d.registry.create(
        "t1", "s1", seq, base, common_pb2.LoraConfig(rank=4), {}, "adamw", False
    )
    return rec.registration_id


async def test_status_shows_slot_holders_and_the_runs_to_look_at(domain: Domain) -> None:
    bound = await domain.ready_registration(seq=0)
    await domain.registry.register_replica(
        Replica("trainer", "tr-small", "127.0.0.1:2", "small", 1, "inc", 0, True)
    )
    binding, queued = await _run(domain, 6, base="small"), await _run(domain, 1, base="small")
    assert (await domain.registry.place(binding)).code == "placed"  # not bound yet
    assert (await domain.registry.place(queued)).code == "queued"  # its one slot is taken
    finished, failed, corrupted, paged = [await _run(domain, seq) for seq in range(2, 6)]
    done = errors.FailedPrecondition("session finished", reason="SESSION_FINISHED")
    await domain.ledger.fence(finished, RegState.RETIRED, done)
    refusal = errors.InvalidArgument("no module zz_proj", field="lora_config.target_modules")
    await domain.client.hset(
        domain.store.keys.reg(failed), "failed", contract.run_failure_json(failed, refusal)
    )
    await domain.ledger.fence(failed, RegState.RETIRED, refusal)
    await domain.client.hset(domain.store.keys.reg(corrupted), "corrupted", "snapshot 3 is gone")
    await domain.ledger.fence(corrupted, RegState.RETIRED, done)
    await domain.client.hset(domain.store.keys.reg(paged), "state", RegState.PAGED.value)

    pool = Pool(1.0, 1.0)  # no rollout: nothing is dialled
    status = convert.fleet_status(await Fleet(domain.registry, domain.ledger, pool).status())
    slots = {rep.replica_id: list(rep.slots) for rep in status.replicas}
    (holder,) = slots["tr-tiny"]
    assert holder.registration_id == bound and holder.bound_at == domain.clock.now
    assert [(r.registration_id, r.bound_at) for r in slots["tr-small"]] == [(binding, 0)]
    assert [r.registration_id for r in status.queued_registrations] == [queued]
    shown = {r.registration_id: (run_state(r), run_reason(r)) for r in status.attention}
    assert status.attention_total == 3 and shown == {
        failed: ("RETIRED/failed", f"training run {failed} failed: no module zz_proj"),
        corrupted: ("RETIRED/corrupted", "snapshot 3 is gone"),
        paged: ("PAGED", ""),
    }
    assert next(r for r in status.attention if r.registration_id == paged).state == (
        K.REGISTRATION_STATE_PAGED
    )
