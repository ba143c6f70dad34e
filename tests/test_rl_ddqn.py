"""hsched.rl.ddqn: the Double-DQN target by hand (mask included), masked actions never chosen (acting, the
target's argmax, serving), the validation slice is disjoint from the training and eval jobs, the reward
selection rule, a short training run on a tiny room improves, resume continues identically, a run's
metadata names the fleet, trace, room, jobs and budget it ran on, a budget short of the first update is refused,
load_policy refuses a checkpoint whose features do not fit, the placer falls back without a model, and the
stack serves `--policy double-dqn` end to end over gRPC."""

from __future__ import annotations

import gzip
import json
import time
from dataclasses import asdict, replace
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hsched.domain.cluster import ClusterState
from hsched.domain.errors import ValidationError
from hsched.domain.fleet import load_fleet
from hsched.envs.dc import THUNDER, Job, run_policy, same_trace, thunder_jobs
from hsched.policies.base import select
from hsched.policies.heuristics import make_policy
from hsched.policies.learned import Fallback, ModelMismatch, learned_policy
from hsched.rl import checkpoint
from hsched.rl.ddqn import (
    SELECTION_FILE,
    TRAIN_REWARD,
    DdqnConfig,
    PlacementQ,
    Trainer,
    _mean_figures,
    double_dqn_target,
    load_policy,
    make_env,
    paper_data,
    placer_mask,
    reward_selection_record,
    selection_key,
    train_double_dqn,
    validation_env,
)
from hsched.rl.training import TrainArgs
from hsched.traces import data_dir
from hsched.traces.catalog import TRACES, resolve_trace
from tests.conftest import SMALL_FLEET, delete_prefix
from tests.test_env_dc import spec, tiny_dc

# 6 servers × 24 cores; 8-core jobs every 10 s running 120 s: ~12 run at once, two per server fit under the
# 0.8 overload threshold, a third overloads. Round robin spreads (0.83 per decision), Greedy packs (0.18).
TINY_DC = tiny_dc(2, 3)
TINY_JOBS = [Job(10.0 * i, spec(8, runtime_s=120.0)) for i in range(60)]
TINY = replace(DdqnConfig(), learning_starts=200, eps_steps=1000, target_every=100, train_every=1,
               buffer_size=4000, steps=1500)


def tiny_env():
    return make_env(TINY, TINY_DC, jobs=TINY_JOBS)


