"""The tenant's and the fleet's limits, leased to the groups (store/README.md §2).

A registration's operations live in its group (keys.py), so admission (`submit.lua`,
`submit_sample.lua`) cannot read a tenant's or the fleet's whole count in its one script.
Instead each group counts its own share of the use exactly (`share:{tenant}`,
`share_fleet`: open operations and their payload bytes, unacknowledged results and their
bytes) and holds a lease of each limit (`lp`, `lu`, `lb`, `lr`) and of its tenant's
admission tokens; a new operation is admitted only while it fits the group's leases and the
group holds a token. The leases are taken from a coordinator (the tenant's hash, or `quota`
for the fleet), which never leases more than the limit in all, so the use summed over the
groups never passes it.

When a group runs short, `Quota.provide` leases it a chunk more, or what its operation needs
where that is more (a payload of more bytes than a chunk); admissions short in one group at
once share a grant, each asking for the lease it needs rather than a chunk more each. When
that is not left to lease, it first takes back what other groups hold and do not use
(revoke, shrink, settle: each step idempotent, and a crash between them only leaves a lease
counted as held, never one held twice), then tries once more; still nothing is a
backpressure refusal with the scope that ran short, as when one script held every count.
Tokens are leased in chunks from the tenant's bucket (tokens_take.lua), so a tenant's
admissions in any T seconds are at most burst + rate * T plus a chunk per group it submits
in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lorafleet_controller.store import Store, named, text

# Leased at a time of a count: a sixteenth of the limit, between 1 and CHUNK_MAX, so small
# limits stay exact and large ones cost a coordinator call every CHUNK_MAX admissions of a
# group. Of bytes: a sixteenth of the limit (a count's CHUNK_MAX would be a lease of 32
# bytes, a coordinator call per operation), or what the operation needs where that is more.
CHUNK_MAX = 32
BYTE_KINDS = frozenset({"b", "r"})


# Admission attempts, each after leasing what the group ran short of: more means other
# admissions took the new leases first each time, and the caller is refused (backpressure).
ADMIT_TRIES = 16


@dataclass(frozen=True)
class Limits:
    """The limits one admission is held to (settings.py names them)."""

    pending_per_tenant: int
    pending_global: int
    unacked_per_tenant: int
    unacked_global: int
    pending_bytes_per_tenant: int
    pending_bytes_global: int
    unacked_bytes_per_tenant: int
    unacked_bytes_global: int
    rate: float = 0.0  # the tenant's admission bucket: tokens per second (0 = no bucket)
    burst: int = 0


@dataclass(frozen=True)
class Scope:
    """A leased limit as its backpressure scope names it: the fleet's or the tenant's, the
    lease's letter (common.lua's LEASES) and the Limits field that sets it."""

    fleet: bool
    kind: str
    limit: str


SCOPES = {
    "tenant": Scope(False, "p", "pending_per_tenant"),
    "global": Scope(True, "p", "pending_global"),
    "tenant_results": Scope(False, "u", "unacked_per_tenant"),
    "results": Scope(True, "u", "unacked_global"),
    "tenant_bytes": Scope(False, "b", "pending_bytes_per_tenant"),
    "global_bytes": Scope(True, "b", "pending_bytes_global"),
    "tenant_result_bytes": Scope(False, "r", "unacked_bytes_per_tenant"),
    "result_bytes": Scope(True, "r", "unacked_bytes_global"),
}
KINDS = frozenset(scope.kind for scope in SCOPES.values())


@dataclass(frozen=True)
class Refusal:
    scope: str
    retry_after: float = 1.0


def lease_needs(out: Mapping[str, Any]) -> list[tuple[str, int]]:
    """A need_lease answer's scopes (submit.lua), each with the lease of it the group must
    hold (for `rate`, the tokens it must get): what `Quota.provide` takes."""
    return [(text(x), int(n)) for x, n in zip(out["need"], out["want"], strict=True)]


def chunk(limit: float, kind: str = "p") -> int:
    if kind in BYTE_KINDS:
        return max(1, int(limit) // 16)
    return max(1, min(CHUNK_MAX, int(limit) // 16))


class Quota:
    """Leases limits to a group when its admission answered need_lease."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.keys = store.keys

    async def provide(
        self,
        tenant: str,
        group: int,
        needs: Sequence[tuple[str, int]],
        limits: Limits,
        rid: str,
        now: float,
    ) -> Refusal | None:
        """Lease `group` what `needs` names: (backpressure scope, the lease of it the group
        must hold), as need_lease answered; the first that cannot be had is the refusal,
        else None (submit again)."""
        for name, want in needs:
            if name == "rate":
                refusal = await self._tokens(tenant, group, limits, rid, now, want)
                if refusal is not None:
                    return refusal
                continue
            scope = SCOPES[name]
            owner = "" if scope.fleet else tenant
            limit = getattr(limits, scope.limit)
            if not await self._lease(owner, group, scope.kind, limit, want):
                await self._take_back(owner, group)
                if not await self._lease(owner, group, scope.kind, limit, want):
                    return Refusal(name)
        return None

    async def _lease(self, owner: str, group: int, kind: str, limit: int, want: int) -> bool:
        out = named(
            await self.store.scripts.run(
                "lease_take",
                [self._coordinator(owner)],
                owner,
                group,
                kind,
                limit,
                chunk(limit, kind),
                want,
            )
        )
        if text(out["code"]) != "granted":
            return False
        await self.store.scripts.run(
            "lease_set",
            [self._share(owner, group)],
            owner,
            kind,
            out["lease"],
            out["ver"],
            group=group,
        )
        return True

    async def _take_back(self, owner: str, asking: int) -> None:
        """Every other group's unused leases of `owner` go back to its coordinator."""
        held = await self.store.redis.hgetall(self._coordinator(owner))
        groups = sorted(
            {
                int(text(k)[1:])
                for k, v in held.items()
                if text(k)[:1] in KINDS and text(k)[1:].isdigit() and int(v) > 0
            }
            - {asking}
        )
        for group in groups:
            ver = named(
                await self.store.scripts.run(
                    "lease_revoke", [self._coordinator(owner)], owner, group
                )
            )["ver"]
            kept = named(
                await self.store.scripts.run(
                    "lease_shrink", [self._share(owner, group)], owner, ver, group=group
                )
            )
            await self.store.scripts.run(
                "lease_settle",
                [self._coordinator(owner)],
                owner,
                group,
                kept["ver"],
                *(x for kind in sorted(KINDS) for x in (kind, kept[kind])),
            )

    async def _tokens(
        self, tenant: str, group: int, limits: Limits, rid: str, now: float, need: int
    ) -> Refusal | None:
        out = named(
            await self.store.scripts.run(
                "tokens_take",
                [self.keys.tenant(tenant)],
                tenant,
                group,
                limits.rate,
                limits.burst,
                chunk(limits.burst),
                now,
                rid,
                need,
            )
        )
        if text(out["code"]) != "granted":
            return Refusal("rate", float(text(out["retry_after"])))
        await self.store.scripts.run(
            "tokens_set", [self.keys.group(group).share(tenant)], tenant, out["total"], group=group
        )
        return None

    def _coordinator(self, owner: str) -> str:
        return self.keys.fleet_quota if owner == "" else self.keys.tenant(owner)

    def _share(self, owner: str, group: int) -> str:
        keys = self.keys.group(group)
        return keys.fleet_share if owner == "" else keys.share(owner)

    async def load(self, tenant: str) -> dict[str, int]:
        """The tenant's use summed over the groups ('' for the fleet's): pending, unacked
        and their bytes."""
        total = {"pending": 0, "unacked": 0, "pending_bytes": 0, "unacked_bytes": 0}
        for keys in self.keys.all_groups():
            share = keys.fleet_share if tenant == "" else keys.share(tenant)
            for name, value in zip(total, await self.store.redis.hmget(share, *total), strict=True):
                total[name] += int(value or 0)
        return total
