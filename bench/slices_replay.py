"""Utilisation and fragmentation with and without slice types (hsched.engine.slices) on a replay of Alibaba 2018
batch DAG jobs through the placer's own planner.

The jobs are the stack replay's (hsched.job_replay.alibaba_jobs: the same conversion to cpu_milli / MiB, stages of
at most `--max-tasks` tasks, Poisson arrivals of mean gap `--interval-s`) drawn from the jobs the slice types were
fitted on (≤ 200 instances, ≥ 2 tasks). A discrete-event replay (trace seconds, no overheads) places each runnable
task with `hsched.policies.placement.plan` — the placer's planner, masks and policy (`--policy`, default the
placer's bestfit) — on a DC of `--nodes` nodes, over a plain ClusterState (no slices) or a SlicedState cut into the
types of `hsched slices fit` (Q = auto, Q = 6, and Q = 1: paper 001's uniform type, the baseline its slices are
compared with). Waiting tasks are tried in arrival order after every event (at most 64 tries, as a placer's drain);
a task runs its runtime, then frees what it held.

Per configuration (time averages over the makespan): **used** = what the running tasks ask / DC capacity (CPU,
memory); **held** = what their allocations hold (with slices: whole slices); **slack** = held − used (the
fragmentation inside slices paper 001 accepts); **stranded** = CPU left free while tasks wait (no waiting task
fits it: with slices, mostly free slices of types the waiting tasks do not need); average JCT, makespan, and tasks
no slice type fits.

    python bench/slices_replay.py [--jobs 200] [--nodes 4] [--node-cores 24] [--node-memory-gib 96]
                                  [--interval-s 2] [--max-tasks 16] [--seed 0] [--policy bestfit]

About 1.5 min on the shared 2-core machine (fitting the three catalogs takes ~20 CPU-s of it).
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import heapq
import itertools
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

MAX_TRIES = 64  # per event, as the placer's drain (MAX_QUEUE_TRIES_PER_RELEASE)


@dataclass
class Figures:
    name: str
    used_cpu: float
    used_mem: float
    held_cpu: float
    held_mem: float
    stranded_cpu: float
    avg_jct_s: float
    makespan_s: float
    unschedulable: int
    jobs_done: int


def datacenter(nodes: int, cores: int, memory_gib: int):
    from hsched.domain.fleet import parse_fleet

    return parse_fleet({
        "version": 1, "name": "bench", "network_price_per_gb_ms": 0.01,
        "wan": {"vertices": [{"name": "s", "lat": 0.0, "lon": 0.0}, {"name": "a", "lat": 0.0, "lon": 1.0}],
                "links": [{"a": "s", "b": "a", "distance_km": 10}], "scheduler_vertex": "s"},
        "datacenters": [{"name": "dc", "vertex": "a", "prices": {"cpu_core_hour": 0.04, "memory_gib_hour": 0.005},
                         "layout": {"racks": 1, "servers_per_rack": nodes, "rows": 1},
                         "node_pools": [{"name": "n", "count": nodes, "cpu_cores": cores, "memory_gib": memory_gib,
                                         "disk_gib": 500}]}],
    }).datacenter("dc")


def replay(name: str, jobs, dc, catalog, policy_name: str, seed: int) -> Figures:
    from hsched.domain.cluster import ClusterState
    from hsched.domain.resources import Resources
    from hsched.domain.task import TaskSpec
    from hsched.engine.slices import SlicedState
    from hsched.policies.heuristics import make_policy
    from hsched.policies.placement import Outcome, plan

    state = ClusterState(dc) if catalog is None else SlicedState(dc, catalog)
    policy = make_policy(policy_name, seed, dc)
    cap = np.array([state.table.cpu_milli.sum(), state.table.memory_mib.sum()], dtype=np.float64)
    seq = itertools.count()
    events: list[tuple[float, int, str, object]] = [(j.arrival_s, next(seq), "arrive", i) for i, j in enumerate(jobs)]
    heapq.heapify(events)
    waiting: deque[tuple[str, TaskSpec, tuple[int, int]]] = deque()
    stage_left: dict[tuple[int, int], int] = {}
    parents_left: dict[tuple[int, int], int] = {}
    children: dict[tuple[int, int], list[int]] = {}
    stages_left: dict[int, int] = {}
    finished: dict[int, float] = {}
    running: dict[str, tuple[int, int]] = {}  # task -> (job, stage)
    demand_of: dict[str, np.ndarray] = {}
    used = np.zeros(2)
    unschedulable = 0
    area_used, area_held, area_stranded = np.zeros(2), np.zeros(2), 0.0
    now = 0.0

    def release_stage(j: int, s: int) -> None:
        st = jobs[j].spec.stages[s]
        r = Resources(st.resources.cpu_milli, st.resources.memory_mib)
        for t in range(st.tasks):
            waiting.append((f"j{j}s{s}t{t}", TaskSpec(r, runtime_s=st.runtime_s), (j, s)))

    def stage_done(j: int, s: int) -> None:
        stages_left[j] -= 1
        if stages_left[j] == 0:
            finished[j] = now
        for c in children[(j, s)]:
            parents_left[(j, c)] -= 1
            if parents_left[(j, c)] == 0:
                release_stage(j, c)

    while events:
        t_next = events[0][0]
        held = cap - np.array([state.free_cpu.sum(), state.free_memory.sum()], dtype=np.float64)
        area_used += used * (t_next - now)
        area_held += held * (t_next - now)
        if waiting:  # free CPU the head of the queue cannot use
            area_stranded += float(state.free_cpu.sum()) * (t_next - now)
        now = t_next
        while events and events[0][0] == now:
            _, _, kind, payload = heapq.heappop(events)
            if kind == "arrive":
                j = payload
                spec = jobs[j].spec
                index = {s.name: k for k, s in enumerate(spec.stages)}
                stages_left[j] = len(spec.stages)
                for k, s in enumerate(spec.stages):
                    stage_left[(j, k)] = s.tasks
                    parents_left[(j, k)] = len(s.parents)
                    children.setdefault((j, k), [])
                    for p in s.parents:
                        children.setdefault((j, index[p]), []).append(k)
                for k, s in enumerate(spec.stages):
                    if not s.parents:
                        release_stage(j, k)
            else:
                task_id = payload
                j, s = running.pop(task_id)
                state.release(task_id)
                used -= demand_of.pop(task_id)
                stage_left[(j, s)] -= 1
                if stage_left[(j, s)] == 0:
                    stage_done(j, s)
        tries, kept = 0, deque()
        while waiting and tries < MAX_TRIES:
            task_id, spec, (j, s) = waiting.popleft()
            tries += 1
            decision = plan(state, spec, policy)
            if decision.outcome is Outcome.PLACED:
                state.apply(task_id, decision.parts)
                running[task_id] = (j, s)
                demand_of[task_id] = np.array([spec.resources.cpu_milli, spec.resources.memory_mib], dtype=np.float64)
                used += demand_of[task_id]
                heapq.heappush(events, (now + spec.runtime_s, next(seq), "finish", task_id))
            elif decision.outcome is Outcome.UNSCHEDULABLE:  # dropped: counted, its stage counts it done
                unschedulable += 1
                stage_left[(j, s)] -= 1
                if stage_left[(j, s)] == 0:
                    stage_done(j, s)
            else:
                kept.append((task_id, spec, (j, s)))
        waiting.extendleft(reversed(kept))
    span = now
    jct = [finished[j] - jobs[j].arrival_s for j in finished]
    return Figures(name, *(area_used / cap / span), *(area_held / cap / span), area_stranded / cap[0] / span,
                   float(np.mean(jct)), span, unschedulable, len(finished))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=200)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--node-cores", type=int, default=24)
    p.add_argument("--node-memory-gib", type=int, default=96)
    p.add_argument("--interval-s", type=float, default=2.0, help="mean gap between job arrivals (trace seconds)")
    p.add_argument("--max-tasks", type=int, default=16, help="fold wider stages into this many longer tasks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy", default="bestfit")
    opts = p.parse_args()

    from hsched.engine.slices import fit_catalog
    from hsched.job_replay import alibaba_jobs

    t0 = time.process_time()
    fits = {"auto": fit_catalog(None), "6": fit_catalog(6), "1": fit_catalog(1)}
    print(f"fitted slice types in {time.process_time() - t0:.1f} CPU-s; auto Q = {fits['auto'].curve.chosen_q}",
          file=sys.stderr)
    jobs = alibaba_jobs(limit=opts.jobs, interval_s=opts.interval_s, seed=opts.seed, max_tasks_per_stage=opts.max_tasks,
                        max_instances=200, min_tasks=2)
    dc = datacenter(opts.nodes, opts.node_cores, opts.node_memory_gib)
    configs = [("no slices (exact fit)", None),
               (f"slices, Q = {fits['auto'].curve.chosen_q} (auto, knee)", fits["auto"].catalog),
               ("slices, Q = 6 (paper 001)", fits["6"].catalog),
               ("slices, Q = 1 (uniform: paper 001's baseline)", fits["1"].catalog)]
    tasks = sum(s.tasks for j in jobs for s in j.spec.stages)
    print(f"{len(jobs)} Alibaba 2018 DAG jobs ({tasks} tasks, seed {opts.seed}, arrivals every {opts.interval_s:g} s), "
          f"{opts.nodes} nodes × {opts.node_cores} cores / {opts.node_memory_gib} GiB, policy {opts.policy}\n")
    print("| configuration | used CPU | used memory | held CPU | held memory | slack CPU | slack memory | "
          "stranded CPU | avg JCT (s) | makespan (s) | unschedulable tasks |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, catalog in configs:
        t0 = time.process_time()
        f = replay(name, jobs, dc, catalog, opts.policy, opts.seed)
        print(f"| {f.name} | {f.used_cpu:.3f} | {f.used_mem:.3f} | {f.held_cpu:.3f} | {f.held_mem:.3f} | "
              f"{f.held_cpu - f.used_cpu:.3f} | {f.held_mem - f.used_mem:.3f} | {f.stranded_cpu:.3f} | {f.avg_jct_s:.1f} | {f.makespan_s:.0f} | "
              f"{f.unschedulable} |", flush=True)
        print(f"  ({name}: {time.process_time() - t0:.1f} CPU-s, {f.jobs_done} jobs finished)", file=sys.stderr)


if __name__ == "__main__":
    main()
