"""Parallel Workloads Archive logs in the Standard Workload Format (data/pwa_swf/*.swf.gz).

An SWF record has 18 whitespace-separated fields; -1 means unknown. Times are seconds (submit time relative to
the header's `UnixStartTime`), memory is KB per processor. Header lines start with `;`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hsched.domain.errors import ValidationError
from hsched.domain.limits import INT64_MAX
from hsched.domain.resources import MILLI, Resources
from hsched.domain.task import MAX_RUNTIME_S, TaskSpec
from hsched.traces._io import TraceFileError, text_lines

# Thunder and KTH record no memory at all, so a task gets this much RAM per CPU core unless its job states
# a memory request. 1 GiB/core is a deliberately modest HPC figure: it keeps CPU the binding resource, as
# in the logs, while giving every task a realistic, non-zero memory footprint.
DEFAULT_MEMORY_MIB_PER_CORE = 1024
MIN_RUNTIME_S = 1.0  # SWF has 0 s runtimes; a TaskSpec needs runtime_s > 0

_HEADER_RE = re.compile(r"^;\s*([A-Za-z][A-Za-z0-9_]*):\s*(.*?)\s*$")
FIELDS = ("job number", "submit time", "wait time", "run time", "allocated processors", "average CPU time",
          "used memory", "requested processors", "requested time", "requested memory", "status", "user id",
          "group id", "executable number", "queue number", "partition number", "preceding job", "think time")


@dataclass(frozen=True, slots=True)
class SwfJob:
    """One SWF job record; unknown values (-1 in SWF) are None."""

    job_id: int
    submit_s: float  # seconds after the log's UnixStartTime
    wait_s: float | None
    runtime_s: float
    procs: int  # requested processors, falling back to allocated ones
    requested_time_s: float | None  # the user's runtime estimate
    status: int | None  # 1 completed, 0 failed, 5 cancelled
    user_id: int | None
    partition: int | None
    memory_mib_per_proc: int | None = None  # requested (else used) memory, KB → MiB rounded up


def _known(value: float) -> float | None:
    return None if value < 0 else value


def _known_int(value: float) -> int | None:
    return None if value < 0 else int(value)


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def _parse(fields: list[str]) -> SwfJob | None:
    """Convert one record; None for placeholder rows (submit < 0, runtime < 0 or no processor count). ValidationError
    naming the field for a record that is not 18 numbers."""
    if len(fields) < len(FIELDS):
        raise ValidationError("", f"has {len(fields)} fields, an SWF record {len(FIELDS)}", " ".join(fields))
    try:
        f = [float(x) for x in fields[:len(FIELDS)]]
    except ValueError:
        f = [math.nan]
    if not all(map(math.isfinite, f)):
        i = next(i for i, x in enumerate(fields) if not math.isfinite(_number(x)))
        raise ValidationError(f"field {i + 1} ({FIELDS[i]})", "must be a number (-1 = unknown)", fields[i])
    if not (f[0].is_integer() and 0 <= f[0] <= INT64_MAX):  # it names the job's task: swf-<job number>
        raise ValidationError(f"field 1 ({FIELDS[0]})", f"must be a whole number in 0..{INT64_MAX}", fields[0])
    procs = int(f[7]) if f[7] > 0 else int(f[4])
    if f[1] < 0 or f[3] < 0 or procs <= 0:
        return None
    mem_kb = f[9] if f[9] > 0 else f[6]
    return SwfJob(
        job_id=int(f[0]), submit_s=f[1], wait_s=_known(f[2]), runtime_s=f[3], procs=procs,
        requested_time_s=_known(f[8]), status=_known_int(f[10]), user_id=_known_int(f[11]),
        partition=_known_int(f[15]),
        memory_mib_per_proc=math.ceil(mem_kb / 1024) if mem_kb > 0 else None,
    )


def load_swf(path: str | Path, limit: int | None = None, skip: int = 0) -> Iterator[SwfJob]:
    """Stream the jobs of a `.swf` or `.swf.gz` log in file order.

    Placeholder rows are dropped (submit < 0, runtime < 0, or neither a requested nor an allocated processor
    count): in LLNL-Thunder these are 1190 all-`-1` rows such as job 299, plus 1058 jobs that never ran
    (runtime 0, no processor count). `skip` kept jobs are skipped, then at most `limit` are yielded. TraceFileError
    naming the file, the line and the field for a file that cannot be read, a record that is not 18 numbers, or a
    file without jobs.
    """
    kept = 0
    for line, text in enumerate(text_lines(path), 1):
        fields = text.split()
        if not fields or fields[0].startswith(";"):
            continue
        try:
            job = _parse(fields)
        except ValidationError as exc:
            raise TraceFileError(path, exc.rule, line, exc.field, exc.value) from None
        if job is None:
            continue
        kept += 1
        if kept <= skip:
            continue
        if limit is not None and kept - skip > limit:
            return
        yield job
    if not kept:
        raise TraceFileError(path, "holds no jobs: an SWF log needs a record with a submit time, a runtime and a "
                                   "processor count")


def swf_header(path: str | Path) -> dict[str, int | str | list[int | str]]:
    """The `; Key: value` header of an SWF log, e.g. MaxProcs, MaxNodes, UnixStartTime (ints when integral).

    Keys that repeat (Partition, Queue, Note) map to the list of their values in file order.
    """
    header: dict[str, int | str | list[int | str]] = {}
    for line in text_lines(path):
        if not line.startswith(";"):
            if line.strip():
                break
            continue
        m = _HEADER_RE.match(line)
        if not m:
            continue  # continuation lines of a multi-line note
        key, raw = m.groups()
        value: int | str = int(raw) if re.fullmatch(r"-?\d+", raw) else raw
        if key not in header:
            header[key] = value
        elif isinstance(prev := header[key], list):
            prev.append(value)
        else:
            header[key] = [prev, value]
    return header


def swf_job_to_task(job: SwfJob, cores_per_proc: int = 1, tenant: str = "swf",
                    memory_mib_per_core: int = DEFAULT_MEMORY_MIB_PER_CORE) -> TaskSpec:
    """A single-replica CPU task for an SWF job.

    cpu_milli = procs × cores_per_proc × 1000. memory_mib = procs × the job's memory per processor when the log
    has it, else cores × `memory_mib_per_core` (default 1024 MiB/core, see DEFAULT_MEMORY_MIB_PER_CORE).
    runtime_s = the job's runtime clamped to [1 s, one year]. Disk, bandwidth and GPU are 0.
    """
    cores = job.procs * cores_per_proc
    memory = job.procs * job.memory_mib_per_proc if job.memory_mib_per_proc else cores * memory_mib_per_core
    return TaskSpec(
        resources=Resources(cpu_milli=cores * MILLI, memory_mib=memory),
        runtime_s=min(max(job.runtime_s, MIN_RUNTIME_S), float(MAX_RUNTIME_S)),
        tenant=tenant,
        name=f"swf-{job.job_id}",
    )
