"""hsched.optimum: the exact MILP optima (HiGHS) of the GPU placement (max tasks deployed / eq.9 utilisation)
and of the DC placement (min peak inlet, then fewest overloaded servers) — hand-checked tiny instances,
brute-force enumeration, and property tests that no library heuristic ever beats the optimum."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hsched.domain.cluster import ClusterState, GpuShare, OverAllocation, Part
from hsched.domain.fleet import DataCenter, parse_fleet
from hsched.domain.resources import MILLI, Resources
from hsched.domain.task import TaskSpec
from hsched.optimum import (
    OptimumResult,
    Placement,
    cluster_utilisation,
    gap_percent,
    heuristic_runs,
    max_deployed,
    min_peak_inlet,
    synthetic_gpu_instance,
)
from hsched.policies.heuristics import HEURISTICS, make_policy
from hsched.policies.placement import Outcome, plan, split_task
from hsched.thermal import RoomModel, ThermalParams
from hsched.thermal.datacenter import room_state

GIB = 1024
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make_dc(pools: list[dict], name: str = "tiny") -> DataCenter:
    nodes = sum(p["count"] for p in pools)
    data = {"version": 1, "name": name, "network_price_per_gb_ms": 0.0,
            "wan": {"vertices": [{"name": "s", "lat": 0.0, "lon": 0.0}], "scheduler_vertex": "s"},
            "datacenters": [{"name": name, "vertex": "s", "prices": {"cpu_core_hour": 0.01, "memory_gib_hour": 0.001},
                             "layout": {"racks": 1, "servers_per_rack": nodes, "rows": 1}, "node_pools": pools}]}
    return parse_fleet(data).datacenters[0]


def gpu_pool(count: int, cards: int, model: str = "T4", cpu: int = 8, mem_gib: int = 64, card_gib: int = 16,
             name: str = "gpu") -> dict:
    return {"name": name, "count": count, "cpu_cores": cpu, "memory_gib": mem_gib,
            "gpus": {"count": cards, "model": model, "memory_gib": card_gib}}


def gpu_task(count: int, pct: int, gmem_gib: int = 4, cpu: int = 1, mem_gib: int = 1, models: tuple[str, ...] = (),
             name: str = "") -> TaskSpec:
    return TaskSpec(Resources(cpu * MILLI, mem_gib * GIB, 0, 0, count, pct, gmem_gib * GIB), runtime_s=60.0,
                    gpu_models=models, name=name)


def cpu_task(cores: float, mem_gib: int = 0, replicas: int = 1, name: str = "") -> TaskSpec:
    return TaskSpec(Resources(round(cores * MILLI), mem_gib * GIB), runtime_s=60.0, replicas=replicas, name=name)


def copy_state(state: ClusterState) -> ClusterState:
    """A fresh state with the same allocations (replayed, so it shares nothing with the original)."""
    out = ClusterState(state.dc, state.table)
    for task_id, parts in state.allocations.items():
        out.apply(task_id, parts)
    return out


def heuristic_counts(state: ClusterState, tasks: list[TaskSpec]) -> dict[str, int]:
    """Tasks deployed by every library heuristic placing `tasks` in order with plan(), skipping what does not fit
    (computed here independently of hsched.optimum.heuristic_runs)."""
    out = {}
    for name in sorted(HEURISTICS):
        s, policy, n = copy_state(state), make_policy(name, seed=7), 0
        for i, task in enumerate(tasks):
            p = plan(s, task, policy)
            if p.outcome is Outcome.PLACED:
                s.apply(f"h{i}", p.parts)
                n += 1
        out[name] = n
    return out


def brute_force_deployed(state: ClusterState, tasks: list[TaskSpec]) -> int:
    """The most tasks that fit, by enumerating every (skip | node × set of cards) choice per task."""
    s = copy_state(state)
    best = 0

    def rec(i: int, count: int) -> None:
        nonlocal best
        if count + len(tasks) - i <= best:
            return
        if i == len(tasks):
            best = count
            return
        r = tasks[i].resources
        for k in np.flatnonzero(s.feasible(r, tasks[i].gpu_models)):
            fits = np.flatnonzero((s.gpu_free_core[k] >= r.gpu_core_percent)
                                  & (s.gpu_free_memory[k] >= r.gpu_memory_mib)) if r.gpu_count else []
            for cards in itertools.combinations(fits, r.gpu_count):
                part = Part(0, 0, int(k), r.cpu_milli, r.memory_mib, r.disk_mib, r.bandwidth_mbps,
                            tuple(GpuShare(int(g), r.gpu_core_percent, r.gpu_memory_mib) for g in cards))
                s.apply(f"b{i}", (part,))
                rec(i + 1, count + 1)
                s.release(f"b{i}")
        rec(i + 1, count)

    rec(0, 0)
    return best


def assert_books_balance(state: ClusterState) -> None:
    t = state.table
    used_cpu = np.zeros(state.n, dtype=np.int64)
    used_core = np.zeros_like(t.gpu_core_percent)
    for parts in state.allocations.values():
        for p in parts:
            used_cpu[p.node] += p.cpu_milli
            for g in p.gpus:
                used_core[p.node, g.card] += g.core_percent
    assert np.array_equal(t.cpu_milli - state.free_cpu, used_cpu)
    assert np.array_equal(t.gpu_core_percent - state.gpu_free_core, used_core)
    assert (state.free_cpu >= 0).all() and (state.gpu_free_core >= 0).all() and (state.gpu_free_memory >= 0).all()


# ---------------------------------------------------------------------------------------------------------------
# max_deployed: hand-checked instances


def test_optimum_deploys_three_where_first_fit_and_every_heuristic_deploy_two() -> None:
    # 2 nodes × 2 cards (100 % core each). Tasks in arrival order: two of 2 slices × 70 % and two of 1 × 60 %.
    # A sequential heuristic must place task 0 on some node (70 % of both its cards) and then task 1 on the
    # other node (a second 70 % slice never fits beside a 70 % one): every card is left with 30 %, so neither
    # 60 % task fits — 2 deployed, whatever the policy. The optimum skips task 1: task 0 on one node, the two
    # 60 % tasks on the two cards of the other node — 3 deployed, and 4 is impossible (all four need
    # 2 × 70 + 2 × 70 + 60 + 60 = 400 % of core, exactly the 4 cards, but two 70 % slices cannot share a card).
    state = ClusterState(make_dc([gpu_pool(2, 2)]))
    tasks = [gpu_task(2, 70), gpu_task(2, 70), gpu_task(1, 60), gpu_task(1, 60)]
    counts = heuristic_counts(state, tasks)
    assert counts["firstfit"] == 2 and set(counts.values()) == {2}
    r = max_deployed(state, tasks)
    assert (r.status, r.deployed, r.objective, r.bound) == ("optimal", 3, 3.0, 3.0)
    assert sum(r.assignment[i] is None for i in (0, 1)) == 1  # exactly one of the two 2 × 70 % tasks waits
    big = r.placement(0) or r.placement(1)
    small = [r.placement(2), r.placement(3)]
    assert big is not None and big.cards == (0, 1)
    assert {p.node for p in small} == {1 - big.node} and {p.cards for p in small} == {(0,), (1,)}
    assert r.secondary == 2 * 70 + 60 + 60  # the tie-break value: GPU core percent allocated
    assert gap_percent(counts["firstfit"], r.objective) == pytest.approx(100 / 3)
    assert brute_force_deployed(state, tasks) == 3


def test_the_assignment_applies_to_the_cluster_state_without_over_allocation() -> None:
    state = ClusterState(make_dc([gpu_pool(2, 2)]))
    tasks = [gpu_task(2, 70), gpu_task(2, 70), gpu_task(1, 60), gpu_task(1, 60)]
    r = max_deployed(state, tasks)
    assert state.allocations == {}  # solving leaves the state alone
    ids = r.apply(state)
    assert ids == [f"optimum-{t}" for t in range(4) if r.assignment[t] is not None]
    assert_books_balance(state)
    assert int((state.table.gpu_core_percent - state.gpu_free_core).sum()) == 260
    for t in range(4):
        if r.assignment[t] is not None:
            cluster, (part,) = r.as_parts(t)
            assert (cluster, part.node, tuple(g.card for g in part.gpus)) == tuple(r.placement(t))
            assert state.allocations[f"optimum-{t}"] == (part,)
    # applying again over-allocates: all or nothing, the state is left exactly as it was
    before = state.snapshot()
    with pytest.raises(OverAllocation):
        r.apply(state, prefix="again-")
    assert all(np.array_equal(a, b) for a, b in zip(before, state.snapshot(), strict=True))
    assert not any(k.startswith("again-") for k in state.allocations)


def test_as_parts_builds_the_parts_apply_expects() -> None:
    state = ClusterState(make_dc([gpu_pool(1, 2)]))
    r = max_deployed(state, [gpu_task(2, 40, gmem_gib=3, cpu=2, mem_gib=5)])
    assert r.as_parts(0) == (0, (Part(0, 0, 0, 2000, 5 * GIB, 0, 0, (GpuShare(0, 40, 3 * GIB),
                                                                      GpuShare(1, 40, 3 * GIB))),))
    assert r.placement(0) == Placement(0, 0, (0, 1))


def test_gpu_model_constraint_is_honoured() -> None:
    # node 0: two T4 cards; node 1: one V100 card. Two whole-V100 tasks: only one can run, on node 1, although
    # the T4 cards stay free; a task that accepts either model fills a T4.
    state = ClusterState(make_dc([gpu_pool(1, 2, "T4", name="t4"), gpu_pool(1, 1, "V100", name="v100")]))
    tasks = [gpu_task(1, 100, models=("V100",)), gpu_task(1, 100, models=("V100",)), gpu_task(1, 100)]
    r = max_deployed(state, tasks)
    assert r.optimal and r.deployed == 2
    v100 = [t for t in (0, 1) if r.assignment[t] is not None]
    assert len(v100) == 1 and r.placement(v100[0]) == Placement(0, 1, (0,))
    assert r.placement(2) is not None and r.placement(2).node == 0
    r.apply(state)
    assert_books_balance(state)


def test_current_free_amounts_are_the_capacity() -> None:
    state = ClusterState(make_dc([gpu_pool(1, 2, cpu=4)]))
    state.apply("old", (Part(0, 0, 0, 3000, 0, 0, 0, (GpuShare(1, 50, GIB),)),))  # 1 core and card 0 + half of 1 left
    tasks = [gpu_task(1, 100, cpu=1), gpu_task(1, 50, cpu=1), gpu_task(1, 10, cpu=0)]
    r = max_deployed(state, tasks)
    # CPU: one core left, so of the two 1-core tasks only one runs; the 0-core 10 % task fits beside it
    assert r.optimal and r.deployed == 2 and r.assignment[2] is not None
    assert brute_force_deployed(state, tasks) == 2 and max_deployed(ClusterState(state.dc), tasks).deployed == 3
    r.apply(state)
    assert_books_balance(state)


def test_the_tie_break_prefers_the_bigger_gpu_share_at_the_same_count() -> None:
    state = ClusterState(make_dc([gpu_pool(1, 1)]))
    r = max_deployed(state, [gpu_task(1, 30), gpu_task(1, 90), gpu_task(1, 80)])  # only one fits on the card
    assert r.optimal and r.deployed == 1 and r.placement(1) is not None and r.secondary == 90
    assert r.secondary_optimal


def test_several_clusters_each_task_at_most_once_anywhere() -> None:
    a = ClusterState(make_dc([gpu_pool(1, 1, "T4")], name="a"))
    b = ClusterState(make_dc([gpu_pool(1, 2, "A100", card_gib=40)], name="b"))
    tasks = [gpu_task(1, 100, models=("A100",)), gpu_task(1, 100), gpu_task(1, 100), gpu_task(1, 100)]
    r = max_deployed([a, b], tasks)
    assert r.optimal and r.deployed == 3  # three cards in all
    # Which task stays out is a tie (task 0 or any of the unconstrained ones): assert what every optimum holds.
    if r.placement(0) is not None:
        assert r.placement(0).cluster == 1  # the A100-only task never lands on the T4 cluster
    assert sorted(p.cluster for p in map(r.placement, range(4)) if p is not None) == [0, 1, 1]
    r.apply([a, b])
    assert_books_balance(a)
    assert_books_balance(b)
    assert len(a.allocations) + len(b.allocations) == 3


def test_utilisation_objective_is_eq9_of_the_state_after_placing() -> None:
    state = ClusterState(make_dc([gpu_pool(1, 1, cpu=8, mem_gib=8)]))
    tasks = [gpu_task(1, 30, gmem_gib=2, cpu=1, mem_gib=1), gpu_task(1, 80, gmem_gib=8, cpu=4, mem_gib=4)]
    by_count = max_deployed(state, tasks)
    by_util = max_deployed(state, tasks, objective="utilisation")
    assert by_util.kind == "max_utilisation" and by_util.optimal
    assert by_util.placement(1) is not None and by_util.placement(0) is None  # 30+80 > 100: one only, the bigger
    after = ClusterState(state.dc)
    by_util.apply(after)
    # eq.8 by hand: (4/8 cpu + 4/8 memory + 8/16 GPU memory + 80/100 core) / 4 = 0.575
    assert by_util.objective == pytest.approx(cluster_utilisation(after)) == pytest.approx(0.575)
    assert by_count.deployed == 1


def test_tasks_that_need_splitting_or_have_replicas_are_refused_by_name() -> None:
    state = ClusterState(make_dc([gpu_pool(2, 1, cpu=8)]))
    with pytest.raises(ValueError, match=r"task 1 \('big'\) needs splitting in tiny"):
        max_deployed(state, [gpu_task(1, 10), cpu_task(9, name="big")])
    with pytest.raises(ValueError, match=r"task 0 has 2 replicas"):
        max_deployed(state, [cpu_task(1, replicas=2)])
    with pytest.raises(ValueError, match="objective"):
        max_deployed(state, [], objective="speed")


def test_nothing_fits_is_an_optimal_zero() -> None:
    state = ClusterState(make_dc([gpu_pool(1, 1, cpu=2)]))
    r = max_deployed(state, [cpu_task(2, mem_gib=100), gpu_task(2, 10)])
    assert (r.status, r.deployed, r.bound, r.assignment) == ("optimal", 0, 0.0, (None, None))


def test_a_time_limited_answer_has_a_bound_and_never_loses_to_a_heuristic() -> None:
    state, tasks = synthetic_gpu_instance(nodes=8, cards=8, tasks=24, seed=2)
    r = max_deployed(state, tasks, time_limit_s=0.3)
    assert r.status in ("optimal", "time_limit") and r.bound is not None
    assert r.deployed <= r.bound <= len(tasks)
    assert r.deployed >= max(heuristic_counts(state, tasks).values())
    after = copy_state(state)
    r.apply(after)
    assert_books_balance(after)


def test_heuristic_runs_cover_every_policy_in_both_orders() -> None:
    state = ClusterState(make_dc([gpu_pool(2, 2)]))
    tasks = [gpu_task(2, 70), gpu_task(2, 70), gpu_task(1, 60), gpu_task(1, 60)]
    runs = heuristic_runs(state, tasks)
    assert set(runs) == set(HEURISTICS) | {f"{n}/smallest-first" for n in HEURISTICS}
    assert sum(a is not None for a in runs["firstfit"]) == 2
    assert sum(a is not None for a in runs["firstfit/smallest-first"]) == 3  # the 60 % tasks first: 3


# ---------------------------------------------------------------------------------------------------------------
# max_deployed: property tests over random tiny instances


@st.composite
def gpu_instances(draw: st.DrawFn) -> tuple[ClusterState, list[TaskSpec]]:
    cards = draw(st.integers(1, 2))
    counts = draw(st.lists(st.integers(1, 2), min_size=1, max_size=2).filter(lambda c: sum(c) <= 3))
    models = ["T4", "V100"]
    pools = [gpu_pool(n, cards, models[i], cpu=draw(st.integers(4, 8)), mem_gib=draw(st.sampled_from([16, 32])),
                      card_gib=draw(st.sampled_from([8, 16])), name=f"p{i}") for i, n in enumerate(counts)]
    state = ClusterState(make_dc(pools))
    tasks = []
    for _ in range(draw(st.integers(2, 6))):
        gpus = draw(st.integers(0, 2))
        cpu = draw(st.integers(0 if gpus else 1, 4))
        mem = draw(st.integers(0, 12))
        if gpus:
            pct = draw(st.sampled_from([10, 25, 30, 50, 60, 75, 100]))
            model = draw(st.sampled_from([(), (), ("T4",), ("V100",)]))
            tasks.append(gpu_task(gpus, pct, gmem_gib=draw(st.integers(1, 8)), cpu=cpu, mem_gib=mem, models=model))
        else:
            tasks.append(cpu_task(cpu, mem))
    # sometimes part of the cluster is taken already: the optimum works on the current free amounts
    for i in range(draw(st.integers(0, 2))):
        p = plan(state, gpu_task(1, draw(st.sampled_from([30, 50, 100])), cpu=1), make_policy("firstfit"))
        if p.outcome is Outcome.PLACED:
            state.apply(f"pre{i}", p.parts)
    return state, tasks


@SETTINGS
@given(gpu_instances())
def test_no_heuristic_deploys_more_than_the_optimum(instance: tuple[ClusterState, list[TaskSpec]]) -> None:
    state, tasks = instance
    r = max_deployed(state, tasks, time_limit_s=20.0)
    assert r.status == "optimal" and r.bound == r.deployed
    counts = heuristic_counts(state, tasks)
    assert all(r.deployed >= n for n in counts.values()), (r.deployed, counts)
    after = copy_state(state)
    r.apply(after)
    assert_books_balance(after)
    for t, a in enumerate(r.assignment):  # GPU model constraint and one slice per distinct card
        if a is not None and tasks[t].gpu_models:
            assert state.table.gpu_model[a[0].node] in tasks[t].gpu_models
        if a is not None:
            assert len(set(a[0].cards)) == len(a[0].cards) == tasks[t].resources.gpu_count
    if state.n * state.table.gpu_count.max() <= 4 and len(tasks) <= 5:
        assert r.deployed == brute_force_deployed(state, tasks)


# ---------------------------------------------------------------------------------------------------------------
# max_deployed with all-or-nothing groups (the replicas of a job)


def as_replica_tasks(jobs: list[TaskSpec]) -> tuple[list[TaskSpec], list[list[int]]]:
    """Each job's replicas as single-replica tasks, and the groups listing them."""
    tasks: list[TaskSpec] = []
    groups = []
    for job in jobs:
        groups.append(list(range(len(tasks), len(tasks) + job.replicas)))
        tasks += [dataclasses.replace(job, replicas=1)] * job.replicas
    return tasks, groups


