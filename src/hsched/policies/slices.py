"""Slice (container) types: paper 001 §2.1's hierarchical clustering with a connectivity constraint.

A cloud pre-partitions its machines into containers ("slices") of a few types; a task instance runs in one
free slice whose size covers its resource demand vector r = (cpu, memory, …). Paper 001 finds Q slice types
by clustering the tasks' demand vectors bottom-up:

- **elements** are the distinct demand vectors (paper: "each element represents one specific resource demand
  vector"); |c| is the number of elements in cluster c;
- **distance**, eq. 1: d(c1, c2) = |c1||c2| / (|c1| + |c2|) · ‖g1 − g2‖ — for two singletons half their
  Euclidean distance, as the paper states. Dimensions are divided by `scale` (a node's capacity) first so
  that cores and memory percent weigh alike;
- **connectivity constraint**, eq. 2: d'(c1, c2) = d(c1, c2) when g1 ≤ g2 or g1 ≥ g2 *componentwise*
  ("a vector satisfies a relation when every element does"), ∞ otherwise: two clusters may merge only when
  one's container is "compatible" with (covers) the other's. The closest admissible pair merges first;
- **centroid** = the cluster's largest element (it covers every member, so the container type of a cluster
  is one of the real demand vectors and no new size is invented);
- **degenerate case**: when no two clusters satisfy the constraint, the step falls back to the plain
  distance and the merged cluster's representative is the componentwise maximum of its members — a new
  vector, counted in `SliceTypes.created` (the paper: "the algorithm degrades to ordinary hierarchical
  clustering and may create new demand vectors").

`cluster_demands(..., constrained=False)` is the paper's method 2 (ordinary hierarchical clustering: mean
centroids in eq. 1, the container is the componentwise max of the members so it can run them) and
`uniform_type` is method 1 (one type: the largest demand of each resource over all tasks).

Q: paper 001 shows the machines' idle-resource fraction against Q (fig. 12) and picks Q = 6 (fig. 10,
the best average JCT). `q_curve` computes the idle fraction for Q = 1..q_max and `choose_q` takes the
knee: the smallest Q after which one more type saves less than `min_gain` of the resources.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

EPS = 1e-12


@dataclass(frozen=True)
class SliceTypes:
    """Q container sizes and, per distinct input demand vector, the type of its cluster."""

    sizes: np.ndarray          # [Q, dims] container size per type, ascending by (scaled) volume
    demands: np.ndarray        # [n, dims] the distinct demand vectors that were clustered
    assignment: np.ndarray     # [n] type index of each demand vector's cluster (sizes[a] ≥ demand)
    created: int = 0           # sizes that are not one of the demand vectors (degenerate merges)

    @property
    def q(self) -> int:
        return int(self.sizes.shape[0])

    def smallest_fitting(self, demand: Sequence[float]) -> int:
        """The index of the smallest type (by scaled volume order) covering `demand`; -1 when none does."""
        r = np.asarray(demand, dtype=np.float64)
        for k in range(self.q):
            if np.all(self.sizes[k] >= r - EPS):
                return k
        return -1


def comparable(a: np.ndarray, b: np.ndarray) -> bool:
    """Eq. 2's connectivity: a ≤ b or a ≥ b in every component."""
    return bool(np.all(a <= b + EPS) or np.all(a >= b - EPS))


def merge_distance(n1: int, n2: int, g1: np.ndarray, g2: np.ndarray) -> float:
    """Eq. 1: |c1||c2| / (|c1| + |c2|) · ‖g1 − g2‖ (already scaled vectors)."""
    return n1 * n2 / (n1 + n2) * float(np.linalg.norm(g1 - g2))


def _distinct(demands: np.ndarray) -> np.ndarray:
    d = np.asarray(demands, dtype=np.float64)
    if d.ndim != 2 or d.shape[0] == 0:
        raise ValueError(f"demands: expected a non-empty [n, dims] array, got shape {d.shape}")
    if not np.all(np.isfinite(d)) or np.any(d < 0):
        raise ValueError("demands: every component must be a finite number ≥ 0")
    return np.unique(d, axis=0)


