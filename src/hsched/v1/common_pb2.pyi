from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TaskState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_STATE_UNSPECIFIED: _ClassVar[TaskState]
    TASK_STATE_SUBMITTED: _ClassVar[TaskState]
    TASK_STATE_PLACED: _ClassVar[TaskState]
    TASK_STATE_DEFERRED: _ClassVar[TaskState]
    TASK_STATE_REJECTED: _ClassVar[TaskState]
    TASK_STATE_RELEASED: _ClassVar[TaskState]
    TASK_STATE_RUNNING: _ClassVar[TaskState]
    TASK_STATE_SUCCEEDED: _ClassVar[TaskState]
    TASK_STATE_FAILED: _ClassVar[TaskState]
    TASK_STATE_PREEMPTED: _ClassVar[TaskState]
    TASK_STATE_EXPIRED: _ClassVar[TaskState]

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_PENDING: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]
TASK_STATE_UNSPECIFIED: TaskState
TASK_STATE_SUBMITTED: TaskState
TASK_STATE_PLACED: TaskState
TASK_STATE_DEFERRED: TaskState
TASK_STATE_REJECTED: TaskState
TASK_STATE_RELEASED: TaskState
TASK_STATE_RUNNING: TaskState
TASK_STATE_SUCCEEDED: TaskState
TASK_STATE_FAILED: TaskState
TASK_STATE_PREEMPTED: TaskState
TASK_STATE_EXPIRED: TaskState
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_PENDING: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLED: JobState

class Resources(_message.Message):
    __slots__ = ("cpu_milli", "memory_mib", "disk_mib", "bandwidth_mbps", "gpu_count", "gpu_core_percent", "gpu_memory_mib")
    CPU_MILLI_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    DISK_MIB_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_MBPS_FIELD_NUMBER: _ClassVar[int]
    GPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    GPU_CORE_PERCENT_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    cpu_milli: int
    memory_mib: int
    disk_mib: int
    bandwidth_mbps: int
    gpu_count: int
    gpu_core_percent: int
    gpu_memory_mib: int
    def __init__(self, cpu_milli: _Optional[int] = ..., memory_mib: _Optional[int] = ..., disk_mib: _Optional[int] = ..., bandwidth_mbps: _Optional[int] = ..., gpu_count: _Optional[int] = ..., gpu_core_percent: _Optional[int] = ..., gpu_memory_mib: _Optional[int] = ...) -> None: ...

class NetworkRequirements(_message.Message):
    __slots__ = ("max_latency_ms", "max_jitter_ms", "max_loss_percent")
    MAX_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_JITTER_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_LOSS_PERCENT_FIELD_NUMBER: _ClassVar[int]
    max_latency_ms: float
    max_jitter_ms: float
    max_loss_percent: float
    def __init__(self, max_latency_ms: _Optional[float] = ..., max_jitter_ms: _Optional[float] = ..., max_loss_percent: _Optional[float] = ...) -> None: ...

class TaskSpec(_message.Message):
    __slots__ = ("request_id", "tenant", "name", "priority", "resources", "replicas", "runtime_s", "data_size_mb", "entry_vertex", "network", "gpu_models", "priority_class", "queue_timeout_s", "job_id", "stage", "stage_path_s", "job_work_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_S_FIELD_NUMBER: _ClassVar[int]
    DATA_SIZE_MB_FIELD_NUMBER: _ClassVar[int]
    ENTRY_VERTEX_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    GPU_MODELS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_CLASS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STAGE_PATH_S_FIELD_NUMBER: _ClassVar[int]
    JOB_WORK_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: str
    name: str
    priority: int
    resources: Resources
    replicas: int
    runtime_s: float
    data_size_mb: float
    entry_vertex: str
    network: NetworkRequirements
    gpu_models: _containers.RepeatedScalarFieldContainer[str]
    priority_class: str
    queue_timeout_s: float
    job_id: str
    stage: str
    stage_path_s: float
    job_work_s: float
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[str] = ..., name: _Optional[str] = ..., priority: _Optional[int] = ..., resources: _Optional[_Union[Resources, _Mapping]] = ..., replicas: _Optional[int] = ..., runtime_s: _Optional[float] = ..., data_size_mb: _Optional[float] = ..., entry_vertex: _Optional[str] = ..., network: _Optional[_Union[NetworkRequirements, _Mapping]] = ..., gpu_models: _Optional[_Iterable[str]] = ..., priority_class: _Optional[str] = ..., queue_timeout_s: _Optional[float] = ..., job_id: _Optional[str] = ..., stage: _Optional[str] = ..., stage_path_s: _Optional[float] = ..., job_work_s: _Optional[float] = ...) -> None: ...

