"""hsched/DagScheduling-v0: hand-checked schedules, the baselines' definitions and invariants under any policy."""

from __future__ import annotations

import dataclasses
import itertools

import gymnasium
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hsched.envs  # noqa: F401  (registers the env ids)
from hsched.envs.dag import (
    CF,
    JF,
    NF,
    DagSchedulingEnv,
    Fifo,
    RandomDag,
    SjfCp,
    TetrisLimited,
    TetrisStar,
    capacity_bound,
    critical_path_bound,
    run_dag_policy,
)
from hsched.traces.decima import DagJob, WaveDurations, critical_path_s, load_tpch_dags, make_dag_job

# 0 → 1, 0 → 2, {1, 2} → 3: a diamond with 2, 1, 3, 1 tasks of 1, 2, 1, 4 s
DIAMOND = make_dag_job(1, "2g", [2, 1, 3, 1], [1.0, 2.0, 1.0, 4.0], [(0, 1), (0, 2), (1, 3), (2, 3)])
SMALL = make_dag_job(2, "2g", [1], [3.0], [])
BIG = make_dag_job(3, "2g", [4], [5.0], [])


def with_waves(job: DagJob, waves: dict[int, WaveDurations]) -> DagJob:
    """`job` with measured lists on the given stages (the others keep their fixed duration)."""
    stages = tuple(dataclasses.replace(st_, waves=waves.get(st_.index)) for st_ in job.stages)
    return DagJob(query=job.query, size=job.size, stages=stages, edges=job.edges)


def _one(value):
    return np.array([value])


# one stage of 5 tasks: fresh 3 s, first wave 2 s (≤ 5 executors) or 4 s (key 10), rest wave 1 s
WAVY = with_waves(make_dag_job(4, "2g", [5], [2.0], []), {0: WaveDurations(
    first={5: _one(2.0), 10: _one(4.0)}, rest={5: _one(1.0), 10: _one(1.0)}, fresh={5: _one(3.0), 10: _one(3.0)})})


def _step(env, flat, count):
    return env.step(np.array([flat, count - 1]))


def test_diamond_by_hand_with_two_executors():
    env = DagSchedulingEnv(2, fixed_jobs=[DIAMOND], moving_delay_s=2.0, record=True)
    obs, info = env.reset(seed=0)
    assert info["action_mask"].nonzero()[0].tolist() == [0]          # only the root is runnable
    assert info["count_mask"].tolist() == [True, True]
    assert obs["stages"][0, 0, NF["critical_path_s"]] == 1 + 2 + 4  # 0 → 1 → 3
    assert obs["parents"][0, 3].tolist()[:4] == [0, 1, 1, 0]
    # both executors to the root: moving delay 2, two parallel 1 s tasks → done at 3
    obs, r, done, _, info = _step(env, 0, 2)
    assert env.now == 3.0 and r == -3.0 and not done
    assert info["action_mask"].nonzero()[0].tolist() == [1, 2]
    assert obs["jobs"][0, JF["local_free_executors"]] == 2
    # one executor to stage 2 (3 tasks of 1 s, no delay: it served this job; 2 tasks left unassigned, so
    # the stage stays schedulable), then the other to stage 1
    obs, r, done, _, info = _step(env, 2, 1)
    assert r == 0.0 and info["action_mask"].nonzero()[0].tolist() == [1, 2]
    assert obs["stages"][0, 2, NF["unassigned_tasks"]] == 2 and obs["stages"][0, 2, NF["running_executors"]] == 1
    obs, r, done, _, info = _step(env, 1, 1)
    # stage 1 ends at 5, stage 2 at 6 (tasks 3-4, 4-5, 5-6); stage 3 runnable at 6, one 4 s task → JCT 10
    assert env.now == 6.0 and r == -3.0
    obs, r, done, _, info = _step(env, 3, 2)
    assert done and env.now == 10.0 and info["jct"] == [10.0]
    assert info["episode"]["avg_jct_s"] == 10.0
    assert info["episode"]["avg_jct_bound_s"] == critical_path_s(DIAMOND) + 2.0 == 9.0
    assert [(r.stage, r.executor, r.start, r.end) for r in env.runs if r.stage == 3] == [(3, 0, 6.0, 10.0)]
    assert [(r.executor, r.start) for r in env.runs if r.stage == 2] == [(0, 3.0), (0, 4.0), (0, 5.0)]


