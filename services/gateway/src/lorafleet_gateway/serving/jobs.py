"""Managed training jobs over REST (juno's paths under /v1/lora): requests → JobsClient.

Juno's clients send a bare JSON array of `{"Q": ..., "A": ...}` with only an API key, so a
request may name nothing but its data: parameters ride in the query string (or a JSON object
`{"pairs": [...], "params": {...}}`), the run defaults to the caller's default run, and the
call waits for the job's end unless `?wait=false`. Bodies are read here (JSON, text, or
multipart with a `file` part, parsed with the standard library's MIME parser) and every
parameter is checked by the controller, the one owner of their rules; nothing here trains
or writes before the controller has accepted the whole request.

Responses are `lora_protocol` models with juno's camelCase names (`pairCount`,
`finalTrainLoss`, ...), with the result's fields at the top level of a finished job, as
juno's synchronous answer has them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from email import policy
from email.parser import BytesParser
from typing import Any

from lorafleet import errors
from lorafleet.v1 import jobs_pb2
from lorafleet_gateway import lora_protocol as lp
from lorafleet_gateway.controller import JobsClient

WAIT_SECONDS = 25.0  # one long poll; a synchronous call keeps polling until the job ends
RESERVED = ("wait", "run", "base_model")  # query names that are not job parameters
STATES = {v: k.removeprefix("JOB_STATE_").lower() for k, v in jobs_pb2.JobState.items()}
KINDS = {v: k.removeprefix("JOB_KIND_").lower() for k, v in jobs_pb2.JobKind.items()}
FINISHED = {jobs_pb2.JOB_STATE_SUCCEEDED, jobs_pb2.JOB_STATE_FAILED, jobs_pb2.JOB_STATE_CANCELLED}
QA_ONLY = {"pairCount", "lossGuidance"}
TEXT_ONLY = {"documentCount", "chunkCount", "droppedChunks"}
VALIDATION_ONLY = {"bestValidationLoss", "bestPass", "restoredCheckpoint"}


# --- request bodies ---------------------------------------------------------------------------
def _json(body: bytes, field: str = "body") -> Any:
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise errors.InvalidArgument(f"not valid JSON: {exc}", field=field) from None
    except RecursionError:
        raise errors.InvalidArgument("JSON nested too deeply", field=field) from None


def _file_part(body: bytes, content_type: str) -> tuple[str, bytes]:
    """The `file` part of a multipart/form-data body: (filename, bytes)."""
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode()
    message = BytesParser(policy=policy.HTTP).parsebytes(head + body)
    if not message.is_multipart():
        raise errors.InvalidArgument("malformed multipart body", field="body")
    for part in message.iter_parts():
        if part.get_param("name", header="content-disposition") == "file":
            payload = part.get_payload(decode=True)
            return part.get_filename() or "", payload if isinstance(payload, bytes) else b""
    raise errors.InvalidArgument("the multipart body has no 'file' part", field="file")


def _text_params(raw: object) -> dict[str, str]:
    """A JSON `params` object → text values, as a query string would carry them."""
    if not isinstance(raw, dict):
        raise errors.InvalidArgument("must be a JSON object", field="params")
    out = {}
    for name, value in raw.items():
        if isinstance(value, bool):
            out[name] = "true" if value else "false"
        elif isinstance(value, int | float | str):
            out[name] = str(value)
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            out[name] = ",".join(value)
        else:
            raise errors.InvalidArgument(
                "must be a number, a string or a list of strings", field=name
            )
    return out


def _pairs(value: object, field: str = "pairs") -> list[jobs_pb2.QaPair]:
    """Shape only (an array of objects); the controller checks keys and values, naming them."""
    if not isinstance(value, list):
        raise errors.InvalidArgument(
            'must be a JSON array of {"Q": ..., "A": ...} objects', field=field
        )
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise errors.InvalidArgument(
                'must be an object {"Q": ..., "A": ...}', field=f"{field}[{i}]"
            )
        unknown = sorted(set(item) - {"Q", "A"})
        if unknown:
            raise errors.InvalidArgument(
                f"unknown key {unknown[0]!r} (expected Q and A)", field=f"{field}[{i}]"
            )
        for key in ("Q", "A"):
            if key not in item:
                raise errors.InvalidArgument(f"missing key {key!r}", field=f"{field}[{i}].{key}")
            if not isinstance(item[key], str):
                raise errors.InvalidArgument(
                    f"must be a string, got {type(item[key]).__name__}", field=f"{field}[{i}].{key}"
                )
        out.append(jobs_pb2.QaPair(question=item["Q"], answer=item["A"]))
    return out


def _documents(value: object) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(d, str) for d in value):
        raise errors.InvalidArgument("must be a JSON array of strings", field="documents")
    return value


def _envelope(obj: dict[str, Any], data_keys: tuple[str, ...]) -> dict[str, str]:
    """The non-data members of a JSON object body: `params`, `run`, `base_model`."""
    unknown = sorted(set(obj) - {*data_keys, "params", "run", "base_model"})
    if unknown:
        raise errors.InvalidArgument(
            f"unknown member (expected {', '.join(data_keys)}, params, run, base_model)",
            field=unknown[0],
        )
    out = _text_params(obj.get("params", {}))
    for name in ("run", "base_model"):
        if name in obj:
            if not isinstance(obj[name], str):
                raise errors.InvalidArgument("must be a string", field=name)
            out[name] = obj[name]
    return out


def parse_body(
    route: str, body: bytes, content_type: str
) -> tuple[jobs_pb2.CreateJobRequest, dict[str, str]]:
    """A job route's body → (the request's data, the body's params/run/base_model)."""
    ctype = content_type.split(";")[0].strip().lower()
    req = jobs_pb2.CreateJobRequest()
    extra: dict[str, str] = {}
    if route in ("train-file-qa", "train-file") and ctype == "multipart/form-data":
        filename, data = _file_part(body, content_type)
        if route == "train-file-qa":
            if not filename.lower().endswith(".json"):
                raise errors.InvalidArgument(
                    f"must be a .json file, got {filename!r}", field="file"
                )
            req.pairs.extend(_pairs(_json(data, "file"), "file"))
        else:
            req.documents.append(_decode(data, "file"))
        return req, extra
    if route in ("train", "train-file") and ctype.startswith("text/"):
        req.documents.append(_decode(body, "body"))
        return req, extra
    value = _json(body) if body.strip() else {}
    if route in ("train-qa", "train-file-qa") and isinstance(value, dict):
        if route == "train-qa" and "pairs" not in value:
            qa = {k: value[k] for k in ("Q", "A") if k in value}
            extra = _envelope(value, ("Q", "A"))
            req.pairs.extend(_pairs([qa], "body"))
        else:
            extra = _envelope(value, ("pairs",))
            req.pairs.extend(_pairs(value.get("pairs"), "pairs"))
    elif route == "train-file-qa":
        req.pairs.extend(_pairs(value, "body"))
    elif route in ("train", "train-file"):
        if not isinstance(value, dict):
            raise errors.InvalidArgument(
                'must be {"text": ...} or {"documents": [...]}', field="body"
            )
        extra = _envelope(value, ("text", "documents"))
        if "text" in value:
            if not isinstance(value["text"], str):
                raise errors.InvalidArgument("must be a string", field="text")
            req.documents.append(value["text"])
        req.documents.extend(_documents(value.get("documents", [])))
    elif route == "save":
        if not isinstance(value, dict):
            raise errors.InvalidArgument('must be {"name": ...}', field="body")
        extra = _envelope(value, ("name",))
        if "name" in value:
            extra["name"] = str(value["name"])
    else:
        raise errors.InvalidArgument('must be a JSON object {"Q": ..., "A": ...}', field="body")
    return req, extra


