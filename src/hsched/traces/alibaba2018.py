"""Alibaba cluster-trace-v2018 batch DAG jobs (data/alibaba_v2018_dags/batch_task_6600_jobs.csv.gz).

The trace of paper 001 (JobFusion): a production cluster where online services and batch jobs share
machines. One row is one *task* of a batch job (a DAG vertex, a "stage"): `instance_num` parallel
instances, each asking `plan_cpu` (1/100 core) and `plan_mem` (percent of one machine's memory,
normalised to 100), running `duration` seconds.

Dependencies are encoded in the task name (the trace's own convention): a letter, the task's id, then
`_<id>` for every task it waits for — `J3_1_2` is task 3, runnable once tasks 1 and 2 have finished.
Reading rules (documented in the data README):

- a `_Stg<n>` group (e.g. `M1_Stg8`) is a stage label, not a dependency, and is ignored;
- a trailing empty group (`J30_4_5_…_25_`, a name truncated by the trace's field width) ends the list: the
  dependencies that were cut off are unknown and therefore absent;
- a name that does not start with letters + digits (`task_…`, `MergeTask`) is a task without an id: it
  depends on nothing and nothing can depend on it.

Units are converted once, in `parse_row`: cpu → cores (÷ 100); memory stays in the trace's normalised
unit, percent of a v2018 machine (`MACHINE_CPU_CORES` = 96 cores, `MACHINE_MEMORY` = 100).
Every malformed value raises `AlibabaTraceError` naming the file line, the field and the rule.
"""

from __future__ import annotations

import csv
import math
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from hsched.domain import dag
from hsched.traces import data_dir
from hsched.traces._io import open_text

DEFAULT_FILE = Path("alibaba_v2018_dags") / "batch_task_6600_jobs.csv.gz"  # under data_dir()
COLUMNS = ("task_name", "job_name", "instance_num", "status", "start_time", "end_time", "duration",
           "plan_cpu", "plan_mem")
STATUSES = ("Terminated", "Running", "Failed", "Waiting")
MACHINE_CPU_CORES = 96.0   # v2018 machine_meta.csv: every machine has 96 cores
MACHINE_MEMORY = 100.0     # ... and memory normalised to 100
CPU_UNITS_PER_CORE = 100.0  # plan_cpu is in 1/100 core

_NAME = re.compile(r"^[A-Za-z]+(\d+)((?:_[^_]*)*)$")
_STAGE_LABEL = re.compile(r"^Stg\d+$")


class AlibabaTraceError(ValueError):
    """A row or job of the trace breaks a rule; the message names the line/job, the field and the rule."""


@dataclass(frozen=True, slots=True)
class AlibabaTask:
    """One task (DAG vertex) of a batch job: `instances` parallel copies of cpu_cores × memory each."""

    name: str                      # the raw task_name, e.g. "J3_1_2"
    task_id: int | None            # 3 for "J3_1_2"; None for a name without an id
    depends_on: tuple[int, ...]    # task ids it waits for, ascending (1, 2 for "J3_1_2")
    instances: int                 # instance_num ≥ 1
    status: str
    start_time_s: int
    end_time_s: int
    duration_s: float              # seconds one instance runs (> 0)
    cpu_cores: float               # per instance, cores (plan_cpu / 100)
    memory: float                  # per instance, percent of a machine's memory (plan_mem)


@dataclass(frozen=True, slots=True)
class AlibabaJob:
    """A batch job: tasks ordered by id (id-less tasks last, by name) and (parent, child) index edges."""

    name: str                                # "j_<id>"
    tasks: tuple[AlibabaTask, ...]
    edges: tuple[tuple[int, int], ...]       # indices into `tasks`, parent first, sorted

    @property
    def arrival_s(self) -> int:
        """Submission proxy: the earliest task start in the trace."""
        return min(t.start_time_s for t in self.tasks)

    @property
    def num_instances(self) -> int:
        return sum(t.instances for t in self.tasks)

    def parents(self, index: int) -> tuple[int, ...]:
        return tuple(p for p, c in self.edges if c == index)


