"""Spark DAG scheduling (Decima, Mao et al. SIGCOMM'19; paper 004 §2) as a Gymnasium environment
(`hsched/DagScheduling-v0`).

Cluster. `executors` identical executors; an executor runs one task at a time. An executor that starts a
task of a job other than the one it last served first pays `moving_delay_s` (Decima's moving delay, 2 s:
the executor is torn down and relaunched in the other job's Spark context; a fresh executor pays it too).

Jobs. DAGs of stages (`hsched.traces.decima.DagJob`; by default the TPC-H DAGs at paper 004's six input
sizes 2-100 GB, sampled uniformly with the env's seeded generator). A stage has `num_tasks` tasks; it becomes
*runnable* when every parent stage has finished.

Task durations (`durations`). "waves" (default): each task's duration is drawn when it is given to an
executor, as decima-sim's `spark_env/node.py::Node.schedule` draws it from the TPC-H measurements
(`hsched.traces.decima.WaveDurations.sample`): the executors the job holds at that moment, this one included,
pick a measured executor key (decima-sim's `sample_executor_key`: ≤ 5 → 5, between data points a random one of
the two neighbours), so a stage spread over more executors draws from the runs measured with more executors
(the median first-wave task is 2.0× longer at key 100 than at key 5); then the kind of start picks the list —
an executor that just moved to the job (it pays the moving delay) → the fresh durations; one taking the next
task of the stage it just ran → the rest wave (median 0.3× the first wave: warm JVM, data in cache); one
coming from another stage of the same job → the first wave. Differences from decima-sim, both to keep one
event per task: decima-sim counts a moving executor in the job only once it arrived and keeps an idle one
counted until it moves away; we count the executors running the job's tasks (moving ones included). Draws use a
generator seeded from the episode seed, so an episode is reproducible from (seed, actions). "mean": every task
takes the stage's `task_duration_s` (Decima's mean), deterministic. Stages without measurements (hand-made
`make_dag_job` jobs) always take `task_duration_s`. Observations and the baselines see only the means (a
scheduler's estimate), never the drawn durations.
`num_init_jobs` jobs are there at t = 0 and `num_stream_jobs` more arrive as a Poisson process (exponential
inter-arrival times of mean `interarrival_s`); `num_stream_jobs=0` is the batch mode.

Decisions (paper 004 §2.2.2). The clock is event driven: the scheduler is asked whenever an executor is
free and some stage is *schedulable* (runnable with tasks nobody runs yet) — i.e. when a stage runs out of
tasks, a stage finishes and unlocks children, or a job arrives. The action is (stage, executor count k),
`MultiDiscrete([max_jobs·max_stages, executors])` = (job slot · max_stages + stage, k − 1), 1 ≤ k ≤ free
executors (paper 004: "at least one executor, at most the idle ones"). min(k, unassigned tasks) free
executors go to the stage — first those that last served the stage's job (no moving delay), then the
others, lowest index first; the rest stay free and the scheduler is asked again at once ("extra executors
activate the scheduler again"). An executor keeps taking the next task of its stage until the stage has
none left, then it is free. Work-conserving: no action leaves executors idle while work is schedulable.
An action on a stage that is not schedulable or a count above the free executors raises ValueError
(`info["action_mask"]`, `info["count_mask"]` say what is allowed) — the project's schedulers always mask, and
a bug in one must not be hidden. `invalid_action="nearest"` (what `gymnasium.make("hsched/DagScheduling-v0")`
builds, so `check_env` and unmasked agents can step it, as Gymnasium expects of any action in the space) takes
the first schedulable stage instead and clips the count to 1..free executors, with `info["invalid_action"]`
True for that step.

Reward (Decima): −(t_k − t_{k−1}) · J_k summed over the intervals between two decisions, J = jobs in the
system; the episode's return is −Σ_jobs JCT, so maximising it minimises the average JCT.
Terminated when every job has finished; never truncated.

Observation (raw quantities; learned policies scale them, `hsched.rl.ba3c.encode`), a Dict of float32:
- "stages" [max_jobs, max_stages, len(NODE_FEATURES)], "parents" int8 [max_jobs, max_stages, max_stages]
  (parents[j, c, p] = 1: stage p of job slot j is a parent of its stage c),
- "jobs" [max_jobs, len(JOB_FEATURES)], "cluster" [len(CLUSTER_FEATURES)].
A job keeps its slot from arrival to completion; the slot is then free for a later arrival.
`info` also has "jct" (completion times of the jobs finished so far, arrival order) and at the end
`info["episode"]` (average JCT, its critical-path lower bound, makespan, decisions).

Baselines (`POLICIES`, all `DagPolicy`): FIFO, SJF-CP and Tetris* as paper 004 §3.2 and Decima §7.1 define
them, and Random. Exact references per job: `critical_path_bound` (unlimited executors) and the tighter
`capacity_bound` (also the job's work spread over all N executors).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol

import gymnasium
import numpy as np
from gymnasium import spaces

from hsched.domain.dag import paths_to_end
from hsched.traces.decima import (
    FIRST_WAVE,
    FRESH,
    REST_WAVE,
    DagJob,
    critical_path_s,
    load_tpch_dags,
    total_work_s,
)

ENV_ID = "hsched/DagScheduling-v0"
PAPER004_SIZES = ("2g", "5g", "10g", "20g", "50g", "100g")  # paper 004 §3.1: 2, 5, 10, 20, 50, 100 SF
MOVING_DELAY_S = 2.0  # decima-sim's moving_delay (2 000 ms)
# paper 004 §3.1 starts with one job and 15 executors; the inter-arrival time puts a 15-executor cluster
# near 80 % busy with paper 004's job mix (mean work 757 executor-s, bench: `hsched eval dag`)
DEFAULT_EXECUTORS = 15
# paper 004's table 1 is not in the seed text we have; its text names 15 (the initial setting) and 29 ("at 29
# executors and above Tetris* beats A3C"): the counts evaluated (hsched.eval.dag) and trained on (hsched.rl.ba3c)
PAPER004_EXECUTOR_COUNTS = (15, 20, 25, 29, 35)
DEFAULT_INTERARRIVAL_S = 60.0
INVALID_ACTIONS = ("raise", "nearest")  # what step() does with an action outside the masks


def invalid_action_mode(value: str) -> str:
    """`value` if it is one of INVALID_ACTIONS (the masked envs' `invalid_action`), else ValueError."""
    if value not in INVALID_ACTIONS:
        raise ValueError(f"invalid_action must be one of {', '.join(INVALID_ACTIONS)}, got {value!r}")
    return value

DURATION_MODELS = ("waves", "mean")

NODE_FEATURES = ("present", "schedulable", "finished", "unassigned_tasks", "task_duration_s",
                 "remaining_work_s", "running_executors", "critical_path_s")
JOB_FEATURES = ("present", "remaining_work_s", "executors", "local_free_executors", "age_s",
                "critical_path_s", "arrival_index")
CLUSTER_FEATURES = ("free_executors", "executors", "jobs_in_system", "time_s")
NF = {name: i for i, name in enumerate(NODE_FEATURES)}
JF = {name: i for i, name in enumerate(JOB_FEATURES)}
CF = {name: i for i, name in enumerate(CLUSTER_FEATURES)}


@lru_cache(maxsize=4096)
def _static(job: DagJob) -> tuple[tuple[float, ...], np.ndarray]:
    """Per stage the critical path from it to the end (its task duration + the longest child path), and the
    [n, n] parent matrix (row = child)."""
    n = len(job.stages)
    below = paths_to_end([s.task_duration_s for s in job.stages], [s.parents for s in job.stages], job.name)
    parents = np.zeros((n, n), dtype=np.int8)
    for p, c in job.edges:
        parents[c, p] = 1
    return tuple(below), parents


def critical_path_bound(job: DagJob, moving_delay_s: float = MOVING_DELAY_S, durations: str = "waves") -> float:
    """A lower bound on the job's JCT in this env under any policy: its critical path (unlimited executors,
    one wave per stage; each stage weighted by the shortest task it can draw under `durations`) plus the
    moving delay its first executor pays (no executor has served a new job)."""
    return critical_path_s(job, shortest=durations == "waves") + moving_delay_s


def capacity_bound(job: DagJob, executors: int, moving_delay_s: float = MOVING_DELAY_S,
                   durations: str = "waves") -> float:
    """A tighter exact lower bound: moving delay + max(critical path, the job's work / N). Every executor
    pays the moving delay before its first task of a new job, so all the job's work (each task at least
    its stage's shortest draw) happens on at most N executors after arrival + the delay."""
    shortest = durations == "waves"
    return moving_delay_s + max(critical_path_s(job, shortest=shortest),
                                total_work_s(job, shortest=shortest) / executors)


class _Job:
    """A job in the system: per-stage counters as Python lists (the event loop touches one at a time)."""

    __slots__ = ("arrival", "below", "children", "dag", "done", "duration", "executors", "finish", "index",
                 "left_parents", "num_tasks", "running", "slot", "stages_left", "unassigned", "waves", "work_left")

    def __init__(self, index: int, dag: DagJob, arrival: float, slot: int) -> None:
        self.index, self.dag, self.arrival, self.slot = index, dag, arrival, slot
        self.num_tasks = [s.num_tasks for s in dag.stages]
        self.duration = [s.task_duration_s for s in dag.stages]  # the mean: what schedulers see
        self.waves = [s.waves for s in dag.stages]
        self.children = [s.children for s in dag.stages]
        self.left_parents = [len(s.parents) for s in dag.stages]
        self.unassigned = list(self.num_tasks)
        self.running = [0] * len(dag.stages)
        self.done = [0] * len(dag.stages)
        self.below = _static(dag)[0]
        self.stages_left = len(dag.stages)
        self.work_left = total_work_s(dag)
        self.executors = 0
        self.finish: float | None = None

    def schedulable(self, s: int) -> bool:
        return self.left_parents[s] == 0 and self.unassigned[s] > 0


@dataclass(frozen=True)
class TaskRun:
    """One task execution (recorded with `record=True`): what the invariant tests check."""

    job: int
    stage: int
    executor: int
    assigned: float  # when the executor was given the task (start − any moving delay)
    start: float
    end: float


class DagSchedulingEnv(gymnasium.Env[dict[str, np.ndarray], np.ndarray]):
    """Decima-style Spark DAG scheduling; see the module docstring.

    Args:
        executors: executor count N.
        num_init_jobs, num_stream_jobs: jobs at t = 0 and jobs arriving later (0: batch mode).
        interarrival_s: mean of the exponential inter-arrival times.
        moving_delay_s: delay an executor pays before its first task for a job it did not serve last.
        jobs: the pool jobs are drawn from (default: TPC-H at paper 004's sizes).
        fixed_jobs: the same job list every episode (in arrival order; num_init_jobs of them at t = 0).
        max_jobs: job slots in the observation (default: every job of the episode).
        durations: "waves" (drawn per task as decima-sim does) or "mean" (Decima's mean, deterministic).
        record: keep every task execution in `self.runs` (tests).
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}  # noqa: RUF012

    def __init__(self, executors: int = DEFAULT_EXECUTORS, *, num_init_jobs: int = 1, num_stream_jobs: int = 20,
                 interarrival_s: float = DEFAULT_INTERARRIVAL_S, moving_delay_s: float = MOVING_DELAY_S,
                 jobs: Sequence[DagJob] | None = None, fixed_jobs: Sequence[DagJob] | None = None,
                 max_jobs: int | None = None, durations: str = "waves", record: bool = False,
                 render_mode: str | None = None, invalid_action: str = "raise") -> None:
        self.invalid_action = invalid_action_mode(invalid_action)
        if isinstance(executors, bool) or not isinstance(executors, int | np.integer) or executors < 1:
            raise ValueError(f"executors must be an integer >= 1, got {executors!r}")
        if fixed_jobs is not None:
            fixed_jobs = list(fixed_jobs)
            if not fixed_jobs:
                raise ValueError("fixed_jobs: the list is empty")
            num_init_jobs = min(num_init_jobs, len(fixed_jobs))
            num_stream_jobs = len(fixed_jobs) - num_init_jobs
        if num_init_jobs < 0 or num_stream_jobs < 0 or num_init_jobs + num_stream_jobs < 1:
            raise ValueError(f"num_init_jobs and num_stream_jobs must be >= 0 with at least one job, got "
                             f"{num_init_jobs} and {num_stream_jobs}")
        if num_stream_jobs and not interarrival_s > 0:
            raise ValueError(f"interarrival_s must be > 0, got {interarrival_s}")
        if not moving_delay_s >= 0:
            raise ValueError(f"moving_delay_s must be >= 0, got {moving_delay_s}")
        if durations not in DURATION_MODELS:
            raise ValueError(f"durations must be one of {', '.join(DURATION_MODELS)}, got {durations!r}")
        self.durations = durations
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self.num_executors = int(executors)
        self.num_init_jobs, self.num_stream_jobs = num_init_jobs, num_stream_jobs
        self.interarrival_s, self.moving_delay_s = float(interarrival_s), float(moving_delay_s)
        self.fixed_jobs = fixed_jobs
        self._pool = tuple(jobs) if jobs is not None else None
        if self._pool is not None and not self._pool:
            raise ValueError("jobs: the pool is empty")
        total = num_init_jobs + num_stream_jobs
        self.max_jobs = total if max_jobs is None else int(max_jobs)
        if self.max_jobs < 1:
            raise ValueError(f"max_jobs must be >= 1, got {max_jobs}")
        self.max_stages = max(len(j.stages) for j in (fixed_jobs or self.pool))
        for j in fixed_jobs or self.pool:
            if any(s.num_tasks < 1 or not s.task_duration_s >= 0 for s in j.stages):
                raise ValueError(f"jobs: {j.name} has a stage without tasks or with a negative duration")
        self.record, self.render_mode = record, render_mode
        J, S, N = self.max_jobs, self.max_stages, self.num_executors
        self.observation_space = spaces.Dict({
            "stages": spaces.Box(0.0, np.inf, shape=(J, S, len(NODE_FEATURES)), dtype=np.float32),
            "parents": spaces.Box(0, 1, shape=(J, S, S), dtype=np.int8),
            "jobs": spaces.Box(0.0, np.inf, shape=(J, len(JOB_FEATURES)), dtype=np.float32),
            "cluster": spaces.Box(0.0, np.inf, shape=(len(CLUSTER_FEATURES),), dtype=np.float32),
        })
        self.action_space = spaces.MultiDiscrete([J * S, N])
        self._stages = np.zeros((J, S, len(NODE_FEATURES)), dtype=np.float32)
        self._parents = np.zeros((J, S, S), dtype=np.int8)
        self._jobs_obs = np.zeros((J, len(JOB_FEATURES)), dtype=np.float32)
        self.jobs: list[_Job] = []
        self._duration_seed = 0
        self._reset_state([], [])

    @property
    def pool(self) -> tuple[DagJob, ...]:
        if self._pool is None:
            self._pool = tuple(load_tpch_dags(sizes=PAPER004_SIZES))
        return self._pool

    # -- episode ------------------------------------------------------------------------------------------

    def _reset_state(self, dags: list[DagJob], arrivals: list[float]) -> None:
        self.now = 0.0
        self.dags, self.arrivals = dags, arrivals
        self.jobs = []                                 # every job that has arrived, by arrival index
        self.active: dict[int, _Job] = {}              # slot → job in the system
        self._free_slots = list(range(self.max_jobs))
        heapq.heapify(self._free_slots)
        self.free: list[int] = list(range(self.num_executors))  # free executors (kept sorted)
        self.last_job: list[int] = [-1] * self.num_executors    # job an executor served last
        self.busy_on: list[tuple[int, int] | None] = [None] * self.num_executors
        self._events: list[tuple[float, int, int, int]] = []    # (time, seq, kind, payload)
        self._seq = 0
        self._waiting: list[int] = []                  # arrived while every job slot was taken (FIFO)
        self._schedulable = 0                          # schedulable stages over all jobs in the system
        self.runs: list[TaskRun] = []
        self._draws = np.random.default_rng(self._duration_seed)
        self.decisions = 0
        self.jct: list[float] = [float("nan")] * len(dags)
        self.finished = 0
        self._stages.fill(0)
        self._parents.fill(0)
        self._jobs_obs.fill(0)
        for k, t in enumerate(arrivals):
            self._push(t, _ARRIVAL, k)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        super().reset(seed=seed)
        rng = self.np_random
        if self.fixed_jobs is not None:
            dags = list(self.fixed_jobs)
        else:
            pool = self.pool
            dags = [pool[i] for i in rng.integers(len(pool), size=self.num_init_jobs + self.num_stream_jobs)]
        gaps = rng.exponential(self.interarrival_s, size=self.num_stream_jobs) if self.num_stream_jobs else []
        arrivals = [0.0] * self.num_init_jobs + np.cumsum(gaps).tolist()
        # task durations from their own stream: the jobs and arrivals of a seed do not depend on the draws
        self._duration_seed = int(rng.integers(2**63))
        self._reset_state(dags, arrivals)
        self._advance()
        return self._obs(), self._info()

    def step(self, action: Sequence[int] | np.ndarray) -> tuple[dict[str, np.ndarray], float, bool, bool,
                                                                  dict[str, Any]]:
        if not self._decision_pending():
            raise RuntimeError("step() without a pending decision: the episode ended, call reset()")
        slot_stage, count = int(action[0]), int(action[1]) + 1
        S = self.max_stages
        slot, s = divmod(slot_stage, S)
        job = self.active.get(slot)
        invalid = False
        if job is None or s >= len(job.dag.stages) or not job.schedulable(s):
            if self.invalid_action == "raise":
                raise ValueError(f"action: stage {slot_stage} (job slot {slot}, stage {s}) is not schedulable; "
                                 "use info['action_mask']")
            slot, s = divmod(int(np.flatnonzero(self._info()["action_mask"])[0]), S)
            job, invalid = self.active[slot], True
        if not 1 <= count <= len(self.free):
            if self.invalid_action == "raise":
                raise ValueError(f"action: executor count {count} outside 1..{len(self.free)} (the free "
                                 "executors); use info['count_mask']")
            count, invalid = min(max(count, 1), len(self.free)), True
        self.decisions += 1
        self._assign(job, s, count)
        penalty = self._advance()
        terminated = self.finished == len(self.dags)
        info = self._info()
        info["invalid_action"] = invalid
        if terminated:
            info["episode"] = self.episode_metrics()
        return self._obs(), -penalty, terminated, False, info

    def episode_metrics(self) -> dict[str, float]:
        done = [t for t in self.jct if t == t]
        bounds = [critical_path_bound(d, self.moving_delay_s, self.durations) for d in self.dags]
        tight = [capacity_bound(d, self.num_executors, self.moving_delay_s, self.durations) for d in self.dags]
        return {"jobs": float(len(self.dags)), "finished": float(len(done)),
                "avg_jct_s": float(np.mean(done)) if done else float("nan"),
                "avg_jct_bound_s": float(np.mean(bounds)) if bounds else float("nan"),
                "avg_jct_capacity_bound_s": float(np.mean(tight)) if tight else float("nan"),
                "makespan_s": self.now, "decisions": float(self.decisions)}

    # -- simulation ---------------------------------------------------------------------------------------

    def _push(self, t: float, kind: int, payload: int) -> None:
        heapq.heappush(self._events, (t, self._seq, kind, payload))
        self._seq += 1

    def _decision_pending(self) -> bool:
        return bool(self.free) and self._schedulable > 0

    def _task_duration(self, job: _Job, s: int, kind: str) -> float:
        waves = job.waves[s]
        if self.durations == "mean" or waves is None:
            return job.duration[s]
        return waves.sample(kind, job.executors, self._draws)

    def _start(self, e: int, job: _Job, s: int, delay: float, kind: str) -> None:
        job.unassigned[s] -= 1
        job.running[s] += 1
        if job.unassigned[s] == 0:
            self._schedulable -= 1
        start = self.now + delay
        end = start + self._task_duration(job, s, kind)
        self.busy_on[e] = (job.slot, s)
        self._push(end, _TASK_DONE, e)
        if self.record:
            self.runs.append(TaskRun(job.index, s, e, self.now, start, end))

    def _assign(self, job: _Job, s: int, count: int) -> None:
        n = min(count, job.unassigned[s])
        local = [e for e in self.free if self.last_job[e] == job.index]
        others = [e for e in self.free if self.last_job[e] != job.index]
        chosen = (local + others)[:n]
        taken = set(chosen)
        self.free = [e for e in self.free if e not in taken]
        job.executors += len(chosen)  # the durations see every executor the job now holds
        for e in chosen:
            moved = self.last_job[e] != job.index
            self.last_job[e] = job.index
            self._start(e, job, s, self.moving_delay_s if moved else 0.0, FRESH if moved else FIRST_WAVE)

    def _arrive(self, k: int) -> None:
        slot = heapq.heappop(self._free_slots)
        job = _Job(k, self.dags[k], self.arrivals[k], slot)
        self.jobs.append(job)
        self.active[slot] = job
        self._schedulable += sum(1 for left in job.left_parents if left == 0)
        n = len(job.num_tasks)
        self._parents[slot, :n, :n] = _static(job.dag)[1]

    def _task_done(self, e: int) -> None:
        slot, s = self.busy_on[e]  # type: ignore[misc]
        job = self.active[slot]
        job.running[s] -= 1
        job.done[s] += 1
        job.work_left -= job.duration[s]
        if job.unassigned[s] > 0:  # the executor takes the stage's next task, no delay
            self._start(e, job, s, 0.0, REST_WAVE)
        else:
            self.busy_on[e] = None
            job.executors -= 1
            self.free.append(e)
            self.free.sort()
        if job.done[s] == job.num_tasks[s]:
            job.stages_left -= 1
            for c in job.children[s]:
                job.left_parents[c] -= 1
                if job.left_parents[c] == 0:
                    self._schedulable += 1
            if job.stages_left == 0:
                job.finish = self.now
                self.jct[job.index] = self.now - job.arrival
                self.finished += 1
                del self.active[slot]
                heapq.heappush(self._free_slots, slot)
                self._stages[slot].fill(0)
                self._parents[slot].fill(0)
                self._jobs_obs[slot].fill(0)
                if self._waiting:
                    self._arrive(self._waiting.pop(0))

    def _advance(self) -> float:
        """Run events until a decision is pending or nothing is left; return ∫ jobs-in-system dt."""
        penalty = 0.0
        while not self._decision_pending() and self._events:
            t = self._events[0][0]
            penalty += (t - self.now) * (len(self.active) + len(self._waiting))
            self.now = t
            while self._events and self._events[0][0] == t:
                _, _, kind, payload = heapq.heappop(self._events)
                if kind == _ARRIVAL:
                    if self._free_slots:
                        self._arrive(payload)
                    else:
                        self._waiting.append(payload)
                else:
                    self._task_done(payload)
        return penalty

    # -- observation --------------------------------------------------------------------------------------

    def _obs(self) -> dict[str, np.ndarray]:
        st, jb = self._stages, self._jobs_obs
        local = [0] * len(self.dags)
        for e in self.free:
            if self.last_job[e] >= 0:
                local[self.last_job[e]] += 1
        for slot, job in self.active.items():
            n = len(job.num_tasks)
            rows = st[slot, :n]
            unassigned = np.asarray(job.unassigned, dtype=np.float32)
            running = np.asarray(job.running, dtype=np.float32)
            done = np.asarray(job.done, dtype=np.float32)
            num = np.asarray(job.num_tasks, dtype=np.float32)
            dur = np.asarray(job.duration, dtype=np.float32)
            finished = done == num
            rows[:, NF["present"]] = 1.0
            rows[:, NF["schedulable"]] = (np.asarray(job.left_parents) == 0) & (unassigned > 0)
            rows[:, NF["finished"]] = finished
            rows[:, NF["unassigned_tasks"]] = unassigned
            rows[:, NF["task_duration_s"]] = dur
            rows[:, NF["remaining_work_s"]] = (num - done) * dur
            rows[:, NF["running_executors"]] = running
            rows[:, NF["critical_path_s"]] = np.where(finished, 0.0, np.asarray(job.below, dtype=np.float32))
            jb[slot] = (1.0, max(job.work_left, 0.0), job.executors, local[job.index], self.now - job.arrival,
                        rows[:, NF["critical_path_s"]].max(), job.index)
        cluster = np.array([len(self.free), self.num_executors, len(self.active), self.now], dtype=np.float32)
        return {"stages": st.copy(), "parents": self._parents.copy(), "jobs": jb.copy(), "cluster": cluster}

    def _info(self) -> dict[str, Any]:
        mask = np.zeros(self.max_jobs * self.max_stages, dtype=bool)
        for slot, job in self.active.items():
            for s in range(len(job.num_tasks)):
                if job.schedulable(s):
                    mask[slot * self.max_stages + s] = True
        counts = np.zeros(self.num_executors, dtype=bool)
        counts[:len(self.free)] = True
        return {"action_mask": mask, "count_mask": counts, "time_s": self.now,
                "jct": [t for t in self.jct if t == t]}

    def render(self) -> str | None:
        if self.render_mode != "ansi":
            return None
        lines = [f"t={self.now:.1f}s free executors {len(self.free)}/{self.num_executors}, "
                 f"jobs in system {len(self.active)}, finished {self.finished}/{len(self.dags)}"]
        for slot, job in sorted(self.active.items()):
            lines.append(f"  slot {slot}: {job.dag.name} executors {job.executors} work left {job.work_left:.0f}s")
        return "\n".join(lines)


_ARRIVAL, _TASK_DONE = 0, 1


# ------------------------------------------------------------------------------------------------------------
# policies over the observation: the baselines and the serving interface of learned ones


class DagPolicy(Protocol):
    """A DAG scheduler: given an observation and the schedulable-stage mask, a (stage, executor count).

    The stage index is the env's flat one (job slot · max_stages + stage) and must be True in `mask`; the
    count is 1..free executors (`observation["cluster"][CF["free_executors"]]`)."""

    name: str

    def choose(self, observation: dict[str, np.ndarray], mask: np.ndarray) -> tuple[int, int]: ...


def _free(obs: dict[str, np.ndarray]) -> int:
    return int(obs["cluster"][CF["free_executors"]])


def _candidates(obs: dict[str, np.ndarray], mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Schedulable flat indices, their job slots and stage indices."""
    idx = np.flatnonzero(mask)
    if len(idx) == 0:
        raise ValueError("mask: no schedulable stage")
    S = obs["stages"].shape[1]
    return idx, idx // S, idx % S


class Fifo:
    """Spark's default (paper 004 baseline 1): jobs in arrival order; in the first job with a schedulable
    stage, its lowest-index one; each job may hold at most `cap` executors (the user's request, the same for
    every job; default: all of them), the count is what the cap leaves of the free executors."""

    name = "FIFO"

    def __init__(self, cap: int | None = None) -> None:
        self.cap = cap

    def choose(self, obs: dict[str, np.ndarray], mask: np.ndarray) -> tuple[int, int]:
        idx, slots, stages = _candidates(obs, mask)
        jobs = obs["jobs"]
        order = np.lexsort((stages, jobs[slots, JF["arrival_index"]]))
        free = _free(obs)
        for i in order:
            held = int(jobs[slots[i], JF["executors"]])
            room = free if self.cap is None else min(free, self.cap - held)
            if room >= 1:
                return int(idx[i]), room
        return int(idx[order[0]]), free  # every job at its cap: stay work-conserving


class SjfCp:
    """Shortest job first, critical path within the job (paper 004 baseline 2, Decima §7.1): the job with
    the least remaining work; in it, the schedulable stage with the longest critical path to the job's end;
    all free executors (those the stage cannot use come straight back to the scheduler)."""

    name = "SJF-CP"

    def choose(self, obs: dict[str, np.ndarray], mask: np.ndarray) -> tuple[int, int]:
        idx, slots, stages = _candidates(obs, mask)
        work = obs["jobs"][slots, JF["remaining_work_s"]]
        cp = obs["stages"][slots, stages, NF["critical_path_s"]]
        arrival = obs["jobs"][slots, JF["arrival_index"]]
        i = np.lexsort((stages, arrival, -cp, work))[0]
        return int(idx[i]), _free(obs)


class TetrisStar:
    """Tetris* (paper 004 baseline 3; Decima §7.1 after Grandl et al. SIGCOMM'14): a stage's score is its
    packing alignment — the share of the free executors its unassigned tasks fill, the dot product of demand
    and free capacity for one-resource executors — plus ε × a shortest-remaining-work preference (least
    remaining job work / the job's remaining work), with Tetris's ε = mean alignment / mean preference over
    the candidates, so the two terms weigh the same. The best stage gets the executors it can fill."""

    name = "Tetris*"

    def choose(self, obs: dict[str, np.ndarray], mask: np.ndarray) -> tuple[int, int]:
        idx, slots, stages = _candidates(obs, mask)
        free = _free(obs)
        unassigned = obs["stages"][slots, stages, NF["unassigned_tasks"]]
        score = self.score(obs, slots, unassigned, free)
        # ties (a job's stages share its shortness) go to the earliest job, then the lowest stage id: worth 7-11 %
        # of average JCT on TPC-H DAGs, whose stage ids are a topological order (docs/dag_scheduling.md)
        i = np.lexsort((stages, obs["jobs"][slots, JF["arrival_index"]], -score))[0]
        return int(idx[i]), self.count(obs, int(slots[i]), int(min(free, unassigned[i])))

    def score(self, obs: dict[str, np.ndarray], slots: np.ndarray, unassigned: np.ndarray, free: int) -> np.ndarray:
        alignment, shortness = self.terms(obs, slots, unassigned, free)
        return alignment + shortness

    def count(self, obs: dict[str, np.ndarray], slot: int, fill: int) -> int:
        """Executors for the chosen stage of job `slot`, given the `fill` = min(free, its unassigned tasks)."""
        return fill

    @staticmethod
    def terms(obs: dict[str, np.ndarray], slots: np.ndarray, unassigned: np.ndarray,
              free: int) -> tuple[np.ndarray, np.ndarray]:
        """Per candidate stage (its job slot, its unassigned tasks) the packing alignment and ε × the
        shortest-remaining-work preference: the two terms of the score."""
        alignment = np.minimum(unassigned, free) / free
        work = np.maximum(obs["jobs"][slots, JF["remaining_work_s"]], 1e-9)
        shortness = work.min() / work
        return alignment, alignment.mean() / shortness.mean() * shortness


class TetrisLimited(TetrisStar):
    """Tetris* plus a per-job executor limit and executor locality (bench/dag_teachers.py measured them):
    a job holds at most `limit` × N executors (Decima's lesson that spreading a stage wider draws slower
    waves), and stages whose job has free executors that already served it (no moving delay) score
    +`locality`. `limit` None: no limit. 0.991 / 0.995 × Tetris*'s average JCT at 15 / 20 executors on 20
    fresh seeds (`bench/dag_teachers.py`); a DAgger teacher for BA3C (`hsched.rl.ba3c.Config.expert`)."""

    name = "Tetris*+limit"

    def __init__(self, limit: float | None = 0.4, locality: float = 0.3, eps_scale: float = 1.0) -> None:
        self.limit, self.locality, self.eps_scale = limit, locality, eps_scale

    def score(self, obs: dict[str, np.ndarray], slots: np.ndarray, unassigned: np.ndarray, free: int) -> np.ndarray:
        alignment, shortness = self.terms(obs, slots, unassigned, free)
        return alignment + self.eps_scale * shortness + self.locality * (obs["jobs"][slots, JF["local_free_executors"]] > 0)

    def count(self, obs: dict[str, np.ndarray], slot: int, fill: int) -> int:
        if self.limit is None:
            return fill
        cap = max(1, round(self.limit * obs["cluster"][CF["executors"]]))
        return max(1, min(fill, cap - int(obs["jobs"][slot, JF["executors"]])))


class RandomDag:
    """A uniformly random schedulable stage and count (the floor any policy should beat)."""

    name = "Random"

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)

    def choose(self, obs: dict[str, np.ndarray], mask: np.ndarray) -> tuple[int, int]:
        idx, _, _ = _candidates(obs, mask)
        return int(self.rng.choice(idx)), int(self.rng.integers(1, _free(obs) + 1))


