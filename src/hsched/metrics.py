"""The GPU-cluster metrics of paper 000 (§2 eq.8, §3.1 eq.15-17, §4.3 eq.26-28, tables 6-9) and FGD's
expected fragmentation (Weng et al., USENIX ATC'23), as pure functions over ClusterStates.

One copy of every formula: the Gymnasium env (hsched.envs.gpu), the FGD policy (hsched.policies.fgd) and
the reports (hsched.eval.gpu, hsched.eval.node_vs_cluster) all call these.

Resources (paper 000 eq.8): R = {GPU memory, GPU core, CPU, memory}, in the column order of tables 6-9
(`RESOURCES`). Per cluster n and resource r, the utilisation is allocated / total, r_o^(n) / r_t^(n), as
ClusterState.utilisation() computes it. A cluster that has none of a resource (a CPU-only room has no GPU
memory) has no utilisation for it: NaN in `utilisation_matrix`, left out of every mean below (0/0 is not 0).

Two different "fragmentation" numbers, deliberately named apart:

- `paper_fragmentation` — paper 000 eq.27. Despite the name it is the mean over clusters of the SUM over the
  four resources of the free share (r_t − r_o) / r_t: 4 for an empty fleet, 0 for a full one. It measures
  idle capacity, not how usable it is (the paper's table 8: 1.99-2.32).
- `fgd_expected_fragmentation` — FGD's measure: the GPU capacity (in whole cards) that a task drawn from
  the workload's distribution of requests could NOT use, in expectation. It is 0 on a node whose idle GPUs
  every typical task can use, and equals the node's idle GPU when no typical task can start there.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from hsched.domain.cluster import ClusterState, count_per_row
from hsched.domain.resources import Resources
from hsched.domain.task import TaskSpec

RESOURCES: tuple[str, ...] = ("gpu_memory", "gpu_core", "cpu", "memory")  # tables 6-9 column order
GPU_RESOURCES: tuple[str, ...] = ("gpu_memory", "gpu_core")
TAU = 10.0  # paper 000 eq.17, τ
FAILURE_REWARD = -50.0  # paper 000 §3.1: the reward of a failed deployment


# ------------------------------------------------------------------------------------------------------------
# utilisation (eq.8, eq.9, tables 6-9)


def utilisation_row(state: ClusterState, resources: Sequence[str] = RESOURCES,
                    present: Sequence[bool] | None = None) -> np.ndarray:
    """r_o^(n) / r_t^(n) of one cluster per resource (ClusterState.utilisation), NaN where r_t^(n) = 0.
    `present` (per resource: r_t^(n) > 0), when the caller already knows it, saves summing the capacities."""
    used = state.utilisation()
    if present is None:
        totals = state.capacity()
        present = [totals[r] > 0 for r in resources]
    return np.array([used[r] if p else np.nan for r, p in zip(resources, present, strict=True)],
                    dtype=np.float64)


def utilisation_matrix(states: Sequence[ClusterState], resources: Sequence[str] = RESOURCES) -> np.ndarray:
    """[N clusters, |R|] utilisation: rows in the order of `states`, columns `resources` (NaN: no such
    resource)."""
    return np.array([utilisation_row(s, resources) for s in states], dtype=np.float64).reshape(len(states),
                                                                                              len(resources))


def mean_utilisation(u: np.ndarray) -> np.ndarray:
    """Paper 000 eq.8 per cluster, from a utilisation matrix `u` [N, |R|]:

        Ū_n = (1/|R|) Σ_{r∈R} r_o^(n) / r_t^(n)

    over the resources the cluster has (NaN columns left out); 0 for a cluster that has none of them.
    A 1-D `u` is one cluster's row (a fast path for per-step use: the same formula on 4 numbers)."""
    if np.ndim(u) == 1:
        vals = [float(x) for x in u if x == x]  # x == x: not NaN
        return np.array([sum(vals) / len(vals) if vals else 0.0])
    u = np.atleast_2d(u)
    have = ~np.isnan(u)
    count = have.sum(axis=1)
    return np.where(count > 0, np.where(have, u, 0.0).sum(axis=1) / np.maximum(count, 1), 0.0)


def objective_eq9(states: Sequence[ClusterState]) -> float:
    """Paper 000 eq.9, the optimisation objective: (1/N) Σ_n Ū_n."""
    return objective_eq9_from(utilisation_matrix(states))


def objective_eq9_from(u: np.ndarray) -> float:
    """eq.9 from a utilisation matrix [N, |R|]."""
    return float(mean_utilisation(u).mean()) if len(u) else 0.0


