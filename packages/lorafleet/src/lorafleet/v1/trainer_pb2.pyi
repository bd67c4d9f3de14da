from lorafleet.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetTrainerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTrainerInfoResponse(_message.Message):
    __slots__ = ("replica_id", "base_model", "num_slots", "max_rank", "loss_fns", "optimizers", "vocab_size", "max_context_length", "incarnation")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MAX_RANK_FIELD_NUMBER: _ClassVar[int]
    LOSS_FNS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZERS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    base_model: str
    num_slots: int
    max_rank: int
    loss_fns: _containers.RepeatedScalarFieldContainer[str]
    optimizers: _containers.RepeatedScalarFieldContainer[str]
    vocab_size: int
    max_context_length: int
    incarnation: str
    def __init__(self, replica_id: _Optional[str] = ..., base_model: _Optional[str] = ..., num_slots: _Optional[int] = ..., max_rank: _Optional[int] = ..., loss_fns: _Optional[_Iterable[str]] = ..., optimizers: _Optional[_Iterable[str]] = ..., vocab_size: _Optional[int] = ..., max_context_length: _Optional[int] = ..., incarnation: _Optional[str] = ...) -> None: ...

class ListSlotsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SlotInfo(_message.Message):
    __slots__ = ("slot", "registration_id", "lora_config", "optim_steps", "has_pending_gradients", "tokens_trained")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_CONFIG_FIELD_NUMBER: _ClassVar[int]
    OPTIM_STEPS_FIELD_NUMBER: _ClassVar[int]
    HAS_PENDING_GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    slot: int
    registration_id: str
    lora_config: _common_pb2.LoraConfig
    optim_steps: int
    has_pending_gradients: bool
    tokens_trained: int
    def __init__(self, slot: _Optional[int] = ..., registration_id: _Optional[str] = ..., lora_config: _Optional[_Union[_common_pb2.LoraConfig, _Mapping]] = ..., optim_steps: _Optional[int] = ..., has_pending_gradients: _Optional[bool] = ..., tokens_trained: _Optional[int] = ...) -> None: ...

class ListSlotsResponse(_message.Message):
    __slots__ = ("slots",)
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedCompositeFieldContainer[SlotInfo]
    def __init__(self, slots: _Optional[_Iterable[_Union[SlotInfo, _Mapping]]] = ...) -> None: ...

class BindSlotRequest(_message.Message):
    __slots__ = ("slot", "registration_id", "lora_config")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_CONFIG_FIELD_NUMBER: _ClassVar[int]
    slot: int
    registration_id: str
    lora_config: _common_pb2.LoraConfig
    def __init__(self, slot: _Optional[int] = ..., registration_id: _Optional[str] = ..., lora_config: _Optional[_Union[_common_pb2.LoraConfig, _Mapping]] = ...) -> None: ...

class BindSlotResponse(_message.Message):
    __slots__ = ("slot",)
    SLOT_FIELD_NUMBER: _ClassVar[int]
    slot: SlotInfo
    def __init__(self, slot: _Optional[_Union[SlotInfo, _Mapping]] = ...) -> None: ...

class UnbindSlotRequest(_message.Message):
    __slots__ = ("slot", "registration_id")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    slot: int
    registration_id: str
    def __init__(self, slot: _Optional[int] = ..., registration_id: _Optional[str] = ...) -> None: ...

class UnbindSlotResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ForwardBackwardItem(_message.Message):
    __slots__ = ("operation_id", "slot", "registration_id", "input")
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    operation_id: str
    slot: int
    registration_id: str
    input: _common_pb2.ForwardBackwardInput
    def __init__(self, operation_id: _Optional[str] = ..., slot: _Optional[int] = ..., registration_id: _Optional[str] = ..., input: _Optional[_Union[_common_pb2.ForwardBackwardInput, _Mapping]] = ...) -> None: ...

class ForwardBackwardRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ForwardBackwardItem]
    def __init__(self, items: _Optional[_Iterable[_Union[ForwardBackwardItem, _Mapping]]] = ...) -> None: ...

class ForwardBackwardItemResult(_message.Message):
    __slots__ = ("operation_id", "output", "error")
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    operation_id: str
    output: _common_pb2.ForwardBackwardOutput
    error: _common_pb2.ErrorInfo
    def __init__(self, operation_id: _Optional[str] = ..., output: _Optional[_Union[_common_pb2.ForwardBackwardOutput, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.ErrorInfo, _Mapping]] = ...) -> None: ...

class ForwardBackwardResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ForwardBackwardItemResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ForwardBackwardItemResult, _Mapping]]] = ...) -> None: ...

class OptimStepRequest(_message.Message):
    __slots__ = ("operation_id", "slot", "registration_id", "adam_params")
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    ADAM_PARAMS_FIELD_NUMBER: _ClassVar[int]
    operation_id: str
    slot: int
    registration_id: str
    adam_params: _common_pb2.AdamParams
    def __init__(self, operation_id: _Optional[str] = ..., slot: _Optional[int] = ..., registration_id: _Optional[str] = ..., adam_params: _Optional[_Union[_common_pb2.AdamParams, _Mapping]] = ...) -> None: ...

class OptimStepResponse(_message.Message):
    __slots__ = ("output",)
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    output: _common_pb2.OptimStepOutput
    def __init__(self, output: _Optional[_Union[_common_pb2.OptimStepOutput, _Mapping]] = ...) -> None: ...

class SaveStateRequest(_message.Message):
    __slots__ = ("operation_id", "slot", "registration_id", "name", "include_optimizer")
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    operation_id: str
    slot: int
    registration_id: str
    name: str
    include_optimizer: bool
    def __init__(self, operation_id: _Optional[str] = ..., slot: _Optional[int] = ..., registration_id: _Optional[str] = ..., name: _Optional[str] = ..., include_optimizer: _Optional[bool] = ...) -> None: ...

class SaveStateResponse(_message.Message):
    __slots__ = ("manifest",)
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    manifest: _common_pb2.BlobRef
    def __init__(self, manifest: _Optional[_Union[_common_pb2.BlobRef, _Mapping]] = ...) -> None: ...

class LoadStateRequest(_message.Message):
    __slots__ = ("operation_id", "slot", "registration_id", "manifest", "include_optimizer")
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    operation_id: str
    slot: int
    registration_id: str
    manifest: _common_pb2.BlobRef
    include_optimizer: bool
    def __init__(self, operation_id: _Optional[str] = ..., slot: _Optional[int] = ..., registration_id: _Optional[str] = ..., manifest: _Optional[_Union[_common_pb2.BlobRef, _Mapping]] = ..., include_optimizer: _Optional[bool] = ...) -> None: ...

class LoadStateResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExportAdapterRequest(_message.Message):
    __slots__ = ("slot", "registration_id")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    slot: int
    registration_id: str
    def __init__(self, slot: _Optional[int] = ..., registration_id: _Optional[str] = ...) -> None: ...

class ExportAdapterChunk(_message.Message):
    __slots__ = ("chunk",)
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    chunk: _common_pb2.FileChunk
    def __init__(self, chunk: _Optional[_Union[_common_pb2.FileChunk, _Mapping]] = ...) -> None: ...

class ImportAdapterHeader(_message.Message):
    __slots__ = ("operation_id", "slot", "registration_id")
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    operation_id: str
    slot: int
    registration_id: str
    def __init__(self, operation_id: _Optional[str] = ..., slot: _Optional[int] = ..., registration_id: _Optional[str] = ...) -> None: ...

class ImportAdapterChunk(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: ImportAdapterHeader
    chunk: _common_pb2.FileChunk
    def __init__(self, header: _Optional[_Union[ImportAdapterHeader, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.FileChunk, _Mapping]] = ...) -> None: ...

class ImportAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
