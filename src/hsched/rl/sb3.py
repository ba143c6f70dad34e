"""Stable-Baselines3 baselines on `hsched/GpuCluster-v0`: paper 000's TD3, SAC and PPO rows (optional
dependency: `pip install 'hsched[sb3]'`). Well-kept implementations as a check on our DDPG.

The agents see what our DDPG sees, flattened: `hsched.rl.ddpg.Codec` (per host its features and its
cluster's free shares, a wait item, the task's demand, the action mask) — one vector — and are trained on the
same reward (eq.15-17 + `deploy_bonus` per placed task) and the same training episode seeds (10 000 + k; never
the evaluation seeds: SB3 passes its own seed to the first reset, which `ScoreVectorActions` ignores).

- TD3, SAC (continuous actions): the action is a score vector in [−1, 1]^(H+1) and the executed action is its
  masked argmax (`ScoreVectorActions`), exactly how DDPG's scores become a decision.
- PPO (discrete actions): the env's own Discrete(H+1); a masked action is executed and penalised by the env
  (eq.17's failure reward −50, the task is lost), which teaches PPO the mask (core SB3 has no action masks).

Served through `SB3Policy` (a NodePolicy: TD3/SAC's action vector or PPO's logits as the score per host), so
in `hsched eval gpu` they decide under the same mask and `select()` as every other row.

Files. SB3's own `model.save` archive holds the critics, the target networks and the optimiser moments
(3-6 MB per model here), none of which serving uses. The shipped ``models/<algo>_gpu.zip`` is therefore a
torch archive (`torch.load(..., weights_only=True)`, no pickled code) of the SB3 policy's serving weights
(TD3/SAC: ``actor.*``; PPO: ``mlp_extractor.policy_net.*`` and ``action_net.*``) with the spaces and inputs
it was trained on; `load` rebuilds SB3's own MlpPolicy around them. The full SB3 archive (to continue
training) goes to ``runs/<algo>_gpu.sb3.zip`` (not shipped); `load` also reads such an archive.

Train: ``python -m hsched.rl.sb3 td3|sac|ppo [--steps N] [--seed S]`` → models/<algo>_gpu.zip + .json.
"""

from __future__ import annotations

import argparse
import json
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import torch
from gymnasium import spaces

from hsched.domain.cluster import ClusterState
from hsched.domain.resources import Resources
from hsched.envs.gpu import HINT_FEATURES, HOST_FEATURES, GpuClusterEnv, MultiClusterState
from hsched.metrics import RESOURCES
from hsched.rl import checkpoint
from hsched.rl.ddpg import (
    CURVE_SEED_STRIDE,
    EVAL_SEEDS,
    ITEM_FEATURES,
    TASK_INPUTS,
    TRAIN_SEED0,
    Codec,
    Config,
    PolicyInputs,
    evaluate_policy,
    make_env,
    noisy_action,
    paired_comparison,
    runs_dir,
)

ALGOS = ("td3", "sac", "ppo")
DEFAULT_STEPS = {"td3": 20_000, "sac": 12_000, "ppo": 40_000}
NET = [128, 64]  # paper 000 table 5's hidden layers
FORMAT = "hsched-sb3-policy/1"
SERVED = {"td3": ("actor.",), "sac": ("actor.",), "ppo": ("mlp_extractor.policy_net.", "action_net.")}


class ScoreVectorActions(gymnasium.Wrapper):
    """GpuClusterEnv for SB3: flat observation (`Codec`), the training reward, and — with `continuous` — a score
    vector as the action, executed as its masked argmax. Episodes use the training seeds in order, whatever
    seed `reset` is given (SB3 passes its global seed, e.g. 0 = an evaluation seed, to the first reset)."""

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
        del seed  # the training seeds, in order: never SB3's (see the class docstring)
        obs, info = self.env.reset(seed=self.seed0 + self.episode, options=options)
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
    """A trained SB3 policy as a NodePolicy: TD3/SAC's deterministic action vector or PPO's action logits,
    one score per host of `view.fleet` (the wait entry is dropped: the caller decides waiting)."""

    def __init__(self, policy: Any, name: str, view: MultiClusterState) -> None:
        self.policy, self.name = policy, name
        self.inputs = PolicyInputs(view)

    @torch.no_grad()
    def scores(self, state: ClusterState, demand: Resources, mask: np.ndarray) -> np.ndarray:
        items, task = self.inputs(state, demand)
        obs = np.concatenate([items.ravel(), task, np.append(mask, False)]).astype(np.float32)
        if hasattr(self.policy, "get_distribution"):  # PPO: the categorical's logits
            t, _ = self.policy.obs_to_tensor(obs)
            return self.policy.get_distribution(t).distribution.logits[0, :-1].numpy().astype(np.float64)
        action, _ = self.policy.predict(obs, deterministic=True)
        return np.asarray(action, dtype=np.float64)[:-1]

    def placed(self, node: int) -> None:
        pass