def heuristic_job_counts(state: ClusterState, jobs: list[TaskSpec]) -> dict[str, int]:
    """Jobs deployed by every library heuristic placing the multi-replica `jobs` in order with plan() (replicas
    one by one with the state updated in between; a job that does not fully fit is left out whole)."""
    out = {}
    for name in sorted(HEURISTICS):
        s, policy, n = copy_state(state), make_policy(name, seed=7), 0
        for i, job in enumerate(jobs):
            p = plan(s, job, policy)
            if p.outcome is Outcome.PLACED:
                s.apply(f"h{i}", p.parts)
                n += 1
        out[name] = n
    return out


def brute_force_jobs(state: ClusterState, jobs: list[TaskSpec]) -> int:
    """The most whole jobs that fit together: the largest subset of jobs whose replicas all fit at once."""
    for size in range(len(jobs), 0, -1):
        for subset in itertools.combinations(jobs, size):
            tasks, _ = as_replica_tasks(list(subset))
            if brute_force_deployed(state, tasks) == len(tasks):
                return size
    return 0


def assert_groups_whole(r: OptimumResult, groups: list[list[int]]) -> int:
    whole = [all(r.assignment[i] is not None for i in g) for g in groups]
    assert all(w or all(r.assignment[i] is None for i in g) for w, g in zip(whole, groups, strict=True))
    return sum(whole)


