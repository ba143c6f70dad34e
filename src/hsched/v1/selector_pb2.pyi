from hsched.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SelectRequest(_message.Message):
    __slots__ = ("task", "method")
    TASK_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    task: _common_pb2.TaskSpec
    method: str
    def __init__(self, task: _Optional[_Union[_common_pb2.TaskSpec, _Mapping]] = ..., method: _Optional[str] = ...) -> None: ...

class SelectResponse(_message.Message):
    __slots__ = ("method", "candidates", "excluded")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    method: str
    candidates: _containers.RepeatedCompositeFieldContainer[_common_pb2.DcCandidate]
    excluded: _containers.RepeatedCompositeFieldContainer[_common_pb2.Exclusion]
    def __init__(self, method: _Optional[str] = ..., candidates: _Optional[_Iterable[_Union[_common_pb2.DcCandidate, _Mapping]]] = ..., excluded: _Optional[_Iterable[_Union[_common_pb2.Exclusion, _Mapping]]] = ...) -> None: ...
