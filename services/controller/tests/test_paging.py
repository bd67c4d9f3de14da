"""Paging (paging.py): a run paged out of its slot and back in is byte-identical to one that
never paged, more runs than slots all finish with the state each has alone, and a controller
SIGKILLed mid page-out loses nothing (real redis, controller and trainer processes)."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import torch
from safetensors.torch import load_file

from lorafleet import errors
from lorafleet.testing import start_redis, wait_until_async
from lorafleet.v1 import common_pb2, controller_pb2
from lorafleet_controller.store.keys import Keys
from lorafleet_trainer.checkpoint import ADAPTER_WEIGHTS, OPTIMIZER_FILE, TRAINER_STATE

from .fleet import (
    Client,
    Proc,
    controller_proc,
    fb_payload,
    optim_payload,
    trainer_proc,
    wait_done,
    wait_for_model,
)

K = controller_pb2
T = "tenant-p"
KEYS = Keys("lf:", 1)  # the controller's default prefix and groups
SLOTS = 2


def tokens(seed: int, step: int) -> list[int]:
    """Different data per run and step, so a step replayed, lost or swapped would show."""
    return [(7 * step + 11 * seed + 5 * i) % 250 + 1 for i in range(8)]


@pytest.fixture
def procs(
    tmp_path: Path, tiny_model_dir: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[Path, object, Proc, Proc]]:
    """Redis, a controller (settings from an indirect parameter) and a 2-slot trainer."""
    redis = start_redis(tmp_path / "redis")
    controller = controller_proc(redis, tmp_path)
    controller.env["LORAFLEET_CONTROLLER_PAGE_IDLE_SECONDS"] = "0"  # forced page-outs only
    for name, value in getattr(request, "param", {}).items():
        controller.env[f"LORAFLEET_CONTROLLER_{name}"] = value
    trainer = trainer_proc(tiny_model_dir, controller.port, tmp_path, "trainer-0", SLOTS)
    try:
        controller.launch()
        trainer.launch()
        controller.wait()
        trainer.wait()
        yield tmp_path, redis, controller, trainer
    finally:
        trainer.stop()
        controller.stop()
        redis.stop()


class Run:
    """One training run driven through the controller's gRPC API, as the SDK drives it."""

    def __init__(self, client: Client, rid: str, seed: int) -> None:
        self.client, self.rid, self.seed, self.seq = client, rid, seed, 0

    async def op(self, payload: controller_pb2.OperationPayload) -> object:
        self.seq += 1
        resp = await self.client(
            "SubmitOperation",
            K.SubmitOperationRequest(
                tenant=T,
                registration_id=self.rid,
                seq_id=self.seq,
                payload=payload.SerializeToString(deterministic=True),
            ),
        )
        op = await wait_done(self.client, T, resp.operation_id)  # type: ignore[attr-defined]
        assert op.state == K.OPERATION_STATE_SUCCEEDED, (self.rid, self.seq, op.error)  # type: ignore[attr-defined]
        return op

    async def steps(self, steps: range, pause: float = 0.0) -> None:
        for step in steps:
            await self.op(fb_payload(tokens(self.seed, step)))
            await self.op(optim_payload())
            await asyncio.sleep(pause)  # a client sampling between steps: idle

    async def state(self, root: Path) -> dict[str, object]:
        """Weights, Adam moments and step count, saved through the ledger (a paged run is
        paged in for it) and read from the trainer's storage folder."""
        name = f"check-{self.seq + 1}"
        await self.op(K.OperationPayload(save_state=K.SaveStatePayload(name=name)))
        folder = root / "trainer-states" / self.rid / name
        trainer_state = json.loads((folder / TRAINER_STATE).read_text())
        return {
            "weights": (folder / ADAPTER_WEIGHTS).read_bytes(),
            "moments": (folder / OPTIMIZER_FILE).read_bytes(),
            "optim_steps": trainer_state["optim_steps"],
            "tensors": {
                **load_file(folder / ADAPTER_WEIGHTS),
                **load_file(folder / OPTIMIZER_FILE),
            },
        }

    async def registration(self) -> object:
        req = K.GetRegistrationRequest(tenant=T, registration_id=self.rid)
        return (await self.client("GetRegistration", req)).registration  # type: ignore[attr-defined]

    async def delete(self) -> None:
        req = K.DeleteRegistrationRequest(tenant=T, registration_id=self.rid)
        await self.client("DeleteRegistration", req)

    async def page_out(self, force: bool = False) -> object:
        req = K.PageOutRegistrationRequest(registration_id=self.rid, force=force)
        return await self.client("PageOutRegistration", req, deadline=120)


