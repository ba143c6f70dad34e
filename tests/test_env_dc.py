"""hsched.envs.dc: the paper 003 §2.2 placement environment — Gymnasium API, eq.12 rewards by hand, the
incremental thermal model against RoomModel.evaluate, splitting, completions, seeding, and the same decisions
as the placer engine for the same heuristic."""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hsched.domain.fleet import DataCenter, load_fleet, parse_fleet
from hsched.domain.resources import MILLI, Resources
from hsched.domain.task import TaskSpec
from hsched.engine.placer import PlacerEngine
from hsched.envs.dc import ENV_ID, DcPlacementEnv, Job, RewardConfig, run_policy, thunder_jobs
from hsched.policies.heuristics import make_policy
from hsched.policies.placement import split_task
from hsched.state.keys import Keys
from hsched.state.redis import connect
from hsched.thermal import RoomModel, ThermalParams

SMALL_SPLIT = (30, 60, 10)  # warm-up, train, eval jobs of the Thunder log: enough for API checks


def tiny_dc(racks: int = 1, per_rack: int = 4, cores: int = 24, supply_mode: str = "fixed") -> DataCenter:
    """A one-vertex fleet with one CPU room of racks × per_rack servers (100 W idle / 300 W full)."""
    return parse_fleet(
        {
            "version": 1,
            "name": "tiny",
            "network_price_per_gb_ms": 0.0,
            "wan": {"vertices": [{"name": "v", "lat": 0.0, "lon": 0.0}], "scheduler_vertex": "v"},
            "datacenters": [
                {
                    "name": "room",
                    "vertex": "v",
                    "prices": {"cpu_core_hour": 0.04, "memory_gib_hour": 0.005},
                    "layout": {"racks": racks, "servers_per_rack": per_rack, "rows": 1},
                    "thermal": {"supply_mode": supply_mode, "t_supply_c": 20.0, "redline_c": 27.0},
                    "node_pools": [
                        {"name": "cpu", "count": racks * per_rack, "cpu_cores": cores, "memory_gib": 96}
                    ],
                }
            ],
        }
    ).datacenter("room")


def spec(cores: int, runtime_s: float = 1e6) -> TaskSpec:
    return TaskSpec(Resources(cores * MILLI, cores * 1024), runtime_s=runtime_s)


def hand_room(top_gain_k_per_w: float = 0.01) -> RoomModel:
    """4 servers; only the top one (3) breathes recirculated air: T_in,3 = 20 + 0.01 K/W × ΣP, others 20 °C."""
    d = np.zeros((4, 4))
    d[3, :] = top_gain_k_per_w
    return RoomModel(
        d, ThermalParams(t_supply_c=20.0, redline_c=27.0), p_idle_w=100.0, p_full_w=300.0, total_cores=24
    )


REWARD = RewardConfig(
    r_job=1.0,
    overheat_penalty=2.0,
    overload_penalty=0.5,
    phi_t=27.0,
    phi_u=0.8,
    defer_reward=0.0,
    invalid_penalty=1.0,
)


# ------------------------------------------------------------------------------------------------------------
# Gymnasium API


def test_check_env_passes_on_the_paper_room() -> None:
    env = gym.make(ENV_ID, split=SMALL_SPLIT).unwrapped
    assert env.n == 672 and env.action_space.n == 673  # 16 × 42 servers + "not now"
    assert env.observation_space.shape == (2 * 672 + 2,)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env)
    assert not [str(w.message) for w in caught if "gymnasium" in str(w.filename)]


def test_check_env_passes_on_a_tiny_room_and_make_vec_steps() -> None:
    check_env(
        gym.make(ENV_ID, dc=tiny_dc(), jobs=[Job(float(i), spec(8, 50.0)) for i in range(40)]).unwrapped
    )
    venv = gym.make_vec(ENV_ID, num_envs=2, vectorization_mode="sync", split=SMALL_SPLIT, phase="eval")
    obs, info = venv.reset(seed=1)
    assert obs.shape == (2, 1346) and obs.dtype == np.float32 and info["action_mask"].shape == (2, 673)
    for _ in range(20):
        obs, reward, _, _, info = venv.step([int(np.flatnonzero(m)[-1]) for m in info["action_mask"]])
    assert reward.shape == (2,) and np.all(info["placed"] > 0)
    venv.close()


