"""Import an HF PEFT LoRA adapter trained elsewhere as a tenant's saved training state.

The result is an ordinary `tinker://<run>/weights/<name>` checkpoint: the trainer itself
writes it (ImportAdapter into a bound slot, then SaveState), so resuming it with
`create_training_client_from_state` or serving it from a sampler takes the same paths as a
state saved by training.

Validate, then mutate. `parse_adapter` checks everything the folder alone can tell (files,
config fields we cannot honour, tensor names and shapes against the rank) and `Importer`
checks the rest against the fleet (a served base model, the trainers' maximum rank, target
modules the base model has) before it creates anything. Only what the trainer checks on the
weights themselves (a module's shape) can still fail after that; the import's temporary run
is then retired and no checkpoint is recorded.

The import runs in a session of its own, finished at the end: finishing it retires the run
and frees its slot (the saved state stays, as for any finished session).
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
from dataclasses import dataclass
from typing import Any, Protocol

from lorafleet import contract, errors, names
from lorafleet.v1 import common_pb2
from lorafleet_controller.catalog import TRAINING, Catalog
from lorafleet_controller.clients import Pool
from lorafleet_controller.flows.sessions import Sessions
from lorafleet_controller.registry import TRAINER, Placer, Registry, Replica, base_model_name
from lorafleet_controller.store import RegState
from lorafleet_controller.tenancy import Tenancy

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
SLOT_WAIT_SECONDS = 120.0  # how long an import waits for a free trainer slot
# PEFT LoraConfig fields that change what the weights mean; any non-default value is refused.
UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "use_dora": (False, "DoRA adapters are not supported (their magnitude vectors have no slot)"),
    "use_rslora": (False, "rsLoRA adapters are not supported (scale alpha/sqrt(r) differs)"),
    "rank_pattern": ({}, "per-module ranks are not supported"),
    "alpha_pattern": ({}, "per-module alphas are not supported"),
    "layers_to_transform": (None, "layer subsets are not supported"),
    "layers_pattern": (None, "layer subsets are not supported"),
    "modules_to_save": (None, "fully trained extra modules are not supported"),
    "target_parameters": (None, "expert-bank target_parameters are not supported by import"),
    "fan_in_fan_out": (False, "fan_in_fan_out (Conv1D) adapters are not supported"),
    "lora_bias": (False, "LoRA bias terms are not supported"),
    "bias": ("none", "bias training is not supported (bias must be 'none')"),
}


@dataclass(frozen=True)
class PeftAdapter:
    """What an adapter folder asks for, as a slot's LoraConfig."""

    base_model: str  # base_model_name_or_path as written ("" when absent)
    lora: common_pb2.LoraConfig


def _field(name: str) -> str:
    return f"files.{CONFIG}.{name}"


def _shapes(blob: bytes) -> dict[str, list[int]]:
    """Tensor shapes from a safetensors header (8-byte length, then JSON), without torch."""
    field = f"files.{WEIGHTS}"
    if len(blob) < 8:
        raise errors.InvalidArgument("is not a safetensors file (too short)", field=field)
    (n,) = struct.unpack("<Q", blob[:8])
    try:
        header = json.loads(blob[8 : 8 + n])
    except (ValueError, UnicodeDecodeError):
        raise errors.InvalidArgument(
            "is not a safetensors file (bad header)", field=field
        ) from None
    if not isinstance(header, dict):
        raise errors.InvalidArgument("is not a safetensors file (bad header)", field=field)
    return {k: list(v.get("shape", [])) for k, v in header.items() if k != "__metadata__"}


def _option(cfg: dict[str, Any], key: str, rule: str, default: object) -> float:
    """A number of the PEFT config (absent or null: PEFT's default), checked by the contract's
    rule for the LoRA option it becomes."""
    value = default if cfg.get(key) is None else cfg[key]
    holds, wanted = contract.OPTION_RULES[rule]
    if not isinstance(value, int | float) or isinstance(value, bool) or not holds(value):
        raise errors.InvalidArgument(f"must be {wanted}, got {value!r}", field=_field(key))
    return float(value)