def test_groups_deploy_more_whole_jobs_than_replica_by_replica_heuristics() -> None:
    # 2 nodes × 1 card (100 % core). Jobs in arrival order: J0 = 2 replicas × 70 %, J1 = 2 × 40 %, J2 = 1 × 70 %.
    # Any heuristic placing replicas greedily, first come first served, deploys J0 first: its two 70 % replicas
    # cannot share a card, so they take one card each and leave 30 % on both; J1 then breaks (its replicas need
    # 40 % each and are rolled back) and J2 (70 %) waits too — 1 job. The optimum skips J0: J1's two replicas
    # share one card (80 %) and J2 takes the other — 2 jobs. All three jobs together need 360 % > 200 %.
    state = ClusterState(make_dc([gpu_pool(2, 1)]))
    jobs = [dataclasses.replace(gpu_task(1, 70), replicas=2), dataclasses.replace(gpu_task(1, 40), replicas=2),
            gpu_task(1, 70)]
    tasks, groups = as_replica_tasks(jobs)
    assert set(heuristic_job_counts(state, jobs).values()) == {1}
    r = max_deployed(state, tasks, groups=groups)
    assert (r.status, r.objective, r.bound, r.deployed) == ("optimal", 2.0, 2.0, 3)
    assert r.assignment[0] is None and r.assignment[1] is None  # J0 waits, whole
    assert r.placement(2).node == r.placement(3).node != r.placement(4).node  # J1 shares a card; J2 alone
    assert assert_groups_whole(r, groups) == 2 and brute_force_jobs(state, jobs) == 2
    after = copy_state(state)
    r.apply(after)
    assert_books_balance(after)


