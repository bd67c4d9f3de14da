from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT64: _ClassVar[DType]

class ErrorCategory(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CATEGORY_UNSPECIFIED: _ClassVar[ErrorCategory]
    ERROR_CATEGORY_USER: _ClassVar[ErrorCategory]
    ERROR_CATEGORY_SERVER: _ClassVar[ErrorCategory]
    ERROR_CATEGORY_UNKNOWN: _ClassVar[ErrorCategory]

class StopReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STOP_REASON_UNSPECIFIED: _ClassVar[StopReason]
    STOP_REASON_STOP: _ClassVar[StopReason]
    STOP_REASON_LENGTH: _ClassVar[StopReason]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_INT64: DType
DTYPE_INT32: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT64: DType
ERROR_CATEGORY_UNSPECIFIED: ErrorCategory
ERROR_CATEGORY_USER: ErrorCategory
ERROR_CATEGORY_SERVER: ErrorCategory
ERROR_CATEGORY_UNKNOWN: ErrorCategory
STOP_REASON_UNSPECIFIED: StopReason
STOP_REASON_STOP: StopReason
STOP_REASON_LENGTH: StopReason

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ErrorInfo(_message.Message):
    __slots__ = ("category", "field", "message", "reason")
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    category: ErrorCategory
    field: str
    message: str
    reason: str
    def __init__(self, category: _Optional[_Union[ErrorCategory, str]] = ..., field: _Optional[str] = ..., message: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class LoraConfig(_message.Message):
    __slots__ = ("rank", "alpha", "dropout", "seed", "target_modules", "exclude_modules", "train_attn", "train_mlp", "train_unembed", "lora_plus_ratio", "a_only_weight_decay")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    DROPOUT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_MODULES_FIELD_NUMBER: _ClassVar[int]
    TRAIN_ATTN_FIELD_NUMBER: _ClassVar[int]
    TRAIN_MLP_FIELD_NUMBER: _ClassVar[int]
    TRAIN_UNEMBED_FIELD_NUMBER: _ClassVar[int]
    LORA_PLUS_RATIO_FIELD_NUMBER: _ClassVar[int]
    A_ONLY_WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    rank: int
    alpha: float
    dropout: float
    seed: int
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    exclude_modules: _containers.RepeatedScalarFieldContainer[str]
    train_attn: bool
    train_mlp: bool
    train_unembed: bool
    lora_plus_ratio: float
    a_only_weight_decay: bool
    def __init__(self, rank: _Optional[int] = ..., alpha: _Optional[float] = ..., dropout: _Optional[float] = ..., seed: _Optional[int] = ..., target_modules: _Optional[_Iterable[str]] = ..., exclude_modules: _Optional[_Iterable[str]] = ..., train_attn: _Optional[bool] = ..., train_mlp: _Optional[bool] = ..., train_unembed: _Optional[bool] = ..., lora_plus_ratio: _Optional[float] = ..., a_only_weight_decay: _Optional[bool] = ...) -> None: ...

class AdamParams(_message.Message):
    __slots__ = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    GRAD_CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip_norm: float
    def __init__(self, learning_rate: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ..., grad_clip_norm: _Optional[float] = ...) -> None: ...

class Datum(_message.Message):
    __slots__ = ("tokens", "loss_fn_inputs")
    class LossFnInputsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_INPUTS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    loss_fn_inputs: _containers.MessageMap[str, Tensor]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., loss_fn_inputs: _Optional[_Mapping[str, Tensor]] = ...) -> None: ...

class ForwardBackwardInput(_message.Message):
    __slots__ = ("data", "loss_fn", "loss_fn_config", "forward_only")
    class LossFnConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    DATA_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_CONFIG_FIELD_NUMBER: _ClassVar[int]
    FORWARD_ONLY_FIELD_NUMBER: _ClassVar[int]
    data: _containers.RepeatedCompositeFieldContainer[Datum]
    loss_fn: str
    loss_fn_config: _containers.ScalarMap[str, float]
    forward_only: bool
    def __init__(self, data: _Optional[_Iterable[_Union[Datum, _Mapping]]] = ..., loss_fn: _Optional[str] = ..., loss_fn_config: _Optional[_Mapping[str, float]] = ..., forward_only: _Optional[bool] = ...) -> None: ...

class DatumOutput(_message.Message):
    __slots__ = ("outputs",)
    class OutputsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.MessageMap[str, Tensor]
    def __init__(self, outputs: _Optional[_Mapping[str, Tensor]] = ...) -> None: ...

class ForwardBackwardOutput(_message.Message):
    __slots__ = ("outputs", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[DatumOutput]
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, outputs: _Optional[_Iterable[_Union[DatumOutput, _Mapping]]] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class OptimStepOutput(_message.Message):
    __slots__ = ("metrics", "applied", "note")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    METRICS_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    metrics: _containers.ScalarMap[str, float]
    applied: bool
    note: str
    def __init__(self, metrics: _Optional[_Mapping[str, float]] = ..., applied: _Optional[bool] = ..., note: _Optional[str] = ...) -> None: ...

class BlobRef(_message.Message):
    __slots__ = ("uri", "sha256", "size_bytes")
    URI_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    uri: str
    sha256: str
    size_bytes: int
    def __init__(self, uri: _Optional[str] = ..., sha256: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("path", "offset", "data", "sha256")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    path: str
    offset: int
    data: bytes
    sha256: str
    def __init__(self, path: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., sha256: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "seed", "temperature", "top_k", "top_p", "stop_strings", "stop_token_ids", "disable_eos_stop")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DISABLE_EOS_STOP_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    seed: int
    temperature: float
    top_k: int
    top_p: float
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    disable_eos_stop: bool
    def __init__(self, max_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., stop_strings: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., disable_eos_stop: _Optional[bool] = ...) -> None: ...

class SampledSequence(_message.Message):
    __slots__ = ("tokens", "logprobs", "stop_reason")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    stop_reason: StopReason
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., stop_reason: _Optional[_Union[StopReason, str]] = ...) -> None: ...

class TopKLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class SampleOutput(_message.Message):
    __slots__ = ("sequences", "prompt_logprobs", "topk_prompt_logprobs")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOPK_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SampledSequence]
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    topk_prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TopKLogprobs]
    def __init__(self, sequences: _Optional[_Iterable[_Union[SampledSequence, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., topk_prompt_logprobs: _Optional[_Iterable[_Union[TopKLogprobs, _Mapping]]] = ...) -> None: ...

class AdapterRef(_message.Message):
    __slots__ = ("registration_id", "version")
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    registration_id: str
    version: int
    def __init__(self, registration_id: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...
