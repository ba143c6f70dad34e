"""JobFusion trainer (paper 001): the Decima-style time baseline by hand, valid masked actions, a tiny
training run that writes checkpoint + metadata + curve, resumes, and loads back as a policy."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hsched.domain.errors import ValidationError
from hsched.envs.colocation import ColocationConfig, ColocationEnv
from hsched.rl.jobfusion import Config, JobFusionNet, decide, load_policy, time_baseline, train
from hsched.rl.training import TRAINERS, TrainArgs, trainer


def test_time_baseline_by_hand():
    a = {"times": [0.0, 10.0], "rewards": [-1.0, -2.0]}   # return-to-go −3, −2
    b = {"times": [0.0, 5.0], "rewards": [-4.0, -1.0]}    # return-to-go −5, −1
    ba, bb = time_baseline([a, b])
    assert ba.tolist() == [-4.0, -1.5]   # t=10: a's −2 and b's last decision (t=5) −1
    assert bb.tolist() == [-4.0, -2.0]   # t=5: a's decision at 0 (−3) and b's −1


@pytest.mark.parametrize("resource_features, slicing", [(True, "constrained"), (False, "uniform")])
def test_sampled_and_greedy_actions_are_always_valid(resource_features, slicing):
    cfg = Config(resource_features=resource_features, slicing=slicing)
    net = JobFusionNet(cfg, seed=0)
    env = ColocationEnv(cfg.env_config(6))
    _, info = env.reset(seed=3)
    rng = np.random.default_rng(0)
    done, step = False, 0
    while not done:
        with torch.no_grad():
            d = decide(net, env, info, greedy=step % 2 == 0, rng=rng)
        c, k, _n = d.action
        assert info["type_mask"][c, k] and float(d.log_prob) <= 0
        _obs, _r, term, trunc, info = env.step(d.action)
        done = term or trunc
        step += 1
    assert info["metrics"]["jobs_finished"] == 6
    assert len(net.columns) == (8 if resource_features else 6)


def test_tiny_training_run_writes_resumes_and_loads(tmp_path):
    cfg = Config(iterations=1, rollouts=2, train_jobs=3, bc_episodes=1, checkpoint_every=1,
                 env=ColocationConfig(num_jobs=3))
    out = tmp_path / "jf.pt"
    res = train(cfg, TrainArgs(seed=1, out=out, progress=False), "jobfusion", "unused")
    assert res["iterations"] == 1 and out.exists() and out.with_suffix(".png").exists()
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["command"] == "hsched train jobfusion --seed 1" and meta["train_seconds"] >= 0
    assert meta["slice_types"]["sizes"] and meta["evaluation"]["jobs_finished"] == 3
    with pytest.raises(ValidationError, match=r"^--resume: .*jf.train.pt was trained with --seed 1; this run asks "
                                              r"--seed 2$"):
        train(cfg, TrainArgs(seed=2, steps=2, out=out, resume=True, progress=False), "jobfusion", "unused")
    res2 = train(cfg, TrainArgs(seed=1, steps=2, out=out, resume=True, progress=False), "jobfusion", "unused")
    assert res2["iterations"] == 2
    policy, loaded = load_policy(out)
    assert loaded.train_jobs == 3 and loaded.env.num_jobs == 3
    env = ColocationEnv(loaded.env_config())
    _, info = env.reset(seed=0)
    done = False
    while not done:
        _obs, _r, term, trunc, info = env.step(policy(env))
        done = term or trunc
    assert info["metrics"]["jobs_finished"] == 3


def test_registered():
    assert "jobfusion" in TRAINERS and "decima-colocation" in TRAINERS
    assert trainer("jobfusion").__name__ == "train_jobfusion"
