"""The node-choice policy interface shared by the placer service, the simulators and the trainers.

Like a Kubernetes Filter/Score plugin pair: the caller computes the feasibility mask (resources,
GPU model, thermal redline), the policy only scores. `select` takes the best masked node, so no
policy — heuristic or learned — can ever pick a node the mask rules out.

Bounded scoring (kube-scheduler's percentageOfNodesToScore): filtering is a few vectorised masks over all
nodes, scoring is what grows with the policy's cost, so `select` scores a bounded candidate set — every
feasible node, or, when a policy carries a `CandidateSampler` (`bound`) or a `candidate_limit` of its own (a
learned policy's fixed input size), a seeded uniform sample of that many feasible nodes. A policy with
`scores_at(state, demand, nodes)` scores only the sampled nodes; else `scores` is called with the sample's
mask. When the bound covers every feasible node nothing is sampled and the decision is the unbounded one
exactly (the same `scores` call).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from hsched.domain.cluster import ClusterState
from hsched.domain.resources import Resources


class NodePolicy(Protocol):
    name: str

    def scores(self, state: ClusterState, demand: Resources, mask: np.ndarray) -> np.ndarray:
        """A score per node (higher is better); only entries where `mask` is True are ever used."""
        ...

    def placed(self, node: int) -> None:
        """Told after each part is placed (round robin moves its cursor here)."""
        ...


@dataclass(frozen=True, slots=True)
class Choice:
    node: int
    alternatives: tuple[tuple[int, float], ...]  # (node, score), best first, the chosen one included


MIN_NODES_TO_SCORE = 100  # kube-scheduler's minFeasibleNodesToFind: a percentage never scores fewer


@dataclass(frozen=True, slots=True)
class NodesToScore:
    """How many feasible nodes one decision scores: `count` nodes, or `percent` % of the feasible ones (at
    least MIN_NODES_TO_SCORE), or all (neither set). Parsed from "all", "256" or "10%"."""

    count: int = 0
    percent: float = 0.0

    @classmethod
    def parse(cls, text: str | int | None) -> NodesToScore:
        raw = "all" if text is None else str(text).strip().lower()
        try:
            if raw in ("", "all"):
                return cls()
            if raw.endswith("%"):
                pct = float(raw[:-1])
                if not 0 < pct <= 100:
                    raise ValueError
                return cls(percent=0.0 if pct == 100 else pct)
            count = int(raw)
            if count < 1:
                raise ValueError
            return cls(count=count)
        except ValueError:
            raise ValueError(f"nodes_to_score: {text!r} must be 'all', a node count >= 1 or a percentage in "
                             "(0, 100] like '10%'") from None

    def limit(self, feasible: int) -> int:
        if self.count:
            return min(self.count, feasible)
        if self.percent:
            return min(feasible, max(MIN_NODES_TO_SCORE, math.ceil(feasible * self.percent / 100)))
        return feasible

    def __str__(self) -> str:
        return str(self.count) if self.count else f"{self.percent:g}%" if self.percent else "all"


class CandidateSampler:
    """A policy's bound on the nodes it scores, with the seeded generator of its samples (one per placer:
    its decisions are reproducible from `seed` and the order of its calls)."""

    def __init__(self, nodes: NodesToScore, seed: int = 0) -> None:
        self.nodes = nodes
        self.rng = np.random.default_rng(seed)


def bound(policy, nodes: NodesToScore | str | None, seed: int = 0):
    """`policy` scoring at most `nodes` feasible nodes per decision (returned for chaining)."""
    policy.sampler = CandidateSampler(nodes if isinstance(nodes, NodesToScore) else NodesToScore.parse(nodes),
                                      seed)
    return policy


def candidates(policy, mask: np.ndarray) -> np.ndarray:
    """The feasible nodes `select` scores, ascending: every node of `mask`, or a uniform sample (without
    replacement) of as many as the policy's sampler and its own `candidate_limit` allow. Only ever nodes of
    `mask`; all of them when the bound covers them."""
    feasible = np.flatnonzero(mask)
    sampler = getattr(policy, "sampler", None)
    k = sampler.nodes.limit(len(feasible)) if sampler is not None else len(feasible)
    own = getattr(policy, "candidate_limit", None)
    if own:
        k = min(k, own)
    if k >= len(feasible):
        return feasible
    if sampler is None:  # a learned policy's own limit, no bound given: a generator of its own, seeded 0
        sampler = policy.sampler = CandidateSampler(NodesToScore(), 0)
    return np.sort(feasible[sampler.rng.choice(len(feasible), k, replace=False)])


def scores_of(policy, state: ClusterState, demand: Resources, mask: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    """The policy's scores of `nodes` (`mask`'s nodes, or a sample of them). Every feasible node: `scores`, as
    without a bound (a learned policy's context is then the whole room, as trained). A sample: `scores_at`
    when the policy has one (its cost then follows len(nodes), not the room's size; a learned policy's context
    is the sample), else `scores` with the mask cut to `nodes`."""
    if len(nodes) < int(np.count_nonzero(mask)):
        at = getattr(policy, "scores_at", None)
        if at is not None:
            return np.asarray(at(state, demand, nodes), dtype=np.float64)
        mask = np.zeros(state.n, dtype=bool)
        mask[nodes] = True
    return np.asarray(policy.scores(state, demand, mask), dtype=np.float64)[nodes]


def select(policy: NodePolicy, state: ClusterState, demand: Resources, mask: np.ndarray, top_k: int = 3,
           narrow: bool = True) -> Choice | None:
    """Best node by score among the `candidates` of `mask`; ties go to the lowest node index (deterministic). A
    policy with a `narrow_mask(state, demand, mask)` (e.g. hsched.costs.stranding.GpuReservePolicy) filters
    further first, unless `narrow` is False."""
    narrowing = getattr(policy, "narrow_mask", None) if narrow else None
    if narrowing is not None:
        mask = narrowing(state, demand, mask)
    nodes = candidates(policy, mask)
    if len(nodes) == 0:
        return None
    s = scores_of(policy, state, demand, mask, nodes)
    # lexsort: primary key -score (descending score), secondary node index (ascending)
    order = np.lexsort((nodes, -s))[:top_k]
    alternatives = tuple((int(nodes[i]), float(s[i])) for i in order)
    policy.placed(alternatives[0][0])
    return Choice(alternatives[0][0], alternatives)
