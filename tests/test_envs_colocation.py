"""hsched/Colocation-v0 (paper 001's co-located cloud): hand-computed episodes and invariants (hypothesis)."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hsched.envs.colocation import (
    ColocationConfig,
    ColocationEnv,
    JobSpec,
    StageSpec,
    critical_path_lower_bound_s,
)
from hsched.policies.colocation import ALL_LEVEL, COUNT_LEVELS, random_action, sjf_action

TWO_STAGES = JobSpec("hand", (StageSpec(2, 10.0, (1.0, 1.0)), StageSpec(1, 5.0, (1.0, 1.0), (0,))))
FIXED = dict(nodes=1, node_capacity=(2.0, 2.0), q=1, num_jobs=1, online_rate=0.0, sched_delay_s=(0.5,),
             container_start_s=(1.0, 1.0), preemption_s=(5.0, 5.0))


def run(env, policy, seed=0, options=None):
    _, info = env.reset(seed=seed, options=options)
    rewards, done = [], False
    while not done:
        _obs, r, term, trunc, info = env.step(policy(env))
        rewards.append(r)
        done = term or trunc
    return rewards, info


def test_two_stage_job_by_hand():
    env = ColocationEnv(pool=[TWO_STAGES], **FIXED)
    assert env.types.sizes.tolist() == [[1.0, 1.0]] and env.per_node == (2,)
    rewards, info = run(env, sjf_action)
    # stage 0: both instances start at 0 + 0.5 + 1 = 1.5, end 11.5; stage 1 starts at 13, ends 18
    assert rewards == pytest.approx([-11.5, -6.5])
    m = info["metrics"]
    assert m["avg_jct_s"] == pytest.approx(18.0) and m["makespan_s"] == pytest.approx(18.0)
    assert m["utilisation"] == pytest.approx((2 * 10 + 5) / (2 * 18))
    assert m["preemptions"] == 0
    assert critical_path_lower_bound_s(TWO_STAGES, 0.4, 1.0) == pytest.approx(15 + 2 * 1.4)


def test_online_task_preempts_the_cheapest_offline_instance_which_is_requeued_and_finishes():
    env = ColocationEnv(pool=[TWO_STAGES], **FIXED)
    rewards, info = run(env, sjf_action, options={"online_tasks": [(3.0, (1.0, 1.0), 4.0)]})
    m = info["metrics"]
    # t=3: both slices run stage 0 (started 1.5): one is preempted, the online task starts at 3 + 5 = 8,
    # ends 12; the other instance ends 11.5, the requeued one runs 13 → 23, stage 1 runs 24.5 → 29.5
    assert m["preemptions"] == 1 and m["online_latency_s"] == pytest.approx(5.0)
    assert m["avg_jct_s"] == pytest.approx(29.5) and sum(rewards) == pytest.approx(-29.5)
    assert m["utilisation"] == pytest.approx((1.5 + 10 + 10 + 5 + 4) / (2 * 29.5))


def test_no_preemption_when_a_free_slice_fits():
    env = ColocationEnv(pool=[JobSpec("one", (StageSpec(1, 10.0, (1.0, 1.0)),))], **FIXED)
    _, info = run(env, sjf_action, options={"online_tasks": [(3.0, (1.0, 1.0), 4.0)]})
    assert info["metrics"]["preemptions"] == 0 and info["metrics"]["online_latency_s"] == pytest.approx(1.0)


def test_online_tasks_wait_rather_than_preempt_online_tasks():
    env = ColocationEnv(pool=[JobSpec("one", (StageSpec(1, 1.0, (1.0, 1.0)),))], **FIXED)
    online = [(0.0, (1.0, 1.0), 50.0), (0.0, (1.0, 1.0), 50.0), (0.5, (1.0, 1.0), 5.0)]
    _, info = run(env, sjf_action, options={"online_tasks": online})
    # t=0: the offline instance takes one slice, online 0 the other (start 1, end 51); online 1 preempts the
    # offline instance (start 0 + 5, end 55); online 2 (t=0.5) finds only online tasks: it waits until 51
    assert info["metrics"]["preemptions"] == 1
    assert [o.start for o in env.online] == pytest.approx([1.0, 5.0, 52.0])
    assert info["metrics"]["avg_jct_s"] == pytest.approx(55 + 1.5 + 1.0)  # requeued, relaunched at 55


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="slicing"):
        ColocationEnv(slicing="nope")
    with pytest.raises(ValueError, match="num_jobs"):
        ColocationConfig(num_jobs=0).validate()
    with pytest.raises(ValueError, match="container_start_s"):
        ColocationConfig(container_start_s=(5.0, 1.0)).validate()
    env = ColocationEnv(pool=[TWO_STAGES], **FIXED)
    env.reset(seed=0)
    with pytest.raises(ValueError, match="action"):
        env.step((5, 0, 0))
    nearest = ColocationEnv(pool=[TWO_STAGES], invalid_action="nearest", **FIXED)
    nearest.reset(seed=0)
    assert nearest.step((5, 0, 0))[4]["invalid_action"]  # candidate 5 of 1: the only candidate
    with pytest.raises(ValueError, match="invalid_action"):
        ColocationEnv(invalid_action="ignore")


def test_made_through_gymnasium_it_passes_check_env():
    from gymnasium.utils.env_checker import check_env

    check_env(gymnasium.make("hsched/Colocation-v0", num_jobs=3).unwrapped, skip_render_check=True)
    env = ColocationEnv(num_jobs=3)
    episodes = []
    for _ in range(5):  # reset(seed) then reset(): the same second episode every time (it drew on OS entropy)
        env.reset(seed=123)
        env.reset()
        episodes.append([s.name for s in env.job_specs])
    assert all(e == episodes[0] for e in episodes)


def test_same_seed_same_workload_for_every_policy_and_deterministic():
    env = ColocationEnv(num_jobs=6, job_interarrival_s=3.0, online_rate=0.2)
    r1, i1 = run(env, sjf_action, seed=4)
    jobs1, online1 = [j.name for j in env.job_specs], [(o.arrival, tuple(o.demand)) for o in env.online]
    r2, i2 = run(env, sjf_action, seed=4)
    assert r1 == r2 and i1["metrics"] == i2["metrics"]
    rng = np.random.default_rng(0)
    run(env, lambda e: random_action(e, rng), seed=4)
    online3 = [(o.arrival, tuple(o.demand)) for o in env.online]
    n = min(len(online1), len(online3))
    assert [j.name for j in env.job_specs] == jobs1 and online3[:n] == online1[:n]


def test_tpch_workload_runs_with_uniform_slices():
    env = ColocationEnv(workload="tpch", tpch_sizes=("2g",), num_jobs=3, slicing="uniform", online_rate=0.0)
    assert env.types.sizes.tolist() == [[1.0, 1.0]]
    _, info = run(env, sjf_action, seed=1)
    assert info["metrics"]["jobs_finished"] == 3


def check_invariants(env: ColocationEnv) -> None:
    for node in range(env.cfg.nodes):
        sids = np.flatnonzero(env.slice_node == node)
        assert np.all(env.types.sizes[env.slice_type[sids]].sum(axis=0) <= env.capacity + 1e-9)
    for iid, inst in env.instances.items():
        job = env.jobs[inst.job]
        spec = job.stages[inst.stage].spec
        assert env.slice_occupant[inst.slice] == iid
        assert np.all(np.asarray(spec.demand) <= env.types.sizes[env.slice_type[inst.slice]] + 1e-9)
        for p in spec.parents:  # dependencies: an instance exists only once its parents are done
            assert job.stages[p].done == job.stages[p].spec.num_tasks
    for job in env.jobs:
        for s, stage in enumerate(job.stages):
            assert stage.pending + stage.running + stage.done == stage.spec.num_tasks
            assert stage.running == sum(1 for i in env.instances.values() if env.jobs[i.job] is job and i.stage == s)
    for oid, task in enumerate(env.online):
        if task.start is not None and task.end > env.t:  # running (or starting) online task keeps its slice
            assert env.slice_occupant[task.slice] == -2 - oid
            assert np.all(task.demand <= env.types.sizes[env.slice_type[task.slice]] + 1e-9)
    free = {sid for f in env.free for sid in f}
    assert free == set(np.flatnonzero(env.slice_occupant == -1).tolist())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), choices=st.lists(st.integers(0, 10_000), min_size=1, max_size=40),
       slicing=st.sampled_from(["constrained", "plain", "uniform"]), online_rate=st.sampled_from([0.0, 0.05, 0.1]),
       nodes=st.integers(1, 2))
def test_invariants_hold_for_any_valid_action_sequence(seed, choices, slicing, online_rate, nodes):
    # light online load (each task holds a slice ~5 s + a 1-10 s start: ≤ 1.6 slices busy at the tidal peak)
    # on ≥ 7 slices. Under heavy load a long offline instance can be preempted again and again (it only
    # finishes in a lull): that starvation is real, and the episode then ends by truncation.
    env = ColocationEnv(num_jobs=5, job_interarrival_s=2.0, online_rate=online_rate, online_duration_s=5.0,
                        slicing=slicing, nodes=nodes, node_capacity=(12.0, 12.0), q=4, horizon_s=50_000.0)
    _, info = env.reset(seed=seed)
    done, step = False, 0
    while not done:
        check_invariants(env)
        pick = choices[step % len(choices)]
        cands = info["candidates"]
        c = pick % len(cands)
        types = np.flatnonzero(info["type_mask"][c])
        action = (c, int(types[pick % len(types)]), pick % len(COUNT_LEVELS))
        _obs, r, term, trunc, info = env.step(action)
        assert r <= 0
        done = term or trunc
        step += 1
    check_invariants(env)
    assert term and info["metrics"]["jobs_finished"] == 5  # every preempted instance was requeued and finished
    assert all(iid not in env.instances for iid in env.preempted_instances)
    assert len(env.preempted_instances) == info["metrics"]["preemptions"]
    assert all(s.done == s.spec.num_tasks for j in env.jobs for s in j.stages)
    assert ALL_LEVEL == len(COUNT_LEVELS) - 1
