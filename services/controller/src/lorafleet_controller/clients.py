"""gRPC clients of trainer and rollout replicas, one reused channel per address.

Transport failures (UNAVAILABLE, DEADLINE_EXCEEDED) are retried with tenacity for up to
`transport_retry_seconds`: every mutating trainer RPC carries an operation id the trainer
deduplicates, so a retry never applies anything twice. Every other failure is converted
back into the domain exception the replica raised (`from_rpc_error`) and not retried.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_delay,
    wait_exponential,
)

from lorafleet import errors
from lorafleet.rpc.channel import make_channel
from lorafleet.rpc.errors import from_rpc_error
from lorafleet.v1 import (
    common_pb2,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)

T = TypeVar("T")
_TRANSPORT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
CHUNK_BYTES = 1 << 20


def _is_transport(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in _TRANSPORT


class _Base:
    def __init__(self, address: str, retry_seconds: float, timeout: float) -> None:
        self.address = address
        self.retry_seconds = retry_seconds
        self.timeout = timeout
        self.channel = make_channel(address)

    async def call(self, fn: Callable[[], Awaitable[T]], *, retry: bool = True) -> T:
        """Run one RPC with transport retries; raise the replica's domain error otherwise."""
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception(_is_transport),
                stop=stop_after_delay(self.retry_seconds if retry else 0),
                wait=wait_exponential(multiplier=0.05, max=2.0),
                reraise=True,
            ):
                with attempt:
                    return await fn()
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        raise errors.Internal("unreachable")  # pragma: no cover

    async def close(self) -> None:
        await self.channel.close()


