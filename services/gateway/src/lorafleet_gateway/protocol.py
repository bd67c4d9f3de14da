"""Pydantic models of Tinker's JSON request bodies (tinker-api.md §6, both SDK versions).

They mirror the SDK's own types closely enough that a wrong type or a missing field is a
400 naming the field ("forward_backward_input.data[0].model_input.chunks") before anything
reaches the controller. Unknown extra fields are ignored: newer SDKs add optional fields.
Tensor-level checks (byte lengths, CSR structure, finiteness) live in convert.py, which
raises InvalidArgument with the same dotted field names.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

TokenId = Annotated[int, Field(ge=0, lt=2**31)]
SeqId = Annotated[int, Field(ge=0, lt=2**31)]
Name = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")]


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
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


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
    rank: Annotated[int, Field(ge=1, le=1024)] = 32
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
    path: Name
    seq_id: SeqId
    overwrite: bool = False
    ttl_seconds: Annotated[int, Field(ge=1)] | None = None
    user_metadata: dict[str, Any] | None = None


class SaveWeightsForSamplerRequest(Body):
    model_id: str
    seq_id: SeqId
    path: Name | None = None
    sampling_session_seq_id: SeqId | None = None
    kind: Literal["snapshot", "inflight"] = "snapshot"
    ttl_seconds: Annotated[int, Field(ge=1)] | None = None
    user_metadata: dict[str, Any] | None = None


class SaveWeightsExternalRequest(Body):
    model_id: str
    path: Name
    seq_id: SeqId
    ttl_seconds: Annotated[int, Field(ge=1)] | None = None
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
    seed: Annotated[int, Field(ge=0, lt=2**64)] | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 1.0
    top_k: int = -1
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0


class SampleRequest(Body):
    prompt: ModelInput
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    num_samples: Annotated[int, Field(ge=1, le=1024)] = 1
    sampling_session_id: str | None = None
    base_model: str | None = None
    model_path: str | None = None
    seq_id: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    prompt_logprobs: bool | None = False
    topk_prompt_logprobs: Annotated[int, Field(ge=0, le=1024)] = 0


class RetrieveFutureRequest(Body):
    request_id: str = Field(min_length=1)
    allow_metadata_only: bool = False


# --- checkpoints --------------------------------------------------------------------------
class TtlRequest(Body):
    ttl_seconds: int | None = None
