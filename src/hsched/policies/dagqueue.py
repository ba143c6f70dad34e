"""A DAG scheduler choosing which DAG job's stage the placer's deferred queue serves next (`--dag-policy`).

Where it acts. The deferred queue's order (hsched.policies.fairshare) picks a lane — class, then the tenant
furthest below its deserved share — and in the lane the highest priority, then arrival. With a DAG policy, when
the lane's next task is an offline task of a DAG job, the tasks of that lane with the same priority (the
"band": same class, tenant and priority, so no class, fair-share or priority guarantee moves) that belong to DAG
jobs are grouped by (job, stage) and the policy picks the stage; its earliest task is served. The mask is the
stages whose next task fits now under the placement policy's masks and the thermal headroom (one `plan` per
stage: a job's stage tasks are identical); the same plan then places it, so the policy never places what the
guard refuses, and it is only asked when at least two stages are in the band.

What the placer knows of a job. The gateway sets on each DAG task (hsched.jobs.stage_queue_hints): job_id,
stage, `stage_path_s` (the stage's critical path to the job's end) and `job_work_s` (the job's work left when
the stage became runnable); they travel in the task spec, so the ledger's defer events keep them across
restarts. The placer adds what it sees: queued tasks per stage, its running tasks per job (task ids are
`<job>.<stage>.<i>`), how long they have waited. That is the DagScheduling-v0 observation
(hsched.envs.dag) restricted to the stages the placer holds: one job slot per job in the band (by first
arrival), one row per queued stage (schedulable = fits now; parents all finished, so no edges), the job's
remaining work and critical path, its running tasks as its executors; the cluster's free executors are the
most tasks of one fitting stage that the DC's free resources hold (`QueuedStage.fit_now`, at most its queued
tasks): the env's free executors are the tasks that could start now, and Tetris*'s packing term and BA3C's
count and cluster inputs read them so. (Counting every fitting queued task instead put Tetris* 12 % and BA3C 16 %
behind SJF-CP on the Alibaba replay; now 0.3 % and 6 %: docs/jobs.md.) Its executors are those plus the DC's
running DAG tasks. Times are task seconds (wall × time factor).

Policies: `fifo` (default) = no reordering: today's order, earliest arrival first within the band (the env's
FIFO over job arrival); `sjf-cp` = hsched.envs.dag.SjfCp (least remaining job work, then the longest critical
path stage); `tetris` = hsched.envs.dag.TetrisStar (packing alignment + shortest remaining work; ties to the
earliest job, then the job's earliest-queued stage), the strongest heuristic on the DAG env (its limited variant
would order a band the same: the limit only shapes a count the queue does not use, and a band shows no executor
locality); `ba3c` = the shipped action-branching A3C (hsched.rl.ba3c.load_dag_policy), one torch thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from hsched.domain.errors import ValidationError
from hsched.envs.dag import CF, CLUSTER_FEATURES, JF, JOB_FEATURES, NF, NODE_FEATURES, POLICIES, DagPolicy

HEURISTICS = ("sjf-cp", "tetris")  # hsched.envs.dag.POLICIES by these names
DAG_POLICIES = ("fifo", *HEURISTICS, "ba3c")
BA3C_MODEL = "ba3c_dag"  # models/ba3c_dag.pt
MAX_BAND_STAGES = 32  # stages offered to one decision (the earliest-arriving ones): bounds the serving cost


def load_dag_queue_policy(name: str, model: str = BA3C_MODEL) -> DagPolicy | None:
    """The DagPolicy for `--dag-policy NAME` (None for fifo: the queue's own order); ValidationError otherwise."""
    if name == "fifo":
        return None
    if name in HEURISTICS:
        return POLICIES[name]()
    if name == "ba3c":
        from hsched.rl.ba3c import load_dag_policy
        from hsched.rl.checkpoint import serve_on_one_thread

        serve_on_one_thread()
        return load_dag_policy(model)
    raise ValidationError("--dag-policy", f"must be one of {', '.join(DAG_POLICIES)}", name)


@dataclass(frozen=True)
class QueuedStage:
    """The queued tasks of one stage of one DAG job in the band."""

    job_id: str
    stage: str
    queued: int            # its tasks waiting in the band
    runtime_s: float       # one task's runtime (task seconds)
    stage_path_s: float    # critical path from the stage to the job's end
    job_work_s: float      # the job's work left (the gateway's hint)
    first_arrival: int     # queue position of its earliest task (lower = earlier)
    waited_s: float        # how long its earliest task has waited (task seconds)
    fits: bool             # its next task can be placed now (the mask)
    fit_now: int           # how many of its tasks the free resources hold (ClusterState.copies_within; 0 if not fits)


def dag_observation(stages: Sequence[QueuedStage], running: Mapping[str, int], dc_running: int
                    ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The DagScheduling-v0 observation and stage mask of a band (module docstring). Flat index of stage k of
    job slot j = j · max_stages + k, jobs in order of first arrival, stages in `stages` order within a job.
    `running`: running tasks per job id; `dc_running`: all running DAG tasks of the DC."""
    jobs: dict[str, list[QueuedStage]] = {}
    for s in sorted(stages, key=lambda s: s.first_arrival):
        jobs.setdefault(s.job_id, []).append(s)
    J, S = max(len(jobs), 1), max((len(v) for v in jobs.values()), default=1)
    st = np.zeros((J, S, len(NODE_FEATURES)), dtype=np.float32)
    jb = np.zeros((J, len(JOB_FEATURES)), dtype=np.float32)
    mask = np.zeros(J * S, dtype=bool)
    free = 0
    for j, (job_id, rows) in enumerate(jobs.items()):
        for k, s in enumerate(rows):
            st[j, k, NF["present"]] = 1.0
            st[j, k, NF["schedulable"]] = float(s.fits)
            st[j, k, NF["unassigned_tasks"]] = s.queued
            st[j, k, NF["task_duration_s"]] = s.runtime_s
            st[j, k, NF["remaining_work_s"]] = s.queued * s.runtime_s
            st[j, k, NF["critical_path_s"]] = s.stage_path_s
            mask[j * S + k] = s.fits
            free = max(free, min(s.fit_now, s.queued) if s.fits else 0)
        jb[j, JF["present"]] = 1.0
        jb[j, JF["remaining_work_s"]] = min(s.job_work_s for s in rows) or sum(s.queued * s.runtime_s for s in rows)
        jb[j, JF["executors"]] = running.get(job_id, 0)
        jb[j, JF["age_s"]] = max(s.waited_s for s in rows)
        jb[j, JF["critical_path_s"]] = max(s.stage_path_s for s in rows)
        jb[j, JF["arrival_index"]] = j
    cluster = np.zeros(len(CLUSTER_FEATURES), dtype=np.float32)
    cluster[CF["free_executors"]] = max(free, 1)
    cluster[CF["executors"]] = max(free, 1) + dc_running
    cluster[CF["jobs_in_system"]] = len(jobs)
    cluster[CF["time_s"]] = float(jb[:, JF["age_s"]].max(initial=0.0))
    parents = np.zeros((J, S, S), dtype=np.int8)
    return {"stages": st, "parents": parents, "jobs": jb, "cluster": cluster}, mask


def choose_stage(policy: DagPolicy, stages: Sequence[QueuedStage], running: Mapping[str, int], dc_running: int
                 ) -> QueuedStage | None:
    """The stage `policy` serves next among the fitting `stages` (None if none fits). A choice outside the mask
    (a policy bug) falls back to the earliest fitting stage: the mask is the guarantee, not the policy."""
    ordered = sorted(stages, key=lambda s: s.first_arrival)
    fitting = [s for s in ordered if s.fits]
    if not fitting:
        return None
    obs, mask = dag_observation(ordered, running, dc_running)
    flat, _ = policy.choose(obs, mask)
    S = obs["stages"].shape[1]
    if not (0 <= flat < mask.size and mask[flat]):
        return fitting[0]
    jobs = list(dict.fromkeys(s.job_id for s in ordered))
    rows = [s for s in ordered if s.job_id == jobs[flat // S]]
    return rows[flat % S]


def job_of_task(task_id: str) -> tuple[str, str] | None:
    """(job id, stage) of a DAG task id `<job_id>.<stage>.<i>` (hsched.jobs.task_id_of), else None."""
    parts = task_id.rsplit(".", 2)
    return (parts[0], parts[1]) if len(parts) == 3 and parts[2].isdigit() else None