async def start_runs(client: Client, seeds: list[int], first: int = 0) -> list[Run]:
    base = await wait_for_model(client)
    session = (await client("CreateSession", K.CreateSessionRequest(tenant=T))).session_id  # type: ignore[attr-defined]
    runs = []
    for i, seed in enumerate(seeds):
        resp = await client(
            "CreateRegistration",
            K.CreateRegistrationRequest(
                tenant=T,
                session_id=session,
                model_seq_id=first + i,
                base_model=base,
                lora_config=common_pb2.LoraConfig(
                    rank=4, seed=seed, dropout=0.1, train_attn=True, train_mlp=True
                ),
            ),
        )
        runs.append(Run(client, resp.registration.registration_id, seed))  # type: ignore[attr-defined]
    return runs


def same(a: dict[str, object], b: dict[str, object]) -> None:
    assert a["optim_steps"] == b["optim_steps"]
    assert a["weights"] == b["weights"]
    assert a["moments"] == b["moments"]


async def test_a_forced_page_out_and_in_is_byte_identical_to_never_paging(procs) -> None:
    root, _, controller, _ = procs
    client = Client(controller.port)
    try:
        reference, paged = await start_runs(client, [3, 3])
        await reference.steps(range(3))
        await paged.steps(range(3))
        out = await paged.page_out()
        assert out.state == K.REGISTRATION_STATE_PAGED and out.seconds > 0  # type: ignore[attr-defined]
        reg = await paged.registration()
        assert reg.state == K.REGISTRATION_STATE_PAGED and reg.slot == -1  # type: ignore[attr-defined]
        again = await paged.page_out()  # idempotent: nothing more to do
        assert again.state == K.REGISTRATION_STATE_PAGED and again.seconds == 0  # type: ignore[attr-defined]
        # Its next operation pages it in; its state is exactly the one it left with.
        same(await paged.state(root), await reference.state(root))
        await paged.page_out()
        await reference.steps(range(3, 6))
        await paged.steps(range(3, 6))  # paged in by its first forward_backward
        same(await paged.state(root), await reference.state(root))
        assert (await paged.registration()).state == K.REGISTRATION_STATE_READY  # type: ignore[attr-defined]
        log = controller.log.read_text()
        assert log.count(f"paged out {paged.rid}") == 2 and f"paged in {paged.rid}" in log

        # Un-stepped gradients cannot be saved: refused, or paged out for replay with force.
        await paged.op(fb_payload(tokens(paged.seed, 6)))
        await reference.op(fb_payload(tokens(reference.seed, 6)))
        with pytest.raises(Exception, match="un-stepped gradients"):
            await paged.page_out()
        assert (await paged.registration()).state == K.REGISTRATION_STATE_READY  # type: ignore[attr-defined]
        forced = await paged.page_out(force=True)
        assert forced.state == K.REGISTRATION_STATE_PAGED  # type: ignore[attr-defined]
        await paged.op(optim_payload())
        await reference.op(optim_payload())
        same(await paged.state(root), await reference.state(root))
    finally:
        await client.close()


RUNS, STEPS = 6, 3


@pytest.mark.parametrize("procs", [{"PAGE_IDLE_SECONDS": "0.3"}], indirect=True)
async def test_more_runs_than_slots_all_finish_each_as_it_would_alone(procs) -> None:
    root, redis_server, controller, _ = procs
    client = Client(controller.port)
    r = aioredis.from_url(redis_server.url)  # type: ignore[attr-defined]
    try:
        seeds = list(range(1, RUNS + 1))
        runs = await start_runs(client, seeds)
        # Every run steps, pausing between steps as a sampling client does: with 2 slots the
        # idle ones are paged out for the waiting ones, and back in on their next step.
        await asyncio.wait_for(
            asyncio.gather(*(run.steps(range(STEPS), pause=0.6) for run in runs)), 300
        )
        shared = [await run.state(root) for run in runs]
        log = controller.log.read_text()
        assert log.count("paged out") >= RUNS - SLOTS and "paged in" in log
        assert not await r.smembers(KEYS.group(0).paging)
        for run in runs:
            await run.delete()
        # The same seeds and data, each run alone on the trainer.
        for i, seed in enumerate(seeds):
            (alone,) = await start_runs(client, [seed], first=100 + i)
            await alone.steps(range(STEPS))
            expected = await alone.state(root)
            got = shared[i]
            assert got["optim_steps"] == expected["optim_steps"] == STEPS
            # A step that shared its pass with another run's rows may differ in the last bits
            # (recovery.py); every step applied once, none lost, none swapped, is far tighter.
            for key, tensor in expected["tensors"].items():  # type: ignore[attr-defined]
                torch.testing.assert_close(got["tensors"][key], tensor, rtol=1e-3, atol=1e-5)  # type: ignore[index]
            await alone.delete()
    finally:
        await r.aclose()
        await client.close()