def test_a_group_with_a_replica_that_fits_nowhere_is_left_out_whole() -> None:
    # J0: a 50 % replica (fits) and a 2-card replica (no node has 2 cards): the replica-level optimum deploys
    # the 50 % replica and breaks J0; with the group J0 deploys nothing, and the count is of groups (J1 alone).
    state = ClusterState(make_dc([gpu_pool(2, 1)]))
    tasks = [gpu_task(1, 50), gpu_task(2, 50), gpu_task(1, 100)]
    assert max_deployed(state, tasks).deployed == 2
    r = max_deployed(state, tasks, groups=[[0, 1]])
    assert (r.status, r.objective, r.deployed, r.assignment[0], r.assignment[1]) == ("optimal", 1.0, 1, None, None)
    runs = heuristic_runs(state, tasks, groups=[[0, 1]])
    assert all(run[0] is None and run[1] is None and run[2] is not None for run in runs.values())
    for bad in ([[0, 1], [1, 2]], [[0, 3]], [[]]):
        with pytest.raises(ValueError):
            max_deployed(state, tasks, groups=bad)


def test_a_time_limited_grouped_answer_has_a_capacity_bound_below_the_job_count() -> None:
    # 40 jobs of 1-4 replicas on 4 nodes × 8 cards ask for far more GPU than there is: stopped at once, the
    # solver may have no bound of its own, and the bound is then the resource-sum one (the most jobs whose
    # summed demands, smallest first, fit in the fleet's free totals), well below the 40 jobs.
    state, pods = synthetic_gpu_instance(nodes=4, cards=8, tasks=40, seed=3)
    rng = np.random.default_rng(0)
    jobs = [dataclasses.replace(t, replicas=int(rng.integers(1, 5))) for t in pods]
    tasks, groups = as_replica_tasks(jobs)
    r = max_deployed(state, tasks, time_limit_s=0.05, groups=groups)
    assert r.status in ("optimal", "time_limit") and r.bound is not None
    assert assert_groups_whole(r, groups) == r.objective <= r.bound < len(jobs)
    assert r.objective >= max(heuristic_job_counts(state, jobs).values())


