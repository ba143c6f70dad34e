from hsched.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PlaceOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PLACE_OUTCOME_UNSPECIFIED: _ClassVar[PlaceOutcome]
    PLACE_OUTCOME_PLACED: _ClassVar[PlaceOutcome]
    PLACE_OUTCOME_DEFERRED: _ClassVar[PlaceOutcome]
    PLACE_OUTCOME_NO_ROOM: _ClassVar[PlaceOutcome]
    PLACE_OUTCOME_UNSCHEDULABLE: _ClassVar[PlaceOutcome]
    PLACE_OUTCOME_FINISHED: _ClassVar[PlaceOutcome]
PLACE_OUTCOME_UNSPECIFIED: PlaceOutcome
PLACE_OUTCOME_PLACED: PlaceOutcome
PLACE_OUTCOME_DEFERRED: PlaceOutcome
PLACE_OUTCOME_NO_ROOM: PlaceOutcome
PLACE_OUTCOME_UNSCHEDULABLE: PlaceOutcome
PLACE_OUTCOME_FINISHED: PlaceOutcome

class PlaceRequest(_message.Message):
    __slots__ = ("task_id", "task", "allow_defer", "trace_context", "not_after_unix_ms", "no_preemption")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    ALLOW_DEFER_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    NOT_AFTER_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    NO_PREEMPTION_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    task: _common_pb2.TaskSpec
    allow_defer: bool
    trace_context: _containers.ScalarMap[str, str]
    not_after_unix_ms: int
    no_preemption: bool
    def __init__(self, task_id: _Optional[str] = ..., task: _Optional[_Union[_common_pb2.TaskSpec, _Mapping]] = ..., allow_defer: _Optional[bool] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., not_after_unix_ms: _Optional[int] = ..., no_preemption: _Optional[bool] = ...) -> None: ...

class PlaceBatchRequest(_message.Message):
    __slots__ = ("calls",)
    CALLS_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[PlaceRequest]
    def __init__(self, calls: _Optional[_Iterable[_Union[PlaceRequest, _Mapping]]] = ...) -> None: ...

class PlaceBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PlaceBatchItem]
    def __init__(self, results: _Optional[_Iterable[_Union[PlaceBatchItem, _Mapping]]] = ...) -> None: ...

class PlaceBatchItem(_message.Message):
    __slots__ = ("response", "error")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    response: PlaceResponse
    error: _common_pb2.BatchItemError
    def __init__(self, response: _Optional[_Union[PlaceResponse, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.BatchItemError, _Mapping]] = ...) -> None: ...

class PlaceResponse(_message.Message):
    __slots__ = ("outcome", "assignments", "policy", "alternatives", "thermal", "reason", "ledger_id", "notes", "finished_ok", "finished_unix_ms")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENTS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
    THERMAL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LEDGER_ID_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    FINISHED_OK_FIELD_NUMBER: _ClassVar[int]
    FINISHED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    outcome: PlaceOutcome
    assignments: _containers.RepeatedCompositeFieldContainer[_common_pb2.Assignment]
    policy: str
    alternatives: _containers.RepeatedCompositeFieldContainer[_common_pb2.Alternative]
    thermal: _common_pb2.ThermalEffect
    reason: str
    ledger_id: str
    notes: _containers.RepeatedScalarFieldContainer[str]
    finished_ok: bool
    finished_unix_ms: int
    def __init__(self, outcome: _Optional[_Union[PlaceOutcome, str]] = ..., assignments: _Optional[_Iterable[_Union[_common_pb2.Assignment, _Mapping]]] = ..., policy: _Optional[str] = ..., alternatives: _Optional[_Iterable[_Union[_common_pb2.Alternative, _Mapping]]] = ..., thermal: _Optional[_Union[_common_pb2.ThermalEffect, _Mapping]] = ..., reason: _Optional[str] = ..., ledger_id: _Optional[str] = ..., notes: _Optional[_Iterable[str]] = ..., finished_ok: _Optional[bool] = ..., finished_unix_ms: _Optional[int] = ...) -> None: ...