def cluster_demands(demands: Sequence[Sequence[float]] | np.ndarray, q: int, *,
                    scale: Sequence[float] | None = None, constrained: bool = True) -> SliceTypes:
    """Cluster the distinct rows of `demands` into `q` slice types (see the module docstring).

    `q` larger than the number of distinct vectors gives one type per vector. Ties merge the pair with the
    lowest cluster indices (clusters are kept in lexicographic order of their first member), so the result is
    deterministic.
    """
    if isinstance(q, bool) or not isinstance(q, int) or q < 1:
        raise ValueError(f"q: must be an integer ≥ 1, got {q!r}")
    vectors = _distinct(np.asarray(demands))
    dims = vectors.shape[1]
    s = np.ones(dims) if scale is None else np.asarray(scale, dtype=np.float64)
    if s.shape != (dims,) or np.any(s <= 0):
        raise ValueError(f"scale: expected {dims} positive numbers, got {scale!r}")
    scaled = vectors / s
    members: list[list[int]] = [[i] for i in range(len(vectors))]
    reps: list[np.ndarray] = [v.copy() for v in scaled]  # representative (container), scaled
    created = 0
    while len(members) > q:
        best: tuple[float, int, int] | None = None
        fallback: tuple[float, int, int] | None = None
        for i in range(len(members)):
            for j in range(i + 1, len(members)):
                if constrained:
                    g1, g2 = reps[i], reps[j]
                else:
                    g1, g2 = scaled[members[i]].mean(axis=0), scaled[members[j]].mean(axis=0)
                d = merge_distance(len(members[i]), len(members[j]), g1, g2)
                if not constrained or comparable(reps[i], reps[j]):
                    if best is None or d < best[0] - EPS:
                        best = (d, i, j)
                elif fallback is None or d < fallback[0] - EPS:
                    fallback = (d, i, j)
        pick = best if best is not None else fallback
        assert pick is not None
        _, i, j = pick
        merged = np.maximum(reps[i], reps[j])
        if best is None:  # no admissible pair: the degenerate merge may invent a size
            if not any(np.allclose(merged, scaled[m]) for m in members[i] + members[j]):
                created += 1
        members[i] = sorted(members[i] + members[j])
        reps[i] = merged
        del members[j], reps[j]
    # type order: ascending scaled volume (sum), then lexicographic, so "smallest fitting" scans in order
    order = sorted(range(len(members)), key=lambda k: (float(reps[k].sum()), tuple(reps[k])))
    sizes = np.array([reps[k] * s for k in order])
    assignment = np.empty(len(vectors), dtype=np.int64)
    for t, k in enumerate(order):
        assignment[members[k]] = t
    return SliceTypes(sizes=sizes, demands=vectors, assignment=assignment, created=created)


def uniform_type(demands: Sequence[Sequence[float]] | np.ndarray) -> SliceTypes:
    """Paper 001's method 1: no clustering, one container type = the largest demand of each resource."""
    vectors = _distinct(np.asarray(demands))
    return SliceTypes(sizes=vectors.max(axis=0, keepdims=True), demands=vectors,
                      assignment=np.zeros(len(vectors), dtype=np.int64),
                      created=int(not any(np.allclose(v, vectors.max(axis=0)) for v in vectors)))