@st.composite
def job_instances(draw: st.DrawFn) -> tuple[ClusterState, list[TaskSpec]]:
    state, tasks = draw(gpu_instances())
    jobs = [dataclasses.replace(t, replicas=draw(st.integers(1, 3))) for t in tasks[:4]]
    return state, jobs


@SETTINGS
@given(job_instances())
def test_no_heuristic_deploys_more_jobs_than_the_grouped_optimum(instance: tuple[ClusterState, list[TaskSpec]]
                                                                  ) -> None:
    state, jobs = instance
    tasks, groups = as_replica_tasks(jobs)
    r = max_deployed(state, tasks, time_limit_s=20.0, groups=groups)
    assert r.status == "optimal" and r.bound == r.objective
    assert assert_groups_whole(r, groups) == r.objective
    counts = heuristic_job_counts(state, jobs)
    assert all(r.objective >= n for n in counts.values()), (r.objective, counts)
    after = copy_state(state)
    r.apply(after)
    assert_books_balance(after)
    if state.n * state.table.gpu_count.max() <= 4 and len(tasks) <= 5:
        assert r.objective == brute_force_jobs(state, jobs)


# ---------------------------------------------------------------------------------------------------------------
# min_peak_inlet


def cpu_room(d: list[list[float]], cores: int = 24, params: ThermalParams | None = None
             ) -> tuple[ClusterState, RoomModel]:
    n = len(d)
    dc = make_dc([{"name": "cpu", "count": n, "cpu_cores": cores, "memory_gib": 64}])
    return ClusterState(dc), RoomModel(np.array(d), params or ThermalParams(t_supply_c=20.0), p_idle_w=100.0,
                                       p_full_w=300.0, total_cores=cores)


