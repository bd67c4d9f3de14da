"""Job records in real Redis (one server and a 3-master Cluster): durable fields, tenant
scoping, the run's FIFO queue, the open set a new leader resumes, versions that wake
long-polls, and default runs; the leader's writes are fenced, a request's are not."""

from __future__ import annotations

import asyncio

import pytest

from lorafleet.errors import NotFound
from lorafleet_controller.jobs.records import JobState, Records
from lorafleet_controller.jobs.runner import JobRunner
from lorafleet_controller.store import StaleEpoch, Store


async def make(records: Records, job_id: str, tenant: str = "t1", rid: str = "s:train:0"):
    return await records.create(
        job_id, tenant, "qa", rid, "tiny", {"rank": "8"}, {"pairs": [["q", "a"]]}, 40
    )


async def test_a_job_is_stored_whole_and_scoped_to_its_tenant(domain) -> None:
    records = Records(domain.store, domain.notifier)
    rec = await make(records, "job-1")
    assert (rec.state, rec.params, rec.data, rec.max_updates) == (
        JobState.QUEUED,
        {"rank": "8"},
        {"pairs": [["q", "a"]]},
        40,
    )
    assert rec.cursor is None and rec.live == [] and not rec.cancel_requested
    assert (await records.get("t1", "job-1")) == rec
    with pytest.raises(NotFound) as err:
        await records.get("t2", "job-1")
    assert err.value.field == "job_id"
    with pytest.raises(NotFound):
        await records.get_any("job-none")


async def test_runs_queue_jobs_in_order_and_finishing_takes_them_out(domain) -> None:
    records = Records(domain.store, domain.notifier)
    first, second = await make(records, "job-1"), await make(records, "job-2")
    await make(records, "job-3", rid="other:train:0")
    assert await records.run_queue("s:train:0") == ["job-1", "job-2"]
    assert await records.open_ids() == ["job-1", "job-2", "job-3"]
    await records.update("job-1", state=JobState.RUNNING.value, cursor={"seq": 3})
    await records.finish(first, JobState.SUCCEEDED, result={"pass_count": 2})
    done = await records.get("t1", "job-1")
    assert done.finished and done.result == {"pass_count": 2} and done.cursor == {"seq": 3}
    assert done.version > first.version and done.finished_at > 0
    # Its data was needed only to run it: a finished job keeps its result, not its data.
    assert first.data and done.data == {}
    assert not await domain.client.hexists(domain.store.keys.job("job-1"), "data")
    assert (await records.get("t1", "job-2")).data == second.data  # unfinished: kept
    assert await records.run_queue("s:train:0") == [second.job_id]
    assert await records.open_ids() == ["job-2", "job-3"]
    jobs, total = await records.list_jobs("t1", 10, 0)
    assert total == 3 and {j.job_id for j in jobs} == {"job-1", "job-2", "job-3"}


async def test_a_long_poll_wakes_on_the_next_version(domain) -> None:
    records = Records(domain.store, domain.notifier)
    rec = await make(records, "job-1")
    waiter = asyncio.create_task(records.wait("t1", "job-1", rec.version, 30))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    await records.update("job-1", live=[{"pass": 1, "update": 1, "loss": 2.0, "lr": 0.1}])
    woke = await asyncio.wait_for(waiter, 10)
    assert woke.version == rec.version + 1 and woke.live[0]["update"] == 1
    # An already newer version answers at once; a timeout answers the current record.
    assert (await records.wait("t1", "job-1", rec.version, 30)).version == woke.version
    assert (await records.wait("t1", "job-1", woke.version, 0.05)).version == woke.version


async def test_cancel_is_a_durable_request(domain) -> None:
    records = Records(domain.store, domain.notifier)
    await make(records, "job-1")
    assert not await records.cancel_requested("job-1")
    await records.request_cancel("job-1")
    assert await records.cancel_requested("job-1")
    assert (await records.get("t1", "job-1")).cancel_requested