def test_observation_layout() -> None:
    env = DcPlacementEnv(tiny_dc(), room=hand_room(), jobs=[Job(0.0, spec(24)), Job(0.0, spec(30))])
    obs, info = env.reset(seed=0)
    assert info["queue_length"] == 5  # 24 cores (one part) + 30 cores split into 4
    obs, *_ = env.step(2)  # 24 cores on server 1
    n = 4
    np.testing.assert_allclose(obs[:n], [0, 1, 0, 0])  # utilisation
    # inlets 20, 20, 20, 20 + 0.01 × (100 + 300 + 100 + 100) = 26 °C; θ = (T − 20) / (27 − 20)
    np.testing.assert_allclose(obs[n : 2 * n], [0, 0, 0, 6 / 7], atol=1e-6)
    assert obs[2 * n] == pytest.approx(8 / 24)  # head: the first 8-core part of the 30-core job
    assert obs[2 * n + 1] == pytest.approx(4 / 4)  # 4 subtasks waiting / 4 servers
    assert env.observation_space.contains(obs)


# ------------------------------------------------------------------------------------------------------------
# eq.12 by hand (hand_room: T_in,3 = 20 + 0.01 × ΣP; eq.5: P = 100 + 200 × busy/24)


def test_reward_eq12_hand_cases() -> None:
    jobs = [Job(0.0, spec(c)) for c in (8, 24, 24, 8)]
    env = DcPlacementEnv(tiny_dc(), room=hand_room(), jobs=jobs, reward=REWARD)
    env.reset(seed=0)
    # 8 cores on server 0: u0 = 8/24 = 0.33, T_in,0 = 20 °C → r = r_job = 1
    _, r, *_ = env.step(1)
    assert r == 1.0
    # 24 cores on server 1: u1 = 1.0 > 0.8 → r = 1 − 0.5 = 0.5; T_in,1 = 20 °C
    _, r, _, _, info = env.step(2)
    assert r == 0.5 and info["overloads"] == 1
    # 24 cores on server 3: P = [166.67, 300, 100, 300], ΣP = 866.67 W → T_in,3 = 28.67 °C > 27 and u3 = 1.0
    #   → r = 1 − 2 − 0.5 = −1.5
    _, r, _, _, info = env.step(4)
    assert env.state.inlet_c[3] == pytest.approx(20 + 0.01 * (100 + 200 * 8 / 24 + 300 + 100 + 300))
    assert r == -1.5 and info["overloads"] == 2 and info["max_inlet_c"] > 27
    # 8 cores on server 2: its inlet stays 20 °C (scope "server") and u2 = 0.33 → r = 1, although server 3 is hot
    _, r, terminated, _, _ = env.step(3)
    assert r == 1.0 and terminated


def test_reward_any_scope_invalid_and_defer() -> None:
    any_scope = RewardConfig(**{**REWARD.__dict__, "temperature_scope": "any"})
    jobs = [Job(0.0, spec(24, 100.0)), Job(0.0, spec(24)), Job(0.0, spec(8)), Job(0.0, spec(8))]
    env = DcPlacementEnv(tiny_dc(), room=hand_room(), jobs=jobs, reward=any_scope)
    env.reset(seed=0)
    env.step(4)  # 24 cores on server 3: ΣP = 600 W → T_in,3 = 26 °C, not hot yet (r = 1 − 0.5)
    _, r, *_ = env.step(
        3
    )  # 24 cores on server 2: ΣP = 800 W → T_in,3 = 28 °C > 27 → any scope: r = 1 − 2 − 0.5
    assert r == -1.5
    # server 2 is full: choosing it for the 8-core part is invalid → treated as "not now": r = 0 − 1; the clock
    # runs to the first completion (job 0, t = 100 s), which frees server 3
    _, r, _, _, info = env.step(3)
    assert r == -1.0 and info["invalid"] == 1 and info["deferred"] == 1 and info["time_s"] == 100.0
    assert env.util[3] == 0.0 and info["placed"] == 2
    _, r, _, _, info = env.step(0)  # plain "not now": r = defer_reward = 0; nothing runs out before t = 1e6
    assert r == 0.0 and info["deferred"] == 2 and info["time_s"] == 1e6 + 0.0


# ------------------------------------------------------------------------------------------------------------
# the simulation


def test_a_30_core_job_becomes_8_8_8_6_subtasks() -> None:
    env = DcPlacementEnv(tiny_dc(), jobs=[Job(0.0, spec(30))])
    env.reset(seed=0)
    assert [d.cpu_milli for d, _ in env._queue] == [8000, 8000, 8000, 6000]
    assert [p.demand.cpu_milli for p in split_task(spec(30), env.dc)] == [8000, 8000, 8000, 6000]
    metrics = run_policy(env, make_policy("firstfit"))
    assert metrics["placed"] == 4 and metrics["steps"] == 4
    # FirstFit: 8 + 8 + 8 fill server 0, the 6-core part goes to server 1
    assert env.cluster.busy_cpu().tolist() == [24000, 6000, 0, 0]


