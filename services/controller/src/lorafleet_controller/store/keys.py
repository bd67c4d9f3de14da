"""Every Redis key of the controller, named once, for Python and for the Lua scripts.

`KEY_FAMILIES` is the one definition: `Keys` formats it for Python, and `lua_prelude()` turns
it into the `keys` table every script starts with, so a key name can never differ between
the two sides.

Each family has a scope, which decides its hash tag (on Redis Cluster a hash tag pins keys
to one slot, and a Lua script may only touch keys of one slot):

- **group**: a registration's records (`op`, `reg`, `replay`) live in its group,
  `group_of(rid)` = the first 32 bits of SHA-1(rid) mod G, tagged `{<prefix>|g<k>}:`; a
  sampler's operations in its sampler id's group.
- **index**: each group has its own indexes and counters (ready queues, claimed, results,
  gaps, depth, usage, ...), named in the group of the call that touches them, so an
  operation's hot path (submit, claim, complete) stays on one slot, and the groups spread
  over the masters. Readers sum or merge them over the groups.
- **fleet**: everything else, tagged `{<prefix>}:` (replicas, slots, tenants, sessions,
  keys, checkpoints, jobs, and for now the tenant and fleet counters).

G (the setting `ledger_groups`) is fixed when a fleet first starts (`layout`, checked by
`Store.check_layout`). With G = 1 the group tag is the fleet tag: one slot holds the fleet,
as before groups existed. SHA-1 because Redis's Lua has it (`redis.sha1hex`): the scripts
compute an id's group themselves and refuse a key of another group than the call's
(CROSSGROUP), on one redis-server as on a Cluster, so a script can never silently span
groups. store/README.md gives the design and what is left before G > 1 runs on a Cluster.
"""

from __future__ import annotations

import hashlib
import re

