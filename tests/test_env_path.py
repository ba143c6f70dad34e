"""hsched.envs.path: the path MDP of paper 003 §2.1 (reward eq.11) against hand-computed cases."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import given, settings
from hypothesis import strategies as st

from hsched.costs import WanGraph, rank_datacenters
from hsched.domain.errors import ValidationError
from hsched.domain.fleet import DataCenter, Link, NodePool, Prices, RoomLayout, Wan, load_fleet
from hsched.domain.resources import Resources
from hsched.domain.task import TaskSpec
from hsched.envs.path import (
    ENV_ID,
    PathEnv,
    PolicyPathFinder,
    eq11,
    goal_reward_for,
    latency_ref_for,
    latency_reward,
    optimal_policy,
    reward_eq11,
    rollout_path,
    value_iteration,
)
from hsched.traces import data_dir


def tiny_wan() -> Wan:
    """s ─2─ a ─0.5─ b ─4─ s, and c ─1─ a (latencies in ms). Target s; c is two hops from it.

    Vertex order (= action index): s 0, a 1, b 2, c 3.
    """
    links = (Link("s", "a", 400, 2.0), Link("a", "b", 100, 0.5), Link("b", "s", 800, 4.0), Link("c", "a", 200, 1.0))
    return Wan(vertices={"s": (0.0, 0.0), "a": (0.0, 1.0), "b": (0.0, 2.0), "c": (0.0, 3.0)}, links=links,
               scheduler_vertex="s", entry_vertices=("s",))


S, A, B, C = range(4)


@pytest.fixture
def tiny() -> WanGraph:
    return WanGraph(tiny_wan())


@pytest.fixture(scope="module")
def abilene() -> WanGraph:
    return WanGraph(load_fleet().wan)


# ------------------------------------------------------------------------------------------------------------
# eq.11


def test_eq11_hand_cases(tiny: WanGraph) -> None:
    assert eq11(None, arrived=False, goal_reward=10.0) == -1.0  # no link
    assert eq11(None, arrived=True, goal_reward=10.0) == -1.0  # "arriving" over a missing link is still invalid
    assert eq11(0.5, arrived=False, goal_reward=10.0) == 2.0  # 1/w
    assert eq11(0.5, arrived=True, goal_reward=10.0) == 10.0  # piecewise: the goal replaces 1/w
    assert reward_eq11(tiny, "a", "b", goal_reward=10.0) == 1 / 0.5
    assert reward_eq11(tiny, "a", "c", goal_reward=10.0) == 1 / 1.0
    assert reward_eq11(tiny, "c", "b", goal_reward=10.0) == -1.0  # c–b does not exist
    assert reward_eq11(tiny, "c", "c", goal_reward=10.0) == -1.0  # no self-loops either
    assert reward_eq11(tiny, "a", "s", goal_reward=10.0) == 10.0  # s is the default target (scheduler)
    assert reward_eq11(tiny, "a", "s", target="b", goal_reward=10.0) == 1 / 2.0
    assert reward_eq11(tiny, "a", "b", target="b", goal_reward=7.0, invalid_reward=-3.0) == 7.0
    assert reward_eq11(tiny, "c", "b", target="b", goal_reward=7.0, invalid_reward=-3.0) == -3.0
    with pytest.raises(ValidationError, match="v"):
        reward_eq11(tiny, "a", "nowhere", goal_reward=1.0)


def test_zero_latency_is_floored(tiny: WanGraph) -> None:
    tiny.update_link("a", "b", latency_ms=0.0)  # a probe may report 0 ms: floored at 0.05 ms, no division by 0
    assert reward_eq11(tiny, "a", "b", goal_reward=10.0) == pytest.approx(20.0)


def test_env_steps_follow_eq11(tiny: WanGraph) -> None:
    env = PathEnv(tiny, start="c", goal_reward=10.0)
    obs, info = env.reset(seed=0)
    assert env.vertices == ("s", "a", "b", "c")
    assert obs.dtype == np.float32 and obs.shape == (8,)
    assert obs.tolist() == [0, 0, 0, 1, 1, 0, 0, 0]  # one-hot current (c) ⧺ one-hot target (s)
    assert info["path"] == ("c",) and info["target"] == "s"

    obs, r, term, trunc, info = env.step(B)  # c–b: no link → −1, stays at c
    assert (r, term, trunc, env.current, info["path"]) == (-1.0, False, False, "c", ("c",))
    assert obs[C] == 1.0

    obs, r, term, trunc, info = env.step(np.int64(A))  # c–a: 1 ms → 1/1
    assert (r, term, env.current, info["path"]) == (1.0, False, "a", ("c", "a"))

    obs, r, term, trunc, info = env.step(B)  # a–b: 0.5 ms → 2
    assert r == pytest.approx(2.0) and not term

    obs, r, term, trunc, info = env.step(S)  # b–s reaches the target: goal reward, terminated
    assert (r, term, trunc, info["path"]) == (10.0, True, False, ("c", "a", "b", "s"))
    assert obs.tolist() == [1, 0, 0, 0, 1, 0, 0, 0]


def test_action_mask_is_the_adjacency(tiny: WanGraph) -> None:
    env = PathEnv(tiny, start="c")
    _, info = env.reset(seed=0)
    assert info["action_mask"].dtype == np.int8
    assert info["action_mask"].tolist() == [0, 1, 0, 0]  # from c only a
    _, _, _, _, info = env.step(A)
    assert info["action_mask"].tolist() == [1, 0, 1, 1]  # from a: s, b, c
    info["action_mask"][:] = 0  # the caller's copy: writing it does not change the env
    assert env._info()["action_mask"].tolist() == [1, 0, 1, 1]
    for u in range(env.n):  # every vertex: mask[j] == 1 iff a link exists
        env._u = u
        mask = env._info()["action_mask"]
        assert [bool(m) for m in mask] == [env.vertices[j] in tiny.graph.adj[env.vertices[u]]
                                           for j in range(env.n)]


def test_truncation_at_max_steps(tiny: WanGraph) -> None:
    env = PathEnv(tiny, start="c", max_steps=3)
    env.reset(seed=0)
    for i in range(3):
        _, r, term, trunc, _ = env.step(B)  # invalid forever
        assert r == -1.0 and not term
        assert trunc == (i == 2)
    assert PathEnv(tiny).max_steps == 8  # default: 2 × vertex count


def test_arrival_on_the_last_step_is_terminated_not_truncated(tiny: WanGraph) -> None:
    env = PathEnv(tiny, start="a", max_steps=1)
    env.reset(seed=0)
    _, _, term, trunc, _ = env.step(S)
    assert term and not trunc


def test_seeding_reproduces_the_start_sequence(tiny: WanGraph) -> None:
    def starts(seed: int, k: int = 30) -> list[str]:
        env = PathEnv(tiny)
        env.reset(seed=seed)
        out = []
        for _ in range(k):
            out.append(env.current)
            env.reset()
        return out

    first = starts(123)
    assert first == starts(123)
    assert first != starts(124)
    assert "s" not in first  # never starts on the target
    assert set(first) == {"a", "b", "c"}


def test_start_excludes_vertices_that_cannot_reach_the_target() -> None:
    wan = tiny_wan()
    wan = Wan(vertices={**wan.vertices, "island": (1.0, 1.0), "atoll": (1.0, 2.0)},
              links=(*wan.links, Link("island", "atoll", 10, 0.1)), scheduler_vertex="s", entry_vertices=("s",))
    env = PathEnv(wan)
    seen = set()
    env.reset(seed=0)
    for _ in range(50):
        seen.add(env.current)
        env.reset()
    assert seen == {"a", "b", "c"}
    with pytest.raises(ValidationError, match="cannot reach"):
        env.reset(options={"start": "island"})


def test_options_and_several_targets(tiny: WanGraph) -> None:
    env = PathEnv(tiny, target=["s", "b"])
    env.reset(seed=0)
    targets = set()
    for _ in range(40):
        obs, info = env.reset()
        targets.add(info["target"])
        assert obs[env.n + env.index[info["target"]]] == 1.0 and obs[env.n:].sum() == 1.0
        assert info["path"][0] != info["target"]
    assert targets == {"s", "b"}
    obs, info = env.reset(options={"start": "s", "target": "c"})
    assert (env.current, env.target) == ("s", "c")
    _, r, term, _, _ = env.step(A)
    assert r == pytest.approx(0.5) and not term
    _, r, term, _, _ = env.step(C)
    assert term and r == env.goal_reward
    with pytest.raises(ValidationError, match="differ"):
        env.reset(options={"start": "c", "target": "c"})
    with pytest.raises(ValueError, match="outside"):
        env.step(4)


def test_link_update_is_picked_up_at_reset(tiny: WanGraph) -> None:
    env = PathEnv(tiny, start="a")
    env.reset(seed=0)
    tiny.update_link("a", "b", latency_ms=0.25)
    _, r, _, _, _ = env.step(B)
    assert r == pytest.approx(2.0)  # the episode keeps the tables it started with
    env.reset()
    _, r, _, _, _ = env.step(B)
    assert r == pytest.approx(4.0)


def test_bad_arguments(tiny: WanGraph) -> None:
    with pytest.raises(ValidationError, match="target"):
        PathEnv(tiny, target="x")
    with pytest.raises(ValidationError, match="start"):
        PathEnv(tiny, start="x")
    with pytest.raises(ValidationError, match="max_steps"):
        PathEnv(tiny, max_steps=0)
    with pytest.raises(ValidationError, match="differ"):
        PathEnv(tiny, start="s").reset()


# ------------------------------------------------------------------------------------------------------------
# Gymnasium conformance


def test_check_env_passes(tiny: WanGraph, abilene: WanGraph) -> None:
    check_env(PathEnv(tiny), skip_render_check=True)
    check_env(PathEnv(abilene), skip_render_check=True)  # rendering: checked through make() below
    check_env(PathEnv(abilene, target=list(abilene.vertices)), skip_render_check=True)


def test_make_and_render() -> None:
    env = gymnasium.make(ENV_ID, render_mode="ansi")  # default fleet: Abilene + scheduler, target = scheduler
    obs, info = env.reset(seed=1)
    assert obs.shape == (24,) and info["target"] == "scheduler"
    assert env.render().endswith("(target scheduler)")
    check_env(env.unwrapped)


def test_make_vec_sync(tiny: WanGraph) -> None:
    envs = gymnasium.make_vec(ENV_ID, num_envs=4, vectorization_mode="sync", graph=tiny, max_steps=5)
    obs, infos = envs.reset(seed=7)
    goal = PathEnv(tiny).goal_reward
    assert obs.shape == (4, 8)
    assert infos["action_mask"].shape == (4, 4)
    rng = np.random.default_rng(0)
    finished = 0
    for _ in range(60):
        actions = np.array([rng.choice(np.flatnonzero(m)) for m in infos["action_mask"]])
        obs, rewards, term, trunc, infos = envs.step(actions)
        assert rewards.shape == (4,) and obs.shape == (4, 8)
        assert np.all(rewards[term] == goal)
        finished += int(term.sum() + trunc.sum())
    assert finished > 0
    envs.close()
    again, _ = gymnasium.make_vec(ENV_ID, num_envs=4, vectorization_mode="sync", graph=tiny).reset(seed=7)
    first, _ = gymnasium.make_vec(ENV_ID, num_envs=4, vectorization_mode="sync", graph=tiny).reset(seed=7)
    assert np.array_equal(first, again)  # seeded: env i gets seed 7 + i


def test_graphml_input() -> None:
    env = PathEnv(data_dir() / "topology_zoo/graphml/Abilene.graphml", target="Denver")
    _, info = env.reset(seed=0)
    assert env.n == 11 and info["target"] == "Denver"


# ------------------------------------------------------------------------------------------------------------
# the goal reward and the return-maximising policy


def test_goal_reward_default_hand_computed(tiny: WanGraph) -> None:
    # target s: links not touching s are a–b (1/0.5 = 2) and a–c (1/1 = 1) → r_max = 2; the farthest start
    # (c) is D = 2 hops away. γ = 0.99: 2 / (0.01 × 0.99^1) = 202.02 → rounded up to 2 significant digits: 210.
    assert goal_reward_for(tiny, "s", 0.99) == pytest.approx(210.0)
    assert PathEnv(tiny).goal_reward == pytest.approx(210.0)
    # γ = 0.9: 2 / (0.1 × 0.9) = 22.2 → 23
    assert goal_reward_for(tiny, "s", 0.9) == pytest.approx(23.0)
    # Abilene, target scheduler: r_max = 1/1.317 ms (Chicago–Indianapolis), D = 4 (New York) → 78.2 → 79
    abilene = WanGraph(load_fleet().wan)
    lat = abilene.link("Chicago", "Indianapolis").latency_ms
    assert lat == pytest.approx(1.317, abs=1e-3)
    assert goal_reward_for(abilene, gamma=0.99) == pytest.approx(79.0)


def test_value_iteration_hand_case(tiny: WanGraph) -> None:
    # goal 210, γ 0.99. From b: straight to s = 210; via a (2 + 0.99·V(a)) is less since V(a) = 210 (a → s).
    # From c: only c → a, then a → s: V(c) = 1 + 0.99 × 210 = 208.9.
    values, policy = value_iteration(tiny, gamma=0.99)
    assert values[S] == 0.0 and policy[S] == -1
    assert values[A] == pytest.approx(210.0) and policy[A] == S
    assert values[B] == pytest.approx(210.0) and policy[B] == S
    assert values[C] == pytest.approx(1 + 0.99 * 210.0) and policy[C] == A


def test_abilene_return_maximising_policy_reaches_the_target(abilene: WanGraph) -> None:
    env = PathEnv(abilene)  # target scheduler, default goal (79 for γ = 0.99)
    policy = optimal_policy(abilene, gamma=0.99)
    agree = 0
    for start in abilene.vertices:
        if start == "scheduler":
            continue
        run = rollout_path(env, policy, start=start, seed=0)
        assert run.terminated and run.path[-1] == "scheduler", start
        assert abilene.is_valid_path(run.path, start, "scheduler")  # no loops
        exact = abilene.dijkstra.path(start, "scheduler")
        agree += run.path == exact
        if run.path != exact:  # the documented cases where eq.11's optimum is not the shortest path
            assert start in {"Washington DC", "Los Angeles"}
            assert abilene.path_metrics(run.path).latency_ms > abilene.path_metrics(exact).latency_ms
    assert agree == 9


@st.composite
def random_wans(draw: st.DrawFn) -> Wan:
    """A connected WAN of 3-8 vertices: a random spanning tree plus random extra links, 0.05-12 ms."""
    n = draw(st.integers(3, 8))
    names = [f"v{i}" for i in range(n)]
    latency = st.floats(0.05, 12.0, allow_nan=False)
    pairs = {(draw(st.integers(0, i - 1)), i) for i in range(1, n)}
    pairs |= set(draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)).filter(lambda p: p[0] < p[1]),
                               max_size=2 * n)))
    links = tuple(Link(names[a], names[b], 1.0, draw(latency)) for a, b in sorted(pairs))
    return Wan(vertices={v: (0.0, 0.0) for v in names}, links=links, scheduler_vertex=names[0],
               entry_vertices=(names[0],))


@settings(max_examples=40, deadline=None)
@given(wan=random_wans(), gamma=st.sampled_from([0.9, 0.95, 0.99]))
def test_default_goal_makes_every_return_maximiser_arrive(wan: Wan, gamma: float) -> None:
    graph = WanGraph(wan)
    env = PathEnv(graph, gamma=gamma)
    _, policy = value_iteration(graph, gamma=gamma)
    for start in graph.vertices[1:]:
        run = rollout_path(env, lambda obs, info: int(policy[env.index[info["path"][-1]]]), start=start, seed=0)
        assert run.terminated and graph.is_valid_path(run.path, start, wan.scheduler_vertex)


def test_a_small_goal_lets_loops_win_on_abilene(abilene: WanGraph) -> None:
    # Why the default goal is sized from γ: with goal 10 and γ = 0.99, looping Chicago ⇄ Indianapolis
    # (0.76 per step → 0.76 / 0.01 = 76) beats arriving, so the return-maximiser never reaches the target.
    _, policy = value_iteration(abilene, gamma=0.99, goal_reward=10.0)
    env = PathEnv(abilene, goal_reward=10.0)
    chicago, indianapolis = env.index["Chicago"], env.index["Indianapolis"]
    assert policy[chicago] == indianapolis and policy[indianapolis] == chicago


def test_policy_path_finder_plugs_into_the_selector(tiny: WanGraph) -> None:
    finder = PolicyPathFinder(tiny, optimal_policy(tiny), name="oracle")
    # the agent walks dst → src (target = entry vertex) and the walk is reversed, as in the paper
    assert finder.path("s", "c") == ("s", "a", "c")
    assert finder.path("s", "s") == ("s",)
    assert finder.path("c", "b") == ("c", "a", "b")
    dcs = [DataCenter(n, v, Prices(1.0, 0.0, 0.0, 0.0), RoomLayout(), (NodePool("p", 1, 24_000, 65_536, 0, 10_000),))
           for n, v in (("dc-b", "b"), ("dc-c", "c"))]
    task = TaskSpec(resources=Resources(cpu_milli=1000), runtime_s=3600.0, data_size_mb=1000.0)
    ranked, _ = rank_datacenters(task, dcs, tiny, 1.0, "s", "min-cost", path_finder=finder)
    by_dc = {c.datacenter: c for c in ranked}
    assert by_dc["dc-c"].path_source == "oracle" and by_dc["dc-c"].path.vertices == ("s", "a", "c")
    # s → b: the eq.11 optimum goes direct (4 ms, 1 hop); Dijkstra's s–a–b is 2.5 ms: the selector replaces it
    assert finder.path("s", "b") == ("s", "b")
    assert by_dc["dc-b"].path_source == "dijkstra" and "oracle path 4 ms > dijkstra 2.5 ms" in by_dc["dc-b"].note


def test_policy_path_finder_gives_none_when_the_walk_never_arrives(tiny: WanGraph) -> None:
    stuck = PolicyPathFinder(tiny, lambda obs, info: 3, name="stuck", max_steps=4)  # always "go to c"
    assert stuck.path("s", "b") is None


# ------------------------------------------------------------------------------------------------------------
# the latency reward (what the learned path agents train on)


def test_latency_reward_hand_cases(tiny: WanGraph) -> None:
    assert latency_reward(None, arrived=True, ref_ms=4.0) == -1.0  # no link
    assert latency_reward(2.0, arrived=False, ref_ms=4.0) == -0.5
    assert latency_reward(2.0, arrived=True, ref_ms=4.0) == 0.5  # the arriving link is paid too, + goal 1
    assert latency_reward(0.0, arrived=False, ref_ms=1.0) == pytest.approx(-0.05)  # floored like eq.11
    # ref = the largest shortest-path latency to the target: c → s is c–a–s, 1 + 2 = 3 ms
    assert latency_ref_for(tiny) == pytest.approx(3.0)
    env = PathEnv(tiny, start="c", reward="latency")
    assert env.latency_ref_ms == pytest.approx(3.0) and env.goal_reward == 1.0
    env.reset(seed=0)
    assert env.step(B)[1] == -1.0  # c–b does not exist
    assert env.step(A)[1] == pytest.approx(-1 / 3)
    _, reward, terminated, _, _ = env.step(S)
    assert terminated and reward == pytest.approx(1 - 2 / 3)  # return 1 − 3 ms / 3 ms − 1 (the invalid move)
    with pytest.raises(ValidationError, match="reward"):
        PathEnv(tiny, reward="hops")


@settings(max_examples=40, deadline=None)
@given(wan=random_wans())
def test_the_latency_reward_optimum_is_the_dijkstra_path(wan: Wan) -> None:
    graph = WanGraph(wan)
    for target in graph.vertices:
        env = PathEnv(graph, target, reward="latency")
        _, policy = value_iteration(graph, target, gamma=1.0, reward="latency")
        for start in graph.vertices:
            if start == target:
                continue
            act = lambda obs, info, policy=policy, env=env: int(policy[env.index[info["path"][-1]]])  # noqa: E731
            run = rollout_path(env, act, start=start, seed=0)
            assert run.terminated and graph.is_valid_path(run.path, start, target)
            best = graph.path_metrics(graph.dijkstra.path(start, target)).latency_ms
            assert graph.path_metrics(run.path).latency_ms == pytest.approx(best, rel=1e-9)


def test_the_latency_optimum_fixes_both_eq11_detours_on_abilene(abilene: WanGraph) -> None:
    _, policy = value_iteration(abilene, gamma=1.0, reward="latency")
    env = PathEnv(abilene, reward="latency")
    for start in ("Washington DC", "Los Angeles"):  # where eq.11's optimum is not the shortest path
        run = rollout_path(env, lambda obs, info: int(policy[env.index[info["path"][-1]]]), start=start, seed=0)
        assert run.path == abilene.dijkstra.path(start, "scheduler")


def test_env_state_round_trip_continues_the_episode(tiny: WanGraph) -> None:
    a, b = PathEnv(tiny, target=["s", "b"]), PathEnv(tiny, target=["s", "b"])
    a.reset(seed=5)
    a.step(int(np.flatnonzero(a._info()["action_mask"])[0]))
    obs, info = b.set_state(a.get_state())
    np.testing.assert_array_equal(obs, a._obs())
    assert info["path"] == a._info()["path"]
    for _ in range(5):  # the same random stream: the same next episodes
        oa, _ = a.reset()
        ob, _ = b.reset()
        np.testing.assert_array_equal(oa, ob)
