"""Thermal-aware Double DQN for placement inside one DC (paper 003 §2.2), CleanRL style, plus its serving.

The algorithm, in one place:

- State (`observe`): per server its CPU utilisation u_i and its inlet's recirculation rise over the supply air
  (T_in,i − T_sup, K), plus the head subtask's cores. The rise rather than the inlet itself: it is the same
  in both CRAC modes (fixed or redline supply), so one model serves either room.
- Network (`PlacementQ`, a `PooledScorer` of hsched.rl.nets): one Q-value per item from shared weights over
  per-item features with a mean/max pooled context, so one checkpoint serves a room of any size. Items are
  laid out as the env's actions: item 0 is action 0 ("wait"; its features are a flag, so its Q comes from
  the pooled context and the task), item k is server k − 1 with the features `ITEM_FEATURES`:
  u, u after placing the subtask, rise / (redline − nominal supply), and the server's heat influence: its
  column sum of the recirculation matrix D over the room's mean column sum (how much one watt on it warms
  every inlet, hence the mean outlet and, in the redline mode, the supply the CRAC must run).
- Masking. The env's feasibility mask is applied to the Q-values when acting (ε-greedy draws among allowed
  actions only) AND in the Double-DQN argmax at s' (an infeasible action's Q is never trained, so letting
  it into the argmax would bootstrap from noise). Action 0 is allowed only when no server fits
  (`placer_mask`): the placer defers exactly then, so the agent is trained under the rule it is served by.
- Target (`double_dqn_target`): a* = argmax over allowed a' of the online net at s', valued by the target
  net: y = r + γ (1 − terminated) Q_target(s', a*). Loss: MSE on Q(s, a) (`PlacementQ.q_at` runs the head
  on the taken action only: no backward pass through 673 items per row). Hard target updates.
- Reward: eq.12 with the constants of `TRAIN_REWARD`, in the fixed 20 °C room (see there for why φ_T
  is lower than the redline). The evaluation metrics (hsched.eval.thermal) are untouched.
- Episodes: windows of `episode_jobs` Thunder jobs of the "train" phase (jobs 2000-4999) at seeded random
  starts, each from the same warmed-up room; the evaluation plays the held-out "eval" jobs (5000-5499)
  through `hsched.eval.thermal.eval_env` + `run_policy`, i.e. the placer's plan()/select() code with the
  served policy (`DoubleDqnPolicy`, what `load_policy` returns).

Budget and resume: training runs whole episodes until `steps` env steps are done (it stops at the first
episode end at or after it). The resumable state (nets, optimiser, replay with its masks, RNG states, the
env's RNG, step, curves) is written at that episode boundary to `<out stem>_resume.pt` next to `args.out`,
or to `runs/` for the shipped model (it holds the replay, ~130 MB: not a file to commit). Hyper-parameters
are in absolute env steps, so training to N then resuming to 2N equals training to 2N in one go.
The shipped model (`models/double_dqn_dc.pt`) holds the online net's weights only; its `.json` the data
slice, seed, hyper-parameters, features, evaluation figures vs RR / Greedy and training time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hsched.domain.cluster import ClusterState
from hsched.domain.fleet import DataCenter
from hsched.domain.resources import MILLI, Resources
from hsched.envs.dc import DEFAULT_DC, ENV_ID, PAPER_SPLIT, THUNDER, DcPlacementEnv, RewardConfig
from hsched.policies.learned import ModelMismatch
from hsched.rl import checkpoint
from hsched.rl.buffers import ReplayBuffer
from hsched.rl.nets import PooledScorer
from hsched.rl.schedules import LinearSchedule, epsilon_greedy, hard_update
from hsched.rl.training import TrainArgs, plot_curves, progress, restore_rng_state, rng_state, seed_everything
from hsched.thermal import RoomModel
from hsched.thermal.datacenter import load_arrays, room_for

MODEL_NAME = "double_dqn_dc"
POLICY_NAME = "double-dqn"
ITEM_FEATURES = ("util", "util_after", "rise", "influence", "is_wait")
TASK_FEATURES = ("demand", "mean_util", "max_rise")
RUNS_DIR = Path(__file__).resolve().parents[3] / "runs"  # git-ignored: the shipped model's resume state

# Eq.12 as trained. With the DC's 27 °C redline as φ_T the overheat term never fires on Thunder load in the
# fixed 20 °C room (the hottest inlet stays at 25-26 °C), so the reward would carry no thermal signal at all.
# φ_T = 20.7 °C marks every inlet more than 0.7 K above the supply air as warm: all but the low slots, where
# little recirculated heat arrives and whose own heat reaches few inlets. (Tried on the train phase with
# 16 k steps: φ_T 22 / 21 / 20.7 °C → held-out redline PUE −0.73 / −0.95 / −1.07 % vs RR.) The overload
# penalty is the larger one (u > 0.8 is a metric itself, a warm inlet only a proxy), and both stay below
# r_job, so placing always beats waiting, as in the placer.
TRAIN_REWARD = RewardConfig(r_job=1.0, overheat_penalty=0.5, overload_penalty=0.8, phi_t=20.7)


@dataclass(frozen=True)
class DdqnConfig:
    """Hyper-parameters (in env steps, independent of the budget, so a resumed run is the same run)."""

    dc: str = DEFAULT_DC
    supply_mode: str = "fixed"  # the training room's CRAC (the features are the same in both modes)
    reward: RewardConfig = TRAIN_REWARD
    episode_jobs: int = 250  # Thunder jobs per training episode (~1 100 decisions)
    steps: int = 24_000  # default budget (TrainArgs.steps overrides)
    gamma: float = 0.9
    learning_starts: int = 2_000
    buffer_size: int = 20_000
    batch_size: int = 32
    lr: float = 5e-4
    train_every: int = 4
    target_every: int = 1_000  # hard target update period
    eps_start: float = 1.0
    eps_end: float = 0.02
    eps_steps: int = 15_000
    grad_clip: float = 10.0
    embed: int = 16  # PooledScorer: small, so a 672-server decision stays far inside the 1 ms budget
    hidden: tuple[int, ...] = (32, 32)
    eval_seeds: tuple[int, ...] = (0,)  # held-out windows scored at the end (seed s: eval jobs offset 500·s)


# ------------------------------------------------------------------------------------------------------------
# state, features, network


def placer_mask(env_mask: np.ndarray) -> np.ndarray:
    """The env's mask with action 0 allowed only when no server fits (the placer's deferral rule)."""
    mask = np.array(env_mask, dtype=bool)
    mask[0] = not mask[1:].any()
    return mask


def observe(util: np.ndarray, rise: np.ndarray, demand_cores: float) -> np.ndarray:
    """The agent's state vector ``[u_0..u_{n-1}, rise_0..rise_{n-1}, demand cores]`` (float32); rise_i is
    T_in,i − T_sup = (D @ P)_i in K."""
    return np.concatenate([util, rise, [demand_cores]]).astype(np.float32)


@dataclass(frozen=True)
class RoomFeatures:
    """What the features need from a room and never changes: per-server capacity and heat influence."""

    inv_cores: torch.Tensor  # [n] 1 / cores
    influence: torch.Tensor  # [n] column sum of D / mean column sum
    rise_scale: float  # 1 / (redline − nominal supply), K⁻¹: rise 1.0 = an inlet at the redline
    max_cores: float

    @classmethod
    def of(cls, room: RoomModel) -> RoomFeatures:
        influence = room.d.sum(axis=0)
        p = room.params
        return cls(
            inv_cores=torch.as_tensor(1.0 / np.maximum(room.total_cores, 1e-9), dtype=torch.float32),
            influence=torch.as_tensor(influence / max(influence.mean(), 1e-30), dtype=torch.float32),
            rise_scale=1.0 / max(p.redline_c - p.t_supply_c, 1e-9),
            max_cores=float(room.total_cores.max()),
        )


def features(obs: torch.Tensor, room: RoomFeatures) -> tuple[torch.Tensor, torch.Tensor]:
    """obs [B, 2n + 1] (`observe`) → items [B, n + 1, ITEM_FEATURES] (item 0 = wait), task [B, TASK_FEATURES]."""
    n = room.inv_cores.shape[0]
    util, rise, demand = obs[:, :n], obs[:, n : 2 * n] * room.rise_scale, obs[:, 2 * n]
    after = util + demand[:, None] * room.inv_cores
    zeros = torch.zeros_like(util)
    servers = torch.stack([util, after, rise, room.influence.expand_as(util), zeros], dim=-1)
    wait = torch.zeros(obs.shape[0], 1, len(ITEM_FEATURES))
    wait[..., ITEM_FEATURES.index("is_wait")] = 1.0
    task = torch.stack([demand / room.max_cores, util.mean(dim=1), rise.amax(dim=1)], dim=-1)
    return torch.cat([wait, servers], dim=1), task


class PlacementQ(PooledScorer):
    """`PooledScorer` over the items of `features`, plus `q_at`: Q(s, a) of one item per row (the TD loss
    needs only the taken action's value, so the other items skip the head)."""

    def __init__(self, embed: int, hidden: tuple[int, ...]) -> None:
        super().__init__(len(ITEM_FEATURES), len(TASK_FEATURES), embed=embed, hidden=hidden)

    def q_at(self, items: torch.Tensor, task: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        h, context = self.encode(items, task)
        chosen = h.gather(1, index.view(-1, 1, 1).expand(-1, 1, h.shape[-1])).squeeze(1)
        return self.score(chosen, context)


def double_dqn_target(rewards: torch.Tensor, dones: torch.Tensor, q_online_next: torch.Tensor,
                      next_mask: torch.Tensor, target_at: Callable[[torch.Tensor], torch.Tensor],
                      gamma: float) -> torch.Tensor:
    """y = r + γ (1 − done) Q_target(s', a*), a* = argmax over the allowed a' of the online Q(s', a').
    `target_at(a*)` gives the target net's Q at those actions, one per row."""
    best = q_online_next.masked_fill(~next_mask, -torch.inf).argmax(dim=1)
    return rewards + gamma * (1.0 - dones) * target_at(best)


# ------------------------------------------------------------------------------------------------------------
# serving


class DoubleDqnPolicy:
    """The served NodePolicy: scores = the Q-values of placing on each server (the wait item is not a node).

    The rise comes from the library's room model of the DC the ClusterState belongs to (`room_for`, built
    once per DC): D @ P with P from `RoomModel.power` (eq.5), i.e. `RoomModel.evaluate`'s inlet minus supply
    without the rest of the state (outlets, CRAC, PUE) the features do not read, with D in float32 (half the
    memory traffic of the O(n²) product, and the features are float32 anyway). So the same policy also scores
    the small rooms of the evaluation's exact instances.
    """

    name = POLICY_NAME

    def __init__(self, net: PlacementQ, dc: DataCenter | None = None) -> None:
        self.net = net.eval()
        self._rooms: dict[int, tuple[DataCenter, RoomModel, RoomFeatures, np.ndarray]] = {}
        if dc is not None:
            self._room(dc)

    def _room(self, dc: DataCenter) -> tuple[DataCenter, RoomModel, RoomFeatures, np.ndarray]:
        hit = self._rooms.get(id(dc))
        if hit is None or hit[0] is not dc:
            room = room_for(dc)
            hit = self._rooms[id(dc)] = (dc, room, RoomFeatures.of(room), room.d.astype(np.float32))
        return hit

    def q_values(self, state: ClusterState, demand: Resources) -> np.ndarray:
        """Q for actions 0..n (0 = wait) in the current state of `state`'s room."""
        _, room, rf, d32 = self._room(state.dc)
        busy_cores, busy_gpus = load_arrays(state)
        rise = d32 @ room.power(busy_cores, busy_gpus).astype(np.float32)
        obs = observe(busy_cores / room.total_cores, rise, demand.cpu_milli / MILLI)
        with torch.inference_mode():
            return self.net(*features(torch.from_numpy(obs)[None], rf))[0].numpy()

    def scores(self, state: ClusterState, demand: Resources, mask: np.ndarray) -> np.ndarray:
        return self.q_values(state, demand)[1:].astype(np.float64)

    def placed(self, node: int) -> None:
        pass


def build_net(meta: dict[str, Any]) -> PlacementQ:
    hp = meta["hyperparameters"]
    return PlacementQ(hp["embed"], tuple(hp["hidden"]))


def load_policy(path: str | Path, dc: DataCenter) -> DoubleDqnPolicy:
    """The shipped (or given) checkpoint as the placer's NodePolicy for `dc`. Raises FileNotFoundError
    without a model and `ModelMismatch` when its features are not this code's or `dc` has GPU cards (the
    features describe CPU rooms only)."""
    path = checkpoint.model_path(str(path))
    if not path.exists():
        raise FileNotFoundError(f"no model at {path}")
    meta = checkpoint.load_metadata(path)
    got = meta.get("features", {})
    if tuple(got.get("item", ())) != ITEM_FEATURES or tuple(got.get("task", ())) != TASK_FEATURES:
        raise ModelMismatch(
            f"{path.name} has {len(got.get('item', ()))} item / {len(got.get('task', ()))} task features "
            f"({', '.join(got.get('item', ()))}); this placer builds {len(ITEM_FEATURES)} / "
            f"{len(TASK_FEATURES)} ({', '.join(ITEM_FEATURES)})")
    if dc is not None and dc.node_table().gpu_count.any():
        raise ModelMismatch(f"{path.name} was trained on CPU rooms; {dc.name} has GPU cards its features "
                            "cannot describe")
    net = build_net(meta)
    try:
        net.load_state_dict(checkpoint.load_state(path)["q"])
    except (KeyError, RuntimeError) as exc:
        raise ModelMismatch(f"{path.name}: weights do not fit the network its metadata describes ({exc})") from exc
    return DoubleDqnPolicy(net, dc)


# ------------------------------------------------------------------------------------------------------------
# training


def make_env(config: DdqnConfig, dc: DataCenter | None = None, **kwargs: Any) -> DcPlacementEnv:
    return DcPlacementEnv(dc or config.dc, phase="train", episode_jobs=config.episode_jobs,
                          supply_mode=config.supply_mode, reward=config.reward, **kwargs)


@dataclass
class Curve:
    step: list[int] = field(default_factory=list)  # env steps at each episode's end
    reward: list[float] = field(default_factory=list)  # mean eq.12 reward per decision
    overloads: list[float] = field(default_factory=list)  # time-weighted mean overloaded servers
    outlet: list[float] = field(default_factory=list)  # time-weighted mean rack outlet °C


class Trainer:
    """One training run over whole episodes; `state()` / `load()` are the resumable checkpoint."""

    def __init__(self, config: DdqnConfig, seed: int, env: DcPlacementEnv | None = None) -> None:
        self.config, self.seed = config, seed
        self.rng = seed_everything(seed)
        self.env = env or make_env(config)
        self.n = self.env.n
        self.room = RoomFeatures.of(self.env.room)
        self.q = PlacementQ(config.embed, config.hidden)
        self.target = PlacementQ(config.embed, config.hidden)
        self.target.load_state_dict(self.q.state_dict())
        self.optimizer = torch.optim.Adam(self.q.parameters(), lr=config.lr)
        # float16 states halve the replay (u is k/24, rises are K: far above float16's resolution)
        self.buffer = ReplayBuffer(config.buffer_size, 2 * self.n + 1, obs_dtype=np.float16, seed=self.rng)
        self.next_masks = np.zeros((config.buffer_size, self.n + 1), dtype=bool)
        self.epsilon = LinearSchedule(config.eps_start, config.eps_end, config.eps_steps)
        self.step = 0
        self.episodes = 0
        self.curve = Curve()
        self.train_seconds = 0.0
        self.evaluation: dict[str, Any] = {}

    def observe(self) -> np.ndarray:
        head, thermal = self.env.head_task(), self.env.state
        return observe(self.env.util, thermal.inlet_c - thermal.t_supply_c,
                       head.resources.cpu_milli / MILLI if head else 0.0)

    def act(self, obs: np.ndarray, mask: np.ndarray) -> int:
        with torch.no_grad():
            q = self.q(*features(torch.from_numpy(obs)[None], self.room))[0].numpy()
        return epsilon_greedy(q, self.epsilon(self.step), self.rng, mask=mask)

    def update(self) -> float:
        c = self.config
        batch = self.buffer.sample(c.batch_size)
        obs = torch.as_tensor(batch.obs, dtype=torch.float32)
        next_obs = torch.as_tensor(batch.next_obs, dtype=torch.float32)
        next_items, next_task = features(next_obs, self.room)
        with torch.no_grad():
            y = double_dqn_target(torch.as_tensor(batch.rewards), torch.as_tensor(batch.dones),
                                  self.q(next_items, next_task), torch.as_tensor(self.next_masks[batch.indices]),
                                  lambda best: self.target.q_at(next_items, next_task, best), c.gamma)
        q = self.q.q_at(*features(obs, self.room), torch.as_tensor(batch.actions))
        loss = torch.nn.functional.mse_loss(q, y)
        self.optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.q.parameters(), c.grad_clip)
        self.optimizer.step()
        return loss.item()

    def episode(self) -> None:
        """Play one episode, learning as it goes (the unit of checkpointing)."""
        c, env = self.config, self.env
        _, info = env.reset(seed=self.seed if self.episodes == 0 else None)
        obs, mask = self.observe(), placer_mask(info["action_mask"])
        done = False
        while not done:
            action = self.act(obs, mask)
            _, reward, terminated, truncated, info = env.step(action)
            next_obs, next_mask = self.observe(), placer_mask(info["action_mask"])
            slot = self.buffer.add(obs, action, reward, next_obs, terminated)  # truncation bootstraps
            self.next_masks[slot] = next_mask
            obs, mask, done = next_obs, next_mask, terminated or truncated
            self.step += 1
            if self.step >= c.learning_starts and self.step % c.train_every == 0:
                self.update()
            if self.step % c.target_every == 0:
                with torch.no_grad():
                    hard_update(self.target.state_dict(), self.q.state_dict())
        m = env.episode_metrics()
        self.episodes += 1
        for key, value in (("step", self.step), ("reward", m["mean_reward"]),
                           ("overloads", m["mean_overloads"]), ("outlet", m["mean_rack_outlet_c"])):
            getattr(self.curve, key).append(value)

    def run(self, until: int, show: bool = True) -> None:
        t0 = time.perf_counter()
        with progress(f"train double-dqn on {self.env.dc.name}", until, show) as advance:
            advance(min(self.step, until))
            while self.step < until:
                before = self.step
                self.episode()
                advance(min(self.step, until) - min(before, until), eps=self.epsilon(self.step),
                        reward=self.curve.reward[-1], overloads=self.curve.overloads[-1])
        self.train_seconds += time.perf_counter() - t0

    def policy(self) -> DoubleDqnPolicy:
        return DoubleDqnPolicy(self.q, self.env.dc)

    # -- checkpoint --------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        buffer = {k: v for k, v in vars(self.buffer).items() if k != "rng"}
        return {"q": self.q.state_dict(), "target": self.target.state_dict(),
                "optimizer": self.optimizer.state_dict(), "buffer": buffer, "next_masks": self.next_masks,
                "rng": rng_state(self.rng), "env_rng": self.env.np_random.bit_generator.state,
                "step": self.step, "episodes": self.episodes, "curve": asdict(self.curve),
                "train_seconds": self.train_seconds}

    def load(self, state: dict[str, Any]) -> None:
        self.q.load_state_dict(state["q"])
        self.target.load_state_dict(state["target"])
        self.optimizer.load_state_dict(state["optimizer"])
        for k, v in state["buffer"].items():
            setattr(self.buffer, k, v)
        self.next_masks = state["next_masks"]
        restore_rng_state(self.rng, state["rng"])
        self.env.reset(seed=self.seed)  # creates env.np_random; its state is then the saved one
        self.env.np_random.bit_generator.state = state["env_rng"]
        self.step, self.episodes = state["step"], state["episodes"]
        self.curve = Curve(**state["curve"])
        self.train_seconds = state["train_seconds"]

    def metadata(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        warm, train, evaluation = PAPER_SPLIT
        return {
            "agent": POLICY_NAME, "env": ENV_ID, "seed": self.seed, "dc": self.env.dc.name,
            "data": {"trace": THUNDER, "warmup_jobs": [0, warm], "train_jobs": [warm, warm + train],
                     "eval_jobs": [warm + train, warm + train + evaluation],
                     "episodes": f"{self.episodes} windows of {self.config.episode_jobs} train jobs"},
            "hyperparameters": asdict(self.config),
            "features": {"item": list(ITEM_FEATURES), "task": list(TASK_FEATURES)},
            "input_shape": {"item_features": len(ITEM_FEATURES), "task_features": len(TASK_FEATURES)},
            "steps": self.step, "train_seconds": round(self.train_seconds, 1),
            "evaluation": self.evaluation,
            **(extra or {}),
        }


def evaluate(policy: DoubleDqnPolicy, seeds: tuple[int, ...]) -> dict[str, Any]:
    """hsched.eval.thermal's held-out Thunder episodes (both CRAC modes) for this policy, RR and Greedy:
    each one's metrics (mean over seeds) and this policy's Δ against RR and Greedy, as the report has them."""
    from hsched.envs.dc import run_policy
    from hsched.eval import thermal

    factories = {"Double DQN": lambda seed: policy, **{k: thermal.POLICY_FACTORIES[k] for k in ("RR", "Greedy")}}
    out: dict[str, Any] = {"seeds": list(seeds), "eval_jobs_per_seed": PAPER_SPLIT[2]}
    for mode in thermal.MODES:
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in factories}
        for seed in seeds:
            env = thermal.eval_env(mode, seed)
            for name, factory in factories.items():
                runs[name].append(run_policy(env, factory(seed), seed=seed))
        out[mode] = {
            "metrics": {name: {key: round(float(np.mean([r[key] for r in rs])), 5) for key, _, _ in thermal.METRICS}
                        for name, rs in runs.items()},
            "deltas": {f"{key} vs {ref} {unit}": round(float(np.mean(thermal.delta_values(
                runs["Double DQN"], runs[ref], key, unit))), 4)
                for key, unit in thermal.DELTAS for ref in ("RR", "Greedy")},
        }
    return out


def train_double_dqn(args: TrainArgs, config: DdqnConfig | None = None,
                     env: DcPlacementEnv | None = None) -> dict[str, Any]:
    """Train (or resume) to `args.steps`, save the model at `args.out`, plot its curve, evaluate it on the
    held-out jobs against RR and Greedy. `config` / `env` override the defaults (tests: a tiny room)."""
    config = config or DdqnConfig()
    out = checkpoint.model_path(str(args.out)) if args.out else checkpoint.model_path(MODEL_NAME)
    resume = out.with_name(out.stem + "_resume.pt") if args.out else RUNS_DIR / f"{MODEL_NAME}_resume.pt"
    trainer = Trainer(config, args.seed, env)
    if args.resume and resume.exists():
        trainer.load(checkpoint.load_state(resume))
    trainer.run(args.steps or config.steps, args.progress)
    checkpoint.save(resume, trainer.state(), trainer.metadata())
    if env is None:  # the paper room: score it on the held-out jobs
        trainer.evaluation = evaluate(trainer.policy(), config.eval_seeds)
    curve = plot_curves(out.with_name(out.stem + "_curve.png"),
                        {"Double DQN": (trainer.curve.step, trainer.curve.reward)},
                        title=f"Double DQN placement on {trainer.env.dc.name} (eq.12, seed {args.seed})",
                        xlabel="environment steps", ylabel="mean reward per decision (episode)", window=3)
    checkpoint.save(out, {"q": trainer.q.state_dict()}, trainer.metadata({"curve_png": curve.name}))
    return {"model": str(out), "curve": str(curve), "steps": trainer.step,
            "train_seconds": round(trainer.train_seconds, 1), "evaluation": trainer.evaluation}
