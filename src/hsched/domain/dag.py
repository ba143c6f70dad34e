"""Longest paths through a job's stage DAG: the one implementation behind every critical path.

A DAG is given by index: `parents[i]` lists the stages stage i waits for, `weights[i]` is stage i's time on
the path (one task's duration, plus any per-stage delay). Each job shape (TPC-H `DagJob`, Alibaba jobs, the
co-location env's `JobSpec`, the gateway's `JobSpec` by stage name) maps itself onto this and keeps its own
name in the error for a cycle.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


class DagCycleError(ValueError):
    """The stages in `stuck` never become ready: they lie on or below a cycle."""

    def __init__(self, name: str, stuck: list[int]) -> None:
        super().__init__(f"{name}: the stage graph has a cycle (stages {stuck} never become ready)")
        self.stuck = stuck


def topological_order(parents: Sequence[Sequence[int]], name: str = "job") -> tuple[int, ...]:
    """Stage indices, every parent before its children (Kahn; the lowest ready index first). DagCycleError
    (a ValueError naming the job `name` and the stuck stages) on a cycle."""
    indegree = [len(p) for p in parents]
    children: list[list[int]] = [[] for _ in parents]
    for i, ps in enumerate(parents):
        for p in ps:
            children[p].append(i)
    ready = [i for i, d in enumerate(indegree) if d == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for c in children[i]:
            indegree[c] -= 1
            if indegree[c] == 0:
                heapq.heappush(ready, c)
    if len(order) != len(parents):
        raise DagCycleError(name, [i for i, d in enumerate(indegree) if d > 0])
    return tuple(order)


def critical_path(weights: Sequence[float], parents: Sequence[Sequence[int]], name: str = "job") -> float:
    """The longest weighted chain: the job's completion time with unlimited executors (0 for no stage)."""
    finish = [0.0] * len(weights)
    for i in topological_order(parents, name):
        finish[i] = max((finish[p] for p in parents[i]), default=0.0) + weights[i]
    return max(finish, default=0.0)


def paths_to_end(weights: Sequence[float], parents: Sequence[Sequence[int]], name: str = "job") -> list[float]:
    """Per stage, the longest weighted chain from it (its own weight included) to the job's end."""
    children: list[list[int]] = [[] for _ in parents]
    for i, ps in enumerate(parents):
        for p in ps:
            children[p].append(i)
    below = [0.0] * len(weights)
    for i in reversed(topological_order(parents, name)):
        below[i] = weights[i] + max((below[c] for c in children[i]), default=0.0)
    return below
