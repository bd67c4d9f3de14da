"""A training run's creation (placed on a slot when one is free) and its deletion."""

from __future__ import annotations

from dataclasses import dataclass, field

from lorafleet import errors
from lorafleet.v1 import common_pb2, controller_pb2
from lorafleet_controller.catalog import TRAINING, Catalog
from lorafleet_controller.flows.runs import Runs
from lorafleet_controller.flows.stranding import no_healthy_trainer
from lorafleet_controller.ledger import Ledger
from lorafleet_controller.publish import Publisher
from lorafleet_controller.registry import TRAINER, Placer, Registry, RegRecord
from lorafleet_controller.store import RegState
from lorafleet_controller.tenancy import Tenancy


@dataclass(frozen=True)
class NewRegistration:
    """A run to create, as CreateRegistration (or a managed job) asks for it."""

    tenant: str
    session_id: str
    model_seq_id: int
    base_model: str
    lora: common_pb2.LoraConfig
    user_metadata: dict[str, str] = field(default_factory=dict)
    optimizer: str = ""  # "" = adamw
    initial_checkpoint: str = ""  # a training checkpoint's path to start from
    initial_with_optimizer: bool = False


class Registrations:
    def __init__(
        self,
        tenancy: Tenancy,
        catalog: Catalog,
        registry: Registry,
        ledger: Ledger,
        placer: Placer,
        runs: Runs,
        publisher: Publisher,
    ):
        self.tenancy = tenancy
        self.catalog = catalog
        self.registry = registry
        self.ledger = ledger
        self.placer = placer
        self.runs = runs
        self.publisher = publisher

    async def create(self, new: NewRegistration) -> tuple[RegRecord, str]:
        """The run's record, and the id of the operation loading its initial state ("" when
        it starts fresh)."""
        await self.tenancy.check_session(new.tenant, new.session_id)
        if new.model_seq_id < 0:
            raise errors.InvalidArgument("must be >= 0", field="model_seq_id")
        optimizer = new.optimizer or "adamw"
        if optimizer != "adamw":
            raise errors.InvalidArgument("only 'adamw' is supported", field="optimizer")
        lora = common_pb2.LoraConfig()
        lora.CopyFrom(new.lora)
        base_model = new.base_model
        load_payload = b""
        if new.initial_checkpoint:
            ckpt = await self.catalog.get(new.tenant, new.initial_checkpoint)
            if ckpt.type != TRAINING:
                raise errors.InvalidArgument(
                    "initial_checkpoint must be a tinker://.../weights/<name> path",
                    field="initial_checkpoint",
                )
            lora.CopyFrom(ckpt.lora)
            base_model = ckpt.base_model
            load_payload = controller_pb2.OperationPayload(
                load_state=controller_pb2.LoadStatePayload(
                    path=new.initial_checkpoint, with_optimizer=new.initial_with_optimizer
                )
            ).SerializeToString()
        trainers = await self.registry.replicas(TRAINER, base_model)
        if not trainers:
            served = sorted({r.base_model for r in await self.registry.replicas(TRAINER)})
            raise errors.InvalidArgument(
                f"no trainer serves base model {base_model!r} (served: {served})",
                field="base_model",
            )
        if not any(t.healthy for t in trainers):
            # A trainer whose restart budget is spent stays down (`lorafleet up`) or a pod
            # crash-loops: a registration queued now would wait forever, so say who is missing.
            raise no_healthy_trainer(self.registry.clock(), base_model, trainers)
        # The LoraConfig's rules (contract.check_lora_config) are checked by the gateway and
        # by the trainer at bind; a refused bind fails the run with that error (Runs.fail).
        rec, created = await self.registry.create(
            new.tenant,
            new.session_id,
            new.model_seq_id,
            base_model,
            lora,
            dict(new.user_metadata),
            optimizer,
            bool(load_payload),
        )
        load_op = ""
        if load_payload:
            load_op = await self.ledger.create_internal(
                rec.registration_id,
                new.tenant,
                0,
                controller_pb2.OPERATION_KIND_LOAD_STATE,
                load_payload,
            )
        placeable = created or rec.state == RegState.QUEUED
        if placeable and (await self.registry.place(rec.registration_id)).code == "placed":
            await self.placer.finish_binding(rec.registration_id)
        rec = await self.registry.get(new.tenant, rec.registration_id)
        if (failure := rec.failure()) is not None:
            raise failure
        return rec, load_op

    async def delete(self, tenant: str, rid: str) -> None:
        """Retire a run: its open operations fail, its slot frees, its published adapters go."""
        rec = await self.registry.get(tenant, rid)
        if rec.state == RegState.RETIRED:
            return
        retired = errors.FailedPrecondition(
            "registration retired before the operation ran",
            field="registration_id",
            reason="RETIRED",
        )
        await self.runs.retire(rid, retired)
        await self.publisher.forget(rid, rec.base_model)