def _inputs() -> dict[str, Any]:
    """The observation layout a model is trained on (checked when it is loaded)."""
    return {"item_features": ITEM_FEATURES, "task_features": len(TASK_INPUTS),
            "host_features": list(HOST_FEATURES), "cluster_features": list(RESOURCES),
            "hint_features": list(HINT_FEATURES)}


def build_policy(algo: str, obs_dim: int, n_actions: int, net_arch: Sequence[int] = tuple(NET)) -> Any:
    """SB3's MlpPolicy of `algo` for these spaces (the same class and defaults `train` uses), untrained."""
    import stable_baselines3

    cls = getattr(stable_baselines3, algo.upper()).policy_aliases["MlpPolicy"]
    obs = spaces.Box(0.0, 1.0, shape=(obs_dim,), dtype=np.float32)
    act = spaces.Discrete(n_actions) if algo == "ppo" else spaces.Box(-1.0, 1.0, (n_actions,), dtype=np.float32)
    return cls(obs, act, lambda _: 0.0, net_arch=list(net_arch))


def save_policy(algo: str, policy: Any, path: Path) -> Path:
    """The serving weights of `policy` (SERVED[algo]) and its spaces, as a torch archive at `path`."""
    import stable_baselines3

    state = {k: v.detach().clone() for k, v in policy.state_dict().items() if k.startswith(SERVED[algo])}
    n = policy.action_space.n if algo == "ppo" else policy.action_space.shape[0]
    blob = {"format": FORMAT, "algo": algo, "stable_baselines3": stable_baselines3.__version__,
            "obs_dim": int(policy.observation_space.shape[0]), "n_actions": int(n), "net_arch": list(NET),
            "inputs": _inputs(), "state_dict": state}
    tmp = path.with_suffix(".zip.tmp")
    torch.save(blob, tmp)
    tmp.replace(path)
    return path


def load_sb3_policy(algo: str, path: str | Path) -> Any:
    """The SB3 policy in `path`: a shipped serving archive (`save_policy`) or SB3's own `model.save` archive."""
    from hsched.policies.learned import ModelMismatch

    path = Path(path)
    with zipfile.ZipFile(path) as z:
        sb3_archive = "policy.pth" in z.namelist()
    if sb3_archive:
        import stable_baselines3

        return getattr(stable_baselines3, algo.upper()).load(str(path), device="cpu").policy
    blob = torch.load(path, map_location="cpu", weights_only=True)
    if blob.get("format") != FORMAT or blob.get("algo") != algo:
        raise ModelMismatch(f"{path.name}: not a {algo} policy of this format ({blob.get('format')!r}, "
                            f"{blob.get('algo')!r})")
    for key, value in _inputs().items():
        if blob["inputs"].get(key) != value:
            raise ModelMismatch(f"{path.name}: {key} {blob['inputs'].get(key)!r}, this build feeds {value!r}")
    policy = build_policy(algo, blob["obs_dim"], blob["n_actions"], blob["net_arch"])
    missing, unexpected = policy.load_state_dict(blob["state_dict"], strict=False)
    if unexpected or any(k.startswith(SERVED[algo]) for k in missing):
        raise ModelMismatch(f"{path.name}: weights do not fit SB3's {algo.upper()} MlpPolicy "
                            f"(unexpected {unexpected}, missing {[k for k in missing if k.startswith(SERVED[algo])]})")
    return policy


