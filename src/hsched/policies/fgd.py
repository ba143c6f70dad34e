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
MEMO_ROWS = 1 << 15  # F_n(M) per state row remembered by an FGD policy (~250 B a row: ~8 MiB at most)


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
        self._memo: dict[bytes, float] = {}  # F_n(M) by state row bytes (`delta`), at most MEMO_ROWS rows
        self._memo_of: TaskDistribution = distribution  # the distribution the memo's values were computed for
        self._codes: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # id(state._models) -> (it, codes per node)
        self._code_of: dict[str, int] = {}  # GPU model name -> code, stable across states

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
        the nodes (the cards each would get included).

        F_n(M) is a function of the node's state row alone (GPU model, free cpu / memory / disk / bandwidth, free
        core and memory per card), so the candidates' rows are deduplicated (an idle host of a machine type is one
        row, however many there are) and each row's F_n(M), before or after, is looked up by the row's bytes in
        the policy's memo first: a hit is exact whatever changed the state in between (the envs write the free
        arrays directly and share them between a fleet and its clusters' views, which no mutation counter in
        ClusterState would see). In a loaded room most rows, before and after, recur from earlier decisions."""
        nodes = np.asarray(nodes, dtype=np.int64)
        if not len(nodes):
            return np.zeros(0)
        codes = self._model_codes(state)
        rows = np.concatenate((codes[nodes, None], state.free_cpu[nodes, None], state.free_memory[nodes, None],
                               state.free_disk[nodes, None], state.free_bandwidth[nodes, None],
                               state.gpu_free_core[nodes], state.gpu_free_memory[nodes]), axis=1, dtype=np.int64)
        first, inverse = distinct_rows(rows)
        rows = rows[first]
        after = rows.copy()
        after[:, 1:5] -= (demand.cpu_milli, demand.memory_mib, demand.disk_mib, demand.bandwidth_mbps)
        if demand.gpu_count:
            cards = state.gpu_free_core.shape[1]
            picked, card = chosen_cards(rows[:, 5:5 + cards], rows[:, 5 + cards:], demand)
            after[picked, 5 + card] -= demand.gpu_core_percent
            after[picked, 5 + cards + card] -= demand.gpu_memory_mib
        both = np.concatenate((rows, after))  # before rows 0..u-1, after rows u..2u-1
        frag = self._fragmentation(both, state._models[np.concatenate((nodes[first], nodes[first]))])
        u = len(first)
        # rounded: equal fragmentation reached by different float sums must tie (the lowest index wins); the sums'
        # order (which rows share a BLAS call, and where) moves only the last bits, which this rounding absorbs.
        # + 0.0: no −0.0 from a tiny negative difference (a score is then −0.0 whatever the sums' order)
        return (np.round(frag[u:] - frag[:u], 9) + 0.0)[inverse]

    def _fragmentation(self, rows: np.ndarray, models: np.ndarray) -> np.ndarray:
        """F_n(M) of state rows (as `delta` builds them; `models` their GPU models): from the memo, the misses
        evaluated together and remembered (the memo starts over at MEMO_ROWS rows: a bound on its memory)."""
        if self._memo_of is not self.distribution or len(self._memo) > MEMO_ROWS:
            self._memo, self._memo_of = {}, self.distribution
        known = self._memo
        keys = np.ascontiguousarray(rows).view(np.dtype((np.void, rows.shape[1] * 8))).ravel().tolist()
        frag = [known.get(k) for k in keys]
        miss = [i for i, f in enumerate(frag) if f is None]
        if miss:
            m, cards = rows[miss], (rows.shape[1] - 5) // 2
            new = fgd_expected_fragmentation(m[:, 1], m[:, 2], m[:, 3], m[:, 4], m[:, 5:5 + cards],
                                             m[:, 5 + cards:], models[miss], self.distribution).tolist()
            for i, f in zip(miss, new, strict=True):
                frag[i] = known[keys[i]] = f
        return np.array(frag)

    def _model_codes(self, state: ClusterState) -> np.ndarray:
        """Per node of `state`, an integer for its GPU model, the same for a model on every state (memo keys)."""
        seen = self._codes
        hit = seen.get(id(state._models))
        if hit is None or hit[0] is not state._models:
            if len(seen) > 64:
                seen.clear()
            names, inverse = np.unique(state._models, return_inverse=True)
            code = self._code_of
            per_name = np.array([code.setdefault(str(m), len(code)) for m in names], dtype=np.int64)
            hit = seen[id(state._models)] = (state._models, per_name[inverse.reshape(-1)])
        return hit[1]

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


_MIX = np.random.default_rng(16).integers(1, 2**62, 64) | 1  # odd multipliers: a row's hash is its dot with them


def distinct_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first, inverse) of the distinct rows of an int64 [k, w] array: `rows[first]` are the distinct rows
    (in no promised order), `rows[first][inverse] == rows`. Rows are told apart by a
    wrapping 64-bit hash (np.unique over rows with axis=0 costs ~15× more), checked exactly: a collision
    falls back to np.unique over the rows."""
    if rows.shape[1] <= len(_MIX):
        h = rows @ _MIX[:rows.shape[1]]  # integer matmul wraps silently
        _, first, inverse = np.unique(h, return_index=True, return_inverse=True)
        inverse = inverse.reshape(-1)
        if np.array_equal(rows[first][inverse], rows):
            return first, inverse
    _, first, inverse = np.unique(rows, axis=0, return_index=True, return_inverse=True)
    return first, inverse.reshape(-1)


def chosen_cards(core: np.ndarray, memory: np.ndarray, demand: Resources) -> tuple[np.ndarray, np.ndarray]:
    """ClusterState.choose_cards for many nodes at once: given their free core / memory per card [k, cards],
    the (row, card) pairs of the demand's slices — per row the `gpu_count` fullest cards that fit (core, then
    memory, then card index ascending). Every row must have that many cards that fit."""
    fits = (core >= demand.gpu_core_percent) & (memory >= demand.gpu_memory_mib)
    index = np.broadcast_to(np.arange(core.shape[1]), core.shape)
    order = np.lexsort((index, memory, core, ~fits), axis=-1)[:, :demand.gpu_count]  # fitting cards first
    rows = np.repeat(np.arange(core.shape[0]), demand.gpu_count)
    return rows, order.ravel()