# family → (scope, suffix); '{id}' is replaced by the id of the record (a registration, an
# operation, a tenant, ...). Families without '{id}' are one key per group or per fleet.
KEY_FAMILIES: dict[str, tuple[str, str]] = {
    # ledger
    # hash: one operation (id `<registration>#<seq>` or `<sampler>#s<seq>`)
    "op": ("group", "op:{id}"),
    "ready_ctl": ("index", "ready:ctl"),  # list: control operations ready to claim
    "ready_data": ("index", "ready:data"),  # list: forward/forward_backward ready to claim
    "claimed": ("index", "claimed"),  # zset: CLAIMED operation ids by claim time
    "results": ("index", "results"),  # zset: terminal, unacknowledged results by finish time
    "depth": ("index", "depth"),  # hash: operation state number → count
    # hash: a group's share of a tenant's limits: its use (pending, unacked and their bytes:
    # exact, summed over the groups for the tenant's) and what it holds leased (lp, lu, lb,
    # lr, tokens; quota.py)
    "share": ("index", "share:{id}"),
    "fleet_share": ("index", "share_fleet"),  # hash: the same for the fleet's limits
    # hash: the fleet's limits leased to the groups (quota.py), as `tenant` is a tenant's
    "fleet_quota": ("fleet", "quota"),
    "gaps": ("index", "gaps"),  # zset: registrations waiting for a missing seq_id, since when
    # zset: retired registrations by retirement time (record cleanup)
    "retired": ("index", "retired"),
    "open_samples": ("index", "open_samples"),  # set: sample operations not finished yet
    "done": ("fleet", "done"),  # pub/sub channel: ids of operations that just finished
    "epoch": ("fleet", "leader_epoch"),  # counter: the dispatching controller's fencing token
    "group_epoch": ("index", "leader_epoch"),  # a group's copy of `epoch` (the one with G = 1)
    "layout": ("fleet", "groups"),  # string: the fleet's group count G, fixed at first start
    # hash: a tenant's limits leased to the groups and its admission bucket (quota.py)
    "tenant": ("fleet", "tenant:{id}"),
    # registry
    "reg": ("group", "reg:{id}"),  # hash: one registration
    "regs": ("fleet", "regs"),  # set: every registration id
    "tenant_regs": ("fleet", "regs:{id}"),  # zset: a tenant's registrations by creation time
    "session_runs": ("fleet", "session_runs:{id}"),  # set: a session's registrations
    "tenant_live": ("fleet", "live_regs:{id}"),  # set: a tenant's registrations not retired
    # zset: registrations retired (their fleet step done) by retirement time, until their
    # records are forgotten (registry.expire_retired)
    "runs_retired": ("fleet", "runs_retired"),
    # hash: registration id → its reservation (tenant, session, time) until its record exists
    "reserving": ("fleet", "reserving"),
    # set: registrations placed but not yet confirmed by the trainer
    "binding": ("index", "binding"),
    "paging": ("index", "paging"),  # set: registrations with a page-out in progress (paging.py)
    "regq": ("fleet", "regq:{id}"),  # zset: registrations of a base model waiting for a slot
    # hash: a registration's replay log and last snapshot (recovery)
    "replay": ("group", "replay:{id}"),
    "replica": ("fleet", "replica:{id}"),  # hash: one trainer or rollout replica
    "replicas": ("fleet", "replicas"),  # set: every replica id
    "trainers": ("fleet", "trainers:{id}"),  # set: trainer replicas of a base model
    "rollouts": ("fleet", "rollouts:{id}"),  # set: rollout replicas of a base model
    "base_models": ("fleet", "base_models"),  # set: every base model a replica announced
    "slots": ("fleet", "slots:{id}"),  # hash: a trainer's slot number → registration id
    "slot_tenants": ("fleet", "slot_tenants:{id}"),  # hash: a trainer's slot number → its tenant
    # samplers and publishing
    "sampler": ("fleet", "sampler:{id}"),  # hash: one sampler
    "session_samplers": ("fleet", "session_samplers:{id}"),  # set: a session's samplers
    "adapter": ("fleet", "adapter:{id}"),  # hash: a published `<registration>@<version>`
    "live": ("fleet", "live:{id}"),  # zset: a base model's published adapter ids by version
    "homes": ("fleet", "homes:{id}"),  # hash: a base model's registration → its home rollout
    # set: what holds a published version (`s:<sampler id>`, `p:<sampler checkpoint path>`)
    "adapter_refs": ("fleet", "adapter_refs:{id}"),
    # hash: a registration → the newest version its own publishes made (its inflight
    # samplers follow it, so it is held)
    "run_newest": ("fleet", "run_newest"),
    # zset: published versions nothing holds any more, by when they were let go (version_gc.py)
    "versions_unheld": ("fleet", "versions_unheld"),
    # checkpoints
    "ckpt": ("fleet", "ckpt:{id}"),  # hash: one checkpoint by tinker path
    "tenant_ckpts": ("fleet", "ckpts:{id}"),  # zset: a tenant's checkpoints by creation time
    "run_ckpts": ("fleet", "run_ckpts:{id}"),  # zset: a registration's checkpoints by creation time
    "ckpt_ttl": ("fleet", "ckpt_ttl"),  # zset: checkpoints by expiry time
    # hash: a removed checkpoint's tinker path → the folder to reclaim from disk (reclaim.py)
    "reclaim": ("fleet", "reclaim"),
    # tenancy
    "api_key": ("fleet", "key:{id}"),  # hash: one API key (by key id)
    "key_hash": ("fleet", "apikey:{id}"),  # string: key id of a key's SHA-256
    "tenant_keys": ("fleet", "keys:{id}"),  # set: a tenant's key ids
    # set: sessions opened with a key (ended on revoke)
    "key_sessions": ("fleet", "key_sessions:{id}"),
    "session": ("fleet", "sess:{id}"),  # hash: one session
    "tenant_sessions": ("fleet", "sessions:{id}"),  # zset: a tenant's sessions by creation time
    "sessions_live": ("fleet", "sessions_live"),  # zset: unfinished sessions by last heartbeat
    "sessions_finished": ("fleet", "sessions_finished"),  # zset: finished sessions by finish time
    # managed training jobs (store/jobs.py)
    "job": ("fleet", "job:{id}"),  # hash: one job (params, data, state, cursor, progress, result)
    "tenant_jobs": ("fleet", "jobs:{id}"),  # zset: a tenant's jobs by creation time
    "run_jobs": ("fleet", "run_jobs:{id}"),  # list: a run's unfinished jobs, in the order they run
    "jobs_open": ("fleet", "jobs_open"),  # set: unfinished job ids (resumed by a new leader)
    "default_run": ("fleet", "default_run:{id}"),  # hash: a tenant's default run for jobs
    # usage accounting (usage.py)
    # hash: a tenant's usage counted in one group (tokens, steps, adapter-seconds); its totals
    # are the sum over the groups
    "usage": ("index", "usage:{id}"),
    "usage_tenants": ("index", "usage_tenants"),  # set: tenants with usage counted in a group
}