def idle_fraction(types: SliceTypes, demands: np.ndarray, weights: np.ndarray,
                  scale: Sequence[float] | None = None) -> float:
    """Fraction of the slice resources reserved for tasks that the tasks do not use (fig. 12's idle ratio).

    Every task (row of `demands`, weighted by `weights`, e.g. instances × duration) runs in its cluster's
    container; per resource, idle = Σ w (size − demand) / Σ w size, averaged over the (scaled) resources.
    """
    d = np.asarray(demands, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    s = np.ones(d.shape[1]) if scale is None else np.asarray(scale, dtype=np.float64)
    index = {tuple(v): k for v, k in zip(map(tuple, types.demands), types.assignment, strict=False)}
    try:
        sizes = np.array([types.sizes[index[tuple(r)]] for r in d])
    except KeyError as exc:
        raise ValueError(f"demands: {exc.args[0]} was not among the clustered vectors") from None
    reserved = (w[:, None] * sizes / s).sum(axis=0)
    used = (w[:, None] * d / s).sum(axis=0)
    return float(np.mean((reserved - used) / np.maximum(reserved, EPS)))


@dataclass(frozen=True)
class QCurve:
    qs: tuple[int, ...]
    constrained: tuple[float, ...]     # idle fraction, method 3 (paper 001)
    unconstrained: tuple[float, ...]   # idle fraction, method 2
    uniform: float                     # idle fraction, method 1 (independent of Q)
    chosen_q: int
    min_gain: float


def choose_q(qs: Sequence[int], idle: Sequence[float], min_gain: float = 0.01) -> int:
    """The knee of the idle-fraction curve: the smallest Q from which one more type saves < `min_gain`."""
    for k in range(len(qs) - 1):
        if idle[k] - idle[k + 1] < min_gain:
            return int(qs[k])
    return int(qs[-1])


def q_curve(demands: np.ndarray, weights: np.ndarray, *, scale: Sequence[float] | None = None, q_max: int = 12,
            min_gain: float = 0.01) -> QCurve:
    """Idle fraction against Q = 1..q_max for methods 3 (constrained), 2 (plain) and 1 (uniform); the chosen Q."""
    if q_max < 1:
        raise ValueError(f"q_max: must be ≥ 1, got {q_max}")
    qs = tuple(range(1, q_max + 1))
    con = tuple(idle_fraction(cluster_demands(demands, q, scale=scale), demands, weights, scale) for q in qs)
    unc = tuple(idle_fraction(cluster_demands(demands, q, scale=scale, constrained=False), demands, weights, scale)
                for q in qs)
    uni = idle_fraction(uniform_type(demands), demands, weights, scale)
    return QCurve(qs=qs, constrained=con, unconstrained=unc, uniform=uni, chosen_q=choose_q(qs, con, min_gain),
                  min_gain=min_gain)


def type_shares(types: SliceTypes, demands: np.ndarray, weights: np.ndarray,
                scale: Sequence[float] | None = None) -> np.ndarray:
    """Per type, the share of the slice capacity the workload reserves: Σ over the demand vectors of its
    cluster of weight × the (scaled) volume of the type's slice — `partition_node`'s `shares`. Uniform when
    the weights are all zero."""
    d = np.asarray(demands, dtype=np.float64)
    s = np.ones(d.shape[1]) if scale is None else np.asarray(scale, dtype=np.float64)
    index = {tuple(v): k for v, k in zip(map(tuple, types.demands), types.assignment, strict=False)}
    reserve = np.zeros(types.q)
    for r, w in zip(d, np.asarray(weights, dtype=np.float64), strict=True):
        k = index[tuple(r)]
        reserve[k] += w * float((types.sizes[k] / s).mean())
    if reserve.sum() <= 0:
        reserve[:] = 1.0
    return reserve


def partition_node(capacity: Sequence[float], sizes: np.ndarray, shares: Sequence[float]) -> list[int]:
    """How many slices of each type to cut from one node of `capacity`.

    `shares` (≥ 0, any scale) is the wanted fraction of the node's (scaled) capacity per type. Slices are cut
    one at a time, always of the type furthest below its share that still fits in what is left; when every
    type with a share is at or above it, the remainder is filled with whatever fits (largest deficit first)
    so that no room a slice could use stays uncut.
    """
    cap = np.asarray(capacity, dtype=np.float64)
    sizes = np.asarray(sizes, dtype=np.float64)
    want = np.asarray(shares, dtype=np.float64)
    if want.shape != (len(sizes),) or np.any(want < 0) or want.sum() <= 0:
        raise ValueError("shares: expected one non-negative share per type, not all zero")
    want = want / want.sum()
    volume = (sizes / cap).mean(axis=1)  # fraction of the node one slice of each type takes
    counts = [0] * len(sizes)
    left = cap.copy()
    while True:
        fits = [k for k in range(len(sizes)) if np.all(sizes[k] <= left + EPS)]
        if not fits:
            return counts
        used = np.array(counts) * volume
        deficit = want - used / max(float(used.sum()), EPS) if used.sum() > 0 else want
        k = max(fits, key=lambda t: (deficit[t], -volume[t], -t))
        counts[k] += 1
        left = left - sizes[k]
