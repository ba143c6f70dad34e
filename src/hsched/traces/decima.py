"""Decima's TPC-H Spark job DAGs (Mao et al., SIGCOMM'19; data/decima_tpch/tpch_dags.json.gz).

22 TPC-H queries × 7 input sizes (2g … 100g) = 154 DAGs. A node of a DAG is a Spark *stage*: `num_tasks`
identical, parallel tasks that may start only when every parent stage has finished. This is the DAG job of
JobFusion (seed 001) and of the action-branching A3C paper (seed 004), which samples these very DAGs.

The file keeps the source's measurements in **milliseconds**: per stage and per measured executor count, the
task durations of the first wave, the later waves and the "fresh" (just-moved executor) first-wave tasks.
`load_tpch_dags` reduces them exactly as decima-sim's `spark_env/job_generator.py::load_job` does and converts
ms → s once, in `_stage`:

- `num_tasks` = len(first_wave[e]) + len(rest_wave[e]) for e = the *first* executor key in the file's order
  (the counts differ between executor keys on 7 stages, all stage 6 of q15, so the key order matters);
- `task_duration_s` = Decima's `rough_duration`: the mean of the first-wave durations with the fresh ones
  removed (a first wave left empty takes the list of the next lower executor count), the later-wave durations
  and the fresh durations, pooled over all executor counts.

`DagStage.waves` keeps the raw lists (`WaveDurations`, in seconds) so a simulator can draw each task's
duration as decima-sim's `spark_env/node.py::Node.schedule` does (`WaveDurations.sample`): the executor count
the job holds picks a measured executor key (`executor_key`, decima-sim's `sample_executor_key` over
`executor_interval_map` of `args.executor_data_point` = 5, 10, 20, 40, 50, 60, 80, 100), and the task's
kind picks the list (fresh executor → fresh durations, else first wave + the 1 s `warmup_delay`; the same
executor's next task of the same stage → rest wave, else first wave; a different stage of the same job →
first wave, else fresh durations); a uniform draw from that list is the duration.
"""

from __future__ import annotations

import bisect
import json
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

import numpy as np

from hsched.domain import dag
from hsched.domain.resources import Resources
from hsched.domain.task import MAX_REPLICAS, TaskSpec
from hsched.traces import data_dir
from hsched.traces._io import open_text

TPCH_SIZES: tuple[str, ...] = ("2g", "5g", "10g", "20g", "50g", "80g", "100g")
TPCH_QUERIES: tuple[int, ...] = tuple(range(1, 23))
DEFAULT_FILE = Path("decima_tpch") / "tpch_dags.json.gz"  # under data_dir()
MS_PER_S = 1000.0
TENANT = "tpch"
# One task occupies one executor slot: Decima runs one task per executor at a time (Spark's default
# spark.task.cpus = 1, i.e. one core), and Spark's default executor heap is spark.executor.memory = 1g.
DEFAULT_CPU_PER_TASK_MILLI = 1000
DEFAULT_MEMORY_MIB_PER_TASK = 1024
_WAVES = ("first_wave", "rest_wave", "fresh_durations")
# decima-sim param.py: the executor counts its measured keys are mapped from, and the warm-up a fresh executor
# pays when a stage has no fresh-duration record (--executor_data_point, --warmup_delay 1000 ms)
EXECUTOR_DATA_POINTS: tuple[int, ...] = (5, 10, 20, 40, 50, 60, 80, 100)
WARMUP_DELAY_S = 1.0
# the kinds of task start decima-sim's Node.schedule tells apart
FRESH, FIRST_WAVE, REST_WAVE = "fresh", "first", "rest"


