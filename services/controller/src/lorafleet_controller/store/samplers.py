"""Samplers and their sample operations in Redis.

A sampler is one hash, listed under its session; recording it (`record_sampler`) is
idempotent on its id. A sample operation is admitted by `submit_sample`, which checks the
tenant's and the fleet's limits and writes the operation in one script. Neither is fenced:
any replica serves SubmitSample and creates samplers, and samples run on the controller that
admitted them (not seq-ordered, so no leader is needed).
"""

from __future__ import annotations

from dataclasses import dataclass

from lorafleet.contract import AdapterId
from lorafleet.v1 import common_pb2
from lorafleet_controller.store import OpState, Store, named, text
from lorafleet_controller.store.quota import ADMIT_TRIES, Limits, Quota, lease_needs


@dataclass(frozen=True)
class SamplerRecord:
    sampler_id: str
    tenant: str
    base_model: str
    model_path: str
    ref: common_pb2.AdapterRef
    inflight: bool


def pinned(rec: SamplerRecord) -> str:
    """The published version a sampler holds (version_gc.py): its own, unless it is on the
    base model or inflight (an inflight sampler follows its run's newest version, which the
    run holds)."""
    if rec.inflight or not rec.ref.registration_id:
        return ""
    return str(AdapterId(rec.ref.registration_id, rec.ref.version))


@dataclass(frozen=True)
class SampleAdmission:
    """`code`: created | duplicate | conflict | not_found | backpressure (`scope` says which
    limit); `state` is the operation's for created and duplicate."""

    code: str
    state: OpState | None
    scope: str


class SamplersRepo:
    """Every Redis access of samplers and sample operations."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.keys = store.keys
        self.quota = Quota(store)

    async def record(self, rec: SamplerRecord, session_id: str) -> str:
        """Record the sampler unless it exists (an existing one is kept as it is): created |
        exists | gone (the version it would pin was collected meanwhile)."""
        own = [self.keys.sampler(rec.sampler_id), self.keys.session_samplers(session_id)]
        out = await self.store.scripts.run(
            "record_sampler",
            own,
            rec.sampler_id,
            session_id,
            rec.tenant,
            pinned(rec),
            "base_model",
            rec.base_model,
            "model_path",
            rec.model_path,
            "rid",
            rec.ref.registration_id,
            "version",
            rec.ref.version,
            "inflight",
            "1" if rec.inflight else "0",
        )
        return text(named(out)["code"])

    async def load(self, sampler_id: str) -> SamplerRecord | None:
        raw = await self.store.redis.hgetall(self.keys.sampler(sampler_id))
        if not raw or b"base_model" not in raw:
            return None
        return SamplerRecord(
            sampler_id=sampler_id,
            tenant=text(raw.get(b"tenant")),
            base_model=text(raw[b"base_model"]),
            model_path=text(raw.get(b"model_path")),
            ref=common_pb2.AdapterRef(
                registration_id=text(raw.get(b"rid")), version=int(raw.get(b"version", b"0"))
            ),
            inflight=raw.get(b"inflight") == b"1",
        )

    async def submit(
        self,
        opid: str,
        tenant: str,
        digest: str,
        body: bytes,
        now: float,
        rid: str,
        limits: Limits,
    ) -> SampleAdmission:
        """Admit the sample operation `opid` (idempotent on its id and payload digest), with
        the limits its group holds leased (store/quota.py)."""
        group = self.keys.group_of_op(opid)
        for _ in range(ADMIT_TRIES):
            out = named(
                await self.store.scripts.run(
                    "submit_sample",
                    [self.keys.op(opid)],
                    opid,
                    digest,
                    body,
                    now,
                    tenant,
                    rid,
                    group=group,
                )
            )
            if text(out["code"]) != "need_lease":
                break
            needs = lease_needs(out)
            refusal = await self.quota.provide(tenant, group, needs, limits, opid, now)
            if refusal is not None:
                return SampleAdmission("backpressure", None, refusal.scope)
        else:
            return SampleAdmission("backpressure", None, needs[0][0])
        state = out.get("state")
        return SampleAdmission(
            code=text(out["code"]),
            state=None if state is None else OpState(int(state)),
            scope=text(out.get("scope")),
        )

    async def open_samples(self) -> list[str]:
        """Sample operations not finished yet (re-run after a controller restart)."""
        ids: list[str] = []
        for group in self.keys.all_groups():
            ids += [text(opid) for opid in await self.store.redis.smembers(group.open_samples)]
        return ids
