"""REST views of training runs and checkpoints, and checkpoint downloads (tinker-api.md §6.5).

Downloads are signed URLs back to this gateway (see signing.py): 0.24.1's archive endpoint
answers {url, expires} for a tar; 0.38's external_weights_urls answers one URL per file. The
download routes stream from the controller's DownloadCheckpoint.
"""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import AsyncIterator

from lorafleet import errors
from lorafleet.contract import TinkerPath
from lorafleet.v1 import controller_pb2 as cpb
from lorafleet_gateway import archive, views
from lorafleet_gateway.controller import ControllerClient
from lorafleet_gateway.protocol import (
    ArchiveUrlResponse,
    CheckpointsListResponse,
    CheckpointView,
    ExternalWeightsUrlsResponse,
    TrainingRun,
    TrainingRunsResponse,
)
from lorafleet_gateway.settings import GatewaySettings
from lorafleet_gateway.signing import Signer


class CheckpointServing:
    def __init__(
        self, controller: ControllerClient, settings: GatewaySettings, signer: Signer
    ) -> None:
        self._controller = controller
        self._settings = settings
        self._signer = signer

    async def list_runs(self, tenant: str, limit: int, offset: int) -> TrainingRunsResponse:
        request = cpb.ListRegistrationsRequest(tenant=tenant, limit=limit, offset=offset)
        reply = await self._controller.list_registrations(request)
        return TrainingRunsResponse(
            training_runs=[views.training_run(r) for r in reply.registrations],
            cursor=views.cursor(offset, limit, reply.total),
        )

    async def get_run(self, tenant: str, run_id: str) -> TrainingRun:
        request = cpb.GetRegistrationRequest(tenant=tenant, registration_id=run_id)
        return views.training_run((await self._controller.get_registration(request)).registration)

    async def list(
        self, tenant: str, run_id: str, limit: int, offset: int
    ) -> CheckpointsListResponse:
        """The run's checkpoints, or all of the tenant's when `run_id` is empty."""
        request = cpb.ListCheckpointsRequest(
            tenant=tenant, training_run_id=run_id, limit=limit, offset=offset
        )
        reply = await self._controller.list_checkpoints(request)
        return CheckpointsListResponse(
            checkpoints=[views.checkpoint(c) for c in reply.checkpoints],
            cursor=views.cursor(offset, limit, reply.total),
        )

    async def get(self, tenant: str, path: TinkerPath) -> CheckpointView:
        request = cpb.GetCheckpointRequest(tenant=tenant, tinker_path=views.controller_path(path))
        return views.checkpoint((await self._controller.get_checkpoint(request)).checkpoint)

    async def delete(self, tenant: str, path: TinkerPath) -> None:
        request = cpb.DeleteCheckpointRequest(
            tenant=tenant, tinker_path=views.controller_path(path)
        )
        await self._controller.delete_checkpoint(request)

    async def set_public(self, tenant: str, path: TinkerPath, public: bool) -> CheckpointView:
        request = cpb.UpdateCheckpointRequest(
            tenant=tenant, tinker_path=views.controller_path(path), public=public
        )
        return views.checkpoint((await self._controller.update_checkpoint(request)).checkpoint)

    async def set_ttl(self, tenant: str, path: TinkerPath, ttl: int | None) -> CheckpointView:
        request = cpb.UpdateCheckpointRequest(
            tenant=tenant, tinker_path=views.controller_path(path)
        )
        if ttl is None:
            request.clear_ttl = True
        elif ttl <= 0:
            raise errors.InvalidArgument(
                "must be > 0 (or null to remove the TTL)", field="ttl_seconds"
            )
        else:
            request.ttl_seconds = ttl
        return views.checkpoint((await self._controller.update_checkpoint(request)).checkpoint)

    async def _signed(self, tenant: str, path: str, base_url: str) -> tuple[str, str | None]:
        """Check the checkpoint exists (404 now, not at download time); sign a URL base."""
        request = cpb.GetCheckpointRequest(tenant=tenant, tinker_path=path)
        await self._controller.get_checkpoint(request)
        expires = time.time() + self._settings.download_ttl_seconds
        token = self._signer.sign(tenant, path, expires)
        base = self._settings.public_url.rstrip("/") or base_url.rstrip("/")
        return f"{base}/api/v1/downloads/{token}", views.iso(expires)

    async def archive_url(self, tenant: str, path: TinkerPath, base_url: str) -> ArchiveUrlResponse:
        base, expires = await self._signed(tenant, views.controller_path(path), base_url)
        return ArchiveUrlResponse(url=f"{base}/archive.tar", expires=expires)

    async def external_weights_urls(
        self, tenant: str, path: TinkerPath, base_url: str
    ) -> ExternalWeightsUrlsResponse:
        stored = views.controller_path(path)
        base, expires = await self._signed(tenant, stored, base_url)
        urls = {
            file_name: f"{base}/files/{urllib.parse.quote(file_name)}"
            for file_name in await archive.names(self._controller, tenant, stored)
        }
        return ExternalWeightsUrlsResponse(urls=urls, expires=expires)

    async def archive(self, token: str) -> tuple[str, AsyncIterator[bytes]]:
        """(file name, tar stream) of a signed token's checkpoint; errors found before the
        first byte (a missing or refused checkpoint) surface as a status code, later ones
        cut the response off."""
        tenant, path = self._signer.verify(token)
        stream = archive.chunks(self._controller, tenant, path)
        first = await anext(stream, None)
        if first is None:
            raise errors.NotFound("checkpoint has no files", field="token")
        name = path.rsplit("/", 1)[-1]
        return f"{name}.tar", archive.tar_stream(first, stream)

    async def file(self, token: str, file_path: str) -> tuple[int, AsyncIterator[bytes]]:
        """(size, bytes) of one file of a signed token's checkpoint, streamed; errors found
        before its first byte surface as a status code."""
        tenant, path = self._signer.verify(token)
        stream = archive.chunks(self._controller, tenant, path)
        async for chunk in stream:
            if chunk.path == file_path and chunk.offset == 0:
                return chunk.size_bytes, archive.file_body(chunk, stream)
        raise errors.NotFound(f"no file {file_path!r} in the checkpoint", field="file_path")
