"""hsched/Colocation-v0: paper 001's online/offline co-located cloud (JobFusion), as a Gymnasium environment.

**Cloud.** `nodes` machines of `node_capacity` (cpu cores, memory in percent of a machine — the units of the
Alibaba v2018 trace: a v2018 machine has 96 cores and memory 100) pre-partitioned into container *slices*
of Q types (`hsched.policies.slices`): `slicing="constrained"` is paper 001's method 3 (connectivity-
constrained hierarchical clustering), `"plain"` method 2, `"uniform"` method 1 (one type = the largest
demand of each resource: how Decima and the other baselines see the machines). A slice runs one task
instance at a time, which needs slice size ≥ its demand vector. Each node is cut in proportion to the
slice capacity the workload pool would reserve per type (`partition_node`).

**Offline jobs** are DAGs: the Alibaba 2018 batch jobs (`workload="alibaba"`) or Decima's TPC-H DAGs
(`"tpch"`; they carry no resource request: one core and `tpch_memory` per task, Spark's defaults). A
stage (DAG node) has `num_tasks` instances of `duration_s` each and may start when all parents finished.
`num_jobs` jobs are drawn from the pool per episode; the first arrives at t = 0, the rest as a Poisson
stream of mean gap `job_interarrival_s`.

**Online (latency-critical) tasks** arrive as a non-homogeneous Poisson stream with paper 001 §3.2.2's tidal
(daily-periodic) load: rate λ(t) = `online_rate` · (1 + `online_amplitude` · sin(2πt / `online_period_s`)),
exponential durations of mean `online_duration_s`, each asking for one slice for a demand vector drawn
from the pool's offline demand vectors (the shipped trace slice has no online-container requests). They
are served first-come-first-served ahead of every offline decision: a free fitting slice (smallest type
first) is taken at once; otherwise the offline instance that loses the least work (elapsed run time ×
demand volume, 0 while still starting; then the smallest slice) is **preempted**: its progress is lost and
it is requeued at its stage; the online task starts after the preemption/context-switch overhead. Online
tasks are never preempted. If every fitting slice holds an online task the queue waits (FCFS).

**Decisions** (the agent schedules offline work only, as in paper 001): whenever a runnable stage has
pending instances and a free slice it fits, the agent picks an action (paper 001 §2.2.2's triple)
`(candidate stage, slice type, count level)`; `info["candidates"]` lists the (job, stage) pairs,
`info["type_mask"][c, k]` says whether type k has a free slice that fits candidate c, and
`COUNT_LEVELS[level]` caps the instances launched (also capped by pending instances and free slices).

**Overheads** (paper 001 §3.1, configurable): scheduling delay per action drawn from 0.4, 0.5, …, 1.0 s;
container start per instance uniform in [1, 10] s; preemption/context switch uniform in [5, 25] s. An
instance holds its slice from the decision on and runs `duration_s` after both delays.

**Reward** r_k = −∫ J(t) dt over [t_{k−1}, t_k] (J = offline jobs in the system): paper 001's
−(t_k − t_{k−1})·J_k with J piecewise constant between events, so an episode's return is −Σ JCT.

**Metrics** (`info["metrics"]` at the end): resource utilisation (time-average of the demand of the running
offline and online tasks over the node capacity, per resource and mean), average JCT, preemptions, online
latency (arrival → start), makespan.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, ClassVar

import gymnasium
import numpy as np
from gymnasium import spaces

from hsched.domain.dag import critical_path, topological_order
from hsched.policies.colocation import COUNT_LEVELS
from hsched.policies.slices import SliceTypes, cluster_demands, partition_node, type_shares, uniform_type

MAX_CANDIDATES = 512
SLICINGS = ("constrained", "plain", "uniform")
WORKLOADS = ("alibaba", "tpch")
STAGE_FEATURES = ("cpu", "memory", "log_instances", "done_fraction", "pending_fraction", "log_duration",
                  "log_remaining_work", "runnable")


@dataclass(frozen=True, slots=True)
class StageSpec:
    num_tasks: int
    duration_s: float
    demand: tuple[float, float]  # cores, memory (percent of a machine)
    parents: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class JobSpec:
    name: str
    stages: tuple[StageSpec, ...]


@dataclass(frozen=True)
class ColocationConfig:
    workload: str = "alibaba"
    num_jobs: int = 50
    job_interarrival_s: float = 4.0
    max_instances: int = 200          # alibaba pool: jobs with at most this many instances ...
    min_tasks: int = 2                # ... and at least this many tasks (DAGs, not single tasks)
    tpch_sizes: tuple[str, ...] = ("2g", "5g", "10g")
    tpch_memory: float = 1.0          # percent of a machine per TPC-H task (≈ Spark's 1 GiB executor)
    nodes: int = 1
    node_capacity: tuple[float, float] = (96.0, 100.0)
    slicing: str = "constrained"
    q: int = 6
    online_rate: float = 0.05         # online arrivals per second, mean over a period
    online_amplitude: float = 0.5
    online_period_s: float = 1800.0   # one compressed "day"
    online_duration_s: float = 120.0
    sched_delay_s: tuple[float, ...] = (0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
    container_start_s: tuple[float, float] = (1.0, 10.0)
    preemption_s: tuple[float, float] = (5.0, 25.0)
    horizon_s: float = 200_000.0

    def validate(self) -> ColocationConfig:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload: must be one of {', '.join(WORKLOADS)}, got {self.workload!r}")
        if self.slicing not in SLICINGS:
            raise ValueError(f"slicing: must be one of {', '.join(SLICINGS)}, got {self.slicing!r}")
        for name in ("num_jobs", "nodes", "q", "max_instances", "min_tasks"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: must be an integer ≥ 1, got {v!r}")
        for name in ("job_interarrival_s", "online_rate", "tpch_memory"):
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):
                raise ValueError(f"{name}: must be a finite number ≥ 0, got {getattr(self, name)!r}")
        for name in ("online_period_s", "online_duration_s", "horizon_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)!r}")
        if not 0 <= self.online_amplitude <= 1:
            raise ValueError(f"online_amplitude: must be in [0, 1], got {self.online_amplitude!r}")
        if len(self.node_capacity) != 2 or min(self.node_capacity) <= 0:
            raise ValueError(f"node_capacity: expected (cores > 0, memory > 0), got {self.node_capacity!r}")
        if not self.sched_delay_s or min(self.sched_delay_s) < 0:
            raise ValueError(f"sched_delay_s: expected a non-empty list of delays ≥ 0, got {self.sched_delay_s!r}")
        for name in ("container_start_s", "preemption_s"):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi:
                raise ValueError(f"{name}: expected (low, high) with 0 ≤ low ≤ high, got {(lo, hi)!r}")
        return self


# ---------------------------------------------------------------- workload pools and slices (cached)

def jobs_from_alibaba(max_instances: int, min_tasks: int) -> tuple[JobSpec, ...]:
    from hsched.traces.alibaba2018 import load_alibaba_jobs

    out = []
    for job in load_alibaba_jobs(max_instances=max_instances, min_tasks=min_tasks):
        out.append(JobSpec(name=job.name, stages=tuple(
            StageSpec(num_tasks=t.instances, duration_s=t.duration_s, demand=(t.cpu_cores, t.memory),
                      parents=job.parents(i)) for i, t in enumerate(job.tasks))))
    return tuple(out)


def jobs_from_tpch(sizes: Sequence[str], memory: float) -> tuple[JobSpec, ...]:
    from hsched.traces.decima import load_tpch_dags

    return tuple(JobSpec(name=dag.name, stages=tuple(
        StageSpec(num_tasks=s.num_tasks, duration_s=s.task_duration_s, demand=(1.0, memory), parents=s.parents)
        for s in dag.stages)) for dag in load_tpch_dags(sizes=sizes))


@lru_cache(maxsize=8)
def _pool(workload: str, max_instances: int, min_tasks: int, tpch_sizes: tuple[str, ...],
          tpch_memory: float) -> tuple[JobSpec, ...]:
    if workload == "alibaba":
        return jobs_from_alibaba(max_instances, min_tasks)
    return jobs_from_tpch(tpch_sizes, tpch_memory)


def job_pool(cfg: ColocationConfig) -> tuple[JobSpec, ...]:
    return _pool(cfg.workload, cfg.max_instances, cfg.min_tasks, tuple(cfg.tpch_sizes), cfg.tpch_memory)


def pool_demands(jobs: Sequence[JobSpec]) -> tuple[np.ndarray, np.ndarray]:
    """Per stage of the pool: demand vector and weight (instances × duration: the slice-seconds it needs)."""
    d = np.array([s.demand for j in jobs for s in j.stages], dtype=np.float64)
    w = np.array([s.num_tasks * s.duration_s for j in jobs for s in j.stages], dtype=np.float64)
    return d, w


def layout_for(pool: Sequence[JobSpec], cfg: ColocationConfig) -> tuple[SliceTypes, tuple[int, ...]]:
    """Slice types clustered from the pool's demand vectors and the slices of each type cut from one node
    (in proportion to the slice capacity the pool's work, instances × duration, reserves per type)."""
    demands, weights = pool_demands(pool)
    scale = np.asarray(cfg.node_capacity, dtype=np.float64)
    if cfg.slicing == "uniform":
        types = uniform_type(demands)
    else:
        types = cluster_demands(demands, cfg.q, scale=scale, constrained=cfg.slicing == "constrained")
    return types, tuple(partition_node(cfg.node_capacity, types.sizes, type_shares(types, demands, weights, scale)))


@lru_cache(maxsize=16)
def _cached_layout(cfg: ColocationConfig) -> tuple[SliceTypes, tuple[int, ...]]:
    return layout_for(job_pool(cfg), cfg)


def slice_layout(cfg: ColocationConfig) -> tuple[SliceTypes, tuple[int, ...]]:
    """The slice types of `cfg`'s workload pool and the number of slices of each type cut from one node."""
    cfg = cfg.validate()
    return _cached_layout(ColocationConfig(workload=cfg.workload, max_instances=cfg.max_instances,
                                           min_tasks=cfg.min_tasks, tpch_sizes=tuple(cfg.tpch_sizes),
                                           tpch_memory=cfg.tpch_memory, node_capacity=tuple(cfg.node_capacity),
                                           slicing=cfg.slicing, q=cfg.q))


def critical_path_lower_bound_s(job: JobSpec, sched_delay_s: float = 0.0, container_start_s: float = 0.0) -> float:
    """The JCT of `job` with unlimited slices: the longest chain of (minimum delays + one instance duration)."""
    return critical_path([sched_delay_s + container_start_s + s.duration_s for s in job.stages],
                         [s.parents for s in job.stages], f"job {job.name}")


# ---------------------------------------------------------------- runtime state

@dataclass
class _Stage:
    spec: StageSpec
    pending: int
    running: int = 0
    done: int = 0
    parents_left: int = 0
    children: list[int] = field(default_factory=list)


@dataclass
class _Job:
    spec: JobSpec
    arrival: float
    stages: list[_Stage]
    finished: float | None = None
    stages_left: int = 0


@dataclass
class _Instance:
    job: int
    stage: int
    slice: int
    placed: float
    run_start: float
    end: float


@dataclass
class _Online:
    demand: np.ndarray
    arrival: float
    duration: float
    slice: int = -1
    start: float | None = None
    end: float | None = None


class ColocationEnv(gymnasium.Env):
    """See the module docstring."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}

    def __init__(self, config: ColocationConfig | None = None, *, pool: Sequence[JobSpec] | None = None,
                 invalid_action: str = "raise", **overrides: Any) -> None:
        """`pool`: the jobs to draw from instead of the configured workload (tests, custom workloads); the
        slice types are then clustered from it. `invalid_action`: what step() does with an action outside the
        masks — "raise" (ValueError: the project's schedulers always mask), or "nearest" (what
        `gymnasium.make("hsched/Colocation-v0")` builds: the clipped candidate and count level and the first
        free slice type that fits, with `info["invalid_action"]` True)."""
        from hsched.envs.dag import invalid_action_mode  # (here: the DAG env's module loads the TPC-H DAGs)

        self.invalid_action = invalid_action_mode(invalid_action)
        cfg = replace(config or ColocationConfig(), **overrides).validate()
        self.cfg = cfg
        if pool is not None:
            if not pool:
                raise ValueError("pool: must hold at least one job")
            for job in pool:
                topological_order([s.parents for s in job.stages], f"job {job.name}")
            self.pool = tuple(pool)
            self.types, self.per_node = layout_for(self.pool, cfg)
        else:
            self.pool = job_pool(cfg)
            self.types, self.per_node = slice_layout(cfg)
        self.q = self.types.q
        self.capacity = np.asarray(cfg.node_capacity, dtype=np.float64)
        for job in self.pool:
            for s in job.stages:
                if self.types.smallest_fitting(s.demand) < 0:
                    raise ValueError(f"workload: job {job.name} asks {s.demand}, larger than every slice type")
        demands, _ = pool_demands(self.pool)
        self.online_demands = demands
        slice_type = [k for _ in range(cfg.nodes) for k in range(self.q) for _ in range(self.per_node[k])]
        self.slice_type = np.array(slice_type, dtype=np.int64)
        self.slice_node = np.repeat(np.arange(cfg.nodes), sum(self.per_node))
        self.observation_space = spaces.Dict({
            "free_slices": spaces.Box(0, np.inf, (self.q,), np.float32),
            "jobs_in_system": spaces.Box(0, np.inf, (1,), np.float32),
            "runnable_stages": spaces.Box(0, np.inf, (1,), np.float32),
            "time": spaces.Box(0, np.inf, (1,), np.float32),
        })
        self.action_space = spaces.MultiDiscrete([MAX_CANDIDATES, self.q, len(COUNT_LEVELS)])
        self._started = False

    # ---------------------------------------------------------------- gym API
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        # without a seed, from the env's own generator (seeded by the last seeded reset): reset(seed=s) then
        # reset() is the same episode every time, as Gymnasium requires (the OS's entropy made it differ)
        ss = np.random.SeedSequence(seed if seed is not None else int(self.np_random.integers(2**63)))
        workload_rng, online_rng, overhead_rng = (np.random.default_rng(s) for s in ss.spawn(3))
        cfg = self.cfg
        picks = workload_rng.choice(len(self.pool), size=min(cfg.num_jobs, len(self.pool)), replace=False)
        gaps = workload_rng.exponential(cfg.job_interarrival_s, size=len(picks)) if cfg.job_interarrival_s > 0 \
            else np.zeros(len(picks))
        gaps[0] = 0.0
        arrivals = np.cumsum(gaps)
        self.online_rng, self.overhead_rng = online_rng, overhead_rng
        self.t = 0.0
        self.events: list[tuple[float, int, str, int]] = []
        self._seq = 0
        self.jobs: list[_Job] = []
        self.arrived: list[int] = []        # job indices in the system (arrived, not finished)
        self.job_specs = [self.pool[int(p)] for p in picks]
        for j, _spec in enumerate(self.job_specs):
            self._push(float(arrivals[j]), "job", j)
        self.instances: dict[int, _Instance] = {}
        self._next_instance = 0
        self.slice_occupant = np.full(len(self.slice_type), -1, dtype=np.int64)  # instance id or −2 − online id
        self.free: list[list[int]] = [[] for _ in range(self.q)]
        for sid in range(len(self.slice_type) - 1, -1, -1):
            self.free[self.slice_type[sid]].append(int(sid))
        self.online: list[_Online] = []
        self.online_queue: list[int] = []
        scripted = (options or {}).get("online_tasks")
        self._scripted_online = scripted is not None
        if scripted is not None:  # [(arrival_s, (cores, memory), duration_s), ...] instead of the random stream
            for arrival, demand, duration in sorted(scripted, key=lambda x: x[0]):
                if not (arrival >= 0 and duration > 0 and len(demand) == 2):
                    raise ValueError(f"options.online_tasks: bad entry {(arrival, demand, duration)!r}")
                if self.types.smallest_fitting(demand) < 0:
                    raise ValueError(f"options.online_tasks: demand {demand!r} fits no slice type")
                self.online.append(_Online(demand=np.asarray(demand, dtype=np.float64), arrival=float(arrival),
                                           duration=float(duration)))
                self._push(float(arrival), "online", len(self.online) - 1)
        else:
            self._schedule_next_online()
        self.area = 0.0                      # ∫ J dt since the last decision
        self.used_integral = np.zeros(2)     # ∫ demand of running tasks dt
        self.preemptions = 0
        self.preempted_instances: list[int] = []
        self.decisions = 0
        self.jct: list[float] = []
        self.jobs_done = 0
        self._started = True
        self._advance()
        return self._obs(), self._info()

    def step(self, action):
        if not self._started:
            raise RuntimeError("call reset() before step()")
        cands = self.candidates()
        if not cands:
            raise RuntimeError("step() after the episode ended; call reset()")
        c, k, level = (int(x) for x in np.asarray(action).reshape(-1)[:3])
        nearest, invalid = self.invalid_action == "nearest", False
        if not 0 <= c < len(cands):
            if not nearest:
                raise ValueError(f"action: candidate {c} out of range 0..{len(cands) - 1}")
            c, invalid = min(max(c, 0), len(cands) - 1), True
        if not 0 <= level < len(COUNT_LEVELS):
            if not nearest:
                raise ValueError(f"action: count level {level} out of range 0..{len(COUNT_LEVELS) - 1}")
            level, invalid = min(max(level, 0), len(COUNT_LEVELS) - 1), True
        j, s = cands[c]
        demand = self.jobs[j].stages[s].spec.demand
        if not (0 <= k < self.q and self._fits(demand, k) and self.free[k]):
            if not nearest:
                raise ValueError(f"action: slice type {k} has no free slice that fits stage {s} of job {j}")
            # a candidate has a free slice that fits (candidates()): the first such type
            k, invalid = next(t for t in range(self.q) if self.free[t] and self._fits(demand, t)), True
        self.launch(j, s, k, COUNT_LEVELS[level])
        self.area = 0.0
        self._advance()
        reward = -self.area
        terminated = self._all_done()
        truncated = not terminated and self.t >= self.cfg.horizon_s
        obs = self._obs()  # (before _info: it refreshes the candidates _info reads)
        info = self._info()
        info["invalid_action"] = invalid
        return obs, reward, terminated, truncated, info

    # ---------------------------------------------------------------- views for policies
    def candidates(self) -> list[tuple[int, int]]:
        """(job, stage) pairs with pending instances, all parents done and a free slice that fits."""
        if self.t >= self.cfg.horizon_s:
            return []
        free_types = [k for k in range(self.q) if self.free[k]]
        if not free_types:
            return []
        fits: dict[tuple[float, float], bool] = {}  # per demand vector: does a free slice fit it?
        out = []
        for j in self.arrived:
            for s, st in enumerate(self.jobs[j].stages):
                if st.pending > 0 and st.parents_left == 0:
                    d = st.spec.demand
                    ok = fits.get(d)
                    if ok is None:
                        ok = fits[d] = any(self._fits(d, k) for k in free_types)
                    if ok:
                        out.append((j, s))
        return out[:MAX_CANDIDATES]

    def type_mask(self, cands: Sequence[tuple[int, int]] | None = None) -> np.ndarray:
        cands = self.candidates() if cands is None else cands
        mask = np.zeros((len(cands), self.q), dtype=bool)
        for c, (j, s) in enumerate(cands):
            d = self.jobs[j].stages[s].spec.demand
            for k in range(self.q):
                mask[c, k] = bool(self.free[k]) and self._fits(d, k)
        return mask

    def stage_features(self, j: int) -> np.ndarray:
        """Per stage of job j, the `STAGE_FEATURES` (demands as a fraction of a node, log-scaled counts)."""
        job = self.jobs[j]
        rows = []
        for st in job.stages:
            n = st.spec.num_tasks
            remaining = (n - st.done) * st.spec.duration_s
            rows.append((st.spec.demand[0] / self.capacity[0] * 10, st.spec.demand[1] / self.capacity[1] * 10,
                         math.log1p(n) / 5, st.done / n, st.pending / n, math.log1p(st.spec.duration_s) / 5,
                         math.log1p(remaining) / 10, float(st.pending > 0 and st.parents_left == 0)))
        return np.asarray(rows, dtype=np.float32)

    def job_edges(self, j: int) -> list[tuple[int, int]]:
        return [(p, i) for i, s in enumerate(self.jobs[j].spec.stages) for p in s.parents]

    def free_counts(self) -> np.ndarray:
        return np.array([len(f) for f in self.free], dtype=np.float32)

    # ---------------------------------------------------------------- mechanics
    def _fits(self, demand: Sequence[float], k: int) -> bool:
        size = self.types.sizes[k]
        return demand[0] <= size[0] + 1e-9 and demand[1] <= size[1] + 1e-9

    def _push(self, t: float, kind: str, ref: int) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, ref))

    def _schedule_next_online(self) -> None:
        """Next arrival of the tidal Poisson stream (thinning against the peak rate)."""
        cfg = self.cfg
        peak = cfg.online_rate * (1 + cfg.online_amplitude)
        if peak <= 0:
            return
        t = self.online[-1].arrival if self.online else 0.0
        while True:
            t += float(self.online_rng.exponential(1.0 / peak))
            rate = cfg.online_rate * (1 + cfg.online_amplitude * math.sin(2 * math.pi * t / cfg.online_period_s))
            if self.online_rng.random() * peak <= rate:
                break
        demand = self.online_demands[int(self.online_rng.integers(len(self.online_demands)))]
        duration = float(self.online_rng.exponential(cfg.online_duration_s))
        self.online.append(_Online(demand=demand, arrival=t, duration=duration))
        self._push(t, "online", len(self.online) - 1)

    def _clock(self, t: float) -> None:
        if t > self.t:
            self.area += len(self.arrived) * (t - self.t)
            self.t = t

    def _credit(self, demand: Sequence[float], start: float, end: float) -> None:
        if end > start:
            self.used_integral += np.asarray(demand, dtype=np.float64) * (end - start)

    def launch(self, j: int, s: int, k: int, count: int) -> int:
        """Start up to `count` instances of stage s of job j on free type-k slices (one scheduling action)."""
        st = self.jobs[j].stages[s]
        n = min(count, st.pending, len(self.free[k]))
        delay = float(self.overhead_rng.choice(self.cfg.sched_delay_s))
        lo, hi = self.cfg.container_start_s
        for _ in range(n):
            sid = self.free[k].pop()
            start = self.t + delay + float(self.overhead_rng.uniform(lo, hi))
            iid = self._next_instance
            self._next_instance += 1
            self.instances[iid] = _Instance(j, s, sid, self.t, start, start + st.spec.duration_s)
            self.slice_occupant[sid] = iid
            self._push(start + st.spec.duration_s, "finish", iid)
        st.pending -= n
        st.running += n
        self.decisions += 1
        return n

    def _release(self, sid: int) -> None:
        self.slice_occupant[sid] = -1
        self.free[self.slice_type[sid]].append(sid)

    def _serve_online(self) -> None:
        """FCFS: place queued online tasks on a free fitting slice, else preempt the cheapest offline victim."""
        while self.online_queue:
            oid = self.online_queue[0]
            task = self.online[oid]
            sid = -1
            for k in range(self.q):  # smallest fitting type with a free slice
                if self.free[k] and self._fits(task.demand, k):
                    sid = self.free[k].pop()
                    break
            delay_lo, delay_hi = self.cfg.container_start_s
            if sid < 0:
                sid = self._victim(task.demand)
                if sid < 0:
                    return  # every fitting slice runs an online task: wait
                self._preempt(sid)
                delay_lo, delay_hi = self.cfg.preemption_s
            self.online_queue.pop(0)
            task.slice = sid
            task.start = self.t + float(self.overhead_rng.uniform(delay_lo, delay_hi))
            task.end = task.start + task.duration
            self.slice_occupant[sid] = -2 - oid
            self._push(task.end, "online_end", oid)

    def _victim(self, demand: np.ndarray) -> int:
        best, best_key = -1, None
        for sid in np.flatnonzero(self.slice_occupant >= 0):
            k = int(self.slice_type[sid])
            if not self._fits(demand, k):
                continue
            inst = self.instances[int(self.slice_occupant[sid])]
            spec = self.jobs[inst.job].stages[inst.stage].spec
            lost = max(0.0, self.t - inst.run_start) * float((np.asarray(spec.demand) / self.capacity).mean())
            key = (lost, float((self.types.sizes[k] / self.capacity).mean()), int(sid))
            if best_key is None or key < best_key:
                best, best_key = int(sid), key
        return best

    def _preempt(self, sid: int) -> None:
        iid = int(self.slice_occupant[sid])
        inst = self.instances.pop(iid)
        st = self.jobs[inst.job].stages[inst.stage]
        self._credit(st.spec.demand, inst.run_start, self.t)  # it did use the resources until now
        st.running -= 1
        st.pending += 1  # requeued: its progress is lost
        self.slice_occupant[sid] = -1
        self.preemptions += 1
        self.preempted_instances.append(iid)

    def _all_done(self) -> bool:
        return self.jobs_done == len(self.job_specs)

    def _advance(self) -> None:
        """Process events until the agent has a decision to make or the episode is over."""
        while True:
            if self._all_done() or self.t >= self.cfg.horizon_s:
                return
            if self.candidates():
                return
            if not self.events:
                raise RuntimeError("no event left but jobs unfinished (a stage fits no slice)")
            t, _, kind, ref = heapq.heappop(self.events)
            self._clock(min(t, self.cfg.horizon_s))
            if t > self.cfg.horizon_s:
                return
            if kind == "job":
                self._arrive(ref)
            elif kind == "finish":
                self._finish(ref)
            elif kind == "online":
                self.online_queue.append(ref)
                if not self._scripted_online:
                    self._schedule_next_online()
            elif kind == "online_end":
                task = self.online[ref]
                self._credit(task.demand, task.start, task.end)
                self._release(task.slice)
            self._serve_online()

    def _arrive(self, j: int) -> None:
        spec = self.job_specs[j]
        stages = [_Stage(spec=s, pending=s.num_tasks, parents_left=len(s.parents)) for s in spec.stages]
        for i, s in enumerate(spec.stages):
            for p in s.parents:
                stages[p].children.append(i)
        assert j == len(self.jobs)
        self.jobs.append(_Job(spec=spec, arrival=self.t, stages=stages, stages_left=len(stages)))
        self.arrived.append(j)

    def _finish(self, iid: int) -> None:
        inst = self.instances.pop(iid, None)
        if inst is None:
            return  # preempted before it finished: a stale event
        job = self.jobs[inst.job]
        st = job.stages[inst.stage]
        self._credit(st.spec.demand, inst.run_start, inst.end)
        st.running -= 1
        st.done += 1
        self._release(inst.slice)
        if st.done == st.spec.num_tasks:
            for c in st.children:
                job.stages[c].parents_left -= 1
            job.stages_left -= 1
            if job.stages_left == 0:
                job.finished = self.t
                self.jct.append(self.t - job.arrival)
                self.arrived.remove(inst.job)
                self.jobs_done += 1

    def _obs(self) -> dict[str, np.ndarray]:
        self._cands = self.candidates()  # reused by _info, which the API calls right after
        return {"free_slices": self.free_counts(),
                "jobs_in_system": np.array([len(self.arrived)], dtype=np.float32),
                "runnable_stages": np.array([len(self._cands)], dtype=np.float32),
                "time": np.array([self.t], dtype=np.float32)}

    def _info(self) -> dict[str, Any]:
        cands = self._cands
        info: dict[str, Any] = {"candidates": cands, "type_mask": self.type_mask(cands), "time": self.t}
        if self._all_done() or self.t >= self.cfg.horizon_s:
            info["metrics"] = self.metrics()
        return info

    def metrics(self) -> dict[str, float]:
        """Utilisation, average JCT, preemptions, online latency; running tasks are credited up to now."""
        used = self.used_integral.copy()
        for inst in self.instances.values():
            spec = self.jobs[inst.job].stages[inst.stage].spec
            used += np.asarray(spec.demand) * max(0.0, min(self.t, inst.end) - inst.run_start)
        for task in self.online:
            if task.start is not None and task.end is not None and task.end > self.t:
                used += task.demand * max(0.0, self.t - task.start)
        span = max(self.t, 1e-9)
        util = used / (self.capacity * self.cfg.nodes * span)
        started = [o.start - o.arrival for o in self.online if o.start is not None and o.arrival <= self.t]
        return {"utilisation": float(util.mean()), "cpu_utilisation": float(util[0]),
                "memory_utilisation": float(util[1]),
                "avg_jct_s": float(np.mean(self.jct)) if self.jct else float("nan"),
                "jobs_finished": float(self.jobs_done), "preemptions": float(self.preemptions),
                "online_latency_s": float(np.mean(started)) if started else 0.0,
                "online_latency_p95_s": float(np.percentile(started, 95)) if started else 0.0,
                "online_tasks": float(len(started)), "makespan_s": float(self.t),
                "decisions": float(self.decisions)}


def run_colocation_policy(env: ColocationEnv, policy: Callable[[ColocationEnv], Any], seed: int) -> dict[str, float]:
    """One episode of `policy` (env → action triple) from `seed`: the env's end-of-episode metrics."""
    _, info = env.reset(seed=seed)
    done = False
    while not done:
        _obs, _r, term, trunc, info = env.step(policy(env))
        done = term or trunc
    return info["metrics"]