class GpuSlice(_message.Message):
    __slots__ = ("card", "core_percent", "memory_mib", "model")
    CARD_FIELD_NUMBER: _ClassVar[int]
    CORE_PERCENT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    card: int
    core_percent: int
    memory_mib: int
    model: str
    def __init__(self, card: _Optional[int] = ..., core_percent: _Optional[int] = ..., memory_mib: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("replica", "part", "node", "node_index", "rack", "resources", "gpus")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    NODE_INDEX_FIELD_NUMBER: _ClassVar[int]
    RACK_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    replica: int
    part: int
    node: str
    node_index: int
    rack: int
    resources: Resources
    gpus: _containers.RepeatedCompositeFieldContainer[GpuSlice]
    def __init__(self, replica: _Optional[int] = ..., part: _Optional[int] = ..., node: _Optional[str] = ..., node_index: _Optional[int] = ..., rack: _Optional[int] = ..., resources: _Optional[_Union[Resources, _Mapping]] = ..., gpus: _Optional[_Iterable[_Union[GpuSlice, _Mapping]]] = ...) -> None: ...

class ResourceCost(_message.Message):
    __slots__ = ("cpu", "memory", "disk", "bandwidth", "gpu", "total")
    CPU_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    cpu: float
    memory: float
    disk: float
    bandwidth: float
    gpu: float
    total: float
    def __init__(self, cpu: _Optional[float] = ..., memory: _Optional[float] = ..., disk: _Optional[float] = ..., bandwidth: _Optional[float] = ..., gpu: _Optional[float] = ..., total: _Optional[float] = ...) -> None: ...

class PathInfo(_message.Message):
    __slots__ = ("vertices", "latency_ms", "jitter_ms", "loss_percent", "bottleneck_bandwidth_mbps", "finder")
    VERTICES_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    JITTER_MS_FIELD_NUMBER: _ClassVar[int]
    LOSS_PERCENT_FIELD_NUMBER: _ClassVar[int]
    BOTTLENECK_BANDWIDTH_MBPS_FIELD_NUMBER: _ClassVar[int]
    FINDER_FIELD_NUMBER: _ClassVar[int]
    vertices: _containers.RepeatedScalarFieldContainer[str]
    latency_ms: float
    jitter_ms: float
    loss_percent: float
    bottleneck_bandwidth_mbps: float
    finder: str
    def __init__(self, vertices: _Optional[_Iterable[str]] = ..., latency_ms: _Optional[float] = ..., jitter_ms: _Optional[float] = ..., loss_percent: _Optional[float] = ..., bottleneck_bandwidth_mbps: _Optional[float] = ..., finder: _Optional[str] = ...) -> None: ...

class DcCandidate(_message.Message):
    __slots__ = ("datacenter", "vertex", "resource_cost", "network_cost", "total_cost", "path", "room_now", "queued_tasks")
    DATACENTER_FIELD_NUMBER: _ClassVar[int]
    VERTEX_FIELD_NUMBER: _ClassVar[int]
    RESOURCE_COST_FIELD_NUMBER: _ClassVar[int]
    NETWORK_COST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_COST_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    ROOM_NOW_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TASKS_FIELD_NUMBER: _ClassVar[int]
    datacenter: str
    vertex: str
    resource_cost: ResourceCost
    network_cost: float
    total_cost: float
    path: PathInfo
    room_now: bool
    queued_tasks: int
    def __init__(self, datacenter: _Optional[str] = ..., vertex: _Optional[str] = ..., resource_cost: _Optional[_Union[ResourceCost, _Mapping]] = ..., network_cost: _Optional[float] = ..., total_cost: _Optional[float] = ..., path: _Optional[_Union[PathInfo, _Mapping]] = ..., room_now: _Optional[bool] = ..., queued_tasks: _Optional[int] = ...) -> None: ...

class BatchItemError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class Exclusion(_message.Message):
    __slots__ = ("datacenter", "reason", "unavailable")
    DATACENTER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    datacenter: str
    reason: str
    unavailable: bool
    def __init__(self, datacenter: _Optional[str] = ..., reason: _Optional[str] = ..., unavailable: _Optional[bool] = ...) -> None: ...

class ThermalEffect(_message.Message):
    __slots__ = ("max_inlet_before_c", "max_inlet_after_c", "pue_before", "pue_after", "t_supply_c", "redline_c", "model_version")
    MAX_INLET_BEFORE_C_FIELD_NUMBER: _ClassVar[int]
    MAX_INLET_AFTER_C_FIELD_NUMBER: _ClassVar[int]
    PUE_BEFORE_FIELD_NUMBER: _ClassVar[int]
    PUE_AFTER_FIELD_NUMBER: _ClassVar[int]
    T_SUPPLY_C_FIELD_NUMBER: _ClassVar[int]
    REDLINE_C_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    max_inlet_before_c: float
    max_inlet_after_c: float
    pue_before: float
    pue_after: float
    t_supply_c: float
    redline_c: float
    model_version: int
    def __init__(self, max_inlet_before_c: _Optional[float] = ..., max_inlet_after_c: _Optional[float] = ..., pue_before: _Optional[float] = ..., pue_after: _Optional[float] = ..., t_supply_c: _Optional[float] = ..., redline_c: _Optional[float] = ..., model_version: _Optional[int] = ...) -> None: ...

class Alternative(_message.Message):
    __slots__ = ("node", "node_index", "score")
    NODE_FIELD_NUMBER: _ClassVar[int]
    NODE_INDEX_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    node: str
    node_index: int
    score: float
    def __init__(self, node: _Optional[str] = ..., node_index: _Optional[int] = ..., score: _Optional[float] = ...) -> None: ...

class Explanation(_message.Message):
    __slots__ = ("selector_method", "ranking", "excluded", "placer_policy", "alternatives", "thermal", "notes")
    SELECTOR_METHOD_FIELD_NUMBER: _ClassVar[int]
    RANKING_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    PLACER_POLICY_FIELD_NUMBER: _ClassVar[int]
    ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
    THERMAL_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    selector_method: str
    ranking: _containers.RepeatedCompositeFieldContainer[DcCandidate]
    excluded: _containers.RepeatedCompositeFieldContainer[Exclusion]
    placer_policy: str
    alternatives: _containers.RepeatedCompositeFieldContainer[Alternative]
    thermal: ThermalEffect
    notes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, selector_method: _Optional[str] = ..., ranking: _Optional[_Iterable[_Union[DcCandidate, _Mapping]]] = ..., excluded: _Optional[_Iterable[_Union[Exclusion, _Mapping]]] = ..., placer_policy: _Optional[str] = ..., alternatives: _Optional[_Iterable[_Union[Alternative, _Mapping]]] = ..., thermal: _Optional[_Union[ThermalEffect, _Mapping]] = ..., notes: _Optional[_Iterable[str]] = ...) -> None: ...

