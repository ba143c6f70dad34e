"""Stable-Baselines3 baselines on `hsched/GpuCluster-v0`: paper 000's TD3, SAC and PPO rows (optional
dependency: `pip install 'hsched[sb3]'`). Well-kept implementations as a check on our DDPG.

The agents see what our DDPG sees, flattened: `hsched.rl.ddpg.Codec` (per host its features and its
cluster's free shares, a wait item, the task's demand, the action mask) — one vector — and are trained on the
same reward (eq.15-17 + `deploy_bonus` per placed task) and the same training episode seeds.

- TD3, SAC (continuous actions): the action is a score vector in [−1, 1]^(H+1) and the executed action is its
  masked argmax (`ScoreVectorActions`), exactly how DDPG's scores become a decision.
- PPO (discrete actions): the env's own Discrete(H+1); a masked action is executed and penalised by the env
  (eq.17's failure reward −50, the task is lost), which teaches PPO the mask (core SB3 has no action masks).

Served through `SB3Policy` (a NodePolicy: TD3/SAC's action vector or PPO's logits as the score per host), so
in `hsched eval gpu` they decide under the same mask and `select()` as every other row.

Train: ``python -m hsched.rl.sb3 td3|sac|ppo [--steps N] [--seed S]`` → models/<algo>_gpu.zip + .json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import torch
from gymnasium import spaces

from hsched.domain.cluster import ClusterState
from hsched.domain.resources import Resources
from hsched.envs.gpu import GpuClusterEnv, MultiClusterState
from hsched.rl import checkpoint
from hsched.rl.ddpg import (
    CURVE_SEED_STRIDE,
    TRAIN_SEED0,
    Codec,
    Config,
    PolicyInputs,
    evaluate_policy,
    make_env,
    noisy_action,
)

ALGOS = ("td3", "sac", "ppo")
DEFAULT_STEPS = {"td3": 20_000, "sac": 12_000, "ppo": 40_000}
NET = [128, 64]  # paper 000 table 5's hidden layers


class ScoreVectorActions(gymnasium.Wrapper):
    """GpuClusterEnv for SB3: flat observation (`Codec`), the training reward, and — with `continuous` — a score
    vector as the action, executed as its masked argmax. Episodes use the training seeds in order."""

    def __init__(self, env: GpuClusterEnv, continuous: bool, deploy_bonus: float, seed: int = 0) -> None:
        super().__init__(env)
        self.codec = Codec(env.view.hosts, env.view.host_cluster)
        self.continuous = continuous
        self.deploy_bonus = deploy_bonus
        self.episode = 0
        self.seed0 = TRAIN_SEED0 + CURVE_SEED_STRIDE * seed
        self.observation_space = spaces.Box(0.0, 1.0, shape=(self.codec.dim,), dtype=np.float32)
        n = env.view.hosts + 1
        self.action_space = spaces.Box(-1.0, 1.0, shape=(n,), dtype=np.float32) if continuous else spaces.Discrete(n)
        self._mask = np.zeros(n, dtype=bool)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        obs, info = self.env.reset(seed=self.seed0 + self.episode if seed is None else seed, options=options)
        self.episode += 1
        self._mask = info["action_mask"].astype(bool)
        return self.codec.encode(obs, info["action_mask"]), info

    def step(self, action):
        a = noisy_action(np.asarray(action, dtype=np.float64), self._mask, 0.0, None) if self.continuous \
            else int(action)
        obs, reward, terminated, truncated, info = self.env.step(a)
        self._mask = info["action_mask"].astype(bool)
        reward += self.deploy_bonus * (info["event"] == "placed")
        return self.codec.encode(obs, info["action_mask"]), reward, terminated, truncated, info


class SB3Policy:
    """A trained SB3 model as a NodePolicy: TD3/SAC's deterministic action vector or PPO's action logits,
    one score per host of `view.fleet` (the wait entry is dropped: the caller decides waiting)."""

    def __init__(self, model: Any, name: str, view: MultiClusterState) -> None:
        self.model, self.name = model, name
        self.inputs = PolicyInputs(view)
        self.codec = Codec(view.hosts, view.host_cluster)

    @torch.no_grad()
    def scores(self, state: ClusterState, demand: Resources, mask: np.ndarray) -> np.ndarray:
        items, task = self.inputs(state, demand)
        obs = np.concatenate([items.ravel(), task, np.append(mask, False).astype(np.float32)])
        if hasattr(self.model.policy, "get_distribution"):  # PPO: the categorical's logits
            t, _ = self.model.policy.obs_to_tensor(obs)
            return self.model.policy.get_distribution(t).distribution.logits[0, :-1].numpy().astype(np.float64)
        action, _ = self.model.predict(obs, deterministic=True)
        return np.asarray(action, dtype=np.float64)[:-1]

    def placed(self, node: int) -> None:
        pass


def load(algo: str, path: str | Path, view: MultiClusterState) -> SB3Policy:
    import stable_baselines3

    from hsched.policies.learned import ModelMismatch

    model = getattr(stable_baselines3, algo.upper()).load(str(Path(path).with_suffix(".zip")), device="cpu")
    want = Codec(view.hosts, view.host_cluster).dim
    if model.observation_space.shape != (want,):
        raise ModelMismatch(f"its MLP reads {model.observation_space.shape[0]} inputs (a fleet of another size), "
                            f"this fleet gives {want}")
    return SB3Policy(model, algo.upper(), view)


def train(algo: str, steps: int | None = None, seed: int = 0, out: Path | None = None) -> dict[str, Any]:
    import stable_baselines3
    from stable_baselines3.common.noise import NormalActionNoise

    from hsched.rl.training import seed_everything

    seed_everything(seed)
    cfg = Config()
    steps = steps or DEFAULT_STEPS[algo]
    env = ScoreVectorActions(make_env(cfg), continuous=algo != "ppo", deploy_bonus=cfg.deploy_bonus, seed=seed)
    common = {"policy_kwargs": {"net_arch": NET}, "seed": seed, "device": "cpu", "verbose": 0}
    if algo == "ppo":
        model = stable_baselines3.PPO("MlpPolicy", env, learning_rate=3e-4, n_steps=2048, batch_size=256,
                                      gamma=cfg.gamma, **common)
    else:
        n = env.action_space.shape[0]
        extra = {"action_noise": NormalActionNoise(np.zeros(n), 0.2 * np.ones(n))} if algo == "td3" else {}
        model = getattr(stable_baselines3, algo.upper())(
            "MlpPolicy", env, learning_rate=1e-3, buffer_size=cfg.buffer_size, batch_size=cfg.batch_size,
            learning_starts=cfg.learning_starts, gamma=cfg.gamma, train_freq=cfg.train_every,
            gradient_steps=1, **extra, **common)
    t0 = time.perf_counter()
    model.learn(total_timesteps=steps, progress_bar=False)
    seconds = time.perf_counter() - t0
    out = out or checkpoint.models_dir() / f"{algo}_gpu.zip"
    model.save(str(out.with_suffix(".zip")))
    figures = evaluate_policy(lambda view: load(algo, out, view), cfg)
    meta = {"agent": f"{algo} (stable-baselines3 {stable_baselines3.__version__})", "steps": steps, "seed": seed,
            "hyperparameters": {"net_arch": NET, "batch_size": cfg.batch_size, "gamma": cfg.gamma,
                                "deploy_bonus": cfg.deploy_bonus, "train_freq": cfg.train_every},
            "data": {"train_episode_seeds_from": env.seed0, "episodes": env.episode, "eval_seeds": [0, 1, 2]},
            "evaluation": figures, "train_seconds": round(seconds, 1)}
    out.with_suffix(".json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return meta


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("algo", choices=ALGOS)
    p.add_argument("--steps", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    print(json.dumps(train(a.algo, a.steps, a.seed, a.out), indent=2, default=str))


if __name__ == "__main__":
    main()
