"""Putting a live adapter version on a rollout replica, and finding a registration's home
rollout: what both publishing and sampling use.

A version recorded live (store/adapters.py) has its files durable under the storage root
or on shared storage, so any replica can be given it again at any time. Publishing pushes a
new version to the registration's home rollout (the barrier, placement.py) and reconciles a
restarted or joining one; sampling puts a version on the replica it chose when that replica
answers that it does not hold it (a home moved, a hot adapter spread, a restart whose
reconcile has not finished or was lost with the controller that ran it), so a pinned sample
is served rather than failed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

from lorafleet.contract import AdapterId
from lorafleet.digests import FileDigest
from lorafleet.v1 import common_pb2
from lorafleet_controller.clients import Pool, sha256
from lorafleet_controller.placement import choose_home
from lorafleet_controller.store import Store
from lorafleet_controller.store.adapters import AdaptersRepo, LiveVersion
from lorafleet_controller.store.placement import HomesRepo
from lorafleet_controller.store.replicas import Replica


@dataclass(frozen=True)
class Payload:
    """A version's files as they travel to rollouts: the bytes (streamed push) or, on shared
    storage, references the rollouts read themselves."""

    files: dict[str, bytes] = field(default_factory=dict)
    refs: dict[str, common_pb2.BlobRef] = field(default_factory=dict)

    @property
    def size_bytes(self) -> int:
        if self.refs:
            return sum(r.size_bytes for r in self.refs.values())
        return sum(map(len, self.files.values()))

    def digests(self) -> dict[str, FileDigest]:
        """File name -> SHA-256 and size: what a download of the version checks it against."""
        if self.refs:
            return {n: FileDigest(r.sha256, r.size_bytes) for n, r in self.refs.items()}
        return {Path(n).name: FileDigest(sha256(d), len(d)) for n, d in self.files.items()}


async def payload_of(live: LiveVersion) -> Payload:
    """A live version's files by reference (shared storage) or by content."""
    if live.refs:
        return Payload(refs=live.refs)
    return Payload(files=await asyncio.to_thread(_read_folder, Path(live.folder)))


def _read_folder(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


class Pusher:
    """Loads versions onto rollout replicas (LoadAdapter, or its by-reference form)."""

    def __init__(self, repo: AdaptersRepo, pool: Pool) -> None:
        self.repo = repo
        self.pool = pool

    async def load(
        self, address: str, live: LiveVersion, payload: Payload, *, retry: bool = True
    ) -> None:
        """`retry=False`: one attempt, for a caller that re-reads where the replica is."""
        client = self.pool.rollout(address)
        ref, lora, tenant = live.ref, live.lora, live.tenant
        if payload.refs:
            await client.load_shared_adapter(ref, lora, payload.refs, tenant=tenant, retry=retry)
        else:
            await client.load_adapter(ref, lora, payload.files, tenant=tenant, retry=retry)

    async def restore(self, address: str, ref: common_pb2.AdapterRef) -> bool:
        """Push `ref` to the replica at `address` if it is a version recorded live; False
        when it is not (never published, or its run retired): nothing to restore."""
        live = await self.repo.live(str(AdapterId(ref.registration_id, ref.version)))
        if live is None:
            return False
        await self.load(address, live, await payload_of(live))
        return True


class Homes:
    """A registration's home rollout as publishing and sampling both read it."""

    def __init__(self, store: Store) -> None:
        self.repo = HomesRepo(store)

    async def home(self, rid: str, base_model: str, rollouts: list[Replica]) -> Replica:
        """`rid`'s home among the healthy `rollouts`, placed (again) when it has none there:
        never placed, or its home is gone or unhealthy."""
        current = await self.repo.get(base_model, rid)
        for rep in rollouts:
            if rep.replica_id == current:
                return rep
        chosen = choose_home(rid, rollouts, await self.repo.all(base_model))
        await self.repo.set(base_model, {rid: chosen.replica_id})
        return chosen
