from lorafleet.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegistrationState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REGISTRATION_STATE_UNSPECIFIED: _ClassVar[RegistrationState]
    REGISTRATION_STATE_QUEUED: _ClassVar[RegistrationState]
    REGISTRATION_STATE_READY: _ClassVar[RegistrationState]
    REGISTRATION_STATE_UNAVAILABLE: _ClassVar[RegistrationState]
    REGISTRATION_STATE_RETIRED: _ClassVar[RegistrationState]

class OperationKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OPERATION_KIND_UNSPECIFIED: _ClassVar[OperationKind]
    OPERATION_KIND_FORWARD: _ClassVar[OperationKind]
    OPERATION_KIND_FORWARD_BACKWARD: _ClassVar[OperationKind]
    OPERATION_KIND_OPTIM_STEP: _ClassVar[OperationKind]
    OPERATION_KIND_SAVE_STATE: _ClassVar[OperationKind]
    OPERATION_KIND_LOAD_STATE: _ClassVar[OperationKind]
    OPERATION_KIND_SAVE_WEIGHTS_FOR_SAMPLER: _ClassVar[OperationKind]
    OPERATION_KIND_SAMPLE: _ClassVar[OperationKind]
    OPERATION_KIND_CREATE: _ClassVar[OperationKind]

class OperationState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OPERATION_STATE_UNSPECIFIED: _ClassVar[OperationState]
    OPERATION_STATE_QUEUED: _ClassVar[OperationState]
    OPERATION_STATE_CLAIMED: _ClassVar[OperationState]
    OPERATION_STATE_SUCCEEDED: _ClassVar[OperationState]
    OPERATION_STATE_FAILED: _ClassVar[OperationState]
    OPERATION_STATE_CANCELLED: _ClassVar[OperationState]
    OPERATION_STATE_EXPIRED: _ClassVar[OperationState]

class CheckpointType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHECKPOINT_TYPE_UNSPECIFIED: _ClassVar[CheckpointType]
    CHECKPOINT_TYPE_TRAINING: _ClassVar[CheckpointType]
    CHECKPOINT_TYPE_SAMPLER: _ClassVar[CheckpointType]
    CHECKPOINT_TYPE_EXTERNAL: _ClassVar[CheckpointType]

class ReplicaKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPLICA_KIND_UNSPECIFIED: _ClassVar[ReplicaKind]
    REPLICA_KIND_TRAINER: _ClassVar[ReplicaKind]
    REPLICA_KIND_ROLLOUT: _ClassVar[ReplicaKind]
REGISTRATION_STATE_UNSPECIFIED: RegistrationState
REGISTRATION_STATE_QUEUED: RegistrationState
REGISTRATION_STATE_READY: RegistrationState
REGISTRATION_STATE_UNAVAILABLE: RegistrationState
REGISTRATION_STATE_RETIRED: RegistrationState
OPERATION_KIND_UNSPECIFIED: OperationKind
OPERATION_KIND_FORWARD: OperationKind
OPERATION_KIND_FORWARD_BACKWARD: OperationKind
OPERATION_KIND_OPTIM_STEP: OperationKind
OPERATION_KIND_SAVE_STATE: OperationKind
OPERATION_KIND_LOAD_STATE: OperationKind
OPERATION_KIND_SAVE_WEIGHTS_FOR_SAMPLER: OperationKind
OPERATION_KIND_SAMPLE: OperationKind
OPERATION_KIND_CREATE: OperationKind
OPERATION_STATE_UNSPECIFIED: OperationState
OPERATION_STATE_QUEUED: OperationState
OPERATION_STATE_CLAIMED: OperationState
OPERATION_STATE_SUCCEEDED: OperationState
OPERATION_STATE_FAILED: OperationState
OPERATION_STATE_CANCELLED: OperationState
OPERATION_STATE_EXPIRED: OperationState
CHECKPOINT_TYPE_UNSPECIFIED: CheckpointType
CHECKPOINT_TYPE_TRAINING: CheckpointType
CHECKPOINT_TYPE_SAMPLER: CheckpointType
CHECKPOINT_TYPE_EXTERNAL: CheckpointType
REPLICA_KIND_UNSPECIFIED: ReplicaKind
REPLICA_KIND_TRAINER: ReplicaKind
REPLICA_KIND_ROLLOUT: ReplicaKind