def _modules(cfg: dict[str, Any], key: str) -> list[str]:
    value = cfg.get(key)
    if value in (None, [], ""):
        return []
    if value == contract.ALL_LINEAR:
        return [contract.ALL_LINEAR]
    if isinstance(value, str):  # PEFT reads a string as a regular expression
        raise errors.InvalidArgument(
            "a regular expression is not supported: list the module names", field=_field(key)
        )
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise errors.InvalidArgument("must be a list of module names", field=_field(key))
    return sorted(value)


def parse_adapter(files: dict[str, bytes]) -> PeftAdapter:
    """Check a PEFT LoRA folder's files (others, such as PEFT's README.md, are ignored);
    raises InvalidArgument naming the file or field."""
    for name in (CONFIG, WEIGHTS):
        if name not in files:
            raise errors.InvalidArgument(f"the adapter folder has no {name}", field=f"files.{name}")
    try:
        cfg = json.loads(files[CONFIG])
    except (ValueError, UnicodeDecodeError):
        raise errors.InvalidArgument("is not JSON", field=f"files.{CONFIG}") from None
    if not isinstance(cfg, dict):
        raise errors.InvalidArgument("must be a JSON object", field=f"files.{CONFIG}")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise errors.InvalidArgument(
            f"is {cfg.get('peft_type')!r}; only LORA adapters can be imported",
            field=_field("peft_type"),
        )
    for key, (default, why) in UNSUPPORTED.items():
        if cfg.get(key, default) not in (default, None, [], {}):
            raise errors.InvalidArgument(why, field=_field(key))
    rank = cfg.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise errors.InvalidArgument(f"must be a positive integer, got {rank!r}", field=_field("r"))
    alpha = _option(cfg, "lora_alpha", "alpha", 8)
    dropout = _option(cfg, "lora_dropout", "dropout", 0.0)
    targets = _modules(cfg, "target_modules")
    if not targets:
        raise errors.InvalidArgument("names no module", field=_field("target_modules"))
    excludes = _modules(cfg, "exclude_modules")
    shapes = _shapes(files[WEIGHTS])
    if not shapes:
        raise errors.InvalidArgument("holds no tensor", field=f"files.{WEIGHTS}")
    for key, shape in sorted(shapes.items()):
        if key.endswith(".lora_A.weight"):
            ok = len(shape) == 2 and shape[0] == rank
        elif key.endswith(".lora_B.weight"):
            ok = len(shape) == 2 and shape[1] == rank
        else:
            raise errors.InvalidArgument(
                f"{key!r} is not a LoRA A/B weight (DoRA magnitudes, biases and saved "
                "modules are not supported)",
                field=f"files.{WEIGHTS}",
            )
        if not ok:
            raise errors.InvalidArgument(
                f"{key} has shape {shape}, which does not match r={rank}",
                field=f"files.{WEIGHTS}",
            )
    lora = common_pb2.LoraConfig(
        rank=rank,
        alpha=float(alpha),
        dropout=float(dropout),
        target_modules=targets,
        exclude_modules=excludes,
    )
    return PeftAdapter(str(cfg.get("base_model_name_or_path") or ""), lora)


def _serves(rep: Replica, name: str) -> bool:
    """`name` is the replica's served name or hub id, or a local folder of that model (PEFT
    writes the path it loaded the base from; its folder is named as the served model is)."""
    if name in (rep.base_model, rep.tokenizer_id):
        return True
    local = base_model_name(name)
    return name.startswith("/") and local in {
        n.rsplit("/", 1)[-1] for n in (rep.base_model, rep.tokenizer_id) if n
    }


def choose_base(adapter: PeftAdapter, asked: str, trainers: list[Replica]) -> str:
    """The served base model the adapter goes onto; refuses a mismatch, naming the field."""
    served = sorted({r.base_model for r in trainers})
    if asked:
        match = [r for r in trainers if _serves(r, asked)]
        if not match:
            raise errors.InvalidArgument(
                f"no trainer serves base model {asked!r} (served: {served})", field="base_model"
            )
        if adapter.base_model and not any(_serves(r, adapter.base_model) for r in match):
            raise errors.InvalidArgument(
                f"the adapter was trained on {adapter.base_model!r}, not {asked!r}",
                field=_field("base_model_name_or_path"),
            )
        return match[0].base_model
    if not adapter.base_model:
        raise errors.InvalidArgument(
            "is empty: pass the base model explicitly", field=_field("base_model_name_or_path")
        )
    match = [r for r in trainers if _serves(r, adapter.base_model)]
    if not match:
        raise errors.InvalidArgument(
            f"{adapter.base_model!r} is not a base model this fleet serves (served: {served})",
            field=_field("base_model_name_or_path"),
        )
    return match[0].base_model


