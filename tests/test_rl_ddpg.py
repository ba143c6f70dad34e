"""DDPG / EADE-DDPG for GPU cluster placement (hsched.rl.ddpg): the action rule, the expert, the dual buffer,
the critic target, a short training run, resume, serving (load_policy) and the placer over gRPC."""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hsched.domain.errors import ValidationError
from hsched.domain.resources import Resources
from hsched.envs.gpu import GpuClusterEnv, MultiClusterState, cluster_totals, host_hints, paper000_datacenters
from hsched.metrics import reward_eq17, utilisation_matrix
from hsched.policies.base import select
from hsched.policies.heuristics import Utilization, card_tightness, gpu_stranding
from hsched.policies.learned import ModelMismatch
from hsched.rl import checkpoint
from hsched.rl.buffers import DualReplayBuffer, ReplayBuffer
from hsched.rl.ddpg import (
    ITEM_FEATURES,
    Actor,
    ActorPolicy,
    Codec,
    Config,
    ScoreGreedyExpert,
    critic_target,
    expert_pool,
    load_actor,
    load_policy,
    make_env,
    masked_argmax,
    noisy_action,
    policy_state,
    train,
    training_path,
)
from hsched.rl.training import TrainArgs, seed_everything

GIB = 1024
# a tiny fleet and episode: 2 clusters × 2 openb 2-GPU hosts, 40 tasks (fast enough for a unit test)
TINY = Config(fleet=(3, 2), n_tasks=30, steps=1_200, batch_size=64, learning_starts=200, train_every=2,
              buffer_size=4_000, expert_episodes=4, noise_steps=600, checkpoint_every=400, embed=16, heads=2,
              actor_lr=1e-3, pretrain_updates=200)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40).flatmap(lambda n: st.tuples(
    st.lists(st.floats(-1e6, 1e6), min_size=n, max_size=n),
    st.lists(st.booleans(), min_size=n, max_size=n).filter(any),
    st.floats(0.0, 100.0), st.integers(0, 2**32 - 1))))
def test_masked_actions_are_never_chosen(case):
    scores, mask, sigma, seed = case
    s, m = np.array(scores), np.array(mask)
    assert m[noisy_action(s, m, sigma, np.random.default_rng(seed))]
    assert m[int(masked_argmax(torch.tensor(s, dtype=torch.float32)[None], torch.tensor(m)[None])[0])]


def test_dual_buffer_batches_hold_the_expert_share():
    rng = np.random.default_rng(0)
    env = GpuClusterEnv(paper000_datacenters(2, 2), n_tasks=20)
    codec = Codec(env.view.hosts, env.view.host_cluster)
    expert = expert_pool(env, codec, dataclasses.replace(TINY, expert_episodes=2, n_tasks=20), rng)
    online = ReplayBuffer(100, codec.dim, seed=rng)
    for _ in range(50):
        online.add(np.full(codec.dim, -1.0, np.float32), 0, 0.0, np.zeros(codec.dim, np.float32), False)
    batch = DualReplayBuffer(expert, online, 0.1).sample(256)
    assert batch.source.sum() == 26  # round(10 % of 256)
    assert (batch.obs[batch.source] >= 0).all() and (batch.obs[~batch.source] == -1).all()


def _hand_made_view() -> MultiClusterState:
    view = MultiClusterState(paper000_datacenters(3, 2))
    # cluster 1 already runs a big GPU task, cluster 2 a small CPU one, cluster 0 is empty
    view.place("busy", 2, Resources(cpu_milli=8000, memory_mib=32 * GIB, gpu_count=2, gpu_core_percent=100,
                                     gpu_memory_mib=16 * GIB))
    view.place("small", 4, Resources(cpu_milli=2000, memory_mib=4 * GIB))
    return view


def test_score_greedy_expert_picks_the_cluster_with_the_best_eq17_reward():
    view = _hand_made_view()
    demand = Resources(cpu_milli=4000, memory_mib=8 * GIB, gpu_count=1, gpu_core_percent=50,
                       gpu_memory_mib=8 * GIB)
    expert = ScoreGreedyExpert(view)
    estimated = expert.cluster_rewards(demand)
    for c in range(3):  # the estimate is the reward the env would pay after really placing it there
        host = int(view.offsets[c]) + (1 if c == 1 else 0)
        trial = _hand_made_view()
        trial.place("t", host, demand)
        assert estimated[c] == pytest.approx(reward_eq17(trial.clusters, c))
    mask = view.fleet.feasible(demand)
    choice = select(expert, view.fleet, demand, mask)
    # the already busy cluster 1 stays the most utilised: reward 0 there, the others pay
    assert estimated[1] == 0.0 and estimated[0] < 0 and estimated[2] < 0
    assert view.locate(choice.node)[0] == 1 and mask[choice.node]


