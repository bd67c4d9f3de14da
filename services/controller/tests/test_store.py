"""The store layer: one definition of keys, states and scripts, and fencing by epoch."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

import pytest

from lorafleet import errors
from lorafleet.v1 import controller_pb2
from lorafleet_controller import ledger as L
from lorafleet_controller.store import Keys, OpState, RegState, StaleEpoch, Store
from lorafleet_controller.store.keys import KEY_FAMILIES, lua_prelude
from lorafleet_controller.store.scripts import FLEET_KEYS

from .conftest import Domain

SRC = Path(__file__).resolve().parents[1] / "src" / "lorafleet_controller"


def test_every_key_shares_the_fleet_hash_tag() -> None:
    keys = Keys("lf:")
    assert keys.reg("s:train:0") == "{lf}:reg:s:train:0"
    assert keys.op("s:train:0#3") == "{lf}:op:s:train:0#3"
    assert keys.ready_data == "{lf}:ready:data"
    prelude = lua_prelude()
    for family, suffix in KEY_FAMILIES.items():  # Lua builds the same names from one table
        head = suffix.split("{id}")[0]
        assert f"'{head}'" in prelude, family
    with pytest.raises(ValueError):
        Keys("bad{prefix}")


def test_scripts_are_declared_and_states_come_from_the_proto() -> None:
    folder = resources.files("lorafleet_controller.store") / "lua"
    on_disk = {p.name.removesuffix(".lua") for p in folder.iterdir() if p.name.endswith(".lua")}
    assert on_disk - {"common"} == set(FLEET_KEYS)
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
    new = Store(domain.store.redis, domain.settings.key_prefix)
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
