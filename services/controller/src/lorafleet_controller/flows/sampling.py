"""A sampler's creation: of a base model, a published sampler checkpoint, or a training one."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from lorafleet import errors
from lorafleet.v1 import common_pb2
from lorafleet_controller.catalog import SAMPLER, Catalog
from lorafleet_controller.publish import Publisher
from lorafleet_controller.registry import ROLLOUT, Registry
from lorafleet_controller.samplers import SamplerRecord, Samplers, sampler_id_of
from lorafleet_controller.tenancy import Tenancy


@dataclass(frozen=True)
class NewSampler:
    """A sampler to create, as CreateSampler asks for it: of exactly one of `model_path` and
    `base_model`."""

    tenant: str
    session_id: str
    sampling_session_seq_id: int
    model_path: str
    base_model: str


class Sampling:
    def __init__(
        self,
        tenancy: Tenancy,
        registry: Registry,
        catalog: Catalog,
        samplers: Samplers,
        publisher: Publisher,
    ):
        self.tenancy = tenancy
        self.registry = registry
        self.catalog = catalog
        self.samplers = samplers
        self.publisher = publisher

    async def create(self, new: NewSampler) -> SamplerRecord:
        await self.tenancy.check_session(new.tenant, new.session_id)
        if bool(new.model_path) == bool(new.base_model):
            raise errors.InvalidArgument(
                "exactly one of model_path and base_model is required", field="model_path"
            )
        sampler_id = sampler_id_of(new.session_id, new.sampling_session_seq_id)
        with contextlib.suppress(errors.NotFound):
            return await self.samplers.get(new.tenant, sampler_id)
        if new.base_model:
            if not await self.registry.replicas(ROLLOUT, new.base_model):
                raise errors.InvalidArgument(
                    f"no rollout serves base model {new.base_model!r}", field="base_model"
                )
            return await self.samplers.record(
                sampler_id=sampler_id,
                tenant=new.tenant,
                base_model=new.base_model,
                model_path="",
                ref=common_pb2.AdapterRef(),
                inflight=False,
            )
        ckpt = await self.catalog.get(new.tenant, new.model_path)
        if ckpt.type != SAMPLER:
            return await self.publisher.sampler_from_checkpoint(
                ckpt, sampler_id, new.tenant, new.model_path
            )
        ref = common_pb2.AdapterRef(registration_id=ckpt.training_run_id, version=ckpt.version)
        return await self.samplers.record(
            sampler_id=sampler_id,
            tenant=new.tenant,
            base_model=ckpt.base_model,
            model_path=new.model_path,
            ref=ref,
            inflight=False,
        )
