"""FGD's expected fragmentation (hsched.metrics) and the FragmentationGradientDescent policy, by hand."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hsched.domain.cluster import ClusterState, GpuShare, Part
from hsched.domain.resources import Resources
from hsched.envs.gpu import GpuClusterEnv
from hsched.metrics import (
    TaskDistribution,
    fgd_expected_fragmentation,
    fgd_fragmentation,
    fgd_node_fragmentation,
)
from hsched.policies.base import select
from hsched.policies.fgd import FragmentationGradientDescent
from hsched.policies.heuristics import BestFit, make_policy
from tests.test_env_gpu import GIB, fleet, gpu_pool


def share(pct: int, cpu: int = 1000) -> Resources:
    """A one-card GPU-sharing request: pct % of the card's cores and pct % of its 10 GiB."""
    return Resources(cpu, 1024, 0, 0, 1, pct, pct * 10 * GIB // 100)


def test_expected_fragmentation_by_hand():
    # one node: 4 cores free, two cards idle 100 % and 30 %
    dist = TaskDistribution.from_tasks([share(50, 1000)] * 2 + [Resources(1000, 0, 0, 0, 1, 100, 10 * GIB)]
                                       + [Resources(2000, 1024)])
    assert dist.popularity.tolist() == [0.5, 0.25, 0.25]
    args = (np.array([4000]), np.array([64 * GIB]), np.array([0]), np.array([0]), np.array([[100, 30]]),
            np.array([[10 * GIB, 3 * GIB]]), ["T4"])
    # 50 % share: runs, card 1 (30 % < 50 %) is stranded -> 0.3
    # whole card: runs on card 0, card 1 stranded -> 0.3
    # CPU-only: every idle GPU is a fragment -> 1.3
    assert fgd_expected_fragmentation(*args, dist)[0] == pytest.approx(0.5 * 0.3 + 0.25 * 0.3 + 0.25 * 1.3)
    # a shape that cannot start (8 cores > 4 free) counts all idle GPU: 1.3
    big = TaskDistribution.from_tasks([share(10, 8000)])
    assert fgd_expected_fragmentation(*args, big)[0] == pytest.approx(1.3)
    # the card's memory matters too: 30 % core free but only 1 GiB -> a 20 % / 2 GiB slice does not fit there
    small = TaskDistribution.from_tasks([share(20)])
    args_mem = (*args[:5], np.array([[10 * GIB, 1 * GIB]]), ["T4"])
    assert fgd_expected_fragmentation(*args, small)[0] == pytest.approx(0.0)
    assert fgd_expected_fragmentation(*args_mem, small)[0] == pytest.approx(0.3)
    # a GPU model the shape excludes: cannot run
    from hsched.domain.task import TaskSpec

    v100 = TaskDistribution.from_tasks([TaskSpec(share(20), 1.0, gpu_models=("V100",))])
    assert fgd_expected_fragmentation(*args, v100)[0] == pytest.approx(1.3)


def test_distribution_from_tasks_counts_replicas_and_keeps_typical_shapes():
    from hsched.domain.task import TaskSpec

    a, b, c = share(50), share(20), Resources(1000, 1024)
    dist = TaskDistribution.from_tasks([TaskSpec(a, 1.0, replicas=3), TaskSpec(b, 1.0), TaskSpec(c, 1.0)])
    assert dist.popularity.tolist() == [0.6, 0.2, 0.2] and dist.gpu_core_percent.tolist() == [50, 20, 0]
    top = TaskDistribution.from_tasks([TaskSpec(a, 1.0, replicas=3), TaskSpec(b, 1.0), TaskSpec(c, 1.0)],
                                      max_types=1)
    assert top.popularity.tolist() == [1.0]
    with pytest.raises(ValueError):
        TaskDistribution.from_tasks([])


@pytest.fixture
def two_nodes() -> ClusterState:
    """Node A: its one card 40 % used (60 % idle); node B: an idle card. Same CPU and memory (10 cores,
    10 GiB)."""
    (dc,) = fleet([gpu_pool("a"), gpu_pool("b")])
    state = ClusterState(dc)
    state.apply("x", (Part(0, 0, 0, 0, 0, 0, 0, (GpuShare(0, 40, 4 * GIB),)),))
    return state


def test_fgd_picks_differently_from_bestfit(two_nodes):
    """The workload is all 50 % GPU shares; the task asks for 30 %.

    BestFit packs: it picks A, the node left with less free capacity (card 60 % -> 30 % idle).
    FGD: on A the card would keep 30 % idle, which no 50 % task can use: F_A goes 0 -> 0.3 (Δ = +0.3).
    On B it keeps 70 % idle, still room for a 50 % task: F_B stays 0 (Δ = 0). FGD picks B.
    """
    fgd = FragmentationGradientDescent.from_tasks([share(50)])
    demand = share(30)
    mask = two_nodes.feasible(demand)
    assert mask.tolist() == [True, True]
    np.testing.assert_allclose(fgd.delta(two_nodes, demand, np.array([0, 1])), [0.3, 0.0])
    np.testing.assert_allclose(fgd.scores(two_nodes, demand, mask), [-0.3, 0.0])
    assert select(fgd, two_nodes, demand, mask).node == 1
    assert select(BestFit(), two_nodes, demand, mask).node == 0
    # and FGD's scoring leaves the state as it found it
    assert two_nodes.gpu_free_core[:, 0].tolist() == [60, 100]
    # masked-out nodes are never scored
    only_a = np.array([True, False])
    assert fgd.scores(two_nodes, demand, only_a)[1] == -np.inf
    assert select(fgd, two_nodes, demand, only_a).node == 0


def test_fgd_measure_agrees_with_cluster_feasibility():
    """F_n({m}) is the node's idle GPU exactly where ClusterState.feasible says m cannot run (one formula for
    "can run" in FGD and in the placer's mask), after a random run on the paper-scale fleet."""
    env = GpuClusterEnv()
    rng = np.random.default_rng(0)
    _, info = env.reset(seed=0)
    for _ in range(120):
        *_, info = env.step(int(rng.choice(np.flatnonzero(info["action_mask"]))))
    state = env.view.fleet
    idle = state.gpu_free_core.sum(axis=1) / 100
    shapes = (share(50), share(100), Resources(64000, 1024, 0, 0, 1, 10, GIB),
              Resources(4000, 1024, 0, 0, 2, 100, 16 * GIB))
    for shape in shapes:
        frag = fgd_node_fragmentation(state, TaskDistribution.from_tasks([shape]))
        cannot = ~state.feasible(shape)
        assert cannot.any() and (~cannot).any()
        np.testing.assert_allclose(frag[cannot], idle[cannot])
        assert (frag[~cannot] < idle[~cannot] + 1e-12).all()
    assert fgd_fragmentation(env.clusters, env.distribution) == pytest.approx(
        fgd_fragmentation([state], env.distribution))


def test_fgd_from_openb_runs_in_the_env():
    fgd = FragmentationGradientDescent.from_openb()
    assert len(fgd.distribution) == 151 and fgd.distribution.popularity.sum() == pytest.approx(1.0)
    assert fgd.name == "fgd"
    from hsched.envs.gpu import run_policy

    env = GpuClusterEnv()
    m_fgd = run_policy(env, fgd, seed=0).metrics
    m_random = run_policy(env, make_policy("random", 0), seed=0).metrics
    assert m_fgd["failed"] == 0
    assert m_fgd["fgd_fragmentation"] < m_random["fgd_fragmentation"]  # what FGD descends on


def _reference_fragmentation(free_cpu, free_memory, free_disk, free_bandwidth, core, gmem, models, dist):
    """fgd_expected_fragmentation as it was before it was built shape-major (node-major, numpy's sum over the
    cards axis): the optimised path must give the same floats, bit for bit."""
    from hsched.metrics import _slice_sizes

    idle = core.sum(axis=1) / 100.0
    host_ok = ((free_cpu[:, None] >= dist.cpu_milli[None, :]) & (free_memory[:, None] >= dist.memory_mib[None, :])
               & (free_disk[:, None] >= dist.disk_mib[None, :])
               & (free_bandwidth[:, None] >= dist.bandwidth_mbps[None, :]))
    sizes, shape_size = _slice_sizes(dist)
    holds = (core[:, :, None] >= sizes[None, None, :, 0]) & (gmem[:, :, None] >= sizes[None, None, :, 1])
    runs = host_ok & (holds.sum(axis=1)[:, shape_size] >= dist.gpu_count[None, :]) & (dist.gpu_count > 0)[None, :]
    for m, allowed in enumerate(dist.gpu_models):
        if allowed:
            runs[:, m] &= np.isin(np.asarray(models), list(allowed))
    stranded = np.einsum("kg,kgu->ku", core / 100.0, ~holds)[:, shape_size]
    return np.where(runs, stranded, idle[:, None]) @ dist.popularity


def _random_nodes(rng, k, cards=8):
    cpu, mem = rng.integers(0, 96_001, k), rng.integers(0, 400_000, k)
    cpu[: k // 4] = 0  # no shape runs there: F = the idle share
    disk, bw = rng.integers(0, 10**6, k), rng.integers(0, 10**5, k)
    # cards idle, full or partly used, so every slice size is held by some cards and not by others
    core = rng.choice([0, 5, 25, 50, 60, 100], (k, cards))
    gmem = rng.choice([0, 1024, 4096, 16_000, 32_000], (k, cards))
    models = list(rng.choice(["V100M32", "T4", "A10"], k))
    return cpu, mem, disk, bw, core, gmem, models


@pytest.mark.parametrize("k", [1, 2, 7, 300, 512])
@pytest.mark.parametrize("seed", range(3))
def test_expected_fragmentation_equals_the_reference_on_random_states(seed, k):
    import dataclasses

    from hsched.policies.fgd import openb_distribution

    rng = np.random.default_rng(seed)
    openb = openb_distribution()  # no disk or bandwidth needs, no GPU models: those tests are skipped
    m = len(openb)
    demanding = dataclasses.replace(  # the same shapes asking disk, bandwidth and (some) GPU models
        openb, disk_mib=rng.integers(0, 10**6, m), bandwidth_mbps=rng.integers(0, 10**5, m),
        gpu_models=tuple(("T4", "A10") if i % 3 == 0 else ("V100M32",) if i % 3 == 1 else () for i in range(m)))
    for dist in (openb, demanding):
        cpu, mem, disk, bw, core, gmem, models = _random_nodes(rng, k)
        got = fgd_expected_fragmentation(cpu, mem, disk, bw, core, gmem, models, dist)
        want = _reference_fragmentation(cpu, mem, disk, bw, core, gmem, models, dist)
        assert got.shape == (k,) and got.tobytes() == want.tobytes()
        if k >= 300:
            differs = ~np.isclose(got, core.sum(axis=1) / 100.0)
            assert not differs[: k // 4].any() and differs[k // 4:].any()  # the card test mattered on some nodes


@pytest.mark.parametrize("cards", [1, 2, 3, 4, 8])
def test_count_per_row_counts_over_the_cards_axis(cards):
    from hsched.domain.cluster import count_per_row

    rng = np.random.default_rng(cards)
    flags = rng.random((50, cards, 7)) < 0.5
    assert np.array_equal(count_per_row(flags), flags.sum(axis=1))
    for rows in (flags[:, :, 0], flags[:, :, 0].copy(), flags[::2, :, 3].copy(), flags[:0, :, 0].copy()):
        got = count_per_row(rows)  # strided, contiguous (one word per row for 1/2/4/8 cards), empty
        assert got.dtype == np.int16 and np.array_equal(got, rows.sum(axis=1))
    full = np.ones((5, cards), dtype=bool)
    assert (count_per_row(full) == cards).all() and (count_per_row(~full) == 0).all()


# ------------------------------------------------------------------------------------------------------------
# the policy's memo of F_n(M) and its evaluation once per distinct state row: the same scores as evaluating
# every candidate's before and after, whatever changed the state in between


def _reference_delta(state: ClusterState, dist: TaskDistribution, demand: Resources, nodes) -> np.ndarray:
    """FragmentationGradientDescent.delta as it was before the memo and the distinct rows: every candidate's
    before and after in one evaluation. (+ 0.0: that version's sign of a zero difference was float noise.)"""
    from hsched.policies.fgd import chosen_cards

    nodes = np.asarray(nodes, dtype=np.int64)
    core, gmem = state.gpu_free_core[nodes], state.gpu_free_memory[nodes]
    core_after, gmem_after = core.copy(), gmem.copy()
    if demand.gpu_count and len(nodes):
        rows, cards = chosen_cards(core, gmem, demand)
        core_after[rows, cards] -= demand.gpu_core_percent
        gmem_after[rows, cards] -= demand.gpu_memory_mib
    free = [state.free_cpu[nodes], state.free_memory[nodes], state.free_disk[nodes], state.free_bandwidth[nodes]]
    need = [demand.cpu_milli, demand.memory_mib, demand.disk_mib, demand.bandwidth_mbps]
    models = state._models[nodes]
    both = fgd_expected_fragmentation(*(np.concatenate([f, f - d]) for f, d in zip(free, need, strict=True)),
                                      np.concatenate([core, core_after]), np.concatenate([gmem, gmem_after]),
                                      np.concatenate([models, models]), dist)
    return np.round(both[len(nodes):] - both[:len(nodes)], 9) + 0.0


def _openb_room() -> ClusterState:
    """kansas-city's 150 GPU hosts (its machine mix: idle hosts of a type share one state row)."""
    from hsched.domain.fleet import load_fleet

    return ClusterState(load_fleet(None).datacenter("kansas-city"))


_STEP = st.one_of(
    st.tuples(st.just("place"), st.integers(0, 10**6), st.integers(0, 10**6)),
    st.tuples(st.just("release"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("write"), st.integers(0, 10**6), st.integers(0, 10**6)),  # bypasses apply / release
    st.tuples(st.just("score"), st.integers(0, 10**6), st.integers(0, 10**6)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(_STEP, min_size=1, max_size=60), shapes=st.none() | st.lists(st.integers(0, 10**6),
                                                                                   min_size=1, max_size=40))
def test_fgd_delta_is_the_reference_through_any_state_changes(steps, shapes):
    """Placements, releases and direct writes to the free arrays (as the envs' resets and shared cluster views
    do), in any order: every score equals the reference's bytes. Workloads: openb's (8,152 tasks), or up to 40
    of its tasks (fewer than 256, so no exact fragmentation difference sits on a 1e-9 rounding boundary, where
    the reference itself would follow the float noise of its summation order)."""
    from hsched.policies.fgd import openb_tasks

    tasks = openb_tasks()
    dist = FragmentationGradientDescent.from_openb().distribution if shapes is None \
        else TaskDistribution.from_tasks([tasks[i % len(tasks)] for i in shapes])
    fgd = FragmentationGradientDescent(dist)
    state = _openb_room()
    held: list[str] = []
    for i, (op, a, b) in enumerate(steps):
        demand = tasks[a % len(tasks)].resources
        if op == "place" or op == "score":
            nodes = np.flatnonzero(state.feasible(demand))
            if not len(nodes):
                continue
            rng = np.random.default_rng(b)
            cand = np.sort(rng.choice(nodes, int(rng.integers(1, len(nodes) + 1)), replace=False))
            got = fgd.scores_at(state, demand, cand)
            assert got.tobytes() == (-_reference_delta(state, dist, demand, cand)).tobytes()
            if op == "place":
                node = int(cand[np.argmax(got)])
                state.apply(f"t{i}", (Part(0, 0, node, demand.cpu_milli, demand.memory_mib, demand.disk_mib,
                                           demand.bandwidth_mbps, state.choose_cards(node, demand)),))
                held.append(f"t{i}")
        elif op == "release" and held:
            state.release(held.pop(a % len(held)))
        elif op == "write":  # one node's free CPU or one card's free core / memory set to a value within capacity
            node, t = a % state.n, state.table
            which = b % 3
            if which == 0:
                state.free_cpu[node] = b % (t.cpu_milli[node] + 1)
            else:
                card = b % t.gpu_core_percent.shape[1]
                cap = (t.gpu_core_percent if which == 1 else t.gpu_memory_mib)[node, card]
                (state.gpu_free_core if which == 1 else state.gpu_free_memory)[node, card] = b % (cap + 1)


def test_fgd_scores_every_node_as_the_reference_on_a_loaded_room():
    """The unbounded path (`scores`, every feasible node) on a room filled by FGD itself, for 40 demands."""
    from hsched.policies.fgd import openb_tasks

    tasks, state = openb_tasks(), _openb_room()
    fgd = FragmentationGradientDescent.from_openb()
    for i in range(400):
        demand = tasks[i].resources
        mask = state.feasible(demand)
        if not mask.any():
            continue
        s = fgd.scores(state, demand, mask)
        if i % 10 == 0:
            want = np.full(state.n, -np.inf)
            want[mask] = -_reference_delta(state, fgd.distribution, demand, np.flatnonzero(mask))
            assert s.tobytes() == want.tobytes()
        node = int(np.argmax(s))
        state.apply(f"t{i}", (Part(0, 0, node, demand.cpu_milli, demand.memory_mib, 0, 0,
                                   state.choose_cards(node, demand)),))
    assert state.utilisation()["gpu_core"] > 0.5


def test_fgd_memo_sees_a_shared_array_written_elsewhere():
    """A state whose arrays are another state's (as GpuClusterEnv's cluster views share the fleet's): a
    placement made through the other state changes the scores."""
    owner, view = _openb_room(), _openb_room()
    for name in ("free_cpu", "free_memory", "free_disk", "free_bandwidth", "gpu_free_core", "gpu_free_memory"):
        setattr(view, name, getattr(owner, name))
    fgd = FragmentationGradientDescent.from_openb()
    demand = share(30)
    nodes = np.flatnonzero(view.feasible(demand))[:40]
    before = fgd.delta(view, demand, nodes)
    node = int(nodes[0])
    owner.apply("x", (Part(0, 0, node, 0, 0, 0, 0, owner.choose_cards(node, share(50))),))
    after = fgd.delta(view, demand, nodes)
    assert after.tobytes() == _reference_delta(view, fgd.distribution, demand, nodes).tobytes()
    assert after[0] != before[0] and after[1:].tobytes() == before[1:].tobytes()


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), k=st.integers(1, 300), distinct=st.integers(1, 40),
       width=st.integers(1, 40))
def test_distinct_rows_are_exact(seed, k, distinct, width):
    from hsched.policies.fgd import distinct_rows

    rng = np.random.default_rng(seed)
    base = rng.integers(-(2**40), 2**40, (distinct, width))
    rows = base[rng.integers(0, distinct, k)]
    first, inverse = distinct_rows(rows)
    assert np.array_equal(rows[first][inverse], rows)
    assert len(first) == len(np.unique(rows, axis=0))


def test_distinct_rows_survive_a_hash_collision(monkeypatch):
    import hsched.policies.fgd as fgd_mod

    monkeypatch.setattr(fgd_mod, "_MIX", np.zeros(64, dtype=np.int64))  # every row hashes to 0
    rows = np.array([[1, 2], [3, 4], [1, 2], [5, 6]])
    first, inverse = fgd_mod.distinct_rows(rows)
    assert len(first) == 3 and np.array_equal(rows[first][inverse], rows)


def test_fgd_memo_starting_over_changes_no_score(monkeypatch):
    """A memo bound of 4 rows: it starts over nearly every decision and the scores stay the reference's."""
    import hsched.policies.fgd as fgd_mod

    monkeypatch.setattr(fgd_mod, "MEMO_ROWS", 4)
    tasks, state = fgd_mod.openb_tasks(), _openb_room()
    fgd = FragmentationGradientDescent.from_openb()
    for i in range(60):
        demand = tasks[i].resources
        nodes = np.flatnonzero(state.feasible(demand))
        s = fgd.scores_at(state, demand, nodes)
        assert s.tobytes() == (-_reference_delta(state, fgd.distribution, demand, nodes)).tobytes()
        assert len(fgd._memo) <= 4 + 2 * len(nodes)
        node = int(nodes[np.argmax(s)])
        state.apply(f"t{i}", (Part(0, 0, node, demand.cpu_milli, demand.memory_mib, 0, 0,
                                   state.choose_cards(node, demand)),))
