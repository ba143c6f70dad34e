"""hsched.metrics (paper 000 eq.8, 15-17, 26-28, tables 6-9) against hand-computed values, and the
GpuClusterEnv: Gymnasium API, rewards, the delay action, releases, seeding, slices never spanning cards."""

from __future__ import annotations

import warnings

import gymnasium
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hsched.domain.cluster import ClusterState, GpuShare, Part
from hsched.domain.fleet import parse_fleet
from hsched.domain.resources import Resources
from hsched.domain.task import TaskSpec
from hsched.envs.gpu import ENV_ID, GpuClusterEnv, MultiClusterState, paper000_datacenters, run_policy
from hsched.metrics import (
    FAILURE_REWARD,
    RESOURCES,
    deployed_count,
    gpu_load_variance,
    mean_utilisation,
    normalised_score,
    objective_eq9,
    paper_fragmentation,
    placement_reward,
    reward_eq17,
    utilisation_matrix,
    utilisation_stats,
)
from hsched.policies.heuristics import make_policy

GIB = 1024


def fleet(*clusters: list[dict]) -> tuple:
    """DataCenters from node-pool dicts (one list of pools per cluster), through parse_fleet."""
    dcs = [{"name": f"c{i}", "vertex": "v", "prices": {"cpu_core_hour": 0, "memory_gib_hour": 0},
            "layout": {"racks": 1, "servers_per_rack": sum(p["count"] for p in pools), "rows": 1},
            "node_pools": pools} for i, pools in enumerate(clusters)]
    return parse_fleet({"version": 1, "name": "t", "network_price_per_gb_ms": 0,
                        "wan": {"vertices": [{"name": "v", "lat": 0, "lon": 0}], "scheduler_vertex": "v"},
                        "datacenters": dcs}).datacenters


def gpu_pool(name: str = "g", count: int = 1, cpu: float = 10, mem_gib: float = 10, cards: int = 1,
             card_gib: float = 10) -> dict:
    return {"name": name, "count": count, "cpu_cores": cpu, "memory_gib": mem_gib,
            "gpus": {"count": cards, "model": "T4", "memory_gib": card_gib}}


def task(cpu: int, mem_mib: int, gpus: int = 0, pct: int = 0, gmem_mib: int = 0, runtime_s: float = 100.0,
         name: str = "") -> TaskSpec:
    return TaskSpec(Resources(cpu, mem_mib, 0, 0, gpus, pct, gmem_mib), runtime_s=runtime_s, name=name)


# ------------------------------------------------------------------------------------------------------------
# metrics: two one-node clusters (10 cores, 10 GiB, one 10 GiB card) with hand-set allocations
#   X: cpu 5/10, memory 2.5/10, GPU core 50/100, GPU memory 5/10   -> Ū_X = (0.5+0.25+0.5+0.5)/4 = 0.4375
#   Y: cpu 1/10, memory 1/10,   GPU core 20/100, GPU memory 1/10   -> Ū_Y = (0.1+0.1+0.2+0.1)/4 = 0.125


@pytest.fixture
def two_clusters() -> list[ClusterState]:
    x, y = (ClusterState(dc) for dc in fleet([gpu_pool()], [gpu_pool()]))
    x.apply("a", (Part(0, 0, 0, 5000, 2560, 0, 0, (GpuShare(0, 50, 5 * GIB),)),))
    y.apply("b", (Part(0, 0, 0, 1000, 1024, 0, 0, (GpuShare(0, 20, 1 * GIB),)),))
    return [x, y]


def test_utilisation_matrix_and_eq8(two_clusters):
    u = utilisation_matrix(two_clusters)
    assert RESOURCES == ("gpu_memory", "gpu_core", "cpu", "memory")
    np.testing.assert_allclose(u, [[0.5, 0.5, 0.5, 0.25], [0.1, 0.2, 0.1, 0.1]])
    np.testing.assert_allclose(mean_utilisation(u), [0.4375, 0.125])
    assert objective_eq9(two_clusters) == pytest.approx((0.4375 + 0.125) / 2)