def test_hints_are_the_heuristic_scores_and_the_expert_mixes_them():
    view = _hand_made_view()
    demand = Resources(cpu_milli=4000, memory_mib=8 * GIB, gpu_count=1, gpu_core_percent=50,
                       gpu_memory_mib=8 * GIB)
    hints = host_hints(view.fleet, demand, utilisation_matrix(view.clusters), cluster_totals(view.clusters),
                       view.host_cluster)
    mask = np.ones(view.hosts, dtype=bool)
    fit = np.clip(Utilization().scores(view.fleet, demand, mask), 0, 1)
    expert = ScoreGreedyExpert(view)
    np.testing.assert_allclose(hints[:, 0], fit, atol=1e-6)
    np.testing.assert_allclose(hints[:, 1], expert.cluster_rewards(demand)[view.host_cluster] / 10 + 1, atol=1e-6)
    np.testing.assert_allclose(hints[:, 2], gpu_stranding(view.fleet, demand), atol=1e-6)
    np.testing.assert_allclose(hints[:, 3], card_tightness(view.fleet, demand), atol=1e-6)
    mixed = ScoreGreedyExpert(view, fit_weight=2.0).scores(view.fleet, demand, mask)
    np.testing.assert_allclose(mixed, hints[:, 1] + 2.0 * fit, atol=1e-6)
    packing = ScoreGreedyExpert(view, fit_weight=2.0, stranding_weight=0.5, tightness_weight=3.0)
    np.testing.assert_allclose(packing.scores(view.fleet, demand, mask),
                               hints[:, 1] + 2.0 * (fit - 0.5 * hints[:, 2] + 3.0 * hints[:, 3]), atol=1e-5)


def test_critic_target_on_a_hand_made_batch():
    rewards = torch.tensor([1.0, -2.0, 0.5])
    dones = torch.tensor([0.0, 1.0, 0.0])
    next_q = torch.tensor([[1.0, 5.0, 3.0], [4.0, 0.0, 0.0], [2.0, 7.0, -1.0]])
    next_scores = torch.tensor([[0.1, 0.9, 0.5], [0.0, 1.0, 2.0], [3.0, 1.0, 2.0]])
    next_mask = torch.tensor([[True, False, True], [False, False, False], [False, True, True]])
    y = critic_target(rewards, dones, next_q, next_scores, next_mask, gamma=0.9)
    # row 0: host 1 is masked, π' picks host 2 (0.5 > 0.1): 1 + 0.9·3; row 1 terminal: r;
    # row 2: host 0 masked, π' picks host 2 (2 > 1): 0.5 + 0.9·(−1)
    torch.testing.assert_close(y, torch.tensor([1.0 + 0.9 * 3.0, -2.0, 0.5 - 0.9]))


def test_served_inputs_match_the_training_inputs():
    env = GpuClusterEnv(paper000_datacenters(3, 2), n_tasks=15)
    codec = Codec(env.view.hosts, env.view.host_cluster)
    policy = ActorPolicy(Actor(16, 2), "t", env.view)
    obs, info = env.reset(seed=3)
    for _ in range(8):
        items, task, _ = codec.decode(torch.from_numpy(codec.encode(obs, info["action_mask"])))
        served_items, served_task = policy.inputs(env.view.fleet, env.current_task.resources)
        np.testing.assert_allclose(items[0].numpy(), served_items, atol=1e-6)
        np.testing.assert_allclose(task[0].numpy(), served_task, atol=1e-6)
        obs, _, done, _, info = env.step(int(np.flatnonzero(info["action_mask"])[0]))
        if done:
            break