def test_wave_durations_by_hand():
    """Two executors on a 5-task stage: both move in (2 s) and draw fresh tasks (3 s) → 2-5; each then takes
    the stage's next task from the rest wave (1 s): 5-6 on both, the fifth 6-7 → JCT 7. Under "mean" every
    task takes 2 s: 2-4 on both, 4-6 on both, 6-8 → JCT 8."""
    env = DagSchedulingEnv(2, fixed_jobs=[WAVY], record=True)
    env.reset(seed=0)
    _, _, done, _, info = _step(env, 0, 2)
    assert done and info["jct"] == [7.0]
    assert sorted((r.start, r.end) for r in env.runs) == [(2.0, 5.0), (2.0, 5.0), (5.0, 6.0), (5.0, 6.0),
                                                          (6.0, 7.0)]
    mean = DagSchedulingEnv(2, fixed_jobs=[WAVY], durations="mean")
    mean.reset(seed=0)
    _, _, done, _, info = _step(mean, 0, 2)
    assert done and info["jct"] == [8.0]
    # shortest draw 1 s per task → bounds 2 + 1 and 2 + max(1, 5 × 1 / 2); under "mean" 2 s per task
    assert critical_path_bound(WAVY) == 3.0 and capacity_bound(WAVY, 2) == 4.5
    assert critical_path_bound(WAVY, durations="mean") == 4.0 and capacity_bound(WAVY, 2, durations="mean") == 7.0


def test_the_job_executor_count_picks_the_measured_key():
    """Stage 1 (7 tasks) gets 10 executors after stage 0 ran on executor 0: executor 0 (same job, other
    stage) draws from the first wave, the 6 movers from the fresh list. The job then holds 7 executors:
    decima-sim's map gives key 5 with p (7 − 5) / (10 − 5), else key 10, so executor 0's first-wave task is
    2 s (key 5) or 4 s (key 10) — over seeds both occur; with 5 executors it is always key 5 (2 s)."""
    job = with_waves(make_dag_job(5, "2g", [1, 7], [1.0, 2.0], [(0, 1)]), {1: WaveDurations(
        first={5: _one(2.0), 10: _one(4.0)}, rest={5: _one(1.0)}, fresh={5: _one(3.0), 10: _one(3.0)})})

    def first_wave_task(executors, seed):
        env = DagSchedulingEnv(executors, fixed_jobs=[job], record=True)
        env.reset(seed=seed)
        _step(env, 0, executors)  # stage 0: executor 0 moves (2 s) and runs the one 1 s task → 3
        _, _, done, _, _ = _step(env, 1, executors)
        assert done
        (run,) = [r for r in env.runs if r.stage == 1 and r.executor == 0 and r.start == 3.0]
        fresh = sorted(r.end - r.start for r in env.runs if r.stage == 1 and r.assigned == 3.0 and r.executor)
        assert fresh == [3.0] * min(executors - 1, 6)
        return run.end - run.start

    assert {first_wave_task(10, seed) for seed in range(30)} == {2.0, 4.0}
    assert {first_wave_task(5, seed) for seed in range(10)} == {2.0}


def test_wave_episodes_are_reproducible_and_policy_independent_in_jobs():
    pool = load_tpch_dags(sizes=["2g"], queries=[1, 2, 3])
    env = DagSchedulingEnv(5, num_stream_jobs=3, jobs=pool)
    a, b = run_dag_policy(env, SjfCp(), seed=11), run_dag_policy(env, SjfCp(), seed=11)
    assert a.jct == b.jct
    dags = list(env.dags)
    c = run_dag_policy(env, Fifo(), seed=11)
    assert env.dags == dags and c.bounds == a.bounds  # the draws never change which jobs arrive when


def test_invalid_actions_name_the_rule():
    env = DagSchedulingEnv(2, fixed_jobs=[DIAMOND])
    env.reset(seed=0)
    with pytest.raises(ValueError, match="not schedulable"):
        _step(env, 3, 1)
    with pytest.raises(ValueError, match="executor count"):
        env.step(np.array([0, 5]))
    with pytest.raises(ValueError, match="executors"):
        DagSchedulingEnv(0)
    with pytest.raises(ValueError, match="interarrival_s"):
        DagSchedulingEnv(2, interarrival_s=0.0)
    with pytest.raises(ValueError, match="durations"):
        DagSchedulingEnv(2, durations="median")
    with pytest.raises(ValueError, match="invalid_action"):
        DagSchedulingEnv(2, invalid_action="ignore")