def parse_task_name(name: str) -> tuple[int | None, tuple[int, ...]]:
    """(task id, dependency ids) of a trace task name; see the module docstring for the rules."""
    m = _NAME.match(name)
    if not m:
        return None, ()
    deps: list[int] = []
    for group in m.group(2).split("_")[1:]:
        if group.isdigit():
            deps.append(int(group))
        elif group == "":  # truncated name: what followed is lost
            break
        elif not _STAGE_LABEL.match(group):
            raise AlibabaTraceError(f"task_name {name!r}: dependency group {group!r} is neither an id nor Stg<n>")
    return int(m.group(1)), tuple(sorted(set(deps)))


def _number(row: dict[str, str], field: str, where: str, *, positive: bool = False,
            nonnegative: bool = False, integer: bool = False) -> float:
    raw = (row.get(field) or "").strip()
    try:
        value = float(raw)
    except ValueError:
        raise AlibabaTraceError(f"{where}: field {field!r} must be a number, got {raw!r}") from None
    if not math.isfinite(value):
        raise AlibabaTraceError(f"{where}: field {field!r} must be finite, got {raw!r}")
    if integer and value != int(value):
        raise AlibabaTraceError(f"{where}: field {field!r} must be a whole number, got {raw!r}")
    if positive and value <= 0:
        raise AlibabaTraceError(f"{where}: field {field!r} must be > 0, got {raw!r}")
    if nonnegative and value < 0:
        raise AlibabaTraceError(f"{where}: field {field!r} must be ≥ 0, got {raw!r}")
    return value


def parse_row(row: dict[str, str], where: str = "row") -> AlibabaTask:
    """One CSV row (column → text) → AlibabaTask, converting units once. Raises AlibabaTraceError."""
    name = (row.get("task_name") or "").strip()
    if not name:
        raise AlibabaTraceError(f"{where}: field 'task_name' must not be empty")
    status = (row.get("status") or "").strip()
    if status not in STATUSES:
        raise AlibabaTraceError(f"{where}: field 'status' must be one of {', '.join(STATUSES)}, got {status!r}")
    task_id, deps = parse_task_name(name)
    if task_id is not None and task_id in deps:
        raise AlibabaTraceError(f"{where}: field 'task_name' {name!r} makes task {task_id} depend on itself")
    start = _number(row, "start_time", where, nonnegative=True, integer=True)
    end = _number(row, "end_time", where, nonnegative=True, integer=True)
    if end < start:
        raise AlibabaTraceError(f"{where}: field 'end_time' ({end:g}) must be ≥ start_time ({start:g})")
    cpu = _number(row, "plan_cpu", where, positive=True)
    mem = _number(row, "plan_mem", where, positive=True)
    if cpu > MACHINE_CPU_CORES * CPU_UNITS_PER_CORE:
        raise AlibabaTraceError(f"{where}: field 'plan_cpu' ({cpu:g}) exceeds one machine "
                                f"({MACHINE_CPU_CORES * CPU_UNITS_PER_CORE:g})")
    if mem > MACHINE_MEMORY:
        raise AlibabaTraceError(f"{where}: field 'plan_mem' ({mem:g}) exceeds one machine ({MACHINE_MEMORY:g})")
    return AlibabaTask(
        name=name, task_id=task_id, depends_on=deps,
        instances=int(_number(row, "instance_num", where, positive=True, integer=True)),
        status=status, start_time_s=int(start), end_time_s=int(end),
        duration_s=_number(row, "duration", where, positive=True),
        cpu_cores=cpu / CPU_UNITS_PER_CORE, memory=mem)


def build_job(name: str, tasks: Sequence[AlibabaTask]) -> AlibabaJob:
    """Order the tasks, resolve dependencies to index edges; reject duplicate ids, unknown parents, cycles."""
    ordered = sorted(tasks, key=lambda t: (t.task_id is None, t.task_id or 0, t.name))
    index: dict[int, int] = {}
    for i, t in enumerate(ordered):
        if t.task_id is not None:
            if t.task_id in index:
                raise AlibabaTraceError(f"job {name}: field 'task_name': task id {t.task_id} appears twice "
                                        f"({ordered[index[t.task_id]].name!r}, {t.name!r})")
            index[t.task_id] = i
    edges = set()
    for i, t in enumerate(ordered):
        for dep in t.depends_on:
            if dep not in index:
                raise AlibabaTraceError(f"job {name}: field 'task_name' {t.name!r} depends on task {dep}, "
                                        f"which the job does not have")
            edges.add((index[dep], i))
    job = AlibabaJob(name=name, tasks=tuple(ordered), edges=tuple(sorted(edges)))
    topological_order(job)
    return job