class Task(_message.Message):
    __slots__ = ("task_id", "spec", "state", "datacenter", "assignments", "explanation", "reason", "created_unix_ms", "updated_unix_ms", "started_unix_ms", "finished_unix_ms", "preemptions")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DATACENTER_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENTS_FIELD_NUMBER: _ClassVar[int]
    EXPLANATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    spec: TaskSpec
    state: TaskState
    datacenter: str
    assignments: _containers.RepeatedCompositeFieldContainer[Assignment]
    explanation: Explanation
    reason: str
    created_unix_ms: int
    updated_unix_ms: int
    started_unix_ms: int
    finished_unix_ms: int
    preemptions: int
    def __init__(self, task_id: _Optional[str] = ..., spec: _Optional[_Union[TaskSpec, _Mapping]] = ..., state: _Optional[_Union[TaskState, str]] = ..., datacenter: _Optional[str] = ..., assignments: _Optional[_Iterable[_Union[Assignment, _Mapping]]] = ..., explanation: _Optional[_Union[Explanation, _Mapping]] = ..., reason: _Optional[str] = ..., created_unix_ms: _Optional[int] = ..., updated_unix_ms: _Optional[int] = ..., started_unix_ms: _Optional[int] = ..., finished_unix_ms: _Optional[int] = ..., preemptions: _Optional[int] = ...) -> None: ...

class TaskEvent(_message.Message):
    __slots__ = ("event_id", "task_id", "kind", "state", "datacenter", "detail", "unix_ms", "tenant", "job_id")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DATACENTER_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    task_id: str
    kind: str
    state: TaskState
    datacenter: str
    detail: str
    unix_ms: int
    tenant: str
    job_id: str
    def __init__(self, event_id: _Optional[str] = ..., task_id: _Optional[str] = ..., kind: _Optional[str] = ..., state: _Optional[_Union[TaskState, str]] = ..., datacenter: _Optional[str] = ..., detail: _Optional[str] = ..., unix_ms: _Optional[int] = ..., tenant: _Optional[str] = ..., job_id: _Optional[str] = ...) -> None: ...

class StageSpec(_message.Message):
    __slots__ = ("name", "tasks", "resources", "runtime_s", "parents")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_S_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    tasks: int
    resources: Resources
    runtime_s: float
    parents: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., tasks: _Optional[int] = ..., resources: _Optional[_Union[Resources, _Mapping]] = ..., runtime_s: _Optional[float] = ..., parents: _Optional[_Iterable[str]] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("request_id", "tenant", "name", "priority_class", "priority", "data_size_mb", "entry_vertex", "network", "gpu_models", "stages")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_CLASS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DATA_SIZE_MB_FIELD_NUMBER: _ClassVar[int]
    ENTRY_VERTEX_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    GPU_MODELS_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: str
    name: str
    priority_class: str
    priority: int
    data_size_mb: float
    entry_vertex: str
    network: NetworkRequirements
    gpu_models: _containers.RepeatedScalarFieldContainer[str]
    stages: _containers.RepeatedCompositeFieldContainer[StageSpec]
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[str] = ..., name: _Optional[str] = ..., priority_class: _Optional[str] = ..., priority: _Optional[int] = ..., data_size_mb: _Optional[float] = ..., entry_vertex: _Optional[str] = ..., network: _Optional[_Union[NetworkRequirements, _Mapping]] = ..., gpu_models: _Optional[_Iterable[str]] = ..., stages: _Optional[_Iterable[_Union[StageSpec, _Mapping]]] = ...) -> None: ...

