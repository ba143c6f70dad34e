"""hsched.policies and ClusterState: which node each heuristic picks and why, task splitting, plan()
(GPU cards, replicas, thermal headroom, outcomes) and the allocation invariant — values worked out by hand.

Most cases use a tiny DC of 4 nodes × 8 cores × 32 GiB (p_idle 100 W, p_full 300 W) built with parse_fleet."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hsched.domain.cluster import ClusterState, GpuShare, OverAllocation, Part
from hsched.domain.fleet import DataCenter, parse_fleet
from hsched.domain.resources import Resources
from hsched.domain.task import TaskSpec
from hsched.policies.base import select
from hsched.policies.heuristics import (
    HEURISTICS,
    BestFit,
    FirstFit,
    Greedy,
    RandomPolicy,
    RoundRobin,
    Utilization,
    card_tightness,
    gpu_stranding,
    make_policy,
)
from hsched.policies.placement import Outcome, part_power_w, plan, split_task

SMALL_FLEET = Path(__file__).resolve().parent / "fleets" / "small.yaml"
CPU4 = [{"name": "cpu", "count": 4, "cpu_cores": 8, "memory_gib": 32}]


def tiny_dc(pools: list[dict] | None = None, **dc_fields: object) -> DataCenter:
    pools = pools or CPU4
    nodes = sum(p["count"] for p in pools)
    data = {"version": 1, "name": "tiny", "network_price_per_gb_ms": 0.0,
            "wan": {"vertices": [{"name": "s", "lat": 0.0, "lon": 0.0}], "scheduler_vertex": "s"},
            "datacenters": [{"name": "tiny", "vertex": "s", "prices": {"cpu_core_hour": 0.01, "memory_gib_hour": 0.001},
                             "layout": {"racks": 1, "servers_per_rack": nodes, "rows": 1}, "node_pools": pools,
                             **dc_fields}]}
    return parse_fleet(data).datacenters[0]


def gpu_dc(cards: int = 4, count: int = 1) -> DataCenter:
    """`count` nodes of 8 cores, 64 GiB and `cards` cards of 16 GiB (20 W idle, 70 W full per card)."""
    return tiny_dc([{"name": "gpu", "count": count, "cpu_cores": 8, "memory_gib": 64, "disk_gib": 100,
                     "gpus": {"count": cards, "model": "T4", "memory_gib": 16, "idle_w": 20, "full_w": 70}}])


def small_dc(name: str) -> DataCenter:
    return parse_fleet(yaml.safe_load(SMALL_FLEET.read_text())).datacenter(name)


def occupy(state: ClusterState, task_id: str, node: int, cpu: int = 0, mem: int = 0,
           gpus: tuple[GpuShare, ...] = ()) -> None:
    state.apply(task_id, (Part(0, 0, node, cpu, mem, 0, 0, gpus),))


def task(cpu: int = 0, mem: int = 0, replicas: int = 1, gpu_count: int = 0, gpu_pct: int = 0, gpu_mem: int = 0,
         gpu_models: tuple[str, ...] = ()) -> TaskSpec:
    return TaskSpec(Resources(cpu, mem, 0, 0, gpu_count, gpu_pct, gpu_mem), runtime_s=60.0, replicas=replicas,
                    gpu_models=gpu_models)


def snapshot_equal(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...]) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def assert_books_balance(state: ClusterState) -> None:
    """For every node and card 0 <= free <= capacity, and capacity − free = the sum of the live parts."""
    t = state.table
    used = [np.zeros_like(a) for a in (t.cpu_milli, t.memory_mib, t.disk_mib, t.bandwidth_mbps,
                                      t.gpu_core_percent, t.gpu_memory_mib)]
    for parts in state.allocations.values():
        for p in parts:
            for arr, amount in zip(used[:4], (p.cpu_milli, p.memory_mib, p.disk_mib, p.bandwidth_mbps), strict=True):
                arr[p.node] += amount
            for g in p.gpus:
                used[4][p.node, g.card] += g.core_percent
                used[5][p.node, g.card] += g.memory_mib
    caps = (t.cpu_milli, t.memory_mib, t.disk_mib, t.bandwidth_mbps, t.gpu_core_percent, t.gpu_memory_mib)
    for free, cap, u in zip(state.snapshot(), caps, used, strict=True):
        assert (free >= 0).all() and (free <= cap).all()
        np.testing.assert_array_equal(cap - free, u)


# ------------------------------------------------------------------------------------------------------------
# heuristics on one hand-made state
#
#   node  used cpu / mem      free fractions (cpu, mem)
#   0     0    / 0            (1,     1)
#   1     2000 / 24576        (0.75,  0.25)
#   2     7000 / 8192         (0.125, 0.75)
#   3     8000 / 0            (0,     1)       full CPU: never eligible
#
# demand 1000 milli + 1024 MiB -> want (0.125, 0.03125) ∝ (4, 1); eligible: 0, 1, 2

DEMAND = Resources(1000, 1024)


@pytest.fixture
def state() -> ClusterState:
    s = ClusterState(tiny_dc())
    occupy(s, "a", 1, 2000, 24576)
    occupy(s, "b", 2, 7000, 8192)
    occupy(s, "c", 3, 8000, 0)
    return s


def choose(policy, state: ClusterState, demand: Resources = DEMAND):
    return select(policy, state, demand, state.feasible(demand))


def test_feasible_mask_of_the_hand_state(state: ClusterState) -> None:
    np.testing.assert_array_equal(state.feasible(DEMAND), [True, True, True, False])


def test_firstfit_takes_the_lowest_eligible_index(state: ClusterState) -> None:
    c = choose(FirstFit(), state)
    assert c.node == 0
    assert c.alternatives == ((0, 0.0), (1, -1.0), (2, -2.0))  # score = -index


def test_greedy_takes_the_most_utilised_eligible_node(state: ClusterState) -> None:
    # score = 1 - mean(free): node0 0, node1 1 - (0.75+0.25)/2 = 0.5, node2 1 - (0.125+0.75)/2 = 0.5625;
    # node3 (0.5 used, but full CPU) is not eligible
    c = choose(Greedy(), state)
    assert c.node == 2
    assert [n for n, _ in c.alternatives] == [2, 1, 0]
    assert [s for _, s in c.alternatives] == pytest.approx([0.5625, 0.5, 0.0])


def test_bestfit_takes_the_least_free_after_placing(state: ClusterState) -> None:
    # score = -mean(free - want): node0 -(0.875 + 0.96875)/2 = -0.921875,
    # node1 -(0.625 + 0.21875)/2 = -0.421875, node2 -(0 + 0.71875)/2 = -0.359375
    c = choose(BestFit(), state)
    assert c.node == 2
    assert [s for _, s in c.alternatives] == pytest.approx([-0.359375, -0.421875, -0.921875])


def test_bestfit_differs_from_greedy_on_unequal_nodes() -> None:
    # node0: 8 cores with 2 used (free 0.75); node1: 16 cores with 6 used (free 10/16 = 0.625). Demand 6 cores:
    #   Greedy: used 0.25 vs 0.375 -> node1.  BestFit: free after 0.75 - 6/8 = 0 vs 0.625 - 6/16 = 0.25 -> node0.
    s = ClusterState(tiny_dc([{"name": "small", "count": 1, "cpu_cores": 8, "memory_gib": 32},
                              {"name": "big", "count": 1, "cpu_cores": 16, "memory_gib": 64}]))
    occupy(s, "a", 0, 2000)
    occupy(s, "b", 1, 6000)
    six = Resources(6000)
    assert choose(Greedy(), s, six).node == 1
    c = choose(BestFit(), s, six)
    assert c.node == 0
    assert c.alternatives == ((0, pytest.approx(0.0)), (1, pytest.approx(-0.25)))


def test_utilization_takes_the_free_shape_closest_to_the_demand(state: ClusterState) -> None:
    # cosine of free (cpu, mem) fractions with want ∝ (4, 1), |(4, 1)| = √17:
    #   node0 (1, 1):        (4 + 1)  / (√2·√17)   = 5/√34   = 0.857493
    #   node1 (0.75, 0.25):  ∝ (3, 1): 13 / (√10·√17) = 13/√170 = 0.997054
    #   node2 (0.125, 0.75): ∝ (1, 6): 10 / (√37·√17) = 10/√629 = 0.398726
    c = choose(Utilization(), state)
    assert c.node == 1
    assert [n for n, _ in c.alternatives] == [1, 0, 2]
    assert [s for _, s in c.alternatives] == pytest.approx([13 / 170**0.5, 5 / 34**0.5, 10 / 629**0.5])


def test_round_robin_moves_its_cursor_and_skips_full_nodes(state: ClusterState) -> None:
    rr = RoundRobin()
    assert choose(rr, state).node == 0 and rr.cursor == 1
    assert choose(rr, state).node == 1 and rr.cursor == 2
    assert choose(rr, state).node == 2 and rr.cursor == 3
    # the cursor is on node 3, which is full: the cycle wraps to node 0 (scores -((i - 3) mod 4))
    c = choose(rr, state)
    assert c.node == 0 and rr.cursor == 1
    assert c.alternatives == ((0, -1.0), (1, -2.0), (2, -3.0))


def test_random_is_seeded_and_only_picks_feasible_nodes(state: ClusterState) -> None:
    a, b = RandomPolicy(seed=7), RandomPolicy(seed=7)
    seq_a = [choose(a, state).node for _ in range(40)]
    seq_b = [choose(b, state).node for _ in range(40)]
    assert seq_a == seq_b  # same seed, same choices
    assert set(seq_a) == {0, 1, 2}  # spread over every feasible node, never the full node 3
    seq_c = [choose(RandomPolicy(seed=8), state).node for _ in range(40)]
    assert seq_c != seq_a


class Constant:
    name = "constant"

    def scores(self, state: ClusterState, demand: Resources, mask: np.ndarray) -> np.ndarray:
        return np.zeros(state.n)

    def placed(self, node: int) -> None:
        pass


def test_select_breaks_ties_by_lowest_index_and_respects_top_k(state: ClusterState) -> None:
    c = select(Constant(), state, DEMAND, np.array([False, True, True, True]), top_k=2)
    assert c.node == 1
    assert c.alternatives == ((1, 0.0), (2, 0.0))


def test_select_returns_none_on_an_empty_mask(state: ClusterState) -> None:
    assert select(Greedy(), state, DEMAND, np.zeros(4, dtype=bool)) is None


def test_make_policy_names() -> None:
    assert sorted(HEURISTICS) == ["bestfit", "firstfit", "greedy", "random", "rr", "utilization"]
    assert isinstance(make_policy("rr"), RoundRobin)
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        make_policy("nope")


@settings(max_examples=50, deadline=None)
@given(used=st.lists(st.integers(0, 8000), min_size=4, max_size=4),
       mask=st.lists(st.booleans(), min_size=4, max_size=4).filter(any),
       name=st.sampled_from(sorted(HEURISTICS)), seed=st.integers(0, 2**16), cpu=st.integers(1, 8000))
def test_masked_out_nodes_are_never_chosen(used: list[int], mask: list[bool], name: str, seed: int, cpu: int) -> None:
    s = ClusterState(tiny_dc())
    for node, milli in enumerate(used):
        occupy(s, f"t{node}", node, milli)
    m = np.array(mask)
    c = select(make_policy(name, seed), s, Resources(cpu), m)
    assert m[c.node]
    assert all(m[n] for n, _ in c.alternatives)


# ------------------------------------------------------------------------------------------------------------
# split_task (paper 003: a CPU replica above the threshold becomes parts of <= 8 cores)


def test_split_above_threshold_into_ceil_cpu_over_8_parts_with_exact_sums() -> None:
    cheap = small_dc("cheap")  # 24-core nodes: threshold 24 000 milli, chunk 8 000
    parts = split_task(TaskSpec(Resources(30_000, 10_000, 7, 101), runtime_s=1.0), cheap)
    # ceil(30 000 / 8 000) = 4 parts; each share = total × 8 000 // 30 000, the remainder on the last part:
    #   memory 10 000 × 8/30 = 2 666 (×3) + 2 002;  disk 7 × 8/30 = 1 (×3) + 4;  bandwidth 101 × 8/30 = 26 (×3) + 23
    assert [(p.replica, p.part) for p in parts] == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert [p.demand.cpu_milli for p in parts] == [8000, 8000, 8000, 6000]
    assert [p.demand.memory_mib for p in parts] == [2666, 2666, 2666, 2002]
    assert [p.demand.disk_mib for p in parts] == [1, 1, 1, 4]
    assert [p.demand.bandwidth_mbps for p in parts] == [26, 26, 26, 23]


def test_split_threshold_boundary() -> None:
    cheap = small_dc("cheap")
    assert [p.demand.cpu_milli for p in split_task(task(24_000), cheap)] == [24_000]  # not above the threshold
    assert [p.demand.cpu_milli for p in split_task(task(24_001), cheap)] == [8000, 8000, 8000, 1]


def test_split_uses_the_fleet_threshold_and_chunk() -> None:
    dc = tiny_dc(split={"threshold_cores": 4, "chunk_cores": 2})
    assert [p.demand.cpu_milli for p in split_task(task(5000), dc)] == [2000, 2000, 1000]  # ceil(5/2) = 3


def test_gpu_tasks_are_never_split() -> None:
    gpu = small_dc("gpu")  # 32-core nodes
    parts = split_task(task(40_000, gpu_count=1, gpu_pct=50), gpu)
    assert len(parts) == 1 and parts[0].demand.cpu_milli == 40_000


def test_split_replicas_each_split() -> None:
    parts = split_task(task(30_000, replicas=2), small_dc("cheap"))
    assert [(p.replica, p.part) for p in parts] == [(r, i) for r in range(2) for i in range(4)]


@settings(max_examples=50, deadline=None)
@given(cpu=st.integers(1, 200_000), mem=st.integers(0, 10**6), disk=st.integers(0, 10**6), bw=st.integers(0, 10**5),
       replicas=st.integers(1, 3))
def test_split_parts_sum_exactly(cpu: int, mem: int, disk: int, bw: int, replicas: int) -> None:
    cheap = small_dc("cheap")
    parts = split_task(TaskSpec(Resources(cpu, mem, disk, bw), runtime_s=1.0, replicas=replicas), cheap)
    expected_n = 1 if cpu <= 24_000 else -(-cpu // 8000)
    for r in range(replicas):
        mine = [p.demand for p in parts if p.replica == r]
        assert len(mine) == expected_n
        assert all(d.cpu_milli <= max(8000, cpu if expected_n == 1 else 0) for d in mine)
        for f, total in (("cpu_milli", cpu), ("memory_mib", mem), ("disk_mib", disk), ("bandwidth_mbps", bw)):
            assert sum(getattr(d, f) for d in mine) == total
            assert all(getattr(d, f) >= 0 for d in mine)


# ------------------------------------------------------------------------------------------------------------
# GPU cards


def test_choose_cards_takes_the_fullest_cards_that_fit() -> None:
    s = ClusterState(gpu_dc(cards=4))
    # free (core %, MiB) per card: 0 (50, 8192), 1 (20, 16384), 2 (100, 16384), 3 (70, 12288)
    occupy(s, "x", 0, 1000, 0, (GpuShare(0, 50, 8192), GpuShare(1, 80, 0), GpuShare(3, 30, 4096)))
    # 40 % + 4096 MiB fits cards 0, 2, 3 (card 1 has 20 %); fullest first: 0 (50 free), then 3 (70), then 2 (100)
    assert s.choose_cards(0, Resources(1000, gpu_count=1, gpu_core_percent=40, gpu_memory_mib=4096)) == (
        GpuShare(0, 40, 4096),)
    assert s.choose_cards(0, Resources(1000, gpu_count=2, gpu_core_percent=40, gpu_memory_mib=4096)) == (
        GpuShare(0, 40, 4096), GpuShare(3, 40, 4096))
    # 60 % fits only cards 3 (70) and 2 (100): the fuller card 3
    assert s.choose_cards(0, Resources(1000, gpu_count=1, gpu_core_percent=60)) == (GpuShare(3, 60, 0),)
    with pytest.raises(OverAllocation):
        s.choose_cards(0, Resources(1000, gpu_count=3, gpu_core_percent=60))


def test_card_tightness_is_best_fit_over_the_cards_choose_cards_takes() -> None:
    s = ClusterState(gpu_dc(cards=4, count=2))
    # node 0 free (core %, MiB) per card: (50, 8192), (20, 16384), (100, 16384), (70, 12288); node 1 all empty
    occupy(s, "x", 0, 1000, 0, (GpuShare(0, 50, 8192), GpuShare(1, 80, 0), GpuShare(3, 30, 4096)))
    one = Resources(1000, gpu_count=1, gpu_core_percent=40, gpu_memory_mib=4096)
    # node 0: card 0 leaves 10 % -> 0.9; node 1: a fresh card leaves 60 % -> 0.4
    assert card_tightness(s, one) == pytest.approx([0.9, 0.4])
    # two slices: the emptier of the two fullest that fit (cards 0 and 3, 70 - 40 = 30 % left) -> 0.7; node 1 0.4
    two = Resources(1000, gpu_count=2, gpu_core_percent=40, gpu_memory_mib=4096)
    assert card_tightness(s, two) == pytest.approx([0.7, 0.4])
    # 13 GiB: of node 0's cards with 40 %+ core only card 2 (100 %, 16 GiB) has the memory -> 0.4 like node 1
    assert card_tightness(s, Resources(1000, gpu_count=1, gpu_core_percent=40, gpu_memory_mib=13 * 1024)) == \
        pytest.approx([0.4, 0.4])
    # five cards never fit a 4-card node; a CPU-only task has no card
    assert card_tightness(s, Resources(1000, gpu_count=5, gpu_core_percent=10)).tolist() == [0.0, 0.0]
    assert card_tightness(s, Resources(1000)).tolist() == [0.0, 0.0]


def test_gpu_stranding_weighs_the_cpu_taken_by_the_gpu_share_left() -> None:
    # gpu_dc: 8 cores, 64 GiB and 4 cards per node (400 % of GPU core)
    s = ClusterState(gpu_dc(cards=4, count=2))
    occupy(s, "x", 0, 4000, 16 * 1024, (GpuShare(0, 100, 16384), GpuShare(1, 100, 16384)))
    # node 0: 4 of 8 cores, 48 GiB free, 200 % GPU core free; node 1 empty
    cpu_task = Resources(2000, memory_mib=24 * 1024)
    # node 0: max(2/4, 24/48) = 0.5 of its free CPU/memory, 200/400 of its GPU core stays free -> 0.25
    # node 1: max(2/8, 24/64) = 0.375, 400/400 -> 0.375
    assert gpu_stranding(s, cpu_task) == pytest.approx([0.25, 0.375])
    gpu_task = Resources(2000, memory_mib=8 * 1024, gpu_count=1, gpu_core_percent=100, gpu_memory_mib=16384)
    # node 0: max(2/4, 8/48) = 0.5, (200 - 100)/400 = 0.25 -> 0.125; node 1: max(2/8, 8/64) = 0.25, 300/400 -> 0.1875
    assert gpu_stranding(s, gpu_task) == pytest.approx([0.125, 0.1875])
    # a task that takes all of node 0's CPU strands what is left of its GPUs: min(6/4, 1) · 200/400
    assert gpu_stranding(s, Resources(6000))[0] == pytest.approx(0.5)


def test_gpu_slice_never_spans_cards() -> None:
    s = ClusterState(gpu_dc(cards=2))
    occupy(s, "x", 0, 0, 0, (GpuShare(0, 50, 0), GpuShare(1, 50, 0)))
    # 100 % free in total, but no single card has 60 %: no room now (an empty node could hold it)
    p = plan(s, task(1000, gpu_count=1, gpu_pct=60), FirstFit())
    assert p.outcome is Outcome.NO_ROOM
    p = plan(s, task(1000, gpu_count=1, gpu_pct=50, gpu_mem=1024), FirstFit())
    assert p.outcome is Outcome.PLACED
    assert p.parts[0].gpus == (GpuShare(0, 50, 1024),)  # equal cards: the lower index


def test_plan_places_multi_slice_gpu_task_on_distinct_cards() -> None:
    s = ClusterState(gpu_dc(cards=4))
    p = plan(s, task(2000, gpu_count=3, gpu_pct=100, gpu_mem=16_384), FirstFit())
    assert p.outcome is Outcome.PLACED
    assert [g.card for g in p.parts[0].gpus] == [0, 1, 2]


# ------------------------------------------------------------------------------------------------------------
# plan(): replicas, thermal headroom, outcomes


def test_replicas_see_each_other() -> None:
    s = ClusterState(tiny_dc())
    # FirstFit would pick node 0 twice if the first replica were not booked before the second is placed
    p = plan(s, task(5000, replicas=2), FirstFit())
    assert p.outcome is Outcome.PLACED
    assert [(q.replica, q.node) for q in p.parts] == [(0, 0), (1, 1)]


def test_two_5_core_replicas_never_share_one_8_core_node() -> None:
    s = ClusterState(tiny_dc([{"name": "one", "count": 1, "cpu_cores": 8, "memory_gib": 32}]))
    before = s.snapshot()
    p = plan(s, task(5000, replicas=2), FirstFit())
    assert p.outcome is Outcome.NO_ROOM
    assert p.reason == "no node has room for replica 1 part 0 now"
    assert snapshot_equal(s.snapshot(), before) and s.allocations == {}  # the tentative replica 0 is undone


def test_plan_leaves_the_state_unchanged_when_it_places(state: ClusterState) -> None:
    before, allocs = state.snapshot(), dict(state.allocations)
    p = plan(state, task(1000, 1024, replicas=3), FirstFit())
    assert p.outcome is Outcome.PLACED and len(p.parts) == 3
    assert snapshot_equal(state.snapshot(), before) and state.allocations == allocs


def test_part_power_is_eq5_busy_term() -> None:
    s = ClusterState(tiny_dc())
    # (p_full - p_idle) × cores / total = (300 - 100) × 2 / 8 = 50 W on every node
    np.testing.assert_allclose(part_power_w(s, Resources(2000)), [50.0] * 4)
    g = ClusterState(gpu_dc(cards=2))
    # 50 W CPU + gpu_units (1 × 50 %) × (70 - 20) W = 50 + 25 = 75 W
    np.testing.assert_allclose(part_power_w(g, Resources(2000, gpu_count=1, gpu_core_percent=50)), [75.0])


def test_headroom_masks_nodes_whose_part_power_exceeds_it() -> None:
    s = ClusterState(tiny_dc())
    # the part draws 50 W: node 0 (40 W headroom) is too hot, node 1 (exactly 50 W) is allowed
    p = plan(s, task(2000), FirstFit(), headroom_w=np.array([40.0, 50.0, 60.0, 1000.0]))
    assert p.outcome is Outcome.PLACED and p.parts[0].node == 1


def test_headroom_is_spent_between_replicas() -> None:
    s = ClusterState(tiny_dc())
    headroom = np.array([0.0, 80.0, 0.0, 0.0])
    # replica 0 takes node 1 (80 - 50 = 30 W left); replica 1 needs 50 W > 30 W anywhere: thermally refused
    p = plan(s, task(2000, replicas=2), FirstFit(), headroom_w=headroom)
    assert p.outcome is Outcome.NO_ROOM and p.thermal_limited
    assert "redline" in p.reason
    np.testing.assert_array_equal(headroom, [0.0, 80.0, 0.0, 0.0])  # the caller's array is not modified
    assert s.allocations == {}


def test_no_room_without_thermal_limit_is_not_thermal_limited(state: ClusterState) -> None:
    occupy(state, "fill0", 0, 8000)
    occupy(state, "fill1", 1, 6000)
    occupy(state, "fill2", 2, 1000)
    p = plan(state, task(1000), FirstFit(), headroom_w=np.full(4, 1e6))
    assert p.outcome is Outcome.NO_ROOM and not p.thermal_limited
    assert p.reason == "no node has room for replica 0 part 0 now"


@pytest.mark.parametrize(("spec", "reason"), [
    (task(1000, 40 * 1024), "memory_mib 40960 per node exceeds the largest node of tiny (32768)"),
    (task(1000, gpu_count=1, gpu_pct=10), "no node of tiny has 1 GPUs (max 0)"),
])
def test_unschedulable_when_no_node_could_ever_hold_a_part(spec: TaskSpec, reason: str) -> None:
    s = ClusterState(tiny_dc())
    occupy(s, "fill", 0, 8000)
    p = plan(s, spec, FirstFit())
    assert p.outcome is Outcome.UNSCHEDULABLE
    assert p.reason == reason


def test_unschedulable_gpu_model() -> None:
    p = plan(ClusterState(gpu_dc()), task(1000, gpu_count=1, gpu_pct=10, gpu_models=("V100",)), FirstFit())
    assert p.outcome is Outcome.UNSCHEDULABLE
    assert p.reason == "no node of tiny has GPU model V100"


def test_split_task_lands_on_several_nodes() -> None:
    s = ClusterState(tiny_dc())  # threshold = the largest node, 8 cores; chunk 8
    p = plan(s, task(20_000), FirstFit())
    # ceil(20/8) = 3 parts: 8, 8, 4 cores on nodes 0, 1, 2
    assert [(q.part, q.node, q.cpu_milli) for q in p.parts] == [(0, 0, 8000), (1, 1, 8000), (2, 2, 4000)]
    assert p.notes == ["split into 3 parts of <= 8 cores (paper 003)"]


# ------------------------------------------------------------------------------------------------------------
# ClusterState.apply / release


def test_apply_rejects_over_allocation_atomically() -> None:
    s = ClusterState(tiny_dc())
    occupy(s, "a", 0, 6000)
    before, allocs = s.snapshot(), dict(s.allocations)
    parts = (Part(0, 0, 1, 4000, 0, 0, 0), Part(0, 1, 0, 4000, 0, 0, 0))  # node 1 fits, node 0 has only 2000
    with pytest.raises(OverAllocation, match="would over-allocate"):
        s.apply("b", parts)
    assert snapshot_equal(s.snapshot(), before) and s.allocations == allocs


@pytest.mark.parametrize(("task_id", "parts", "match"), [
    ("a", (Part(0, 0, 1, 1, 0, 0, 0),), "already holds"),
    ("b", (Part(0, 0, 4, 1, 0, 0, 0),), "node index out of range"),
    ("b", (Part(0, 0, -1, 1, 0, 0, 0),), "node index out of range"),
    ("b", (Part(0, 0, 0, 7001, 0, 0, 0),), "would over-allocate"),  # 1000 + 7001 > 8000
    ("b", (Part(0, 0, 0, 1, 0, 0, 0), Part(0, 1, 0, 7000, 0, 0, 0)), "would over-allocate"),  # two parts, one node
])
def test_apply_rejects_bad_parts(task_id: str, parts: tuple[Part, ...], match: str) -> None:
    s = ClusterState(tiny_dc())
    occupy(s, "a", 0, 1000)
    before = s.snapshot()
    with pytest.raises(OverAllocation, match=match):
        s.apply(task_id, parts)
    assert snapshot_equal(s.snapshot(), before) and list(s.allocations) == ["a"]


def test_apply_rejects_negative_amounts_even_where_they_fit_under_another_task() -> None:
    # node 0 holds "a" (1000 milli): a -1 milli part would leave free at 7001 <= 8000, inside the bounds, but
    # releasing "a" afterwards would set free to 8001 > capacity 8000 — the state's invariant broken by a release.
    s = ClusterState(tiny_dc())
    occupy(s, "a", 0, 1000)
    before = s.snapshot()
    for part in (Part(0, 0, 0, -1, 0, 0, 0), Part(0, 0, 0, 0, 0, 0, 0, (GpuShare(0, -1, 0),))):
        with pytest.raises(OverAllocation, match="negative"):
            s.apply("b", (part,))
        assert snapshot_equal(s.snapshot(), before) and list(s.allocations) == ["a"]


def test_apply_rejects_a_card_the_node_does_not_have() -> None:
    # node 0 has 2 cards, node 1 has none (its card column is 0 capacity)
    s = ClusterState(tiny_dc([{"name": "g", "count": 1, "cpu_cores": 8, "memory_gib": 32,
                               "gpus": {"count": 2, "model": "T4", "memory_gib": 16}},
                              {"name": "c", "count": 1, "cpu_cores": 8, "memory_gib": 32}]))
    before = s.snapshot()
    with pytest.raises(OverAllocation):
        s.apply("x", (Part(0, 0, 1, 1000, 0, 0, 0, (GpuShare(0, 10, 0),)),))
    with pytest.raises(OverAllocation, match="card index out of range"):
        s.apply("x", (Part(0, 0, 0, 1000, 0, 0, 0, (GpuShare(2, 10, 0),)),))
    assert snapshot_equal(s.snapshot(), before)


def test_release_returns_the_parts_and_restores_free() -> None:
    s = ClusterState(gpu_dc(cards=2))
    before = s.snapshot()
    parts = (Part(0, 0, 0, 3000, 1024, 5, 6, (GpuShare(1, 30, 2048),)),)
    s.apply("x", parts)
    assert s.free_cpu[0] == 5000 and s.gpu_free_core[0, 1] == 70 and s.gpu_free_memory[0, 1] == 16_384 - 2048
    assert s.release("x") == parts
    assert snapshot_equal(s.snapshot(), before)
    assert s.release("x") is None


# ------------------------------------------------------------------------------------------------------------
# stateful: random place/release sequences with random heuristics never break the books


class PlaceReleaseMachine(RuleBasedStateMachine):
    @initialize(dc_name=st.sampled_from(["cheap", "gpu"]), seed=st.integers(0, 1000))
    def setup(self, dc_name: str, seed: int) -> None:
        self.state = ClusterState(small_dc(dc_name))
        self.policies = {name: make_policy(name, seed) for name in HEURISTICS}
        self.next_id = 0

    @rule(cpu=st.integers(1, 60).map(lambda c: c * 500), mem=st.integers(0, 120_000), disk=st.integers(0, 600_000),
          bw=st.integers(0, 12_000), gpus=st.integers(0, 3), pct=st.integers(1, 100), gmem=st.integers(0, 17_000),
          replicas=st.integers(1, 3), policy=st.sampled_from(sorted(HEURISTICS)))
    def place(self, cpu: int, mem: int, disk: int, bw: int, gpus: int, pct: int, gmem: int, replicas: int,
              policy: str) -> None:
        spec = TaskSpec(Resources(cpu, mem, disk, bw, gpus, pct if gpus else 0, gmem if gpus else 0), 60.0,
                        replicas=replicas)
        before = self.state.snapshot()
        p = plan(self.state, spec, self.policies[policy])
        assert snapshot_equal(self.state.snapshot(), before)
        if p.outcome is Outcome.PLACED:
            assert len(p.parts) == len(split_task(spec, self.state.dc))
            self.state.apply(f"t{self.next_id}", p.parts)  # raises if the plan over-allocates
            self.next_id += 1
        else:
            assert p.outcome in (Outcome.NO_ROOM, Outcome.UNSCHEDULABLE) and p.reason

    @precondition(lambda self: bool(self.state.allocations))
    @rule(pick=st.integers(0, 10**6))
    def release(self, pick: int) -> None:
        ids = sorted(self.state.allocations)
        assert self.state.release(ids[pick % len(ids)]) is not None

    @invariant()
    def books_balance(self) -> None:
        assert_books_balance(self.state)


PlaceReleaseMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)
TestPlaceRelease = PlaceReleaseMachine.TestCase


def _gpu(cards: int = 1, pct: int = 100, gib: float = 4, cores: int = 1) -> Resources:
    return Resources(cpu_milli=cores * 1000, memory_mib=1024, gpu_count=cards, gpu_core_percent=pct,
                     gpu_memory_mib=round(gib * 1024))


def test_replicas_the_empty_gpu_dc_could_hold_by_hand():
    """The small fleet's gpu DC: 4 hosts of 32 cores, 256 GiB and 2 T4 cards of 16 GiB."""
    empty = ClusterState(parse_fleet(yaml.safe_load(SMALL_FLEET.read_text())).datacenter("gpu"))
    assert empty.replicas_it_could_hold(_gpu()) == 8  # a whole card each
    assert empty.replicas_it_could_hold(_gpu(cards=2)) == 4  # both cards of a host
    assert empty.replicas_it_could_hold(_gpu(pct=50)) == 16  # two per card
    assert empty.replicas_it_could_hold(_gpu(pct=30, gib=10)) == 8  # memory: one 10 GiB slice per 16 GiB card
    assert empty.replicas_it_could_hold(_gpu(pct=50, cores=20)) == 4  # cores: one per host
    assert empty.replicas_it_could_hold(_gpu(), ("A100",)) == 0