def executor_key(num_executors: int, rng: np.random.Generator) -> int:
    """decima-sim's `sample_executor_key` before its fallback: the job's executor count n → a measured key.

    n at or below the first data point (5) → 5; above the last (100) → 100; equal to a point → that point;
    between points l < n < r → l with probability (n − l) / (r − l), else r. That is decima-sim's rule as
    written (`rand_pt = randint(1, r − l + 1); l if rand_pt <= n − l else r`): it picks the *farther* point
    more often (n = 19 → 10 with p 0.9). We keep it, as the simulator the papers trained on does.
    """
    points = EXECUTOR_DATA_POINTS
    if num_executors <= points[0]:
        return points[0]
    if num_executors >= points[-1]:
        return points[-1]
    i = bisect.bisect_left(points, num_executors)
    if points[i] == num_executors:
        return num_executors
    left, right = points[i - 1], points[i]
    return left if int(rng.integers(1, right - left + 1)) <= num_executors - left else right


@dataclass(frozen=True, slots=True)
class WaveDurations:
    """A stage's measured task durations (seconds) per measured executor key: first wave (cleaned as
    decima-sim's `pre_process_task_duration` leaves it for sampling), later waves, fresh (just-moved executor)."""

    first: Mapping[int, np.ndarray]
    rest: Mapping[int, np.ndarray]
    fresh: Mapping[int, np.ndarray]

    def key(self, num_executors: int, rng: np.random.Generator) -> int:
        """`executor_key`, then decima-sim's fallback: a key the stage has no first-wave record for (more
        executors than the stage's tasks) → the largest key it has."""
        k = executor_key(num_executors, rng)
        return k if k in self.first else max(self.first)

    def sample(self, kind: str, num_executors: int, rng: np.random.Generator) -> float:
        """One task duration as decima-sim's `Node.schedule` draws it (see the module docstring); `kind` is
        FRESH, FIRST_WAVE or REST_WAVE, `num_executors` the executors the job holds (≥ 1)."""
        k = self.key(max(num_executors, 1), rng)
        empty = np.zeros(0)
        first, rest, fresh = self.first.get(k, empty), self.rest.get(k, empty), self.fresh.get(k, empty)
        if kind == FRESH:
            if len(fresh):
                return float(fresh[rng.integers(len(fresh))])
            if len(first):
                return float(first[rng.integers(len(first))]) + WARMUP_DELAY_S
        elif kind == REST_WAVE and len(rest):
            return float(rest[rng.integers(len(rest))])
        else:
            if len(first):
                return float(first[rng.integers(len(first))])
            if len(fresh):
                return float(fresh[rng.integers(len(fresh))])
        raise ValueError(f"no {kind} task duration recorded for executor key {k}")

    def minimum_s(self) -> float:
        """The shortest duration `sample` can return (a lower bound on any task of the stage)."""
        lows = [float(a.min()) for wave in (self.first, self.rest, self.fresh) for a in wave.values() if len(a)]
        return min(lows)


@dataclass(frozen=True, slots=True)
class DagStage:
    """One Spark stage (DAG node): `num_tasks` parallel tasks of `task_duration_s` each (Decima's mean)."""

    index: int  # node index 0..n-1 in the job
    num_tasks: int
    task_duration_s: float  # mean task duration, seconds
    parents: tuple[int, ...] = ()  # stage indices that must finish first, ascending
    children: tuple[int, ...] = ()  # ascending
    # the measured lists (TPC-H loader); None for hand-made stages, which always take task_duration_s
    waves: WaveDurations | None = field(default=None, compare=False, hash=False, repr=False)

    @property
    def min_task_duration_s(self) -> float:
        """The shortest a task of this stage can take: the waves' minimum, or the fixed duration."""
        return self.waves.minimum_s() if self.waves is not None else self.task_duration_s

    @property
    def work_s(self) -> float:
        """Executor-seconds of the stage: num_tasks × task_duration_s."""
        return self.num_tasks * self.task_duration_s