def test_table6_mean_and_population_std_across_clusters(two_clusters):
    stats = utilisation_stats(two_clusters)
    assert stats["gpu_memory"] == pytest.approx((0.3, 0.2))
    assert stats["gpu_core"] == pytest.approx((0.35, 0.15))
    assert stats["cpu"] == pytest.approx((0.3, 0.2))
    assert stats["memory"] == pytest.approx((0.175, 0.075))


def test_eq26_deployed_count():
    assert deployed_count(170, 40) == 210
    assert deployed_count(0, 0) == 0
    with pytest.raises(ValueError):
        deployed_count(-1, 0)


def test_eq27_fragmentation(two_clusters):
    # X: 0.5 + 0.75 + 0.5 + 0.5 = 2.25; Y: 0.9 + 0.9 + 0.8 + 0.9 = 3.5; mean 2.875
    assert paper_fragmentation(two_clusters) == pytest.approx(2.875)
    empty = [ClusterState(dc) for dc in fleet([gpu_pool()])]
    assert paper_fragmentation(empty) == pytest.approx(4.0)


def test_eq28_gpu_load_variance(two_clusters):
    # GPU load: X (0.5 + 0.5)/2 = 0.5, Y (0.2 + 0.1)/2 = 0.15 -> mean 0.325, variance 0.175² = 0.030625
    assert gpu_load_variance(two_clusters) == pytest.approx(0.030625)
    # eq.8 over all four resources: 0.4375 and 0.125 -> variance 0.15625² = 0.0244140625
    assert gpu_load_variance(two_clusters, RESOURCES) == pytest.approx(0.0244140625)


def test_resources_a_cluster_lacks_are_left_out():
    cpu_only = {"name": "cpu", "count": 1, "cpu_cores": 10, "memory_gib": 10}
    x, y = (ClusterState(dc) for dc in fleet([cpu_only], [gpu_pool()]))
    x.apply("a", (Part(0, 0, 0, 5000, 5 * GIB, 0, 0),))
    u = utilisation_matrix([x, y])
    assert np.isnan(u[0, :2]).all() and u[0, 2:].tolist() == [0.5, 0.5]
    assert mean_utilisation(u)[0] == pytest.approx(0.5)  # over CPU and memory only, not 0/0 GPUs
    assert mean_utilisation(u[0])[0] == pytest.approx(0.5)  # the 1-D fast path agrees
    assert paper_fragmentation([x]) == pytest.approx(1.0)  # 0.5 + 0.5
    assert gpu_load_variance([x, y]) == 0.0  # only y has GPUs


def test_reward_eq15_17():
    scores = np.array([0.45, 0.2, 0.0])
    assert placement_reward(scores, 0) == 0.0  # the most utilised cluster: Score = 1
    assert placement_reward(scores, 2) == pytest.approx(-10.0)  # the least utilised: Score = 0 -> −τ
    assert normalised_score(scores, 1) == pytest.approx(0.2 / 0.45)
    assert placement_reward(scores, 1) == pytest.approx((0.2 / 0.45 - 1) * 10)  # −50/9
    assert placement_reward(scores, 1, tau=2.0) == pytest.approx((0.2 / 0.45 - 1) * 2)
    assert placement_reward(np.array([0.3, 0.3]), 1) == 0.0  # all equal: Score = 1
    assert placement_reward(np.array([0.3]), 0) == 0.0  # one cluster


def test_reward_eq17_from_states(two_clusters):
    assert reward_eq17(two_clusters, 0) == 0.0
    assert reward_eq17(two_clusters, 1) == pytest.approx(-10.0)
    assert reward_eq17(two_clusters, None) == FAILURE_REWARD == -50.0


# ------------------------------------------------------------------------------------------------------------
# the env: three one-node clusters (10 cores, 10 GiB, one 10 GiB card)


