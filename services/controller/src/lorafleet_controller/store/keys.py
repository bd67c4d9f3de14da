"""Every Redis key of the controller, named once, for Python and for the Lua scripts.

`KEY_FAMILIES` is the one definition: `Keys` formats it for Python, and `lua_prelude()` turns
it into the `keys` table every script starts with, so a key name can never differ between
the two sides.

Every key starts with the fleet's hash tag, `{<prefix>}:`. On Redis Cluster a hash tag pins
keys to one slot, and a Lua script may only touch keys of one slot. The controller's
transitions are cross-registration by nature and are kept atomic on purpose:

- admission (`submit`) checks the tenant's and the fleet's limits and pushes the ready queue
  in the same script that writes the operation, so a refused submission writes nothing and
  an admitted one is always dispatchable;
- claiming (`claim_many`) pops the shared ready queues and claims operations of many
  registrations at once, which is what lets one scheduler round trip feed a whole batch;
- placement (`place`, `release`, `replica_lost`) reads and writes the slot table of a
  trainer together with the registrations it holds, so a slot is never given twice;
- the sweeper's outcomes (`sweep`, `seal`) update the fleet's counters with the records.

Splitting those across slots would turn each into a multi-step protocol with repair after a
crash (an outbox per registration, re-derived indexes and approximate limits). So the whole
fleet shares one tag and one slot: on a Redis Cluster the controller's state lives on one
master (its replica takes over on failover), and several fleets (prefixes) spread over the
masters. Every script still declares the keys it names in KEYS (the routing key is first),
and every key it derives inside (the next operation of a registration) carries the same tag.
`store/README.md` designs the layout that replaces this one so that a fleet's ledger scales
over the masters (issue 24 item 4); until it lands, one fleet is one master.
"""

from __future__ import annotations

import re

# family → suffix; '{id}' is replaced by the id of the record (a registration, an operation,
# a tenant, ...). Families without '{id}' are single fleet-wide keys.
KEY_FAMILIES: dict[str, str] = {
    # ledger
    "op": "op:{id}",  # hash: one operation (id `<registration>#<seq>` or `<sampler>#s<seq>`)
    "ready_ctl": "ready:ctl",  # list: control operations ready to claim
    "ready_data": "ready:data",  # list: forward/forward_backward ready to claim
    "claimed": "claimed",  # zset: CLAIMED operation ids by claim time
    "results": "results",  # zset: terminal, unacknowledged results by finish time
    "depth": "depth",  # hash: operation state number → count
    "pending": "pending",  # counter: open operations of the fleet
    "unacked": "unacked",  # counter: terminal unacknowledged results of the fleet
    "gaps": "gaps",  # zset: registrations waiting for a missing seq_id, since when
    "retired": "retired",  # zset: retired registrations by retirement time (record cleanup)
    "open_samples": "open_samples",  # set: sample operations not finished yet
    "done": "done",  # pub/sub channel: ids of operations that just finished
    "epoch": "leader_epoch",  # counter: the dispatching controller's fencing token
    "tenant": "tenant:{id}",  # hash: per-tenant counters (pending, unacked, registrations)
    # and the admission bucket (bucket_tokens, bucket_at; see submit.lua)
    # registry
    "reg": "reg:{id}",  # hash: one registration
    "regs": "regs",  # set: every registration id
    "tenant_regs": "regs:{id}",  # zset: a tenant's registrations by creation time
    "session_runs": "session_runs:{id}",  # set: a session's registrations
    "binding": "binding",  # set: registrations placed but not yet confirmed by the trainer
    "paging": "paging",  # set: registrations with a page-out in progress (paging.py)
    "regq": "regq:{id}",  # zset: registrations of a base model waiting for a slot
    "replay": "replay:{id}",  # hash: a registration's replay log and last snapshot (recovery)
    "replica": "replica:{id}",  # hash: one trainer or rollout replica
    "replicas": "replicas",  # set: every replica id
    "trainers": "trainers:{id}",  # set: trainer replicas of a base model
    "rollouts": "rollouts:{id}",  # set: rollout replicas of a base model
    "base_models": "base_models",  # set: every base model a replica announced
    "slots": "slots:{id}",  # hash: a trainer's slot number → registration id
    # samplers and publishing
    "sampler": "sampler:{id}",  # hash: one sampler
    "session_samplers": "session_samplers:{id}",  # set: a session's samplers
    "adapter": "adapter:{id}",  # hash: a published `<registration>@<version>`
    "live": "live:{id}",  # zset: a base model's published adapter ids by version
    # checkpoints
    "ckpt": "ckpt:{id}",  # hash: one checkpoint by tinker path
    "tenant_ckpts": "ckpts:{id}",  # zset: a tenant's checkpoints by creation time
    "run_ckpts": "run_ckpts:{id}",  # zset: a registration's checkpoints by creation time
    "ckpt_ttl": "ckpt_ttl",  # zset: checkpoints by expiry time
    # tenancy
    "api_key": "key:{id}",  # hash: one API key (by key id)
    "key_hash": "apikey:{id}",  # string: key id of a key's SHA-256
    "tenant_keys": "keys:{id}",  # set: a tenant's key ids
    "key_sessions": "key_sessions:{id}",  # set: sessions opened with a key (ended on revoke)
    "session": "sess:{id}",  # hash: one session
    "tenant_sessions": "sessions:{id}",  # zset: a tenant's sessions by creation time
    "sessions_live": "sessions_live",  # zset: unfinished sessions by last heartbeat
    # managed training jobs (store/jobs.py)
    "job": "job:{id}",  # hash: one job (params, data, state, cursor, progress, result)
    "tenant_jobs": "jobs:{id}",  # zset: a tenant's jobs by creation time
    "run_jobs": "run_jobs:{id}",  # list: a run's unfinished jobs, in the order they run
    "jobs_open": "jobs_open",  # set: unfinished job ids (resumed by a new leader)
    "default_run": "default_run:{id}",  # hash: a tenant's default run for jobs
    # usage accounting (usage.py)
    "usage": "usage:{id}",  # hash: a tenant's usage totals (tokens, steps, adapter-seconds)
    "usage_tenants": "usage_tenants",  # set: tenants with any usage
}

