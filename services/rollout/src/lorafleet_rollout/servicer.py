"""RolloutService over gRPC: protos in, domain calls on RolloutCore, protos out.

No logic lives here beyond translation; errors are lorafleet exceptions that the shared
interceptor maps to status codes. Proto3 cannot tell an unset float from 0, so top_p == 0
means "unset" (Tinker's default 1.0) and num_samples == 0 means 1; top_k 0 or -1 is off;
max_tokens 0 means up to the context length.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

from lorafleet import contract, quantize
from lorafleet.errors import FailedPrecondition, InvalidArgument
from lorafleet.rpc.types import ServerContext
from lorafleet.shared_storage import FileRef
from lorafleet.staging import ChunkedUpload
from lorafleet.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from lorafleet_rollout import metrics
from lorafleet_rollout.core import RolloutCore
from lorafleet_rollout.shared_read import stage_refs
from lorafleet_rollout.types import LoraSpec, SampleRequest, SampleResult, SamplingSpec

_STOP = {"stop": common_pb2.STOP_REASON_STOP, "length": common_pb2.STOP_REASON_LENGTH}


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(
        self,
        core: RolloutCore,
        replica_id: str,
        base_model: str = "",
        shared_root: Path | None = None,
        quantization: str = quantize.NONE,
    ) -> None:
        self.core = core
        self.replica_id = replica_id
        self.base_model = base_model
        self.shared_root = shared_root
        self.quantization = quantization

    async def GetRolloutInfo(
        self, request: rollout_pb2.GetRolloutInfoRequest, context: ServerContext
    ) -> rollout_pb2.GetRolloutInfoResponse:
        info = self.core.info()
        return rollout_pb2.GetRolloutInfoResponse(
            replica_id=self.replica_id,
            base_model=self.base_model or info.base_model,
            engine=info.engine,
            max_loaded_adapters=self.core.max_loaded_adapters,
            max_queued_requests=self.core.limits.max_queued_requests,
            max_lora_rank=info.max_lora_rank,
            max_context_length=info.max_context_length,
            incarnation=self.core.incarnation,
            max_num_samples=self.core.limits.max_num_samples,
            quantization=self.quantization,
        )

    async def LoadAdapter(
        self,
        request_iterator: AsyncIterator[rollout_pb2.LoadAdapterChunk],
        context: ServerContext,
    ) -> rollout_pb2.LoadAdapterResponse:
        header: rollout_pb2.AdapterHeader | None = None
        upload = ChunkedUpload(self.core.adapter_dir, self.core.limits.max_adapter_bytes)
        try:
            async for message in request_iterator:
                if message.HasField("header"):
                    if header is not None:
                        raise InvalidArgument("a second header arrived", field="header")
                    header = message.header
                elif header is None:
                    raise InvalidArgument("the first message must be the header", field="header")
                else:
                    c = message.chunk
                    upload.write(c.path, c.offset, c.data, c.sha256)
            if header is None:
                raise InvalidArgument("the stream carried no header", field="header")
            if header.file_refs:
                await self._read_shared(header, upload)
            cfg = header.lora_config
            lora = LoraSpec(
                rank=cfg.rank,
                alpha=contract.effective_alpha(cfg.alpha),
                target_modules=tuple(cfg.target_modules),
            )
            engine_id, already = await self.core.load_adapter(
                header.adapter.registration_id,
                header.adapter.version,
                lora,
                upload.folder,
                dict(header.file_sha256)
                or {name: ref.sha256 for name, ref in header.file_refs.items()},
                upload.digests(),
                tenant=header.tenant,
            )
            metrics.ADAPTER_PUSHES.labels(via="shared" if header.file_refs else "stream").inc()
        finally:
            upload.discard()
        return rollout_pb2.LoadAdapterResponse(adapter_id=engine_id, already_loaded=already)

    async def _read_shared(self, header: rollout_pb2.AdapterHeader, upload: ChunkedUpload) -> None:
        """Published by reference: no chunks came; read the files from shared storage."""
        if self.shared_root is None:
            raise FailedPrecondition(
                "this replica has no shared adapter root (LORAFLEET_ROLLOUT_SHARED_ADAPTER_ROOT)",
                field="header.file_refs",
                reason="NOT_SHARED",
            )
        if upload.digests():
            raise InvalidArgument("file chunks and file_refs together", field="header.file_refs")
        refs = {
            name: FileRef(r.uri, r.sha256, r.size_bytes) for name, r in header.file_refs.items()
        }
        await asyncio.to_thread(stage_refs, upload, self.shared_root, refs)

    async def UnloadAdapter(
        self, request: rollout_pb2.UnloadAdapterRequest, context: ServerContext
    ) -> rollout_pb2.UnloadAdapterResponse:
        await self.core.unload_adapter(request.adapter.registration_id, request.adapter.version)
        return rollout_pb2.UnloadAdapterResponse()

    async def ListAdapters(
        self, request: rollout_pb2.ListAdaptersRequest, context: ServerContext
    ) -> rollout_pb2.ListAdaptersResponse:
        return rollout_pb2.ListAdaptersResponse(
            adapters=[
                rollout_pb2.ResidentAdapter(
                    adapter=common_pb2.AdapterRef(
                        registration_id=r.registration_id, version=r.version
                    ),
                    adapter_id=r.adapter_id,
                    rank=r.rank,
                    in_flight=r.in_flight,
                    loaded=r.loaded,
                    tenant=r.tenant,
                )
                for r in self.core.list_adapters()
                if not r.retiring
            ]
        )

    async def Sample(
        self, request: rollout_pb2.SampleRequest, context: ServerContext
    ) -> rollout_pb2.SampleResponse:
        result = await self.core.sample(
            request.adapter.registration_id, request.adapter.version, sample_request(request)
        )
        return rollout_pb2.SampleResponse(output=sample_output(result))


def sample_request(request: rollout_pb2.SampleRequest) -> SampleRequest:
    p = request.params
    return SampleRequest(
        adapter_id=None,
        prompt_tokens=tuple(request.prompt_tokens),
        params=SamplingSpec(
            max_tokens=p.max_tokens,
            temperature=p.temperature,
            top_p=1.0 if p.top_p == 0 else p.top_p,
            top_k=p.top_k,
            stop_strings=tuple(p.stop_strings),
            stop_token_ids=tuple(p.stop_token_ids),
            disable_eos_stop=p.disable_eos_stop,
            seed=p.seed if p.HasField("seed") else None,
        ),
        num_samples=request.num_samples or 1,
        prompt_logprobs=request.prompt_logprobs,
        topk_prompt_logprobs=request.topk_prompt_logprobs,
    )


def sample_output(result: SampleResult) -> common_pb2.SampleOutput:
    return common_pb2.SampleOutput(
        sequences=[
            common_pb2.SampledSequence(
                tokens=s.tokens, logprobs=s.logprobs, stop_reason=_STOP[s.stop_reason]
            )
            for s in result.sequences
        ],
        prompt_logprobs=result.prompt_logprobs,
        topk_prompt_logprobs=[
            common_pb2.TopKLogprobs(token_ids=[t for t, _ in row], logprobs=[lp for _, lp in row])
            for row in result.topk_prompt_logprobs
        ],
    )