def load(algo: str, path: str | Path, view: MultiClusterState) -> SB3Policy:
    """The policy `hsched eval gpu` serves for `view`; ModelMismatch when its MLP is sized for another fleet."""
    from hsched.policies.learned import ModelMismatch

    policy = load_sb3_policy(algo, Path(path).with_suffix(".zip"))
    policy.set_training_mode(False)
    want = Codec(view.hosts, view.host_cluster).dim
    if policy.observation_space.shape != (want,):
        raise ModelMismatch(f"its MLP reads {policy.observation_space.shape[0]} inputs (a fleet of another size), "
                            f"this fleet gives {want}")
    return SB3Policy(policy, algo.upper(), view)


def _hyperparameters(model: Any, cfg: Config) -> dict[str, Any]:
    """What the SB3 model was built with (its attributes after construction, SB3's defaults included)."""
    out: dict[str, Any] = {"net_arch": NET, "deploy_bonus": cfg.deploy_bonus, "policy": type(model.policy).__name__,
                           "activation_fn": model.policy.activation_fn.__name__}
    for key in ("learning_rate", "gamma", "batch_size", "buffer_size", "learning_starts", "gradient_steps",
                "tau", "policy_delay", "target_policy_noise", "target_noise_clip", "ent_coef", "target_entropy",
                "target_update_interval", "n_steps", "n_epochs", "gae_lambda", "clip_range", "vf_coef",
                "max_grad_norm", "normalize_advantage"):
        if hasattr(model, key):
            value = getattr(model, key)
            value = value(1.0) if callable(value) else value  # PPO's clip_range is a schedule
            out[key] = value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
    if hasattr(model, "train_freq"):
        out["train_freq"] = [model.train_freq.frequency, str(model.train_freq.unit.value)]
    if getattr(model, "action_noise", None) is not None:
        out["action_noise"] = f"Normal(0, {float(model.action_noise._sigma[0])}) per score"
    return out


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
    t0, cpu0 = time.perf_counter(), time.process_time()
    model.learn(total_timesteps=steps, progress_bar=False)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
    out = (out or checkpoint.models_dir() / f"{algo}_gpu.zip").with_suffix(".zip")
    out.parent.mkdir(parents=True, exist_ok=True)
    full = runs_dir(out) / f"{out.stem}.sb3.zip"
    full.parent.mkdir(parents=True, exist_ok=True)
    model.save(str(full))  # everything SB3 needs to continue training (not shipped)
    save_policy(algo, model.policy, out)

    def make(view: MultiClusterState) -> SB3Policy:
        return load(algo, out, view)

    figures = evaluate_policy(make, cfg)
    figures["train_seconds"] = round(seconds, 1)
    figures["train_cpu_seconds"] = round(cpu_seconds, 1)  # wall time counts a shared machine
    episodes = env.episode  # resets, the last episode possibly cut short by the step budget
    meta = {"agent": f"{algo} (stable-baselines3 {stable_baselines3.__version__})",
            "environment": f"hsched/GpuCluster-v0, paper000_datacenters{cfg.fleet} (clusters × hosts of openb "
                           "2-GPU machines)",
            "data": {"trace": "alibaba_openb_gpu_2023 openb_pod_list_default", "tasks_per_episode": cfg.n_tasks,
                     "train_episode_seeds": f"{env.seed0}..{env.seed0 + episodes - 1}",
                     "eval_seeds": list(EVAL_SEEDS)},
            "seed": seed, "steps": int(model.num_timesteps), "steps_asked": steps, "episodes": episodes,
            "hyperparameters": _hyperparameters(model, cfg),
            "inputs": {**_inputs(), "observation": "hsched.rl.ddpg.Codec: (H+1) items × item_features, the "
                                                   "task's demand, the action mask (H+1)",
                       "dim": env.codec.dim, "actions": env.action_space.shape[0] if algo != "ppo"
                       else int(env.action_space.n)},
            "files": {"shipped": f"{out.name}: serving weights only ({FORMAT}, hsched.rl.sb3.load)",
                      "full_sb3_archive": str(full.relative_to(checkpoint.models_dir().parent))
                      if full.is_relative_to(checkpoint.models_dir().parent) else str(full)},
            "evaluation": figures, "paired_comparison": paired_comparison(make, cfg, vs_shipped=True),
            "train_seconds": figures["train_seconds"], "train_cpu_seconds": figures["train_cpu_seconds"],
            "torch": torch.__version__, "stable_baselines3": stable_baselines3.__version__}
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