def test_made_through_gymnasium_any_action_of_the_space_steps_and_passes_check_env():
    """gymnasium.make builds invalid_action="nearest": an unschedulable stage becomes the first schedulable one
    (DIAMOND at t=0: only its root, stage 0), a count above the free executors is clipped; flagged in info."""
    from gymnasium.utils.env_checker import check_env

    env = gymnasium.make("hsched/DagScheduling-v0", executors=2, fixed_jobs=[DIAMOND]).unwrapped
    env.reset(seed=0)
    _, _, _, _, info = env.step(np.array([3, 1]))  # stage 3 is not schedulable yet
    assert info["invalid_action"] and env.decisions == 1
    assert [j.running[0] + j.done[0] for j in env.active.values()] == [2]  # the root got both executors
    check_env(gymnasium.make("hsched/DagScheduling-v0", executors=3, num_stream_jobs=2).unwrapped,
              skip_render_check=True)


def test_moving_between_jobs_costs_the_delay_and_local_executors_go_first():
    env = DagSchedulingEnv(1, fixed_jobs=[SMALL, BIG], num_init_jobs=2, moving_delay_s=2.0, record=True)
    env.reset(seed=0)
    S = env.max_stages
    _step(env, 0 * S, 1)   # SMALL: 2 + 3 → ends at 5
    _, _, done, _, info = _step(env, 1 * S, 1)  # BIG: moves (2 s), 4 tasks of 5 s → 5 + 2 + 20 = 27
    assert done and info["jct"] == [5.0, 27.0]


def test_baselines_as_defined():
    env = DagSchedulingEnv(3, fixed_jobs=[BIG, SMALL], num_init_jobs=2)
    obs, info = env.reset(seed=0)
    S = env.max_stages
    assert Fifo().choose(obs, info["action_mask"]) == (0, 3)            # first arrival, all executors
    assert Fifo(cap=2).choose(obs, info["action_mask"]) == (0, 2)       # the per-job request
    assert SjfCp().choose(obs, info["action_mask"]) == (S, 3)           # least remaining work (3 < 20)
    # Tetris*: alignment BIG 3/3, SMALL 1/3; shortness BIG 3/20, SMALL 1; ε = (2/3)/(23/40) = 1.159;
    # scores BIG 1 + 0.174 = 1.174, SMALL 0.333 + 1.159 = 1.493 → SMALL, with the 1 executor it fills
    assert TetrisStar().choose(obs, info["action_mask"]) == (S, 1)
    # with 1 free executor both align fully (1/1): BIG 1 + ε·0.15, SMALL 1 + ε → SMALL again
    env1 = DagSchedulingEnv(1, fixed_jobs=[BIG, SMALL], num_init_jobs=2)
    obs1, info1 = env1.reset(seed=0)
    assert TetrisStar().choose(obs1, info1["action_mask"]) == (S, 1)
    assert obs["cluster"][CF["free_executors"]] == 3


def test_tetris_limited_by_hand():
    env = DagSchedulingEnv(3, fixed_jobs=[BIG, SMALL], num_init_jobs=2)
    obs, info = env.reset(seed=0)
    S = env.max_stages
    # no executor has served a job yet (no locality bonus), so the scores are Tetris*'s (BIG 1.174, SMALL 1.493):
    # SMALL with min(free 3, 1 task) = 1 executor
    assert TetrisLimited().choose(obs, info["action_mask"]) == (S, 1)
    # BIG, once SMALL is gone from the mask: min(3, 4 tasks) = 3, capped at round(0.4 · 3) = 1 per job; no limit: 3
    only_big = info["action_mask"].copy()
    only_big[S] = False
    assert TetrisLimited().choose(obs, only_big) == (0, 1)
    assert TetrisLimited(limit=None).choose(obs, only_big) == (0, 3)
    # a locality bonus of 1 on BIG alone (it holds a free executor that served it) turns the choice to BIG
    obs = {k: v.copy() for k, v in obs.items()}
    obs["jobs"][0, JF["local_free_executors"]] = 1
    assert TetrisLimited(locality=1.0).choose(obs, info["action_mask"]) == (0, 1)


def test_registered_and_observations_in_their_space():
    env = gymnasium.make("hsched/DagScheduling-v0", executors=4, num_stream_jobs=2, jobs=[DIAMOND, SMALL, BIG])
    obs, info = env.reset(seed=3)
    space = env.unwrapped.observation_space
    while True:
        assert space.contains(obs)
        stage, count = SjfCp().choose(obs, info["action_mask"])
        assert env.unwrapped.action_space.contains(np.array([stage, count - 1]))
        obs, _, done, truncated, info = env.step(np.array([stage, count - 1]))
        if done:
            break
        assert not truncated
    assert space.contains(obs) and info["episode"]["finished"] == 3


