"""What a job submitter asks for: a task spec (per-replica resources, runtime, data, network needs)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from hsched.domain.errors import ValidationError
from hsched.domain.limits import check_count, check_string
from hsched.domain.resources import Resources

MAX_REPLICAS = 256
MAX_RUNTIME_S = 366 * 24 * 3600
ONLINE, OFFLINE = "online", "offline"  # online (latency-critical) tasks may preempt offline ones
PRIORITY_CLASSES = ("", ONLINE, OFFLINE)
PRIORITY_MIN, PRIORITY_MAX = -1000, 1000  # order within a priority class, higher first
NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?\Z")  # a tenant, name, ... (DNS-1123)
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}\Z")


@dataclass(frozen=True, slots=True)
class NetworkRequirements:
    """Upper bounds on the path from the entry vertex to the DC (paper 002 eq.1-3); 0 = no bound."""

    max_latency_ms: float = 0.0
    max_jitter_ms: float = 0.0
    max_loss_percent: float = 0.0

    def validate(self, prefix: str = "network") -> None:
        for name in ("max_latency_ms", "max_jitter_ms", "max_loss_percent"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValidationError(f"{prefix}.{name}", "must be a finite number >= 0 (0 = no bound)", value)
        if self.max_loss_percent > 100:
            raise ValidationError(f"{prefix}.max_loss_percent", "must be <= 100", self.max_loss_percent)


# The fields of a DAG job's task that only the gateway sets (SubmitJob); a Submit or a task file may not
JOB_TASK_FIELDS = ("job_id", "stage", "stage_path_s", "job_work_s")


@dataclass(frozen=True, slots=True)
class TaskSpec:
    resources: Resources  # per replica
    runtime_s: float  # task seconds; 0 = runs until released (RUNNING until its client's Release)
    tenant: str = "default"
    name: str = ""
    request_id: str = ""  # client-chosen idempotency key; a retry with the same id gets the first answer
    priority: int = 0
    replicas: int = 1
    data_size_mb: float = 0.0
    entry_vertex: str = ""  # "" = the fleet's scheduler vertex
    network: NetworkRequirements = field(default_factory=NetworkRequirements)
    gpu_models: tuple[str, ...] = ()  # allowed GPU models (openb gpu_spec); empty = any
    priority_class: str = ""  # "online" | "offline"; "" = offline (as on the wire)
    queue_timeout_s: float = 0.0  # a task still deferred after this long (task time) expires; 0 = never
    # A DAG job's task (set by the gateway): its job, stage, the stage's critical path to the job's end and the
    # job's work left (task seconds); the placer's --dag-policy orders queued DAG tasks by them.
    job_id: str = ""
    stage: str = ""
    stage_path_s: float = 0.0
    job_work_s: float = 0.0

    @property
    def effective_class(self) -> str:
        """The priority class with the wire default applied ("" = offline)."""
        return self.priority_class or "offline"

    @property
    def total(self) -> Resources:
        return self.resources.scaled(self.replicas)

    def validate(self) -> None:
        """Raise ValidationError naming the first field that breaks a rule (sizes first, then in wire order)."""
        for name in ("request_id", "tenant", "name", "entry_vertex", "priority_class", "job_id", "stage"):
            check_string(name, getattr(self, name))
        check_count("gpu_models", len(self.gpu_models))
        for i, model in enumerate(self.gpu_models):
            check_string(f"gpu_models[{i}]", model, "gpu_models")
        if self.request_id and not _REQUEST_ID_RE.match(self.request_id):
            raise ValidationError("request_id", "must be 1-128 characters of [A-Za-z0-9._:-]", self.request_id)
        if not NAME_RE.match(self.tenant):
            raise ValidationError("tenant", "must be a DNS-1123 label: lowercase alphanumerics, '-', '.', '_', "
                                  "1-63 characters, starting and ending alphanumeric", self.tenant)
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise ValidationError("priority", "must be an integer", self.priority)
        if not PRIORITY_MIN <= self.priority <= PRIORITY_MAX:
            raise ValidationError("priority", f"must be in {PRIORITY_MIN}..{PRIORITY_MAX}", self.priority)
        self.resources.validate("resources")
        if not isinstance(self.replicas, int) or isinstance(self.replicas, bool):
            raise ValidationError("replicas", "must be an integer", self.replicas)
        if not 1 <= self.replicas <= MAX_REPLICAS:
            raise ValidationError("replicas", f"must be in 1..{MAX_REPLICAS}", self.replicas)
        if not math.isfinite(self.runtime_s) or not 0 <= self.runtime_s <= MAX_RUNTIME_S:
            raise ValidationError("runtime_s", f"must be a finite number >= 0 and <= {MAX_RUNTIME_S} (one year; "
                                  "0 = runs until released)", self.runtime_s)
        if self.priority_class not in PRIORITY_CLASSES:
            raise ValidationError("priority_class", "must be \"online\", \"offline\" or \"\" (= offline)",
                                  self.priority_class)
        if not math.isfinite(self.queue_timeout_s) or not 0 <= self.queue_timeout_s <= MAX_RUNTIME_S:
            raise ValidationError("queue_timeout_s", f"must be >= 0 and <= {MAX_RUNTIME_S} (0 = never)",
                                  self.queue_timeout_s)
        if not math.isfinite(self.data_size_mb) or self.data_size_mb < 0:
            raise ValidationError("data_size_mb", "must be a finite number >= 0", self.data_size_mb)
        for name in ("stage_path_s", "job_work_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValidationError(name, "must be a finite number >= 0", value)
        self.network.validate("network")
        for i, model in enumerate(self.gpu_models):
            if not model:
                raise ValidationError(f"gpu_models[{i}]", "must be a non-empty model name", model)
        if self.gpu_models and self.resources.gpu_count == 0:
            raise ValidationError("gpu_models", "only allowed when resources.gpu_count > 0", list(self.gpu_models))


def task_to_dict(task: TaskSpec) -> dict:
    """A JSON-ready dict (the ledger stores deferred tasks this way)."""
    r, n = task.resources, task.network
    return {"resources": [r.cpu_milli, r.memory_mib, r.disk_mib, r.bandwidth_mbps, r.gpu_count, r.gpu_core_percent,
                          r.gpu_memory_mib],
            "runtime_s": task.runtime_s, "tenant": task.tenant, "name": task.name, "request_id": task.request_id,
            "priority": task.priority, "replicas": task.replicas, "data_size_mb": task.data_size_mb,
            "entry_vertex": task.entry_vertex,
            "network": [n.max_latency_ms, n.max_jitter_ms, n.max_loss_percent], "gpu_models": list(task.gpu_models),
            "priority_class": task.priority_class, "queue_timeout_s": task.queue_timeout_s,
            **({"job": [task.job_id, task.stage, task.stage_path_s, task.job_work_s]} if task.job_id else {})}


def task_from_dict(d: dict) -> TaskSpec:
    return TaskSpec(resources=Resources(*d["resources"]), runtime_s=d["runtime_s"], tenant=d["tenant"],
                    name=d["name"], request_id=d["request_id"], priority=d["priority"], replicas=d["replicas"],
                    data_size_mb=d["data_size_mb"], entry_vertex=d["entry_vertex"],
                    network=NetworkRequirements(*d["network"]), gpu_models=tuple(d["gpu_models"]),
                    # absent in ledgers written before issue 15
                    priority_class=d.get("priority_class", ""), queue_timeout_s=d.get("queue_timeout_s", 0.0),
                    **_job_fields(d.get("job")))


def _job_fields(job: list | None) -> dict:
    if not job:  # a standalone task, or a ledger written before the placer's --dag-policy
        return {}
    job_id, stage, path, work = job
    return {"job_id": job_id, "stage": stage, "stage_path_s": float(path), "job_work_s": float(work)}
