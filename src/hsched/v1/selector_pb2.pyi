from hsched.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SelectRequest(_message.Message):
    __slots__ = ("task", "method", "trace_context", "include_room")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TASK_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_ROOM_FIELD_NUMBER: _ClassVar[int]
    task: _common_pb2.TaskSpec
    method: str
    trace_context: _containers.ScalarMap[str, str]
    include_room: bool
    def __init__(self, task: _Optional[_Union[_common_pb2.TaskSpec, _Mapping]] = ..., method: _Optional[str] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., include_room: _Optional[bool] = ...) -> None: ...

class SelectBatchRequest(_message.Message):
    __slots__ = ("calls",)
    CALLS_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[SelectRequest]
    def __init__(self, calls: _Optional[_Iterable[_Union[SelectRequest, _Mapping]]] = ...) -> None: ...

class SelectBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SelectBatchItem]
    def __init__(self, results: _Optional[_Iterable[_Union[SelectBatchItem, _Mapping]]] = ...) -> None: ...

class SelectBatchItem(_message.Message):
    __slots__ = ("response", "error")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    response: SelectResponse
    error: _common_pb2.BatchItemError
    def __init__(self, response: _Optional[_Union[SelectResponse, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.BatchItemError, _Mapping]] = ...) -> None: ...

class SelectResponse(_message.Message):
    __slots__ = ("method", "candidates", "excluded")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    method: str
    candidates: _containers.RepeatedCompositeFieldContainer[_common_pb2.DcCandidate]
    excluded: _containers.RepeatedCompositeFieldContainer[_common_pb2.Exclusion]
    def __init__(self, method: _Optional[str] = ..., candidates: _Optional[_Iterable[_Union[_common_pb2.DcCandidate, _Mapping]]] = ..., excluded: _Optional[_Iterable[_Union[_common_pb2.Exclusion, _Mapping]]] = ...) -> None: ...