POLICIES: dict[str, type] = {"fifo": Fifo, "sjf-cp": SjfCp, "tetris": TetrisStar, "tetris-limited": TetrisLimited,
                             "random": RandomDag}


@dataclass(frozen=True)
class DagEpisode:
    reward: float
    decisions: int
    metrics: dict[str, float]  # DagSchedulingEnv.episode_metrics()
    jct: list[float]           # per job, arrival order
    bounds: list[float]        # per job, critical_path_bound
    capacity_bounds: list[float]  # per job, capacity_bound (tighter)


def run_dag_policy(env: gymnasium.Env, policy: DagPolicy, *, seed: int | None = None,
                   options: dict[str, Any] | None = None) -> DagEpisode:
    """One episode of `policy`; a stage outside the mask or a count outside 1..free raises (the env's check)."""
    base = env.unwrapped
    if not isinstance(base, DagSchedulingEnv):
        raise TypeError(f"run_dag_policy needs a DagSchedulingEnv, got {type(base).__name__}")
    obs, info = env.reset(seed=seed, options=options)
    total, steps, done = 0.0, 0, base.finished == len(base.dags)
    while not done:
        stage, count = policy.choose(obs, info["action_mask"])
        obs, reward, terminated, truncated, info = env.step(np.array([stage, count - 1]))
        total += reward
        steps += 1
        done = terminated or truncated
    return DagEpisode(total, steps, base.episode_metrics(), list(base.jct),
                      [critical_path_bound(d, base.moving_delay_s, base.durations) for d in base.dags],
                      [capacity_bound(d, base.num_executors, base.moving_delay_s, base.durations)
                       for d in base.dags])


if ENV_ID not in gymnasium.registry:
    gymnasium.register(id=ENV_ID, entry_point="hsched.envs.dag:DagSchedulingEnv")
