"""Adapter identity on a rollout replica: registration-scoped, version-pinned, refcounted.

Every adapter version lives in the engine under `<registration_id>@<version>`, and a request
names the registration and version it was issued for, never a slot. So a request for a
version that is not resident, or for a registration that has been retired (its trainer slot
perhaps already serving a new tenant), fails with NotFound naming it instead of silently
running on whatever weights are there (vllm-project/vllm#47724, design-lessons §4.3, §10.7).

The newest `versions_per_registration` versions of each registration accept new requests;
an older one is *retiring*: in-flight samples finish on it, new ones are refused, and it is
unloaded as soon as its in-flight count drops to zero. Publishing thus never pauses anyone.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from pathlib import Path

from lorafleet.digests import sha256_file
from lorafleet.errors import (
    Conflict,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)

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
    registration_id: str
    version: int
    rank: int
    digests: dict[str, str]
    folder: Path | None = None
    in_flight: int = 0
    retiring: bool = False

    @property
    def adapter_id(self) -> str:
        return adapter_id(self.registration_id, self.version)


@dataclass(frozen=True)
class LoadPlan:
    """What a load will do, decided before anything changes."""

    already_loaded: bool
    #: Versions to mark retiring (outside the window once the new one is in).
    retire: tuple[str, ...] = ()


@dataclass
class AdapterRegistry:
    """Resident adapter versions of one replica. Single-threaded (the service's event loop)."""

    max_loaded: int
    versions_per_registration: int = 2
    resident: dict[str, Resident] = field(default_factory=dict)
    _retired: collections.OrderedDict[str, None] = field(default_factory=collections.OrderedDict)

    # ------------------------------------------------------------- sampling side
    def acquire(self, registration_id: str, version: int) -> str | None:
        """Pin a version for one request; returns its engine id (None = base model)."""
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
            live = sorted(
                r.version
                for r in self.resident.values()
                if r.registration_id == registration_id and not r.retiring
            )
            state = "was superseded" if entry is not None else "is not loaded on this replica"
            raise NotFound(
                f"adapter {adapter_id(registration_id, version)} {state} "
                f"(serving versions: {live or 'none'})",
                field="adapter.version",
                reason="VERSION_NOT_RESIDENT",
            )
        entry.in_flight += 1
        return entry.adapter_id

    def release(self, engine_id: str | None) -> bool:
        """Unpin; True when the version is retiring and now idle (the caller unloads it)."""
        if engine_id is None:
            return False
        entry = self.resident[engine_id]
        entry.in_flight -= 1
        return entry.retiring and entry.in_flight == 0

    # ------------------------------------------------------------- publishing side
    def plan_load(self, registration_id: str, version: int, digests: dict[str, str]) -> LoadPlan:
        """Decide a load without changing anything; raise if it cannot happen."""
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
        live = sorted(
            (
                r
                for r in self.resident.values()
                if r.registration_id == registration_id and not r.retiring
            ),
            key=lambda r: r.version,
            reverse=True,
        )
        window = sorted([version, *(r.version for r in live)], reverse=True)
        if version not in window[: self.versions_per_registration]:
            raise FailedPrecondition(
                f"version {version} is older than the {self.versions_per_registration} "
                f"resident versions {[r.version for r in live]}",
                field="header.adapter.version",
            )
        keep = set(window[: self.versions_per_registration])
        retire = tuple(r.adapter_id for r in live if r.version not in keep)
        freeable = sum(
            1
            for r in self.resident.values()
            if r.in_flight == 0 and (r.retiring or r.adapter_id in retire)
        )
        # At capacity, a registration's own idle older versions make room for its new one:
        # the window is "up to N", never a reason to refuse a publish.
        spare = [r for r in reversed(live) if r.adapter_id not in retire and r.in_flight == 0]
        while spare and len(self.resident) - freeable + 1 > self.max_loaded:
            retire = (*retire, spare.pop(0).adapter_id)
            freeable += 1
        if len(self.resident) - freeable + 1 > self.max_loaded:
            raise ResourceExhausted(
                f"{len(self.resident)} adapter versions are resident (limit "
                f"{self.max_loaded}) and none can be freed now",
                retry_after=1.0,
                field="header.adapter",
            )
        return LoadPlan(already_loaded=False, retire=retire)

    def retire(self, engine_ids: tuple[str, ...]) -> list[Resident]:
        """Mark versions retiring; return those already idle (to unload now)."""
        idle = []
        for engine_id in engine_ids:
            entry = self.resident[engine_id]
            entry.retiring = True
            if entry.in_flight == 0:
                idle.append(entry)
        return idle

    def idle_retiring(self) -> list[Resident]:
        return [r for r in self.resident.values() if r.retiring and r.in_flight == 0]

    def add(self, entry: Resident) -> None:
        self.resident[entry.adapter_id] = entry

    def remove(self, engine_id: str) -> Resident | None:
        return self.resident.pop(engine_id, None)

    def retire_registration(self, registration_id: str) -> list[Resident]:
        """Fence a registration for good; return its idle versions (to unload now)."""
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