def utilisation_stats(states: Sequence[ClusterState], resources: Sequence[str] = RESOURCES
                      ) -> dict[str, tuple[float, float]]:
    """Tables 6-9 (table 6): per resource, the mean and the standard deviation ACROSS CLUSTERS of the
    utilisation r_o^(n) / r_t^(n). The deviation is the population one, sqrt((1/N) Σ_n (u_n − ū)²), the same
    1/N convention as eq.28; clusters without the resource are left out."""
    return utilisation_stats_from(utilisation_matrix(states, resources), resources)


def utilisation_stats_from(u: np.ndarray, resources: Sequence[str] = RESOURCES
                           ) -> dict[str, tuple[float, float]]:
    """`utilisation_stats` from a utilisation matrix [N, |R|] whose columns are `resources`."""
    out: dict[str, tuple[float, float]] = {}
    for j, r in enumerate(resources):
        col = u[:, j][~np.isnan(u[:, j])]
        out[r] = (float(col.mean()), float(col.std())) if len(col) else (float("nan"), float("nan"))
    return out


# ------------------------------------------------------------------------------------------------------------
# eq.26-28


def deployed_count(n_success: int, n_suc_jud: int) -> int:
    """Paper 000 eq.26, the number of successfully handled tasks:

        N = n_success + n_suc_jud

    n_success: tasks deployed; n_suc_jud: tasks for which the scheduler correctly judged that no cluster
    could host them (it chose the delay action while no host had room). With a feasibility mask every
    decision is "correct", so N counts every task that was not failed; compare policies on n_success."""
    if n_success < 0 or n_suc_jud < 0:
        raise ValueError("counts must be >= 0")
    return n_success + n_suc_jud


def paper_fragmentation(states: Sequence[ClusterState], resources: Sequence[str] = RESOURCES) -> float:
    """Paper 000 eq.27, the "resource fragmentation rate":

        F = (1/N) Σ_{n=1}^{N} Σ_{r∈R} (r_t^(n) − r_o^(n)) / r_t^(n)

    i.e. the mean over clusters of the summed free shares (in 0..|R|); resources a cluster lacks are
    skipped."""
    return fragmentation_eq27(utilisation_matrix(states, resources))


def fragmentation_eq27(u: np.ndarray) -> float:
    """eq.27 from a utilisation matrix [N, |R|] (NaN: the cluster lacks that resource, skipped)."""
    if len(u) == 0:
        return 0.0
    return float(np.where(np.isnan(u), 0.0, 1.0 - u).sum(axis=1).mean())


def gpu_load_variance(states: Sequence[ClusterState], resources: Sequence[str] = GPU_RESOURCES) -> float:
    """Paper 000 eq.28, the cross-cluster GPU load variance:

        σ_L² = (1/N) Σ_{n=1}^{N} (Ū_n − (1/N) Σ_{n'} Ū_n')²

    with Ū_n eq.8 restricted to the GPU resources (GPU memory and GPU core: the "GPU load" the metric is
    named for; pass `resources=RESOURCES` for eq.8 over all four). Clusters without GPUs are left out."""
    return load_variance_eq28(utilisation_matrix(states, resources))


def load_variance_eq28(u: np.ndarray) -> float:
    """eq.28 from a utilisation matrix [N, |R'|] of the resources the load is made of; rows that are all
    NaN (a cluster with none of them) are left out."""
    u = u[~np.isnan(u).all(axis=1)] if len(u) else u
    if len(u) == 0:
        return 0.0
    load = mean_utilisation(u)
    return float(((load - load.mean()) ** 2).mean())


def paper_summary(u: np.ndarray, states: Sequence[ClusterState] = (), dist: TaskDistribution | None = None
                  ) -> dict[str, float]:
    """Every state metric of tables 6-9 from a utilisation matrix `u` [N, 4] (columns `RESOURCES`):
    "<resource>_mean" / "<resource>_std" (table 6), "fragmentation" (eq.27), "gpu_load_variance" (eq.28 over
    GPU memory and GPU core), "eq9"; with `dist`, also FGD's "fgd_fragmentation" (GPUs) and
    "fgd_fragmentation_rate" over the nodes of `states`. The deployed counts (eq.26) are the caller's."""
    out: dict[str, float] = {}
    for r, (m, s) in utilisation_stats_from(u).items():
        out[f"{r}_mean"], out[f"{r}_std"] = m, s
    out["fragmentation"] = fragmentation_eq27(u)
    out["gpu_load_variance"] = load_variance_eq28(u[:, [RESOURCES.index(r) for r in GPU_RESOURCES]])
    out["eq9"] = objective_eq9_from(u)
    if dist is not None:
        out["fgd_fragmentation"] = fgd_fragmentation(states, dist)
        out["fgd_fragmentation_rate"] = fgd_fragmentation_rate(states, dist, out["fgd_fragmentation"])
    return out


# ------------------------------------------------------------------------------------------------------------
# reward eq.15-17


