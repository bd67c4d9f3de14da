"""REST views of training runs and checkpoints, and checkpoint downloads (tinker-api.md §6.5).

checkpoint_id is "<kind>/<name>" (it contains a slash), so the routes spell it as two path
segments. Downloads are signed URLs back to this gateway (see signing.py): 0.24.1's archive
endpoint answers {url, expires} for a tar; 0.38's external_weights_urls answers one URL per
file. The download routes stream from the controller's DownloadCheckpoint.
"""

from __future__ import annotations

import time
import urllib.parse

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse

from lorafleet import errors
from lorafleet.v1 import controller_pb2 as cpb
from lorafleet_gateway import archive, views
from lorafleet_gateway.deps import Ctl, Settings, Tenant
from lorafleet_gateway.protocol import TtlRequest

router = APIRouter(prefix="/api/v1", tags=["checkpoints"])
CHECKPOINT = "/training_runs/{run_id}/checkpoints/{kind}/{name}"
Limit = Query(20, ge=1, le=1000)
Offset = Query(0, ge=0, lt=2**31)


@router.get("/training_runs")
async def list_training_runs(
    tenant: Tenant, ctl: Ctl, limit: int = Limit, offset: int = Offset
) -> dict:
    request = cpb.ListRegistrationsRequest(tenant=tenant, limit=limit, offset=offset)
    reply = await ctl.call("ListRegistrations", request)
    return {
        "training_runs": [views.training_run(r) for r in reply.registrations],
        "cursor": views.cursor(offset, limit, reply.total),
    }


@router.get("/training_runs/{run_id}")
async def get_training_run(run_id: str, tenant: Tenant, ctl: Ctl) -> dict:
    request = cpb.GetRegistrationRequest(tenant=tenant, registration_id=run_id)
    return views.training_run((await ctl.call("GetRegistration", request)).registration)


async def _list(ctl: Ctl, tenant: str, run_id: str, limit: int, offset: int) -> dict:
    request = cpb.ListCheckpointsRequest(
        tenant=tenant, training_run_id=run_id, limit=limit, offset=offset
    )
    reply = await ctl.call("ListCheckpoints", request)
    return {
        "checkpoints": [views.checkpoint(c) for c in reply.checkpoints],
        "cursor": views.cursor(offset, limit, reply.total),
    }


@router.get("/training_runs/{run_id}/checkpoints")
async def list_run_checkpoints(run_id: str, tenant: Tenant, ctl: Ctl) -> dict:
    return await _list(ctl, tenant, run_id, 1000, 0)


@router.get("/checkpoints")
async def list_checkpoints(
    tenant: Tenant, ctl: Ctl, limit: int = Query(100, ge=1, le=1000), offset: int = Offset
) -> dict:
    return await _list(ctl, tenant, "", limit, offset)


def _path(run_id: str, kind: str, name: str) -> str:
    return views.controller_path(views.checkpoint_path(run_id, f"{kind}/{name}"))


@router.delete(CHECKPOINT)
async def delete_checkpoint(run_id: str, kind: str, name: str, tenant: Tenant, ctl: Ctl) -> dict:
    request = cpb.DeleteCheckpointRequest(tenant=tenant, tinker_path=_path(run_id, kind, name))
    await ctl.call("DeleteCheckpoint", request)
    return {}


async def _update(ctl: Ctl, request: cpb.UpdateCheckpointRequest) -> dict:
    return views.checkpoint((await ctl.call("UpdateCheckpoint", request)).checkpoint)


@router.post(CHECKPOINT + "/publish")
async def publish(run_id: str, kind: str, name: str, tenant: Tenant, ctl: Ctl) -> dict:
    path = _path(run_id, kind, name)
    return await _update(
        ctl, cpb.UpdateCheckpointRequest(tenant=tenant, tinker_path=path, public=True)
    )


@router.delete(CHECKPOINT + "/publish")
async def unpublish(run_id: str, kind: str, name: str, tenant: Tenant, ctl: Ctl) -> dict:
    path = _path(run_id, kind, name)
    return await _update(
        ctl, cpb.UpdateCheckpointRequest(tenant=tenant, tinker_path=path, public=False)
    )


@router.put(CHECKPOINT + "/ttl")
async def set_ttl(
    run_id: str, kind: str, name: str, body: TtlRequest, tenant: Tenant, ctl: Ctl
) -> dict:
    request = cpb.UpdateCheckpointRequest(tenant=tenant, tinker_path=_path(run_id, kind, name))
    if body.ttl_seconds is None:
        request.clear_ttl = True
    elif body.ttl_seconds <= 0:
        raise errors.InvalidArgument("must be > 0 (or null to remove the TTL)", field="ttl_seconds")
    else:
        request.ttl_seconds = body.ttl_seconds
    return await _update(ctl, request)


def _download_base(request: Request, settings: Settings, token: str) -> str:
    base = settings.public_url.rstrip("/") or str(request.base_url).rstrip("/")
    return f"{base}/api/v1/downloads/{token}"


async def _signed(request: Request, settings: Settings, tenant: str, ctl: Ctl, path: str):
    """Check the checkpoint exists (404 now, not at download time); sign a URL base for it."""
    await ctl.call("GetCheckpoint", cpb.GetCheckpointRequest(tenant=tenant, tinker_path=path))
    expires = time.time() + settings.download_ttl_seconds
    token = request.app.state.signer.sign(tenant, path, expires)
    return _download_base(request, settings, token), views.iso(expires)


@router.get(CHECKPOINT + "/archive")
async def archive_url(
    run_id: str,
    kind: str,
    name: str,
    request: Request,
    tenant: Tenant,
    ctl: Ctl,
    settings: Settings,
) -> dict:
    base, expires = await _signed(request, settings, tenant, ctl, _path(run_id, kind, name))
    return {"url": f"{base}/archive.tar", "expires": expires}


@router.get(CHECKPOINT + "/external_weights_urls")
async def external_weights_urls(
    run_id: str,
    kind: str,
    name: str,
    request: Request,
    tenant: Tenant,
    ctl: Ctl,
    settings: Settings,
) -> dict:
    path = _path(run_id, kind, name)
    base, expires = await _signed(request, settings, tenant, ctl, path)
    urls = {}
    async for file_name, _ in archive.files(ctl, tenant, path):
        urls[file_name] = f"{base}/files/{urllib.parse.quote(file_name)}"
    return {"urls": urls, "expires": expires}


@router.get("/downloads/{token}/archive.tar")
async def download_archive(token: str, request: Request, ctl: Ctl) -> Response:
    tenant, path = request.app.state.signer.verify(token)
    stream = archive.files(ctl, tenant, path)
    first = await anext(stream, None)  # errors surface as a status code, before streaming
    if first is None:
        raise errors.NotFound("checkpoint has no files", field="token")
    name = path.rsplit("/", 1)[-1]
    return StreamingResponse(
        archive.tar_stream(first, stream),
        media_type="application/x-tar",
        headers={"Content-Disposition": f'attachment; filename="{name}.tar"'},
    )


@router.get("/downloads/{token}/files/{file_path:path}")
async def download_file(token: str, file_path: str, request: Request, ctl: Ctl) -> Response:
    tenant, path = request.app.state.signer.verify(token)
    async for file_name, data in archive.files(ctl, tenant, path):
        if file_name == file_path:
            return Response(data, media_type="application/octet-stream")
    raise errors.NotFound(f"no file {file_path!r} in the checkpoint", field="file_path")