@pytest.fixture
def three() -> tuple:
    return fleet([gpu_pool()], [gpu_pool()], [gpu_pool()])


def test_rewards_failure_and_the_delay_action(three):
    tasks = [task(4000, 4 * GIB, 1, 50, 5 * GIB, name="t0"),  # -> host 0: cluster 0 at 0.45, reward 0
             task(2000, 2 * GIB, 1, 20, 2 * GIB, name="t1"),  # -> host 1: cluster 1 at 0.2: (0.2/0.45 − 1)·10
             task(1000, 1 * GIB, 1, 60, 1 * GIB, name="t2"),  # host 0 has 50 % GPU left: failure, dropped
             task(1000, 1 * GIB, name="t3"),  # wait although hosts have room: −50, back of the queue
             task(1000, 1 * GIB, 2, 100, 1 * GIB, name="t4")]  # 2 GPUs: fits nowhere, a correct delay
    env = GpuClusterEnv(three, tasks=tasks, max_waits=1)
    _, info = env.reset(seed=0)
    assert info["action_mask"].tolist() == [1, 1, 1, 0] and info["action_mask"].dtype == np.int8
    _, r, term, _, info = env.step(0)
    assert (r, info["event"], term) == (0.0, "placed", False)
    _, r, _, _, info = env.step(1)
    assert r == pytest.approx(-50 / 9) and info["event"] == "placed"
    assert info["action_mask"].tolist() == [0, 1, 1, 0]  # t2 needs 60 % of a card: not on host 0
    _, r, _, _, info = env.step(0)
    assert (r, info["event"], info["failed"]) == (-50.0, "failed", 1)
    assert env.current_task.name == "t3"
    _, r, _, _, info = env.step(env.wait_action)
    assert (r, info["event"]) == (-50.0, "delayed")
    assert env.current_task.name == "t4"  # t3 went to the back of the queue
    assert info["action_mask"].tolist() == [0, 0, 0, 1]  # nothing fits t4: only "wait" is allowed
    _, r, _, _, info = env.step(env.wait_action)
    assert (r, info["event"]) == (0.0, "delayed")
    assert env.current_task.name == "t3"
    _, r, _, _, info = env.step(env.wait_action)  # t3's second delay (max_waits = 1): it leaves, failed
    assert (r, info["event"], info["failed"]) == (-50.0, "failed", 2)
    _, r, term, trunc, info = env.step(env.wait_action)  # t4's second delay: judged (eq.26 n_suc_jud)
    assert (r, info["event"], term, trunc) == (0.0, "judged", True, False)
    m = info["episode"]
    assert (m["deployed"], m["judged"], m["failed"], m["eq26"]) == (2, 1, 2, 3)
    assert info["action_mask"].tolist() == [0, 0, 0, 0]
    with pytest.raises(RuntimeError):
        env.step(0)


def test_releases_make_room_for_a_delayed_task(three):
    big = task(10000, 10 * GIB, 1, 100, 10 * GIB, runtime_s=20.0, name="big")
    one = fleet([gpu_pool()])
    tasks = [big, task(5000, 5 * GIB, 1, 50, 5 * GIB, name="next")]
    env = GpuClusterEnv(one, tasks=tasks, runtime_scale_s=10.0)
    _, info = env.reset()
    _, _, _, _, info = env.step(0)  # big runs 20 s = 2 ticks: placed at tick 0, ends at tick 2
    assert info["action_mask"].tolist() == [0, 1]
    _, r, _, _, info = env.step(env.wait_action)  # correct delay; tick 2: big is released
    assert (r, info["event"]) == (0.0, "delayed")
    assert info["action_mask"].tolist() == [1, 0]  # "next" came round again and now fits
    _, _, term, _, info = env.step(0)
    assert term and info["episode"]["deployed"] == 2
    # without releases the same delayed task never fits again
    env = GpuClusterEnv(one, tasks=[big, task(5000, 5 * GIB, 1, 50, 5 * GIB)])
    env.reset()
    env.step(0)
    _, _, _, _, info = env.step(env.wait_action)
    assert info["action_mask"].tolist() == [0, 1]


