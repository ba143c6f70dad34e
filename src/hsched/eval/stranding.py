"""Replay of a mixed trace through the selector and the placers' planning, in-process: stranded GPU tasks.

A "stranded" GPU task is one that no DC places when it arrives although some host of a GPU DC has enough idle
cards of an allowed model for it (cards with its core share and GPU memory free) and would have the CPU and
memory too if the CPU-only tasks on that host were not there: CPU-only work starved the cards. `bench/gpu_stranding.py` prints the counts with the GPU-aware
DC choice off (the paper's eq.3, plain placers) and on (the stranding term in the selector and the GPU-host
reserve in the placers, hsched.costs.stranding); tests/test_gpu_stranding.py checks them.

The model is the stack's decision path without its transport: `DcSelector.select` ranks the DCs from their
current free resources (as the placers' summaries publish them), each DC in rank order is tried with
`hsched.policies.placement.plan` (the placer's planner, its policy wrapped by `GpuReservePolicy` when on), the
first that places it keeps it until its runtime is over (trace time), and a task no DC places is counted
deferred (a GPU one also stranded when idle cards fit it) and not retried, so the counts are per Submit.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hsched.costs import WanGraph
from hsched.costs.stranding import OFF, GpuReservePolicy, StrandingConfig, free_of
from hsched.domain.cluster import ClusterState
from hsched.domain.fleet import Fleet
from hsched.domain.task import TaskSpec
from hsched.engine.selector import DcSelector
from hsched.policies.heuristics import make_policy
from hsched.policies.placement import Outcome, plan


@dataclass
class ReplayCounts:
    cpu_tasks: int = 0
    cpu_placed: int = 0
    cpu_in_gpu_dcs: int = 0  # CPU-only tasks placed in a DC with GPUs
    gpu_tasks: int = 0
    gpu_placed: int = 0
    gpu_deferred: int = 0
    gpu_stranded: int = 0  # deferred while a host had idle cards that fit it, and CPU-only tasks held its CPU/memory
    rejected: int = 0  # fit no DC even when empty
    peak_gpu_use: float = 0.0  # highest share of the fleet's GPU cores in use
    examples: list[str] = field(default_factory=list)

    def row(self) -> list[object]:
        return [self.gpu_tasks, self.gpu_placed, self.gpu_deferred, self.gpu_stranded, self.cpu_tasks,
                self.cpu_placed, self.cpu_in_gpu_dcs, self.rejected, f"{100 * self.peak_gpu_use:.1f}"]


HEADERS = ["GPU tasks", "GPU placed", "GPU deferred", "GPU deferred: idle cards stranded by CPU-only tasks",
           "CPU tasks", "CPU placed", "CPU placed in GPU DCs", "fit no DC", "peak GPU use (%)"]


def _stranded_by_cpu_tasks(state: ClusterState, task: TaskSpec, cpu_held: np.ndarray, mem_held: np.ndarray) -> bool:
    """Some host has the task's cards idle and would have its CPU and memory too but for the CPU-only tasks
    it holds: the GPUs are stranded by CPU-only work, not by a lack of cards or by other GPU tasks."""
    d = task.resources
    cards = (state.gpu_free_core >= d.gpu_core_percent) & (state.gpu_free_memory >= d.gpu_memory_mib)
    ok = (cards.sum(axis=1) >= d.gpu_count) & state.model_mask(task.gpu_models)
    ok &= (state.free_cpu + cpu_held >= d.cpu_milli) & (state.free_memory + mem_held >= d.memory_mib)
    ok &= (state.free_disk >= d.disk_mib) & (state.free_bandwidth >= d.bandwidth_mbps)
    return bool(np.any(ok))


def replay(fleet: Fleet, jobs: Sequence[tuple[float, TaskSpec]], stranding: StrandingConfig,
           policy: str = "bestfit", hold: bool = False, reserve: StrandingConfig | None = None) -> ReplayCounts:
    """Replay `jobs` ((arrival s, task) in arrival order) with the GPU-aware DC choice `stranding` (OFF =
    the paper's eq.3 and plain placers). `hold`: tasks are never released (a load test's burst of Submits
    that fills the fleet) instead of ending after their runtime. `reserve`: the placers' GPU-host reserve when
    it differs from the selector's setting (e.g. OFF: the selector's term alone)."""
    reserve = stranding if reserve is None else reserve
    selector = DcSelector(fleet, graph=WanGraph(fleet.wan), stranding=stranding, stale_after_s=float("inf"))
    states = {dc.name: ClusterState(dc) for dc in fleet.datacenters}
    gpu_dcs = {dc.name for dc in fleet.datacenters if dc.capacity_total().gpu_count}
    policies = {}
    for dc in fleet.datacenters:
        p = make_policy(policy, 0, dc)
        policies[dc.name] = GpuReservePolicy(p, reserve) if reserve.share > 0 and dc.name in gpu_dcs else p
    gpu_cores = sum(int(states[d].table.gpu_core_percent.sum()) for d in gpu_dcs) or 1
    running: list[tuple[float, int, str, str]] = []  # (end, seq, dc, task id)
    # per DC and node: CPU (milli) and memory (MiB) held by CPU-only tasks
    held = {name: (np.zeros(s.n, dtype=np.int64), np.zeros(s.n, dtype=np.int64)) for name, s in states.items()}
    cpu_only: set[str] = set()

    def hold_parts(dc: str, parts, sign: int) -> None:
        for part in parts:
            held[dc][0][part.node] += sign * part.cpu_milli
            held[dc][1][part.node] += sign * part.memory_mib
    out = ReplayCounts()

    def publish(name: str) -> None:
        s = states[name]
        summary = {"datacenter": name, "fencing_token": 0}
        if name in gpu_dcs:
            summary["gpu_hosts"] = free_of(s).as_dict()
        selector.update_summary(summary)

    for name in states:
        publish(name)
    for i, (t, task) in enumerate(jobs):
        while running and running[0][0] <= t:
            _, _, dc, tid = heapq.heappop(running)
            parts = states[dc].release(tid)
            if tid in cpu_only and parts:
                hold_parts(dc, parts, -1)
            publish(dc)
        gpu = task.resources.gpu_count > 0
        if gpu:
            out.gpu_tasks += 1
        else:
            out.cpu_tasks += 1
        ranked, _, _ = selector.select(task)
        placed = None
        for cand in ranked:
            p = plan(states[cand.datacenter], task, policies[cand.datacenter])
            if p.outcome is Outcome.PLACED:
                placed = cand.datacenter
                states[placed].apply(f"t{i}", p.parts)
                if not gpu:
                    cpu_only.add(f"t{i}")
                    hold_parts(placed, p.parts, +1)
                if not hold:
                    heapq.heappush(running, (t + task.runtime_s, i, placed, f"t{i}"))
                publish(placed)
                break
        if placed is None and not ranked:
            out.rejected += 1
            continue
        if gpu:
            if placed:
                out.gpu_placed += 1
            else:
                out.gpu_deferred += 1
                if any(_stranded_by_cpu_tasks(states[c.datacenter], task, *held[c.datacenter])
                       for c in ranked if c.datacenter in gpu_dcs):
                    out.gpu_stranded += 1
                    if len(out.examples) < 3:
                        r = task.resources
                        out.examples.append(f"{task.name}: {r.gpu_count}×{r.gpu_core_percent}% GPU, "
                                            f"{r.cpu_milli / 1000:g} cores, {r.memory_mib / 1024:.0f} GiB")
        elif placed:
            out.cpu_placed += 1
            out.cpu_in_gpu_dcs += placed in gpu_dcs
        used = sum(int((states[d].table.gpu_core_percent - states[d].gpu_free_core).sum()) for d in gpu_dcs)
        out.peak_gpu_use = max(out.peak_gpu_use, used / gpu_cores)
    return out


def compare(fleet: Fleet, jobs: Sequence[tuple[float, TaskSpec]], on: StrandingConfig | None = None,
            policy: str = "bestfit", hold: bool = False) -> dict[str, ReplayCounts]:
    """The replay with the GPU-aware DC choice off, each half alone, and on (the default)."""
    on = on or StrandingConfig()
    return {"off (eq.3, plain placers)": replay(fleet, jobs, OFF, policy, hold),
            "selector's stranding term only": replay(fleet, jobs, on, policy, hold, reserve=OFF),
            "placers' GPU-host reserve only": replay(fleet, jobs, OFF, policy, hold, reserve=on),
            "on (both, the default)": replay(fleet, jobs, on, policy, hold)}
