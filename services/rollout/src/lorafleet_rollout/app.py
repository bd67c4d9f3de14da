"""Wiring of one rollout replica: engine → core → gRPC servicer, plus the controller heartbeat."""

from __future__ import annotations

import logging

import torch

from lorafleet.replica import Registrar, ReplicaSettings
from lorafleet.rpc.server import ServiceSpec, serve
from lorafleet.settings import ServerSettings
from lorafleet.v1 import controller_pb2, rollout_pb2_grpc
from lorafleet_rollout.core import Limits, RolloutCore
from lorafleet_rollout.engine import RolloutEngine
from lorafleet_rollout.servicer import RolloutServicer
from lorafleet_rollout.settings import RolloutSettings

log = logging.getLogger(__name__)


def make_engine(settings: RolloutSettings) -> RolloutEngine:
    if settings.engine == "sglang":
        from lorafleet_rollout.sglang_engine import SGLangEngine

        return SGLangEngine(
            settings.engine_url,
            settings.model_path,
            max_lora_rank=settings.max_lora_rank,
            launch=settings.engine_launch,
            max_loaded_adapters=settings.max_loaded_adapters,
            quantization=settings.quantization,
        )
    if settings.engine == "vllm":
        from lorafleet_rollout.vllm_engine import VLLMEngine

        return VLLMEngine(
            settings.engine_url,
            settings.model_path,
            served_model_name=settings.served_model_name,
            max_lora_rank=settings.max_lora_rank,
        )
    from lorafleet_rollout import kernels, metrics
    from lorafleet_rollout.torch_engine import TorchEngine

    # Loaded here, at start-up (a library built with the package: no compiler runs), and
    # reported, so a deployment shows whether it decodes natively or on the torch fallback.
    decode_path = kernels.path()
    metrics.DECODE_KERNELS.labels(path=decode_path).set(1)
    log.info("torch engine: decode kernels %s", decode_path)
    return TorchEngine(
        settings.model_path,
        max_batch_size=settings.max_batch_size,
        max_lora_rank=settings.max_lora_rank,
        prefix_cache_bytes=settings.prefix_cache_bytes,
        warm_bytes=settings.warm_memory_bytes,
        prefill_chunk=settings.prefill_chunk_tokens,
        favour_decoding=settings.favour_decoding,
        publish_cpu_share=settings.publish_cpu_share,
        quantization=settings.quantization,
    )


def make_core(settings: RolloutSettings) -> RolloutCore:
    limits = Limits(
        max_loaded_adapters=settings.max_loaded_adapters,
        max_stored_adapters=settings.max_stored_adapters,
        max_queued_requests=settings.max_queued_requests,
        max_num_samples=settings.max_num_samples,
        max_adapter_bytes=settings.max_adapter_bytes,
    )
    return RolloutCore(make_engine(settings), limits, settings.adapter_dir / settings.replica_id)


def run(settings: RolloutSettings, server: ServerSettings, replica: ReplicaSettings) -> None:
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    core = make_core(settings)

    def registration() -> controller_pb2.RegisterReplicaRequest:
        info = core.info()
        return controller_pb2.RegisterReplicaRequest(
            kind=controller_pb2.REPLICA_KIND_ROLLOUT,
            replica_id=settings.replica_id,
            address=replica.address(server.port),
            base_model=settings.served_base_model,
            num_slots=core.max_loaded_adapters,
            incarnation=core.incarnation,
            tokenizer_id=settings.served_base_model,
            max_rank=info.max_lora_rank,
            max_context_length=info.max_context_length,
            arch=info.engine,
            max_num_samples=settings.max_num_samples,
            quantization=settings.quantization,
        )

    registrar = Registrar(replica, registration)

    async def startup() -> None:
        await core.start()
        registrar.start()

    async def shutdown() -> None:
        await registrar.stop()
        await core.close()

    servicer = RolloutServicer(
        core,
        settings.replica_id,
        settings.served_base_model,
        settings.shared_adapter_root,
        quantization=settings.quantization,
    )
    spec = ServiceSpec(
        servicer=servicer,
        add_fn=rollout_pb2_grpc.add_RolloutServiceServicer_to_server,
        full_name="lorafleet.v1.RolloutService",
    )
    serve("rollout", server, [spec], startup=startup, shutdown=shutdown)
