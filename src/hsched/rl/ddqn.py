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
- Data: the paper's "train" phase (Thunder jobs 2000-4999) is cut in two (`train_split`): episodes are
  windows of `episode_jobs` jobs of its first part (jobs 2000-4499) at seeded random starts, each from the
  same warmed-up room; its last `val_jobs` jobs (4500-4999) are the validation slice (`validation_env`,
  played like an evaluation episode: right after the warm-up). The reward constants are chosen on it
  (`select_reward`, `bench/ddqn_reward_selection.py`), never on the held-out "eval" jobs (5000-5499 and
  the later seeds' windows), which only score the finished model through `hsched.envs.dc.eval_env`
  + `run_policy`, i.e. the placer's plan()/select() code with the served policy (`DoubleDqnPolicy`, what
  `load_policy` returns).

Budget and resume: training runs whole episodes until `steps` env steps are done (it stops at the first
episode end at or after it). The resumable state (nets, optimiser, replay with its masks, RNG states, the
env's RNG, step, curves) is written at that episode boundary, and at the first episode boundary after every
`--checkpoint-seconds` of training (hsched.rl.checkpoint.Resumable), to `<out stem>_resume.pt` next to
`args.out` (it holds the replay, ~130 MB: not a file to commit; models/*_resume.pt is git-ignored).
Hyper-parameters are in absolute env steps, so training to N then resuming to 2N, or resuming a killed run
from its last save, equals training in one go.
The shipped model (`models/double_dqn_dc.pt`) holds the online net's weights only; its `.json` the data
slice, seed, hyper-parameters, features, evaluation figures vs RR / Greedy and training time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hsched.domain.cluster import ClusterState
from hsched.domain.fleet import DataCenter
from hsched.domain.resources import MILLI, Resources
from hsched.envs.dc import (
    DEFAULT_DC,
    DELTAS,
    ENV_ID,
    METRICS,
    MODES,
    PAPER_SPLIT,
    DcPlacementEnv,
    RewardConfig,
    delta_values,
    eval_env,
    run_policy,
    trace_record,
)
from hsched.policies.heuristics import make_policy
from hsched.policies.learned import ModelMismatch
from hsched.rl import checkpoint
from hsched.rl.buffers import ReplayBuffer
from hsched.rl.nets import PooledNumpy, PooledScorer
from hsched.rl.schedules import LinearSchedule, epsilon_greedy, hard_update
from hsched.rl.training import (
    TrainArgs,
    check_budget,
    output_path,
    plot_curves,
    progress,
    restore_rng_state,
    rng_state,
    run_identity,
    seed_everything,
)
from hsched.thermal import RoomModel
from hsched.thermal.datacenter import load_arrays, room_for

MODEL_NAME = "double_dqn_dc"
POLICY_NAME = "double-dqn"
ITEM_FEATURES = ("util", "util_after", "rise", "influence", "is_wait")
TASK_FEATURES = ("demand", "mean_util", "max_rise")

# Eq.12 as trained. With the DC's 27 °C redline as φ_T the overheat term never fires on Thunder load in the
# fixed 20 °C room (the hottest inlet stays at 25-26 °C), so the reward would carry no thermal signal at all:
# φ_T must sit a little above the 20 °C supply air, which inlets count as "warm" then. Which φ_T and which
# penalties is chosen on the VALIDATION slice (jobs 4500-4999, never on the held-out eval jobs) by
# `select_reward` over `REWARD_CANDIDATES` (`bench/ddqn_reward_selection.py` runs it and writes
# models/double_dqn_dc_selection.json, which the shipped model's metadata quotes). Both penalties stay below
# r_job, so placing always beats waiting, as in the placer.
REWARD_CANDIDATES: dict[str, RewardConfig] = {
    "phi_t 22.0, overheat 0.5, overload 0.8": RewardConfig(overheat_penalty=0.5, overload_penalty=0.8, phi_t=22.0),
    "phi_t 21.0, overheat 0.5, overload 0.8": RewardConfig(overheat_penalty=0.5, overload_penalty=0.8, phi_t=21.0),
    "phi_t 20.7, overheat 0.5, overload 0.8": RewardConfig(overheat_penalty=0.5, overload_penalty=0.8, phi_t=20.7),
    "phi_t 21.0, overheat 0.8, overload 0.5": RewardConfig(overheat_penalty=0.8, overload_penalty=0.5, phi_t=21.0),
}
TRAIN_REWARD = RewardConfig(r_job=1.0, overheat_penalty=0.5, overload_penalty=0.8, phi_t=20.7)
SELECTION_FILE = "double_dqn_dc_selection.json"  # in the models dir, next to the shipped model


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
    val_jobs: int = 500  # the last jobs of the train phase, never trained on: the validation slice
    eval_seeds: tuple[int, ...] = (0, 1, 2)  # held-out windows scored at the end (seed s: eval jobs offset 500·s)


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
        influence = room.recirc.column_sums()  # O(n) from the zonal model
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

    It scores at most `candidate_limit` servers per decision (hsched.policies.base.candidates: a uniform
    sample of the feasible ones when more fit), the size of the room it was trained on, so a decision costs
    the same in a room of 10,000 servers as in the training room; the network reads a set of items of any
    size (`PooledScorer`), so nothing is padded.

    The rise comes from the library's room model of the DC the ClusterState belongs to (`room_for`, built
    once per DC): D @ P with P from `RoomModel.power` (eq.5), i.e. `RoomModel.evaluate`'s inlet minus supply
    without the rest of the state (outlets, CRAC, PUE) the features do not read, with D the room's zonal
    operator (O(n), hsched.thermal.zonal). So the same policy also scores the small rooms of the evaluation's
    exact instances.
    """

    name = POLICY_NAME
    candidate_limit = 672  # the training room's servers (DEFAULT_DC)

    def __init__(self, net: PlacementQ, dc: DataCenter | None = None) -> None:
        self.net = net.eval()
        self._forward = PooledNumpy(self.net)
        self._rooms: dict[int, tuple[DataCenter, RoomModel, RoomFeatures]] = {}
        self._arrays: dict[int, tuple[RoomFeatures, np.ndarray, np.ndarray]] = {}
        if dc is not None:
            self._room(dc)

    def _room(self, dc: DataCenter) -> tuple[DataCenter, RoomModel, RoomFeatures]:
        hit = self._rooms.get(id(dc))
        if hit is None or hit[0] is not dc:
            room = room_for(dc)
            hit = self._rooms[id(dc)] = (dc, room, RoomFeatures.of(room))
        return hit

    def q_values(self, state: ClusterState, demand: Resources, nodes: np.ndarray | None = None) -> np.ndarray:
        """Q for actions 0..n (0 = wait) in the current state of `state`'s room (torch, as trained) — or, with
        `nodes`, for wait and those servers only (the bounded candidate set of hsched.policies.base), the
        pooled context then taken over them so the network's cost follows len(nodes); the task features stay
        room-wide (mean utilisation, hottest rise: O(n) vector operations). That path builds the items of
        `features` for `nodes` only and runs the forward in numpy (`PooledNumpy`: torch's per-operator overhead
        was most of a decision)."""
        _, room, rf = self._room(state.dc)
        busy_cores, busy_gpus = load_arrays(state)
        if nodes is None:
            rise = room.rise(room.power(busy_cores, busy_gpus))
            obs = observe(busy_cores / room.total_cores, rise, demand.cpu_milli / MILLI)
            with torch.inference_mode():
                return self.net(*features(torch.from_numpy(obs)[None], rf))[0].numpy()
        rise = room.rise(room.power_of(busy_cores, busy_gpus)).astype(np.float32) * np.float32(rf.rise_scale)
        util = (busy_cores / room.total_cores).astype(np.float32)
        demand_cores = np.float32(demand.cpu_milli / MILLI)
        task = np.array([demand_cores / rf.max_cores, util.mean(), rise.max()], dtype=np.float32)
        idx = np.asarray(nodes, dtype=np.intp)
        u, inv, infl = util[idx], self._inv_cores(rf)[idx], self._influence(rf)[idx]
        items = np.zeros((len(u) + 1, len(ITEM_FEATURES)), dtype=np.float32)
        items[0, ITEM_FEATURES.index("is_wait")] = 1.0
        items[1:, 0], items[1:, 1], items[1:, 2], items[1:, 3] = u, u + demand_cores * inv, rise[idx], infl
        return self._forward(items, task)

    def _numpy(self, rf: RoomFeatures) -> tuple[RoomFeatures, np.ndarray, np.ndarray]:
        hit = self._arrays.get(id(rf))
        if hit is None or hit[0] is not rf:
            hit = self._arrays[id(rf)] = (rf, rf.inv_cores.numpy(), rf.influence.numpy())
        return hit

    def _inv_cores(self, rf: RoomFeatures) -> np.ndarray:
        return self._numpy(rf)[1]

    def _influence(self, rf: RoomFeatures) -> np.ndarray:
        return self._numpy(rf)[2]

    def scores(self, state: ClusterState, demand: Resources, mask: np.ndarray) -> np.ndarray:
        return self.q_values(state, demand)[1:].astype(np.float64)

    def scores_at(self, state: ClusterState, demand: Resources, nodes: np.ndarray) -> np.ndarray:
        return self.q_values(state, demand, np.asarray(nodes))[1:].astype(np.float64)

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


def train_split(config: DdqnConfig) -> tuple[int, int, int]:
    """The env split (warm-up, train, validation): the paper's train phase minus its last `val_jobs` jobs,
    which become the "eval" phase of this split (the validation slice; the paper's eval jobs stay unread)."""
    warm, train, _ = PAPER_SPLIT
    return warm, train - config.val_jobs, config.val_jobs


def make_env(config: DdqnConfig, dc: DataCenter | None = None, **kwargs: Any) -> DcPlacementEnv:
    """The training env: windows of the train jobs without the validation slice (`jobs=` replaces them)."""
    return DcPlacementEnv(dc or config.dc, phase="train", split=train_split(config),
                          episode_jobs=config.episode_jobs, supply_mode=config.supply_mode, reward=config.reward,
                          **kwargs)


def paper_data(config: DdqnConfig) -> dict[str, Any]:
    """The metadata's `data` of the paper room (`make_env`): Thunder's train phase minus the validation slice,
    and the held-out eval jobs `evaluate` scores."""
    from hsched.traces.catalog import resolve_trace

    warm, train, val = train_split(config)
    first_eval, evaluation = sum(PAPER_SPLIT[:2]), PAPER_SPLIT[2]
    return {**trace_record(resolve_trace("thunder")), "fleet": "the default fleet",
            "warmup_jobs": [0, warm], "train_jobs": [warm, warm + train],
            "validation_jobs": [warm + train, warm + train + val], "eval_jobs": [first_eval, first_eval + evaluation],
            "eval_seeds": {str(s): [first_eval + evaluation * s, first_eval + evaluation * (s + 1)]
                           for s in config.eval_seeds}}


def data_env(config: DdqnConfig, args: TrainArgs) -> tuple[DcPlacementEnv, dict[str, Any]] | None:
    """`hsched train double-dqn --fleet F --trace T`: the first CPU-only DC of F, trained on T's jobs split as
    the paper splits Thunder (2 000 warm-up, 3 000 train) when T has them, else in those proportions; with the
    metadata's `data` naming them (no validation or eval jobs: such a run is not scored). None without
    --fleet/--trace (the paper room and its held-out evaluation)."""
    if not args.fleet and not args.trace:
        return None
    from hsched.domain.errors import ValidationError
    from hsched.domain.fleet import load_fleet
    from hsched.traces.catalog import resolve_trace, trace_jobs

    fleet = load_fleet(args.fleet)
    dc = next((d for d in fleet.datacenters if not any(p.gpu_count for p in d.pools)), None)
    if dc is None:
        raise ValidationError("--fleet", "has no CPU-only data center to train the thermal placer on",
                              str(args.fleet))
    ref = resolve_trace(args.trace or "thunder", args.cores_per_proc, time_compression=args.time_compression)
    if ref.kind != "swf":
        raise ValidationError("--trace", "must be an SWF log for the CPU-room placer", args.trace)
    warm, train, _ = PAPER_SPLIT
    jobs = trace_jobs(ref, limit=warm + train)
    if len(jobs) < warm + train:
        warm = max(1, len(jobs) * warm // (warm + train))
    if len(jobs) - warm < 1:
        raise ValidationError("--trace", "needs at least 2 jobs", args.trace)
    env = DcPlacementEnv(dc, jobs=jobs[warm:], warmup_jobs=jobs[:warm], episode_jobs=config.episode_jobs,
                         supply_mode=config.supply_mode, reward=config.reward)
    return env, {**trace_record(ref), "fleet": str(args.fleet) if args.fleet else "the default fleet",
                 "warmup_jobs": [0, warm], "train_jobs": [warm, len(jobs)], "validation_jobs": None,
                 "eval_jobs": None}


def validation_env(config: DdqnConfig, mode: str, seed: int = 0) -> DcPlacementEnv:
    """The validation episode in CRAC `mode`: the last `val_jobs` train jobs, played like an evaluation
    episode (right after the warm-up). One window: `seed` is accepted for `compare`'s signature only."""
    return DcPlacementEnv(config.dc, phase="eval", split=train_split(config), supply_mode=mode)


@dataclass
class Curve:
    step: list[int] = field(default_factory=list)  # env steps at each episode's end
    reward: list[float] = field(default_factory=list)  # mean eq.12 reward per decision
    overloads: list[float] = field(default_factory=list)  # time-weighted mean overloaded servers
    outlet: list[float] = field(default_factory=list)  # time-weighted mean rack outlet °C


class Trainer:
    """One training run over whole episodes; `state()` / `load()` are the resumable checkpoint. `data`: what
    the metadata says `env` plays (default: the paper room's `paper_data`; a given env without it: its job
    counts only)."""

    def __init__(self, config: DdqnConfig, seed: int, env: DcPlacementEnv | None = None,
                 data: dict[str, Any] | None = None) -> None:
        self.seed = seed
        self.rng = seed_everything(seed)
        self.env = env or make_env(config)
        # the hyper-parameters as run: the env's DC and episode length, which a given env decides
        self.config = config = replace(config, dc=self.env.dc.name, episode_jobs=self.env.episode_jobs)
        warm = len(self.env._warm_jobs)
        self.data = data or (paper_data(config) if env is None else
                             {"trace": None, "jobs": "given by the caller", "warmup_jobs": [0, warm],
                              "train_jobs": [warm, warm + len(self.env._phase_jobs)]})
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
        self.train_cpu_seconds = 0.0  # this process's CPU time while training (other load does not count)
        self.evaluation: dict[str, Any] = {}
        self.validation: dict[str, Any] = {}

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

    def run(self, until: int, show: bool = True, boundary: Callable[[], None] | None = None) -> None:
        """Episodes until `until` env steps; `boundary()` after each (where a resumable state may be saved)."""
        with progress(f"train double-dqn on {self.env.dc.name}", until, show) as advance:
            advance(min(self.step, until))
            while self.step < until:
                before, t0, c0 = self.step, time.perf_counter(), time.process_time()
                self.episode()
                self.train_seconds += time.perf_counter() - t0
                self.train_cpu_seconds += time.process_time() - c0
                advance(min(self.step, until) - min(before, until), eps=self.epsilon(self.step),
                        reward=self.curve.reward[-1], overloads=self.curve.overloads[-1])
                if boundary is not None:
                    boundary()

    def policy(self) -> DoubleDqnPolicy:
        return DoubleDqnPolicy(self.q, self.env.dc)

    # -- checkpoint --------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        buffer = {k: v for k, v in vars(self.buffer).items() if k != "rng"}
        return {"q": self.q.state_dict(), "target": self.target.state_dict(),
                "optimizer": self.optimizer.state_dict(), "buffer": buffer, "next_masks": self.next_masks,
                "rng": rng_state(self.rng), "env_rng": self.env.np_random.bit_generator.state,
                "step": self.step, "episodes": self.episodes, "curve": asdict(self.curve),
                "train_seconds": self.train_seconds, "train_cpu_seconds": self.train_cpu_seconds}

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
        self.train_cpu_seconds = state.get("train_cpu_seconds", 0.0)

    def metadata(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
            "agent": POLICY_NAME, "env": ENV_ID, "seed": self.seed, "dc": self.env.dc.name,
            "data": {**self.data, "episodes": f"{self.episodes} windows of {self.config.episode_jobs} train jobs"},
            "hyperparameters": asdict(self.config),
            "features": {"item": list(ITEM_FEATURES), "task": list(TASK_FEATURES)},
            "input_shape": {"item_features": len(ITEM_FEATURES), "task_features": len(TASK_FEATURES)},
            "steps": self.step, "train_seconds": round(self.train_seconds, 1),
            "train_cpu_seconds": round(self.train_cpu_seconds, 1),
            "validation": self.validation,
            "evaluation": self.evaluation,
            **(extra or {}),
        }


def compare(policy: DoubleDqnPolicy, env_for: Callable[[str, int], DcPlacementEnv],
            seeds: tuple[int, ...]) -> dict[str, Any]:
    """This policy, RR and Greedy on the episodes `env_for(mode, seed)` (both CRAC modes): each one's metrics
    (mean over seeds) and this policy's Δ against RR and Greedy, as hsched.eval.thermal's report has them."""
    factories = {"Double DQN": lambda seed: policy, "RR": lambda seed: make_policy("rr"),
                 "Greedy": lambda seed: make_policy("greedy")}
    out: dict[str, Any] = {"seeds": list(seeds)}
    for mode in MODES:
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in factories}
        for seed in seeds:
            env = env_for(mode, seed)
            for name, factory in factories.items():
                runs[name].append(run_policy(env, factory(seed), seed=seed))
        out[mode] = {
            "metrics": {name: {key: round(float(np.mean([r[key] for r in rs])), 5) for key, _, _ in METRICS}
                        for name, rs in runs.items()},
            "deltas": {f"{key} vs {ref} {unit}": round(float(np.mean(delta_values(
                runs["Double DQN"], runs[ref], key, unit))), 4)
                for key, unit in DELTAS for ref in ("RR", "Greedy")},
        }
    return out


def evaluate(policy: DoubleDqnPolicy, seeds: tuple[int, ...]) -> dict[str, Any]:
    """hsched.eval.thermal's held-out Thunder episodes (jobs 5000 + 500·s …, s in `seeds`): `compare`."""
    return {**compare(policy, eval_env, seeds), "eval_jobs_per_seed": PAPER_SPLIT[2]}


def validate(policy: DoubleDqnPolicy, config: DdqnConfig) -> dict[str, Any]:
    """The validation slice (`validation_env`: the last `val_jobs` train jobs): `compare`."""
    warm, train, val = train_split(config)
    return {**compare(policy, lambda mode, seed: validation_env(config, mode), (0,)),
            "validation_jobs": [warm + train, warm + train + val]}


# ------------------------------------------------------------------------------------------------------------
# choosing eq.12's constants on the validation slice


SELECTION_CRITERION = (
    "on the validation slice: first the candidates that beat both RR and Greedy on overloads and on the "
    "fixed-mode mean rack outlet; among them (or among all, if none does) the lowest redline-mode PUE Δ vs RR %"
)


def selection_key(figures: dict[str, Any]) -> tuple[int, float]:
    """How `select_reward` ranks a candidate by its validation figures, smaller first (`SELECTION_CRITERION`):
    the overload and outlet bar of the issue, then the redline PUE, the metric φ_T acts on (hot inlets cost
    cooling power)."""
    fixed, redline = figures["fixed"]["deltas"], figures["redline"]["deltas"]
    beats = all(fixed[f"{key} vs {ref} {unit}"] < 0 for key, unit in (("mean_overloads", "%"),
                                                                        ("mean_rack_outlet_c", "°C"))
                for ref in ("RR", "Greedy"))
    return (0 if beats else 1, redline["mean_pue vs RR %"])


def _mean_figures(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """`compare` figures averaged over training seeds (same validation episode, one model per seed)."""
    out: dict[str, Any] = {}
    for mode in ("fixed", "redline"):
        out[mode] = {part: {k: (round(float(np.mean([f[mode][part][k] for f in per_seed])), 4)
                                if part == "deltas" else
                                {m: round(float(np.mean([f[mode][part][k][m] for f in per_seed])), 5)
                                 for m in per_seed[0][mode][part][k]})
                            for k in per_seed[0][mode][part]}
                     for part in ("metrics", "deltas")}
    return out


def select_reward(candidates: dict[str, RewardConfig], steps: int, seeds: tuple[int, ...] = (0,),
                  config: DdqnConfig | None = None, show: bool = True,
                  log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Train one model per candidate reward and seed for `steps` env steps (on the train jobs without the
    validation slice), score each on the validation slice (`validate`), average over the seeds and choose
    by `selection_key`. The held-out eval jobs are never read. Returns the record the shipped model's
    metadata quotes."""
    config = config or DdqnConfig()
    records = []
    for name, reward in candidates.items():
        runs = []
        for seed in seeds:
            trainer = Trainer(replace(config, reward=reward), seed)
            trainer.run(steps, show)
            runs.append({"seed": seed, "steps": trainer.step, "train_seconds": round(trainer.train_seconds, 1),
                         "train_cpu_seconds": round(trainer.train_cpu_seconds, 1),
                         "validation": validate(trainer.policy(), trainer.config)})
            if log:
                log(f"{name} seed {seed}: {trainer.step} steps, {trainer.train_seconds:.0f} s wall, "
                    f"{trainer.train_cpu_seconds:.0f} s CPU")
        records.append({"name": name, "reward": asdict(reward),
                        "validation": _mean_figures([r["validation"] for r in runs]), "runs": runs})
    chosen = min(records, key=lambda r: selection_key(r["validation"]))
    warm, train, val = train_split(config)
    return {"seeds": list(seeds), "steps_per_run": steps, "validation_jobs": [warm + train, warm + train + val],
            "train_jobs": [warm, warm + train], "criterion": SELECTION_CRITERION,
            "candidates": records, "chosen": chosen["name"], "chosen_reward": chosen["reward"]}


def reward_selection_record(reward: RewardConfig, directory: Path | None = None) -> dict[str, Any] | None:
    """The selection record in the models dir if it chose `reward` (else None: a model trained with other
    constants must not quote it)."""
    path = (directory or checkpoint.model_path(MODEL_NAME).parent) / SELECTION_FILE
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    return record if record.get("chosen_reward") == asdict(reward) else None


def train_double_dqn(args: TrainArgs, config: DdqnConfig | None = None,
                     env: DcPlacementEnv | None = None) -> dict[str, Any]:
    """Train (or resume) to `args.steps`, save the model at `args.out`, plot its curve, evaluate it on the
    held-out jobs against RR and Greedy. `config` / `env` override the defaults (tests: a tiny room)."""
    config = config or DdqnConfig()
    config = replace(config, steps=args.steps or config.steps)  # the budget as run, in the metadata
    check_budget(config.steps, config.learning_starts, config.train_every)
    data = None
    if env is None and (on_data := data_env(config, args)) is not None:
        env, data = on_data
    out = output_path(args, MODEL_NAME)
    resume = checkpoint.Resumable(out.with_name(out.stem + "_resume.pt"),
                                  run_identity(args, POLICY_NAME, config, ignore=("steps",)), args.checkpoint_seconds)
    if args.resume:
        resume.check()  # before the env and the nets are built
    trainer = Trainer(config, args.seed, env, data)
    if args.resume:
        trainer.load(resume.load())

    def boundary() -> None:
        if resume.due():
            resume.save(trainer.state(), trainer.metadata())

    trainer.run(config.steps, args.progress, boundary)
    resume.save(trainer.state(), trainer.metadata())
    extra: dict[str, Any] = {}
    if env is None:  # the paper room: score it on the validation slice and the held-out jobs
        trainer.validation = validate(trainer.policy(), config)
        trainer.evaluation = evaluate(trainer.policy(), config.eval_seeds)
        extra["reward_selection"] = reward_selection_record(config.reward, out.parent)
    curve = plot_curves(out.with_name(out.stem + "_curve.png"),
                        {"Double DQN": (trainer.curve.step, trainer.curve.reward)},
                        title=f"Double DQN placement on {trainer.env.dc.name} (eq.12, seed {args.seed})",
                        xlabel="environment steps", ylabel="mean reward per decision (episode)", window=3)
    checkpoint.save(out, {"q": trainer.q.state_dict()}, trainer.metadata({"curve_png": curve.name, **extra}))
    return {"model": str(out), "curve": str(curve), "steps": trainer.step,
            "train_seconds": round(trainer.train_seconds, 1),
            "train_cpu_seconds": round(trainer.train_cpu_seconds, 1), "validation": trainer.validation,
            "evaluation": trainer.evaluation}
