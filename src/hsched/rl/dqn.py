"""DQN and PER-DQN path agents (paper 003 §2.1) on `hsched/Path-v0`, CleanRL style, plus their serving.

The algorithm, in one place:

- One Q-network (`mlp`, 128-64) serves every target: the observation is one_hot(current) ⧺ one_hot(target)
  (PathEnv), the output one Q-value per vertex ("go there next"). The shipped model is trained on every
  entry vertex of the default WAN as a target, so the selector can ask it for a path from any entry.
- Masking. Moves to non-neighbours are masked in action selection (ε-greedy draws among neighbours only)
  AND in the bootstrap max: an invalid move is never taken, so its Q-value is never trained and would be
  an arbitrary number; letting it into max_a' Q(s', a') would bootstrap from that noise. The mask of s' is
  the WAN's adjacency row of the vertex s' is at (read off the observation), so the buffer stores no masks.
- Target: Double DQN (`double=True`, the default): a' = argmax over valid a' of the online net, valued by
  the target net, y = r + γ (1 − terminated) Q_target(s', a'). `double=False` gives the plain DQN target
  y = r + γ (1 − terminated) max over valid a' of Q_target(s', a'). Truncation (the env's step limit) is not
  terminal: it bootstraps, so the values are those of the time-unlimited MDP.
- Replay: uniform (`DQN`) or proportional prioritized (`PER-DQN`: priorities (|δ| + ε)^α, importance-sampling
  weights with β annealed to 1, hsched.rl.buffers). The loss is the paper's MSE, weighted by the IS weights.
- Reward: `reward="latency"` by default (hsched.envs.path): −latency/ref per link, +1 on arrival, γ = 1.
  Its return-maximising path IS the lowest-latency path, whereas eq.11's optimum is not Dijkstra's for 2 of
  the 11 Abilene DCs (see hsched.envs.path), so an agent trained on eq.11 could at best serve 9 of 11.
  `reward="eq11"` (with γ < 1) remains available for the paper's comparison.
- Evaluation: every `eval_every` steps the greedy masked policy walks from every start to every target;
  a pair "matches" when the walk arrives over a simple path no longer than Dijkstra's (the selector's own
  acceptance test). `solved_at` is the first env step at which every pair matched.

Checkpoints (`args.out`, default models/per_dqn_path.pt) hold the nets, optimiser, replay buffer, RNG states,
the episode in progress and the curves, so `resume` continues exactly where it stopped: hyper-parameters
are in absolute steps (ε decay, β annealing), never relative to the budget, so training to N in one go and
training to N/2 then resuming to N give the same weights.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from hsched.costs.graph import WanGraph
from hsched.costs.paths import PathFinder
from hsched.costs.selection import no_longer
from hsched.domain.fleet import load_fleet
from hsched.envs.path import ENV_ID, PathEnv, PolicyPathFinder, _as_graph
from hsched.policies.learned import ModelMismatch  # also: trained on another WAN
from hsched.rl import checkpoint
from hsched.rl.buffers import Batch, PrioritizedReplayBuffer, ReplayBuffer
from hsched.rl.nets import HIDDEN, mlp
from hsched.rl.schedules import LinearSchedule, epsilon_greedy, hard_update
from hsched.rl.training import (
    TrainArgs,
    output_path,
    plot_curves,
    progress,
    restore_rng_state,
    rng_state,
    seed_everything,
)

MODEL_NAME = "per_dqn_path"


@dataclass(frozen=True)
class DqnConfig:
    """Hyper-parameters (all in env steps, independent of the budget, so a resumed run is the same run)."""

    prioritized: bool = True       # PER-DQN (True) or uniform-replay DQN
    double: bool = True            # Double-DQN target (online argmax, target value) or the max of the target
    graph: str | None = None       # a fleet YAML (its WAN) or a Topology Zoo GraphML; None: the default fleet
    targets: tuple[str, ...] | None = None  # None: the WAN's entry vertices (a GraphML: every vertex)
    reward: str = "latency"        # "latency" (return-optimal = Dijkstra, γ = 1) or "eq11" (paper, γ < 1)
    gamma: float = 1.0
    steps: int = 30_000            # default budget (TrainArgs.steps overrides)
    learning_starts: int = 1_000
    buffer_size: int = 10_000      # Abilene has ~500 distinct valid transitions; keeps the checkpoint ~1 MB
    batch_size: int = 128
    lr: float = 1e-3
    lr_end: float = 5e-5           # linear decay from lr to lr_end over lr_steps (precision for near-ties)
    lr_steps: int = 30_000
    train_every: int = 1
    gradient_steps: int = 1        # per training step
    target_every: int = 250        # hard target update period
    eps_start: float = 1.0
    eps_end: float = 0.05
    eps_steps: int = 10_000
    per_alpha: float = 0.6
    per_beta0: float = 0.4
    per_beta_steps: int = 30_000   # sample() calls until β = 1
    per_eps: float = 1e-3
    max_episode_steps: int | None = None  # None: PathEnv's 2 × vertex count
    eval_every: int = 500
    stop_after_solved: int = 0     # > 0: stop once this many evaluations in a row matched every pair

    @property
    def agent(self) -> str:
        return "per-dqn" if self.prioritized else "dqn"


# ------------------------------------------------------------------------------------------------------------
# the environment, the network, the greedy policy


def load_graph(source: str | None) -> WanGraph:
    if source is not None and Path(source).suffix in (".yaml", ".yml"):
        return WanGraph(load_fleet(source).wan)
    return _as_graph(source, None)


def make_env(config: DqnConfig, graph: WanGraph | None = None) -> PathEnv:
    graph = graph or load_graph(config.graph)
    targets = config.targets or (graph.wan.entry_vertices or graph.vertices)
    return PathEnv(graph, list(targets), max_steps=config.max_episode_steps, reward=config.reward,
                   gamma=config.gamma if config.reward == "eq11" else 0.99)


def q_network(n: int) -> nn.Sequential:
    return mlp(2 * n, n, HIDDEN)


def adjacency(graph: WanGraph) -> torch.Tensor:
    """[n, n] bool in `graph.vertices` order, row u = the vertices u links to: the action mask at u (the same
    mask PathEnv puts in info["action_mask"])."""
    index = {v: i for i, v in enumerate(graph.vertices)}
    adj = torch.zeros(len(index), len(index), dtype=torch.bool)
    for a, b in graph.graph.edges:
        adj[index[a], index[b]] = adj[index[b], index[a]] = True
    return adj


def masked(q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return q.masked_fill(~mask, -torch.inf)


def td_target(batch_rewards: torch.Tensor, dones: torch.Tensor, next_obs: torch.Tensor, q_net: nn.Module,
              target_net: nn.Module, adj: torch.Tensor, gamma: float, double: bool) -> torch.Tensor:
    """y = r + γ (1 − done) Q_target(s', a*) with a* masked to the neighbours of s' (see the module doc)."""
    n = adj.shape[0]
    next_mask = adj[next_obs[:, :n].argmax(dim=1)]
    with torch.no_grad():
        q_next = target_net(next_obs)
        if double:
            best = masked(q_net(next_obs), next_mask).argmax(dim=1, keepdim=True)
            value = q_next.gather(1, best).squeeze(1)
        else:
            value = masked(q_next, next_mask).max(dim=1).values
    return batch_rewards + gamma * (1.0 - dones) * value


def greedy_table(q_net: nn.Module, n: int, adj: torch.Tensor) -> np.ndarray:
    """table[t, u] = the greedy masked action at vertex u when the target is t (one batched forward)."""
    eye = torch.eye(n)
    obs = torch.cat([eye.repeat(n, 1), eye.repeat_interleave(n, dim=0)], dim=1)  # row t·n + u
    with torch.no_grad():
        q = masked(q_net(obs), adj.repeat(n, 1))
    return q.argmax(dim=1).reshape(n, n).numpy()


def walk(table: np.ndarray, start: int, target: int, max_steps: int) -> list[int] | None:
    """The greedy walk start → target (vertex indices), or None if it does not arrive within max_steps."""
    path = [start]
    while path[-1] != target:
        if len(path) > max_steps:
            return None
        path.append(int(table[target, path[-1]]))
    return path


def evaluate(table: np.ndarray, env: PathEnv) -> dict[str, Any]:
    """Greedy walks from every start to every target of `env`, against Dijkstra (see the module doc)."""
    graph, names = env.graph, env.vertices
    matched = total = 0
    misses: list[str] = []
    for t_name in env.targets:
        t = env.index[t_name]
        best = graph.dijkstra.paths_from(t_name)
        for u_name, opt_path in best.items():
            if u_name == t_name:
                continue
            total += 1
            path = walk(table, env.index[u_name], t, env.max_steps)
            vertices = [names[i] for i in path] if path else None
            opt = graph.path_metrics(opt_path).latency_ms
            if vertices and graph.is_valid_path(vertices, u_name, t_name) \
                    and no_longer(graph.path_metrics(vertices).latency_ms, opt):
                matched += 1
            elif len(misses) < 5:
                misses.append(f"{u_name}→{t_name}")
    return {"matched": matched, "pairs": total, "misses": misses}


# ------------------------------------------------------------------------------------------------------------
# training


class Trainer:
    """One training run; `state()` / `load()` are the resumable checkpoint."""

    def __init__(self, config: DqnConfig, seed: int, graph: WanGraph | None = None) -> None:
        self.config, self.seed = config, seed
        self.rng = seed_everything(seed)
        self.env = make_env(config, graph)
        n = self.n = self.env.n
        self.adj = adjacency(self.env.graph)
        self.q = q_network(n)
        self.target = q_network(n)
        self.target.load_state_dict(self.q.state_dict())
        self.optimizer = torch.optim.Adam(self.q.parameters(), lr=config.lr)
        kwargs = {"capacity": config.buffer_size, "obs_shape": 2 * n, "obs_dtype": np.uint8, "seed": self.rng}
        self.buffer: ReplayBuffer = (
            PrioritizedReplayBuffer(**kwargs, alpha=config.per_alpha, beta0=config.per_beta0,
                                    beta_steps=config.per_beta_steps, eps=config.per_eps)
            if config.prioritized else ReplayBuffer(**kwargs))
        self.epsilon = LinearSchedule(config.eps_start, config.eps_end, config.eps_steps)
        self.lr = LinearSchedule(config.lr, config.lr_end, config.lr_steps)
        self.step = 0
        self.obs, self.info = self.env.reset(seed=seed)
        self.episode_return = 0.0
        self.curve: dict[str, list[float]] = {"step": [], "return": []}  # one point per finished episode
        self.evals: list[tuple[int, int, int]] = []  # (step, matched, pairs)
        self.solved_at: int | None = None
        self.train_seconds = 0.0  # wall clock
        self.cpu_seconds = 0.0  # this process's CPU time: what the run costs on a shared machine

    # -- one env step + one gradient step ----------------------------------------------------------------

    def act(self) -> int:
        with torch.no_grad():
            q = self.q(torch.as_tensor(self.obs)).numpy()
        return epsilon_greedy(q, self.epsilon(self.step), self.rng, mask=self.info["action_mask"])

    def update(self, batch: Batch) -> np.ndarray:
        obs = torch.as_tensor(batch.obs, dtype=torch.float32)
        next_obs = torch.as_tensor(batch.next_obs, dtype=torch.float32)
        y = td_target(torch.as_tensor(batch.rewards), torch.as_tensor(batch.dones), next_obs, self.q, self.target,
                      self.adj, self.config.gamma, self.config.double)
        q = self.q(obs).gather(1, torch.as_tensor(batch.actions).unsqueeze(1)).squeeze(1)
        td = y - q
        loss = (torch.as_tensor(batch.weights) * td.pow(2)).mean()  # IS-weighted MSE (weights 1 if uniform)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return td.detach().numpy()

    def train_step(self) -> None:
        c = self.config
        action = self.act()
        next_obs, reward, terminated, truncated, info = self.env.step(action)
        self.buffer.add(self.obs, action, reward, next_obs, terminated)  # truncation bootstraps
        self.episode_return += reward
        self.step += 1
        if terminated or truncated:
            self.curve["step"].append(self.step)
            self.curve["return"].append(self.episode_return)
            self.episode_return = 0.0
            self.obs, self.info = self.env.reset()
        else:
            self.obs, self.info = next_obs, info
        if self.step >= c.learning_starts and self.step % c.train_every == 0:
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr(self.step)
            for _ in range(c.gradient_steps):
                batch = self.buffer.sample(c.batch_size)
                td = self.update(batch)
                if isinstance(self.buffer, PrioritizedReplayBuffer):
                    self.buffer.update_priorities(batch.indices, td)
        if self.step % c.target_every == 0:
            with torch.no_grad():
                hard_update(self.target.state_dict(), self.q.state_dict())
        if self.step % c.eval_every == 0:
            self.evaluate()

    def evaluate(self, record: bool = True) -> dict[str, Any]:
        """Greedy paths vs Dijkstra now; `record` (the periodic checks) adds it to the run's history."""
        result = evaluate(greedy_table(self.q, self.n, self.adj), self.env)
        if record:
            self.evals.append((self.step, result["matched"], result["pairs"]))
            if self.solved_at is None and result["matched"] == result["pairs"]:
                self.solved_at = self.step
        return result

    def solved_streak(self) -> int:
        streak = 0
        for _, matched, pairs in reversed(self.evals):
            if matched != pairs:
                break
            streak += 1
        return streak

    def run(self, until: int, show: bool = True, label: str = "") -> None:
        c = self.config
        t0, cpu0 = time.perf_counter(), time.process_time()
        with progress(label or f"train {c.agent} paths", until, show) as advance:
            shown = self.step
            advance(shown)
            while self.step < until:
                self.train_step()
                if self.step % c.eval_every == 0:
                    _, matched, pairs = self.evals[-1]
                    advance(self.step - shown, eps=self.epsilon(self.step), dijkstra=f"{matched}/{pairs}")
                    shown = self.step
                    if c.stop_after_solved and self.solved_streak() >= c.stop_after_solved:
                        break
            advance(self.step - shown)
        self.train_seconds += time.perf_counter() - t0
        self.cpu_seconds += time.process_time() - cpu0

    # -- checkpoint --------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        buf = self.buffer
        buffer = {k: v for k, v in vars(buf).items() if k not in ("rng", "tree")}
        if isinstance(buf, PrioritizedReplayBuffer):
            buffer["tree"] = buf.tree.tree
        return {"q": self.q.state_dict(), "target": self.target.state_dict(),
                "optimizer": self.optimizer.state_dict(), "buffer": buffer, "rng": rng_state(self.rng),
                "env": self.env.get_state(), "step": self.step, "episode_return": self.episode_return,
                "curve": self.curve, "evals": self.evals, "solved_at": self.solved_at,
                "train_seconds": self.train_seconds, "cpu_seconds": self.cpu_seconds}

    def load(self, state: dict[str, Any]) -> None:
        self.q.load_state_dict(state["q"])
        self.target.load_state_dict(state["target"])
        self.optimizer.load_state_dict(state["optimizer"])
        for k, v in state["buffer"].items():
            if k == "tree":
                self.buffer.tree.tree[:] = v
            else:
                setattr(self.buffer, k, v)
        restore_rng_state(self.rng, state["rng"])
        self.obs, self.info = self.env.set_state(state["env"])
        self.step, self.episode_return = state["step"], state["episode_return"]
        self.curve, self.evals = state["curve"], [tuple(e) for e in state["evals"]]
        self.solved_at, self.train_seconds = state["solved_at"], state["train_seconds"]
        self.cpu_seconds = state["cpu_seconds"]

    def metadata(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        env, final = self.env, self.evaluate(record=False)
        return {
            "agent": self.config.agent, "env": ENV_ID, "seed": self.seed,
            "graph": {"source": env.graph.wan.source or "inline", "vertices": list(env.vertices),
                      "targets": list(env.targets)},
            "reward": {"kind": env.reward, "goal_reward": env.goal_reward, "latency_ref_ms": env.latency_ref_ms,
                       "invalid_reward": env.invalid_reward},
            "hyperparameters": asdict(self.config) | {"hidden": list(HIDDEN)},
            "input_shape": [2 * self.n], "output_shape": [self.n],
            "evaluation": {"steps": self.step, "paths_equal_dijkstra": final["matched"], "pairs": final["pairs"],
                           "summary": f"{final['matched']} of {final['pairs']} (start, target) greedy paths "
                                      "are as short as Dijkstra's",
                           "solved_at_step": self.solved_at, "train_seconds": round(self.train_seconds, 1),
                           "train_cpu_seconds": round(self.cpu_seconds, 1)},
            **(extra or {}),
        }


def train(config: DqnConfig, args: TrainArgs) -> dict[str, Any]:
    """Train (or resume) `config` to `args.steps`, save it at `args.out`, plot its curve; with
    `args.compare`, also train the other replay kind with the same seed and budget and plot both."""
    out = output_path(args, MODEL_NAME if config.prioritized else "dqn_path")
    steps = args.steps or config.steps
    trainer = Trainer(config, args.seed)
    if args.resume and out.exists():
        trainer.load(checkpoint.load_state(out))
    trainer.run(steps, args.progress)
    state = trainer.state()  # before a comparison run reseeds the global RNGs
    runs = {config.agent: trainer}
    if args.compare:
        other = replace(config, prioritized=not config.prioritized)
        runs[other.agent] = Trainer(other, args.seed)
        runs[other.agent].run(steps, args.progress)
    env = trainer.env
    pairs = trainer.evals[-1][2] if trainer.evals else 0
    about = f"{env.n} vertices, {pairs} pairs, seed {args.seed}"
    curve = plot_curves(out.with_name(out.stem + "_curve.png"),
                        {name.upper(): (t.curve["step"], t.curve["return"]) for name, t in runs.items()},
                        title=f"Return per episode, {env.reward} reward ({about})", xlabel="environment steps",
                        ylabel="episode return", window=200)
    match = plot_curves(out.with_name(out.stem + "_dijkstra.png"),
                        {name.upper(): ([e[0] for e in t.evals], [100 * e[1] / e[2] for e in t.evals])
                         for name, t in runs.items()},
                        title=f"Greedy paths as short as Dijkstra's ({about})", xlabel="environment steps",
                        ylabel="(start, target) pairs (%)", window=1)
    figures = {name: t.metadata()["evaluation"] for name, t in runs.items()}
    checkpoint.save(out, state, trainer.metadata({"curve_png": curve.name, "dijkstra_png": match.name,
                                                  "comparison": figures if args.compare else None}))
    return {"model": str(out), "curve": str(curve), "dijkstra_curve": str(match), **figures}


def _on_data(config: DqnConfig, args: TrainArgs) -> DqnConfig:
    """`hsched train --fleet F`: the path agent learns F's WAN (a trace does not apply: it routes, no tasks)."""
    if args.trace:
        from hsched.domain.errors import ValidationError

        raise ValidationError("--trace", "does not apply to a path agent (it learns the --fleet's WAN, no tasks)")
    return replace(config, graph=str(args.fleet)) if args.fleet else config


def train_dqn(args: TrainArgs) -> dict[str, Any]:
    return train(_on_data(DqnConfig(prioritized=False), args), args)


def train_per_dqn(args: TrainArgs) -> dict[str, Any]:
    return train(_on_data(DqnConfig(prioritized=True), args), args)


# ------------------------------------------------------------------------------------------------------------
# serving


def load_path_finder(path: str | Path, graph: WanGraph, name: str = "per-dqn") -> PathFinder:
    """The agent at `path` as a PathFinder on `graph`: greedy masked walks (DC → entry vertex, reversed).

    The greedy action of every (vertex, target) pair comes from one batched forward pass at load time, so a
    path is table lookups. Raises FileNotFoundError without a model, ModelMismatch if it was trained on
    another vertex set. The walk follows the weights learned on the trained latencies: after a link update
    it may no longer be the shortest, which the selector's check against Dijkstra catches.
    """
    path = checkpoint.model_path(str(path))
    if not path.exists():
        raise FileNotFoundError(f"no model at {path}")
    meta = checkpoint.load_metadata(path)
    trained: Sequence[str] = meta["graph"]["vertices"]
    if list(trained) != list(graph.vertices):
        raise ModelMismatch(f"{path.name} was trained on {len(trained)} vertices "
                            f"({meta['graph']['source']}), the WAN has {len(graph.vertices)} different ones")
    n = len(trained)
    q = q_network(n)
    q.load_state_dict(checkpoint.load_state(path)["q"])
    table = greedy_table(q.eval(), n, adjacency(graph))

    def policy(obs: np.ndarray, info: dict[str, Any]) -> int:
        return int(table[int(np.argmax(obs[n:])), int(np.argmax(obs[:n]))])

    return PolicyPathFinder(graph, policy, name=name)
