"""Published adapter versions in Redis: the version counter, and the live versions rollouts
are reconciled with.

A publish allocates its version once (`publish_version`: a re-dispatch of the same
operation gets the same number) and records the version live (`publish_live`: the
version's record and its base model's live index together, so a rollout reconciled after a
crash never finds an index entry without its files). Fencing: a publish dispatched by the
scheduler is the leader's (`fenced=True`: refused once a newer leader took over); a sampler
made from a checkpoint serves a request any replica takes, and is not fenced.
"""

from __future__ import annotations

from dataclasses import dataclass

from lorafleet.contract import AdapterId, SamplerId
from lorafleet.v1 import common_pb2, trainer_pb2
from lorafleet_controller.store import Store, blob, named, text


@dataclass(frozen=True)
class LiveVersion:
    """A version recorded live: its folder and, on shared storage, its files by reference
    (empty when the files travel by content, read from the folder)."""

    ref: common_pb2.AdapterRef
    base_model: str
    lora: common_pb2.LoraConfig
    folder: str
    refs: dict[str, common_pb2.BlobRef]
    #: Its run's tenant ('' for a version recorded before tenants were: shared fairly as one).
    tenant: str = ""


class AdaptersRepo:
    """Every Redis access of published adapter versions."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.keys = store.keys

    def _epoch(self, fenced: bool) -> int | None:
        return self.store.leader_epoch() if fenced else None

    async def allocate_version(self, rid: str, opid: str, *, fenced: bool) -> int:
        """The version `opid` makes live, allocated once (a re-dispatch gets the same one);
        `opid` '' allocates a fresh one."""
        own = [self.keys.reg(rid)] + ([self.keys.op(opid)] if opid else [])
        out = named(
            await self.store.scripts.run(
                "publish_version",
                own,
                rid,
                opid,
                epoch=self._epoch(fenced),
                group=self.keys.group_of(rid),
            )
        )
        return int(out["version"])

    async def record_live(
        self, live: LiveVersion, now: float, *, fenced: bool, sampler_id: str = ""
    ) -> None:
        """Without `sampler_id`: the run's own publish, which its inflight samplers follow
        from now on (the one before is let go). With it: that sampler's own version (a
        sampler made from a training checkpoint), held for it from this step on."""
        aid = str(AdapterId(live.ref.registration_id, live.ref.version))
        shared = trainer_pb2.WriteSharedAdapterResponse(files=live.refs).SerializeToString()
        await self.store.scripts.run(
            "publish_live",
            [self.keys.adapter(aid), self.keys.live(live.base_model)],
            aid,
            live.base_model,
            live.ref.registration_id,
            live.ref.version,
            live.folder,
            live.lora.SerializeToString(),
            shared,
            live.tenant,
            "0" if sampler_id else "1",
            now,
            sampler_id,
            SamplerId.parse(sampler_id, "sampler_id").session_id if sampler_id else "",
            epoch=self._epoch(fenced),
        )

    async def live(self, aid: str) -> LiveVersion | None:
        """The version `aid` (`<registration>@<version>`) as recorded live, if it is."""
        raw = await self.store.redis.hgetall(self.keys.adapter(aid))
        if not raw:
            return None
        refs = trainer_pb2.WriteSharedAdapterResponse.FromString(blob(raw.get(b"refs", b"")))
        return LiveVersion(
            ref=common_pb2.AdapterRef(
                registration_id=text(raw.get(b"rid")), version=int(raw[b"version"])
            ),
            base_model=text(raw.get(b"base_model")),
            lora=common_pb2.LoraConfig.FromString(blob(raw[b"lora"])),
            folder=text(raw[b"files_dir"]),
            refs=dict(refs.files),
            tenant=text(raw.get(b"tenant")),
        )

    async def live_ids(self, base_model: str) -> list[AdapterId]:
        """The live versions of a base model's registrations, newest first."""
        raw = await self.store.redis.zrevrange(self.keys.live(base_model), 0, -1)
        return [AdapterId.parse(text(a)) for a in raw]

    async def unlist(self, base_model: str, aids: list[AdapterId]) -> None:
        """Take versions out of the base model's live index (no longer pushed to rollouts)."""
        if aids:
            await self.store.redis.zrem(self.keys.live(base_model), *map(str, aids))

    async def unheld(self, cutoff: float, limit: int) -> list[str]:
        """Up to `limit` versions let go at or before `cutoff`, oldest first."""
        raw = await self.store.redis.zrangebyscore(
            self.keys.versions_unheld, "-inf", cutoff, start=0, num=limit
        )
        return [text(a) for a in raw]

    async def collect(self, aid: str, cutoff: float, reclaim: str) -> str:
        """Drop a version nothing holds and queue its folder (`reclaim`, an encoded entry):
        collected | held | waiting | gone (version_collect.lua)."""
        out = await self.store.scripts.run(
            "version_collect",
            [self.keys.adapter(aid), self.keys.adapter_refs(aid)],
            aid,
            cutoff,
            reclaim,
            epoch=self.store.leader_epoch(),
        )
        return text(named(out)["code"])
