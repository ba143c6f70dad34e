"""Heuristic node policies: RR and Greedy as in paper 003, BestFit/FirstFit/Random/Utilization as in
paper 000 §4 (there defined over clusters; here over the nodes of one DC). FirstFit is paper 000's
"Greedy" (stop at the first node that fits); Greedy is paper 003's (the most-utilised eligible node)."""

from __future__ import annotations

import numpy as np

from hsched.domain.cluster import ClusterState, rows_of, small_row_sums
from hsched.domain.resources import Resources


def _fraction_columns(state: ClusterState, demand: Resources, nodes: np.ndarray | None = None
                      ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Free and demanded fractions of capacity per node (all, or the indices `nodes`) over the dimensions
    the demand uses, one array per dimension (cpu, then memory and the GPU's core and memory when demanded)."""
    t = state.table
    i = slice(None) if nodes is None else nodes
    cpu = np.maximum(t.cpu_milli[i], 1)
    free = [state.free_cpu[i] / cpu]
    want = [demand.cpu_milli / cpu]
    if demand.memory_mib:
        mem = np.maximum(t.memory_mib[i], 1)
        free.append(state.free_memory[i] / mem)
        want.append(demand.memory_mib / mem)
    if demand.gpu_count:
        core_cap, mem_cap = (c[i] for c in t.gpu_capacity_floor1)
        free += [small_row_sums(rows_of(state.gpu_free_core, i)) / core_cap,
                 small_row_sums(rows_of(state.gpu_free_memory, i)) / mem_cap]
        want += [demand.gpu_count * demand.gpu_core_percent / core_cap, demand.gpu_count * demand.gpu_memory_mib / mem_cap]
    return free, want


def _fractions(state: ClusterState, demand: Resources, nodes: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
    """`_fraction_columns` as two [n, d] arrays."""
    free, want = _fraction_columns(state, demand, nodes)
    return np.stack(free, axis=1), np.stack(want, axis=1)


def _row_dot(a: list[np.ndarray], b: list[np.ndarray]) -> np.ndarray:
    """Σ_j a[j] · b[j] per node, summed left to right: the same floats as (stack(a) * stack(b)).sum(axis=1), whose
    reduction over d <= 4 columns adds them in that order (tests/test_candidates.py), without the stacks."""
    out = a[0] * b[0]
    for x, y in zip(a[1:], b[1:], strict=True):
        out += x * y
    return out


class FirstFit:
    name = "firstfit"

    def scores(self, state: ClusterState, demand: Resources, mask: np.ndarray) -> np.ndarray:
        return -np.arange(state.n, dtype=np.float64)

    def scores_at(self, state: ClusterState, demand: Resources, nodes: np.ndarray) -> np.ndarray:
        return -np.asarray(nodes, dtype=np.float64)

    def placed(self, node: int) -> None:
        pass


class RoundRobin:
    """Cycle through the nodes, skipping those without room (paper 003 RR)."""

    name = "rr"

    def __init__(self) -> None:
        self.cursor = 0

    def scores(self, state: ClusterState, demand: Resources, mask: np.ndarray) -> np.ndarray:
        return -((np.arange(state.n) - self.cursor) % state.n).astype(np.float64)

    def placed(self, node: int) -> None:
        self.cursor = node + 1


class Greedy:
    """The most-utilised eligible node, to keep the number of busy servers low (paper 003 Greedy)."""

    name = "greedy"

    def scores(self, state: ClusterState, demand: Resources, mask: np.ndarray) -> np.ndarray:
        return self.scores_at(state, demand, None)

    def scores_at(self, state: ClusterState, demand: Resources, nodes: np.ndarray | None) -> np.ndarray:
        free, _ = _fractions(state, demand, nodes)
        return 1.0 - free.mean(axis=1)

    def placed(self, node: int) -> None:
        pass


class BestFit:
    """The node left with the least free capacity after placing (paper 000 BestFit)."""

    name = "bestfit"

    def scores(self, state: ClusterState, demand: Resources, mask: np.ndarray) -> np.ndarray:
        return self.scores_at(state, demand, None)

    def scores_at(self, state: ClusterState, demand: Resources, nodes: np.ndarray | None) -> np.ndarray:
        """The scores of `nodes` only (None: all): `select`'s bounded candidate set costs O(len(nodes))."""
        free, want = _fractions(state, demand, nodes)
        return -(free - want).mean(axis=1)

    def placed(self, node: int) -> None:
        pass


class RandomPolicy:
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)

    def scores(self, state: ClusterState, demand: Resources, mask: np.ndarray) -> np.ndarray:
        return self.rng.random(state.n)

    def placed(self, node: int) -> None:
        pass


class Utilization:
    """The node whose free-capacity proportions best match the demand's (cosine similarity; paper 000)."""

    name = "utilization"

    def scores(self, state: ClusterState, demand: Resources, mask: np.ndarray) -> np.ndarray:
        return self.scores_at(state, demand, None)

    def scores_at(self, state: ClusterState, demand: Resources, nodes: np.ndarray | None) -> np.ndarray:
        free, want = _fraction_columns(state, demand, nodes)
        # np.linalg.norm's own formula for a vector norm along an axis (the square root of the row's sum of squares),
        # on the columns: every EADE-DDPG decision computes this fit as an input
        norm = np.sqrt(_row_dot(free, free)) * np.sqrt(_row_dot(want, want))
        return np.where(norm > 0, _row_dot(free, want) / np.maximum(norm, 1e-12), 0.0)

    def placed(self, node: int) -> None:
        pass


def gpu_stranding(state: ClusterState, demand: Resources, nodes: np.ndarray | None = None) -> np.ndarray:
    """Per node (all, or the indices `nodes`), in [0, 1]: how much placing `demand` there would strand GPU
    capacity — the share of the node's
    free CPU or memory (the larger) the demand takes, times the share of the node's GPU core still free after
    it. A GPU is useless once its host's CPU or memory is gone; on fleets that mix 16- and 104-core 2-GPU
    hosts (openb) that loses whole cards, so a packing policy should spend the small hosts' CPU on GPU work."""
    t = state.table
    i = slice(None) if nodes is None else nodes
    core_cap = t.gpu_capacity_floor1[0][i]
    gpu_free_after = np.maximum(rows_of(state.gpu_free_core, i).sum(axis=1) - demand.gpu_count * demand.gpu_core_percent,
                                0)
    taken = np.maximum(demand.cpu_milli / np.maximum(state.free_cpu[i], 1),
                       demand.memory_mib / np.maximum(state.free_memory[i], 1))
    return np.minimum(taken, 1.0) * gpu_free_after / core_cap


def card_tightness(state: ClusterState, demand: Resources, nodes: np.ndarray | None = None) -> np.ndarray:
    """Per node (all, or the indices `nodes`), in [0, 1]: 1 − the core share left on the cards
    `ClusterState.choose_cards` would give the
    demand (the fullest that fit; with several, the emptiest of them); 0 where the node cannot take it or the
    demand has no GPU. Best fit at card level: a slice on a card that it fills leaves whole cards for
    whole-card tasks."""
    i = slice(None) if nodes is None else nodes
    k = state.n if nodes is None else len(nodes)
    if not demand.gpu_count:
        return np.zeros(k)
    core, mem = rows_of(state.gpu_free_core, i), rows_of(state.gpu_free_memory, i)
    left = np.where((core >= demand.gpu_core_percent) & (mem >= demand.gpu_memory_mib),
                    core - demand.gpu_core_percent, np.inf)
    if left.shape[1] < demand.gpu_count:
        return np.zeros(k)
    kth = left.min(axis=1) if demand.gpu_count == 1 else np.sort(left, axis=1)[:, demand.gpu_count - 1]
    return np.where(np.isfinite(kth), 1.0 - kth / 100.0, 0.0)


HEURISTICS = {cls.name: cls for cls in (RoundRobin, Greedy, BestFit, FirstFit, RandomPolicy, Utilization)}


# Learned policies: name → "module:factory", factory(dc, seed) -> NodePolicy. Each factory loads its model
# from models/ and, when the model is missing or does not fit `dc`, returns a heuristic fallback that says
# so (log + its name), so a placer started with a learned policy always serves.
LEARNED_POLICIES = {
    "double-dqn": "hsched.policies.learned:double_dqn_policy",
    "ddpg": "hsched.policies.learned:ddpg_policy",
    "eade-ddpg": "hsched.policies.learned:eade_ddpg_policy",
}

# Policies that need more than a seed to build (FGD learns the trace's GPU-request distribution).
POLICY_NAMES = (*sorted(HEURISTICS), "fgd", *LEARNED_POLICIES)


def make_policy(name: str, seed: int = 0, dc=None, nodes_to_score=None):
    """A fresh policy instance by name: rr, greedy, bestfit, firstfit, random, utilization, fgd
    (fragmentation gradient descent against the openb trace's GPU-request distribution), or a learned
    policy (double-dqn, ddpg, eade-ddpg) for the DataCenter `dc` it will serve. `nodes_to_score` ("all",
    "256", "10%" or a NodesToScore; None = all): the most feasible nodes one decision scores, sampled with
    `seed` (hsched.policies.base; a learned policy also keeps its own fixed `candidate_limit`)."""
    policy = _make_policy(name, seed, dc)
    if nodes_to_score is not None:
        from hsched.policies.base import bound

        bound(policy, nodes_to_score, seed)
    return policy


def _make_policy(name: str, seed: int, dc):
    if name == "fgd":
        from hsched.policies.fgd import FragmentationGradientDescent

        return FragmentationGradientDescent.from_openb()
    if name in LEARNED_POLICIES:
        import importlib

        module, func = LEARNED_POLICIES[name].split(":")
        return getattr(importlib.import_module(module), func)(dc, seed)
    try:
        cls = HEURISTICS[name]
    except KeyError:
        raise ValueError(f"policy: unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}") from None
    return cls(seed) if cls is RandomPolicy else cls()
