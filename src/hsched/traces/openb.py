"""Alibaba GPU-sharing cluster trace "openb" (ATC'23 FGD paper; data/alibaba_openb_gpu_2023/).

openb already uses hsched's CPU and memory units (milli-cores, MiB). GPUs are in milli-GPU per card
(1000 = one whole card) and times are integer seconds after the trace start.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from hsched.domain.errors import ValidationError
from hsched.domain.limits import INT32_MAX, INT64_MAX  # a task's amounts are int64, its gpu_count int32
from hsched.domain.resources import MIB_PER_GIB, Resources
from hsched.domain.task import TaskSpec
from hsched.traces._io import TraceFileError, open_text, text_lines

# openb has no GPU-memory column. A pod is assumed to use GPU memory in proportion to its core share of a card
# of this size (16 GiB: the V100M16/P100-class cards that dominate the cluster's older models).
DEFAULT_GPU_MEMORY_GIB_PER_FULL_GPU = 16.0
# Runtime for a pod whose end is unknown (no deletion_time, e.g. the 5-column multigpu variants):
# one hour, a round figure above the default trace's median runtime (540 s).
DEFAULT_RUNTIME_S = 3600.0
MIN_RUNTIME_S = 1.0  # deletion == scheduled happens; a TaskSpec needs runtime_s > 0
# QoS → TaskSpec.priority: latency-sensitive (LS) and Kubernetes Guaranteed pods first, then Burstable,
# then best-effort (BE). Unknown/missing QoS counts as best-effort.
QOS_PRIORITY: dict[str, int] = {"LS": 100, "Guaranteed": 100, "Burstable": 50, "BE": 0}
TENANT = "openb"
POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")  # the columns every pod list has


@dataclass(frozen=True, slots=True)
class OpenbNode:
    sn: str
    cpu_milli: int
    memory_mib: int
    gpu: int  # physical GPUs
    model: str  # GPU model ("" for CPU-only nodes)


@dataclass(frozen=True, slots=True)
class OpenbPod:
    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int  # per GPU, 1000 = a whole card; < 1000 only for GPU-sharing pods (num_gpu == 1)
    gpu_spec: tuple[str, ...] = ()  # allowed GPU models, deduplicated, in file order; () = any
    qos: str = ""  # LS, BE, Burstable, Guaranteed; "" when the file has no qos column
    phase: str = ""  # Running, Failed, Pending, Succeeded
    creation_s: int = 0  # seconds after trace start
    deletion_s: int | None = None
    scheduled_s: int | None = None  # None for Pending pods


def _int(text: str | None, column: str, most: int = INT64_MAX) -> int:
    """A count or amount of a pod list: a whole number in 0..`most` (ValidationError naming `column`)."""
    if not (text and text.isascii() and text.isdigit() and len(text) <= 19 and int(text) <= most):
        raise ValidationError(column, f"must be a whole number in 0..{most}", text)
    return int(text)


def _optional_int(text: str | None, column: str) -> int | None:
    return None if text in (None, "") else _int(text, column)


def load_openb_nodes(path: str | Path) -> list[OpenbNode]:
    """Read an openb node list (`sn,cpu_milli,memory_mib,gpu,model`)."""
    with open_text(path) as fh:
        return [OpenbNode(r["sn"], int(r["cpu_milli"]), int(r["memory_mib"]), int(r["gpu"]), r["model"] or "")
                for r in csv.DictReader(fh)]


def load_openb_pods(path: str | Path, limit: int | None = None) -> list[OpenbPod]:
    """Read an openb pod list (`.csv` or `.csv.gz`), at most `limit` pods.

    Handles the 11-column files and the 5-column multigpu variants (`name,cpu_milli,memory_mib,num_gpu,
    gpu_milli`), whose missing columns take the `OpenbPod` defaults. TraceFileError naming the file, the line and the
    column for a file that cannot be read, a count that is not a whole number in range, a pod that is not a valid
    task (`TaskSpec.validate`), or a file without pods.
    """
    pods: list[OpenbPod] = []
    rows = csv.DictReader(text_lines(path))
    try:
        if missing := [c for c in POD_COLUMNS if c not in (rows.fieldnames or ())]:
            raise ValidationError("header", f"must name the columns {','.join(POD_COLUMNS)} (missing "
                                            f"{','.join(missing)})")
        for r in rows:
            if limit is not None and len(pods) >= limit:
                break
            pod = OpenbPod(
                name=r["name"] or "",
                cpu_milli=_int(r["cpu_milli"], "cpu_milli"),
                memory_mib=_int(r["memory_mib"], "memory_mib"),
                num_gpu=_int(r["num_gpu"], "num_gpu", INT32_MAX),
                gpu_milli=_int(r["gpu_milli"], "gpu_milli", 1000),  # per card
                gpu_spec=tuple(dict.fromkeys(m for m in (r.get("gpu_spec") or "").split("|") if m)),
                qos=r.get("qos") or "",
                phase=r.get("pod_phase") or "",
                creation_s=_optional_int(r.get("creation_time"), "creation_time") or 0,
                deletion_s=_optional_int(r.get("deletion_time"), "deletion_time"),
                scheduled_s=_optional_int(r.get("scheduled_time"), "scheduled_time"),
            )
            openb_pod_to_task(pod).validate()  # the task rules every pod must meet (hsched.domain.task)
            pods.append(pod)
        else:
            if not pods:
                raise TraceFileError(path, "holds no pods (a header line only)")
    except TraceFileError:
        raise  # the file cannot be read (text_lines)
    except ValidationError as exc:
        raise TraceFileError(path, exc.rule, rows.reader.line_num or None, exc.field, exc.value) from None
    except csv.Error as exc:
        raise TraceFileError(path, f"must be CSV ({exc})", rows.reader.line_num or None) from None
    return pods


def pod_runtime_s(pod: OpenbPod) -> float:
    """deletion − scheduled (− creation for never-scheduled pods), >= 1 s; DEFAULT_RUNTIME_S if no deletion."""
    if pod.deletion_s is None:
        return DEFAULT_RUNTIME_S
    start = pod.scheduled_s if pod.scheduled_s is not None else pod.creation_s
    return max(float(pod.deletion_s - start), MIN_RUNTIME_S)


def openb_pod_to_task(pod: OpenbPod,
                      gpu_memory_gib_per_full_gpu: float = DEFAULT_GPU_MEMORY_GIB_PER_FULL_GPU) -> TaskSpec:
    """A single-replica TaskSpec for an openb pod.

    gpu_count = num_gpu; gpu_core_percent = gpu_milli / 10 rounded up, in 1..100 (per card);
    gpu_memory_mib = round(gpu_milli / 1000 × gpu_memory_gib_per_full_gpu × 1024) per card (an assumption:
    openb records no GPU memory); runtime_s from `pod_runtime_s`; priority from `QOS_PRIORITY`;
    gpu_models = gpu_spec (GPU pods only). CPU and memory are copied (0 MiB memory is valid).
    """
    gpu_count = pod.num_gpu
    core_percent = min(100, max(1, -(-pod.gpu_milli // 10))) if gpu_count else 0
    gpu_memory = round(pod.gpu_milli / 1000 * gpu_memory_gib_per_full_gpu * MIB_PER_GIB) if gpu_count else 0
    return TaskSpec(
        resources=Resources(cpu_milli=pod.cpu_milli, memory_mib=pod.memory_mib, gpu_count=gpu_count,
                            gpu_core_percent=core_percent, gpu_memory_mib=gpu_memory),
        runtime_s=pod_runtime_s(pod),
        tenant=TENANT,
        name=pod.name,
        priority=QOS_PRIORITY.get(pod.qos, 0),
        gpu_models=pod.gpu_spec if gpu_count else (),
    )