class PlacerReleaseRequest(_message.Message):
    __slots__ = ("task_id", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, task_id: _Optional[str] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class PlacerReleaseBatchRequest(_message.Message):
    __slots__ = ("calls",)
    CALLS_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[PlacerReleaseRequest]
    def __init__(self, calls: _Optional[_Iterable[_Union[PlacerReleaseRequest, _Mapping]]] = ...) -> None: ...

class PlacerReleaseBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PlacerReleaseBatchItem]
    def __init__(self, results: _Optional[_Iterable[_Union[PlacerReleaseBatchItem, _Mapping]]] = ...) -> None: ...

class PlacerReleaseBatchItem(_message.Message):
    __slots__ = ("response", "error")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    response: PlacerReleaseResponse
    error: _common_pb2.BatchItemError
    def __init__(self, response: _Optional[_Union[PlacerReleaseResponse, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.BatchItemError, _Mapping]] = ...) -> None: ...

class QueuedPlacement(_message.Message):
    __slots__ = ("task_id", "assignments")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENTS_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    assignments: _containers.RepeatedCompositeFieldContainer[_common_pb2.Assignment]
    def __init__(self, task_id: _Optional[str] = ..., assignments: _Optional[_Iterable[_Union[_common_pb2.Assignment, _Mapping]]] = ...) -> None: ...

class PlacerReleaseResponse(_message.Message):
    __slots__ = ("released", "freed", "placed_from_queue")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    FREED_FIELD_NUMBER: _ClassVar[int]
    PLACED_FROM_QUEUE_FIELD_NUMBER: _ClassVar[int]
    released: bool
    freed: _common_pb2.Resources
    placed_from_queue: _containers.RepeatedCompositeFieldContainer[QueuedPlacement]
    def __init__(self, released: _Optional[bool] = ..., freed: _Optional[_Union[_common_pb2.Resources, _Mapping]] = ..., placed_from_queue: _Optional[_Iterable[_Union[QueuedPlacement, _Mapping]]] = ...) -> None: ...

class PlacerStateRequest(_message.Message):
    __slots__ = ("include_nodes", "include_tenants")
    INCLUDE_NODES_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_TENANTS_FIELD_NUMBER: _ClassVar[int]
    include_nodes: bool
    include_tenants: bool
    def __init__(self, include_nodes: _Optional[bool] = ..., include_tenants: _Optional[bool] = ...) -> None: ...

class ShareVector(_message.Message):
    __slots__ = ("cpu_milli", "memory_mib", "gpu_core_percent")
    CPU_MILLI_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    GPU_CORE_PERCENT_FIELD_NUMBER: _ClassVar[int]
    cpu_milli: float
    memory_mib: float
    gpu_core_percent: float
    def __init__(self, cpu_milli: _Optional[float] = ..., memory_mib: _Optional[float] = ..., gpu_core_percent: _Optional[float] = ...) -> None: ...

class TenantShare(_message.Message):
    __slots__ = ("tenant", "weight", "allocated", "requested", "deserved", "share", "running_tasks", "queued_tasks")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_FIELD_NUMBER: _ClassVar[int]
    DESERVED_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_TASKS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TASKS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    weight: float
    allocated: ShareVector
    requested: ShareVector
    deserved: ShareVector
    share: float
    running_tasks: int
    queued_tasks: int
    def __init__(self, tenant: _Optional[str] = ..., weight: _Optional[float] = ..., allocated: _Optional[_Union[ShareVector, _Mapping]] = ..., requested: _Optional[_Union[ShareVector, _Mapping]] = ..., deserved: _Optional[_Union[ShareVector, _Mapping]] = ..., share: _Optional[float] = ..., running_tasks: _Optional[int] = ..., queued_tasks: _Optional[int] = ...) -> None: ...

class GpuCardState(_message.Message):
    __slots__ = ("card", "model", "core_percent_free", "memory_mib_free", "memory_mib_capacity")
    CARD_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CORE_PERCENT_FREE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FREE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    card: int
    model: str
    core_percent_free: int
    memory_mib_free: int
    memory_mib_capacity: int
    def __init__(self, card: _Optional[int] = ..., model: _Optional[str] = ..., core_percent_free: _Optional[int] = ..., memory_mib_free: _Optional[int] = ..., memory_mib_capacity: _Optional[int] = ...) -> None: ...

