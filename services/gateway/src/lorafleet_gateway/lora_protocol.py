"""Response models of the gateway's own routes under /v1/lora (not Tinker's API).

Managed jobs answer with juno's camelCase names (`jobId`, `pairCount`, `finalTrainLoss`):
the models name fields in snake_case and serialise them by alias. A job's result fields
appear at the top level only once it has succeeded, and only those that apply to its kind
(serving/jobs.py decides), so the routes drop unset fields (`response_model_exclude_unset`)
instead of answering them as null. The PEFT import answers in Tinker's snake_case.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


class Camel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)


class JobPoint(Camel):
    """One optimizer update of the loss curve."""

    pass_number: int
    update: int
    loss: float
    learning_rate: float


class JobPass(Camel):
    """One full pass; validationLoss only with a validation split."""

    pass_number: int
    train_loss: float
    validation_loss: float | None = None


class JobError(Camel):
    field: str | None = Field(description="the parameter or datum at fault, when one is")
    message: str
    reason: str


class Job(Camel):
    """A job; a succeeded one also carries its result's fields (those of its kind)."""

    job_id: str
    run_id: str = Field(description="the training run (registration) the job trains")
    base_model: str
    kind: str = Field(description="qa, text or save")
    state: str = Field(description="queued, running, succeeded, failed or cancelled")
    params: dict[str, str] = Field(description="every parameter, defaults filled in")
    passes: int
    updates: int
    max_updates: int
    train_loss: float | None
    validation_loss: float | None
    history: list[JobPass]
    curve: list[JobPoint]
    created_at: float
    started_at: float | None
    finished_at: float | None
    error: JobError | None
    checkpoint: str | None = Field(
        None, description="tinker:// path of the saved state holding the final adapter"
    )
    # The result's fields (jobs.proto JobResult), set once the job has succeeded.
    pair_count: int | None = None
    document_count: int | None = None
    unit_count: int | None = None
    train_unit_count: int | None = None
    validation_unit_count: int | None = None
    chunk_count: int | None = None
    dropped_chunks: int | None = None
    final_train_loss: float | None = None
    initial_loss: float | None = None
    pass_count: int | None = None
    optimizer_update_count: int | None = None
    stop_reason: str | None = None
    target_reached: bool | None = None
    chat_template: str | None = None
    best_validation_loss: float | None = None
    best_pass: int | None = None
    restored_checkpoint: str | None = None
    loss_guidance: str | None = None


class JobList(Camel):
    jobs: list[Job] = Field(description="newest first")
    total: int


class ResetRun(Camel):
    reset: bool = Field(description="whether there was a default run to retire")
    run_id: str | None


class ImportedLoraConfig(BaseModel):
    rank: int
    alpha: float
    dropout: float
    target_modules: list[str]
    exclude_modules: list[str]


class ImportedAdapter(BaseModel):
    """The saved state an imported PEFT adapter became."""

    path: str = Field(description="tinker://<run>/weights/<name>")
    training_run_id: str
    base_model: str
    lora_config: ImportedLoraConfig