class StageStatus(_message.Message):
    __slots__ = ("name", "tasks", "pending", "running", "succeeded", "failed", "task_ids", "cancelled")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    SUCCEEDED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    name: str
    tasks: int
    pending: int
    running: int
    succeeded: int
    failed: int
    task_ids: _containers.RepeatedScalarFieldContainer[str]
    cancelled: int
    def __init__(self, name: _Optional[str] = ..., tasks: _Optional[int] = ..., pending: _Optional[int] = ..., running: _Optional[int] = ..., succeeded: _Optional[int] = ..., failed: _Optional[int] = ..., task_ids: _Optional[_Iterable[str]] = ..., cancelled: _Optional[int] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("job_id", "spec", "state", "datacenter", "stages", "reason", "created_unix_ms", "updated_unix_ms", "finished_unix_ms")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DATACENTER_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    spec: JobSpec
    state: JobState
    datacenter: str
    stages: _containers.RepeatedCompositeFieldContainer[StageStatus]
    reason: str
    created_unix_ms: int
    updated_unix_ms: int
    finished_unix_ms: int
    def __init__(self, job_id: _Optional[str] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., state: _Optional[_Union[JobState, str]] = ..., datacenter: _Optional[str] = ..., stages: _Optional[_Iterable[_Union[StageStatus, _Mapping]]] = ..., reason: _Optional[str] = ..., created_unix_ms: _Optional[int] = ..., updated_unix_ms: _Optional[int] = ..., finished_unix_ms: _Optional[int] = ...) -> None: ...

class DcSummary(_message.Message):
    __slots__ = ("datacenter", "nodes", "capacity", "free", "largest_node", "running_tasks", "deferred_tasks", "cpu_utilisation", "memory_utilisation", "gpu_core_utilisation", "gpu_memory_utilisation", "pue", "max_inlet_c", "ledger_id", "fencing_token", "unix_ms", "gpu_models", "cordoned_nodes")
    DATACENTER_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    LARGEST_NODE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_TASKS_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_TASKS_FIELD_NUMBER: _ClassVar[int]
    CPU_UTILISATION_FIELD_NUMBER: _ClassVar[int]
    MEMORY_UTILISATION_FIELD_NUMBER: _ClassVar[int]
    GPU_CORE_UTILISATION_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_UTILISATION_FIELD_NUMBER: _ClassVar[int]
    PUE_FIELD_NUMBER: _ClassVar[int]
    MAX_INLET_C_FIELD_NUMBER: _ClassVar[int]
    LEDGER_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    GPU_MODELS_FIELD_NUMBER: _ClassVar[int]
    CORDONED_NODES_FIELD_NUMBER: _ClassVar[int]
    datacenter: str
    nodes: int
    capacity: Resources
    free: Resources
    largest_node: Resources
    running_tasks: int
    deferred_tasks: int
    cpu_utilisation: float
    memory_utilisation: float
    gpu_core_utilisation: float
    gpu_memory_utilisation: float
    pue: float
    max_inlet_c: float
    ledger_id: str
    fencing_token: int
    unix_ms: int
    gpu_models: _containers.RepeatedScalarFieldContainer[str]
    cordoned_nodes: int
    def __init__(self, datacenter: _Optional[str] = ..., nodes: _Optional[int] = ..., capacity: _Optional[_Union[Resources, _Mapping]] = ..., free: _Optional[_Union[Resources, _Mapping]] = ..., largest_node: _Optional[_Union[Resources, _Mapping]] = ..., running_tasks: _Optional[int] = ..., deferred_tasks: _Optional[int] = ..., cpu_utilisation: _Optional[float] = ..., memory_utilisation: _Optional[float] = ..., gpu_core_utilisation: _Optional[float] = ..., gpu_memory_utilisation: _Optional[float] = ..., pue: _Optional[float] = ..., max_inlet_c: _Optional[float] = ..., ledger_id: _Optional[str] = ..., fencing_token: _Optional[int] = ..., unix_ms: _Optional[int] = ..., gpu_models: _Optional[_Iterable[str]] = ..., cordoned_nodes: _Optional[int] = ...) -> None: ...