class NodeState(_message.Message):
    __slots__ = ("name", "index", "rack", "capacity", "free", "gpus", "cordoned", "cordon_reason", "cordoned_unix_ms", "tasks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    RACK_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    CORDONED_FIELD_NUMBER: _ClassVar[int]
    CORDON_REASON_FIELD_NUMBER: _ClassVar[int]
    CORDONED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    index: int
    rack: int
    capacity: _common_pb2.Resources
    free: _common_pb2.Resources
    gpus: _containers.RepeatedCompositeFieldContainer[GpuCardState]
    cordoned: bool
    cordon_reason: str
    cordoned_unix_ms: int
    tasks: int
    def __init__(self, name: _Optional[str] = ..., index: _Optional[int] = ..., rack: _Optional[int] = ..., capacity: _Optional[_Union[_common_pb2.Resources, _Mapping]] = ..., free: _Optional[_Union[_common_pb2.Resources, _Mapping]] = ..., gpus: _Optional[_Iterable[_Union[GpuCardState, _Mapping]]] = ..., cordoned: _Optional[bool] = ..., cordon_reason: _Optional[str] = ..., cordoned_unix_ms: _Optional[int] = ..., tasks: _Optional[int] = ...) -> None: ...

class SetSchedulableRequest(_message.Message):
    __slots__ = ("nodes", "schedulable", "reason", "evict")
    NODES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULABLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EVICT_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedScalarFieldContainer[str]
    schedulable: bool
    reason: str
    evict: bool
    def __init__(self, nodes: _Optional[_Iterable[str]] = ..., schedulable: _Optional[bool] = ..., reason: _Optional[str] = ..., evict: _Optional[bool] = ...) -> None: ...

class NodeTaskCount(_message.Message):
    __slots__ = ("node", "tasks")
    NODE_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    node: str
    tasks: int
    def __init__(self, node: _Optional[str] = ..., tasks: _Optional[int] = ...) -> None: ...

class SetSchedulableResponse(_message.Message):
    __slots__ = ("changed", "evicted_task_ids", "remaining", "placed_from_queue")
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    REMAINING_FIELD_NUMBER: _ClassVar[int]
    PLACED_FROM_QUEUE_FIELD_NUMBER: _ClassVar[int]
    changed: _containers.RepeatedScalarFieldContainer[str]
    evicted_task_ids: _containers.RepeatedScalarFieldContainer[str]
    remaining: _containers.RepeatedCompositeFieldContainer[NodeTaskCount]
    placed_from_queue: _containers.RepeatedCompositeFieldContainer[QueuedPlacement]
    def __init__(self, changed: _Optional[_Iterable[str]] = ..., evicted_task_ids: _Optional[_Iterable[str]] = ..., remaining: _Optional[_Iterable[_Union[NodeTaskCount, _Mapping]]] = ..., placed_from_queue: _Optional[_Iterable[_Union[QueuedPlacement, _Mapping]]] = ...) -> None: ...

class PlacerState(_message.Message):
    __slots__ = ("summary", "nodes", "deferred_task_ids", "policy", "thermal", "owner", "tenants")
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    THERMAL_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    summary: _common_pb2.DcSummary
    nodes: _containers.RepeatedCompositeFieldContainer[NodeState]
    deferred_task_ids: _containers.RepeatedScalarFieldContainer[str]
    policy: str
    thermal: _common_pb2.ThermalEffect
    owner: str
    tenants: _containers.RepeatedCompositeFieldContainer[TenantShare]
    def __init__(self, summary: _Optional[_Union[_common_pb2.DcSummary, _Mapping]] = ..., nodes: _Optional[_Iterable[_Union[NodeState, _Mapping]]] = ..., deferred_task_ids: _Optional[_Iterable[str]] = ..., policy: _Optional[str] = ..., thermal: _Optional[_Union[_common_pb2.ThermalEffect, _Mapping]] = ..., owner: _Optional[str] = ..., tenants: _Optional[_Iterable[_Union[TenantShare, _Mapping]]] = ...) -> None: ...
