"""The node-choice policy interface shared by the placer service, the simulators and the trainers.

Like a Kubernetes Filter/Score plugin pair: the caller computes the feasibility mask (resources,
GPU model, thermal redline), the policy only scores. `select` takes the best masked node, so no
policy — heuristic or learned — can ever pick a node the mask rules out.
"""

from __future__ import annotations

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


def select(policy: NodePolicy, state: ClusterState, demand: Resources, mask: np.ndarray, top_k: int = 3) -> Choice | None:
    """Best masked node by score; ties go to the lowest node index (deterministic). A policy with a
    `narrow_mask(state, demand, mask)` (e.g. hsched.costs.stranding.GpuReservePolicy) filters further first."""
    narrow = getattr(policy, "narrow_mask", None)
    if narrow is not None:
        mask = narrow(state, demand, mask)
    candidates = np.flatnonzero(mask)
    if len(candidates) == 0:
        return None
    s = np.asarray(policy.scores(state, demand, mask), dtype=np.float64)[candidates]
    # lexsort: primary key -score (descending score), secondary node index (ascending)
    order = np.lexsort((candidates, -s))[:top_k]
    alternatives = tuple((int(candidates[i]), float(s[i])) for i in order)
    policy.placed(alternatives[0][0])
    return Choice(alternatives[0][0], alternatives)
