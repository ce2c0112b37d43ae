from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Chunk(_message.Message):
    __slots__ = ("data", "last")
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    last: bool
    def __init__(self, data: _Optional[bytes] = ..., last: _Optional[bool] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class NamedTensor(_message.Message):
    __slots__ = ("name", "tensor")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    name: str
    tensor: Tensor
    def __init__(self, name: _Optional[str] = ..., tensor: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("pipeline_id", "microbatch", "outer_step", "inner_step", "stage", "tokens", "hidden", "targets", "train", "attempt", "route", "window", "defer_norms", "uncompressed")
    PIPELINE_ID_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    OUTER_STEP_FIELD_NUMBER: _ClassVar[int]
    INNER_STEP_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    DEFER_NORMS_FIELD_NUMBER: _ClassVar[int]
    UNCOMPRESSED_FIELD_NUMBER: _ClassVar[int]
    pipeline_id: str
    microbatch: int
    outer_step: int
    inner_step: int
    stage: int
    tokens: Tensor
    hidden: Tensor
    targets: Tensor
    train: bool
    attempt: int
    route: _containers.RepeatedScalarFieldContainer[str]
    window: int
    defer_norms: bool
    uncompressed: bool
    def __init__(self, pipeline_id: _Optional[str] = ..., microbatch: _Optional[int] = ..., outer_step: _Optional[int] = ..., inner_step: _Optional[int] = ..., stage: _Optional[int] = ..., tokens: _Optional[_Union[Tensor, _Mapping]] = ..., hidden: _Optional[_Union[Tensor, _Mapping]] = ..., targets: _Optional[_Union[Tensor, _Mapping]] = ..., train: _Optional[bool] = ..., attempt: _Optional[int] = ..., route: _Optional[_Iterable[str]] = ..., window: _Optional[int] = ..., defer_norms: _Optional[bool] = ..., uncompressed: _Optional[bool] = ...) -> None: ...

class ForwardReply(_message.Message):
    __slots__ = ("hidden", "loss", "grad", "grad_sq_norm", "sq_norms", "served_s")
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    GRAD_FIELD_NUMBER: _ClassVar[int]
    GRAD_SQ_NORM_FIELD_NUMBER: _ClassVar[int]
    SQ_NORMS_FIELD_NUMBER: _ClassVar[int]
    SERVED_S_FIELD_NUMBER: _ClassVar[int]
    hidden: Tensor
    loss: float
    grad: Tensor
    grad_sq_norm: float
    sq_norms: _containers.RepeatedScalarFieldContainer[float]
    served_s: float
    def __init__(self, hidden: _Optional[_Union[Tensor, _Mapping]] = ..., loss: _Optional[float] = ..., grad: _Optional[_Union[Tensor, _Mapping]] = ..., grad_sq_norm: _Optional[float] = ..., sq_norms: _Optional[_Iterable[float]] = ..., served_s: _Optional[float] = ...) -> None: ...

class BackwardRequest(_message.Message):
    __slots__ = ("pipeline_id", "microbatch", "outer_step", "inner_step", "stage", "grad", "uncompressed")
    PIPELINE_ID_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    OUTER_STEP_FIELD_NUMBER: _ClassVar[int]
    INNER_STEP_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    GRAD_FIELD_NUMBER: _ClassVar[int]
    UNCOMPRESSED_FIELD_NUMBER: _ClassVar[int]
    pipeline_id: str
    microbatch: int
    outer_step: int
    inner_step: int
    stage: int
    grad: Tensor
    uncompressed: bool
    def __init__(self, pipeline_id: _Optional[str] = ..., microbatch: _Optional[int] = ..., outer_step: _Optional[int] = ..., inner_step: _Optional[int] = ..., stage: _Optional[int] = ..., grad: _Optional[_Union[Tensor, _Mapping]] = ..., uncompressed: _Optional[bool] = ...) -> None: ...

class BackwardReply(_message.Message):
    __slots__ = ("grad", "grad_sq_norm")
    GRAD_FIELD_NUMBER: _ClassVar[int]
    GRAD_SQ_NORM_FIELD_NUMBER: _ClassVar[int]
    grad: Tensor
    grad_sq_norm: float
    def __init__(self, grad: _Optional[_Union[Tensor, _Mapping]] = ..., grad_sq_norm: _Optional[float] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("pipeline_id", "outer_step", "inner_step", "n_microbatches", "tokens", "grad_norm")
    PIPELINE_ID_FIELD_NUMBER: _ClassVar[int]
    OUTER_STEP_FIELD_NUMBER: _ClassVar[int]
    INNER_STEP_FIELD_NUMBER: _ClassVar[int]
    N_MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    pipeline_id: str
    outer_step: int
    inner_step: int
    n_microbatches: int
    tokens: int
    grad_norm: float
    def __init__(self, pipeline_id: _Optional[str] = ..., outer_step: _Optional[int] = ..., inner_step: _Optional[int] = ..., n_microbatches: _Optional[int] = ..., tokens: _Optional[int] = ..., grad_norm: _Optional[float] = ...) -> None: ...

class StepReply(_message.Message):
    __slots__ = ("ok", "message")
    OK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    message: str
    def __init__(self, ok: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class PayloadRequest(_message.Message):
    __slots__ = ("outer_step", "stage", "sender", "kind", "ranges")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        PAYLOAD: _ClassVar[PayloadRequest.Kind]
        PART: _ClassVar[PayloadRequest.Kind]
        SHARD: _ClassVar[PayloadRequest.Kind]
        EMBED: _ClassVar[PayloadRequest.Kind]
    PAYLOAD: PayloadRequest.Kind
    PART: PayloadRequest.Kind
    SHARD: PayloadRequest.Kind
    EMBED: PayloadRequest.Kind
    OUTER_STEP_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    outer_step: int
    stage: int
    sender: str
    kind: PayloadRequest.Kind
    ranges: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, outer_step: _Optional[int] = ..., stage: _Optional[int] = ..., sender: _Optional[str] = ..., kind: _Optional[_Union[PayloadRequest.Kind, str]] = ..., ranges: _Optional[_Iterable[int]] = ...) -> None: ...

class RangeBlob(_message.Message):
    __slots__ = ("range", "data", "proof")
    RANGE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    range: int
    data: bytes
    proof: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, range: _Optional[int] = ..., data: _Optional[bytes] = ..., proof: _Optional[_Iterable[bytes]] = ...) -> None: ...

class RangesReply(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[RangeBlob]
    def __init__(self, items: _Optional[_Iterable[_Union[RangeBlob, _Mapping]]] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("stage",)
    STAGE_FIELD_NUMBER: _ClassVar[int]
    stage: int
    def __init__(self, stage: _Optional[int] = ...) -> None: ...

class StateReply(_message.Message):
    __slots__ = ("outer_step", "meta_json", "tensors")
    OUTER_STEP_FIELD_NUMBER: _ClassVar[int]
    META_JSON_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    outer_step: int
    meta_json: str
    tensors: _containers.RepeatedCompositeFieldContainer[NamedTensor]
    def __init__(self, outer_step: _Optional[int] = ..., meta_json: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[NamedTensor, _Mapping]]] = ...) -> None: ...

class ArtifactRequest(_message.Message):
    __slots__ = ("name", "offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class Blob(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...

class Refusal(_message.Message):
    __slots__ = ("kind", "stage", "outer_step", "inner_step", "attempt")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[Refusal.Kind]
        BUSY: _ClassVar[Refusal.Kind]
        CLAIMED: _ClassVar[Refusal.Kind]
        LOST: _ClassVar[Refusal.Kind]
        STALE: _ClassVar[Refusal.Kind]
        NETWORK: _ClassVar[Refusal.Kind]
        REMOTE: _ClassVar[Refusal.Kind]
    KIND_UNSPECIFIED: Refusal.Kind
    BUSY: Refusal.Kind
    CLAIMED: Refusal.Kind
    LOST: Refusal.Kind
    STALE: Refusal.Kind
    NETWORK: Refusal.Kind
    REMOTE: Refusal.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    OUTER_STEP_FIELD_NUMBER: _ClassVar[int]
    INNER_STEP_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    kind: Refusal.Kind
    stage: int
    outer_step: int
    inner_step: int
    attempt: int
    def __init__(self, kind: _Optional[_Union[Refusal.Kind, str]] = ..., stage: _Optional[int] = ..., outer_step: _Optional[int] = ..., inner_step: _Optional[int] = ..., attempt: _Optional[int] = ...) -> None: ...

class Metadatum(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: str
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("call", "method", "metadata", "data", "end", "code", "details", "timeout_s", "cancel", "refusal")
    CALL_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    call: int
    method: str
    metadata: _containers.RepeatedCompositeFieldContainer[Metadatum]
    data: bytes
    end: bool
    code: int
    details: str
    timeout_s: float
    cancel: bool
    refusal: Refusal
    def __init__(self, call: _Optional[int] = ..., method: _Optional[str] = ..., metadata: _Optional[_Iterable[_Union[Metadatum, _Mapping]]] = ..., data: _Optional[bytes] = ..., end: _Optional[bool] = ..., code: _Optional[int] = ..., details: _Optional[str] = ..., timeout_s: _Optional[float] = ..., cancel: _Optional[bool] = ..., refusal: _Optional[_Union[Refusal, _Mapping]] = ...) -> None: ...

class DialBackRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class DialBackReply(_message.Message):
    __slots__ = ("ok", "peer_id", "detail", "seen_host", "relay")
    OK_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    SEEN_HOST_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    peer_id: str
    detail: str
    seen_host: str
    relay: bool
    def __init__(self, ok: _Optional[bool] = ..., peer_id: _Optional[str] = ..., detail: _Optional[str] = ..., seen_host: _Optional[str] = ..., relay: _Optional[bool] = ...) -> None: ...