@dataclass(frozen=True, slots=True)
class DagJob:
    """A TPC-H query at one input size: stages plus [parent, child] dependency edges (parent first)."""

    query: int  # TPC-H query 1..22
    size: str  # input size, one of TPCH_SIZES (e.g. "2g")
    stages: tuple[DagStage, ...]
    edges: tuple[tuple[int, int], ...]  # sorted (parent, child) pairs

    def __post_init__(self) -> None:
        n = len(self.stages)
        for i, stage in enumerate(self.stages):
            if stage.index != i:
                raise ValueError(f"{self.name}: stages[{i}] has index {stage.index}")
        parents: list[list[int]] = [[] for _ in range(n)]
        children: list[list[int]] = [[] for _ in range(n)]
        for p, c in self.edges:
            if not (0 <= p < n and 0 <= c < n):
                raise ValueError(f"{self.name}: edge ({p}, {c}) names a stage outside 0..{n - 1}")
            parents[c].append(p)
            children[p].append(c)
        for stage in self.stages:
            if stage.parents != tuple(sorted(parents[stage.index])) or \
                    stage.children != tuple(sorted(children[stage.index])):
                raise ValueError(f"{self.name}: stage {stage.index}'s parents/children disagree with the edges")

    @property
    def name(self) -> str:
        """`tpch-<size>-q<query>`, e.g. `tpch-2g-q14` (Decima names it `tpch-2g-14`)."""
        return f"tpch-{self.size}-q{self.query}"

    @property
    def num_tasks(self) -> int:
        return sum(stage.num_tasks for stage in self.stages)


def make_dag_job(query: int, size: str, num_tasks: Sequence[int], task_duration_s: Sequence[float],
                 edges: Iterable[tuple[int, int]]) -> DagJob:
    """A `DagJob` whose stage i has num_tasks[i] tasks of task_duration_s[i]; parents/children from `edges`.

    Duplicate edges are merged. Acyclicity is not checked here: `topological_order` does that.
    """
    if len(num_tasks) != len(task_duration_s):
        raise ValueError(f"tpch-{size}-q{query}: {len(num_tasks)} task counts but {len(task_duration_s)} durations")
    pairs = tuple(sorted({(int(p), int(c)) for p, c in edges}))
    n = len(num_tasks)
    parents: list[list[int]] = [[] for _ in range(n)]
    children: list[list[int]] = [[] for _ in range(n)]
    for p, c in pairs:
        if 0 <= p < n and 0 <= c < n:  # out-of-range edges are reported by DagJob.__post_init__
            parents[c].append(p)
            children[p].append(c)
    stages = tuple(DagStage(index=i, num_tasks=int(num_tasks[i]), task_duration_s=float(task_duration_s[i]),
                            parents=tuple(parents[i]), children=tuple(children[i])) for i in range(n))
    return DagJob(query=query, size=size, stages=stages, edges=pairs)


def _num_tasks(durations: Mapping[str, Mapping[str, list[float]]]) -> int:
    """decima-sim's task count: first + later waves of the first executor key in the source's order."""
    first_key = next(iter(durations["first_wave"]))
    return len(durations["first_wave"][first_key]) + len(durations["rest_wave"].get(first_key, ()))


def _clean_first_wave(durations: Mapping[str, Mapping[str, list[float]]]) -> dict[str, list[float]]:
    """decima-sim's `pre_process_task_duration` (job_generator.py), which rewrites the first wave in place
    before the stage's `Node` samples from it: the fresh durations removed once each, an emptied list
    replaced by the next lower executor count's."""
    clean: dict[str, list[float]] = {}
    for key, first in durations["first_wave"].items():
        fresh = Counter(durations["fresh_durations"].get(key, ()))
        kept = []
        for d in first:
            if fresh[d] > 0:
                fresh[d] -= 1  # a fresh task is also listed in the first wave: drop it there once
            else:
                kept.append(d)
        clean[key] = kept
    last: list[float] = []
    for key in sorted(clean, key=int):  # an emptied first wave borrows the next lower executor count's
        if not clean[key]:
            clean[key] = last
        last = clean[key]
    return clean


