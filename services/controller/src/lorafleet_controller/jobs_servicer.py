"""JobService: translates job RPCs to `jobs.runner.JobRunner` calls and records to messages.

No logic here: failures are `lorafleet.errors` exceptions the shared interceptor maps to
status codes, as for ControllerService.
"""

from __future__ import annotations

from lorafleet import errors
from lorafleet.rpc.types import ServerContext
from lorafleet.v1 import common_pb2, jobs_pb2, jobs_pb2_grpc
from lorafleet_controller.jobs.data import Pair
from lorafleet_controller.jobs.params import JobKind
from lorafleet_controller.jobs.records import JobRecord, JobState
from lorafleet_controller.jobs.runner import JobRunner

MAX_WAIT_SECONDS = 60.0
KINDS = {
    jobs_pb2.JOB_KIND_QA: JobKind.QA,
    jobs_pb2.JOB_KIND_TEXT: JobKind.TEXT,
    jobs_pb2.JOB_KIND_SAVE: JobKind.SAVE,
}
KIND_ENUM = {v.value: k for k, v in KINDS.items()}
STATES = {
    JobState.QUEUED: jobs_pb2.JOB_STATE_QUEUED,
    JobState.RUNNING: jobs_pb2.JOB_STATE_RUNNING,
    JobState.SUCCEEDED: jobs_pb2.JOB_STATE_SUCCEEDED,
    JobState.FAILED: jobs_pb2.JOB_STATE_FAILED,
    JobState.CANCELLED: jobs_pb2.JOB_STATE_CANCELLED,
}


def job_message(rec: JobRecord, curve: bool = True) -> jobs_pb2.Job:
    cursor = rec.cursor or {}
    points = [*cursor.get("curve", []), *rec.live]
    kind = KIND_ENUM.get(rec.kind, jobs_pb2.JOB_KIND_UNSPECIFIED)
    job = jobs_pb2.Job(
        job_id=rec.job_id,
        tenant=rec.tenant,
        kind=kind,
        registration_id=rec.registration_id,
        base_model=rec.base_model,
        state=STATES[rec.state],
        params=rec.params,
        passes=cursor.get("passes", 0),
        updates=points[-1]["update"] if points else 0,
        max_updates=rec.max_updates,
        created_at=rec.created_at,
        started_at=rec.started_at,
        finished_at=rec.finished_at,
        version=rec.version,
    )
    for name in ("train_loss", "validation_loss"):
        if cursor.get(name) is not None:
            setattr(job, name, cursor[name])
    for summary in cursor.get("history", []):
        job.history.add(pass_number=summary["pass"], train_loss=summary["train_loss"])
        if summary["validation_loss"] is not None:
            job.history[-1].validation_loss = summary["validation_loss"]
    if curve:
        job.curve.extend(
            jobs_pb2.JobPoint(
                pass_number=pt["pass"], update=pt["update"], loss=pt["loss"], learning_rate=pt["lr"]
            )
            for pt in points
        )
    if rec.result:
        job.result.CopyFrom(
            jobs_pb2.JobResult(**{k: v for k, v in rec.result.items() if v is not None})
        )
    if rec.error:
        job.error.CopyFrom(
            common_pb2.ErrorInfo(
                category=common_pb2.ERROR_CATEGORY_USER
                if rec.error.get("category") == "user"
                else common_pb2.ERROR_CATEGORY_SERVER,
                field=rec.error.get("field", ""),
                message=rec.error.get("message", ""),
                reason=rec.error.get("reason", ""),
            )
        )
    return job


class JobServicer(jobs_pb2_grpc.JobServiceServicer):
    def __init__(self, runner: JobRunner) -> None:
        self.runner = runner

    async def CreateJob(
        self, request: jobs_pb2.CreateJobRequest, context: ServerContext
    ) -> jobs_pb2.CreateJobResponse:
        kind = KINDS.get(request.kind)
        if kind is None:
            raise errors.InvalidArgument("must be QA, TEXT or SAVE", field="kind")
        rec = await self.runner.create(
            request.tenant,
            kind,
            request.registration_id,
            request.base_model,
            dict(request.params),
            [Pair(p.question, p.answer) for p in request.pairs],
            list(request.documents),
        )
        return jobs_pb2.CreateJobResponse(job=job_message(rec))

    async def GetJob(
        self, request: jobs_pb2.GetJobRequest, context: ServerContext
    ) -> jobs_pb2.GetJobResponse:
        wait = min(max(0.0, request.wait_seconds), MAX_WAIT_SECONDS)
        rec = await self.runner.records.wait(
            request.tenant, request.job_id, request.after_version, wait
        )
        return jobs_pb2.GetJobResponse(job=job_message(rec))

    async def ListJobs(
        self, request: jobs_pb2.ListJobsRequest, context: ServerContext
    ) -> jobs_pb2.ListJobsResponse:
        limit = request.limit if request.limit > 0 else 20
        if request.offset < 0:
            raise errors.InvalidArgument("must be >= 0", field="offset")
        recs, total = await self.runner.records.list_jobs(
            request.tenant, min(limit, 1000), request.offset
        )
        return jobs_pb2.ListJobsResponse(
            jobs=[job_message(r, curve=False) for r in recs], total=total
        )

    async def CancelJob(
        self, request: jobs_pb2.CancelJobRequest, context: ServerContext
    ) -> jobs_pb2.CancelJobResponse:
        rec = await self.runner.cancel(request.tenant, request.job_id)
        return jobs_pb2.CancelJobResponse(job=job_message(rec))

    async def ResetDefaultRun(
        self, request: jobs_pb2.ResetDefaultRunRequest, context: ServerContext
    ) -> jobs_pb2.ResetDefaultRunResponse:
        rid = await self.runner.reset_default(request.tenant)
        return jobs_pb2.ResetDefaultRunResponse(registration_id=rid)
