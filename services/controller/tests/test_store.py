"""The store layer: one definition of keys, states and scripts, and fencing by epoch."""

from __future__ import annotations

import ast
import re
from importlib import resources
from pathlib import Path

import pytest

from lorafleet import errors
from lorafleet.testing import RedisServer
from lorafleet.v1 import controller_pb2
from lorafleet_controller import ledger as L
from lorafleet_controller.store import Keys, OpState, RegState, StaleEpoch, Store, connect
from lorafleet_controller.store.keys import KEY_FAMILIES, lua_prelude
from lorafleet_controller.store.scripts import SHARED_KEYS

from .conftest import Domain

SRC = Path(__file__).resolve().parents[1] / "src" / "lorafleet_controller"


def test_one_group_shares_the_fleet_hash_tag() -> None:
    """With G = 1 every key carries the fleet's tag (the layout before groups existed)."""
    keys = Keys("lf:", 1)
    assert keys.reg("s:train:0") == "{lf}:reg:s:train:0"
    assert keys.op("s:train:0#3") == "{lf}:op:s:train:0#3"
    assert keys.group(0).ready_data == "{lf}:ready:data"
    assert keys.group(0).group_epoch == keys.epoch == "{lf}:leader_epoch"
    prelude = lua_prelude(1)
    for family, (_, suffix) in KEY_FAMILIES.items():  # Lua builds the same names from one table
        head = suffix.split("{id}")[0]
        assert f"'{head}'" in prelude, family
    with pytest.raises(ValueError):
        Keys("bad{prefix}", 1)
    with pytest.raises(ValueError):
        Keys("lf:", 0)


def test_a_registrations_records_and_operations_share_its_groups_tag() -> None:
    keys = Keys("lf:", 8)
    groups = {keys.group_of(f"s:train:{i}") for i in range(64)}
    assert groups == set(range(8))  # the registrations spread over every group
    rid = "s:train:5"
    g = keys.group_of(rid)
    tag = "{lf|g" + str(g) + "}:"
    assert keys.reg(rid) == tag + "reg:" + rid
    assert keys.op(rid + "#12") == tag + "op:" + rid + "#12"
    assert keys.replay(rid) == tag + "replay:" + rid
    assert keys.group(g).ready_data == tag + "ready:data"
    assert keys.group_of_op("sampler#1#s3") == keys.group_of("sampler#1")  # the last '#'
    assert keys.regs == "{lf}:regs" and keys.slots("tr") == "{lf}:slots:tr"


async def test_a_script_refuses_a_record_of_another_group(redis_server: RedisServer) -> None:
    """On one redis-server (where slots are not enforced) as on a Cluster, a script touching
    a record outside its call's group fails, naming it; a call given a key of another group
    is refused before it is sent."""
    store = Store(connect(redis_server.url), "xg:", 4)
    rid = next(f"r{i}" for i in range(100) if store.keys.group_of(f"r{i}") != 0)
    with pytest.raises(Exception, match="CROSSGROUP"):
        await store.scripts.run("repush", [], rid, 1.0, group=0)
    with pytest.raises(ValueError, match="in group 0 was given"):
        await store.scripts.run("repush", [store.keys.reg(rid)], rid, 1.0, group=0)
    await store.scripts.run(
        "repush", [store.keys.reg(rid)], rid, 1.0, group=store.keys.group_of(rid)
    )
    await store.close()


async def test_a_fleet_keeps_the_group_count_it_started_with(redis_server: RedisServer) -> None:
    client = connect(redis_server.url)
    first = Store(client, "layout:", 4)
    await first.check_layout()
    await first.check_layout()  # the same count again: fine
    with pytest.raises(errors.FailedPrecondition, match="in 4 groups, not 8") as refused:
        await Store(client, "layout:", 8).check_layout()
    assert refused.value.field == "ledger_groups"
    await Store(client, "other:", 8).check_layout()  # another fleet (prefix) has its own
    await client.aclose()