def _decode(data: bytes, field: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise errors.InvalidArgument("must be UTF-8 text", field=field) from None


# --- responses --------------------------------------------------------------------------------
def _fields(msg: Any) -> dict[str, Any]:
    """Every field of a message under its JSON (camelCase) name; unset optionals omitted."""
    out = {}
    for f in msg.DESCRIPTOR.fields:
        if f.has_presence and not msg.HasField(f.name):
            continue
        out[f.json_name] = getattr(msg, f.name)
    return out


def job_view(job: jobs_pb2.Job) -> lp.Job:
    """A job as JSON; a finished job carries its result's fields at the top level (only
    the fields given are set, so unset ones stay out of the answer)."""
    view: dict[str, Any] = {
        "jobId": job.job_id,
        "runId": job.registration_id,
        "baseModel": job.base_model,
        "kind": KINDS[job.kind],
        "state": STATES[job.state],
        "params": dict(job.params),
        "passes": job.passes,
        "updates": job.updates,
        "maxUpdates": job.max_updates,
        "trainLoss": job.train_loss if job.HasField("train_loss") else None,
        "validationLoss": job.validation_loss if job.HasField("validation_loss") else None,
        "history": [_fields(h) for h in job.history],
        "curve": [_fields(p) for p in job.curve],
        "createdAt": job.created_at,
        "startedAt": job.started_at or None,
        "finishedAt": job.finished_at or None,
        "error": None,
    }
    if job.HasField("error"):
        view["error"] = {
            "field": job.error.field or None,
            "message": job.error.message,
            "reason": job.error.reason,
        }
    if job.state == jobs_pb2.JOB_STATE_SUCCEEDED:
        drop = TEXT_ONLY if job.kind == jobs_pb2.JOB_KIND_QA else QA_ONLY
        if not job.result.validation_unit_count:
            drop = drop | VALIDATION_ONLY
        if job.kind == jobs_pb2.JOB_KIND_SAVE:
            view["checkpoint"] = job.result.checkpoint
        else:
            view.update({k: v for k, v in _fields(job.result).items() if k not in drop})
    return lp.Job.model_validate(view)


def _event(name: str, data: lp.Camel | dict[str, Any]) -> str:
    body = (
        data.model_dump_json(by_alias=True, exclude_unset=True)
        if isinstance(data, lp.Camel)
        else json.dumps(data)
    )
    return f"event: {name}\ndata: {body}\n\n"


def _flag(raw: str, field: str) -> bool:
    low = raw.strip().lower()
    if low not in ("true", "false", "1", "0"):
        raise errors.InvalidArgument(f"must be true or false, got {raw!r}", field=field)
    return low in ("true", "1")


class JobsServing:
    """The flows of the /v1/lora job routes over the typed JobService client."""

    KIND_OF_ROUTE: Mapping[str, jobs_pb2.JobKind.ValueType] = {
        "train-qa": jobs_pb2.JOB_KIND_QA,
        "train-file-qa": jobs_pb2.JOB_KIND_QA,
        "train": jobs_pb2.JOB_KIND_TEXT,
        "train-file": jobs_pb2.JOB_KIND_TEXT,
        "save": jobs_pb2.JOB_KIND_SAVE,
    }

    def __init__(self, jobs: JobsClient) -> None:
        self._jobs = jobs

    async def create(
        self, tenant: str, route: str, query: Mapping[str, str], body: bytes, content_type: str
    ) -> lp.Job:
        """Create the job; wait for its end unless `wait=false`."""
        req, extra = parse_body(route, body, content_type)
        named = {**extra, **query}
        wait = _flag(named.pop("wait", "true"), "wait")
        req.tenant = tenant
        req.kind = self.KIND_OF_ROUTE[route]
        req.registration_id = named.pop("run", "")
        req.base_model = named.pop("base_model", "")
        req.params.update(named)
        job = (await self._jobs.create_job(req)).job
        while wait and job.state not in FINISHED:
            job = await self._get(tenant, job.job_id, job.version)
        return job_view(job)

    async def _get(self, tenant: str, job_id: str, after: int = 0) -> jobs_pb2.Job:
        wait = WAIT_SECONDS if after else 0.0
        req = jobs_pb2.GetJobRequest(
            tenant=tenant, job_id=job_id, after_version=after, wait_seconds=wait
        )
        return (await self._jobs.get_job(req)).job

    async def get(self, tenant: str, job_id: str) -> lp.Job:
        return job_view(await self._get(tenant, job_id))

    async def list(self, tenant: str, limit: int, offset: int) -> lp.JobList:
        req = jobs_pb2.ListJobsRequest(tenant=tenant, limit=limit, offset=offset)
        reply = await self._jobs.list_jobs(req)
        return lp.JobList(jobs=[job_view(j) for j in reply.jobs], total=reply.total)

    async def cancel(self, tenant: str, job_id: str) -> lp.Job:
        req = jobs_pb2.CancelJobRequest(tenant=tenant, job_id=job_id)
        return job_view((await self._jobs.cancel_job(req)).job)

    async def reset(self, tenant: str) -> lp.ResetRun:
        req = jobs_pb2.ResetDefaultRunRequest(tenant=tenant)
        reply = await self._jobs.reset_default_run(req)
        return lp.ResetRun(reset=bool(reply.registration_id), run_id=reply.registration_id or None)

    async def events(self, tenant: str, job_id: str) -> AsyncIterator[str]:
        """Server-sent events: `step` per optimizer update (pass, step, loss, lr), `pass` per
        full pass (train and validation loss), then `end` with the job."""
        job = await self._get(tenant, job_id)
        yield _event("job", job_view(job))
        steps = passes = 0
        while True:
            for point in job.curve[steps:]:
                step = {
                    "pass": point.pass_number,
                    "step": point.update,
                    "loss": point.loss,
                    "lr": point.learning_rate,
                }
                yield _event("step", step)
            for summary in job.history[passes:]:
                validation = (
                    summary.validation_loss if summary.HasField("validation_loss") else None
                )
                yield _event(
                    "pass",
                    {
                        "pass": summary.pass_number,
                        "trainLoss": summary.train_loss,
                        "validationLoss": validation,
                    },
                )
            steps, passes = len(job.curve), len(job.history)
            if job.state in FINISHED:
                yield _event("end", job_view(job))
                return
            version = job.version
            job = await self._get(tenant, job_id, version)
            if job.version == version:
                yield ": waiting\n\n"