def test_same_seed_same_episode():
    env = DagSchedulingEnv(5, num_stream_jobs=3, jobs=[DIAMOND, SMALL, BIG])
    a, b = run_dag_policy(env, RandomDag(1), seed=7), run_dag_policy(env, RandomDag(1), seed=7)
    assert a.jct == b.jct and a.reward == b.reward


@st.composite
def dag_jobs(draw):
    n = draw(st.integers(1, 6))
    edges = [(p, c) for c in range(1, n) for p in range(c) if draw(st.booleans())]
    tasks = draw(st.lists(st.integers(1, 5), min_size=n, max_size=n))
    durations = draw(st.lists(st.sampled_from([0.5, 1.0, 1.5, 3.0]), min_size=n, max_size=n))
    job = make_dag_job(1, "2g", tasks, durations, edges)
    values = st.lists(st.sampled_from([0.25, 0.5, 1.0, 2.0, 4.0]), max_size=3).map(np.array)
    keys = st.lists(st.sampled_from([5, 10, 20]), min_size=1, max_size=3, unique=True)
    waves = {}
    for i in range(n):
        if draw(st.booleans()):
            ks = draw(keys)
            first = {k: draw(values) for k in ks}
            fresh = {k: draw(values) for k in ks}
            for k in ks:  # decima-sim's stages always have a first-wave or a fresh value
                if not len(first[k]) and not len(fresh[k]):
                    first[k] = np.array([1.0])
            waves[i] = WaveDurations(first=first, rest={k: draw(values) for k in ks}, fresh=fresh)
    return with_waves(job, waves)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs=st.lists(dag_jobs(), min_size=1, max_size=4), executors=st.integers(1, 5),
       init=st.integers(0, 4), seed=st.integers(0, 2**16), policy=st.sampled_from(["random", "fifo", "sjf", "tetris", "limited"]),
       delay=st.sampled_from([0.0, 2.0]), max_jobs=st.sampled_from([None, 1, 2]),
       durations=st.sampled_from(["waves", "mean"]))
def test_invariants_under_any_policy(jobs, executors, init, seed, policy, delay, max_jobs, durations):
    env = DagSchedulingEnv(executors, fixed_jobs=jobs, num_init_jobs=init, interarrival_s=2.0,
                           moving_delay_s=delay, max_jobs=max_jobs, durations=durations, record=True)
    chooser = {"random": RandomDag(seed), "fifo": Fifo(), "sjf": SjfCp(), "tetris": TetrisStar(),
               "limited": TetrisLimited()}[policy]
    ep = run_dag_policy(env, chooser, seed=seed)
    # every job finishes, no earlier than its capacity bound, itself no lower than the critical-path bound
    assert ep.metrics["finished"] == len(jobs)
    for k, job in enumerate(env.dags):
        assert ep.jct[k] >= capacity_bound(job, executors, delay, durations) - 1e-9
        assert capacity_bound(job, executors, delay, durations) >= critical_path_bound(job, delay, durations)
    # each task lasts one of its stage's possible values: the fixed one, or a measured one (+ the warm-up)
    for r in env.runs:
        stage = env.dags[r.job].stages[r.stage]
        if durations == "mean" or stage.waves is None:
            assert r.end - r.start == pytest.approx(stage.task_duration_s)
        else:
            assert r.end - r.start >= stage.min_task_duration_s - 1e-9
    # a stage's tasks start only after all its parents' tasks have ended; each stage runs all its tasks
    end = {}
    for r in env.runs:
        end[(r.job, r.stage)] = max(end.get((r.job, r.stage), 0.0), r.end)
    for r in env.runs:
        job = env.dags[r.job]
        assert r.start >= env.arrivals[r.job]
        for p in job.stages[r.stage].parents:
            assert r.assigned >= end[(r.job, p)] - 1e-9
    for k, job in enumerate(env.dags):
        for s in job.stages:
            assert sum(1 for r in env.runs if (r.job, r.stage) == (k, s.index)) == s.num_tasks
    # an executor runs one task at a time (assignment through end never overlap), never more than N busy
    by_exec = {}
    for r in env.runs:
        by_exec.setdefault(r.executor, []).append((r.assigned, r.end))
    assert set(by_exec) <= set(range(executors))
    for spans in by_exec.values():
        spans.sort()
        assert all(b[0] >= a[1] - 1e-9 for a, b in itertools.pairwise(spans))
    # the return is −∫ jobs-in-system dt = −Σ JCT
    assert ep.reward == pytest.approx(-sum(ep.jct))