def _parent_lists(job: AlibabaJob) -> list[list[int]]:
    parents: list[list[int]] = [[] for _ in job.tasks]
    for p, c in job.edges:
        parents[c].append(p)
    return parents


def _cycle(job: AlibabaJob, exc: dag.DagCycleError) -> AlibabaTraceError:
    stuck = [job.tasks[i].name for i in exc.stuck]
    return AlibabaTraceError(f"job {job.name}: field 'task_name': dependency cycle among {stuck}")


def topological_order(job: AlibabaJob) -> tuple[int, ...]:
    """Task indices, parents first (lowest ready index first); AlibabaTraceError on a cycle."""
    try:
        return dag.topological_order(_parent_lists(job))
    except dag.DagCycleError as exc:
        raise _cycle(job, exc) from None


def critical_path_s(job: AlibabaJob) -> float:
    """Longest dependency chain weighted by one instance's duration: the JCT with unlimited machines and no
    overheads, a lower bound on the job's completion time."""
    try:
        return dag.critical_path([t.duration_s for t in job.tasks], _parent_lists(job))
    except dag.DagCycleError as exc:
        raise _cycle(job, exc) from None


def read_jobs(lines: Iterable[str], source: str = "<rows>",
              statuses: Iterable[str] = ("Terminated",)) -> list[AlibabaJob]:
    """Parse CSV text (header row first) into jobs, in order of first appearance.

    A job is kept only when every one of its tasks has a status in `statuses` (default: only complete,
    Terminated jobs — the trace leaves resource cells empty on some Running/Waiting tasks). Rows of kept
    jobs are fully validated; rows of dropped jobs only need a job_name and a valid status.
    """
    keep = set(statuses)
    for s in keep:
        if s not in STATUSES:
            raise AlibabaTraceError(f"statuses: {s!r} is not one of {', '.join(STATUSES)}")
    reader = csv.DictReader(lines)
    missing = [c for c in COLUMNS if c not in (reader.fieldnames or ())]
    if missing:
        raise AlibabaTraceError(f"{source}: header lacks column(s) {', '.join(missing)}; expected {', '.join(COLUMNS)}")
    rows: dict[str, list[tuple[str, dict[str, str]]]] = {}
    dropped: set[str] = set()
    for line_no, row in enumerate(reader, start=2):
        where = f"{source}:{line_no}"
        job = (row.get("job_name") or "").strip()
        if not job:
            raise AlibabaTraceError(f"{where}: field 'job_name' must not be empty")
        status = (row.get("status") or "").strip()
        if status not in STATUSES:
            raise AlibabaTraceError(f"{where}: field 'status' must be one of {', '.join(STATUSES)}, got {status!r}")
        if status not in keep:
            dropped.add(job)
        rows.setdefault(job, []).append((where, row))
    return [build_job(job, [parse_row(row, where) for where, row in job_rows])
            for job, job_rows in rows.items() if job not in dropped]


@lru_cache(maxsize=2)
def _load(path: str, _mtime_ns: int) -> tuple[AlibabaJob, ...]:
    with open_text(path) as fh:
        return tuple(read_jobs(fh, source=Path(path).name))


def load_alibaba_jobs(path: str | Path | None = None, *, max_instances: int | None = None,
                      min_tasks: int = 1) -> list[AlibabaJob]:
    """The shipped slice's complete (all-Terminated) jobs, optionally only those with at most
    `max_instances` instances in all and at least `min_tasks` tasks. Parsed once per file (cached)."""
    file = Path(path) if path is not None else data_dir() / DEFAULT_FILE
    jobs = _load(str(file.resolve()), os.stat(file).st_mtime_ns)
    return [j for j in jobs if (max_instances is None or j.num_instances <= max_instances)
            and len(j.tasks) >= min_tasks]