def kth_slice(path: Path, count: int, skip: int = 0) -> Path:
    """Write KTH SP2's jobs skip..skip + count - 1 (its SWF records, comments dropped) to `path`."""
    with gzip.open(data_dir() / TRACES["kth"], "rt") as fh:
        records = [line for line in fh if line.strip() and not line.startswith(";")]
    path.write_text("".join(records[skip:skip + count]))
    return path


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A short training run on the tiny room, saved as a model directory (shared by the serving tests)."""
    out = tmp_path_factory.mktemp("models") / "double_dqn_dc.pt"
    result = train_double_dqn(TrainArgs(seed=0, steps=TINY.steps, out=out, progress=False), TINY, tiny_env())
    return out, result


# -- the target -----------------------------------------------------------------------------------------------


def test_double_dqn_target_on_a_hand_made_batch() -> None:
    online = torch.tensor([[1.0, 5.0, 3.0, 2.0],   # 5 is masked: a* = 2
                           [0.0, 1.0, 2.0, 9.0],   # a* = 3, but the episode ended there
                           [4.0, 1.0, 8.0, 1.0]])  # only wait allowed: a* = 0
    target = torch.tensor([[10.0, 20.0, 30.0, 40.0],
                           [11.0, 21.0, 31.0, 41.0],
                           [12.0, 22.0, 32.0, 42.0]])
    mask = torch.tensor([[True, False, True, True], [True, True, True, True], [True, False, False, False]])
    rewards, dones = torch.tensor([1.0, 0.5, -0.3]), torch.tensor([0.0, 1.0, 0.0])
    chosen: list[list[int]] = []

    def target_at(best: torch.Tensor) -> torch.Tensor:
        chosen.append(best.tolist())
        return target.gather(1, best[:, None]).squeeze(1)

    y = double_dqn_target(rewards, dones, online, mask, target_at, gamma=0.5)
    assert chosen == [[2, 3, 0]]
    # 1 + 0.5·30 = 16;  0.5 (terminal);  −0.3 + 0.5·12 = 5.7. Plain DQN (max of the target) would give 21.
    assert y.tolist() == pytest.approx([16.0, 0.5, 5.7])


def test_q_at_is_forward_at_the_chosen_items() -> None:
    torch.manual_seed(0)
    net = PlacementQ(8, (16, 8))
    items, task = torch.rand(3, 7, 5), torch.rand(3, 3)
    index = torch.tensor([0, 6, 3])
    assert torch.allclose(net.q_at(items, task, index), net(items, task)[torch.arange(3), index], atol=1e-6)


def test_placer_mask_allows_waiting_only_when_no_server_fits() -> None:
    assert placer_mask(np.array([True, False, True])).tolist() == [False, False, True]
    assert placer_mask(np.array([True, False, False])).tolist() == [True, False, False]


# -- masked actions are never chosen ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trainer() -> Trainer:
    return Trainer(TINY, 0, tiny_env())


masks = st.lists(st.booleans(), min_size=7, max_size=7).filter(any)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mask=masks, step=st.integers(0, 2000), state=st.lists(st.floats(0, 1), min_size=13, max_size=13),
       q=st.lists(st.floats(-1e6, 1e6), min_size=7, max_size=7))
def test_masked_actions_are_never_chosen(trainer: Trainer, mask, step, state, q) -> None:
    mask = np.array(mask)
    trainer.step = step  # ε from 1 (uniform among the allowed) down to 0.02
    obs = np.array(state, dtype=np.float32)
    obs[-1] *= 24.0  # demand in cores
    assert mask[trainer.act(obs, mask)]
    # the Double-DQN argmax at s' picks an allowed action, whatever the online Q of the masked ones
    picked: list[int] = []
    double_dqn_target(torch.zeros(1), torch.zeros(1), torch.tensor([q]), torch.from_numpy(mask[None]),
                      lambda best: picked.extend(best.tolist()) or torch.zeros(1), 0.9)
    assert mask[picked[0]]
    # served: the placer's select() over the policy's Q-values
    state_ = ClusterState(TINY_DC)
    choice = select(trainer.policy(), state_, spec(4).resources, mask[1:])
    assert (choice is None) == (not mask[1:].any())
    if choice is not None:
        assert all(mask[1 + node] for node, _ in choice.alternatives)


# -- training ---------------------------------------------------------------------------------------------


def test_a_short_run_on_a_tiny_room_beats_its_start(tiny_model) -> None:
    untrained = Trainer(TINY, 0, tiny_env())
    env = tiny_env()
    before = run_policy(env, untrained.policy())["mean_reward"]
    out, result = tiny_model
    after = run_policy(env, load_policy(out, TINY_DC))["mean_reward"]
    assert result["steps"] >= TINY.steps and out.exists() and (out.parent / "double_dqn_dc_curve.png").exists()
    assert after >= before + 0.3, (before, after)
    assert after >= run_policy(env, make_policy("greedy"))["mean_reward"] + 0.3  # it learned not to pack
    meta = checkpoint.load_metadata(out)
    assert meta["seed"] == 0 and meta["features"]["item"][0] == "util" and meta["hyperparameters"]["gamma"]


class Killed(BaseException):
    """A stand-in for SIGKILL: raised by the n-th checkpoint save, once its files are written."""


def kill_at_save(monkeypatch, n: int) -> None:
    real, saves = checkpoint.save, []

    def save(*args, **kwargs):
        path = real(*args, **kwargs)
        saves.append(path)
        if len(saves) == n:
            raise Killed(path)
        return path

    monkeypatch.setattr(checkpoint, "save", save)


def test_resume_continues_identically(tmp_path, monkeypatch) -> None:
    config = replace(TINY, steps=600)
    one = train_double_dqn(TrainArgs(seed=3, steps=600, out=tmp_path / "one.pt", progress=False), config,
                           tiny_env())
    half = TrainArgs(seed=3, steps=300, out=tmp_path / "two.pt", progress=False)
    train_double_dqn(half, config, tiny_env())
    with pytest.raises(ValidationError, match=r"^--resume: .*two_resume.pt was trained with --seed 3; this run "
                                              r"asks --seed 4$"):
        train_double_dqn(replace(half, seed=4, steps=600, resume=True), config, tiny_env())
    two = train_double_dqn(replace(half, steps=600, resume=True), config, tiny_env())
    assert one["steps"] == two["steps"]
    a, b = checkpoint.load_state(tmp_path / "one.pt")["q"], checkpoint.load_state(tmp_path / "two.pt")["q"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    curve = checkpoint.load_state(tmp_path / "two_resume.pt")["curve"]
    assert curve == checkpoint.load_state(tmp_path / "one_resume.pt")["curve"]
    # a run killed after its second periodic save (every episode here) resumes from it, identically
    killed = TrainArgs(seed=3, steps=600, out=tmp_path / "three.pt", progress=False, checkpoint_seconds=0)
    with monkeypatch.context() as m:
        kill_at_save(m, 2)
        with pytest.raises(Killed):
            train_double_dqn(killed, config, tiny_env())
    assert not (tmp_path / "three.pt").exists()
    saved = checkpoint.load_state(tmp_path / "three_resume.pt")
    assert 0 < saved["step"] < 300 and saved["episodes"] == 2
    train_double_dqn(replace(killed, resume=True), config, tiny_env())
    c = checkpoint.load_state(tmp_path / "three.pt")["q"]
    assert all(torch.equal(a[k], c[k]) for k in a)
    assert checkpoint.load_state(tmp_path / "three_resume.pt")["curve"] == curve


def test_a_resume_with_nothing_to_resume_is_refused(tmp_path) -> None:
    with pytest.raises(ValidationError, match=r"^--resume: nothing to resume: no training checkpoint at "
                                              r".*none_resume.pt; train without --resume to start one$"):
        train_double_dqn(TrainArgs(seed=0, steps=300, out=tmp_path / "none.pt", progress=False, resume=True), TINY,
                         tiny_env())
    assert not list(tmp_path.iterdir())


def test_a_data_runs_metadata_names_the_fleet_trace_room_jobs_and_budget_it_ran_on(tmp_path) -> None:
    trace = kth_slice(tmp_path / "kth300.swf", 300)
    out = tmp_path / "ddqn.pt"
    train_double_dqn(TrainArgs(seed=0, steps=300, out=out, progress=False, fleet=Path(SMALL_FLEET),
                               trace=str(trace)), TINY)
    meta = checkpoint.load_metadata(out)
    data = meta["data"]
    assert data["trace"] == str(trace.resolve()) and data["fleet"] == SMALL_FLEET
    assert same_trace(data, resolve_trace(str(trace))) and not same_trace(data, resolve_trace("kth"))
    # 300 jobs, fewer than the paper's 5 000: warm-up and training jobs in its 2 000 : 3 000 proportion
    assert data["warmup_jobs"] == [0, 120] and data["train_jobs"] == [120, 300]
    assert data["validation_jobs"] is None and data["eval_jobs"] is None  # not scored: no held-out jobs claimed
    assert meta["dc"] == meta["hyperparameters"]["dc"] == "cheap"  # the small fleet's first CPU-only room
    assert meta["hyperparameters"]["steps"] == 300 <= meta["steps"]  # whole episodes: it may run past
    assert meta["hyperparameters"]["episode_jobs"] == 180 and data["episodes"].endswith(" windows of 180 train jobs")


def test_the_paper_rooms_data_is_the_shipped_models_thunder_split() -> None:
    data = paper_data(DdqnConfig())
    assert data["trace"] == THUNDER and (data["cores_per_proc"], data["time_compression"]) == (1, 1.0)
    assert (data["warmup_jobs"], data["train_jobs"], data["validation_jobs"], data["eval_jobs"]) == (
        [0, 2000], [2000, 4500], [4500, 5000], [5000, 5500])
    shipped = json.loads((Path(__file__).parents[1] / "models" / "double_dqn_dc.json").read_text())["data"]
    assert same_trace(shipped, resolve_trace("thunder"))  # written before the scaling keys: unscaled


def test_a_budget_that_ends_before_the_first_update_is_refused(tmp_path) -> None:
    config = replace(TINY, learning_starts=201, train_every=4)  # first update at env step 204
    with pytest.raises(ValidationError, match=r"^--steps: ends before the first gradient update, at env step 204 "
                                              r"\(learning_starts 201, train_every 4\): give --steps >= 204 \(got 203\)$"):
        train_double_dqn(TrainArgs(seed=0, steps=203, out=tmp_path / "m.pt", progress=False), config, tiny_env())
    assert not list(tmp_path.iterdir())


# -- validation slice and reward selection ---------------------------------------------------------------


@pytest.mark.slow
def test_training_validation_and_eval_jobs_are_disjoint() -> None:
    jobs = thunder_jobs(5500)
    config = DdqnConfig()
    train = make_env(config)._phase_jobs
    validation = validation_env(config, "fixed")._phase_jobs
    assert train == jobs[2000:4500] and validation == jobs[4500:5000]  # eval jobs start at 5000


def _figures(pue_rr: float, overloads: tuple[float, float], outlet: tuple[float, float]) -> dict:
    fixed = {"mean_overloads vs RR %": overloads[0], "mean_overloads vs Greedy %": overloads[1],
             "mean_rack_outlet_c vs RR °C": outlet[0], "mean_rack_outlet_c vs Greedy °C": outlet[1]}
    metrics = {"Double DQN": {"mean_pue": 1.3}}
    return {"fixed": {"deltas": fixed, "metrics": metrics},
            "redline": {"deltas": {**fixed, "mean_pue vs RR %": pue_rr}, "metrics": metrics}}


def test_selection_prefers_beating_both_baselines_then_the_lowest_redline_pue() -> None:
    good = _figures(-0.5, (-40.0, -90.0), (-0.1, -0.1))
    better = _figures(-0.9, (-30.0, -90.0), (-0.05, -0.1))
    hot = _figures(-2.0, (-50.0, -95.0), (0.1, -0.1))  # lowest PUE, but a warmer outlet than RR's
    ranked = sorted({"good": good, "better": better, "hot": hot}.items(), key=lambda kv: selection_key(kv[1]))
    assert [name for name, _ in ranked] == ["better", "good", "hot"]
    mean = _mean_figures([good, hot])
    assert mean["redline"]["deltas"]["mean_pue vs RR %"] == pytest.approx(-1.25)
    assert mean["fixed"]["deltas"]["mean_rack_outlet_c vs RR °C"] == pytest.approx(0.0)


def test_only_a_model_with_the_chosen_reward_quotes_the_selection(tmp_path) -> None:
    assert reward_selection_record(TRAIN_REWARD, tmp_path) is None
    record = {"chosen": "x", "chosen_reward": json.loads(json.dumps(asdict(TRAIN_REWARD)))}
    (tmp_path / SELECTION_FILE).write_text(json.dumps(record))
    assert reward_selection_record(TRAIN_REWARD, tmp_path) == record
    assert reward_selection_record(replace(TRAIN_REWARD, phi_t=30.0), tmp_path) is None


# -- serving ------------------------------------------------------------------------------------------------


def test_load_policy_refuses_other_features_and_gpu_rooms(tiny_model, tmp_path) -> None:
    out, _ = tiny_model
    policy = load_policy(out, TINY_DC)
    assert policy.name == "double-dqn"
    assert load_policy(out, load_fleet().datacenter("chicago")).scores(
        ClusterState(load_fleet().datacenter("chicago")), spec(4).resources, np.ones(672, bool)).shape == (672,)
    bad = tmp_path / "bad.pt"
    bad.write_bytes(out.read_bytes())
    meta = json.loads(out.with_suffix(".json").read_text())
    meta["features"]["item"] = meta["features"]["item"][:-1]  # a model built with one feature fewer
    bad.with_suffix(".json").write_text(json.dumps(meta))
    with pytest.raises(ModelMismatch, match="4 item / 3 task features"):
        load_policy(bad, TINY_DC)
    with pytest.raises(ModelMismatch, match="GPU cards"):
        load_policy(out, load_fleet().datacenter("kansas-city"))


def test_placer_falls_back_to_greedy_when_the_model_is_missing(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HSCHED_MODELS_DIR", str(tmp_path))
    policy = make_policy("double-dqn", 0, TINY_DC)
    assert isinstance(policy, Fallback)
    assert policy.name.startswith("greedy (fallback for double-dqn: no model at")
    state = ClusterState(TINY_DC)
    assert select(policy, state, spec(4).resources, np.ones(6, bool)) is not None
    explicit = learned_policy("double-dqn", TINY_DC, model=str(tmp_path / "elsewhere.pt"))
    assert isinstance(explicit, Fallback) and "elsewhere.pt" in explicit.name


@pytest.mark.slow
def test_the_stack_serves_double_dqn_over_grpc(tiny_model, redis_url) -> None:
    from hsched.stack import Stack, StackConfig
    from hsched.v1 import gateway_pb2, gateway_pb2_grpc
    from tests.test_stack import submit, task

    out, _ = tiny_model
    prefix = f"test-ddqn-{int(time.time() * 1000)}"
    config = StackConfig(fleet_path=SMALL_FLEET, redis_url=redis_url, prefix=prefix, gateway_port=0,
                         policy="double-dqn", traces="none", extra_env={"HSCHED_MODELS_DIR": str(out.parent)})
    try:
        with Stack(config) as stack, grpc.insecure_channel(stack.gateway) as channel:
            gw = gateway_pb2_grpc.GatewayStub(channel)
            t = submit(gw, task(cores=4, mem_gib=8)).task
            assert t.state == 2 and t.datacenter in ("cheap", "near")  # TASK_STATE_PLACED, a CPU room
            explanation = t.explanation
            assert explanation.placer_policy == "double-dqn"
            alternatives = list(explanation.alternatives)
            assert len(alternatives) == 3 and alternatives[0].node == t.assignments[0].node
            assert [a.score for a in alternatives] == sorted((a.score for a in alternatives), reverse=True)
            # the GPU room has no features for its cards: the same flag serves it with the heuristic fallback
            g = submit(gw, task(cores=2, gpus=1, gpu_pct=50, gpu_mem_gib=4)).task
            assert g.datacenter == "gpu" and "fallback for double-dqn" in g.explanation.placer_policy
            gw.Release(gateway_pb2.ReleaseRequest(task_id=t.task_id), timeout=20)
    finally:
        delete_prefix(redis_url, prefix)