def check_targets(lora: common_pb2.LoraConfig, modules: list[str]) -> None:
    """Each target/exclude name must name a module of the base model (the contract's rule)."""
    for key in ("target_modules", "exclude_modules"):
        contract.check_target_names(getattr(lora, key), modules, _field(key))


class ImportHost(Protocol):
    """The controller's parts an import uses, and the one flow (ending its session): the
    Controller satisfies it structurally, so this module never imports it back."""

    registry: Registry
    placer: Placer
    pool: Pool
    tenancy: Tenancy
    catalog: Catalog
    sessions: Sessions


class Importer:
    """Drives one import through the controller's parts (see the module doc)."""

    def __init__(self, host: ImportHost) -> None:
        self.c = host

    async def run(
        self, tenant: str, name: str, base_model: str, files: dict[str, bytes]
    ) -> tuple[str, str, str, common_pb2.LoraConfig]:
        """(path, training run id, base model, LoRA config) of the new saved state."""
        c = self.c
        if not tenant:
            raise errors.InvalidArgument("tenant is required", field="tenant")
        names.check_name(name)
        adapter = parse_adapter(files)
        trainers = await c.registry.replicas(TRAINER)
        base = choose_base(adapter, base_model, trainers)
        pool = [r for r in trainers if r.base_model == base]
        max_rank = max(r.max_rank for r in pool)
        if max_rank and adapter.lora.rank > max_rank:
            raise errors.InvalidArgument(
                f"r={adapter.lora.rank} is above the trainers' maximum rank {max_rank}",
                field=_field("r"),
            )
        info = await c.pool.trainer(pool[0].address).info()
        check_targets(adapter.lora, list(info.modules))
        session_id = await c.tenancy.create_session(
            tenant, ["peft-import"], {}, "", "", f"PEFT import {name}"
        )
        try:
            return await self._import(tenant, session_id, name, base, adapter, files)
        finally:
            await c.sessions.finish(tenant, session_id, "PEFT import finished")

    async def _import(
        self,
        tenant: str,
        session_id: str,
        name: str,
        base: str,
        adapter: PeftAdapter,
        files: dict[str, bytes],
    ) -> tuple[str, str, str, common_pb2.LoraConfig]:
        c = self.c
        meta = {"lorafleet.imported_from": adapter.base_model or base}
        rec, _ = await c.registry.create(
            tenant, session_id, 0, base, adapter.lora, meta, "adamw", False
        )
        rid = rec.registration_id
        if (await c.registry.place(rid)).code == "placed":
            await c.placer.finish_binding(rid)
        deadline = time.monotonic() + SLOT_WAIT_SECONDS
        while (rec := await c.registry.get(tenant, rid)).state != RegState.READY:
            if time.monotonic() > deadline:
                raise errors.Unavailable(
                    f"no trainer slot for {base!r} came free within {SLOT_WAIT_SECONDS:g}s",
                    reason="NO_FREE_SLOT",
                )
            await asyncio.sleep(0.05)
        rep = await c.registry.replica(rec.replica)
        if rep is None:
            raise errors.Unavailable(f"trainer replica {rec.replica} is gone")
        trainer = c.pool.trainer(rep.address)
        adapter_files = {n: files[n] for n in (CONFIG, WEIGHTS)}
        await trainer.import_adapter(f"{rid}#import", rec.slot, rid, adapter_files)
        save_op = f"{rid}#save"
        manifest = await trainer.save_state(save_op, rec.slot, rid, name, True)
        path = str(contract.TinkerPath(rid, contract.CheckpointKind.WEIGHTS, name))
        await c.catalog.add(
            tinker_path=path,
            tenant=tenant,
            type=TRAINING,
            base_model=base,
            lora=rec.lora,
            manifest=manifest,
            has_optimizer=True,
            user_metadata=meta,
            operation_id=save_op,
        )
        return path, rid, base, rec.lora