_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,64}$")


def tag_of(prefix: str) -> str:
    """`lf:` → `{lf}:`, the hash-tagged base of every key of the fleet."""
    if not _PREFIX_RE.match(prefix):
        raise ValueError(f"key prefix {prefix!r} must match {_PREFIX_RE.pattern}")
    return "{" + (prefix.rstrip(":") or prefix) + "}:"


class Keys:
    """Key names of one fleet (one prefix): `keys.reg(rid)`, `keys.ready_data`, ..."""

    def __init__(self, prefix: str) -> None:
        self.base = tag_of(prefix)
        for family, suffix in KEY_FAMILIES.items():
            if "{id}" not in suffix:
                setattr(self, family, self.base + suffix)

    def _key(self, family: str, ident: str) -> str:
        return self.base + KEY_FAMILIES[family].replace("{id}", ident)

    # Fleet-wide keys (set in __init__), listed for type checkers and readers.
    ready_ctl: str
    ready_data: str
    claimed: str
    results: str
    depth: str
    pending: str
    unacked: str
    gaps: str
    retired: str
    open_samples: str
    done: str
    epoch: str
    regs: str
    binding: str
    paging: str
    replicas: str
    base_models: str
    ckpt_ttl: str
    sessions_live: str
    jobs_open: str
    usage_tenants: str

    def op(self, opid: str) -> str:
        return self._key("op", opid)

    def tenant(self, tenant: str) -> str:
        return self._key("tenant", tenant)

    def reg(self, rid: str) -> str:
        return self._key("reg", rid)

    def tenant_regs(self, tenant: str) -> str:
        return self._key("tenant_regs", tenant)

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

    def sampler(self, sampler_id: str) -> str:
        return self._key("sampler", sampler_id)

    def session_samplers(self, session_id: str) -> str:
        return self._key("session_samplers", session_id)

    def adapter(self, adapter_id: str) -> str:
        return self._key("adapter", adapter_id)

    def live(self, base_model: str) -> str:
        return self._key("live", base_model)

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

    def usage(self, tenant: str) -> str:
        return self._key("usage", tenant)


def lua_prelude() -> str:
    """The `keys` table of the scripts: `keys.ready_data`, `keys.reg(rid)`, ... built from
    `KEY_FAMILIES` on the fleet base `P` (ARGV[1])."""
    lines = ["local keys = {}"]
    for family, suffix in KEY_FAMILIES.items():
        if "{id}" in suffix:
            head, tail = suffix.split("{id}")
            body = f"P .. '{head}' .. id" + (f" .. '{tail}'" if tail else "")
            lines.append(f"function keys.{family}(id) return {body} end")
        else:
            lines.append(f"keys.{family} = P .. '{suffix}'")
    return "\n".join(lines) + "\n"
