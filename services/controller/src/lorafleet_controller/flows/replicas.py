"""Replicas joining (RegisterReplica or discovery), lost, and failed for good."""

from __future__ import annotations

import dataclasses
import logging

from lorafleet import errors, quantize
from lorafleet_controller.clients import Pool
from lorafleet_controller.flows import Background
from lorafleet_controller.flows.stranding import Stranding
from lorafleet_controller.publish import Publisher
from lorafleet_controller.registry import (
    ROLLOUT,
    TRAINER,
    Placer,
    Registry,
    Replica,
    base_model_name,
)

log = logging.getLogger(__name__)


class Replicas:
    def __init__(
        self,
        registry: Registry,
        pool: Pool,
        placer: Placer,
        publisher: Publisher,
        stranding: Stranding,
        background: Background,
    ):
        self.registry = registry
        self.pool = pool
        self.placer = placer
        self.publisher = publisher
        self.stranding = stranding
        self.background = background

    async def register(self, rep: Replica) -> None:
        """A replica as it registered itself (RegisterReplica): checked, then admitted with
        its base model named as trainers name it and its quantization defaulted."""
        if rep.kind not in (TRAINER, ROLLOUT):
            raise errors.InvalidArgument("kind must be TRAINER or ROLLOUT", field="kind")
        for name in ("replica_id", "address", "base_model", "incarnation"):
            if not getattr(rep, name):
                raise errors.InvalidArgument(f"{name} is required", field=name)
        if rep.kind == TRAINER and rep.num_slots < 1:
            raise errors.InvalidArgument("must be >= 1", field="num_slots")
        quantization = rep.quantization or quantize.NONE
        if quantization not in quantize.QUANTIZATIONS:
            raise errors.InvalidArgument(
                f"must be one of {', '.join(quantize.QUANTIZATIONS)}", field="quantization"
            )
        await self.admit(
            dataclasses.replace(
                rep, base_model=base_model_name(rep.base_model), quantization=quantization
            )
        )

    async def admit(self, rep: Replica) -> str:
        """Record a replica (RegisterReplica or discovery) and act on what changed."""
        await self._check_same_base(rep)
        change = await self.registry.register_replica(rep)
        if change == "same":
            return change
        log.info("%s replica %s: %s", rep.kind, rep.replica_id, change)
        if rep.kind == TRAINER:
            self.background(self._trainer_joined(rep))
        else:
            self.background(self.publisher.reconcile(rep))
        return change

    async def _check_same_base(self, rep: Replica) -> None:
        """Refuse a replica that stores its base model otherwise (`lorafleet.quantize`) than a
        healthy replica of the same model: a sampler on other weights than its trainer's gives
        logprobs that drift from the trainer's, and RL's importance ratios pay for it.

        Refused here, when the replica registers, rather than when a run is created: the
        mismatch is a deployment fault no run can fix, it is caught before any tenant's work
        reaches the replica (a refused replica is never recorded, so it gets no traffic), the
        replica's heartbeat log names it, and it is admitted by itself once the replicas it
        disagrees with are gone (changing the quantization is redeploying the model)."""
        for other in await self.registry.replicas():
            if (
                other.healthy
                and other.base_model == rep.base_model
                and other.replica_id != rep.replica_id
                and other.quantization != rep.quantization
            ):
                raise errors.FailedPrecondition(
                    f"{rep.kind} {rep.replica_id} stores base model {rep.base_model!r} with "
                    f"quantization {rep.quantization!r}, but {other.kind} {other.replica_id} "
                    f"serves it with {other.quantization!r}: every trainer and rollout of a "
                    "model must run the same one",
                    field="quantization",
                    reason="QUANTIZATION_MISMATCH",
                )

    async def _trainer_joined(self, rep: Replica) -> None:
        try:
            info = await self.pool.trainer(rep.address).info()
            await self.registry.set_trainer_info(
                rep.replica_id, list(info.loss_fns), list(info.modules), info.vocab_size
            )
        except errors.LorafleetError as exc:
            log.warning("GetTrainerInfo on %s failed: %s", rep.replica_id, exc)
        await self.placer.fill(rep.base_model)

    async def lose(self, replica_id: str, reason: str) -> None:
        """A replica is gone: a trainer's registrations become UNAVAILABLE and re-queue."""
        rep = await self.registry.replica(replica_id)
        if rep is None or not rep.healthy:
            return
        await self.registry.replica_lost(rep.replica_id, reason)
        if rep.kind == TRAINER:
            await self.placer.fill(rep.base_model)

    async def finish_losses(self) -> None:
        """A trainer lost by a controller that died half-way through (replica_lost.lua, then
        one step per run) is unhealthy with slot entries left: lose those now."""
        for rep in await self.registry.replicas(TRAINER):
            if not rep.healthy and await self.registry.slot_table(rep.replica_id):
                await self.registry.replica_lost(
                    rep.replica_id, f"trainer replica {rep.replica_id} was lost"
                )
                await self.placer.fill(rep.base_model)

    async def failed(self, replica_id: str, reason: str) -> list[str]:
        """A replica's process stays down: its supervisor spent the restart budget
        (`lorafleet up`). Record why (status, the replica table) and lose it; when it was the
        last trainer of its base model, strand the runs waiting on one. Returns those."""
        rep = await self.registry.replica_failed(replica_id, reason)
        return await self.stranding.strand(rep.base_model) if rep.kind == TRAINER else []