def test_completions_free_resources_and_waiting_runs_the_clock() -> None:
    jobs = [Job(0.0, spec(24, 100.0)) for _ in range(4)] + [Job(10.0, spec(16, 50.0))]
    env = DcPlacementEnv(tiny_dc(), jobs=jobs)
    _, info = env.reset(seed=0)
    for k in (1, 2, 3, 4):
        _, _, _, _, info = env.step(k)
    # all four servers full; the queue ran empty so the clock went on to the next arrival at t = 10 s
    assert info["time_s"] == 10.0 and not info["action_mask"][1:].any() and info["queue_length"] == 1
    _, r, _, _, info = env.step(0)  # wait: the four completions at t = 100 s free every server at once
    assert info["time_s"] == 100.0 and info["action_mask"][1:].all() and r == 0.0
    assert env.cluster.allocations == {} and env.cluster.busy_cpu().sum() == 0
    np.testing.assert_allclose(env.state.power_w, 100.0)
    _, _, terminated, _, info = env.step(2)
    assert terminated and env.cluster.busy_cpu().tolist() == [0, 16000, 0, 0]


def test_metrics_are_averaged_over_simulated_time() -> None:
    # job A (24 cores, 100 s) at t = 0 and job B (8 cores) at t = 300 s
    env = DcPlacementEnv(
        tiny_dc(), room=hand_room(0.0), jobs=[Job(0.0, spec(24, 100.0)), Job(300.0, spec(8))]
    )
    env.reset(seed=0)
    env.step(
        1
    )  # A on server 0: 1 overloaded server on [0, 100); then A ends and the clock runs to B at 300 s
    _, _, terminated, _, _ = env.step(1)
    assert terminated
    m = env.episode_metrics()
    assert m["sim_hours"] == pytest.approx(300 / 3600)
    assert m["mean_overloads"] == pytest.approx((1 * 100 + 0 * 200) / 300)
    # IT power: 300 + 3 × 100 = 600 W on [0, 100), 400 W on [100, 300)
    assert m["mean_it_power_w"] == pytest.approx((600 * 100 + 400 * 200) / 300)
    # 24 of the room's 4 × 24 cores busy on [0, 100), none on [100, 300)
    assert m["mean_cpu_load"] == pytest.approx(0.25 * 100 / 300)
    # fixed 20 °C supply: PUE = 1 + 1/CoP(20) + 0.05, CoP(20) = 0.0068·400 + 0.0008·20 + 0.458 = 3.194
    assert m["mean_pue"] == pytest.approx(1.05 + 1 / 3.194)
    assert m["mean_reward"] == pytest.approx((0.5 + 1.0) / 2)  # A overloads its server (u = 1): 1 − 0.5


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    jobs=st.lists(
        st.tuples(st.integers(0, 400), st.integers(1, 40), st.integers(1, 60)), min_size=3, max_size=25
    ),
    picks=st.lists(st.integers(0, 10_000), min_size=80, max_size=80),
    mode=st.sampled_from(["fixed", "redline"]),
)
def test_incremental_thermal_equals_room_evaluate(jobs, picks, mode) -> None:
    env = DcPlacementEnv(
        tiny_dc(racks=2, per_rack=3, supply_mode=mode),
        jobs=[Job(float(t), spec(c, float(r))) for t, c, r in sorted(jobs)],
    )
    env.reset(seed=0)
    completions = 0
    for pick in picks:
        mask = env.action_masks()
        feasible = np.flatnonzero(mask[1:]) + 1
        action = 0 if pick % 5 == 0 or not len(feasible) else int(feasible[pick % len(feasible)])
        running = len(env.cluster.allocations)
        _, _, terminated, truncated, info = env.step(action)
        completions += running + (action > 0) - len(env.cluster.allocations)
        ref = env.room.evaluate(env.cluster.busy_cpu() / MILLI)
        got = env.state
        for a, b in ((got.power_w, ref.power_w), (got.inlet_c, ref.inlet_c), (got.outlet_c, ref.outlet_c)):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-9)
        for name in ("t_supply_c", "it_power_w", "cooling_power_w", "pue", "max_inlet_c"):
            assert getattr(got, name) == pytest.approx(getattr(ref, name), rel=0, abs=1e-9)
        assert info["overloads"] == int((env.cluster.busy_cpu() / env.table.cpu_milli > 0.8).sum())
        if terminated or truncated:
            break
    event(f"completions > 0: {completions > 0}")


def test_seeded_episodes_are_reproducible_and_start_from_the_same_warm_room() -> None:
    def trajectory(env: DcPlacementEnv, seed: int) -> tuple[int, list[float], np.ndarray]:
        obs, info = env.reset(seed=seed)
        rng = np.random.default_rng(seed)
        rewards, last = [], obs
        for _ in range(60):
            feasible = np.flatnonzero(info["action_mask"])
            last, r, term, trunc, info = env.step(int(rng.choice(feasible)))
            rewards.append(r)
            if term or trunc:
                break
        return env.episode_start, rewards, last

    a = DcPlacementEnv(split=(30, 200, 0), episode_jobs=20)
    b = DcPlacementEnv(split=(30, 200, 0), episode_jobs=20)
    s1, r1, o1 = trajectory(a, 7)
    s2, r2, o2 = trajectory(b, 7)
    assert s1 == s2 and r1 == r2 and np.array_equal(o1, o2)
    starts = set()
    for seed in range(6):
        a.reset(seed=seed)
        starts.add(a.episode_start)
        trajectory(b, seed + 100)  # b plays some other episode, then resets to a's window
        b.reset(options={"start": a.episode_start})
        # every reset restores the (cached) warm-up state: no episode leaks into the next
        assert all(
            np.array_equal(x, y) for x, y in zip(a.cluster.snapshot(), b.cluster.snapshot(), strict=True)
        )
        np.testing.assert_array_equal(a.state.inlet_c, b.state.inlet_c)
    assert len(starts) > 1
    assert a.cluster.busy_cpu().sum() > 0  # warmed up: the 30 warm-up jobs left work running


def test_trace_phases_follow_the_paper_split() -> None:
    jobs = thunder_jobs(5500)
    train = DcPlacementEnv(phase="train", split=(2000, 3000, 500))
    evaluation = DcPlacementEnv(phase="eval", split=(2000, 3000, 500), offset=500)
    assert train._phase_jobs[0] == jobs[2000] and len(train._phase_jobs) == 3000
    assert train._warm_jobs == jobs[:2000]
    assert evaluation._phase_jobs[0] == thunder_jobs(6000)[5500] and len(evaluation._phase_jobs) == 500


# ------------------------------------------------------------------------------------------------------------
# the environment and the placer decide alike


@pytest.fixture
async def aredis(redis_url):
    client = connect(redis_url)
    yield client
    await client.aclose()


@pytest.mark.parametrize("policy", ["greedy", "rr", "bestfit", "utilization"])
async def test_env_and_placer_make_the_same_choices(aredis, prefix, policy) -> None:
    dc = load_fleet().datacenter("chicago")
    subtasks = [TaskSpec(p.demand, runtime_s=1e6) for j in thunder_jobs(120) for p in split_task(j.spec, dc)][
        :300
    ]
    engine = PlacerEngine(dc, aredis, Keys(prefix), make_policy(policy), "p1", thermal=None)
    await engine.start(wait_for_lease_s=5.0)
    try:
        served = []
        for i, s in enumerate(subtasks):
            result = await engine.place(f"s{i}", s, allow_defer=False)
            assert result.outcome == "placed"
            served.append(result.parts[0].node)
    finally:
        await engine.stop()

    env = DcPlacementEnv(dc, jobs=[Job(0.0, s) for s in subtasks])  # nothing completes: runtime 1e6 s
    env.reset(seed=0)
    env_policy, simulated = make_policy(policy), []
    for _ in subtasks:
        action = env.policy_action(env_policy)
        simulated.append(action - 1)
        env.step(action)
    assert simulated == served
    assert len(set(served)) > 1  # not a trivial sequence
    assert all(
        np.array_equal(x, y) for x, y in zip(env.cluster.snapshot(), engine.state.snapshot(), strict=True)
    )


def test_run_policy_accepts_a_callable() -> None:
    env = DcPlacementEnv(tiny_dc(), jobs=[Job(float(i), spec(8, 30.0)) for i in range(12)])
    last_feasible = lambda obs, mask: int(np.flatnonzero(mask)[-1])  # noqa: E731
    m = run_policy(env, last_feasible, seed=0)
    # nothing ends before t = 30 s: server 3 takes jobs 0-2, server 2 jobs 3-5, … ; each third part fills a
    # server (u = 1 > 0.8): 4 of the 12 rewards are 1 − 0.5
    assert (
        m["placed"] == 12 and m["invalid"] == 0 and m["mean_reward"] == pytest.approx((8 * 1 + 4 * 0.5) / 12)
    )
    assert env.cluster.busy_cpu().tolist() == [24000] * 4