def test_check_env_and_make_vec():
    from gymnasium.utils.env_checker import check_env

    env = gymnasium.make(ENV_ID)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env.unwrapped)
    assert not [str(w.message) for w in caught]
    venv = gymnasium.make_vec(ENV_ID, num_envs=2, vectorization_mode="sync")
    obs, info = venv.reset(seed=0)
    assert obs["hosts"].shape == (2, 64, 6) and obs["clusters"].shape == (2, 16, 4)
    assert obs["task"].shape == (2, 7)
    assert info["action_mask"].shape == (2, 65)
    obs, rewards, *_ = venv.step([int(np.flatnonzero(m)[0]) for m in info["action_mask"]])
    assert rewards.tolist() == [0.0, 0.0]  # the first placement makes its cluster the most utilised
    venv.close()


def test_seeding_reproduces_tasks_and_trajectories():
    env = GpuClusterEnv()

    def trajectory(seed: int) -> tuple[list[str], list[float], np.ndarray]:
        _, info = env.reset(seed=seed)
        names = [t.name for t in env.tasks]
        rewards = []
        for _ in range(60):
            obs, r, *_, info = env.step(int(np.flatnonzero(info["action_mask"])[-1]))
            rewards.append(r)
        return names, rewards, obs["hosts"]

    a, b, c = trajectory(3), trajectory(3), trajectory(4)
    assert a[0] == b[0] and a[1] == b[1] and np.array_equal(a[2], b[2])
    assert a[0] != c[0]
    assert len(a[0]) == 220 and len(set(a[0])) == 220  # drawn without replacement
    order = [int(n.rsplit("-", 1)[1]) for n in a[0]]
    assert order == sorted(order)  # FIFO in trace order


def test_observation_layout():
    env = GpuClusterEnv()
    obs, _ = env.reset(seed=0)
    assert env.observation_space.contains(obs)
    np.testing.assert_allclose(obs["clusters"], 1.0)  # empty fleet: everything free
    t = env.current_task
    np.testing.assert_allclose(obs["task"][:2], [t.resources.cpu_milli / env._host_scale[0],
                                                 t.resources.memory_mib / env._host_scale[1]], rtol=1e-6)
    host = int(np.flatnonzero(env._room)[0])
    obs, *_ = env.step(host)
    f = env.view.fleet
    assert obs["hosts"][host, 0] == pytest.approx(f.free_cpu[host] / env._host_scale[0], rel=1e-6)
    assert obs["hosts"][host, 4] == pytest.approx(f.gpu_free_core[host].max() / 100, rel=1e-6)


@pytest.mark.parametrize("name", ["bestfit", "firstfit", "greedy", "random", "utilization"])
def test_run_policy_masked_heuristics_never_fail(name):
    env = GpuClusterEnv()
    res = run_policy(env, make_policy(name, 0), seed=1)
    m = res.metrics
    assert m["failed"] == 0 and m["deployed"] + m["judged"] == 220 == m["eq26"]
    assert 100 < m["deployed"] < 220  # the paper-scale fleet cannot hold all 220 tasks
    assert res.steps == 220 + m["judged"]  # a judged task takes two delays (max_waits = 1), a placed one 1
    np.testing.assert_allclose(env._u, utilisation_matrix(env.clusters))  # the incremental rows are exact
    assert m["fragmentation"] == pytest.approx(paper_fragmentation(env.clusters))
    assert m["gpu_load_variance"] == pytest.approx(gpu_load_variance(env.clusters))


