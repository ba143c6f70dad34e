"""Learned node policies served by the placer, with a heuristic fallback that always serves.

A learned policy is an ordinary `NodePolicy` (hsched.policies.base): the placer computes the feasibility
and thermal-redline mask, the model only scores the nodes that mask allows, and `select()` returns the
top-k alternatives with their Q-values (Double DQN) or actor scores (DDPG) as the decision explanation.

Each agent module provides ``load_policy(path, dc) -> NodePolicy`` and raises `ModelMismatch` when the
checkpoint cannot serve `dc` (feature count, resource kinds). A missing model or a mismatch is never fatal:
the factory logs why and returns the fallback heuristic, whose `name` says which model it stands in for
and why (the placer reports `policy.name` in every decision).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import numpy as np

from hsched.domain.cluster import ClusterState
from hsched.domain.resources import Resources
from hsched.rl.checkpoint import model_path, serve_on_one_thread

log = logging.getLogger(__name__)

# policy name → (agent module, shipped model name, fallback heuristic)
MODELS = {
    "double-dqn": ("hsched.rl.ddqn", "double_dqn_dc", "greedy"),
    "ddpg": ("hsched.rl.ddpg", "ddpg_gpu", "bestfit"),
    "eade-ddpg": ("hsched.rl.ddpg", "eade_ddpg_gpu", "bestfit"),
}


class ModelMismatch(ValueError):
    """The checkpoint cannot serve this data center (its input features do not match the fleet's)."""


class Fallback:
    """A heuristic standing in for a learned policy; its name carries the reason into every decision."""

    def __init__(self, policy: Any, learned: str, reason: str, kind: str) -> None:
        self.policy = policy
        self.learned = learned
        self.reason = reason
        self.kind = kind  # model_missing or model_mismatch: the bounded reason of the metrics
        self.name = f"{policy.name} (fallback for {learned}: {reason})"
        self.decisions = 0  # node choices made in the learned policy's place (hsched_placer_policy_fallbacks_total)

    def scores(self, state: ClusterState, demand: Resources, mask: np.ndarray) -> np.ndarray:
        self.decisions += 1
        return self.policy.scores(state, demand, mask)

    def scores_at(self, state: ClusterState, demand: Resources, nodes: np.ndarray) -> np.ndarray:
        """The heuristic's scores of a sampled candidate set (hsched.policies.base.scores_of)."""
        self.decisions += 1
        at = getattr(self.policy, "scores_at", None)
        if at is not None:
            return at(state, demand, nodes)
        mask = np.zeros(state.n, dtype=bool)
        mask[nodes] = True
        return np.asarray(self.policy.scores(state, demand, mask))[nodes]

    def placed(self, node: int) -> None:
        self.policy.placed(node)


def learned_policy(name: str, dc: Any, seed: int = 0, model: str | None = None) -> Any:
    """The served policy `name` for `dc`, from `model` (a path) or the shipped model, else the fallback."""
    from hsched.policies.heuristics import make_policy

    serve_on_one_thread()
    module, shipped, fallback = MODELS[name]
    path = model_path(model or shipped)
    try:
        if not path.exists():
            raise FileNotFoundError(f"no model at {path}")
        policy = importlib.import_module(module).load_policy(path, dc)
        log.info("policy %s: serving %s", name, path)
        return policy
    except (FileNotFoundError, ModelMismatch) as exc:
        log.warning("policy %s: %s; serving the %s heuristic instead", name, exc, fallback)
        kind = "model_mismatch" if isinstance(exc, ModelMismatch) else "model_missing"
        return Fallback(make_policy(fallback, seed), name, str(exc), kind)


def double_dqn_policy(dc: Any, seed: int = 0) -> Any:
    return learned_policy("double-dqn", dc, seed)


def ddpg_policy(dc: Any, seed: int = 0) -> Any:
    return learned_policy("ddpg", dc, seed)


def eade_ddpg_policy(dc: Any, seed: int = 0) -> Any:
    return learned_policy("eade-ddpg", dc, seed)
