"""Managed training jobs, juno's REST paths under /v1/lora (issue 13).

`POST /v1/lora/train-qa` (one pair), `/train-file-qa` (a JSON array of pairs, or multipart
with a .json `file`), `/train` (text), `/train-file` (a text file), `/save`, `/reset`;
`GET /v1/lora/jobs`, `/v1/lora/jobs/{id}`, `/v1/lora/jobs/{id}/events` (server-sent
events) and `POST /v1/lora/jobs/{id}/cancel`. Bodies are read raw (JSON, text or
multipart), so the serving layer parses them; parameters come from the query string.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from lorafleet_gateway import lora_protocol as lp
from lorafleet_gateway.deps import Areas, Tenant

router = APIRouter(prefix="/v1/lora", tags=["jobs"])
TRAIN_ROUTES = ("train-qa", "train-file-qa", "train", "train-file", "save")
# Routes that carry training data: the gateway's large-body limit applies to them.
DATA_ROUTES = frozenset(f"{router.prefix}/{r}" for r in TRAIN_ROUTES)


def _train_route(route: str) -> None:
    async def handler(request: Request, tenant: Tenant, areas: Areas) -> lp.Job:
        return await areas.jobs.create(
            tenant,
            route,
            dict(request.query_params),
            await request.body(),
            request.headers.get("content-type", ""),
        )

    handler.__name__ = route.replace("-", "_")
    router.post(
        f"/{route}",
        summary=f"juno's /{route}: create a job (waits unless wait=false)",
        response_model_exclude_unset=True,
    )(handler)


for _route in TRAIN_ROUTES:
    _train_route(_route)


@router.post("/reset")
async def reset(tenant: Tenant, areas: Areas) -> lp.ResetRun:
    return await areas.jobs.reset(tenant)


@router.get("/jobs", response_model_exclude_unset=True)
async def list_jobs(
    tenant: Tenant,
    areas: Areas,
    limit: int = Query(20, ge=1, le=1000),
    offset: int = Query(0, ge=0, lt=2**31),
) -> lp.JobList:
    return await areas.jobs.list(tenant, limit, offset)


@router.get("/jobs/{job_id}", response_model_exclude_unset=True)
async def get_job(job_id: str, tenant: Tenant, areas: Areas) -> lp.Job:
    return await areas.jobs.get(tenant, job_id)


@router.post("/jobs/{job_id}/cancel", response_model_exclude_unset=True)
async def cancel_job(job_id: str, tenant: Tenant, areas: Areas) -> lp.Job:
    return await areas.jobs.cancel(tenant, job_id)


@router.get(
    "/jobs/{job_id}/events",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}}},
)
async def job_events(job_id: str, tenant: Tenant, areas: Areas) -> StreamingResponse:
    events = areas.jobs.events(tenant, job_id)
    first = await anext(events)  # an unknown job is a 404 here, before the stream starts

    async def stream() -> Any:
        yield first
        async for event in events:
            yield event

    return StreamingResponse(
        stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )
