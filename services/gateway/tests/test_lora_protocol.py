"""The /v1/lora response models: juno's camelCase names, every field the jobs proto carries,
and a job's result fields only where juno has them (unset fields stay out of the answer)."""

from __future__ import annotations

from typing import Any

from lorafleet.v1 import common_pb2, jobs_pb2
from lorafleet_gateway import lora_protocol as lp
from lorafleet_gateway.serving.jobs import job_view


def aliases(model: type[lp.Camel]) -> set[str]:
    return {f.alias or name for name, f in model.model_fields.items()}


def answer(job: jobs_pb2.Job) -> dict[str, Any]:
    """What a job route answers (response_model_exclude_unset, by alias)."""
    return job_view(job).model_dump(mode="json", by_alias=True, exclude_unset=True)


def test_the_models_name_every_field_of_the_jobs_proto() -> None:
    def json_names(message: Any) -> set[str]:
        return {f.json_name for f in message.DESCRIPTOR.fields}

    assert json_names(jobs_pb2.JobResult) <= aliases(lp.Job)
    assert json_names(jobs_pb2.JobPoint) == aliases(lp.JobPoint)
    assert json_names(jobs_pb2.JobPass) == aliases(lp.JobPass)


def test_a_running_job_has_no_result_fields_and_null_losses() -> None:
    job = jobs_pb2.Job(
        job_id="j1",
        registration_id="run-1",
        kind=jobs_pb2.JOB_KIND_QA,
        state=jobs_pb2.JOB_STATE_RUNNING,
        params={"rank": "8"},
        curve=[jobs_pb2.JobPoint(pass_number=1, update=1, loss=2.5, learning_rate=1e-4)],
        history=[jobs_pb2.JobPass(pass_number=1, train_loss=2.0)],
        created_at=1.0,
    )
    got = answer(job)
    assert got["jobId"] == "j1" and got["runId"] == "run-1" and got["state"] == "running"
    assert got["trainLoss"] is None and got["startedAt"] is None and got["error"] is None
    assert got["curve"] == [{"passNumber": 1, "update": 1, "loss": 2.5, "learningRate": 1e-4}]
    assert got["history"] == [{"passNumber": 1, "trainLoss": 2.0}]  # no validation split
    result_fields = {f.json_name for f in jobs_pb2.JobResult.DESCRIPTOR.fields}
    assert set(got) == aliases(lp.Job) - result_fields


def test_a_succeeded_job_carries_the_result_fields_of_its_kind() -> None:
    result = jobs_pb2.JobResult(
        pair_count=2,
        unit_count=8,
        final_train_loss=0.1,
        checkpoint="tinker://r/weights/a",
        loss_guidance="reliable recall",
    )
    qa = jobs_pb2.Job(
        job_id="j2", kind=jobs_pb2.JOB_KIND_QA, state=jobs_pb2.JOB_STATE_SUCCEEDED, result=result
    )
    got = answer(qa)
    assert (got["pairCount"], got["finalTrainLoss"]) == (2, 0.1)
    assert got["lossGuidance"] == "reliable recall"
    assert got["checkpoint"] == "tinker://r/weights/a"
    assert "documentCount" not in got and "bestValidationLoss" not in got
    assert "initialLoss" not in got  # an unset optional is left out, not null
    failed = jobs_pb2.Job(
        job_id="j3",
        kind=jobs_pb2.JOB_KIND_TEXT,
        state=jobs_pb2.JOB_STATE_FAILED,
        error=common_pb2.ErrorInfo(message="bad", reason="INVALID"),
    )
    assert answer(failed)["error"] == {"field": None, "message": "bad", "reason": "INVALID"}
