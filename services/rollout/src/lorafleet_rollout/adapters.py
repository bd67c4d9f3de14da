"""Adapter identity on a rollout replica: registration-scoped, version-pinned, refcounted.

Every adapter version lives in the engine under `<registration_id>@<version>`, and a request
names the registration and version it was issued for, never a slot. So a request for a
version that is not resident, or for a registration that has been retired (its trainer slot
perhaps already serving a new tenant), fails with NotFound naming it instead of silently
running on whatever weights are there (vllm-project/vllm#47724, design-lessons §4.3, §10.7).

Every version published here serves until the controller takes it away: a version nothing
holds any more (the controller's version collection) or a retired registration is
*retiring*: in-flight samples finish on it, new ones are refused, and it is dropped as soon
as its in-flight count drops to zero, never loaded again (the fence is exact). A newer
version does not retire an older one: a snapshot sampler or a sampler path keeps sampling
the weights it was made from. Publishing thus never pauses anyone.

The versions held are a cache over the checkpoint store (`AdapterRegistry`): many more are
held than the engine has loaded, and a sample loads what it needs.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lorafleet.digests import sha256_file
from lorafleet.errors import (
    Conflict,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from lorafleet_rollout.types import LoraSpec

#: How many retired registration ids are remembered, to refuse late requests by name.
RETIRED_MEMORY = 65536


def adapter_id(registration_id: str, version: int) -> str:
    return f"{registration_id}@{version}"


def check_ref(registration_id: str, version: int, field_prefix: str = "adapter") -> None:
    if not registration_id or "@" in registration_id or "/" in registration_id:
        raise InvalidArgument(
            f"{registration_id!r} is not a registration id",
            field=f"{field_prefix}.registration_id",
        )
    if version < 1:
        raise InvalidArgument(f"version {version} must be >= 1", field=f"{field_prefix}.version")


def folder_digests(folder: Path) -> dict[str, str]:
    """relative path -> SHA-256 of every file under `folder` (for folders not staged by upload)."""
    return {
        p.relative_to(folder).as_posix(): sha256_file(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def verify_digests(expected: dict[str, str], measured: dict[str, str]) -> None:
    """The staged files (`measured`, path -> SHA-256) are exactly those `expected` announces.

    `measured` comes from the one hashing pass made while the bytes were staged, so an upload
    is never read back from disk just to be hashed a second time.
    """
    if not expected:
        raise InvalidArgument("no file digests were sent", field="header.file_sha256")
    extra = measured.keys() - expected.keys()
    if extra:
        raise InvalidArgument(f"files without a digest: {sorted(extra)}", field="chunk.path")
    for name, want in sorted(expected.items()):
        got = measured.get(name)
        if got is None:
            raise InvalidArgument(
                f"{name} was announced but never sent", field="header.file_sha256"
            )
        if got != want.lower():
            raise InvalidArgument(
                f"{name}: SHA-256 {got} does not match the announced {want}",
                field=f"header.file_sha256[{name}]",
            )


@dataclass
class Resident:
    """A version this replica holds: its files always (`folder`, the cache's backing copy on
    this replica), its weights in the engine only while `loaded`."""

    registration_id: str
    version: int
    lora: LoraSpec
    digests: dict[str, str]
    folder: Path | None = None
    #: The registration's owner, for the fair share of the engine's slots ('' when unknown).
    tenant: str = ""
    #: Requests pinning it: running on it, or waiting for it to load.
    in_flight: int = 0
    retiring: bool = False
    loaded: bool = False
    #: The registry's use counter when a request last pinned it (least recently used first).
    last_used: int = 0

    @property
    def adapter_id(self) -> str:
        return adapter_id(self.registration_id, self.version)

    @property
    def rank(self) -> int:
        return self.lora.rank


@dataclass(frozen=True)
class LoadPlan:
    """What a publish will do, decided before anything changes."""

    already_loaded: bool


@dataclass
class AdapterRegistry:
    """The versions one replica holds, as a two-tier cache. Single-threaded (the service's
    event loop); what changes the engine is the caller's (`RolloutCore`).

    Every version published here stays on this replica's disk (up to `max_stored`) and is
    selectable; at most `max_loaded` are in the engine at once. A request for one that is not
    loaded waits for it to be loaded, evicting the least recently used loaded version that no
    request pins (of the tenant holding the most, `victim`): other tenants' publishes never
    make a sample fail, nor take a tenant's hot set. Past `max_stored`, idle
    versions leave the replica altogether (least recently used first); a request for one gets
    VERSION_NOT_RESIDENT, and the controller pushes it again from the checkpoint store.
    """

    max_loaded: int
    max_stored: int = 1024
    resident: dict[str, Resident] = field(default_factory=dict)
    _retired: collections.OrderedDict[str, None] = field(default_factory=collections.OrderedDict)
    _uses: int = 0

    # ------------------------------------------------------------- sampling side
    def acquire(self, registration_id: str, version: int) -> Resident | None:
        """Pin a version for one request (None = the base model); it may still need loading."""
        if not registration_id:
            return None
        if registration_id in self._retired:
            raise NotFound(
                f"registration {registration_id} was retired; its adapters no longer serve",
                field="adapter.registration_id",
                reason="RETIRED",
            )
        entry = self.resident.get(adapter_id(registration_id, version))
        if entry is None or entry.retiring:
            raise self.not_resident(registration_id, version)
        entry.in_flight += 1
        self._uses += 1
        entry.last_used = self._uses
        return entry

    def not_resident(self, registration_id: str, version: int) -> NotFound:
        """The refusal of a version this replica will not serve (superseded or not held)."""
        entry = self.resident.get(adapter_id(registration_id, version))
        live = sorted(
            r.version
            for r in self.resident.values()
            if r.registration_id == registration_id and not r.retiring
        )
        state = "was superseded" if entry is not None else "is not loaded on this replica"
        return NotFound(
            f"adapter {adapter_id(registration_id, version)} {state} "
            f"(serving versions: {live or 'none'})",
            field="adapter.version",
            reason="VERSION_NOT_RESIDENT",
        )

    @staticmethod
    def release(entry: Resident) -> bool:
        """Unpin; True when the version is retiring and now idle (the caller drops it)."""
        entry.in_flight -= 1
        return entry.retiring and entry.in_flight == 0

    # ------------------------------------------------------------- cache tiers
    def loaded_count(self) -> int:
        return sum(1 for r in self.resident.values() if r.loaded)

    def victim(
        self, tenant: str, rank: int = 0, rank_class: Callable[[int], int] | None = None
    ) -> Resident | None:
        """The loaded version to evict for room for one of `tenant`'s: a retiring one if any
        is idle; otherwise the least recently used idle one of the tenant that would hold the
        most loaded versions (counting the one to load for `tenant`). So the slots are shared
        fairly: a tenant cycling through a thousand adapters evicts its own, never a smaller
        tenant's hot set, while a lone tenant gets plain LRU over every slot.

        With `rank_class` (the engine's grouping of adapters by rank in memory), the oldest
        idle version of the incoming one's class (rank `rank`) is taken instead when it is in
        the least recently used third: the class's memory is reused rather than one class
        growing while another compacts (bench/rank_class_cache.py, Zipf over 1,000 on 64:
        a tenth of plain LRU's stack copies per load at the same hit rate; 4 % fewer hits
        when the hot set's ranks all change at once)."""
        idle = [r for r in self.resident.values() if r.loaded and r.in_flight == 0]
        retiring = [r for r in idle if r.retiring]
        if retiring or not idle:
            return min(retiring, key=lambda r: r.last_used, default=None)
        held = collections.Counter(r.tenant for r in self.resident.values() if r.loaded)
        held[tenant] += 1
        most = max(held[r.tenant] for r in idle)
        theirs = sorted((r for r in idle if held[r.tenant] == most), key=lambda r: r.last_used)
        if rank_class is not None:
            wanted = rank_class(rank)
            oldest = theirs[: max(1, len(theirs) // 3)]
            alike = next((r for r in oldest if rank_class(r.rank) == wanted), None)
            if alike is not None:
                return alike
        return theirs[0]

    def over_stored(self) -> list[Resident]:
        """Idle versions to drop from this replica to get back within `max_stored`, least
        recently used first (pinned ones stay; the bound is met once they are released)."""
        excess = len(self.resident) - self.max_stored
        if excess <= 0:
            return []
        idle = sorted(
            (r for r in self.resident.values() if r.in_flight == 0),
            key=lambda r: (not r.retiring, r.last_used),
        )
        return idle[:excess]

    # ------------------------------------------------------------- publishing side
    def plan_load(self, registration_id: str, version: int, digests: dict[str, str]) -> LoadPlan:
        """Decide a publish without changing anything; raise if it cannot happen."""
        if registration_id in self._retired:
            raise FailedPrecondition(
                f"registration {registration_id} was retired",
                field="header.adapter.registration_id",
                reason="RETIRED",
            )
        existing = self.resident.get(adapter_id(registration_id, version))
        if existing is not None and not existing.retiring:
            if existing.digests != digests:
                raise Conflict(
                    f"{existing.adapter_id} is already loaded with different files",
                    field="header.file_sha256",
                    reason="PAYLOAD_CONFLICT",
                )
            return LoadPlan(already_loaded=True)
        if existing is not None:
            raise FailedPrecondition(
                f"{existing.adapter_id} is retiring; publish a newer version",
                field="header.adapter.version",
            )
        return LoadPlan(already_loaded=False)

    def add(self, entry: Resident) -> None:
        self._uses += 1
        entry.last_used = self._uses
        self.resident[entry.adapter_id] = entry

    def remove(self, entry: Resident) -> bool:
        """Forget `entry`; False when it was already gone (or replaced)."""
        if self.resident.get(entry.adapter_id) is not entry:
            return False
        del self.resident[entry.adapter_id]
        return True

    def retire(self, engine_ids: tuple[str, ...]) -> list[Resident]:
        """Mark versions retiring; return those already idle (to drop now)."""
        idle = []
        for engine_id in engine_ids:
            entry = self.resident[engine_id]
            entry.retiring = True
            if entry.in_flight == 0:
                idle.append(entry)
        return idle

    def idle_retiring(self) -> list[Resident]:
        return [r for r in self.resident.values() if r.retiring and r.in_flight == 0]

    def retire_registration(self, registration_id: str) -> list[Resident]:
        """Fence a registration for good; return its idle versions (to drop now)."""
        self._retired[registration_id] = None
        while len(self._retired) > RETIRED_MEMORY:
            self._retired.popitem(last=False)
        ids = tuple(
            r.adapter_id for r in self.resident.values() if r.registration_id == registration_id
        )
        return self.retire(ids)

    def retire_version(self, registration_id: str, version: int) -> list[Resident]:
        engine_id = adapter_id(registration_id, version)
        if engine_id not in self.resident:
            return []
        return self.retire((engine_id,))