def peak_of(state: ClusterState, room: RoomModel) -> float:
    return room_state(room, state).max_inlet_c


def heuristic_peaks(state: ClusterState, room: RoomModel, tasks: list[TaskSpec]) -> dict[str, float]:
    """Peak inlet (°C, RoomModel.evaluate) of every heuristic that places all of `tasks` in order with plan()."""
    out = {}
    for name in sorted(HEURISTICS):
        s, policy = copy_state(state), make_policy(name, seed=7)
        for i, task in enumerate(tasks):
            p = plan(s, task, policy)
            if p.outcome is not Outcome.PLACED:
                break
            s.apply(f"h{i}", p.parts)
        else:
            out[name] = peak_of(s, room)
    return out


# 1 rack, 3 servers (K/W). Idle (100 W each) rises: 0.7, 0.65, 0.4 K, so server 0's inlet is the hottest.
# A 12-core task adds 100 W (eq.5: 200 W × 12/24) where it runs, i.e. 100 · D[:, k]:
#   on 0: [0.9, 0.7, 0.5]   on 1: [0.8, 0.85, 0.5]   on 2: [1.1, 1.05, 0.6]
# Server 1 recirculates least into the hottest inlet (D[0, 1] = 0.001): the optimum is 20 + 0.85 = 20.85 °C.
HAND_D = [[0.002, 0.001, 0.004],
          [0.0005, 0.002, 0.004],
          [0.001, 0.001, 0.002]]


def test_min_peak_inlet_puts_the_task_on_the_coolest_coupled_server() -> None:
    state, room = cpu_room(HAND_D)
    r = min_peak_inlet(state, room, [cpu_task(12)])
    assert r.status == "optimal" and r.assignment == ((Placement(0, 1, ()),),)
    assert r.objective == pytest.approx(20.85) and r.bound == pytest.approx(20.85)
    assert r.secondary == 0 and r.deployed == 1
    peaks = heuristic_peaks(state, room, [cpu_task(12)])
    assert peaks["firstfit"] == pytest.approx(20.9)  # server 0
    assert all(p >= r.objective - 1e-9 for p in peaks.values())
    assert gap_percent(peaks["firstfit"] - 20, r.objective - 20, sense="min") == pytest.approx(100 * 0.05 / 0.85)
    after = copy_state(state)
    r.apply(after)
    assert peak_of(after, room) == pytest.approx(r.objective)


