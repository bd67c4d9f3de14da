"""Pydantic models of Tinker's JSON request bodies and of every route's response
(tinker-api.md §6, both SDK versions).

They mirror the SDK's own types closely enough that a wrong type or a missing field is a
400 naming the field ("forward_backward_input.data[0].model_input.chunks") before anything
reaches the controller. Unknown extra fields are ignored: newer SDKs add optional fields.
Tensor-level checks (byte lengths, CSR structure, finiteness) live in convert.py and the
rules (losses, Adam ranges, names, LoRA options) in `lorafleet.contract`; both raise
InvalidArgument with the same dotted field names. The response models give the OpenAPI
document a schema for what each route answers.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from lorafleet.contract import ADAM_DEFAULTS, DEFAULT_RANK, MAX_RANK, SEED_LIMIT
from lorafleet.quantize import NONE

# int32, what the v1 messages carry; the id rules (>= 0, < vocabulary) are lorafleet.validate_msgs'
TokenId = Annotated[int, Field(ge=-(2**31), lt=2**31)]
SEQ_ID_LIMIT = 2**31  # seq_ids are int32 in tinker_public
SeqId = Annotated[int, Field(ge=0, lt=SEQ_ID_LIMIT)]
# Seconds until a checkpoint expires (int64 on the wire; bounded far below it).
TtlSeconds = Annotated[int, Field(ge=1, lt=2**40)]


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


# --- data ---------------------------------------------------------------------------------
class TensorData(Body):
    data: list[int | float]
    dtype: Literal["int64", "float32"]
    shape: list[Annotated[int, Field(ge=0)]] | None = None
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None


class Chunk(Body):
    type: str = "encoded_text"
    tokens: list[TokenId] | None = None


class ModelInput(Body):
    chunks: list[Chunk]


class Datum(Body):
    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData] = Field(default_factory=dict)


class ForwardBackwardInput(Body):
    data: list[Datum]
    loss_fn: str
    loss_fn_config: dict[str, float] | None = None


class ForwardBackwardRequest(Body):
    forward_backward_input: ForwardBackwardInput
    model_id: str
    seq_id: SeqId


class ForwardRequest(Body):
    forward_input: ForwardBackwardInput
    model_id: str
    seq_id: SeqId


class AdamParams(Body):
    """Ranges are checked by `lorafleet.contract.check_adam` (convert.adam_from_json)."""

    learning_rate: float = ADAM_DEFAULTS["learning_rate"]
    beta1: float = ADAM_DEFAULTS["beta1"]
    beta2: float = ADAM_DEFAULTS["beta2"]
    eps: float = ADAM_DEFAULTS["eps"]
    weight_decay: float = ADAM_DEFAULTS["weight_decay"]
    grad_clip_norm: float = ADAM_DEFAULTS["grad_clip_norm"]


class OptimStepRequest(Body):
    model_id: str
    seq_id: SeqId
    adam_params: AdamParams | None = None
    optimizer_params: dict[str, Any] | None = None


# --- sessions -----------------------------------------------------------------------------
class CreateSessionRequest(Body):
    tags: list[str] = Field(default_factory=list)
    user_metadata: dict[str, Any] | None = None
    sdk_version: str = ""
    project_id: str | None = None
    display_name: str | None = None


class SessionHeartbeatRequest(Body):
    session_id: str


class FinishReason(Body):
    type: Literal["success", "errored", "interrupted"] = "success"


class FinishSessionRequest(Body):
    reason: FinishReason | None = None
    detail: str | None = None


class TelemetryRequest(Body):
    events: list[dict[str, Any]] = Field(default_factory=list)
    session_id: str = ""


class ClientConfigRequest(Body):
    sdk_version: str = ""


# --- training runs ------------------------------------------------------------------------
class LoraConfig(Body):
    rank: Annotated[int, Field(ge=1, le=MAX_RANK)] = DEFAULT_RANK
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(Body):
    type: str = "adamw"


class CreateModelRequest(Body):
    session_id: str
    model_seq_id: SeqId
    base_model: str
    lora_config: LoraConfig = Field(default_factory=LoraConfig)
    optimizer_config: OptimizerConfig | None = None
    user_metadata: dict[str, Any] | None = None


class ModelIdRequest(Body):
    model_id: str


class SaveWeightsRequest(Body):
    model_id: str
    path: str
    seq_id: SeqId
    overwrite: bool = False
    ttl_seconds: TtlSeconds | None = None
    user_metadata: dict[str, Any] | None = None


class SaveWeightsForSamplerRequest(Body):
    model_id: str
    seq_id: SeqId
    path: str | None = None
    sampling_session_seq_id: SeqId | None = None
    kind: Literal["snapshot", "inflight"] = "snapshot"
    ttl_seconds: TtlSeconds | None = None
    user_metadata: dict[str, Any] | None = None


class SaveWeightsExternalRequest(Body):
    model_id: str
    path: str
    seq_id: SeqId
    ttl_seconds: TtlSeconds | None = None
    age_encryption_recipients: list[str] | None = None


class LoadWeightsRequest(Body):
    path: str
    optimizer: bool = False
    model_id: str | None = None
    seq_id: SeqId | None = None
    session_id: str | None = None
    model_seq_id: SeqId | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None


class WeightsInfoRequest(Body):
    tinker_path: str


# --- sampling -----------------------------------------------------------------------------
class CreateSamplingSessionRequest(Body):
    session_id: str
    sampling_session_seq_id: SeqId
    model_path: str | None = None
    base_model: str | None = None


class SamplingParams(Body):
    max_tokens: Annotated[int, Field(ge=1, lt=2**31)] | None = None
    seed: Annotated[int, Field(ge=0, lt=SEED_LIMIT)] | None = None
    stop: str | list[str] | list[int] | None = None
    # Value rules (temperature >= 0, top_k >= -1, ...) are lorafleet.validate_msgs.check_sample's,
    # run on the converted request; here only what the v1 message cannot carry: int32 range,
    # and top_p 0 (proto3 reads it as unset).
    temperature: float = 1.0
    top_k: Annotated[int, Field(ge=-(2**31), lt=2**31)] = -1
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0


class SampleRequest(Body):
    prompt: ModelInput
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    # its limit is the rollouts' (capabilities), checked when the sample is submitted
    num_samples: int = 1
    sampling_session_id: str | None = None
    base_model: str | None = None
    model_path: str | None = None
    seq_id: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    prompt_logprobs: bool | None = False
    topk_prompt_logprobs: Annotated[int, Field(ge=-(2**31), lt=2**31)] = 0


class RetrieveFutureRequest(Body):
    request_id: str = Field(min_length=1)
    allow_metadata_only: bool = False


# --- checkpoints --------------------------------------------------------------------------
class TtlRequest(Body):
    # <= 0 is refused by the serving layer with a message (null removes the TTL).
    ttl_seconds: Annotated[int, Field(gt=-(2**40), lt=2**40)] | None = None


# === responses ==============================================================================
# What each route answers, so the OpenAPI document says it. They mirror the SDK's own
# response types; fields the SDK treats as optional are None rather than absent.
class Reply(BaseModel):
    model_config = ConfigDict(extra="forbid")


class UntypedAPIFuture(Reply):
    """What every submit answers: the future to poll with retrieve_future."""

    request_id: str
    model_id: str | None = None
    sample_sequence_ids: list[str] | None = None


class ClientConfigResponse(Reply):
    pjwt_auth_enabled: bool = False
    use_pyqwest_transport: bool = False
    proto_write_fwdbwd: bool | None = None
    fwd_via_fwdbwd: bool | None = None
    create_model_via_load_weights: bool | None = None
    proto_compress_fwdbwd: bool | None = None


class DynamicConfigResponse(Reply):
    refresh_interval_sec: int
    sample_cancel_enabled: bool
    sample_cancel_max_batch_size: int


class SupportedModel(Reply):
    model_name: str
    max_context_length: int | None
    trainable: bool
    sampleable: bool
    # Ours, beside Tinker's fields (its SDKs ignore extra response fields): how the fleet
    # stores the frozen base (lorafleet.quantize: none, int8, fp8), one value per model.
    quantization: str = NONE


class ServerCapabilities(Reply):
    supported_models: list[SupportedModel]


class Health(Reply):
    status: Literal["ok"] = "ok"


class Empty(Reply):
    pass


class CreateSessionResponse(Reply):
    type: Literal["create_session"] = "create_session"
    session_id: str
    info_message: str | None = None
    warning_message: str | None = None
    error_message: str | None = None


class SessionHeartbeatResponse(Reply):
    type: Literal["session_heartbeat"] = "session_heartbeat"


class TelemetryResponse(Reply):
    status: Literal["accepted"] = "accepted"


class Cursor(Reply):
    offset: int
    limit: int
    total_count: int


class ListSessionsResponse(Reply):
    sessions: list[str]
    cursor: Cursor


class SessionInfo(Reply):
    session_id: str
    training_run_ids: list[str]
    sampler_ids: list[str]
    user_metadata: dict[str, str]
    display_name: str | None


class ModelData(Reply):
    model_name: str
    arch: str | None = None
    tokenizer_id: str | None = None


class OptimizerInfo(Reply):
    type: str = "adamw"


class GetInfoResponse(Reply):
    type: Literal["get_info"] = "get_info"
    model_id: str
    model_data: ModelData
    is_lora: bool = True
    lora_rank: int
    model_name: str
    optimizer_config: OptimizerInfo


class WeightsInfoResponse(Reply):
    base_model: str
    is_lora: bool = True
    lora_rank: int
    train_unembed: bool
    train_mlp: bool
    train_attn: bool
    optimizer_config: OptimizerInfo


class CreateSamplingSessionResponse(Reply):
    type: Literal["create_sampling_session"] = "create_sampling_session"
    sampling_session_id: str


class GetSamplerResponse(Reply):
    sampler_id: str
    base_model: str
    model_path: str | None


class CheckpointView(Reply):
    checkpoint_id: str
    checkpoint_type: Literal["training", "sampler", "external"]
    time: str
    tinker_path: str
    training_run_id: str
    size_bytes: int | None
    public: bool
    expires_at: str | None
    user_metadata: dict[str, str] | None


class CheckpointsListResponse(Reply):
    checkpoints: list[CheckpointView]
    cursor: Cursor


class TrainingRun(Reply):
    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool = True
    corrupted: bool = False
    lora_rank: int
    last_request_time: str
    last_checkpoint: CheckpointView | None = None
    last_sampler_checkpoint: CheckpointView | None = None
    user_metadata: dict[str, str] | None


class TrainingRunsResponse(Reply):
    training_runs: list[TrainingRun]
    cursor: Cursor


class ArchiveUrlResponse(Reply):
    url: str
    expires: str | None


class ExternalWeightsUrlsResponse(Reply):
    urls: dict[str, str]
    expires: str | None


# --- retrieve_future results (JSON; protobuf for forward_backward and sample when asked) ----
class TryAgain(Reply):
    type: Literal["try_again"] = "try_again"
    request_id: str
    queue_state: Literal["active", "paused_capacity"]
    queue_state_reason: str | None = None


class RequestFailed(Reply):
    error: str
    category: Literal["user", "server", "unknown"]


class TensorOut(Reply):
    data: list[int] | list[float]
    dtype: Literal["int64", "float32"]
    shape: list[int]


class ForwardBackwardOutput(Reply):
    loss_fn_output_type: Literal["ArrayRecord"] = "ArrayRecord"
    loss_fn_outputs: list[dict[str, TensorOut]]
    metrics: dict[str, float]


class OptimStepResult(Reply):
    metrics: dict[str, float]


class SampledSequence(Reply):
    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"]


class SampleResult(Reply):
    type: Literal["sample"] = "sample"
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None
    prompt_cache_hit_tokens: int = 0


class PathResult(Reply):
    """save_weights, save_weights_for_sampler (named), save_weights_external."""

    type: Literal["save_weights", "save_weights_for_sampler", "save_weights_external"]
    path: str


class SamplerResult(Reply):
    """save_weights_for_sampler without a name: the sampler created for it."""

    type: Literal["save_weights_for_sampler"] = "save_weights_for_sampler"
    sampling_session_id: str


class LoadWeightsResult(Reply):
    type: Literal["load_weights"] = "load_weights"
    path: str | None
    model_id: str


class ModelResult(Reply):
    """create_model and unload_model."""

    type: Literal["create_model", "unload_model"]
    model_id: str


FutureResult = (
    TryAgain
    | RequestFailed
    | ForwardBackwardOutput
    | OptimStepResult
    | SampleResult
    | PathResult
    | SamplerResult
    | LoadWeightsResult
    | ModelResult
)
