"""Replay buffers for the learning problems of DESIGN.md §3 (NumPy only, vectorised).

* :class:`ReplayBuffer` — uniform, circular, fixed capacity (Stable-Baselines3 style storage: one
  pre-allocated array per field, ``pos`` is the next slot to write, ``size`` the number of filled slots).
* :class:`SumTree` — array-backed binary tree whose leaves hold priorities and whose inner nodes hold the
  sum of their children; vectorised ``update`` and ``find``.
* :class:`PrioritizedReplayBuffer` — proportional PER (Schaul et al. 2016): p_i = (|δ_i| + ε)^α,
  P(i) = p_i / Σ_k p_k, stratified sampling, importance-sampling weights
  w_i = (N·P(i))^−β / max_j w_j with β annealed linearly from β₀ to 1.
* :class:`DualReplayBuffer` — paper 000: an expert pool (demonstrations) and an online pool, each batch
  takes ``round(expert_ratio · B)`` transitions from the expert pool and the rest from the online pool.

Every ``sample`` returns a :class:`Batch`. ``rewards``, ``dones`` and ``weights`` are float32 so that a
trainer can write ``r + γ (1 − done) Q'`` and ``(w · δ²).mean()`` directly.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

__all__ = ["Batch", "DualReplayBuffer", "PrioritizedReplayBuffer", "ReplayBuffer", "SumTree"]


class Batch(NamedTuple):
    """A batch of B transitions.

    ``indices`` are slot numbers in the buffer that produced each row (pass them back to
    ``update_priorities``). ``weights`` are importance-sampling weights (all 1 for uniform sampling).
    ``source`` is ``None`` except for :class:`DualReplayBuffer`, where it is a bool array, True where the
    row came from the expert pool (then ``indices[i]`` is a slot of the expert pool, else of the online one).
    """

    obs: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    next_obs: np.ndarray
    dones: np.ndarray
    weights: np.ndarray
    indices: np.ndarray
    source: np.ndarray | None = None


def _shape(shape: int | tuple[int, ...]) -> tuple[int, ...]:
    return (shape,) if isinstance(shape, int | np.integer) else tuple(int(s) for s in shape)


class ReplayBuffer:
    """Uniform circular replay buffer of ``capacity`` transitions; the oldest is overwritten first."""

    def __init__(
        self,
        capacity: int,
        obs_shape: int | tuple[int, ...],
        action_shape: int | tuple[int, ...] = (),
        obs_dtype: DTypeLike = np.float32,
        action_dtype: DTypeLike = np.int64,
        seed: int | np.random.Generator | None = None,
    ) -> None:
        if int(capacity) < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self.obs_shape = _shape(obs_shape)
        self.action_shape = _shape(action_shape)
        self.obs = np.zeros((self.capacity, *self.obs_shape), dtype=obs_dtype)
        self.next_obs = np.zeros((self.capacity, *self.obs_shape), dtype=obs_dtype)
        self.actions = np.zeros((self.capacity, *self.action_shape), dtype=action_dtype)
        self.rewards = np.zeros(self.capacity, dtype=np.float32)
        self.dones = np.zeros(self.capacity, dtype=np.float32)
        self.rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
        self.pos = 0  # next slot to write
        self.size = 0  # filled slots

    def __len__(self) -> int:
        return self.size

    def add(self, obs: ArrayLike, action: ArrayLike, reward: float, next_obs: ArrayLike, done: bool) -> int:
        """Store one transition; returns the slot it was written to."""
        idx = self.add_batch(
            np.asarray(obs)[None],
            np.asarray(action)[None],
            np.asarray([reward]),
            np.asarray(next_obs)[None],
            np.asarray([done]),
        )
        return int(idx[0])

    def add_batch(
        self, obs: ArrayLike, actions: ArrayLike, rewards: ArrayLike, next_obs: ArrayLike, dones: ArrayLike
    ) -> np.ndarray:
        """Store n transitions (leading axis n) in order; returns the slots written (int64, length n).

        If n > capacity only the last ``capacity`` transitions survive (as if added one by one); the
        returned slots then repeat and the later write wins.
        """
        obs = np.asarray(obs)
        n = obs.shape[0]
        if obs.shape[1:] != self.obs_shape:
            raise ValueError(f"obs shape {obs.shape[1:]} != buffer obs_shape {self.obs_shape}")
        actions = np.asarray(actions).reshape((n, *self.action_shape))
        rewards = np.asarray(rewards, dtype=np.float32).reshape(n)
        next_obs = np.asarray(next_obs).reshape((n, *self.obs_shape))
        dones = np.asarray(dones, dtype=np.float32).reshape(n)
        idx = (self.pos + np.arange(n)) % self.capacity
        keep = slice(max(0, n - self.capacity), n)  # fancy assignment with repeats: keep the last ones only
        self.obs[idx[keep]] = obs[keep]
        self.next_obs[idx[keep]] = next_obs[keep]
        self.actions[idx[keep]] = actions[keep]
        self.rewards[idx[keep]] = rewards[keep]
        self.dones[idx[keep]] = dones[keep]
        self.pos = int((self.pos + n) % self.capacity)
        self.size = min(self.size + n, self.capacity)
        return idx.astype(np.int64)

    def _check_sample(self, batch_size: int) -> None:
        if self.size == 0:
            raise ValueError("cannot sample from an empty replay buffer")
        if batch_size < 0:
            raise ValueError(f"batch_size must be >= 0, got {batch_size}")

    def _gather(self, idx: np.ndarray, weights: np.ndarray) -> Batch:
        return Batch(
            obs=self.obs[idx],
            actions=self.actions[idx],
            rewards=self.rewards[idx],
            next_obs=self.next_obs[idx],
            dones=self.dones[idx],
            weights=weights.astype(np.float32),
            indices=idx.astype(np.int64),
        )

    def sample(self, batch_size: int) -> Batch:
        """``batch_size`` transitions drawn uniformly with replacement; weights are all 1."""
        self._check_sample(batch_size)
        idx = self.rng.integers(0, self.size, size=batch_size)
        return self._gather(idx, np.ones(batch_size, dtype=np.float32))


class SumTree:
    """Binary sum tree over ``capacity`` leaves, stored in one array of ``2·L`` floats (L = capacity rounded
    up to a power of two). Node 1 is the root, node k has children 2k and 2k+1, leaf i is node L + i;
    node 0 and padding leaves (i >= capacity) hold 0. Inner nodes are recomputed from their children (not
    incremented by deltas), so the sums never drift.
    """

    def __init__(self, capacity: int) -> None:
        if int(capacity) < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self.n_leaves = 1 << (self.capacity - 1).bit_length()
        self.depth = self.n_leaves.bit_length() - 1  # levels above the leaves
        self.tree = np.zeros(2 * self.n_leaves, dtype=np.float64)

    @property
    def leaves(self) -> np.ndarray:
        """Read-only view of the ``capacity`` leaf priorities."""
        view = self.tree[self.n_leaves : self.n_leaves + self.capacity]
        view.flags.writeable = False
        return view

    def total(self) -> float:
        return float(self.tree[1])

    def max(self) -> float:
        """Largest leaf priority (O(capacity), vectorised)."""
        return float(self.leaves.max())

    def __getitem__(self, idx: ArrayLike) -> np.ndarray:
        return self.tree[self.n_leaves + np.asarray(idx, dtype=np.int64)]

    def update(self, idx: ArrayLike, priority: ArrayLike) -> None:
        """Set leaves ``idx`` to ``priority`` (arrays or scalars; with repeated indices the last one wins)."""
        idx = np.atleast_1d(np.asarray(idx, dtype=np.int64))
        priority = np.broadcast_to(np.asarray(priority, dtype=np.float64), idx.shape)
        if idx.size == 0:
            return
        if idx.min() < 0 or idx.max() >= self.capacity:
            raise IndexError(f"leaf index out of range [0, {self.capacity})")
        if not np.all(np.isfinite(priority)) or np.any(priority < 0):
            raise ValueError("priorities must be finite and >= 0")
        nodes = idx + self.n_leaves
        self.tree[nodes] = priority
        for _ in range(self.depth):
            nodes = np.unique(nodes >> 1)
            self.tree[nodes] = self.tree[2 * nodes] + self.tree[2 * nodes + 1]

    def find(self, prefix_sums: ArrayLike) -> np.ndarray:
        """Leaf index i for each value v such that Σ_{k<i} p_k <= v < Σ_{k<=i} p_k (vectorised descent).

        Values are clipped to [0, total]; a value at (or, by rounding, beyond) the right edge returns the
        last leaf with non-zero priority, so a leaf of priority 0 is never returned while total > 0.
        """
        v = np.clip(np.asarray(prefix_sums, dtype=np.float64), 0.0, self.total()).copy()
        nodes = np.ones(v.shape, dtype=np.int64)
        for _ in range(self.depth):
            left = 2 * nodes
            left_sum = self.tree[left]
            go_left = (v < left_sum) | (self.tree[left + 1] <= 0.0)
            v = np.where(go_left, v, v - left_sum)
            nodes = np.where(go_left, left, left + 1)
        return nodes - self.n_leaves


class PrioritizedReplayBuffer(ReplayBuffer):
    """Proportional prioritized replay.

    New transitions get the largest priority seen so far (``max_priority``, starts at 1, never decreases —
    as in OpenAI Baselines), so each is replayed at least once with high probability. ``sample`` draws
    stratified: the total priority is cut into B equal segments and one prefix sum is drawn uniformly in
    each. Weights are normalised by the largest weight over the *whole buffer* (that of the smallest
    priority), so they lie in (0, 1] and do not depend on the batch. Each ``sample`` call counts one step
    of β annealing: β = β₀ + (1 − β₀)·min(1, calls / beta_steps); the weights use β before the increment.
    """

    def __init__(
        self,
        capacity: int,
        obs_shape: int | tuple[int, ...],
        action_shape: int | tuple[int, ...] = (),
        obs_dtype: DTypeLike = np.float32,
        action_dtype: DTypeLike = np.int64,
        seed: int | np.random.Generator | None = None,
        alpha: float = 0.6,
        beta0: float = 0.4,
        beta_steps: int = 100_000,
        eps: float = 1e-6,
    ) -> None:
        super().__init__(capacity, obs_shape, action_shape, obs_dtype, action_dtype, seed)
        if alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {alpha}")
        if not 0.0 <= beta0 <= 1.0:
            raise ValueError(f"beta0 must be in [0, 1], got {beta0}")
        if beta_steps < 1:
            raise ValueError(f"beta_steps must be >= 1, got {beta_steps}")
        if eps < 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        self.alpha = float(alpha)
        self.beta0 = float(beta0)
        self.beta_steps = int(beta_steps)
        self.eps = float(eps)
        self.tree = SumTree(self.capacity)
        self.max_priority = 1.0
        self.sample_calls = 0

    @property
    def beta(self) -> float:
        """β used by the next ``sample`` call."""
        return self.beta0 + (1.0 - self.beta0) * min(1.0, self.sample_calls / self.beta_steps)

    def add_batch(
        self, obs: ArrayLike, actions: ArrayLike, rewards: ArrayLike, next_obs: ArrayLike, dones: ArrayLike
    ) -> np.ndarray:
        idx = super().add_batch(obs, actions, rewards, next_obs, dones)
        self.tree.update(idx, self.max_priority)
        return idx

    def probabilities(self) -> np.ndarray:
        """P(i) for the filled slots 0..size-1."""
        p = np.asarray(self.tree.leaves[: self.size])
        return p / self.tree.total()

    def sample(self, batch_size: int) -> Batch:
        self._check_sample(batch_size)
        total = self.tree.total()
        if total <= 0.0:
            raise ValueError("all priorities are 0; use eps > 0")
        segment = total / max(batch_size, 1)
        prefix = (np.arange(batch_size) + self.rng.random(batch_size)) * segment
        idx = self.tree.find(prefix)
        beta = self.beta
        self.sample_calls += 1
        probs = self.tree[idx] / total
        leaves = self.tree.leaves[: self.size]
        p_min = leaves[leaves > 0].min() / total
        weights = (self.size * probs) ** (-beta) / (self.size * p_min) ** (-beta)
        return self._gather(idx, weights)

    def update_priorities(self, indices: ArrayLike, td_errors: ArrayLike) -> None:
        """Set p_i = (|δ_i| + eps)^α for the given slots (e.g. ``batch.indices``)."""
        indices = np.atleast_1d(np.asarray(indices, dtype=np.int64))
        td = np.abs(np.atleast_1d(np.asarray(td_errors, dtype=np.float64)))
        if indices.shape != td.shape:
            raise ValueError(f"indices {indices.shape} and td_errors {td.shape} differ in shape")
        if indices.size and (indices.min() < 0 or indices.max() >= self.size):
            raise IndexError(f"priority index out of the filled range [0, {self.size})")
        priorities = (td + self.eps) ** self.alpha
        self.tree.update(indices, priorities)
        if priorities.size:
            self.max_priority = max(self.max_priority, float(priorities.max()))


class DualReplayBuffer:
    """Paper 000's dual buffer: an expert pool (demonstrations) and an online pool.

    Each batch of B rows takes ``n_e = round(expert_ratio · B)`` rows (half rounds up) from the expert
    pool and ``B − n_e`` from the online pool, expert rows first. Pools are sampled with replacement, so
    the only shortage is an empty pool: if the expert pool is empty every row is online, if the online
    pool is empty every row is expert. ``Batch.source`` is True on expert rows; expert rows have weight 1,
    online rows keep the online buffer's weights (IS weights when it is prioritized).
    """

    def __init__(
        self, expert: ReplayBuffer, online: ReplayBuffer | PrioritizedReplayBuffer, expert_ratio: float = 0.1
    ) -> None:
        if not 0.0 <= expert_ratio <= 1.0:
            raise ValueError(f"expert_ratio must be in [0, 1], got {expert_ratio}")
        if expert.obs_shape != online.obs_shape or expert.action_shape != online.action_shape:
            raise ValueError("expert and online pools must have the same obs_shape and action_shape")
        self.expert = expert
        self.online = online
        self.expert_ratio = float(expert_ratio)

    def __len__(self) -> int:
        return len(self.expert) + len(self.online)

    def n_expert(self, batch_size: int) -> int:
        """Expert rows in a batch of ``batch_size`` given the current pool sizes."""
        if self.expert.size == 0 and self.online.size == 0:
            raise ValueError("cannot sample: both expert and online pools are empty")
        if self.expert.size == 0:
            return 0
        if self.online.size == 0:
            return batch_size
        return int(np.floor(self.expert_ratio * batch_size + 0.5))

    def add(self, obs: ArrayLike, action: ArrayLike, reward: float, next_obs: ArrayLike, done: bool) -> int:
        """Store one transition in the online pool."""
        return self.online.add(obs, action, reward, next_obs, done)

    def sample(self, batch_size: int) -> Batch:
        n_e = self.n_expert(batch_size)
        parts = [pool.sample(n) for pool, n in ((self.expert, n_e), (self.online, batch_size - n_e)) if n > 0]
        if not parts:  # batch_size == 0
            parts = [self.online.sample(0) if self.online.size else self.expert.sample(0)]
        fields = [np.concatenate([getattr(p, f) for p in parts]) for f in Batch._fields[:-1]]
        source = np.zeros(batch_size, dtype=bool)
        source[:n_e] = True
        return Batch(*fields, source=source)

    def update_priorities(self, batch: Batch, td_errors: ArrayLike) -> None:
        """Forward the TD errors of the online rows to a prioritized online pool (no-op otherwise)."""
        if not isinstance(self.online, PrioritizedReplayBuffer) or batch.source is None:
            return
        online = ~batch.source
        self.online.update_priorities(batch.indices[online], np.asarray(td_errors)[online])