class TrainerClient(_Base):
    def __init__(self, address: str, retry_seconds: float = 30.0, timeout: float = 600.0):
        super().__init__(address, retry_seconds, timeout)
        self.stub = trainer_pb2_grpc.TrainerServiceStub(self.channel)

    async def info(self, *, retry: bool = True) -> trainer_pb2.GetTrainerInfoResponse:
        return await self.call(
            lambda: self.stub.GetTrainerInfo(trainer_pb2.GetTrainerInfoRequest(), timeout=5),
            retry=retry,
        )

    async def list_slots(self) -> list[trainer_pb2.SlotInfo]:
        resp = await self.call(
            lambda: self.stub.ListSlots(trainer_pb2.ListSlotsRequest(), timeout=5)
        )
        return list(resp.slots)

    async def bind(self, slot: int, rid: str, lora: common_pb2.LoraConfig) -> None:
        req = trainer_pb2.BindSlotRequest(slot=slot, registration_id=rid, lora_config=lora)
        await self.call(lambda: self.stub.BindSlot(req, timeout=30))

    async def unbind(self, slot: int, rid: str) -> None:
        req = trainer_pb2.UnbindSlotRequest(slot=slot, registration_id=rid)
        await self.call(lambda: self.stub.UnbindSlot(req, timeout=30))

    async def forward_backward(
        self, items: list[trainer_pb2.ForwardBackwardItem], *, incarnation: str = ""
    ) -> trainer_pb2.ForwardBackwardResponse:
        """`incarnation`: the trainer process meant; another one refuses (STALE_INCARNATION),
        so a retry that reaches a restarted trainer never applies there."""
        req = trainer_pb2.ForwardBackwardRequest(items=items, incarnation=incarnation)
        return await self.call(lambda: self.stub.ForwardBackward(req, timeout=self.timeout))

    async def optim_step(
        self,
        opid: str,
        slot: int,
        rid: str,
        adam: common_pb2.AdamParams,
        *,
        incarnation: str = "",
    ) -> trainer_pb2.OptimStepResponse:
        """The step's output, and the slot's newest complete snapshot (recovery.py)."""
        req = trainer_pb2.OptimStepRequest(
            operation_id=opid,
            slot=slot,
            registration_id=rid,
            adam_params=adam,
            incarnation=incarnation,
        )
        return await self.call(lambda: self.stub.OptimStep(req, timeout=120))

    async def save_state(
        self,
        opid: str,
        slot: int,
        rid: str,
        name: str,
        include_optimizer: bool,
        *,
        incarnation: str = "",
    ) -> common_pb2.BlobRef:
        req = trainer_pb2.SaveStateRequest(
            operation_id=opid,
            slot=slot,
            registration_id=rid,
            name=name,
            include_optimizer=include_optimizer,
            incarnation=incarnation,
        )
        resp = await self.call(lambda: self.stub.SaveState(req, timeout=300))
        return resp.manifest

    async def prune_snapshots(self, rid: str, keep_uris: list[str]) -> list[str]:
        """Delete the run's superseded snapshots and page-out saves but `keep_uris`."""
        req = trainer_pb2.PruneSnapshotsRequest(registration_id=rid, keep_uris=keep_uris)
        resp = await self.call(lambda: self.stub.PruneSnapshots(req, timeout=60))
        return list(resp.removed_uris)

    async def load_state(
        self,
        opid: str,
        slot: int,
        rid: str,
        manifest: common_pb2.BlobRef,
        with_optimizer: bool,
        *,
        incarnation: str = "",
    ) -> None:
        req = trainer_pb2.LoadStateRequest(
            operation_id=opid,
            slot=slot,
            registration_id=rid,
            manifest=manifest,
            include_optimizer=with_optimizer,
            incarnation=incarnation,
        )
        await self.call(lambda: self.stub.LoadState(req, timeout=300))

    async def export_adapter(self, slot: int, rid: str) -> dict[str, bytes]:
        """The slot's PEFT adapter folder as {path: bytes}, each file checked by SHA-256."""
        req = trainer_pb2.ExportAdapterRequest(slot=slot, registration_id=rid)

        async def fetch() -> dict[str, bytes]:
            files: dict[str, bytearray] = {}
            async for part in self.stub.ExportAdapter(req, timeout=120):
                c = part.chunk
                files.setdefault(c.path, bytearray()).extend(c.data)
            return {path: bytes(data) for path, data in files.items()}

        return await self.call(fetch)

    async def export_tokenizer(self) -> dict[str, bytes]:
        """The base model's tokenizer files as {name: bytes}, each checked by its SHA-256."""
        req = trainer_pb2.ExportTokenizerRequest()

        async def fetch() -> dict[str, bytes]:
            files: dict[str, bytearray] = {}
            digests: dict[str, str] = {}
            async for part in self.stub.ExportTokenizer(req, timeout=60):
                c = part.chunk
                files.setdefault(c.path, bytearray()).extend(c.data)
                if c.sha256:
                    digests[c.path] = c.sha256
            for path, data in files.items():
                if digests.get(path) != sha256(bytes(data)):
                    raise errors.Unavailable(f"tokenizer file {path} arrived damaged; retry")
            return {path: bytes(data) for path, data in files.items()}

        return await self.call(fetch)

    async def write_shared_adapter(
        self, slot: int, rid: str, version: int
    ) -> dict[str, common_pb2.BlobRef]:
        """Publish by reference: the trainer writes the version's folder on shared storage."""
        req = trainer_pb2.WriteSharedAdapterRequest(slot=slot, registration_id=rid, version=version)
        resp = await self.call(lambda: self.stub.WriteSharedAdapter(req, timeout=120))
        return dict(resp.files)

    async def import_adapter(self, opid: str, slot: int, rid: str, files: dict[str, bytes]) -> None:
        header = trainer_pb2.ImportAdapterHeader(operation_id=opid, slot=slot, registration_id=rid)

        async def chunks() -> AsyncIterator[trainer_pb2.ImportAdapterChunk]:
            yield trainer_pb2.ImportAdapterChunk(header=header)
            for chunk in file_chunks(files):
                yield trainer_pb2.ImportAdapterChunk(chunk=chunk)

        await self.call(lambda: self.stub.ImportAdapter(chunks(), timeout=300))