def normalised_score(scores: np.ndarray, n: int) -> float:
    """Paper 000 eq.15-16 for the cluster n that received the task:

        Score_n = Ū_n                                                     (15)
        Score   = (Score_n − minscore) / (maxscore − minscore)            (16)

    min/max over all clusters' scores. When every cluster scores the same (maxscore = minscore, e.g. one
    cluster) the chosen cluster is both the best and the worst: Score = 1 (no penalty)."""
    s = np.asarray(scores, dtype=np.float64)
    lo, hi = float(s.min()), float(s.max())
    return 1.0 if hi - lo <= 1e-12 else (float(s[n]) - lo) / (hi - lo)


def placement_reward(scores: np.ndarray, n: int, tau: float = TAU) -> float:
    """Paper 000 eq.17 for a successful deployment on cluster n, given every cluster's eq.15 score
    (its eq.8 utilisation, measured after the placement):

        Re = (Score − 1) × τ,   τ = 10                                     (17)

    in [−τ, 0]: 0 when n is (one of) the most utilised cluster(s), −τ when it is the least utilised."""
    return (normalised_score(scores, n) - 1.0) * tau


def reward_eq17(states: Sequence[ClusterState], n: int | None, tau: float = TAU,
                failure: float = FAILURE_REWARD) -> float:
    """The paper 000 reward from the clusters' states after an action: `placement_reward` of cluster n, or
    `failure` (−50) when the deployment failed (n is None)."""
    if n is None:
        return failure
    return placement_reward(mean_utilisation(utilisation_matrix(states)), n, tau)


# ------------------------------------------------------------------------------------------------------------
# FGD expected fragmentation


@dataclass(frozen=True, eq=False)
class TaskDistribution:
    """The target workload of FGD: M typical task shapes and their popularity (sums to 1).

    Arrays have one entry per shape. `gpu_models[m]` is the shape's allowed GPU models (() = any)."""

    cpu_milli: np.ndarray
    memory_mib: np.ndarray
    disk_mib: np.ndarray
    bandwidth_mbps: np.ndarray
    gpu_count: np.ndarray
    gpu_core_percent: np.ndarray
    gpu_memory_mib: np.ndarray
    gpu_models: tuple[tuple[str, ...], ...]
    popularity: np.ndarray

    def __len__(self) -> int:
        return len(self.popularity)

    @classmethod
    def from_tasks(cls, tasks: Iterable[TaskSpec | Resources],
                   max_types: int | None = None) -> TaskDistribution:
        """The request histogram of `tasks` (TaskSpecs count once per replica; bare Resources once).

        `max_types` keeps the most popular shapes only (ties by first appearance) and renormalises, as
        FGD's "typical pods" do; None keeps all."""
        counts: Counter[tuple[Resources, tuple[str, ...]]] = Counter()
        for t in tasks:
            if isinstance(t, TaskSpec):
                key = (t.resources, tuple(sorted(set(t.gpu_models))) if t.resources.gpu_count else ())
                counts[key] += t.replicas
            else:
                counts[(t, ())] += 1
        if not counts:
            raise ValueError("a task distribution needs at least one task")
        items = counts.most_common(max_types)
        total = sum(c for _, c in items)
        rs = [r for (r, _), _ in items]

        def arr(field: str) -> np.ndarray:
            return np.array([getattr(r, field) for r in rs], dtype=np.int64)

        return cls(arr("cpu_milli"), arr("memory_mib"), arr("disk_mib"), arr("bandwidth_mbps"),
                   arr("gpu_count"), arr("gpu_core_percent"), arr("gpu_memory_mib"),
                   tuple(m for (_, m), _ in items),
                   np.array([c / total for _, c in items], dtype=np.float64))


_SLICE_SIZES: dict[int, tuple[TaskDistribution, np.ndarray, np.ndarray]] = {}


def _slice_sizes(dist: TaskDistribution) -> tuple[np.ndarray, np.ndarray]:
    """The distinct (core %, memory) slice sizes of `dist`'s shapes [U, 2] and each shape's index into them
    (cached per distribution: FGD scores every decision against the same one)."""
    hit = _SLICE_SIZES.get(id(dist))
    if hit is None or hit[0] is not dist:
        need = np.stack([np.maximum(dist.gpu_core_percent, 1), dist.gpu_memory_mib], axis=1)
        sizes, index = np.unique(need, axis=0, return_inverse=True)
        if len(_SLICE_SIZES) > 64:  # a few distributions per process; never grow without bound
            _SLICE_SIZES.clear()
        hit = _SLICE_SIZES[id(dist)] = (dist, sizes, index.reshape(-1))
    return hit[1], hit[2]