def _rough_duration_ms(durations: Mapping[str, Mapping[str, list[float]]]) -> float:
    """decima-sim's `rough_duration` (job_generator.py: pre_process_task_duration, then np.mean), in ms."""
    clean = _clean_first_wave(durations)
    pooled = [d for wave in (clean, durations["rest_wave"], durations["fresh_durations"])
              for ds in wave.values() for d in ds]
    if not pooled:
        raise ValueError("stage has no task durations")
    return sum(pooled) / len(pooled)


def _job(key: str, raw: Mapping) -> DagJob:
    size, _, q = key.partition("/q")
    durations = raw["task_duration_ms"]
    if len(durations) != raw["num_nodes"]:
        raise ValueError(f"{key}: {len(durations)} stage duration records for {raw['num_nodes']} nodes")
    try:
        job = make_dag_job(
            query=int(q), size=size,
            num_tasks=[_num_tasks(d) for d in durations],
            task_duration_s=[_rough_duration_ms(d) / MS_PER_S for d in durations],  # the one ms → s conversion
            edges=[(p, c) for p, c in raw["edges"]],
        )
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from exc
    topological_order(job)  # rejects cycles
    stages = tuple(replace(stage, waves=_waves(d)) for stage, d in zip(job.stages, durations, strict=True))
    return DagJob(query=job.query, size=job.size, stages=stages, edges=job.edges)


def _waves(durations: Mapping[str, Mapping[str, list[float]]]) -> WaveDurations:
    def wave(lists: Mapping[str, list[float]]) -> dict[int, np.ndarray]:
        return {int(k): np.asarray(v, dtype=np.float64) / MS_PER_S for k, v in lists.items()}

    out = WaveDurations(wave(_clean_first_wave(durations)), wave(durations.get("rest_wave", {})),
                        wave(durations.get("fresh_durations", {})))
    if not out.first:
        raise ValueError("stage has no first-wave record")
    return out


@lru_cache(maxsize=4)
def _load_all(path: str, _mtime_ns: int) -> dict[str, DagJob]:
    with open_text(path) as fh:
        raw = json.load(fh)
    return {key: _job(key, value) for key, value in raw.items()}


def tpch_size(size: str | int) -> str:
    """A TPC-H input size as TPCH_SIZES spells it ("2G", 2 -> "2g"); ValueError naming the sizes if unknown."""
    name = f"{size}g" if isinstance(size, int) else str(size).lower()
    if name not in TPCH_SIZES:
        raise ValueError(f"unknown TPC-H size {size!r}; expected one of {', '.join(TPCH_SIZES)}")
    return name


def load_tpch_dags(path: str | Path | None = None, queries: Iterable[int] | None = None,
                   sizes: Iterable[str | int] | None = None) -> list[DagJob]:
    """The TPC-H DAGs for `sizes` × `queries` (default all 7 × 22 = 154), ordered by size, then query.

    `path` defaults to `data_dir() / "decima_tpch/tpch_dags.json.gz"`. Sizes are "2g" … "100g" or the GB
    number (2 … 100); queries are 1..22. An unknown size/query, a DAG missing from the file or a cyclic DAG
    raises ValueError. The parsed file is cached per path (and modification time); the jobs are immutable.
    """
    file = Path(path) if path is not None else data_dir() / DEFAULT_FILE
    wanted_sizes = [tpch_size(s) for s in (TPCH_SIZES if sizes is None else sizes)]
    wanted_queries = list(TPCH_QUERIES if queries is None else queries)
    for q in wanted_queries:
        if isinstance(q, bool) or not isinstance(q, int) or q not in TPCH_QUERIES:
            raise ValueError(f"unknown TPC-H query {q!r}; expected an integer in 1..22")
    jobs = _load_all(str(file.resolve()), os.stat(file).st_mtime_ns)
    out = []
    for size in sorted(dict.fromkeys(wanted_sizes), key=TPCH_SIZES.index):
        for q in sorted(dict.fromkeys(wanted_queries)):
            key = f"{size}/q{q}"
            if key not in jobs:
                raise ValueError(f"{file}: no DAG {key}")
            out.append(jobs[key])
    return out