MAX_GROUPS = 16384  # Redis Cluster's hash slots: more groups could not spread further
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,64}$")


def tag_of(prefix: str) -> str:
    """`lf:` → `{lf}:`, the hash-tagged base of every key of the fleet."""
    if not _PREFIX_RE.match(prefix):
        raise ValueError(f"key prefix {prefix!r} must match {_PREFIX_RE.pattern}")
    return "{" + (prefix.rstrip(":") or prefix) + "}:"


def owner_of(opid: str) -> str:
    """The registration (or sampler) an operation id `<owner>#<seq>` belongs to."""
    owner, sep, _ = opid.rpartition("#")
    return owner if sep else opid


class GroupKeys:
    """The keys of one group's indexes and counters: `keys.group(g).claimed`, ..."""

    def __init__(self, base: str) -> None:
        self.base = base
        for family, (scope, suffix) in KEY_FAMILIES.items():
            if scope == "index" and "{id}" not in suffix:
                setattr(self, family, base + suffix)

    def usage(self, tenant: str) -> str:
        return self.base + KEY_FAMILIES["usage"][1].replace("{id}", tenant)

    def share(self, tenant: str) -> str:
        return self.base + KEY_FAMILIES["share"][1].replace("{id}", tenant)

    ready_ctl: str
    ready_data: str
    claimed: str
    results: str
    depth: str
    gaps: str
    retired: str
    open_samples: str
    binding: str
    paging: str
    group_epoch: str
    usage_tenants: str
    fleet_share: str


class Keys:
    """Key names of one fleet (one prefix, G groups): `keys.reg(rid)`, `keys.regs`,
    `keys.group(g).ready_data`, ..."""

    def __init__(self, prefix: str, groups: int) -> None:
        if not 1 <= groups <= MAX_GROUPS:
            raise ValueError(f"groups must be 1..{MAX_GROUPS}, not {groups}")
        self.base = tag_of(prefix)
        self.groups = groups
        self._groups = [GroupKeys(self._group_base(g)) for g in range(groups)]
        for family, (scope, suffix) in KEY_FAMILIES.items():
            if scope == "fleet" and "{id}" not in suffix:
                setattr(self, family, self.base + suffix)

    def _group_base(self, group: int) -> str:
        if self.groups == 1:
            return self.base
        return "{" + self.base[1:-2] + f"|g{group}" + "}:"

    def group_of(self, owner: str) -> int:
        """The group of a registration or sampler id (see the module's docstring)."""
        if self.groups == 1:
            return 0
        return int(hashlib.sha1(owner.encode()).hexdigest()[:8], 16) % self.groups

    def group_of_op(self, opid: str) -> int:
        return self.group_of(owner_of(opid))

    def group(self, group: int) -> GroupKeys:
        return self._groups[group]

    def all_groups(self) -> list[GroupKeys]:
        return self._groups

    def _key(self, family: str, ident: str) -> str:
        scope, suffix = KEY_FAMILIES[family]
        base = self.base if scope == "fleet" else self._group_base(self.group_of(ident))
        return base + suffix.replace("{id}", ident)

    # Fleet-wide keys (set in __init__), listed for type checkers and readers.
    fleet_quota: str
    done: str
    epoch: str
    layout: str
    regs: str
    reserving: str
    replicas: str
    base_models: str
    ckpt_ttl: str
    reclaim: str
    run_newest: str
    runs_retired: str
    versions_unheld: str
    sessions_live: str
    sessions_finished: str
    jobs_open: str

    def op(self, opid: str) -> str:
        suffix = KEY_FAMILIES["op"][1]
        return self._group_base(self.group_of_op(opid)) + suffix.replace("{id}", opid)

    def tenant(self, tenant: str) -> str:
        return self._key("tenant", tenant)

    def reg(self, rid: str) -> str:
        return self._key("reg", rid)

    def tenant_regs(self, tenant: str) -> str:
        return self._key("tenant_regs", tenant)

    def tenant_live(self, tenant: str) -> str:
        return self._key("tenant_live", tenant)

    def session_runs(self, session_id: str) -> str:
        return self._key("session_runs", session_id)

    def regq(self, base_model: str) -> str:
        return self._key("regq", base_model)

    def replay(self, rid: str) -> str:
        return self._key("replay", rid)

    def replica(self, replica_id: str) -> str:
        return self._key("replica", replica_id)

    def pool(self, kind: str, base_model: str) -> str:
        """The replicas of one kind ('trainer' or 'rollout') serving a base model."""
        return self._key(f"{kind}s", base_model)

    def slots(self, replica_id: str) -> str:
        return self._key("slots", replica_id)

    def slot_tenants(self, replica_id: str) -> str:
        return self._key("slot_tenants", replica_id)

    def sampler(self, sampler_id: str) -> str:
        return self._key("sampler", sampler_id)

    def session_samplers(self, session_id: str) -> str:
        return self._key("session_samplers", session_id)

    def adapter(self, adapter_id: str) -> str:
        return self._key("adapter", adapter_id)

    def adapter_refs(self, adapter_id: str) -> str:
        return self._key("adapter_refs", adapter_id)

    def live(self, base_model: str) -> str:
        return self._key("live", base_model)

    def homes(self, base_model: str) -> str:
        return self._key("homes", base_model)

    def ckpt(self, tinker_path: str) -> str:
        return self._key("ckpt", tinker_path)

    def tenant_ckpts(self, tenant: str) -> str:
        return self._key("tenant_ckpts", tenant)

    def run_ckpts(self, rid: str) -> str:
        return self._key("run_ckpts", rid)

    def api_key(self, key_id: str) -> str:
        return self._key("api_key", key_id)

    def key_hash(self, digest: str) -> str:
        return self._key("key_hash", digest)

    def tenant_keys(self, tenant: str) -> str:
        return self._key("tenant_keys", tenant)

    def key_sessions(self, key_id: str) -> str:
        return self._key("key_sessions", key_id)

    def session(self, session_id: str) -> str:
        return self._key("session", session_id)

    def tenant_sessions(self, tenant: str) -> str:
        return self._key("tenant_sessions", tenant)

    def job(self, job_id: str) -> str:
        return self._key("job", job_id)

    def tenant_jobs(self, tenant: str) -> str:
        return self._key("tenant_jobs", tenant)

    def run_jobs(self, rid: str) -> str:
        return self._key("run_jobs", rid)

    def default_run(self, tenant: str) -> str:
        return self._key("default_run", tenant)


