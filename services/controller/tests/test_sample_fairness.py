"""One tenant's sample flood cannot fail or starve another's: a real controller and a real
rollout whose queue holds 16 requests (issue 36 item 3). Before the fair queue every admitted
sample was its own task, so 2,000 of one tenant hit the rollout at once, past its bound, and
every tenant's samples behind them failed with RESOURCE_EXHAUSTED."""

from __future__ import annotations

import asyncio
from pathlib import Path

from lorafleet.testing import start_redis, wait_until_async
from lorafleet.v1 import common_pb2, controller_pb2

from .fleet import Client, controller_proc, rollout_proc, wait_done

K = controller_pb2
FLOOD, OTHERS = 2000, 5
# Flood samples that must wait in the controller when the other tenant arrives: far more than
# the dispatches a fair turn lets pass first (sample workers 32 + the rollout's queue 16, per
# sample of the other tenant); at most MAX_FLOOD are admitted to get there.
BACKLOG, MAX_FLOOD = 500, 4000


def sample(tenant: str, sampler_id: str, seq: int) -> K.SubmitSampleRequest:
    return K.SubmitSampleRequest(
        tenant=tenant,
        sampler_id=sampler_id,
        seq_id=seq,
        prompt_tokens=[5, 17, 33, 90 + seq % 7],
        params=common_pb2.SamplingParams(max_tokens=2, temperature=0.0, top_k=-1, top_p=1),
        num_samples=1,
    )


async def test_a_2000_sample_flood_fails_and_starves_no_other_tenant(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    redis = start_redis(tmp_path / "redis")
    controller = controller_proc(redis, tmp_path, LORAFLEET_CONTROLLER_SAMPLE_WORKERS="32")
    controller.launch()
    rollout = rollout_proc(
        tiny_model_dir,
        controller.port,
        tmp_path,
        "rollout-0",
        LORAFLEET_ROLLOUT_MAX_QUEUED_REQUESTS="16",
    )
    client = None
    try:
        rollout.launch()
        controller.wait()
        rollout.wait()
        client = Client(controller.port)

        async def sampleable() -> str:
            caps = await client("GetCapabilities", K.GetCapabilitiesRequest())
            return next((str(m.name) for m in caps.models if m.sampleable), "")  # type: ignore[attr-defined]

        base = await wait_until_async(sampleable, "the rollout registered")
        samplers = {}
        for tenant in ("flood", "other"):
            session = await client("CreateSession", K.CreateSessionRequest(tenant=tenant))
            made = await client(
                "CreateSampler",
                K.CreateSamplerRequest(
                    tenant=tenant,
                    session_id=session.session_id,  # type: ignore[attr-defined]
                    sampling_session_seq_id=0,
                    base_model=base,
                ),
            )
            samplers[tenant] = made.sampler.sampler_id  # type: ignore[attr-defined]

        async def state(op: object) -> int:
            resp = await client(
                "GetOperation",
                K.GetOperationRequest(tenant="flood", operation_id=op.operation_id),  # type: ignore[attr-defined]
            )
            return int(resp.operation.state)  # type: ignore[attr-defined]

        # The flood is admitted in batches until BACKLOG of it wait in the controller (a
        # loaded machine may sample as fast as it admits): then the other tenant arrives.
        flood: list[object] = []
        while len(flood) < FLOOD or await state(flood[-BACKLOG]) != K.OPERATION_STATE_QUEUED:
            assert len(flood) < MAX_FLOOD, "the rollout drained every batch as it came"
            start = len(flood)
            flood += await asyncio.gather(
                *(
                    client("SubmitSample", sample("flood", samplers["flood"], seq))
                    for seq in range(start, start + 100)
                )
            )
        others = [
            await client("SubmitSample", sample("other", samplers["other"], seq))
            for seq in range(OTHERS)
        ]
        done_others = [
            await wait_done(client, "other", s.operation_id)  # type: ignore[attr-defined]
            for s in others
        ]
        for op in done_others:
            assert op.state == K.OPERATION_STATE_SUCCEEDED, op.error  # type: ignore[attr-defined]
        # Fair turns: the other tenant's samples ran long before the backlog ahead of them
        # drained (in FIFO it would all have gone first).
        waiting = (K.OPERATION_STATE_QUEUED, K.OPERATION_STATE_CLAIMED)
        pending = sum([await state(s) in waiting for s in flood[-BACKLOG:]])
        assert pending > 0, "the backlog drained first: the other tenant waited behind it"
        # And the flood itself, past the rollout's queue bound, fails nothing: it waits.
        for s in flood:
            op = await wait_done(client, "flood", s.operation_id)  # type: ignore[attr-defined]
            assert op.state == K.OPERATION_STATE_SUCCEEDED, op.error  # type: ignore[attr-defined]
    finally:
        if client is not None:
            await client.close()
        rollout.stop()
        controller.stop()
        redis.stop()