def topological_order(job: DagJob) -> tuple[int, ...]:
    """Stage indices, every parent before its children (Kahn; the lowest ready index first).

    Raises ValueError naming the job and the stages left on a cycle.
    """
    return dag.topological_order([stage.parents for stage in job.stages], job.name)


def _duration(stage: DagStage, shortest: bool) -> float:
    return stage.min_task_duration_s if shortest else stage.task_duration_s


def critical_path_s(job: DagJob, *, shortest: bool = False) -> float:
    """Longest dependency chain, weighting each stage by one task duration, in seconds.

    With unlimited executors and no scheduling or start-up delays every stage runs all its tasks in one wave,
    so this is the job's completion time in that ideal case: a lower bound on its JCT with mean durations.
    `shortest=True` weights a stage by the shortest task it can draw (`DagStage.min_task_duration_s`): the
    bound that holds when durations are drawn from the measured waves.
    """
    return dag.critical_path([_duration(s, shortest) for s in job.stages], [s.parents for s in job.stages], job.name)


def total_work_s(job: DagJob, *, shortest: bool = False) -> float:
    """Executor-seconds of the job: Σ num_tasks × task_duration_s (decima-sim's JobDAGDuration); with
    `shortest=True` Σ num_tasks × the shortest task duration the stage can draw."""
    return sum(stage.num_tasks * _duration(stage, shortest) for stage in job.stages)


def dag_stage_to_task(stage: DagStage, cpu_per_task_milli: int = DEFAULT_CPU_PER_TASK_MILLI,
                      memory_mib_per_task: int = DEFAULT_MEMORY_MIB_PER_TASK, tenant: str = TENANT,
                      name: str = "", priority: int = 0, max_replicas: int = MAX_REPLICAS) -> TaskSpec:
    """A multi-replica TaskSpec for a stage: one replica per Spark task.

    Assumptions (the trace records only durations): a task needs one executor slot, `cpu_per_task_milli`
    (default one core) and `memory_mib_per_task` (default 1024 MiB, Spark's default executor memory); no disk,
    network or GPU; no input data size. replicas = num_tasks and runtime_s = task_duration_s while
    num_tasks <= `max_replicas` (TaskSpec allows at most 256; 63 of the 1414 stages have more, up to 593);
    above it replicas = max_replicas and the runtime stretches to num_tasks × task_duration_s / replicas,
    which keeps the stage's executor-seconds. A TaskSpec has no dependencies: release a stage's task only
    when all its `parents` have finished (see `topological_order`).
    """
    if not 1 <= max_replicas <= MAX_REPLICAS:
        raise ValueError(f"max_replicas must be in 1..{MAX_REPLICAS}, got {max_replicas}")
    replicas = min(stage.num_tasks, max_replicas)
    runtime = stage.task_duration_s if replicas == stage.num_tasks else stage.work_s / replicas
    return TaskSpec(
        resources=Resources(cpu_milli=cpu_per_task_milli, memory_mib=memory_mib_per_task),
        runtime_s=runtime,
        tenant=tenant,
        name=name,
        priority=priority,
        replicas=replicas,
    )


def dag_job_to_tasks(job: DagJob, cpu_per_task_milli: int = DEFAULT_CPU_PER_TASK_MILLI,
                     memory_mib_per_task: int = DEFAULT_MEMORY_MIB_PER_TASK, tenant: str = TENANT,
                     priority: int = 0, max_replicas: int = MAX_REPLICAS) -> list[tuple[DagStage, TaskSpec]]:
    """(stage, `dag_stage_to_task`) pairs in `topological_order`, tasks named `<job.name>-s<index>`."""
    return [(job.stages[i], dag_stage_to_task(job.stages[i], cpu_per_task_milli, memory_mib_per_task, tenant,
                                              f"{job.name}-s{i}", priority, max_replicas))
            for i in topological_order(job)]
