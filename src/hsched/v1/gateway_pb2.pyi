from hsched.v1 import common_pb2 as _common_pb2
from hsched.v1 import placer_pb2 as _placer_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SetNodesSchedulableRequest(_message.Message):
    __slots__ = ("datacenter", "nodes", "schedulable", "reason", "evict")
    DATACENTER_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULABLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EVICT_FIELD_NUMBER: _ClassVar[int]
    datacenter: str
    nodes: _containers.RepeatedScalarFieldContainer[str]
    schedulable: bool
    reason: str
    evict: bool
    def __init__(self, datacenter: _Optional[str] = ..., nodes: _Optional[_Iterable[str]] = ..., schedulable: _Optional[bool] = ..., reason: _Optional[str] = ..., evict: _Optional[bool] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("task", "selector_method")
    TASK_FIELD_NUMBER: _ClassVar[int]
    SELECTOR_METHOD_FIELD_NUMBER: _ClassVar[int]
    task: _common_pb2.TaskSpec
    selector_method: str
    def __init__(self, task: _Optional[_Union[_common_pb2.TaskSpec, _Mapping]] = ..., selector_method: _Optional[str] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("task", "duplicate")
    TASK_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    task: _common_pb2.Task
    duplicate: bool
    def __init__(self, task: _Optional[_Union[_common_pb2.Task, _Mapping]] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("task_id",)
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    def __init__(self, task_id: _Optional[str] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("tenant", "state", "datacenter", "limit", "page_token", "job_id")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DATACENTER_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    state: _common_pb2.TaskState
    datacenter: str
    limit: int
    page_token: str
    job_id: str
    def __init__(self, tenant: _Optional[str] = ..., state: _Optional[_Union[_common_pb2.TaskState, str]] = ..., datacenter: _Optional[str] = ..., limit: _Optional[int] = ..., page_token: _Optional[str] = ..., job_id: _Optional[str] = ...) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("tasks", "next_page_token")
    TASKS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[_common_pb2.Task]
    next_page_token: str
    def __init__(self, tasks: _Optional[_Iterable[_Union[_common_pb2.Task, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("task_id", "tenant", "after_event_id", "job_id")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    AFTER_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    tenant: str
    after_event_id: str
    job_id: str
    def __init__(self, task_id: _Optional[str] = ..., tenant: _Optional[str] = ..., after_event_id: _Optional[str] = ..., job_id: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("task_id",)
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    def __init__(self, task_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("task",)
    TASK_FIELD_NUMBER: _ClassVar[int]
    task: _common_pb2.Task
    def __init__(self, task: _Optional[_Union[_common_pb2.Task, _Mapping]] = ...) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("job", "selector_method")
    JOB_FIELD_NUMBER: _ClassVar[int]
    SELECTOR_METHOD_FIELD_NUMBER: _ClassVar[int]
    job: _common_pb2.JobSpec
    selector_method: str
    def __init__(self, job: _Optional[_Union[_common_pb2.JobSpec, _Mapping]] = ..., selector_method: _Optional[str] = ...) -> None: ...

class SubmitJobResponse(_message.Message):
    __slots__ = ("job", "duplicate")
    JOB_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    job: _common_pb2.Job
    duplicate: bool
    def __init__(self, job: _Optional[_Union[_common_pb2.Job, _Mapping]] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("tenant", "state", "limit", "page_token")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    state: _common_pb2.JobState
    limit: int
    page_token: str
    def __init__(self, tenant: _Optional[str] = ..., state: _Optional[_Union[_common_pb2.JobState, str]] = ..., limit: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Job]
    next_page_token: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[_common_pb2.Job, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListDatacentersRequest(_message.Message):
    __slots__ = ("include_tenants",)
    INCLUDE_TENANTS_FIELD_NUMBER: _ClassVar[int]
    include_tenants: bool
    def __init__(self, include_tenants: _Optional[bool] = ...) -> None: ...

class ListDatacentersResponse(_message.Message):
    __slots__ = ("datacenters",)
    DATACENTERS_FIELD_NUMBER: _ClassVar[int]
    datacenters: _containers.RepeatedCompositeFieldContainer[DatacenterView]
    def __init__(self, datacenters: _Optional[_Iterable[_Union[DatacenterView, _Mapping]]] = ...) -> None: ...

class GetDatacenterRequest(_message.Message):
    __slots__ = ("datacenter", "gpu_model")
    DATACENTER_FIELD_NUMBER: _ClassVar[int]
    GPU_MODEL_FIELD_NUMBER: _ClassVar[int]
    datacenter: str
    gpu_model: str
    def __init__(self, datacenter: _Optional[str] = ..., gpu_model: _Optional[str] = ...) -> None: ...

class PlacerLease(_message.Message):
    __slots__ = ("holder", "ttl_ms", "fencing_token")
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    holder: str
    ttl_ms: int
    fencing_token: int
    def __init__(self, holder: _Optional[str] = ..., ttl_ms: _Optional[int] = ..., fencing_token: _Optional[int] = ...) -> None: ...

class GpuModelCapacity(_message.Message):
    __slots__ = ("model", "cards", "cards_idle", "core_percent_free", "memory_mib_free", "memory_mib_capacity")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CARDS_FIELD_NUMBER: _ClassVar[int]
    CARDS_IDLE_FIELD_NUMBER: _ClassVar[int]
    CORE_PERCENT_FREE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FREE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    model: str
    cards: int
    cards_idle: int
    core_percent_free: int
    memory_mib_free: int
    memory_mib_capacity: int
    def __init__(self, model: _Optional[str] = ..., cards: _Optional[int] = ..., cards_idle: _Optional[int] = ..., core_percent_free: _Optional[int] = ..., memory_mib_free: _Optional[int] = ..., memory_mib_capacity: _Optional[int] = ...) -> None: ...

class DatacenterView(_message.Message):
    __slots__ = ("datacenter", "vertex", "kind", "status", "reason", "lease", "summary", "policy", "gpus", "thermal", "nodes", "tenants")
    DATACENTER_FIELD_NUMBER: _ClassVar[int]
    VERTEX_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    THERMAL_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    datacenter: str
    vertex: str
    kind: str
    status: str
    reason: str
    lease: PlacerLease
    summary: _common_pb2.DcSummary
    policy: str
    gpus: _containers.RepeatedCompositeFieldContainer[GpuModelCapacity]
    thermal: _common_pb2.ThermalEffect
    nodes: _containers.RepeatedCompositeFieldContainer[_placer_pb2.NodeState]
    tenants: _containers.RepeatedCompositeFieldContainer[_placer_pb2.TenantShare]
    def __init__(self, datacenter: _Optional[str] = ..., vertex: _Optional[str] = ..., kind: _Optional[str] = ..., status: _Optional[str] = ..., reason: _Optional[str] = ..., lease: _Optional[_Union[PlacerLease, _Mapping]] = ..., summary: _Optional[_Union[_common_pb2.DcSummary, _Mapping]] = ..., policy: _Optional[str] = ..., gpus: _Optional[_Iterable[_Union[GpuModelCapacity, _Mapping]]] = ..., thermal: _Optional[_Union[_common_pb2.ThermalEffect, _Mapping]] = ..., nodes: _Optional[_Iterable[_Union[_placer_pb2.NodeState, _Mapping]]] = ..., tenants: _Optional[_Iterable[_Union[_placer_pb2.TenantShare, _Mapping]]] = ...) -> None: ...

class TaskDescription(_message.Message):
    __slots__ = ("task", "events", "events_truncated")
    TASK_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    task: _common_pb2.Task
    events: _containers.RepeatedCompositeFieldContainer[_common_pb2.TaskEvent]
    events_truncated: bool
    def __init__(self, task: _Optional[_Union[_common_pb2.Task, _Mapping]] = ..., events: _Optional[_Iterable[_Union[_common_pb2.TaskEvent, _Mapping]]] = ..., events_truncated: _Optional[bool] = ...) -> None: ...
