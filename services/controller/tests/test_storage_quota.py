"""Per-tenant storage quota (storage_quota.py; issue 36 item 4): a real controller and trainer
whose tenants may store 1 byte of checkpoints, so the first save is admitted and every later
one refused with 400 STORAGE_QUOTA until a delete frees room; a refused save spends its
seq_id, so the run's next operation runs at once, and a retry of the admitted save finds it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lorafleet.testing import start_redis
from lorafleet.v1 import common_pb2, controller_pb2
from lorafleet_controller.storage_quota import STORAGE_QUOTA

from .fleet import (
    controller_proc,
    fb_payload,
    optim_payload,
    trainer_proc,
    wait_done,
)
from .test_integration import TOKENS, Fleet, Procs, T
from .test_integration import fleet as fleet  # on this module's procs

K = controller_pb2


@pytest.fixture(scope="module")
def procs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Procs]:
    root = tmp_path_factory.mktemp("quota")
    redis = start_redis(root / "redis")
    controller = controller_proc(redis, root, LORAFLEET_CONTROLLER_MAX_STORED_BYTES_PER_TENANT="1")
    trainer = trainer_proc(tiny_model_dir, controller.port, root, "trainer-0")
    try:
        controller.launch()
        trainer.launch()
        controller.wait()
        trainer.wait()
        yield Procs(root, redis, controller, trainer)
    finally:
        trainer.stop()
        controller.stop()
        redis.stop()


def save(name: str) -> controller_pb2.OperationPayload:
    return K.OperationPayload(save_state=K.SaveStatePayload(name=name))


async def test_saves_past_the_quota_are_refused_until_a_delete(fleet: Fleet) -> None:
    rid = await fleet.registration(await fleet.session())

    async def done(seq: int, payload: controller_pb2.OperationPayload) -> object:
        sub = await fleet.submit(rid, seq, payload)
        return await wait_done(fleet.client, T, sub.operation_id)  # type: ignore[attr-defined]

    first = await done(1, save("first"))
    assert first.state == K.OPERATION_STATE_SUCCEEDED, first.error  # type: ignore[attr-defined]
    refused = await done(2, save("second"))
    assert refused.state == K.OPERATION_STATE_FAILED  # type: ignore[attr-defined]
    error = refused.error  # type: ignore[attr-defined]
    assert (error.reason, error.field) == (STORAGE_QUOTA, "storage"), error
    assert error.category == common_pb2.ERROR_CATEGORY_USER, error
    # Nothing was written, and the run goes on: its next operation does not wait for seq 2.
    assert not list(fleet.root.rglob("second"))
    step = await done(3, fb_payload(TOKENS))
    assert step.state == K.OPERATION_STATE_SUCCEEDED, step.error  # type: ignore[attr-defined]
    retry = await fleet.submit(rid, 1, save("first"))  # admitted before the cap: found
    assert retry.duplicate  # type: ignore[attr-defined]

    path = f"tinker://{rid}/weights/first"
    await fleet.client("DeleteCheckpoint", K.DeleteCheckpointRequest(tenant=T, tinker_path=path))
    stepped = await done(4, optim_payload())
    assert stepped.state == K.OPERATION_STATE_SUCCEEDED, stepped.error  # type: ignore[attr-defined]
    again = await done(5, save("third"))
    assert again.state == K.OPERATION_STATE_SUCCEEDED, again.error  # type: ignore[attr-defined]