def test_multicluster_views_write_through():
    view = MultiClusterState(fleet([gpu_pool(count=2, cards=2)], [gpu_pool(cards=8)]))
    assert view.hosts == 3 and view.fleet.gpu_free_core.shape == (3, 8) and view.offsets.tolist() == [0, 2, 3]
    c = view.place("x", 2, Resources(1000, 1024, 0, 0, 3, 40, 1024))
    assert c == 1 and view.locate(2) == (1, 0)
    assert view.clusters[1].gpu_free_core[0].tolist()[:3] == [60, 60, 60]
    assert view.fleet.gpu_free_core[2].tolist()[:3] == [60, 60, 60]
    assert view.fleet.free_cpu[2] == 9000
    view.reset()
    assert view.fleet.free_cpu[2] == 10000 and view.clusters[1].free_cpu[0] == 10000
    assert not view.clusters[1].allocations


@st.composite
def fleets_and_tasks(draw):
    clusters = []
    for _ in range(draw(st.integers(1, 3))):
        pools = [gpu_pool(name=f"p{i}", count=draw(st.integers(1, 3)), cpu=draw(st.sampled_from([8, 16, 32])),
                          mem_gib=draw(st.sampled_from([16, 64])), cards=draw(st.integers(1, 8)),
                          card_gib=draw(st.sampled_from([8, 16, 24])))
                 for i in range(draw(st.integers(1, 2)))]
        clusters.append(pools)
    tasks = []
    for _ in range(draw(st.integers(5, 40))):
        gpus = draw(st.sampled_from([0, 1, 1, 1, 2, 4]))
        pct = draw(st.integers(1, 100)) if gpus == 1 else (100 if gpus else 0)
        tasks.append(task(draw(st.integers(1, 8)) * 1000, draw(st.integers(0, 16)) * GIB, gpus, pct,
                          draw(st.integers(0, 16)) * 512 if gpus else 0))
    return fleet(*clusters), tasks, draw(st.integers(0, 2**31 - 1))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleets_and_tasks())
def test_a_slice_never_spans_cards(case):
    dcs, tasks, seed = case
    env = GpuClusterEnv(dcs, tasks=tasks)
    rng = np.random.default_rng(seed)
    _, info = env.reset(seed=seed)
    term = False
    while not term:
        t = env.current_task
        action = int(rng.choice(np.flatnonzero(info["action_mask"])))
        _, _, term, _, info = env.step(action)
        if info["event"] != "placed":
            continue
        c, _ = env.view.locate(action)
        (part,) = list(env.clusters[c].allocations.values())[-1]  # the allocation just made
        r = t.resources
        assert len(part.gpus) == r.gpu_count == len({g.card for g in part.gpus})  # distinct cards
        assert all(g.core_percent == r.gpu_core_percent and g.memory_mib == r.gpu_memory_mib
                   for g in part.gpus)
    f, tab = env.view.fleet, env.view.fleet.table
    assert (f.gpu_free_core >= 0).all() and (f.gpu_free_memory >= 0).all() and (f.free_cpu >= 0).all()
    used_core = np.zeros_like(f.gpu_free_core)
    for c, s in enumerate(env.clusters):
        for parts in s.allocations.values():
            for p in parts:
                for g in p.gpus:
                    used_core[env.view.offsets[c] + p.node, g.card] += g.core_percent
    # the cards' used amounts are exactly the sum of whole slices recorded on them
    np.testing.assert_array_equal(used_core, tab.gpu_core_percent - f.gpu_free_core)


def test_paper000_fleet_shape():
    dcs = paper000_datacenters()
    assert len(dcs) == 16 and all(dc.node_count == 4 for dc in dcs)
    assert {p.gpu_count for dc in dcs for p in dc.pools} == {2}
    assert {p.gpu_model for dc in dcs for p in dc.pools} <= {"T4", "P100"}
    assert paper000_datacenters() == dcs  # seeded
    with pytest.raises(ValueError, match="replace=True"):
        paper000_datacenters(200, 4)
    with pytest.raises(ValueError):
        GpuClusterEnv("nope")
