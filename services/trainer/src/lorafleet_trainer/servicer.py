"""TrainerService: translates proto ⇄ engine calls; never aborts, only raises domain errors.

All engine work runs on one worker thread (torch is not re-entrant here), which also
serialises operations per slot. Adapters stream as file chunks, each file's last chunk
carrying its SHA-256.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from lorafleet import shared_storage
from lorafleet.errors import FailedPrecondition, InvalidArgument, LorafleetError
from lorafleet.rpc.errors import error_info
from lorafleet.rpc.types import ServerContext
from lorafleet.staging import MAX_ADAPTER_BYTES, ChunkedUpload
from lorafleet.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from lorafleet_trainer import convert
from lorafleet_trainer.checkpoint import ADAPTER_CONFIG, ADAPTER_WEIGHTS, resolve_uri
from lorafleet_trainer.domain import ForwardBackwardItem
from lorafleet_trainer.engine import TrainerEngine
from lorafleet_trainer.snapshots import Snapshotter, prune
from lorafleet_trainer.tokenizer import tokenizer_files

if TYPE_CHECKING:
    from lorafleet_trainer.group import GroupEngine

T = TypeVar("T")
CHUNK_BYTES = 1 << 20
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(
        self,
        engine: TrainerEngine | GroupEngine,
        replica_id: str,
        snapshots: Snapshotter | None = None,
        shared_root: Path | None = None,
        model_path: Path | None = None,
        max_adapter_bytes: int = MAX_ADAPTER_BYTES,
    ) -> None:
        self.engine = engine
        self.max_adapter_bytes = max_adapter_bytes  # cap of one ImportAdapter stream
        self.replica_id = replica_id
        self.snapshots = snapshots
        self.shared_root = shared_root
        self.model_path = model_path  # where ExportTokenizer reads the tokenizer
        self._tokenizer: dict[str, bytes] | None = None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args))

    async def GetTrainerInfo(
        self, request: trainer_pb2.GetTrainerInfoRequest, context: ServerContext
    ) -> trainer_pb2.GetTrainerInfoResponse:
        info = self.engine.info()
        return trainer_pb2.GetTrainerInfoResponse(
            replica_id=self.replica_id,
            base_model=info["base_model"],
            num_slots=info["num_slots"],
            max_rank=info["max_rank"],
            loss_fns=info["loss_fns"],
            optimizers=info["optimizers"],
            vocab_size=info["vocab_size"],
            max_context_length=info["max_context_length"],
            incarnation=info["incarnation"],
            quantization=info["quantization"],
            modules=sorted(
                {n for s in self.engine.sites if s.adaptable for n in (s.name, s.module)}
            ),
        )

    async def ListSlots(
        self, request: trainer_pb2.ListSlotsRequest, context: ServerContext
    ) -> trainer_pb2.ListSlotsResponse:
        slots = await self._run(self.engine.list_slots)
        return trainer_pb2.ListSlotsResponse(slots=[convert.slot_to_proto(s) for s in slots])

    async def BindSlot(
        self, request: trainer_pb2.BindSlotRequest, context: ServerContext
    ) -> trainer_pb2.BindSlotResponse:
        spec = convert.spec_from_proto(request.lora_config)
        info = await self._run(self.engine.bind, request.slot, request.registration_id, spec)
        return trainer_pb2.BindSlotResponse(slot=convert.slot_to_proto(info))

    async def UnbindSlot(
        self, request: trainer_pb2.UnbindSlotRequest, context: ServerContext
    ) -> trainer_pb2.UnbindSlotResponse:
        await self._run(self.engine.unbind, request.slot, request.registration_id)
        return trainer_pb2.UnbindSlotResponse()

    def _addressed(self, incarnation: str) -> None:
        """A request addressed to another process of this trainer (one that died, whose slots
        this one may be rebuilding by replay) must change nothing here."""
        mine = self.engine.incarnation
        if incarnation and incarnation != mine:
            raise FailedPrecondition(
                f"addressed to trainer incarnation {incarnation}, this process is {mine}",
                field="incarnation",
                reason="STALE_INCARNATION",
            )

    async def ForwardBackward(
        self, request: trainer_pb2.ForwardBackwardRequest, context: ServerContext
    ) -> trainer_pb2.ForwardBackwardResponse:
        self._addressed(request.incarnation)
        items: list[ForwardBackwardItem] = []
        results: list[Any] = [None] * len(request.items)
        positions = []
        for i, it in enumerate(request.items):
            try:
                inp = convert.fb_input_from_payload(it.payload)
            except LorafleetError as exc:
                results[i] = exc
                continue
            positions.append(i)
            items.append(ForwardBackwardItem(it.operation_id, it.slot, it.registration_id, inp))
        outs = await self._run(self.engine.forward_backward, items) if items else []
        for i, out in zip(positions, outs, strict=True):
            results[i] = out
        response = trainer_pb2.ForwardBackwardResponse()
        for it, res in zip(request.items, results, strict=True):
            r = response.results.add(operation_id=it.operation_id)
            if isinstance(res, LorafleetError):
                r.error.CopyFrom(error_info(res))
            else:
                r.result, r.target_tokens = convert.fb_result(res)
        return response

    async def OptimStep(
        self, request: trainer_pb2.OptimStepRequest, context: ServerContext
    ) -> trainer_pb2.OptimStepResponse:
        self._addressed(request.incarnation)
        result, snapshot = await self._run(
            self._optim_step,
            request.operation_id,
            request.slot,
            request.registration_id,
            convert.adam_from_proto(request.adam_params),
        )
        response = trainer_pb2.OptimStepResponse(output=convert.optim_to_proto(result))
        if snapshot is not None:
            response.snapshot.operation_id = snapshot[0]
            response.snapshot.manifest.CopyFrom(convert.ref_to_proto(snapshot[1]))
        return response

    def _optim_step(self, operation_id: str, slot: int, registration_id: str, hp: Any) -> Any:
        """optim_step, then (same torch-thread turn) an automatic snapshot when one is due,
        and the slot's newest complete snapshot for the answer."""
        if self.snapshots is None:
            return self.engine.optim_step(operation_id, slot, registration_id, hp), None
        binding = self.engine.slots.leased(slot, registration_id)
        fresh = operation_id not in binding.ops  # a repeated id only gets its first result
        result = self.engine.optim_step(operation_id, slot, registration_id, hp)
        if fresh and result.applied:
            self.snapshots.after_step(slot, binding, operation_id)
        return result, self.snapshots.latest(slot, registration_id)

    async def SaveState(
        self, request: trainer_pb2.SaveStateRequest, context: ServerContext
    ) -> trainer_pb2.SaveStateResponse:
        self._addressed(request.incarnation)
        ref = await self._run(
            self.engine.save_state,
            request.operation_id,
            request.slot,
            request.registration_id,
            request.name,
            request.include_optimizer,
        )
        return trainer_pb2.SaveStateResponse(manifest=convert.ref_to_proto(ref))

    async def LoadState(
        self, request: trainer_pb2.LoadStateRequest, context: ServerContext
    ) -> trainer_pb2.LoadStateResponse:
        self._addressed(request.incarnation)
        await self._run(
            self.engine.load_state,
            request.operation_id,
            request.slot,
            request.registration_id,
            convert.ref_from_proto(request.manifest),
            request.include_optimizer,
        )
        return trainer_pb2.LoadStateResponse()

    async def ExportAdapter(
        self, request: trainer_pb2.ExportAdapterRequest, context: ServerContext
    ) -> AsyncIterator[trainer_pb2.ExportAdapterChunk]:
        folder = Path(tempfile.mkdtemp(prefix="lorafleet-export-"))
        try:
            await self._run(
                self.engine.export_adapter, request.slot, request.registration_id, folder
            )
            for name in ADAPTER_FILES:
                data = (folder / name).read_bytes()
                digest = hashlib.sha256(data).hexdigest()
                starts = range(0, max(len(data), 1), CHUNK_BYTES)
                for offset in starts:
                    last = offset + CHUNK_BYTES >= len(data)
                    yield trainer_pb2.ExportAdapterChunk(
                        chunk=common_pb2.FileChunk(
                            path=name,
                            offset=offset,
                            data=data[offset : offset + CHUNK_BYTES],
                            sha256=digest if last else "",
                        )
                    )
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    async def PruneSnapshots(
        self, request: trainer_pb2.PruneSnapshotsRequest, context: ServerContext
    ) -> trainer_pb2.PruneSnapshotsResponse:
        rid, root = request.registration_id, self.engine.storage_root
        keep = {resolve_uri(root, uri) for uri in request.keep_uris}
        if self.snapshots is not None:  # a write in progress must not land after the listing
            await asyncio.to_thread(self.snapshots.drain)
        removed = await asyncio.to_thread(prune, root, rid, keep)
        return trainer_pb2.PruneSnapshotsResponse(removed_uris=[p.as_uri() for p in removed])

    async def ExportTokenizer(
        self, request: trainer_pb2.ExportTokenizerRequest, context: ServerContext
    ) -> AsyncIterator[trainer_pb2.ExportTokenizerChunk]:
        if self.model_path is None:
            raise FailedPrecondition(
                "this trainer was started without a model folder to serve a tokenizer from",
                field="base_model",
                reason="NO_TOKENIZER",
            )
        if self._tokenizer is None:  # off the torch thread: training goes on meanwhile
            self._tokenizer = await asyncio.to_thread(tokenizer_files, self.model_path)
        for name, data in self._tokenizer.items():
            digest = hashlib.sha256(data).hexdigest()
            for offset in range(0, max(len(data), 1), CHUNK_BYTES):
                last = offset + CHUNK_BYTES >= len(data)
                yield trainer_pb2.ExportTokenizerChunk(
                    chunk=common_pb2.FileChunk(
                        path=name,
                        offset=offset,
                        data=data[offset : offset + CHUNK_BYTES],
                        sha256=digest if last else "",
                    )
                )

    async def WriteSharedAdapter(
        self, request: trainer_pb2.WriteSharedAdapterRequest, context: ServerContext
    ) -> trainer_pb2.WriteSharedAdapterResponse:
        """Publish by reference (lorafleet.shared_storage): the folder is written next to its
        final place on the shared root, then renamed in; hashing runs off the event loop."""
        if self.shared_root is None:
            raise FailedPrecondition(
                "this trainer has no shared adapter root (LORAFLEET_TRAINER_SHARED_ADAPTER_ROOT)",
                field="shared_adapter_root",
                reason="NOT_SHARED",
            )
        final = shared_storage.adapter_folder(
            self.shared_root, request.registration_id, request.version
        )
        if not await asyncio.to_thread(final.is_dir):
            staged = final.with_name(f".tmp-{request.version}-{uuid.uuid4().hex}")
            try:
                await self._run(
                    self.engine.export_adapter, request.slot, request.registration_id, staged
                )
                await asyncio.to_thread(shared_storage.publish_folder, staged, final)
            finally:
                await asyncio.to_thread(shutil.rmtree, staged, ignore_errors=True)
        refs = await asyncio.to_thread(shared_storage.describe, final)
        return trainer_pb2.WriteSharedAdapterResponse(
            files={
                name: common_pb2.BlobRef(uri=r.uri, sha256=r.sha256, size_bytes=r.size_bytes)
                for name, r in refs.items()
            }
        )

    async def ImportAdapter(
        self,
        request_iterator: AsyncIterator[trainer_pb2.ImportAdapterChunk],
        context: ServerContext,
    ) -> trainer_pb2.ImportAdapterResponse:
        """The two PEFT files, staged through lorafleet.staging's walls (plain names, the
        size cap, in-order chunks, each file's SHA-256) before the engine reads them."""
        upload = ChunkedUpload(
            Path(tempfile.gettempdir()), self.max_adapter_bytes, names=ADAPTER_FILES
        )
        try:
            header = None
            async for part in request_iterator:
                if part.HasField("header"):
                    if header is not None:
                        raise InvalidArgument(
                            "only the first message may be a header", field="header"
                        )
                    header = part.header
                    continue
                if header is None:
                    raise InvalidArgument("the first message must be the header", field="header")
                c = part.chunk
                upload.write(c.path, c.offset, c.data, c.sha256)
            if header is None:
                raise InvalidArgument("the stream carried no header", field="header")
            upload.require_complete(ADAPTER_FILES)
            await self._run(
                self.engine.import_adapter,
                header.operation_id,
                header.slot,
                header.registration_id,
                upload.folder,
            )
            return trainer_pb2.ImportAdapterResponse()
        finally:
            await asyncio.to_thread(upload.discard)
