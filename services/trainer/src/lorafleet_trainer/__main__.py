"""`python -m lorafleet_trainer`: settings first (fast failure), then torch and the model.

Bad settings or a bad model folder print one line and exit 2.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

from lorafleet import hub, quantize
from lorafleet.replica import ReplicaSettings
from lorafleet.settings import ServerSettings, SettingsError, describe, load_settings
from lorafleet.shared_storage import check_root
from lorafleet_trainer.settings import PREFIX, TrainerSettings


def _fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help"):
        print("Settings (environment variables):")
        print(describe(ServerSettings, PREFIX))
        print(describe(TrainerSettings, PREFIX))
        print(describe(ReplicaSettings, PREFIX))
        return
    try:
        server = load_settings(ServerSettings, PREFIX)
        settings = load_settings(TrainerSettings, PREFIX)
        replica = load_settings(ReplicaSettings, PREFIX)
        shared_root = None
        if settings.shared_adapter_root is not None:
            shared_root = check_root(settings.shared_adapter_root, f"{PREFIX}SHARED_ADAPTER_ROOT")
    except SettingsError as exc:
        _fail(str(exc))
    if not (settings.model_path / "config.json").is_file():
        _fail(f"{PREFIX}MODEL_PATH={settings.model_path}: not a model folder (no config.json)")
    try:
        served = settings.served_base_model
    except ValueError as exc:
        _fail(f"{PREFIX}{exc}")
    # Clients load the tokenizer by the served name: make it resolve offline here.
    hub.install(settings.model_path, served)

    import torch

    from lorafleet.logging import setup_logging
    from lorafleet.replica import Registrar
    from lorafleet.rpc.server import ServiceSpec, serve
    from lorafleet.v1 import controller_pb2, trainer_pb2_grpc
    from lorafleet_trainer.engine import TrainerEngine
    from lorafleet_trainer.group import (
        GroupEngine,
        GroupEnv,
        exit_lost,
        load_group_engine,
        serve_worker,
    )
    from lorafleet_trainer.servicer import TrainerServicer
    from lorafleet_trainer.snapshots import Snapshotter

    setup_logging("trainer", server.log_level)
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    if settings.device == "cuda" and not torch.cuda.is_available():
        _fail(f"{PREFIX}DEVICE=cuda: no CUDA device is available")
    group_env = GroupEnv.from_environ()
    if group_env is not None and settings.quantization != quantize.NONE:
        _fail(
            f"{PREFIX}QUANTIZATION={settings.quantization}: a trainer group shards the float "
            "base with FSDP2; a quantized base is for single-process trainers"
        )
    try:
        if group_env is None:
            engine = TrainerEngine.from_pretrained(
                settings.model_path,
                device=settings.device,
                dtype=settings.dtype,
                num_slots=settings.num_slots,
                max_rank=settings.max_rank,
                storage_root=settings.storage_root,
                max_applied_ops=settings.max_applied_ops,
                base_model=served,
                quantization=settings.quantization,
            )
        else:  # a trainer group under torchrun: see lorafleet_trainer.group
            engine, group = load_group_engine(
                settings.model_path,
                group_env,
                device=settings.device,
                dtype=settings.dtype,
                timeout=settings.group_timeout_seconds,
                base_model=served,
                reshard=settings.group_reshard_after_forward,
                num_slots=settings.num_slots,
                max_rank=settings.max_rank,
                storage_root=settings.storage_root,
                max_applied_ops=settings.max_applied_ops,
            )
    except Exception as exc:  # any load failure is an operator error: one line, exit 2
        _fail(f"{PREFIX}MODEL_PATH={settings.model_path}: cannot load the model: {exc}")
    serving: TrainerEngine | GroupEngine = engine
    if group_env is not None:
        if group_env.rank != 0:
            serve_worker(engine, group)  # never returns
        serving = GroupEngine(engine, group, settings.group_keepalive_seconds, exit_lost)
    snapshots = Snapshotter(serving, settings.snapshot_every_steps, settings.snapshot_every_seconds)
    servicer = TrainerServicer(
        serving,
        settings.replica_id,
        snapshots,
        shared_root,
        model_path=settings.model_path,
        max_adapter_bytes=settings.max_adapter_bytes,
    )
    info = serving.info()
    registrar = Registrar(
        replica,
        lambda: controller_pb2.RegisterReplicaRequest(
            kind=controller_pb2.REPLICA_KIND_TRAINER,
            replica_id=settings.replica_id,
            address=replica.address(server.port),
            base_model=info["base_model"],
            num_slots=info["num_slots"],
            incarnation=info["incarnation"],
            tokenizer_id=served,
            max_rank=info["max_rank"],
            max_context_length=info["max_context_length"],
            arch=info["arch"],
            quantization=info["quantization"],
        ),
    )

    async def startup() -> None:
        registrar.start()

    async def shutdown() -> None:
        await registrar.stop()
        servicer.executor.shutdown(wait=True)
        snapshots.close()
        if isinstance(serving, GroupEngine):
            serving.close()  # releases the other ranks

    serve(
        "trainer",
        server,
        [
            ServiceSpec(
                servicer,
                trainer_pb2_grpc.add_TrainerServiceServicer_to_server,
                "lorafleet.v1.TrainerService",
            )
        ],
        startup=startup,
        shutdown=shutdown,
    )
    # Everything is drained and shut down; skip interpreter teardown of torch/transformers,
    # which took 5-20 s on a loaded machine and made SIGTERM look like a hang.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
