"""Slice types (paper 001 §2.1): hand-computed clustering, idle fraction, Q knee and node partition."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hsched.policies.slices import (
    choose_q,
    cluster_demands,
    comparable,
    idle_fraction,
    merge_distance,
    partition_node,
    q_curve,
    uniform_type,
)

A, B, C = (2.0, 4.0), (4.0, 2.0), (5.0, 5.0)  # the paper's 2 core/4 GB vs 4 core/2 GB example plus a big one


def test_eq1_two_singletons_are_half_their_euclidean_distance_apart():
    assert merge_distance(1, 1, np.array([0.0, 0.0]), np.array([3.0, 4.0])) == 2.5
    assert merge_distance(2, 1, np.array([0.0, 0.0]), np.array([3.0, 4.0])) == pytest.approx(2 / 3 * 5)


def test_connectivity_is_componentwise_order():
    assert comparable(np.array(A), np.array(C)) and comparable(np.array(C), np.array(B))
    assert not comparable(np.array(A), np.array(B))


def test_constrained_clustering_never_merges_incomparable_vectors():
    # singleton distances: A-B 0.5·√8 = 1.414 (closest), A-C = B-C = 0.5·√10 = 1.581
    plain = cluster_demands([A, B, C], 2, constrained=False)
    assert plain.sizes.tolist() == [[4.0, 4.0], [5.0, 5.0]]  # A+B merged, container = componentwise max
    con = cluster_demands([A, B, C], 2)
    # A-B is not admissible; A-C and B-C tie, the lower index pair (A, C) merges; the container is C itself
    assert con.sizes.tolist() == [[4.0, 2.0], [5.0, 5.0]]
    assert con.demands.tolist() == [list(A), list(B), list(C)]
    assert con.assignment.tolist() == [1, 0, 1]
    assert con.created == 0
    assert cluster_demands([A, B, C], 1).sizes.tolist() == [[5.0, 5.0]]  # B ≤ C: admissible


def test_degenerate_step_falls_back_to_distance_and_creates_a_type():
    types = cluster_demands([A, B], 1)
    assert types.sizes.tolist() == [[4.0, 4.0]] and types.created == 1


def test_scale_and_duplicates():
    types = cluster_demands([A, A, B, C], 3, scale=[10.0, 100.0])
    assert types.q == 3 and types.demands.shape == (3, 2)  # duplicates are one element
    assert types.smallest_fitting((4.5, 1.0)) == types.sizes.tolist().index([5.0, 5.0])
    assert types.smallest_fitting((6.0, 1.0)) == -1


def test_idle_fraction_by_hand():
    types = cluster_demands([A, B, C], 2)
    # reserved: A→(5,5), B→(4,2), C→(5,5) = (14, 12); used (11, 11): idle = (3/14 + 1/12) / 2
    got = idle_fraction(types, np.array([A, B, C]), np.ones(3))
    assert got == pytest.approx((3 / 14 + 1 / 12) / 2)
    assert idle_fraction(uniform_type([A, B, C]), np.array([A, B, C]), np.ones(3)) == pytest.approx(
        ((15 - 11) / 15 + (15 - 11) / 15) / 2)


def test_choose_q_is_the_knee():
    assert choose_q([1, 2, 3, 4], [0.8, 0.5, 0.45, 0.44], min_gain=0.1) == 2
    assert choose_q([1, 2, 3], [0.8, 0.5, 0.2], min_gain=0.1) == 3


def test_q_curve_is_monotone_for_the_constrained_method_on_a_chain():
    demands = np.array([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [4.0, 4.0]])
    curve = q_curve(demands, np.ones(4), q_max=4, min_gain=0.01)
    assert curve.constrained[-1] == 0.0 and curve.constrained[0] == pytest.approx(1 - 10 / 16)
    assert all(a >= b for a, b in zip(curve.constrained, curve.constrained[1:], strict=False))
    assert curve.uniform == curve.constrained[0] and curve.chosen_q == 4


def test_partition_node_by_hand():
    # volumes 0.1 and 0.4; the trace: small, big, small, small (big no longer fits), then small until full
    assert partition_node([10.0, 10.0], np.array([[1.0, 1.0], [4.0, 4.0]]), [1, 1]) == [6, 1]
    assert partition_node([10.0, 10.0], np.array([[3.0, 1.0]]), [1]) == [3]


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="q:"):
        cluster_demands([A], 0)
    with pytest.raises(ValueError, match="demands:"):
        cluster_demands([[1.0, -1.0]], 1)
    with pytest.raises(ValueError, match="scale:"):
        cluster_demands([A], 1, scale=[1.0])
    with pytest.raises(ValueError, match="shares:"):
        partition_node([1.0, 1.0], np.array([[1.0, 1.0]]), [0])


vectors = st.lists(st.tuples(st.integers(1, 8), st.integers(1, 8)), min_size=1, max_size=9)


@settings(max_examples=80, deadline=None)
@given(demands=vectors, q=st.integers(1, 10), constrained=st.booleans())
def test_every_demand_fits_its_type_and_q_is_honoured(demands, q, constrained):
    d = np.array(demands, dtype=float)
    types = cluster_demands(d, q, constrained=constrained)
    distinct = len({tuple(v) for v in demands})
    assert types.q == min(q, distinct)
    assert np.all(types.sizes[types.assignment] >= types.demands)
    assert 0.0 <= idle_fraction(types, d, np.ones(len(d))) <= idle_fraction(uniform_type(d), d, np.ones(len(d))) + 1e-9


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 5), min_size=1, max_size=6), q=st.integers(1, 6))
def test_a_chain_of_comparable_demands_never_invents_a_size(sizes, q):
    d = np.array([[s, 2 * s] for s in sizes], dtype=float)
    types = cluster_demands(d, q)
    assert types.created == 0
    assert all(any(np.allclose(t, v) for v in d) for t in types.sizes)
