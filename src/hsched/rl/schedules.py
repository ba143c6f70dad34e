"""Exploration schedules, ε-greedy action selection and target-network updates (NumPy; the torch trainers
call :func:`soft_update` / :func:`hard_update` directly on their ``state_dict()`` tensors, so the update
formula lives in one place only).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["ExponentialSchedule", "LinearSchedule", "epsilon_greedy", "hard_update", "soft_update"]


@dataclass(frozen=True)
class LinearSchedule:
    """value(t) = start + (end − start)·min(t / steps, 1): linear from ``start`` at t = 0 to ``end`` at
    t = steps, constant afterwards (CleanRL's ``linear_schedule``)."""

    start: float
    end: float
    steps: int

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")

    def __call__(self, t: ArrayLike) -> Any:
        frac = np.clip(np.asarray(t, dtype=np.float64) / self.steps, 0.0, 1.0)
        out = self.start + (self.end - self.start) * frac
        return float(out) if out.ndim == 0 else out


@dataclass(frozen=True)
class ExponentialSchedule:
    """value(t) = max(end, start·decay^t) — the closed form of the per-step rule ε ← max(ε_min, ε·decay)
    (for start >= end; with start < end it is min(end, start·decay^t), i.e. it grows towards end)."""

    start: float
    end: float
    decay: float

    def __post_init__(self) -> None:
        if not 0.0 < self.decay:
            raise ValueError(f"decay must be > 0, got {self.decay}")

    def __call__(self, t: ArrayLike) -> Any:
        raw = self.start * self.decay ** np.maximum(np.asarray(t, dtype=np.float64), 0.0)
        out = np.maximum(self.end, raw) if self.start >= self.end else np.minimum(self.end, raw)
        return float(out) if out.ndim == 0 else out


def epsilon_greedy(
    q_values: ArrayLike,
    epsilon: float | ArrayLike,
    rng: np.random.Generator,
    mask: ArrayLike | None = None,
) -> Any:
    """ε-greedy over the allowed actions.

    ``q_values`` is (A,) or (B, A); ``mask`` (same shape, True = allowed) defaults to all allowed;
    ``epsilon`` is a scalar or one value per row. With probability ε a row picks uniformly among its
    allowed actions, otherwise the allowed action of largest Q (ties: lowest index). A masked action is
    never returned; a row with no allowed action raises ValueError. Returns an int for a single row, an
    int64 array of B actions otherwise.
    """
    q = np.asarray(q_values, dtype=np.float64)
    single = q.ndim == 1
    q2 = np.atleast_2d(q)
    if q2.ndim != 2:
        raise ValueError(f"q_values must be (A,) or (B, A), got shape {q.shape}")
    allowed = np.ones(q2.shape, dtype=bool) if mask is None else np.atleast_2d(np.asarray(mask, dtype=bool))
    if allowed.shape != q2.shape:
        raise ValueError(f"mask shape {allowed.shape} != q_values shape {q2.shape}")
    if not allowed.any(axis=1).all():
        raise ValueError("every row needs at least one allowed action")
    eps = np.broadcast_to(np.asarray(epsilon, dtype=np.float64), q2.shape[:1])
    rows = np.arange(q2.shape[0])
    greedy = np.argmax(np.where(allowed, q2, -np.inf), axis=1)
    bad = ~allowed[rows, greedy]  # allowed Q values all -inf or NaN: take the first allowed action
    greedy[bad] = np.argmax(allowed[bad], axis=1)
    # uniform among allowed: argmax of i.i.d. uniform keys, masked keys forced below every allowed one
    random = np.argmax(np.where(allowed, rng.random(q2.shape), -1.0), axis=1)
    actions = np.where(rng.random(q2.shape[0]) < eps, random, greedy).astype(np.int64)
    return int(actions[0]) if single else actions


def soft_update(target: Mapping[str, Any], source: Mapping[str, Any], tau: float) -> None:
    """Polyak averaging in place, key by key: target ← (1 − τ)·target + τ·source.

    Values may be NumPy arrays or any tensor with ``mul_`` / ``add_(other, alpha=)`` (e.g. torch tensors
    from ``net.state_dict()``; call it under ``torch.no_grad()``). τ = 1 is a hard update.
    """
    if not 0.0 <= tau <= 1.0:
        raise ValueError(f"tau must be in [0, 1], got {tau}")
    _check_keys(target, source)
    for key, t in target.items():
        s = source[key]
        if hasattr(t, "mul_"):
            t.mul_(1.0 - tau).add_(s, alpha=tau)
        else:
            t *= 1.0 - tau
            t += tau * np.asarray(s)


def hard_update(target: Mapping[str, Any], source: Mapping[str, Any]) -> None:
    """Copy every source value into the target in place (``copy_`` for tensors, ``np.copyto`` for arrays)."""
    _check_keys(target, source)
    for key, t in target.items():
        if hasattr(t, "copy_"):
            t.copy_(source[key])
        else:
            np.copyto(t, source[key])


def _check_keys(target: Mapping[str, Any], source: Mapping[str, Any]) -> None:
    if set(target) != set(source):
        missing = sorted(set(target) ^ set(source))
        raise KeyError(f"target and source have different keys: {missing}")
