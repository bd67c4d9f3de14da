from lorafleet.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetRolloutInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetRolloutInfoResponse(_message.Message):
    __slots__ = ("replica_id", "base_model", "engine", "max_loaded_adapters", "max_queued_requests", "max_lora_rank", "max_context_length", "incarnation")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MAX_LOADED_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    base_model: str
    engine: str
    max_loaded_adapters: int
    max_queued_requests: int
    max_lora_rank: int
    max_context_length: int
    incarnation: str
    def __init__(self, replica_id: _Optional[str] = ..., base_model: _Optional[str] = ..., engine: _Optional[str] = ..., max_loaded_adapters: _Optional[int] = ..., max_queued_requests: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., max_context_length: _Optional[int] = ..., incarnation: _Optional[str] = ...) -> None: ...

class AdapterHeader(_message.Message):
    __slots__ = ("adapter", "lora_config", "file_sha256")
    class FileSha256Entry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    LORA_CONFIG_FIELD_NUMBER: _ClassVar[int]
    FILE_SHA256_FIELD_NUMBER: _ClassVar[int]
    adapter: _common_pb2.AdapterRef
    lora_config: _common_pb2.LoraConfig
    file_sha256: _containers.ScalarMap[str, str]
    def __init__(self, adapter: _Optional[_Union[_common_pb2.AdapterRef, _Mapping]] = ..., lora_config: _Optional[_Union[_common_pb2.LoraConfig, _Mapping]] = ..., file_sha256: _Optional[_Mapping[str, str]] = ...) -> None: ...

class LoadAdapterChunk(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: AdapterHeader
    chunk: _common_pb2.FileChunk
    def __init__(self, header: _Optional[_Union[AdapterHeader, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.FileChunk, _Mapping]] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("adapter_id", "already_loaded")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    ALREADY_LOADED_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    already_loaded: bool
    def __init__(self, adapter_id: _Optional[str] = ..., already_loaded: _Optional[bool] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: _common_pb2.AdapterRef
    def __init__(self, adapter: _Optional[_Union[_common_pb2.AdapterRef, _Mapping]] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResidentAdapter(_message.Message):
    __slots__ = ("adapter", "adapter_id", "rank", "in_flight")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    adapter: _common_pb2.AdapterRef
    adapter_id: str
    rank: int
    in_flight: int
    def __init__(self, adapter: _Optional[_Union[_common_pb2.AdapterRef, _Mapping]] = ..., adapter_id: _Optional[str] = ..., rank: _Optional[int] = ..., in_flight: _Optional[int] = ...) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[ResidentAdapter]
    def __init__(self, adapters: _Optional[_Iterable[_Union[ResidentAdapter, _Mapping]]] = ...) -> None: ...

class SampleRequest(_message.Message):
    __slots__ = ("request_id", "adapter", "prompt_tokens", "params", "num_samples", "prompt_logprobs", "topk_prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOPK_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    adapter: _common_pb2.AdapterRef
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    num_samples: int
    prompt_logprobs: bool
    topk_prompt_logprobs: int
    def __init__(self, request_id: _Optional[str] = ..., adapter: _Optional[_Union[_common_pb2.AdapterRef, _Mapping]] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., num_samples: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., topk_prompt_logprobs: _Optional[int] = ...) -> None: ...

class SampleResponse(_message.Message):
    __slots__ = ("output",)
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    output: _common_pb2.SampleOutput
    def __init__(self, output: _Optional[_Union[_common_pb2.SampleOutput, _Mapping]] = ...) -> None: ...