def test_scripts_are_declared_and_states_come_from_the_proto() -> None:
    folder = resources.files("lorafleet_controller.store") / "lua"
    on_disk = {p.name.removesuffix(".lua") for p in folder.iterdir() if p.name.endswith(".lua")}
    assert on_disk - {"common"} == set(SHARED_KEYS)
    keys = Keys("t", 2)
    for name, shared in SHARED_KEYS.items():  # each script's `-- keys:` names real keys
        for family in shared:
            holder = keys.group(1) if KEY_FAMILIES[family][0] == "index" else keys
            assert isinstance(getattr(holder, family, None), str), (name, family)
    assert {s.value for s in OpState} == {
        v.number for v in controller_pb2.OperationState.DESCRIPTOR.values if v.number
    }
    assert RegState.BINDING.proto == controller_pb2.REGISTRATION_STATE_QUEUED


def test_no_redis_key_literal_outside_the_store() -> None:
    """Key names live in store/keys.py only: no module builds one from the prefix."""
    pattern = re.compile(r"""f["']\{self\.p\}|key_prefix\}|["'](reg|op|ckpt|sess|replica|slots):""")
    offenders = [
        f"{path.relative_to(SRC)}:{n}"
        for path in SRC.rglob("*.py")
        if "store" not in path.parts
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []


async def test_a_deposed_leader_cannot_write(domain: Domain) -> None:
    """Two controllers believe they lead; only the newest epoch's writes land."""
    rid = await domain.ready_registration()
    old = domain.store
    new = Store(domain.store.redis, domain.settings.key_prefix, domain.settings.ledger_groups)
    await new.take_epoch()
    newer = L.Ledger(new, domain.settings, domain.notifier, domain.clock)
    a = await domain.ledger.submit("t1", rid, 1, 2, b"a", "da")  # submits are not fenced
    with pytest.raises(StaleEpoch) as exc:
        await domain.ledger.claim(a.operation_id)
    assert isinstance(exc.value, errors.Unavailable) and exc.value.reason == "STALE_EPOCH"
    with pytest.raises(StaleEpoch):
        await domain.ledger.sweep()
    assert (await domain.ledger.get("t1", a.operation_id)).state == OpState.QUEUED
    claim = await newer.claim(a.operation_id)
    assert claim is not None
    with pytest.raises(StaleEpoch):  # the old leader cannot record an outcome either
        await domain.ledger.complete(a.operation_id, OpState.FAILED)
    assert await newer.complete(a.operation_id, OpState.SUCCEEDED, b"ok")
    old.drop_epoch()
    with pytest.raises(StaleEpoch):  # and a controller that stepped down writes nothing
        await domain.ledger.claim(a.operation_id)


# --- the README's claims about the store (issue 23: tested or removed) ---------------------
# Redis commands that write. Python may read anything; what it writes is checked below.
WRITES = frozenset(
    {
        "hset",
        "hsetnx",
        "hdel",
        "hincrby",
        "hincrbyfloat",
        "set",
        "setnx",
        "delete",
        "unlink",
        "zadd",
        "zrem",
        "zincrby",
        "sadd",
        "srem",
        "smove",
        "lpush",
        "rpush",
        "lpop",
        "rpop",
        "lrem",
        "lset",
        "ltrim",
        "incr",
        "incrby",
        "decr",
        "expire",
        "getdel",
        "rename",
    }
)
# Key families whose records are the ledger's and the registry's state: operations, their
# queues and counters, the registrations' indexes and queues, the slot tables (a slot's
# holder). Writing one outside a Lua script is a transition outside a script.
TRANSITIONS = frozenset(
    {
        "op",
        "ready_ctl",
        "ready_data",
        "claimed",
        "results",
        "depth",
        "pending",
        "unacked",
        "gaps",
        "retired",
        "open_samples",
        "tenant",
        "regs",
        "tenant_regs",
        "session_runs",
        "binding",
        "paging",
        "regq",
        "slots",
    }
)
# A registration's own record: these fields are its state, its holder and its ledger
# position; the others (why it failed or was corrupted) are annotations the scripts read.
REG_STATE_FIELDS = frozenset(
    {"state", "replica", "slot", "head", "max_seq", "pending", "dirty", "restore"}
)


def _families(node: ast.AST) -> set[str]:
    """The key families an expression names: `self.keys.op(...)`, `keys.slots(...)`, and
    recovery's `reg_key` (a registration's record)."""
    out = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute):
            owner = sub.value
            if isinstance(owner, ast.Attribute | ast.Name) and (
                getattr(owner, "attr", getattr(owner, "id", "")) == "keys"
            ):
                out.add(sub.attr)
            elif sub.attr == "reg_key":
                out.add("reg")
    return out


def _written_fields(call: ast.Call) -> set[str]:
    """The hash fields a write names: its second argument or its mapping's keys."""
    fields = set()
    if len(call.args) > 1 and isinstance(call.args[1], ast.Constant):
        fields.add(str(call.args[1].value))
    for kw in call.keywords:
        if kw.arg == "mapping" and isinstance(kw.value, ast.Dict):
            fields |= {str(k.value) for k in kw.value.keys if isinstance(k, ast.Constant)}
    return fields


def transitions_outside_scripts(source: str, where: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in WRITES or not node.args:
            continue
        families = _families(node.args[0])
        hit = families & TRANSITIONS
        if "reg" in families and _written_fields(node) & REG_STATE_FIELDS:
            hit.add("reg")
        if hit:
            found.append(f"{where}:{node.lineno}: {node.func.attr} on {sorted(hit)}")
    return found


def test_every_ledger_and_registry_transition_is_one_lua_script() -> None:
    """README: "Every ledger and registry transition (an operation's state, a slot's
    holder) is one Lua script". No Python module outside the store writes those keys."""
    paths = [p for p in SRC.rglob("*.py") if "store" not in p.relative_to(SRC).parts]
    assert len(paths) > 20
    found = [f for p in paths for f in transitions_outside_scripts(p.read_text(), p.name)]
    assert found == []
    # The scan sees the shapes it forbids (so the test above can fail).
    for line in (
        "await self.store.redis.hset(self.keys.op(opid), 'state', 3)",
        "pipe.hdel(self.keys.slots(replica), slot)",
        "await redis.hset(keys.reg(rid), mapping={'state': 'ready'})",
        "pipe.zadd(self.keys.regq(base), {rid: now})",
    ):
        assert transitions_outside_scripts(line, "probe"), line
    assert not transitions_outside_scripts("await r.hset(self.keys.reg(rid), 'failed', x)", "p")


def test_controller_py_only_wires() -> None:
    """README: controller.py wires the parts and the flows over them (`flows/`) together; it
    reads or writes no Redis key itself: every store access is the parts' (registry, ledger,
    ...). It may only check and close the connection it made."""
    tree = ast.parse((SRC / "controller.py").read_text())
    own = [
        f"controller.py:{node.lineno}: {ast.unparse(node.func)}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Attribute)
        and node.func.value.attr == "redis"
        and node.func.attr not in ("ping", "aclose")
    ]
    assert own == []


# Modules whose Redis access has not moved into store/ yet (issue 24 item 2): the list only
# shrinks. Each entry is the module's path under the package.
REDIS_OUTSIDE_THE_STORE_PENDING: set[str] = set()


def redis_access(source: str) -> list[str]:
    """What in `source` reaches Redis itself: importing redis-py, or touching a client
    (`.redis`, `.pipeline(`, `.register_script(`, `.execute_command(`, `.pubsub(`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            mods = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            mods += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found += [f"{node.lineno}: import {m}" for m in mods if m.split(".")[0] == "redis"]
        elif isinstance(node, ast.Attribute) and node.attr in (
            "redis",
            "pipeline",
            "register_script",
            "execute_command",
            "pubsub",
        ):
            found.append(f"{node.lineno}: .{node.attr}")
    return found


def test_no_redis_access_outside_the_store() -> None:
    """Issue 24: the store owns every Redis access; a module outside store/ calls its
    repositories and scripts and never holds a client."""
    offenders, clean = {}, set()
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("store/"):
            continue
        if found := redis_access(path.read_text()):
            offenders[rel] = found
        else:
            clean.add(rel)
    assert set(offenders) <= REDIS_OUTSIDE_THE_STORE_PENDING, {
        k: v for k, v in offenders.items() if k not in REDIS_OUTSIDE_THE_STORE_PENDING
    }
    # A module that moved leaves the list, so it cannot slip back.
    assert not (REDIS_OUTSIDE_THE_STORE_PENDING & clean), REDIS_OUTSIDE_THE_STORE_PENDING & clean
    for probe in (
        "import redis",
        "from redis.exceptions import RedisError",
        "await self.store.redis.hget(k, 'f')",
        "async with client.pipeline() as p: pass",
    ):
        assert redis_access(probe), probe
    assert not redis_access("await self.repo.get(key)")
