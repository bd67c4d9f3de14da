"""Training-run and checkpoint views, signed download URLs and the downloads themselves.

checkpoint_id is "<kind>/<name>" (it contains a slash), so the routes spell it as two path
segments; `{kind:checkpoint_kind}` matches only the kinds a tinker path has, so a path with
any other id (say the SDK's "checkpoint-123") matches no route at all: 404, never 405.
"""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from starlette.convertors import Convertor, register_url_convertor

from lorafleet.contract import CheckpointKind, TinkerPath
from lorafleet_gateway.deps import Areas, Tenant
from lorafleet_gateway.protocol import (
    ArchiveUrlResponse,
    CheckpointsListResponse,
    CheckpointView,
    Empty,
    ExternalWeightsUrlsResponse,
    TrainingRun,
    TrainingRunsResponse,
    TtlRequest,
)


class CheckpointKindConvertor(Convertor[str]):
    regex = "|".join(k.value for k in CheckpointKind)

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("checkpoint_kind", CheckpointKindConvertor())

router = APIRouter(prefix="/api/v1", tags=["checkpoints"])
CHECKPOINT = "/training_runs/{run_id}/checkpoints/{kind:checkpoint_kind}/{name}"
Limit = Query(20, ge=1, le=1000)
Offset = Query(0, ge=0, lt=2**31)
_BINARY = {"schema": {"type": "string", "format": "binary"}}


def _path(run_id: str, kind: CheckpointKind, name: str) -> TinkerPath:
    return TinkerPath.from_parts(run_id, kind, name, "checkpoint_id")


@router.get("/training_runs")
async def list_training_runs(
    tenant: Tenant, serving: Areas, limit: int = Limit, offset: int = Offset
) -> TrainingRunsResponse:
    return await serving.checkpoints.list_runs(tenant, limit, offset)


@router.get("/training_runs/{run_id}")
async def get_training_run(run_id: str, tenant: Tenant, serving: Areas) -> TrainingRun:
    return await serving.checkpoints.get_run(tenant, run_id)


@router.get("/training_runs/{run_id}/checkpoints")
async def list_run_checkpoints(
    run_id: str, tenant: Tenant, serving: Areas
) -> CheckpointsListResponse:
    return await serving.checkpoints.list(tenant, run_id, 1000, 0)


@router.get("/checkpoints")
async def list_checkpoints(
    tenant: Tenant, serving: Areas, limit: int = Query(100, ge=1, le=1000), offset: int = Offset
) -> CheckpointsListResponse:
    return await serving.checkpoints.list(tenant, "", limit, offset)


@router.get(CHECKPOINT)
async def get_checkpoint(
    run_id: str, kind: CheckpointKind, name: str, tenant: Tenant, serving: Areas
) -> CheckpointView:
    return await serving.checkpoints.get(tenant, _path(run_id, kind, name))


@router.delete(CHECKPOINT)
async def delete_checkpoint(
    run_id: str, kind: CheckpointKind, name: str, tenant: Tenant, serving: Areas
) -> Empty:
    await serving.checkpoints.delete(tenant, _path(run_id, kind, name))
    return Empty()


@router.post(CHECKPOINT + "/publish")
async def publish(
    run_id: str, kind: CheckpointKind, name: str, tenant: Tenant, serving: Areas
) -> CheckpointView:
    return await serving.checkpoints.set_public(tenant, _path(run_id, kind, name), True)


@router.delete(CHECKPOINT + "/publish")
async def unpublish(
    run_id: str, kind: CheckpointKind, name: str, tenant: Tenant, serving: Areas
) -> CheckpointView:
    return await serving.checkpoints.set_public(tenant, _path(run_id, kind, name), False)


@router.put(CHECKPOINT + "/ttl")
async def set_ttl(
    run_id: str, kind: CheckpointKind, name: str, body: TtlRequest, tenant: Tenant, serving: Areas
) -> CheckpointView:
    return await serving.checkpoints.set_ttl(tenant, _path(run_id, kind, name), body.ttl_seconds)


@router.get(CHECKPOINT + "/archive")
async def archive_url(
    run_id: str, kind: CheckpointKind, name: str, request: Request, tenant: Tenant, serving: Areas
) -> ArchiveUrlResponse:
    path = _path(run_id, kind, name)
    return await serving.checkpoints.archive_url(tenant, path, str(request.base_url))


@router.get(CHECKPOINT + "/external_weights_urls")
async def external_weights_urls(
    run_id: str, kind: CheckpointKind, name: str, request: Request, tenant: Tenant, serving: Areas
) -> ExternalWeightsUrlsResponse:
    path = _path(run_id, kind, name)
    return await serving.checkpoints.external_weights_urls(tenant, path, str(request.base_url))


@router.get(
    "/downloads/{token}/archive.tar",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-tar": _BINARY}}},
)
async def download_archive(token: str, serving: Areas) -> StreamingResponse:
    file_name, stream = await serving.checkpoints.archive(token)
    return StreamingResponse(
        stream,
        media_type="application/x-tar",
        headers={"Content-Disposition": f'attachment; filename="{file_name}"'},
    )


@router.get(
    "/downloads/{token}/files/{file_path:path}",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": _BINARY}}},
)
async def download_file(token: str, file_path: str, serving: Areas) -> StreamingResponse:
    """With its Content-Length, so a response cut off by a damaged file is seen as short."""
    size, body = await serving.checkpoints.file(token, file_path)
    return StreamingResponse(
        body, media_type="application/octet-stream", headers={"Content-Length": str(size)}
    )