def _agreement(actor: Actor, cfg: Config, seeds=(0, 1, 2)) -> float:
    """Share of the actor's decisions (on the states its own greedy run visits) that the expert makes too."""
    env = make_env(cfg)
    policy, expert = ActorPolicy(actor, "a", env.view), ScoreGreedyExpert.of(env.view, cfg)
    same = total = 0
    for seed in seeds:
        _, info = env.reset(seed=seed)
        done = False
        while not done:
            room = info["action_mask"][:-1].astype(bool)
            demand = env.current_task.resources
            choice = select(policy, env.view.fleet, demand, room)
            if choice is not None and room.sum() > 1:
                same += choice.node == select(expert, env.view.fleet, demand, room).node
                total += 1
            _, _, done, _, info = env.step(env.wait_action if choice is None else choice.node)
    return same / total


def test_short_training_run_improves_over_its_start(tmp_path):
    seed_everything(0)
    start = _agreement(Actor(TINY.embed, TINY.heads), TINY)
    result = train(TINY, TrainArgs(seed=0, out=tmp_path / "m.pt", progress=False), "eade-ddpg", "m")
    trained, _ = load_actor(tmp_path / "m.pt")
    # EADE-DDPG learns from the score-greedy expert's demonstrations: it now decides as the expert would
    # where the untrained actor mostly did not (only decisions with a choice between hosts count)
    assert _agreement(trained, TINY) > start + 0.25
    assert result["steps"] >= TINY.steps and (tmp_path / "m.json").exists() and (tmp_path / "m.png").exists()
    assert checkpoint.load_metadata(tmp_path / "m.pt")["evaluation"]["deployed"] == result["deployed"]


def test_resume_continues_identically(tmp_path):
    cfg = dataclasses.replace(TINY, steps=600, checkpoint_every=1)
    straight = tmp_path / "a.pt"
    train(cfg, TrainArgs(seed=1, out=straight, progress=False), "ddpg", "a")
    halves = tmp_path / "b.pt"
    train(cfg, TrainArgs(seed=1, steps=300, out=halves, progress=False), "ddpg", "b")
    with pytest.raises(ValidationError, match=r"^--resume: .*b.train.pt was trained with --seed 1 and "
                                              r"hyper-parameter embed 16; this run asks --seed 2 hyper-parameter embed 8$"):
        train(dataclasses.replace(cfg, embed=8), TrainArgs(seed=2, out=halves, resume=True, progress=False), "ddpg", "b")
    train(cfg, TrainArgs(seed=1, out=halves, resume=True, progress=False), "ddpg", "b")
    a, b = checkpoint.load_state(straight), checkpoint.load_state(halves)
    for key in a["actor"]:
        torch.testing.assert_close(a["actor"][key], b["actor"][key], rtol=0, atol=0)
    ta, tb = checkpoint.load_state(training_path(straight)), checkpoint.load_state(training_path(halves))
    assert ta["step"] == tb["step"] and ta["curves"] == tb["curves"]


def test_a_budget_that_ends_before_the_first_update_is_refused(tmp_path):
    # EADE-DDPG's updates on the expert's demonstrations alone would not make it a trained agent
    for name in ("ddpg", "eade-ddpg"):
        with pytest.raises(ValidationError, match=r"^--steps: ends before the first gradient update, at env step "
                                                  r"200 \(learning_starts 200, train_every 2\): give --steps >= 200 "
                                                  r"\(got 199\)$"):
            train(TINY, TrainArgs(seed=0, steps=199, out=tmp_path / "m.pt", progress=False), name, "m")
    assert not list(tmp_path.iterdir())


def _save_untrained(path: Path, name: str = "eade-ddpg", **override) -> Path:
    state = policy_state(Actor(16, 2), name, dataclasses.replace(TINY))
    state.update(override)
    return checkpoint.save(path, state, {"agent": name})


def test_load_policy_serves_a_gpu_dc_and_rejects_mismatches(tmp_path):
    dc = paper000_datacenters(1, 4)[0]
    policy = load_policy(_save_untrained(tmp_path / "ok.pt"), dc)
    assert policy.name == "eade-ddpg"
    from hsched.domain.cluster import ClusterState

    state = ClusterState(dc)
    demand = Resources(cpu_milli=1000, memory_mib=GIB, gpu_count=1, gpu_core_percent=30, gpu_memory_mib=GIB)
    mask = state.feasible(demand)
    mask[0] = False
    choice = select(policy, state, demand, mask)
    assert choice.node != 0 and len(choice.alternatives) == 3
    with pytest.raises(ModelMismatch, match="item_features"):
        load_policy(_save_untrained(tmp_path / "bad.pt", item_features=ITEM_FEATURES + 1), dc)
    cpu_dc = dataclasses.replace(dc, pools=tuple(dataclasses.replace(p, gpu_count=0) for p in dc.pools))
    with pytest.raises(ModelMismatch, match="no GPUs"):
        load_policy(tmp_path / "ok.pt", cpu_dc)