def test_gpu_replicas_no_empty_dc_could_hold_are_refused_and_reasons_name_model_and_card_memory():
    """(6 replicas of a whole T4 where 5 exist were DEFERRED for ever, with exit 0.)"""
    from hsched.engine.selector import DcSelector
    from hsched.policies.placement import never_fits_reason

    fleet = parse_fleet(yaml.safe_load(SMALL_FLEET.read_text()))
    selector = DcSelector(fleet)
    gpu = fleet.datacenter("gpu")
    fits = TaskSpec(resources=_gpu(), runtime_s=60, replicas=8, gpu_models=("T4",))
    assert selector.structural_misfit(fits, gpu) == ""
    # 5 GPUs and 100 cores in all are there, but a host's 32 cores take one 20-core replica: 4 at most
    too_many = TaskSpec(resources=_gpu(pct=50, cores=20), runtime_s=60, replicas=5, gpu_models=("T4",))
    assert selector.structural_misfit(too_many, gpu) == (
        "its 5 replicas do not fit even in the empty DC: its nodes hold at most 4 of them (each needs 1 card(s) of "
        "50% and 4096 MiB of T4)")
    # CPU replicas of one part each likewise: 5 of 13 cores where 4 nodes of 24 cores hold one each
    wide = TaskSpec(resources=Resources(cpu_milli=13_000, memory_mib=1024), runtime_s=60, replicas=5)
    assert selector.structural_misfit(wide, fleet.datacenter("cheap")) == (
        "its 5 replicas do not fit even in the empty DC: its nodes hold at most 4 of them (each needs 13 cores and "
        "1024 MiB)")
    assert selector.structural_misfit(replace(wide, replicas=4), fleet.datacenter("cheap")) == ""
    empty = ClusterState(gpu)
    big_card = _gpu(gib=20)
    assert never_fits_reason(empty, big_card, TaskSpec(resources=big_card, runtime_s=60, gpu_models=("T4",))) == (
        "gpu_memory_mib 20480 per card exceeds the largest T4 card of gpu (16384 MiB)")
    three = _gpu(cards=3)
    assert never_fits_reason(empty, three, TaskSpec(resources=three, runtime_s=60, gpu_models=("T4",))) == (
        "no node of gpu has 3 T4 GPUs (max 2)")