class AuthenticateRequest(_message.Message):
    __slots__ = ("api_key",)
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    api_key: str
    def __init__(self, api_key: _Optional[str] = ...) -> None: ...

class AuthenticateResponse(_message.Message):
    __slots__ = ("tenant", "key_id")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    key_id: str
    def __init__(self, tenant: _Optional[str] = ..., key_id: _Optional[str] = ...) -> None: ...

class CreateApiKeyRequest(_message.Message):
    __slots__ = ("tenant", "label")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    label: str
    def __init__(self, tenant: _Optional[str] = ..., label: _Optional[str] = ...) -> None: ...

class CreateApiKeyResponse(_message.Message):
    __slots__ = ("api_key", "key_id")
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    api_key: str
    key_id: str
    def __init__(self, api_key: _Optional[str] = ..., key_id: _Optional[str] = ...) -> None: ...

class ApiKeyInfo(_message.Message):
    __slots__ = ("key_id", "tenant", "label", "created_at", "revoked")
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    tenant: str
    label: str
    created_at: float
    revoked: bool
    def __init__(self, key_id: _Optional[str] = ..., tenant: _Optional[str] = ..., label: _Optional[str] = ..., created_at: _Optional[float] = ..., revoked: _Optional[bool] = ...) -> None: ...

class ListApiKeysRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class ListApiKeysResponse(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[ApiKeyInfo]
    def __init__(self, keys: _Optional[_Iterable[_Union[ApiKeyInfo, _Mapping]]] = ...) -> None: ...

class RevokeApiKeyRequest(_message.Message):
    __slots__ = ("key_id",)
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    def __init__(self, key_id: _Optional[str] = ...) -> None: ...

class RevokeApiKeyResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CreateSessionRequest(_message.Message):
    __slots__ = ("tenant", "tags", "user_metadata", "sdk_version", "project_id", "display_name")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    SDK_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROJECT_ID_FIELD_NUMBER: _ClassVar[int]
    DISPLAY_NAME_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    tags: _containers.RepeatedScalarFieldContainer[str]
    user_metadata: _containers.ScalarMap[str, str]
    sdk_version: str
    project_id: str
    display_name: str
    def __init__(self, tenant: _Optional[str] = ..., tags: _Optional[_Iterable[str]] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., sdk_version: _Optional[str] = ..., project_id: _Optional[str] = ..., display_name: _Optional[str] = ...) -> None: ...

class CreateSessionResponse(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class SessionHeartbeatRequest(_message.Message):
    __slots__ = ("tenant", "session_id")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    session_id: str
    def __init__(self, tenant: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class SessionHeartbeatResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FinishSessionRequest(_message.Message):
    __slots__ = ("tenant", "session_id", "reason")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    session_id: str
    reason: str
    def __init__(self, tenant: _Optional[str] = ..., session_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class FinishSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "training_run_ids", "sampler_ids", "user_metadata", "display_name", "finished", "created_at")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TRAINING_RUN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_IDS_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    DISPLAY_NAME_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    training_run_ids: _containers.RepeatedScalarFieldContainer[str]
    sampler_ids: _containers.RepeatedScalarFieldContainer[str]
    user_metadata: _containers.ScalarMap[str, str]
    display_name: str
    finished: bool
    created_at: float
    def __init__(self, session_id: _Optional[str] = ..., training_run_ids: _Optional[_Iterable[str]] = ..., sampler_ids: _Optional[_Iterable[str]] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., display_name: _Optional[str] = ..., finished: _Optional[bool] = ..., created_at: _Optional[float] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("tenant", "session_id")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    session_id: str
    def __init__(self, tenant: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class GetSessionResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: SessionInfo
    def __init__(self, session: _Optional[_Union[SessionInfo, _Mapping]] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ("tenant", "limit", "offset")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    limit: int
    offset: int
    def __init__(self, tenant: _Optional[str] = ..., limit: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("session_ids", "total")
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    total: int
    def __init__(self, session_ids: _Optional[_Iterable[str]] = ..., total: _Optional[int] = ...) -> None: ...

class Registration(_message.Message):
    __slots__ = ("registration_id", "tenant", "base_model", "lora_config", "state", "trainer_replica", "slot", "queue_position", "optim_steps", "published_version", "last_checkpoint", "created_at", "last_request_time", "user_metadata", "unavailable_reason", "optimizer")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    LORA_CONFIG_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TRAINER_REPLICA_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    OPTIM_STEPS_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_REQUEST_TIME_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_REASON_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    registration_id: str
    tenant: str
    base_model: str
    lora_config: _common_pb2.LoraConfig
    state: RegistrationState
    trainer_replica: str
    slot: int
    queue_position: int
    optim_steps: int
    published_version: int
    last_checkpoint: str
    created_at: float
    last_request_time: float
    user_metadata: _containers.ScalarMap[str, str]
    unavailable_reason: str
    optimizer: str
    def __init__(self, registration_id: _Optional[str] = ..., tenant: _Optional[str] = ..., base_model: _Optional[str] = ..., lora_config: _Optional[_Union[_common_pb2.LoraConfig, _Mapping]] = ..., state: _Optional[_Union[RegistrationState, str]] = ..., trainer_replica: _Optional[str] = ..., slot: _Optional[int] = ..., queue_position: _Optional[int] = ..., optim_steps: _Optional[int] = ..., published_version: _Optional[int] = ..., last_checkpoint: _Optional[str] = ..., created_at: _Optional[float] = ..., last_request_time: _Optional[float] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., unavailable_reason: _Optional[str] = ..., optimizer: _Optional[str] = ...) -> None: ...

class CreateRegistrationRequest(_message.Message):
    __slots__ = ("tenant", "session_id", "model_seq_id", "base_model", "lora_config", "user_metadata", "initial_checkpoint", "initial_with_optimizer", "optimizer")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    LORA_CONFIG_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    INITIAL_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    INITIAL_WITH_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    session_id: str
    model_seq_id: int
    base_model: str
    lora_config: _common_pb2.LoraConfig
    user_metadata: _containers.ScalarMap[str, str]
    initial_checkpoint: str
    initial_with_optimizer: bool
    optimizer: str
    def __init__(self, tenant: _Optional[str] = ..., session_id: _Optional[str] = ..., model_seq_id: _Optional[int] = ..., base_model: _Optional[str] = ..., lora_config: _Optional[_Union[_common_pb2.LoraConfig, _Mapping]] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., initial_checkpoint: _Optional[str] = ..., initial_with_optimizer: _Optional[bool] = ..., optimizer: _Optional[str] = ...) -> None: ...

class CreateRegistrationResponse(_message.Message):
    __slots__ = ("registration", "load_operation_id")
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    LOAD_OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    registration: Registration
    load_operation_id: str
    def __init__(self, registration: _Optional[_Union[Registration, _Mapping]] = ..., load_operation_id: _Optional[str] = ...) -> None: ...

class GetRegistrationRequest(_message.Message):
    __slots__ = ("tenant", "registration_id")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    registration_id: str
    def __init__(self, tenant: _Optional[str] = ..., registration_id: _Optional[str] = ...) -> None: ...

class GetRegistrationResponse(_message.Message):
    __slots__ = ("registration",)
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    registration: Registration
    def __init__(self, registration: _Optional[_Union[Registration, _Mapping]] = ...) -> None: ...

class ListRegistrationsRequest(_message.Message):
    __slots__ = ("tenant", "limit", "offset")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    limit: int
    offset: int
    def __init__(self, tenant: _Optional[str] = ..., limit: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class ListRegistrationsResponse(_message.Message):
    __slots__ = ("registrations", "total")
    REGISTRATIONS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    registrations: _containers.RepeatedCompositeFieldContainer[Registration]
    total: int
    def __init__(self, registrations: _Optional[_Iterable[_Union[Registration, _Mapping]]] = ..., total: _Optional[int] = ...) -> None: ...

class DeleteRegistrationRequest(_message.Message):
    __slots__ = ("tenant", "registration_id")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    registration_id: str
    def __init__(self, tenant: _Optional[str] = ..., registration_id: _Optional[str] = ...) -> None: ...

class DeleteRegistrationResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SaveStatePayload(_message.Message):
    __slots__ = ("name", "ttl_seconds", "user_metadata")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    ttl_seconds: int
    user_metadata: _containers.ScalarMap[str, str]
    def __init__(self, name: _Optional[str] = ..., ttl_seconds: _Optional[int] = ..., user_metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class LoadStatePayload(_message.Message):
    __slots__ = ("path", "with_optimizer")
    PATH_FIELD_NUMBER: _ClassVar[int]
    WITH_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    path: str
    with_optimizer: bool
    def __init__(self, path: _Optional[str] = ..., with_optimizer: _Optional[bool] = ...) -> None: ...

class SaveWeightsForSamplerPayload(_message.Message):
    __slots__ = ("name", "sampler_session_id", "sampling_session_seq_id", "kind", "ttl_seconds", "user_metadata")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_SESSION_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    sampler_session_id: str
    sampling_session_seq_id: int
    kind: str
    ttl_seconds: int
    user_metadata: _containers.ScalarMap[str, str]
    def __init__(self, name: _Optional[str] = ..., sampler_session_id: _Optional[str] = ..., sampling_session_seq_id: _Optional[int] = ..., kind: _Optional[str] = ..., ttl_seconds: _Optional[int] = ..., user_metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class OperationPayload(_message.Message):
    __slots__ = ("forward", "forward_backward", "optim_step", "save_state", "load_state", "save_weights_for_sampler")
    FORWARD_FIELD_NUMBER: _ClassVar[int]
    FORWARD_BACKWARD_FIELD_NUMBER: _ClassVar[int]
    OPTIM_STEP_FIELD_NUMBER: _ClassVar[int]
    SAVE_STATE_FIELD_NUMBER: _ClassVar[int]
    LOAD_STATE_FIELD_NUMBER: _ClassVar[int]
    SAVE_WEIGHTS_FOR_SAMPLER_FIELD_NUMBER: _ClassVar[int]
    forward: _common_pb2.ForwardBackwardInput
    forward_backward: _common_pb2.ForwardBackwardInput
    optim_step: _common_pb2.AdamParams
    save_state: SaveStatePayload
    load_state: LoadStatePayload
    save_weights_for_sampler: SaveWeightsForSamplerPayload
    def __init__(self, forward: _Optional[_Union[_common_pb2.ForwardBackwardInput, _Mapping]] = ..., forward_backward: _Optional[_Union[_common_pb2.ForwardBackwardInput, _Mapping]] = ..., optim_step: _Optional[_Union[_common_pb2.AdamParams, _Mapping]] = ..., save_state: _Optional[_Union[SaveStatePayload, _Mapping]] = ..., load_state: _Optional[_Union[LoadStatePayload, _Mapping]] = ..., save_weights_for_sampler: _Optional[_Union[SaveWeightsForSamplerPayload, _Mapping]] = ...) -> None: ...

class SaveStateResult(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class SaveWeightsForSamplerResult(_message.Message):
    __slots__ = ("path", "sampler_id", "version")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    path: str
    sampler_id: str
    version: int
    def __init__(self, path: _Optional[str] = ..., sampler_id: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class LoadStateResult(_message.Message):
    __slots__ = ("path", "registration_id")
    PATH_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    path: str
    registration_id: str
    def __init__(self, path: _Optional[str] = ..., registration_id: _Optional[str] = ...) -> None: ...

class OperationResult(_message.Message):
    __slots__ = ("forward_backward", "optim_step", "save_state", "load_state", "save_weights_for_sampler", "sample", "create")
    FORWARD_BACKWARD_FIELD_NUMBER: _ClassVar[int]
    OPTIM_STEP_FIELD_NUMBER: _ClassVar[int]
    SAVE_STATE_FIELD_NUMBER: _ClassVar[int]
    LOAD_STATE_FIELD_NUMBER: _ClassVar[int]
    SAVE_WEIGHTS_FOR_SAMPLER_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    CREATE_FIELD_NUMBER: _ClassVar[int]
    forward_backward: _common_pb2.ForwardBackwardOutput
    optim_step: _common_pb2.OptimStepOutput
    save_state: SaveStateResult
    load_state: LoadStateResult
    save_weights_for_sampler: SaveWeightsForSamplerResult
    sample: _common_pb2.SampleOutput
    create: Registration
    def __init__(self, forward_backward: _Optional[_Union[_common_pb2.ForwardBackwardOutput, _Mapping]] = ..., optim_step: _Optional[_Union[_common_pb2.OptimStepOutput, _Mapping]] = ..., save_state: _Optional[_Union[SaveStateResult, _Mapping]] = ..., load_state: _Optional[_Union[LoadStateResult, _Mapping]] = ..., save_weights_for_sampler: _Optional[_Union[SaveWeightsForSamplerResult, _Mapping]] = ..., sample: _Optional[_Union[_common_pb2.SampleOutput, _Mapping]] = ..., create: _Optional[_Union[Registration, _Mapping]] = ...) -> None: ...

class Operation(_message.Message):
    __slots__ = ("operation_id", "registration_id", "seq_id", "kind", "state", "result", "error", "submitted_at", "finished_at", "waiting_reason")
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    WAITING_REASON_FIELD_NUMBER: _ClassVar[int]
    operation_id: str
    registration_id: str
    seq_id: int
    kind: OperationKind
    state: OperationState
    result: OperationResult
    error: _common_pb2.ErrorInfo
    submitted_at: float
    finished_at: float
    waiting_reason: str
    def __init__(self, operation_id: _Optional[str] = ..., registration_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., kind: _Optional[_Union[OperationKind, str]] = ..., state: _Optional[_Union[OperationState, str]] = ..., result: _Optional[_Union[OperationResult, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.ErrorInfo, _Mapping]] = ..., submitted_at: _Optional[float] = ..., finished_at: _Optional[float] = ..., waiting_reason: _Optional[str] = ...) -> None: ...

class SubmitOperationRequest(_message.Message):
    __slots__ = ("tenant", "registration_id", "seq_id", "payload", "rejection")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    REJECTION_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    registration_id: str
    seq_id: int
    payload: OperationPayload
    rejection: _common_pb2.ErrorInfo
    def __init__(self, tenant: _Optional[str] = ..., registration_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., payload: _Optional[_Union[OperationPayload, _Mapping]] = ..., rejection: _Optional[_Union[_common_pb2.ErrorInfo, _Mapping]] = ...) -> None: ...

class SubmitOperationResponse(_message.Message):
    __slots__ = ("operation_id", "state", "duplicate", "sequence_ids")
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    operation_id: str
    state: OperationState
    duplicate: bool
    sequence_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, operation_id: _Optional[str] = ..., state: _Optional[_Union[OperationState, str]] = ..., duplicate: _Optional[bool] = ..., sequence_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetOperationRequest(_message.Message):
    __slots__ = ("tenant", "operation_id", "wait_seconds")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    operation_id: str
    wait_seconds: float
    def __init__(self, tenant: _Optional[str] = ..., operation_id: _Optional[str] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class GetOperationResponse(_message.Message):
    __slots__ = ("operation",)
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    operation: Operation
    def __init__(self, operation: _Optional[_Union[Operation, _Mapping]] = ...) -> None: ...

class AckOperationRequest(_message.Message):
    __slots__ = ("tenant", "operation_id")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    operation_id: str
    def __init__(self, tenant: _Optional[str] = ..., operation_id: _Optional[str] = ...) -> None: ...

class AckOperationResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Sampler(_message.Message):
    __slots__ = ("sampler_id", "base_model", "model_path", "adapter", "inflight")
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    sampler_id: str
    base_model: str
    model_path: str
    adapter: _common_pb2.AdapterRef
    inflight: bool
    def __init__(self, sampler_id: _Optional[str] = ..., base_model: _Optional[str] = ..., model_path: _Optional[str] = ..., adapter: _Optional[_Union[_common_pb2.AdapterRef, _Mapping]] = ..., inflight: _Optional[bool] = ...) -> None: ...

class CreateSamplerRequest(_message.Message):
    __slots__ = ("tenant", "session_id", "sampling_session_seq_id", "model_path", "base_model")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_SESSION_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    session_id: str
    sampling_session_seq_id: int
    model_path: str
    base_model: str
    def __init__(self, tenant: _Optional[str] = ..., session_id: _Optional[str] = ..., sampling_session_seq_id: _Optional[int] = ..., model_path: _Optional[str] = ..., base_model: _Optional[str] = ...) -> None: ...

class CreateSamplerResponse(_message.Message):
    __slots__ = ("sampler",)
    SAMPLER_FIELD_NUMBER: _ClassVar[int]
    sampler: Sampler
    def __init__(self, sampler: _Optional[_Union[Sampler, _Mapping]] = ...) -> None: ...

class GetSamplerRequest(_message.Message):
    __slots__ = ("tenant", "sampler_id")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    sampler_id: str
    def __init__(self, tenant: _Optional[str] = ..., sampler_id: _Optional[str] = ...) -> None: ...

class GetSamplerResponse(_message.Message):
    __slots__ = ("sampler",)
    SAMPLER_FIELD_NUMBER: _ClassVar[int]
    sampler: Sampler
    def __init__(self, sampler: _Optional[_Union[Sampler, _Mapping]] = ...) -> None: ...

class SubmitSampleRequest(_message.Message):
    __slots__ = ("tenant", "sampler_id", "seq_id", "prompt_tokens", "params", "num_samples", "prompt_logprobs", "topk_prompt_logprobs")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOPK_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    sampler_id: str
    seq_id: int
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    num_samples: int
    prompt_logprobs: bool
    topk_prompt_logprobs: int
    def __init__(self, tenant: _Optional[str] = ..., sampler_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., num_samples: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., topk_prompt_logprobs: _Optional[int] = ...) -> None: ...

class Checkpoint(_message.Message):
    __slots__ = ("checkpoint_id", "type", "training_run_id", "tinker_path", "created_at", "size_bytes", "public", "expires_at", "user_metadata", "base_model", "lora_config", "manifest", "has_optimizer")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    TRAINING_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TINKER_PATH_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    LORA_CONFIG_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    HAS_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    type: CheckpointType
    training_run_id: str
    tinker_path: str
    created_at: float
    size_bytes: int
    public: bool
    expires_at: float
    user_metadata: _containers.ScalarMap[str, str]
    base_model: str
    lora_config: _common_pb2.LoraConfig
    manifest: _common_pb2.BlobRef
    has_optimizer: bool
    def __init__(self, checkpoint_id: _Optional[str] = ..., type: _Optional[_Union[CheckpointType, str]] = ..., training_run_id: _Optional[str] = ..., tinker_path: _Optional[str] = ..., created_at: _Optional[float] = ..., size_bytes: _Optional[int] = ..., public: _Optional[bool] = ..., expires_at: _Optional[float] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., base_model: _Optional[str] = ..., lora_config: _Optional[_Union[_common_pb2.LoraConfig, _Mapping]] = ..., manifest: _Optional[_Union[_common_pb2.BlobRef, _Mapping]] = ..., has_optimizer: _Optional[bool] = ...) -> None: ...

class ListCheckpointsRequest(_message.Message):
    __slots__ = ("tenant", "training_run_id", "limit", "offset")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TRAINING_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    training_run_id: str
    limit: int
    offset: int
    def __init__(self, tenant: _Optional[str] = ..., training_run_id: _Optional[str] = ..., limit: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class ListCheckpointsResponse(_message.Message):
    __slots__ = ("checkpoints", "total")
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    checkpoints: _containers.RepeatedCompositeFieldContainer[Checkpoint]
    total: int
    def __init__(self, checkpoints: _Optional[_Iterable[_Union[Checkpoint, _Mapping]]] = ..., total: _Optional[int] = ...) -> None: ...

class GetCheckpointRequest(_message.Message):
    __slots__ = ("tenant", "tinker_path")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TINKER_PATH_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    tinker_path: str
    def __init__(self, tenant: _Optional[str] = ..., tinker_path: _Optional[str] = ...) -> None: ...

class GetCheckpointResponse(_message.Message):
    __slots__ = ("checkpoint",)
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    checkpoint: Checkpoint
    def __init__(self, checkpoint: _Optional[_Union[Checkpoint, _Mapping]] = ...) -> None: ...

class DeleteCheckpointRequest(_message.Message):
    __slots__ = ("tenant", "tinker_path")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TINKER_PATH_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    tinker_path: str
    def __init__(self, tenant: _Optional[str] = ..., tinker_path: _Optional[str] = ...) -> None: ...

class DeleteCheckpointResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UpdateCheckpointRequest(_message.Message):
    __slots__ = ("tenant", "tinker_path", "public", "ttl_seconds", "clear_ttl")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TINKER_PATH_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CLEAR_TTL_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    tinker_path: str
    public: bool
    ttl_seconds: int
    clear_ttl: bool
    def __init__(self, tenant: _Optional[str] = ..., tinker_path: _Optional[str] = ..., public: _Optional[bool] = ..., ttl_seconds: _Optional[int] = ..., clear_ttl: _Optional[bool] = ...) -> None: ...

class UpdateCheckpointResponse(_message.Message):
    __slots__ = ("checkpoint",)
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    checkpoint: Checkpoint
    def __init__(self, checkpoint: _Optional[_Union[Checkpoint, _Mapping]] = ...) -> None: ...

class DownloadCheckpointRequest(_message.Message):
    __slots__ = ("tenant", "tinker_path")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TINKER_PATH_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    tinker_path: str
    def __init__(self, tenant: _Optional[str] = ..., tinker_path: _Optional[str] = ...) -> None: ...

class BaseModelInfo(_message.Message):
    __slots__ = ("name", "tokenizer_id", "arch", "max_context_length", "trainable", "sampleable", "max_rank", "loss_fns")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_ID_FIELD_NUMBER: _ClassVar[int]
    ARCH_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TRAINABLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLEABLE_FIELD_NUMBER: _ClassVar[int]
    MAX_RANK_FIELD_NUMBER: _ClassVar[int]
    LOSS_FNS_FIELD_NUMBER: _ClassVar[int]
    name: str
    tokenizer_id: str
    arch: str
    max_context_length: int
    trainable: bool
    sampleable: bool
    max_rank: int
    loss_fns: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., tokenizer_id: _Optional[str] = ..., arch: _Optional[str] = ..., max_context_length: _Optional[int] = ..., trainable: _Optional[bool] = ..., sampleable: _Optional[bool] = ..., max_rank: _Optional[int] = ..., loss_fns: _Optional[_Iterable[str]] = ...) -> None: ...

class GetCapabilitiesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetCapabilitiesResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[BaseModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[BaseModelInfo, _Mapping]]] = ...) -> None: ...

class RegisterReplicaRequest(_message.Message):
    __slots__ = ("kind", "replica_id", "address", "base_model", "num_slots", "incarnation", "tokenizer_id", "max_rank", "max_context_length", "arch")
    KIND_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_RANK_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ARCH_FIELD_NUMBER: _ClassVar[int]
    kind: ReplicaKind
    replica_id: str
    address: str
    base_model: str
    num_slots: int
    incarnation: str
    tokenizer_id: str
    max_rank: int
    max_context_length: int
    arch: str
    def __init__(self, kind: _Optional[_Union[ReplicaKind, str]] = ..., replica_id: _Optional[str] = ..., address: _Optional[str] = ..., base_model: _Optional[str] = ..., num_slots: _Optional[int] = ..., incarnation: _Optional[str] = ..., tokenizer_id: _Optional[str] = ..., max_rank: _Optional[int] = ..., max_context_length: _Optional[int] = ..., arch: _Optional[str] = ...) -> None: ...

class RegisterReplicaResponse(_message.Message):
    __slots__ = ("heartbeat_interval_seconds",)
    HEARTBEAT_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_seconds: float
    def __init__(self, heartbeat_interval_seconds: _Optional[float] = ...) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("kind", "replica_id", "address", "base_model", "healthy", "last_seen", "slots", "num_slots", "adapters")
    KIND_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    kind: ReplicaKind
    replica_id: str
    address: str
    base_model: str
    healthy: bool
    last_seen: float
    slots: _containers.RepeatedCompositeFieldContainer[Registration]
    num_slots: int
    adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, kind: _Optional[_Union[ReplicaKind, str]] = ..., replica_id: _Optional[str] = ..., address: _Optional[str] = ..., base_model: _Optional[str] = ..., healthy: _Optional[bool] = ..., last_seen: _Optional[float] = ..., slots: _Optional[_Iterable[_Union[Registration, _Mapping]]] = ..., num_slots: _Optional[int] = ..., adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class GetFleetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetFleetStatusResponse(_message.Message):
    __slots__ = ("replicas", "ledger_depth", "queued_registrations")
    class LedgerDepthEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    LEDGER_DEPTH_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REGISTRATIONS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    ledger_depth: _containers.ScalarMap[str, int]
    queued_registrations: _containers.RepeatedCompositeFieldContainer[Registration]
    def __init__(self, replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ..., ledger_depth: _Optional[_Mapping[str, int]] = ..., queued_registrations: _Optional[_Iterable[_Union[Registration, _Mapping]]] = ...) -> None: ...
