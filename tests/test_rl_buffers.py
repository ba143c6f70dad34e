"""hsched.rl: replay buffers (uniform, prioritized sum-tree, paper 000's dual buffer), ε-greedy,
schedules and target updates, against hand-computed values and seeded statistical checks."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from hsched.rl import (
    Batch,
    DualReplayBuffer,
    ExponentialSchedule,
    LinearSchedule,
    PrioritizedReplayBuffer,
    ReplayBuffer,
    SumTree,
    epsilon_greedy,
    hard_update,
    soft_update,
)

# χ² critical value at p = 0.999 for 4 degrees of freedom (tables): a correct sampler fails 1 time in 1000,
# a sampler off by a few % on 100 000 draws fails every time. Seeds are fixed, so the tests are deterministic.
CHI2_999_DF4 = 18.467


def _fill(buf: ReplayBuffer, n: int, start: int = 0) -> np.ndarray:
    """Add n transitions whose obs/reward encode their insertion number."""
    k = np.arange(start, start + n)
    obs = np.repeat(k[:, None].astype(np.float32), buf.obs_shape[0], axis=1)
    return buf.add_batch(obs, k % 3, k.astype(np.float32), obs + 1, k % 2 == 0)


def _assert_tree_consistent(tree: SumTree) -> None:
    inner = np.arange(1, tree.n_leaves)
    np.testing.assert_allclose(tree.tree[inner], tree.tree[2 * inner] + tree.tree[2 * inner + 1], rtol=1e-12)
    assert np.all(tree.tree[tree.n_leaves + tree.capacity :] == 0.0)  # padding leaves stay empty


# ------------------------------------------------------------------------------------------------------------
# uniform replay


def test_replay_buffer_add_is_circular_and_sample_weights_are_one():
    buf = ReplayBuffer(4, obs_shape=2, seed=0)
    assert [buf.add([k, k], k, float(k), [k + 1, k + 1], False) for k in range(6)] == [0, 1, 2, 3, 0, 1]
    assert len(buf) == 4 and buf.pos == 2
    np.testing.assert_array_equal(buf.rewards, [4, 5, 2, 3])  # slots 0,1 overwritten by transitions 4,5
    batch = buf.sample(64)
    assert isinstance(batch, Batch) and batch.source is None
    assert batch.obs.shape == (64, 2) and batch.actions.shape == (64,) and batch.actions.dtype == np.int64
    np.testing.assert_array_equal(batch.weights, np.ones(64, dtype=np.float32))
    np.testing.assert_array_equal(batch.rewards, buf.rewards[batch.indices])
    np.testing.assert_array_equal(batch.next_obs, batch.obs + 1)


def test_add_batch_larger_than_capacity_keeps_the_last_transitions():
    buf = ReplayBuffer(3, obs_shape=(1,), seed=0)
    _fill(buf, 7)  # transitions 0..6 → slots 0,1,2,0,1,2,0 → slot contents 6,4,5
    np.testing.assert_array_equal(buf.rewards, [6, 4, 5])
    assert buf.pos == 1 and len(buf) == 3


def test_sampling_an_empty_buffer_is_an_error():
    with pytest.raises(ValueError, match="empty"):
        ReplayBuffer(3, obs_shape=1).sample(2)


# ------------------------------------------------------------------------------------------------------------
# sum tree


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(1, 40),
    updates=st.lists(
        st.lists(st.tuples(st.integers(0, 1000), st.floats(0, 1e3, allow_nan=False)), min_size=1, max_size=20),
        max_size=10,
    ),
)
def test_sum_tree_total_is_the_sum_of_priorities(capacity, updates):
    tree = SumTree(capacity)
    expected = np.zeros(capacity)
    for chunk in updates:
        idx = np.array([i % capacity for i, _ in chunk])
        pri = np.array([p for _, p in chunk])
        tree.update(idx, pri)
        for i, p in zip(idx, pri, strict=True):  # repeated index: the last write wins
            expected[i] = p
    assert tree.total() == pytest.approx(expected.sum(), rel=1e-12, abs=1e-12)
    np.testing.assert_array_equal(tree.leaves, expected)
    assert tree.max() == expected.max()
    _assert_tree_consistent(tree)


def test_sum_tree_find_by_hand():
    tree = SumTree(5)  # 8 leaves, 3 of them padding
    tree.update([0, 1, 2, 3, 4], [1.0, 2.0, 0.0, 3.0, 4.0])  # cumulative edges 0 |1| 3 |3| 6 | 10
    prefix = [0.0, 0.99, 1.0, 2.99, 3.0, 5.99, 6.0, 9.99, 10.0, 12.0, -1.0]
    # 3.0 skips the empty leaf 2; 10.0 (= total) and 12.0 are clipped to the last non-empty leaf; -1 → 0
    np.testing.assert_array_equal(tree.find(prefix), [0, 0, 1, 1, 3, 3, 4, 4, 4, 4, 0])
    assert tree.find(np.array([[0.5, 7.0]])).shape == (1, 2)


def test_sum_tree_sampling_is_proportional_to_priority():
    priorities = np.array([1.0, 2.0, 3.0, 4.0, 0.0, 5.0])
    tree = SumTree(len(priorities))
    tree.update(np.arange(len(priorities)), priorities)
    rng = np.random.default_rng(12345)
    n = 100_000
    counts = np.bincount(tree.find(rng.random(n) * tree.total()), minlength=len(priorities))
    assert counts[4] == 0  # zero priority is never drawn
    expected = n * priorities / priorities.sum()
    nz = priorities > 0
    chi2 = float((((counts - expected) ** 2)[nz] / expected[nz]).sum())  # 5 categories → 4 d.o.f.
    assert chi2 < CHI2_999_DF4, (chi2, counts)


# ------------------------------------------------------------------------------------------------------------
# prioritized replay


def test_per_stratified_sampling_frequencies_follow_priorities():
    buf = PrioritizedReplayBuffer(5, obs_shape=1, seed=7, alpha=1.0, eps=0.0)
    _fill(buf, 5)
    buf.update_priorities(np.arange(5), [1.0, 2.0, 3.0, 4.0, 5.0])
    counts = np.zeros(5)
    for _ in range(1000):  # 100 000 draws
        counts += np.bincount(buf.sample(100).indices, minlength=5)
    expected = 100_000 * np.arange(1, 6) / 15
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_999_DF4, (chi2, counts)


def test_importance_weights_by_hand():
    # α = 1, ε = 0: priorities p = |δ| = 1, 2, 1 → P = 1/4, 1/2, 1/4, N = 3, β = 0.5.
    # raw w = (N·P)^−β: (3/4)^−½ = 2/√3 ≈ 1.1547, (3/2)^−½ = √(2/3) ≈ 0.8165, 2/√3.
    # normalised by the largest (2/√3): 1, √(2/3)·√3/2 = 1/√2 ≈ 0.7071, 1.
    # Stratified batch of 4 over total 4: one draw in each of [0,1), [1,2), [2,3), [3,4) → leaves 0, 1, 1, 2.
    buf = PrioritizedReplayBuffer(3, obs_shape=1, seed=0, alpha=1.0, beta0=0.5, eps=0.0)
    _fill(buf, 3)
    buf.update_priorities([0, 1, 2], [1.0, -2.0, 1.0])  # |δ|: sign is irrelevant
    np.testing.assert_allclose(buf.probabilities(), [0.25, 0.5, 0.25])
    batch = buf.sample(4)
    np.testing.assert_array_equal(batch.indices, [0, 1, 1, 2])
    np.testing.assert_allclose(batch.weights, [1.0, 1 / math.sqrt(2), 1 / math.sqrt(2), 1.0], rtol=1e-6)
    np.testing.assert_array_equal(batch.rewards, [0.0, 1.0, 1.0, 2.0])


def test_priority_formula_uses_alpha_and_eps():
    buf = PrioritizedReplayBuffer(2, obs_shape=1, alpha=0.5, eps=0.25)
    _fill(buf, 2)
    buf.update_priorities([0, 1], [0.0, -3.75])  # (0 + .25)^.5 = .5, (3.75 + .25)^.5 = 2
    np.testing.assert_allclose(buf.tree.leaves, [0.5, 2.0])
    assert buf.tree.total() == pytest.approx(2.5)


def test_beta_anneals_linearly_to_one():
    buf = PrioritizedReplayBuffer(4, obs_shape=1, seed=0, beta0=0.4, beta_steps=10)
    _fill(buf, 4)
    assert buf.beta == pytest.approx(0.4)
    for _ in range(5):
        buf.sample(2)
    assert buf.beta == pytest.approx(0.7)
    for _ in range(5):
        buf.sample(2)
    assert buf.beta == 1.0
    buf.sample(2)
    assert buf.beta == 1.0  # stays at 1


def test_new_transitions_get_the_max_priority():
    buf = PrioritizedReplayBuffer(8, obs_shape=1, alpha=1.0, eps=0.0)
    _fill(buf, 2)
    np.testing.assert_array_equal(buf.tree.leaves[:2], [1.0, 1.0])  # initial max priority is 1
    buf.update_priorities([0, 1], [3.0, 0.5])
    (slot,) = _fill(buf, 1, start=2)
    assert buf.tree[slot] == 3.0 == buf.max_priority
    buf.update_priorities([0], [0.1])  # the running max does not decrease
    assert buf.tree[_fill(buf, 1, start=3)[0]] == 3.0


def test_circular_overwrite_keeps_the_tree_consistent():
    rng = np.random.default_rng(3)
    buf = PrioritizedReplayBuffer(5, obs_shape=1, seed=1, alpha=1.0, eps=0.0)
    expected = np.zeros(5)
    for step in range(23):
        (slot,) = _fill(buf, 1, start=step)
        assert slot == step % 5
        expected[slot] = buf.max_priority
        if step % 3 == 0:
            batch = buf.sample(4)
            td = rng.random(4) * 10
            buf.update_priorities(batch.indices, td)
            for i, d in zip(batch.indices, td, strict=True):
                expected[i] = d
        np.testing.assert_allclose(buf.tree.leaves, expected)
        assert buf.tree.total() == pytest.approx(expected.sum())
        _assert_tree_consistent(buf.tree)
    assert len(buf) == 5
    np.testing.assert_array_equal(np.sort(buf.rewards), [18, 19, 20, 21, 22])


def test_update_priorities_rejects_unfilled_slots():
    buf = PrioritizedReplayBuffer(4, obs_shape=1)
    _fill(buf, 2)
    with pytest.raises(IndexError):
        buf.update_priorities([2], [1.0])


# ------------------------------------------------------------------------------------------------------------
# dual buffer (paper 000)


def _pools(n_expert: int, n_online: int, prioritized: bool = False):
    expert = ReplayBuffer(100, obs_shape=1, seed=1)
    online_cls = PrioritizedReplayBuffer if prioritized else ReplayBuffer
    online = online_cls(1000, obs_shape=1, seed=2)
    if n_expert:
        expert.add_batch(np.ones((n_expert, 1)), np.zeros(n_expert), np.ones(n_expert), np.ones((n_expert, 1)),
                         np.zeros(n_expert))
    if n_online:
        online.add_batch(np.zeros((n_online, 1)), np.zeros(n_online), np.zeros(n_online),
                         np.zeros((n_online, 1)), np.zeros(n_online))
    return expert, online


@pytest.mark.parametrize("prioritized", [False, True])
def test_dual_buffer_takes_round_ratio_times_batch_from_the_expert_pool(prioritized):
    dual = DualReplayBuffer(*_pools(50, 500, prioritized), expert_ratio=0.1)
    for _ in range(20):
        batch = dual.sample(256)
        assert batch.source is not None and batch.source.dtype == bool
        assert int(batch.source.sum()) == 26  # round(0.1 · 256) = round(25.6), exactly, every batch
        np.testing.assert_array_equal(batch.obs[:, 0] == 1.0, batch.source)  # expert rows are tagged
        np.testing.assert_array_equal(batch.weights[batch.source], 1.0)
        assert batch.indices[batch.source].max() < 50 and batch.indices[~batch.source].max() < 500
    assert dual.n_expert(10) == 1 and dual.n_expert(15) == 2  # 1.5 rounds half up


def test_dual_buffer_falls_back_when_one_pool_is_empty():
    only_online = DualReplayBuffer(*_pools(0, 30), expert_ratio=0.1).sample(256)
    assert not only_online.source.any() and len(only_online.obs) == 256
    only_expert = DualReplayBuffer(*_pools(30, 0), expert_ratio=0.1).sample(256)
    assert only_expert.source.all() and len(only_expert.obs) == 256
    with pytest.raises(ValueError, match="both"):
        DualReplayBuffer(*_pools(0, 0)).sample(8)


def test_dual_buffer_forwards_online_td_errors_only():
    expert, online = _pools(10, 10, prioritized=True)
    online.alpha, online.eps = 1.0, 0.0
    dual = DualReplayBuffer(expert, online, expert_ratio=0.5)
    batch = dual.sample(8)
    dual.update_priorities(batch, np.full(8, 7.0))
    touched = np.unique(batch.indices[~batch.source])
    np.testing.assert_array_equal(online.tree[touched], 7.0)
    assert online.tree.total() == pytest.approx(7.0 * len(touched) + (10 - len(touched)))


# ------------------------------------------------------------------------------------------------------------
# ε-greedy, schedules, target updates


@st.composite
def _q_and_mask(draw):
    b, a = draw(st.integers(1, 6)), draw(st.integers(1, 8))
    q = draw(hnp.arrays(np.float64, (b, a), elements=st.floats(-1e6, 1e6)))
    mask = draw(hnp.arrays(np.bool_, (b, a)))
    mask[np.arange(b), draw(hnp.arrays(np.int64, b, elements=st.integers(0, a - 1)))] = True
    return q, mask


@settings(max_examples=100, deadline=None)
@given(qm=_q_and_mask(), epsilon=st.floats(0.0, 1.0), seed=st.integers(0, 2**32 - 1))
def test_epsilon_greedy_never_returns_a_masked_action(qm, epsilon, seed):
    q, mask = qm
    actions = epsilon_greedy(q, epsilon, np.random.default_rng(seed), mask)
    assert actions.shape == (q.shape[0],)
    assert mask[np.arange(q.shape[0]), actions].all()
    greedy = epsilon_greedy(q, 0.0, np.random.default_rng(seed), mask)
    np.testing.assert_array_equal(greedy, np.argmax(np.where(mask, q, -np.inf), axis=1))


def test_epsilon_greedy_by_hand():
    rng = np.random.default_rng(0)
    q = np.array([[5.0, 1.0, 3.0], [0.0, 9.0, 2.0]])
    mask = np.array([[False, True, True], [True, True, True]])
    np.testing.assert_array_equal(epsilon_greedy(q, 0.0, rng, mask), [2, 1])  # 5 and the masked 0 skipped
    assert epsilon_greedy(q[0], 0.0, rng) == 0 and isinstance(epsilon_greedy(q[0], 0.0, rng), int)
    # ε = 1: uniform over the 2 allowed actions of row 0, never action 0
    draws = np.array([epsilon_greedy(q[0], 1.0, rng, mask[0]) for _ in range(4000)])
    assert set(np.unique(draws)) == {1, 2}
    assert abs((draws == 1).mean() - 0.5) < 0.04
    with pytest.raises(ValueError, match="allowed"):
        epsilon_greedy(q[0], 0.1, rng, np.zeros(3, dtype=bool))


def test_linear_schedule_by_hand():
    s = LinearSchedule(start=1.0, end=0.05, steps=100)
    assert s(0) == 1.0
    assert s(50) == pytest.approx(0.525)  # 1 + (0.05 − 1)·0.5
    assert s(100) == pytest.approx(0.05) and s(1000) == pytest.approx(0.05)
    np.testing.assert_allclose(s(np.array([0, 20, 200])), [1.0, 0.81, 0.05])


def test_exponential_schedule_by_hand():
    s = ExponentialSchedule(start=1.0, end=0.1, decay=0.5)
    assert [s(t) for t in range(5)] == pytest.approx([1.0, 0.5, 0.25, 0.125, 0.1])  # 0.0625 floored at 0.1


def test_soft_and_hard_update_by_hand():
    target = {"w": np.array([0.0, 10.0]), "b": np.array([2.0])}
    source = {"w": np.array([10.0, 0.0]), "b": np.array([4.0])}
    w = target["w"]
    soft_update(target, source, tau=0.1)  # 0.9·t + 0.1·s
    assert target["w"] is w  # in place
    np.testing.assert_allclose(target["w"], [1.0, 9.0])
    np.testing.assert_allclose(target["b"], [2.2])
    hard_update(target, source)
    np.testing.assert_array_equal(target["w"], [10.0, 0.0])
    with pytest.raises(KeyError):
        soft_update({"w": np.zeros(1)}, {"v": np.zeros(1)}, 0.5)


class _FakeTensor:
    """Mimics the in-place torch API that soft_update uses."""

    def __init__(self, value: float) -> None:
        self.value = value

    def mul_(self, k: float) -> _FakeTensor:
        self.value *= k
        return self

    def add_(self, other: _FakeTensor, alpha: float = 1.0) -> _FakeTensor:
        self.value += alpha * other.value
        return self


def test_soft_update_uses_the_in_place_tensor_api():
    t = {"w": _FakeTensor(0.0)}
    soft_update(t, {"w": _FakeTensor(10.0)}, tau=0.25)
    assert t["w"].value == pytest.approx(2.5)