class RolloutClient(_Base):
    def __init__(self, address: str, retry_seconds: float = 30.0, timeout: float = 600.0):
        super().__init__(address, retry_seconds, timeout)
        self.stub = rollout_pb2_grpc.RolloutServiceStub(self.channel)

    async def info(self, *, retry: bool = True) -> rollout_pb2.GetRolloutInfoResponse:
        return await self.call(
            lambda: self.stub.GetRolloutInfo(rollout_pb2.GetRolloutInfoRequest(), timeout=5),
            retry=retry,
        )

    async def load_adapter(
        self,
        ref: common_pb2.AdapterRef,
        lora: common_pb2.LoraConfig,
        files: dict[str, bytes],
        *,
        tenant: str,
        retry: bool = True,
    ) -> rollout_pb2.LoadAdapterResponse:
        header = rollout_pb2.AdapterHeader(
            adapter=ref,
            lora_config=lora,
            file_sha256={p: sha256(d) for p, d in files.items()},
            tenant=tenant,
        )

        async def chunks() -> AsyncIterator[rollout_pb2.LoadAdapterChunk]:
            yield rollout_pb2.LoadAdapterChunk(header=header)
            for chunk in file_chunks(files):
                yield rollout_pb2.LoadAdapterChunk(chunk=chunk)

        return await self.call(lambda: self.stub.LoadAdapter(chunks(), timeout=120), retry=retry)

    async def load_shared_adapter(
        self,
        ref: common_pb2.AdapterRef,
        lora: common_pb2.LoraConfig,
        refs: dict[str, common_pb2.BlobRef],
        *,
        tenant: str,
        retry: bool = True,
    ) -> rollout_pb2.LoadAdapterResponse:
        """A header naming the files on shared storage; no chunks (the replica reads them)."""
        header = rollout_pb2.AdapterHeader(
            adapter=ref,
            lora_config=lora,
            file_refs=refs,
            file_sha256={path: r.sha256 for path, r in refs.items()},
            tenant=tenant,
        )

        async def only_header() -> AsyncIterator[rollout_pb2.LoadAdapterChunk]:
            yield rollout_pb2.LoadAdapterChunk(header=header)

        return await self.call(
            lambda: self.stub.LoadAdapter(only_header(), timeout=120), retry=retry
        )

    async def unload_adapter(self, ref: common_pb2.AdapterRef) -> None:
        req = rollout_pb2.UnloadAdapterRequest(adapter=ref)
        await self.call(lambda: self.stub.UnloadAdapter(req, timeout=30))

    async def list_adapters(self, *, retry: bool = True) -> list[rollout_pb2.ResidentAdapter]:
        resp = await self.call(
            lambda: self.stub.ListAdapters(rollout_pb2.ListAdaptersRequest(), timeout=5),
            retry=retry,
        )
        return list(resp.adapters)

    async def sample(self, req: rollout_pb2.SampleRequest) -> common_pb2.SampleOutput:
        resp = await self.call(lambda: self.stub.Sample(req, timeout=self.timeout))
        return resp.output


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_chunks(files: dict[str, bytes]) -> list[common_pb2.FileChunk]:
    """Files as FileChunks; the last chunk of each carries the file's SHA-256."""
    out: list[common_pb2.FileChunk] = []
    for path in sorted(files):
        data = files[path]
        offsets = list(range(0, len(data), CHUNK_BYTES)) or [0]
        for i, off in enumerate(offsets):
            last = i == len(offsets) - 1
            out.append(
                common_pb2.FileChunk(
                    path=path,
                    offset=off,
                    data=data[off : off + CHUNK_BYTES],
                    sha256=sha256(data) if last else "",
                )
            )
    return out


class Pool:
    """One client per replica address, created on first use and closed on shutdown."""

    def __init__(self, retry_seconds: float, timeout: float) -> None:
        self.retry_seconds = retry_seconds
        self.timeout = timeout
        self._trainers: dict[str, TrainerClient] = {}
        self._rollouts: dict[str, RolloutClient] = {}

    def trainer(self, address: str) -> TrainerClient:
        if address not in self._trainers:
            self._trainers[address] = TrainerClient(address, self.retry_seconds, self.timeout)
        return self._trainers[address]

    def rollout(self, address: str) -> RolloutClient:
        if address not in self._rollouts:
            self._rollouts[address] = RolloutClient(address, self.retry_seconds, self.timeout)
        return self._rollouts[address]

    async def close(self) -> None:
        clients: list[Any] = [*self._trainers.values(), *self._rollouts.values()]
        for client in clients:
            await client.close()
        self._trainers.clear()
        self._rollouts.clear()