@pytest.mark.parametrize("procs", [{"PAGE_IDLE_SECONDS": "0.3"}], indirect=True)
async def test_an_idle_run_with_un_stepped_gradients_yields_its_slot_and_replays_exactly(
    procs,
) -> None:
    """A client that ran forward_backward and went quiet does not hold its slot: the sweep
    pages it out for the waiting run (restored by replay, as the trainer cannot save pending
    gradients), and its optim_step later is exactly the one it would have taken bound."""
    root, _, controller, _ = procs
    client = Client(controller.port)
    try:
        quiet, reference = await start_runs(client, [5, 5])  # the 2 slots
        await quiet.op(fb_payload(tokens(5, 0)))
        await reference.steps(range(1))
        (waiting,) = await start_runs(client, [7], first=2)
        # The quiet run is the least recently active idle one: it is the one paged out.
        await asyncio.wait_for(waiting.steps(range(1)), 120)
        assert (await quiet.registration()).state == K.REGISTRATION_STATE_PAGED  # type: ignore[attr-defined]
        await quiet.op(optim_payload())  # paged in by replay of its forward_backward
        same(await quiet.state(root), await reference.state(root))
        assert f"paged out {quiet.rid} (idle)" in controller.log.read_text()
    finally:
        await client.close()


async def test_a_controller_sigkilled_mid_page_out_loses_nothing_and_applies_nothing_twice(
    procs,
) -> None:
    root, redis_server, controller, trainer = procs
    client = Client(controller.port)
    r = aioredis.from_url(redis_server.url)  # type: ignore[attr-defined]
    try:
        reference, paged = await start_runs(client, [5, 5])
        await reference.steps(range(2))
        await paged.steps(range(2))
        # The trainer stalls in the page-out's SaveState; the controller dies meanwhile.
        trainer.proc.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
        stalled = asyncio.ensure_future(paged.page_out())
        await wait_until_async(
            lambda: r.sismember(KEYS.group(0).paging, paged.rid), "the page-out began"
        )
        assert await r.hget(KEYS.reg(paged.rid), "state") == b"paging"
        # An operation submitted meanwhile waits (a paging run is claimed by nobody).
        paged.seq += 1
        queued = await client(
            "SubmitOperation",
            K.SubmitOperationRequest(
                tenant=T,
                registration_id=paged.rid,
                seq_id=paged.seq,
                payload=fb_payload(tokens(paged.seed, 2)).SerializeToString(deterministic=True),
            ),
        )
        controller.kill()
        trainer.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
        with pytest.raises(errors.LorafleetError):  # its controller died under it
            await stalled
        await client.close()
        controller.start()
        client = Client(controller.port)
        paged.client = reference.client = client
        # The new controller's sweep gives the interrupted page-out up: the run is READY again
        # with its state intact on the trainer, and the waiting operation runs once.
        op = await wait_done(client, T, queued.operation_id)  # type: ignore[attr-defined]
        assert op.state == K.OPERATION_STATE_SUCCEEDED  # type: ignore[attr-defined]
        assert not await r.smembers(KEYS.group(0).paging)
        assert "a page-out of" in controller.log.read_text()
        await paged.op(optim_payload())
        await reference.op(fb_payload(tokens(reference.seed, 2)))
        await reference.op(optim_payload())
        same(await paged.state(root), await reference.state(root))
        # And a page-out now completes, its run paged in exactly on its next step.
        assert (await paged.page_out()).state == K.REGISTRATION_STATE_PAGED  # type: ignore[attr-defined]
        await paged.steps(range(3, 5))
        await reference.steps(range(3, 5))
        same(await paged.state(root), await reference.state(root))
    finally:
        await r.aclose()
        await client.close()