def fgd_expected_fragmentation(free_cpu: np.ndarray, free_memory: np.ndarray, free_disk: np.ndarray,
                               free_bandwidth: np.ndarray, gpu_free_core: np.ndarray,
                               gpu_free_memory: np.ndarray, gpu_model: Sequence[str],
                               dist: TaskDistribution) -> np.ndarray:
    """FGD's expected GPU fragmentation of each node (in whole GPUs), for nodes given by their free amounts
    (1-D arrays [k]; GPU arrays [k, cards]; `gpu_model` [k]):

        F_n(M) = Σ_{m∈M} p_m · F_n(m)
        F_n(m) = Σ_g R_{n,g}                          if task m cannot run on node n, or requests no GPU
                 Σ_g R_{n,g} · 1[card g cannot hold one slice of m]     otherwise

    R_{n,g} = idle core share of card g (1 = a whole idle card). "Cannot run" = not enough CPU, memory, disk
    or bandwidth, fewer than gpu_count cards that can each hold a slice, or a GPU model the task excludes —
    the node feasibility of ClusterState.feasible, evaluated for every shape at once. A card holds a slice
    when both its idle core percent and its idle memory cover the slice (hsched's 2-D cards; FGD's trace has
    GPU share only). CPU-only shapes count every idle GPU as fragment (FGD's x-axis cases).
    """
    core = np.asarray(gpu_free_core)
    idle = core.sum(axis=1) / 100.0  # [k]
    if len(dist) == 0 or core.shape[0] == 0:
        return np.zeros(core.shape[0])
    host_ok = np.ones((core.shape[0], len(dist)), dtype=bool)  # [k, M]
    for free, need in ((free_cpu, dist.cpu_milli), (free_memory, dist.memory_mib), (free_disk, dist.disk_mib),
                       (free_bandwidth, dist.bandwidth_mbps)):
        free = np.asarray(free)
        if need.max() > free.min():  # else every node has enough for every shape (openb asks no disk, bandwidth)
            host_ok &= free[:, None] >= need[None, :]
    # per card, per distinct slice size (openb: 22 for 151 shapes), then spread to the shapes: [k, cards, U]
    sizes, shape_size = _slice_sizes(dist)
    holds = (core[:, :, None] >= sizes[None, None, :, 0]) & (gpu_free_memory[:, :, None] >= sizes[None, None, :, 1])
    # the spreads by np.take, not `[:, shape_size]`: the same values in C order, at half the cost; C order is
    # also the layout of the product's matrix it always had (BLAS's sums, hence the last bits, follow it)
    runs = host_ok & (np.take(count_per_row(holds), shape_size, axis=1) >= dist.gpu_count[None, :]) \
        & (dist.gpu_count > 0)[None, :]
    if any(dist.gpu_models):
        models = np.asarray(gpu_model)
        for m, allowed in enumerate(dist.gpu_models):
            if allowed:
                runs[:, m] &= np.isin(models, list(allowed))
    # idle share on cards that cannot hold a slice
    stranded = np.take(np.einsum("kg,kgu->ku", core / 100.0, ~holds), shape_size, axis=1)
    per_shape = np.where(runs, stranded, idle[:, None])  # [k, M]
    return per_shape @ dist.popularity


def fgd_node_fragmentation(state: ClusterState, dist: TaskDistribution,
                           nodes: np.ndarray | None = None) -> np.ndarray:
    """`fgd_expected_fragmentation` of the nodes of `state` (all, or the indices `nodes`)."""
    idx = slice(None) if nodes is None else np.asarray(nodes)
    models = state.table.gpu_model if nodes is None else [state.table.gpu_model[i] for i in np.asarray(nodes)]
    return fgd_expected_fragmentation(state.free_cpu[idx], state.free_memory[idx], state.free_disk[idx],
                                      state.free_bandwidth[idx], state.gpu_free_core[idx],
                                      state.gpu_free_memory[idx], models, dist)


def fgd_fragmentation(states: Sequence[ClusterState], dist: TaskDistribution) -> float:
    """FGD's cluster fragmentation: Σ over every node of every state of F_n(M), in whole GPUs."""
    return float(sum(fgd_node_fragmentation(s, dist).sum() for s in states))


def fgd_fragmentation_rate(states: Sequence[ClusterState], dist: TaskDistribution,
                           fragmentation: float | None = None) -> float:
    """`fgd_fragmentation` as a share of the idle GPU capacity (0 = every idle GPU is usable; 1 = none is).
    `fragmentation`: the already computed `fgd_fragmentation(states, dist)`, if the caller has it."""
    idle = sum(float(s.gpu_free_core.sum()) / 100.0 for s in states)
    frag = fgd_fragmentation(states, dist) if fragmentation is None else fragmentation
    return frag / idle if idle > 0 else 0.0