def lua_prelude(groups: int) -> str:
    """The `keys` table of the scripts: `keys.reg(rid)`, `keys.regs`, `keys.ready_data` (the
    call's group), ... built from `KEY_FAMILIES` on the fleet base `P` (ARGV[1]) and the
    call's group `G` (ARGV[3], '' for a call in no group: its group keys are nil)."""
    lines = [
        f"local GROUPS = {groups}",
        "local G = ARGV[3]",
        "local GB = nil",
        "if G ~= '' then",
        "  GB = GROUPS == 1 and P or ('{' .. string.sub(P, 2, -3) .. '|g' .. G .. '}:')",
        "end",
        "local group_cache = {}",
        "local function group_of(owner)",
        "  if GROUPS == 1 then return '0' end",
        "  local g = group_cache[owner]",
        "  if not g then",
        "    g = tostring(tonumber(string.sub(redis.sha1hex(owner), 1, 8), 16) % GROUPS)",
        "    group_cache[owner] = g",
        "  end",
        "  return g",
        "end",
        "local function in_group(owner)",
        "  local g = group_of(owner)",
        "  if g ~= G then",
        "    error('CROSSGROUP ' .. owner .. ' is in group ' .. g .. ', this call in ' .. G)",
        "  end",
        "  return GB",
        "end",
        "local function owner_of(id) return string.match(id, '^(.*)#') or id end",
        "local keys = {}",
    ]
    for family, (scope, suffix) in KEY_FAMILIES.items():
        if "{id}" in suffix:
            head, tail = suffix.split("{id}")
            if scope == "fleet":
                base = "P"
            elif scope == "index":
                base = "GB"
            elif family == "op":
                base = "in_group(owner_of(id))"
            else:
                base = "in_group(id)"
            body = f"{base} .. '{head}' .. id" + (f" .. '{tail}'" if tail else "")
            lines.append(f"function keys.{family}(id) return {body} end")
        elif scope == "fleet":
            lines.append(f"keys.{family} = P .. '{suffix}'")
        else:
            lines.append(f"if GB then keys.{family} = GB .. '{suffix}' end")
    return "\n".join(lines) + "\n"