async def test_default_runs_per_tenant(domain) -> None:
    records = Records(domain.store, domain.notifier)
    assert await records.default_run("t1") == {}
    await records.set_default_run("t1", rid="s:train:0", checkpoint="")
    await records.set_default_run("t1", checkpoint="tinker://s:train:0/weights/x")
    assert await records.default_run("t1") == {
        "rid": "s:train:0",
        "checkpoint": "tinker://s:train:0/weights/x",
    }
    assert await records.default_run("t2") == {}
    await records.clear_default_run("t1")
    assert await records.default_run("t1") == {}


async def test_a_deposed_leaders_job_writes_are_refused_and_change_nothing(domain) -> None:
    records = Records(domain.store, domain.notifier)
    rec = await make(records, "job-1")
    await records.set_default_run("t1", rid="s:train:0", checkpoint="")
    await Store(
        domain.client, domain.settings.key_prefix, domain.settings.ledger_groups
    ).take_epoch()  # a new leader
    with pytest.raises(StaleEpoch):
        await records.update("job-1", state=JobState.RUNNING.value, cursor={"seq": 3})
    with pytest.raises(StaleEpoch):
        await records.finish(rec, JobState.FAILED, error={"message": "x"})
    with pytest.raises(StaleEpoch):
        await records.set_default_checkpoint("t1", "s:train:0", "tinker://s:train:0/weights/x")
    assert await records.get("t1", "job-1") == rec
    assert await records.run_queue("s:train:0") == ["job-1"]
    assert await records.open_ids() == ["job-1"]
    assert await records.default_run("t1") == {"rid": "s:train:0", "checkpoint": ""}


async def test_requests_write_jobs_on_a_replica_that_does_not_lead(domain) -> None:
    standby = Records(
        Store(domain.client, domain.settings.key_prefix, domain.settings.ledger_groups),
        domain.notifier,
    )
    rec = await make(standby, "job-1")
    await standby.request_cancel("job-1")
    after = await standby.get("t1", "job-1")
    assert after.cancel_requested and after.version == rec.version + 1
    with pytest.raises(NotFound):
        await standby.request_cancel("job-none")
    assert await standby.open_ids() == ["job-1"]
    with pytest.raises(StaleEpoch):  # progress is the leader's
        await standby.update("job-1", live=[])


async def test_the_default_checkpoint_is_kept_only_while_its_run_is_the_default(domain) -> None:
    records = Records(domain.store, domain.notifier)
    await records.set_default_run("t1", rid="s:train:0", checkpoint="")
    await records.set_default_checkpoint("t1", "s:train:0", "tinker://s:train:0/weights/a")
    assert (await records.default_run("t1"))["checkpoint"] == "tinker://s:train:0/weights/a"
    await records.set_default_checkpoint("t1", "old:train:0", "tinker://old:train:0/weights/b")
    assert (await records.default_run("t1"))["checkpoint"] == "tinker://s:train:0/weights/a"
    await records.clear_default_run("t1")  # a reset while the job ended: it stays reset
    await records.set_default_checkpoint("t1", "s:train:0", "tinker://s:train:0/weights/c")
    assert await records.default_run("t1") == {}


async def test_a_write_naming_no_job_field_is_refused_before_redis(domain) -> None:
    records = Records(domain.store, domain.notifier)
    rec = await make(records, "job-1")
    with pytest.raises(ValueError, match="tenant"):
        await records.update("job-1", tenant="t2", live=[])
    assert await records.get("t1", "job-1") == rec


class _Host:
    """The parts a runner's worker reads before a job's first operation (all real)."""

    def __init__(self, domain) -> None:
        self.store, self.notifier, self.registry = domain.store, domain.notifier, domain.registry
        self.leading = True


async def test_a_deposed_runner_leaves_its_job_to_the_next_leader(domain) -> None:
    rid = await domain.ready_registration()
    runner = JobRunner(_Host(domain))
    rec = await make(runner.records, "job-1", rid=rid)
    await Store(
        domain.client, domain.settings.key_prefix, domain.settings.ledger_groups
    ).take_epoch()  # a new leader
    await asyncio.wait_for(runner._work(rid), 30)  # returns: neither started nor failed
    assert await runner.records.get("t1", "job-1") == rec
    assert await runner.records.run_queue(rid) == ["job-1"]
    assert await runner.records.open_ids() == ["job-1"]