def test_served_models_hold_torch_to_one_thread(tmp_path):
    # a served decision is a few small matmuls; torch's default intra-op threads spin on every core and,
    # with 11 placers and a selector on a small host, cost the whole stack its tail latency
    from hsched.costs import WanGraph
    from hsched.domain.fleet import load_fleet
    from hsched.policies.learned import learned_policy
    from hsched.rl.path_serving import selector_path_finder

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        policy = learned_policy("eade-ddpg", paper000_datacenters(1, 4)[0],
                                model=str(_save_untrained(tmp_path / "m.pt")))
        assert policy.name == "eade-ddpg" and torch.get_num_threads() == 1
        torch.set_num_threads(2)
        assert selector_path_finder("per-dqn", "per_dqn_path", WanGraph(load_fleet(None).wan)) is not None
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_placer_serves_eade_ddpg_over_grpc(tmp_path, redis_url):
    from hsched.stack import Stack, StackConfig
    from hsched.v1 import common_pb2 as pb
    from hsched.v1 import gateway_pb2, gateway_pb2_grpc
    from tests.conftest import SMALL_FLEET, delete_prefix

    _save_untrained(tmp_path / "eade_ddpg_gpu.pt")
    prefix = f"test-ddpg-{uuid.uuid4().hex[:12]}"  # tmp_path names repeat across runs; a prefix must not
    config = StackConfig(fleet_path=SMALL_FLEET, redis_url=redis_url, prefix=prefix, gateway_port=0,
                         gpu_policy="eade-ddpg", extra_env={checkpoint.MODELS_ENV: str(tmp_path)})
    try:
        with Stack(config) as stack, grpc.insecure_channel(stack.gateway) as ch:
            gw = gateway_pb2_grpc.GatewayStub(ch)
            spec = pb.TaskSpec(resources=pb.Resources(cpu_milli=2000, memory_mib=4 * GIB, gpu_count=1,
                                                      gpu_core_percent=40, gpu_memory_mib=4 * GIB),
                               runtime_s=600)
            t = gw.Submit(gateway_pb2.SubmitRequest(task=spec), timeout=30).task
            assert t.state == pb.TASK_STATE_PLACED and t.datacenter == "gpu"
            assert t.explanation.placer_policy == "eade-ddpg"  # the model, not a fallback
            assert len(t.explanation.alternatives) >= 2
    finally:
        delete_prefix(redis_url, prefix)


def test_sb3_score_vector_wrapper_never_executes_a_masked_action():
    from hsched.rl.sb3 import ScoreVectorActions

    env = ScoreVectorActions(GpuClusterEnv(paper000_datacenters(3, 2), n_tasks=25), continuous=True,
                             deploy_bonus=10.0)
    rng = np.random.default_rng(0)
    obs, _ = env.reset()
    assert obs.shape == env.observation_space.shape
    done = False
    while not done:
        obs, _, done, _, info = env.step(rng.uniform(-1, 1, env.action_space.shape))
        assert info["event"] != "failed"


def test_eval_rows_come_from_shipped_models_or_say_why_not(tmp_path, monkeypatch):
    from hsched.envs.gpu import run_policy
    from hsched.eval import gpu

    monkeypatch.setenv(checkpoint.MODELS_ENV, str(tmp_path))
    monkeypatch.setattr(gpu, "LEARNED_POLICIES", {})
    monkeypatch.setattr(gpu, "LEARNED_NOTES", [])
    gpu.register_shipped_models()
    assert "EADE-DDPG" not in gpu.LEARNED_POLICIES
    assert any(n.startswith("EADE-DDPG row skipped: no model at") for n in gpu.LEARNED_NOTES)
    _save_untrained(tmp_path / "eade_ddpg_gpu.pt")
    gpu.register_shipped_models()
    env = GpuClusterEnv(paper000_datacenters(3, 2), n_tasks=20)
    result = run_policy(env, gpu.LEARNED_POLICIES["EADE-DDPG"](env.view, 0), seed=0)
    assert result.metrics["failed"] == 0 and result.metrics["deployed"] > 0