def test_min_peak_inlet_then_the_fewest_overloaded_servers() -> None:
    # servers 1 and 2 heat nobody (zero columns of D): anything there leaves the peak alone. Two 10-core tasks
    # on one 24-core server would be 20/24 > 80 % (overloaded); the optimum puts one on each.
    state, room = cpu_room([[0.002, 0.0, 0.0], [0.001, 0.0, 0.0], [0.001, 0.0, 0.0]])
    r = min_peak_inlet(state, room, [cpu_task(10), cpu_task(10)])
    assert r.optimal and r.secondary_optimal and r.secondary == 0
    assert sorted(a[0].node for a in r.assignment) == [1, 2]
    assert r.objective == pytest.approx(20.2)  # 100 W idle × 0.002 on server 0's own inlet


def test_min_peak_inlet_counts_servers_overloaded_already() -> None:
    state, room = cpu_room([[0.002, 0.0, 0.0], [0.0, 0.002, 0.0], [0.0, 0.0, 0.002]])
    state.apply("old", (Part(0, 0, 0, 22 * MILLI, 0, 0, 0),))
    r = min_peak_inlet(state, room, [cpu_task(1)])
    assert r.optimal and r.secondary == 1 and r.placement(0).node != 0


def test_min_peak_inlet_places_every_part_of_a_split_task() -> None:
    state, room = cpu_room(HAND_D)
    tasks = [cpu_task(40, mem_gib=10), cpu_task(6)]  # 40 cores > the 24-core servers: 5 parts of 8 cores
    r = min_peak_inlet(state, room, tasks)
    assert r.optimal and len(r.assignment[0]) == len(split_task(tasks[0], state.dc)) == 5
    cluster, parts = r.as_parts(0)
    assert cluster == 0 and sum(p.cpu_milli for p in parts) == 40 * MILLI and sum(p.memory_mib for p in parts) == 10 * GIB
    with pytest.raises(ValueError, match="parts"):
        r.placement(0)
    after = copy_state(state)
    r.apply(after)
    assert_books_balance(after)
    assert peak_of(after, room) == pytest.approx(r.objective)
    assert all(p >= r.objective - 1e-9 for p in heuristic_peaks(state, room, tasks).values())


def test_min_peak_inlet_with_gpu_power() -> None:
    # two GPU servers (2 cards, 50 W idle / 250 W full per card); a whole-card task adds 200 W where it runs
    dc = make_dc([{"name": "g", "count": 2, "cpu_cores": 8, "memory_gib": 64,
                   "gpus": {"count": 2, "model": "T4", "memory_gib": 16, "idle_w": 50, "full_w": 250}}])
    state = ClusterState(dc)
    t = state.table
    room = RoomModel(np.array([[0.001, 0.004], [0.001, 0.002]]), ThermalParams(t_supply_c=18.0), p_idle_w=t.p_idle_w,
                     p_full_w=t.p_full_w, total_cores=t.cpu_milli / MILLI, gpu_count=t.gpu_count,
                     gpu_idle_w=t.gpu_idle_w, gpu_full_w=t.gpu_full_w)
    r = min_peak_inlet(state, room, [gpu_task(1, 100, cpu=0, mem_gib=1)])
    assert r.optimal and r.placement(0).node == 0 and len(r.placement(0).cards) == 1
    # P = 100 + 2 × 50 = 200 W per server at idle; +200 W on server 0: inlet 0 = 18 + 0.001·400 + 0.004·200
    assert r.objective == pytest.approx(18 + 0.4 + 0.8)


def test_min_peak_inlet_infeasible_and_mismatched_rooms() -> None:
    state, room = cpu_room(HAND_D)
    r = min_peak_inlet(state, room, [cpu_task(20), cpu_task(20), cpu_task(20), cpu_task(20)])
    assert r.status == "infeasible" and r.objective is None and r.assignment == (None,) * 4
    r = min_peak_inlet(state, room, [cpu_task(8, mem_gib=65)])
    assert r.status == "infeasible" and "fits no node" in r.message
    with pytest.raises(ValueError, match="room has 2 servers"):
        min_peak_inlet(state, RoomModel(np.zeros((2, 2))), [cpu_task(1)])


