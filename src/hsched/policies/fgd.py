"""Fragmentation Gradient Descent (FGD; Weng et al., "Beware of Fragmentation: Scheduling GPU-Sharing
Workloads with Fragmentation Gradient Descent", USENIX ATC'23) as a NodePolicy.

FGD scores a candidate node by how much placing the task there would grow the node's expected GPU
fragmentation F_n(M) — the idle GPU capacity that a task drawn from the target workload M could not use
(hsched.metrics.fgd_expected_fragmentation) — and picks the node with the smallest growth:

    score(n) = −(F_n'(M) − F_n(M)),   n' = node n after the placement

The placement it evaluates is the one the placer will make: the demand's slices go on the cards
ClusterState.choose_cards picks (the fullest cards that fit), so the score and the allocation agree.
FGD's original also picks the card inside the node by the same gradient; here the card rule is the
library's, for every policy alike.

The workload M is the GPU-request histogram of a trace (`from_openb`) or of any list of TaskSpecs
(`from_tasks`), optionally cut to the `max_types` most popular request shapes ("typical pods").
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache
from pathlib import Path

import numpy as np

from hsched.domain.cluster import ClusterState
from hsched.domain.resources import Resources
from hsched.domain.task import TaskSpec
from hsched.metrics import TaskDistribution, fgd_expected_fragmentation

OPENB_POD_LIST = "alibaba_openb_gpu_2023/openb_pod_list_default.csv.gz"


@cache
def _openb_tasks(path: str) -> tuple[TaskSpec, ...]:
    from hsched.traces.openb import load_openb_pods, openb_pod_to_task

    return tuple(openb_pod_to_task(p) for p in load_openb_pods(path))


def openb_tasks(path: str | Path | None = None) -> tuple[TaskSpec, ...]:
    """Every pod of an openb pod list as a TaskSpec (cached per path; default: the trace's default list)."""
    if path is None:
        from hsched.traces import data_dir

        path = data_dir() / OPENB_POD_LIST
    return _openb_tasks(str(path))


@cache
def _openb_distribution(path: str, max_types: int | None) -> TaskDistribution:
    return TaskDistribution.from_tasks(_openb_tasks(path), max_types)


def openb_distribution(path: str | Path | None = None, max_types: int | None = None) -> TaskDistribution:
    """The request histogram of a whole openb pod list (cached per path; default: the default pod list)."""
    if path is None:
        from hsched.traces import data_dir

        path = data_dir() / OPENB_POD_LIST
    return _openb_distribution(str(path), max_types)


class FragmentationGradientDescent:
    """NodePolicy "fgd". Build with `FragmentationGradientDescent(distribution)`,
    `FragmentationGradientDescent.from_tasks(tasks, max_types=None)` or
    `FragmentationGradientDescent.from_openb(path=None, max_types=None)`."""

    name = "fgd"

    def __init__(self, distribution: TaskDistribution) -> None:
        self.distribution = distribution

    @classmethod
    def from_tasks(cls, tasks: Iterable[TaskSpec | Resources], max_types: int | None = None
                   ) -> FragmentationGradientDescent:
        return cls(TaskDistribution.from_tasks(tasks, max_types))

    @classmethod
    def from_openb(cls, path: str | Path | None = None, max_types: int | None = None
                   ) -> FragmentationGradientDescent:
        """The workload of an openb pod list (default: openb_pod_list_default, 8 152 pods, 151 shapes)."""
        return cls(openb_distribution(path, max_types))

    def delta(self, state: ClusterState, demand: Resources, nodes: np.ndarray) -> np.ndarray:
        """F_n'(M) − F_n(M) for each node index in `nodes` (each must have room for `demand`); vectorised over
        the nodes (the cards each would get included), so its cost is a few array operations of len(nodes)."""
        nodes = np.asarray(nodes, dtype=np.int64)
        models = state._models[nodes]  # the table's models as an array (ClusterState keeps one)
        cpu, mem = state.free_cpu[nodes], state.free_memory[nodes]
        disk, bw = state.free_disk[nodes], state.free_bandwidth[nodes]
        core, gmem = state.gpu_free_core[nodes], state.gpu_free_memory[nodes]
        core_after, gmem_after = core.copy(), gmem.copy()
        if demand.gpu_count and len(nodes):
            rows, cards = chosen_cards(core, gmem, demand)
            core_after[rows, cards] -= demand.gpu_core_percent
            gmem_after[rows, cards] -= demand.gpu_memory_mib
        # before and after in one evaluation (rows k..2k-1 = after): half the per-call overhead
        both = fgd_expected_fragmentation(
            np.concatenate([cpu, cpu - demand.cpu_milli]), np.concatenate([mem, mem - demand.memory_mib]),
            np.concatenate([disk, disk - demand.disk_mib]), np.concatenate([bw, bw - demand.bandwidth_mbps]),
            np.concatenate([core, core_after]), np.concatenate([gmem, gmem_after]),
            np.concatenate([models, models]), self.distribution)
        before, after = both[:len(nodes)], both[len(nodes):]
        # rounded: equal fragmentation reached by different float sums must tie (the lowest index wins)
        return np.round(after - before, 9)

    def scores(self, state: ClusterState, demand: Resources, mask: np.ndarray) -> np.ndarray:
        out = np.full(state.n, -np.inf)
        nodes = np.flatnonzero(mask)
        if len(nodes):
            out[nodes] = -self.delta(state, demand, nodes)
        return out

    def scores_at(self, state: ClusterState, demand: Resources, nodes: np.ndarray) -> np.ndarray:
        return -self.delta(state, demand, nodes)

    def placed(self, node: int) -> None:
        pass


def chosen_cards(core: np.ndarray, memory: np.ndarray, demand: Resources) -> tuple[np.ndarray, np.ndarray]:
    """ClusterState.choose_cards for many nodes at once: given their free core / memory per card [k, cards],
    the (row, card) pairs of the demand's slices — per row the `gpu_count` fullest cards that fit (core, then
    memory, then card index ascending). Every row must have that many cards that fit."""
    fits = (core >= demand.gpu_core_percent) & (memory >= demand.gpu_memory_mib)
    index = np.broadcast_to(np.arange(core.shape[1]), core.shape)
    order = np.lexsort((index, memory, core, ~fits), axis=-1)[:, :demand.gpu_count]  # fitting cards first
    rows = np.repeat(np.arange(core.shape[0]), demand.gpu_count)
    return rows, order.ravel()