def test_redline_supply_mode_reports_the_evaluated_peak() -> None:
    params = ThermalParams(supply_mode="redline", redline_c=27.0, t_supply_min_c=10.0, t_supply_max_c=22.0)
    state, room = cpu_room(HAND_D, params=params)
    r = min_peak_inlet(state, room, [cpu_task(12)])
    assert r.optimal and r.placement(0).node == 1
    after = copy_state(state)
    r.apply(after)
    assert r.objective == pytest.approx(peak_of(after, room)) == pytest.approx(22.85)  # T_sup clipped at 22 °C


def test_redline_plateau_ties_go_to_the_fewest_overloads() -> None:
    # Redline mode holds the hottest inlet at 27 °C for every peak rise from 2 K (supply at its 25 °C max)
    # to 17 K, so (15 → node 0, 20 → node 1), rise 2.0 K, 2 overloads, and (15 → node 2, 20 → node 1),
    # rise 2.25 K, 1 overload, tie at 27 °C: the tie-break must pick the second.
    d = [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.002, 0.004, 0.004]]
    state, room = cpu_room(d, params=ThermalParams(supply_mode="redline", t_supply_max_c=25.0))
    state.apply("pre0", (Part(0, 0, 0, 5 * MILLI, 0, 0, 0),))
    r = min_peak_inlet(state, room, [cpu_task(15), cpu_task(20)])
    assert r.optimal and r.objective == pytest.approx(27.0)
    assert r.secondary == 1 and r.secondary_optimal


@st.composite
def thermal_instances(draw: st.DrawFn) -> tuple[ClusterState, RoomModel, list[TaskSpec]]:
    n = draw(st.integers(2, 3))
    d = [[draw(st.sampled_from([0.0, 0.0005, 0.001, 0.002, 0.004])) for _ in range(n)] for _ in range(n)]
    mode = draw(st.sampled_from(["fixed", "redline"]))
    state, room = cpu_room(d, params=ThermalParams(supply_mode=mode, t_supply_max_c=25.0))
    for k in range(n):
        busy = draw(st.integers(0, 16))
        if busy:
            state.apply(f"pre{k}", (Part(0, 0, k, busy * MILLI, 0, 0, 0),))
    tasks = [cpu_task(draw(st.integers(1, 30))) for _ in range(draw(st.integers(1, 3)))]
    return state, room, tasks


@SETTINGS
@given(thermal_instances())
def test_no_heuristic_placement_is_cooler_than_the_optimum(instance) -> None:
    state, room, tasks = instance
    parts = [d for t in tasks for d in split_task(t, state.dc)]
    r = min_peak_inlet(state, room, tasks)
    # brute force: every part on every server
    best, best_over = None, None
    if len(parts) <= 6:
        for nodes in itertools.product(range(state.n), repeat=len(parts)):
            s = copy_state(state)
            try:
                for i, (d, k) in enumerate(zip(parts, nodes, strict=True)):
                    s.apply(f"b{i}", (Part(0, 0, k, d.demand.cpu_milli, 0, 0, 0),))
            except OverAllocation:
                continue
            peak = peak_of(s, room)
            over = int(np.sum(5 * (s.table.cpu_milli - s.free_cpu) > 4 * s.table.cpu_milli))
            if best is None or peak < best - 1e-9 or (abs(peak - best) <= 1e-9 and over < best_over):
                best, best_over = peak, over
    if r.status == "infeasible":
        assert best is None and heuristic_peaks(state, room, tasks) == {}
        return
    assert r.status == "optimal"
    assert all(p >= r.objective - 1e-6 for p in heuristic_peaks(state, room, tasks).values())
    after = copy_state(state)
    r.apply(after)
    assert peak_of(after, room) == pytest.approx(r.objective)
    if best is not None:
        assert r.objective == pytest.approx(best, abs=1e-6)
        if r.secondary_optimal:
            assert r.secondary == best_over


# ---------------------------------------------------------------------------------------------------------------
# gap_percent


def test_gap_percent() -> None:
    assert gap_percent(2, 3) == pytest.approx(100 / 3)
    assert gap_percent(3, 3) == 0.0
    assert gap_percent(4, 3) == pytest.approx(-100 / 3)  # beat a (time-limited) incumbent
    assert gap_percent(1.1, 1.0, sense="min") == pytest.approx(10.0)
    assert gap_percent(0, 0) == 0.0 and gap_percent(1, 0, sense="min") == float("inf")
    with pytest.raises(ValueError, match="sense"):
        gap_percent(1, 1, sense="up")


def test_result_is_a_plain_value() -> None:
    r = OptimumResult("max_deployed", "optimal", 0.0, 0.0, 0, (), (), 0.0)
    assert r.optimal and r.apply([]) == []
