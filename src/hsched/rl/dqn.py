"""DQN and PER-DQN path agents (paper 003 §2.1) that run on any WAN, plus their serving.

The MDP is `hsched/Path-v0` (hsched.envs.path, latency reward: −w/scale per link, +1 on arrival, γ = 1, so
the return-optimal walk is the lowest-latency path). What changed from a one-hot agent is what the network
sees and what it outputs, so that one set of weights serves every graph:

- Observation: graph-relative features (hsched.envs.path_features): per directed link its latency, per
  vertex its great-circle distance to the target and whether it is the target, degree and link latencies,
  all in units of the graph's median link latency. No shortest-path distance is an input.
- Action: a choice among the current vertex's neighbours (the graph's links out of u; a move along a
  missing link cannot be expressed, so it is never taken and never trained).
- Network (`PathGnn`, plain torch): a node encoder, K rounds of message passing over the graph's links
  (messages carry the link latency; each vertex aggregates max and mean over its neighbours; the same
  weights every round) and a head giving a learned cost-to-go correction f(v | t) per vertex. Because the
  env's reward for the move u → v is known (−w(u, v), +1 when v is the target), Q is structured as
  "reward of the move + value of where it lands":

      Q(u → v | t) = 1 − w(u, v) − [v ≠ t] · (geo(v, t) + f(v | t))

  with geo the haversine lower bound. f is what is learned: how much longer than the straight line the way
  from v to t is. Everything the Q-value depends on is per-graph relative, so the weights are graph-free.
- Learner (unchanged, paper 003's): Q-learning with a target network (hard updates), Double-DQN targets
  over the neighbours of the next vertex, and proportional prioritized replay (`PER-DQN`, priorities
  (|δ| + ε)^α, IS weights annealed to 1; hsched.rl.buffers) or uniform replay (`DQN`). A transition is
  stored as integers (graph, target, u → v), the features are rebuilt from the graph at update time.
- Training distribution: the Topology Zoo graphs in data/ listed in `TRAIN_GRAPHS` plus the default
  fleet's WAN, episodes drawing a graph (small graphs only during the first `curriculum_steps`, then
  weighted by vertex count) and a (start, target) pair uniformly over all ordered pairs. The graphs of
  `HELD_OUT_GRAPHS` are never trained on: they are the evaluation (bench/path_agents.py).
- Evaluation: deterministic greedy walks from every start to every target with a 2n step cap and loop
  detection; a pair "matches" when the walk arrives over a simple path no longer than Dijkstra's (the
  selector's own acceptance test), "invalid" when it loops or never arrives.

Checkpoints (`args.out`, default a run directory) hold the nets, optimiser, replay buffer, RNG states and
the episode in progress, so `resume` continues where it stopped. A model file of the old one-hot format is
refused with a ModelMismatch that says to retrain.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from hsched.costs.graph import WanGraph
from hsched.costs.paths import PathFinder
from hsched.costs.selection import no_longer
from hsched.domain.fleet import load_fleet
from hsched.envs.path import ENV_ID, PathEnv, PolicyPathFinder
from hsched.envs.path_features import EDGE_FEATURES, NODE_FEATURES, GraphFeatures
from hsched.policies.learned import ModelMismatch  # also: a model of the old one-hot format
from hsched.rl import checkpoint
from hsched.rl.buffers import Batch, PrioritizedReplayBuffer, ReplayBuffer
from hsched.rl.schedules import LinearSchedule, hard_update
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
ARCHITECTURE = "graph-relative-gnn-v1"  # the json's "architecture": what load_path_finder accepts
DEFAULT_FLEET = "fleet:default"  # the default fleet's WAN (Abilene + the scheduler vertex)
# Topology Zoo graphs (data/topology_zoo/graphml/<name>.graphml) trained on / reserved for evaluation.
# Held out: Uninett (the largest graph available here, 71 linked PoPs), GÉANT 2012 (multi-country), and the two
# Chinese networks (another continent; Cernet has duplicate city names and parallel links).
TRAIN_GRAPHS: tuple[str, ...] = (DEFAULT_FLEET, "Abilene", "Sprint", "Aarnet", "AttMpls", "BackboneSerbiaMontenegro",
                                 "Hibernia", "Garr200004", "Renater2010")
HELD_OUT_GRAPHS: tuple[str, ...] = ("Uninett", "Geant2012", "Cernet", "Chinanet")


@dataclass(frozen=True)
class DqnConfig:
    """Hyper-parameters (all in env steps, independent of the budget, so a resumed run is the same run)."""

    prioritized: bool = True       # PER-DQN (True) or uniform-replay DQN
    double: bool = True            # Double-DQN target (online argmin, target value) or the target's own
    graphs: tuple[str, ...] = TRAIN_GRAPHS  # Zoo names, GraphML / fleet YAML paths, or DEFAULT_FLEET
    steps: int = 30_000            # default budget (TrainArgs.steps overrides)
    hidden: int = 32
    rounds: int = 8                # message-passing rounds K
    learning_starts: int = 500
    buffer_size: int = 50_000
    batch_size: int = 64
    lr: float = 2e-3
    lr_end: float = 2e-4
    lr_steps: int = 30_000
    train_every: int = 1
    target_every: int = 250
    eps_start: float = 1.0
    eps_end: float = 0.05
    eps_steps: int = 8_000
    per_alpha: float = 0.6
    per_beta0: float = 0.4
    per_beta_steps: int = 30_000
    per_eps: float = 1e-3
    curriculum_steps: int = 4_000  # only graphs of <= curriculum_vertices vertices before this step
    curriculum_vertices: int = 20
    her_targets: int = 3           # extra copies of each move relabelled with random targets (hindsight)
    eval_every: int = 2_000
    stop_after_solved: int = 0     # > 0: stop once this many evaluations in a row matched every pair

    @property
    def agent(self) -> str:
        return "per-dqn" if self.prioritized else "dqn"


# ------------------------------------------------------------------------------------------------------------
# graphs


def zoo_path(name: str) -> Path:
    from hsched.traces import data_dir

    return data_dir() / "topology_zoo" / "graphml" / f"{name}.graphml"


def load_graph(source: str | None) -> WanGraph:
    """A WanGraph from DEFAULT_FLEET/None (the default fleet), a fleet YAML, a GraphML path or a Zoo name."""
    if source is None or source == DEFAULT_FLEET:
        return WanGraph(load_fleet().wan)
    if Path(source).suffix in (".yaml", ".yml"):
        return WanGraph(load_fleet(source).wan)
    if not Path(source).suffix and not Path(source).exists():
        source = str(zoo_path(source))
    from hsched.domain.fleet import Wan
    from hsched.traces.topology_zoo import largest_component, load_graphml

    vertices, links, label = load_graphml(source)
    vertices, links, dropped = largest_component(vertices, links)
    if len(vertices) < 2:
        from hsched.domain.errors import ValidationError

        raise ValidationError("graph", "needs at least two linked vertices with coordinates", source)
    return WanGraph(Wan(vertices=vertices, links=tuple(links), scheduler_vertex=next(iter(vertices)),
                        entry_vertices=tuple(vertices), source=label, pruned=dropped))


def constructed_graph(names: Sequence[str] = HELD_OUT_GRAPHS, bridges: int = 2) -> WanGraph:
    """The CONSTRUCTED large held-out WAN: the given Zoo graphs (largest parts) chained by their nearest PoPs
    (hsched.traces.topology_zoo.join_graphs). No Zoo graph of >= 150 vertices is available here."""
    from hsched.domain.fleet import Wan
    from hsched.traces.topology_zoo import join_graphs

    parts = []
    for name in names:
        g = load_graph(name)
        parts.append((name, dict(g.wan.vertices), list(g.wan.links)))
    vertices, links = join_graphs(parts, bridges)
    return WanGraph(Wan(vertices=vertices, links=tuple(links), scheduler_vertex=next(iter(vertices)),
                        entry_vertices=tuple(vertices),
                        source=f"constructed: {' + '.join(names)} joined by {bridges} nearest-PoP links each"))


def graph_label(graph: WanGraph) -> str:
    return graph.wan.source or "inline WAN"


# ------------------------------------------------------------------------------------------------------------
# the network


class PathGnn(nn.Module):
    """Per-vertex cost-to-go correction f(v | t) by K rounds of message passing (see the module doc)."""

    def __init__(self, hidden: int = 32, rounds: int = 8) -> None:
        super().__init__()
        self.hidden, self.rounds = hidden, rounds
        self.encode = nn.Sequential(nn.Linear(NODE_FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, hidden))
        self.msg_self = nn.Linear(hidden, hidden)
        self.msg_other = nn.Linear(hidden, hidden, bias=False)
        self.msg_edge = nn.Linear(EDGE_FEATURES, hidden, bias=False)
        self.update = nn.Sequential(nn.Linear(3 * hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden))
        self.head = nn.Sequential(nn.Linear(hidden + NODE_FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        nn.init.zeros_(self.head[-1].weight)  # start at f = 0: the straight-line estimate
        nn.init.zeros_(self.head[-1].bias)

    def forward(self, g: GraphBatch) -> torch.Tensor:
        """f per vertex of the batch [N] (0 at the targets)."""
        h = self.encode(g.node_x)
        n = h.shape[0]
        degree = torch.zeros(n).index_add_(0, g.src, torch.ones(len(g.src))).clamp(min=1).unsqueeze(1)
        edge = self.msg_edge(g.edge_x)
        index = g.src.unsqueeze(1).expand(-1, self.hidden)
        for _ in range(self.rounds):
            # vertex a hears from each neighbour b over the link a → b: cost-to-go flows back along links
            m = torch.relu(self.msg_self(h)[g.src] + self.msg_other(h)[g.dst] + edge)
            agg_max = torch.zeros(n, self.hidden).scatter_reduce(0, index, m, "amax", include_self=False)
            agg_mean = torch.zeros(n, self.hidden).index_add_(0, g.src, m) / degree
            h = h + self.update(torch.cat([h, agg_max, agg_mean], dim=1))
        f = self.head(torch.cat([h, g.node_x], dim=1)).squeeze(1)
        return f * (1.0 - g.is_target)


@dataclass
class GraphBatch:
    """The disjoint union of several (graph, target) instances, ready for `PathGnn`."""

    node_x: torch.Tensor    # [N, NODE_FEATURES]
    edge_x: torch.Tensor    # [E, EDGE_FEATURES]
    src: torch.Tensor       # [E] int64, global vertex ids
    dst: torch.Tensor
    is_target: torch.Tensor  # [N] float
    geo: torch.Tensor       # [N] geo-to-target of each vertex (graph units)
    w: torch.Tensor         # [E] link latency (graph units)
    offsets: list[int] = field(default_factory=list)  # first global id of each instance

    def cost_to_go(self, f: torch.Tensor) -> torch.Tensor:
        """[E] the cost of taking link a → b and then b's estimated way to the target: w + geo(b) + f(b)."""
        return self.w + self.geo[self.dst] + f[self.dst]


class FeatureCache:
    """Torch tensors of every (graph, target) instance, built once: batches are then concatenations."""

    def __init__(self, features: Sequence[GraphFeatures]) -> None:
        self.features = list(features)
        self._cache: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    def instance(self, g: int, t: int) -> tuple[torch.Tensor, ...]:
        key = (g, t)
        got = self._cache.get(key)
        if got is None:
            feats = self.features[g]
            node_x = torch.from_numpy(feats.node_features(t))
            got = self._cache[key] = (node_x, torch.from_numpy(feats.edge_features(t)),
                                      torch.from_numpy(feats.src), torch.from_numpy(feats.dst),
                                      node_x[:, 1].clone(), node_x[:, 0].clone(), torch.from_numpy(feats.w))
        return got

    def batch(self, instances: Sequence[tuple[int, int]]) -> GraphBatch:
        parts = [self.instance(g, t) for g, t in instances]
        offsets, total = [], 0
        for (g, _t) in instances:
            offsets.append(total)
            total += self.features[g].n
        shift = [torch.full_like(p[2], o) for p, o in zip(parts, offsets, strict=True)]
        return GraphBatch(
            node_x=torch.cat([p[0] for p in parts]), edge_x=torch.cat([p[1] for p in parts]),
            src=torch.cat([p[2] + s for p, s in zip(parts, shift, strict=True)]),
            dst=torch.cat([p[3] + s for p, s in zip(parts, shift, strict=True)]),
            is_target=torch.cat([p[4] for p in parts]), geo=torch.cat([p[5] for p in parts]),
            w=torch.cat([p[6] for p in parts]), offsets=offsets)

    def clear(self) -> None:
        self._cache.clear()


def node_min(values: torch.Tensor, src: torch.Tensor, n: int) -> torch.Tensor:
    """[n] min over the links leaving each vertex (inf for a vertex without links)."""
    return torch.full((n,), torch.inf).scatter_reduce(0, src, values, "amin", include_self=False)


def greedy_tables(net: PathGnn, cache: FeatureCache, g: int, targets: Sequence[int]) -> np.ndarray:
    """table[i, u] = the greedy next vertex at u when the target is targets[i]: the argmin of the estimated
    cost-to-go over u's links (batched forwards). -1 for a vertex without links."""
    feats = cache.features[g]
    n = feats.n
    table = np.full((len(targets), n), -1, dtype=np.int64)
    chunk = max(1, 20_000 // max(n, 1))  # bounded union size
    with torch.no_grad():
        for lo in range(0, len(targets), chunk):
            part = list(targets[lo:lo + chunk])
            batch = cache.batch([(g, t) for t in part])
            cost = batch.cost_to_go(net(batch)).numpy()
            src = batch.src.numpy()
            order = np.lexsort((cost, src))  # by vertex, cheapest link first
            first = order[np.r_[True, src[order][1:] != src[order][:-1]]]
            rows = src[first]
            table[lo + rows // n, rows % n] = batch.dst.numpy()[first] % n
    return table


# ------------------------------------------------------------------------------------------------------------
# evaluation: the agent's own greedy walks against Dijkstra


def walk(table_row: np.ndarray, start: int, target: int, max_steps: int) -> list[int] | None:
    """The deterministic greedy walk start → target, or None if it loops (a revisit repeats forever) or has
    not arrived within max_steps."""
    path, seen = [start], {start}
    while path[-1] != target:
        nxt = int(table_row[path[-1]])
        if nxt < 0 or nxt in seen or len(path) > max_steps:
            return None
        path.append(nxt)
        seen.add(nxt)
    return path


def evaluate_graph(net: PathGnn, graph: WanGraph, targets: Sequence[str] | None = None,
                   starts: Sequence[str] | None = None) -> dict[str, Any]:
    """Greedy walks (no guard) from every start to every target (default: all ordered pairs) vs Dijkstra:
    `equal` (arrives, simple, no longer than Dijkstra's), `invalid` (loops / never arrives), and the
    latency gap of the arriving walks (sum over pairs, vs Dijkstra's)."""
    feats = GraphFeatures(graph)
    cache = FeatureCache([feats])
    names = feats.vertices
    target_ids = [feats.index[t] for t in (targets or names)]
    table = greedy_tables(net, cache, 0, target_ids)
    pairs = equal = invalid = 0
    agent_ms = best_ms = 0.0
    misses: list[str] = []
    for i, t in enumerate(target_ids):
        best = graph.dijkstra.paths_from(names[t])
        for u_name in (starts or names):
            u = feats.index[u_name]
            if u == t or u_name not in best:
                continue
            pairs += 1
            opt = graph.path_metrics(best[u_name]).latency_ms
            path = walk(table[i], u, t, 2 * feats.n)
            if path is None:
                invalid += 1
                if len(misses) < 5:
                    misses.append(f"{u_name}→{names[t]} (loop)")
                continue
            got = graph.path_metrics([names[v] for v in path]).latency_ms
            agent_ms += got
            best_ms += opt
            if no_longer(got, opt):
                equal += 1
            elif len(misses) < 5:
                misses.append(f"{u_name}→{names[t]} (+{got - opt:.2f} ms)")
    return {"pairs": pairs, "matched": equal, "invalid": invalid,
            "latency_gap_percent": round(100 * (agent_ms / best_ms - 1), 3) if best_ms else 0.0,
            "misses": misses}


def held_out_evaluation(net: PathGnn) -> dict[str, Any]:
    """`evaluate_graph` (own greedy paths, all ordered pairs, no guard) on every graph of HELD_OUT_GRAPHS and
    on the constructed large graph: what the model json reports."""
    graphs = [(name, load_graph(name)) for name in HELD_OUT_GRAPHS] + [("constructed", constructed_graph())]
    out = {}
    for name, graph in graphs:
        r = evaluate_graph(net, graph)
        out[name] = {"source": graph_label(graph), "vertices": len(graph.vertices), "pairs": r["pairs"],
                     "paths_equal_dijkstra": r["matched"], "invalid_paths": r["invalid"],
                     "equal_percent": round(100 * r["matched"] / r["pairs"], 2),
                     "invalid_percent": round(100 * r["invalid"] / r["pairs"], 2),
                     "latency_excess_percent": r["latency_gap_percent"]}
    return out


# ------------------------------------------------------------------------------------------------------------
# training


class Trainer:
    """One training run over a distribution of graphs; `state()` / `load()` are the resumable checkpoint."""

    def __init__(self, config: DqnConfig, seed: int, graphs: Sequence[WanGraph] | None = None) -> None:
        self.config, self.seed = config, seed
        self.rng = seed_everything(seed)
        self.graphs = list(graphs) if graphs is not None else [load_graph(s) for s in config.graphs]
        self.features = [GraphFeatures(g) for g in self.graphs]
        self.cache = FeatureCache(self.features)
        self.envs = [PathEnv(g, list(g.vertices), reward="latency", latency_ref_ms=f.scale_ms, goal_reward=1.0)
                     for g, f in zip(self.graphs, self.features, strict=True)]
        for i, env in enumerate(self.envs):
            env.reset(seed=seed + i)
        sizes = np.array([f.n for f in self.features], dtype=float)
        self.weights_all = sizes / sizes.sum()
        small = np.where(sizes <= config.curriculum_vertices, sizes, 0.0)
        self.weights_small = small / small.sum() if small.sum() else self.weights_all
        # dense link latencies per graph (graph units) to rebuild Q(u → v) of a stored transition
        self.link_w = []
        for f in self.features:
            m = np.zeros((f.n, f.n), dtype=np.float32)
            m[f.src, f.dst] = f.w
            self.link_w.append(torch.from_numpy(m))
        self.q = PathGnn(config.hidden, config.rounds)
        self.target = PathGnn(config.hidden, config.rounds)
        self.target.load_state_dict(self.q.state_dict())
        self.optimizer = torch.optim.Adam(self.q.parameters(), lr=config.lr)
        kwargs = {"capacity": config.buffer_size, "obs_shape": 3, "obs_dtype": np.int32, "seed": self.rng}
        self.buffer: ReplayBuffer = (
            PrioritizedReplayBuffer(**kwargs, alpha=config.per_alpha, beta0=config.per_beta0,
                                    beta_steps=config.per_beta_steps, eps=config.per_eps)
            if config.prioritized else ReplayBuffer(**kwargs))
        self.epsilon = LinearSchedule(config.eps_start, config.eps_end, config.eps_steps)
        self.lr = LinearSchedule(config.lr, config.lr_end, config.lr_steps)
        self.step = 0
        self.episode_return = 0.0
        self.curve: dict[str, list[float]] = {"step": [], "return": []}
        self.evals: list[tuple[int, int, int]] = []  # (step, matched, pairs) on the training graphs
        self.solved_at: int | None = None
        self.train_seconds = 0.0
        self.cpu_seconds = 0.0
        self._new_episode()

    # -- acting ---------------------------------------------------------------------------------------------

    def _new_episode(self) -> None:
        weights = self.weights_small if self.step < self.config.curriculum_steps else self.weights_all
        self.g = int(self.rng.choice(len(self.graphs), p=weights))
        env = self.envs[self.g]
        env.reset()
        self.u, self.t = env.index[env.current], env.index[env.target]
        self._cost: np.ndarray | None = None  # this episode's cost-to-go per link, for acting

    def act(self) -> int:
        feats = self.features[self.g]
        neighbours = feats.neighbours(self.u)
        if self.rng.random() < self.epsilon(self.step):
            return int(neighbours[self.rng.integers(len(neighbours))])
        if self._cost is None:  # once per episode: the weights move little within one
            with torch.no_grad():
                batch = self.cache.batch([(self.g, self.t)])
                self._cost = batch.cost_to_go(self.q(batch)).numpy()
        lo, hi = feats.ptr[self.u], feats.ptr[self.u + 1]
        return int(neighbours[int(np.argmin(self._cost[lo:hi]))])

    # -- learning -------------------------------------------------------------------------------------------

    def td(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(Q(u → v) of the online net [B], target y [B]) for a batch of stored transitions."""
        obs = batch.obs.astype(np.int64)
        keys = list(dict.fromkeys(zip(obs[:, 0].tolist(), obs[:, 1].tolist(), strict=True)))
        slot = {k: i for i, k in enumerate(keys)}
        union = self.cache.batch(keys)
        base = torch.tensor([union.offsets[slot[(int(g), int(t))]] for g, t, _ in obs])
        v = base + torch.as_tensor(batch.actions)
        w = torch.stack([self.link_w[int(g)][int(u), int(a)] for (g, _t, u), a in zip(obs, batch.actions,
                                                                                         strict=True)])
        f = self.q(union)
        q = 1.0 - w - (1.0 - union.is_target[v]) * (union.geo[v] + f[v])
        n = len(union.node_x)
        with torch.no_grad():
            target_cost = union.cost_to_go(self.target(union))
            if self.config.double:
                online_cost = union.cost_to_go(f.detach())
                best = node_min(online_cost, union.src, n)
                chosen = torch.where(online_cost <= best[union.src] + 1e-7, target_cost,
                                     torch.full_like(target_cost, torch.inf))
                next_cost = node_min(chosen, union.src, n)
            else:
                next_cost = node_min(target_cost, union.src, n)
            dones = torch.as_tensor(batch.dones)
            value = torch.where(dones > 0, torch.zeros_like(dones), 1.0 - next_cost[v])
            y = torch.as_tensor(batch.rewards) + value
        return q, y

    def update(self, batch: Batch) -> np.ndarray:
        q, y = self.td(batch)
        td = y - q
        loss = (torch.as_tensor(batch.weights) * td.pow(2)).mean()  # IS-weighted MSE (weights 1 if uniform)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return td.detach().numpy()

    def train_step(self) -> None:
        c = self.config
        action = self.act()
        env = self.envs[self.g]
        _, reward, terminated, truncated, _ = env.step(action)
        self.buffer.add(np.array([self.g, self.t, self.u], dtype=np.int32), action, reward,
                        np.array([self.g, self.t, action], dtype=np.int32), terminated)  # truncation bootstraps
        # Hindsight relabelling: the same move is a transition of the same MDP for any other target (reward
        # −w, +1 if it arrives there), so it also teaches the way to targets this episode is not heading to.
        w = float(self.link_w[self.g][self.u, action])
        n = self.features[self.g].n
        for t in self.rng.integers(n, size=self.config.her_targets):
            t = int(t)
            if t == self.u:
                continue
            arrived = t == action
            self.buffer.add(np.array([self.g, t, self.u], dtype=np.int32), action, -w + float(arrived),
                            np.array([self.g, t, action], dtype=np.int32), arrived)
        self.episode_return += reward
        self.u = action
        self.step += 1
        if terminated or truncated:
            self.curve["step"].append(self.step)
            self.curve["return"].append(self.episode_return)
            self.episode_return = 0.0
            self._new_episode()
        if self.step >= c.learning_starts and self.step % c.train_every == 0:
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr(self.step)
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
        """Greedy walks over all ordered pairs of every training graph vs Dijkstra (summed)."""
        total = {"pairs": 0, "matched": 0, "invalid": 0}
        for graph in self.graphs:
            r = evaluate_graph(self.q, graph)
            for k in total:
                total[k] += r[k]
        if record:
            self.evals.append((self.step, total["matched"], total["pairs"]))
            if self.solved_at is None and total["matched"] == total["pairs"]:
                self.solved_at = self.step
        return total

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

    # -- checkpoint -----------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        buf = self.buffer
        buffer = {k: v for k, v in vars(buf).items() if k not in ("rng", "tree")}
        if isinstance(buf, PrioritizedReplayBuffer):
            buffer["tree"] = buf.tree.tree
        return {"q": self.q.state_dict(), "target": self.target.state_dict(),
                "optimizer": self.optimizer.state_dict(), "buffer": buffer, "rng": rng_state(self.rng),
                "envs": [e.get_state() for e in self.envs], "episode": (self.g, self.u, self.t),
                "step": self.step, "episode_return": self.episode_return, "curve": self.curve,
                "evals": self.evals, "solved_at": self.solved_at, "train_seconds": self.train_seconds,
                "cpu_seconds": self.cpu_seconds}

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
        for env, s in zip(self.envs, state["envs"], strict=True):
            env.set_state(s)
        self.g, self.u, self.t = state["episode"]
        self._cost = None
        self.step, self.episode_return = state["step"], state["episode_return"]
        self.curve, self.evals = state["curve"], [tuple(e) for e in state["evals"]]
        self.solved_at, self.train_seconds = state["solved_at"], state["train_seconds"]
        self.cpu_seconds = state["cpu_seconds"]

    def metadata(self, extra: dict[str, Any] | None = None, held_out: bool = False) -> dict[str, Any]:
        """The model json; `held_out` adds the held-out graphs' figures (when trained on TRAIN_GRAPHS)."""
        final = self.evaluate(record=False)
        return {
            "agent": self.config.agent, "env": ENV_ID, "seed": self.seed, "architecture": ARCHITECTURE,
            "training_graphs": [{"source": graph_label(g), "vertices": f.n, "links": f.edges // 2}
                                for g, f in zip(self.graphs, self.features, strict=True)],
            "held_out_graphs": [g for g in HELD_OUT_GRAPHS if g not in self.config.graphs],
            "reward": {"kind": "latency", "goal_reward": 1.0, "latency_ref": "the graph's median link latency",
                       "gamma": 1.0},
            "hyperparameters": asdict(self.config),
            "input": {"node_features": NODE_FEATURES, "edge_features": EDGE_FEATURES,
                      "note": "graph-relative; any vertex count"},
            "evaluation": {"steps": self.step, "paths_equal_dijkstra": final["matched"], "pairs": final["pairs"],
                           "invalid_paths": final["invalid"],
                           "summary": f"{final['matched']} of {final['pairs']} (start, target) greedy paths on "
                                      "the training graphs are as short as Dijkstra's",
                           "solved_at_step": self.solved_at, "train_seconds": round(self.train_seconds, 1),
                           "train_cpu_seconds": round(self.cpu_seconds, 1)},
            "held_out_evaluation": (held_out_evaluation(self.q)
                                    if held_out and set(self.config.graphs) == set(TRAIN_GRAPHS) else None),
            **(extra or {}),
        }


def train(config: DqnConfig, args: TrainArgs) -> dict[str, Any]:
    """Train (or resume) `config` to `args.steps`, save it at `args.out`, plot its curve; with
    `args.compare`, also train the other replay kind with the same seed and budget and plot both."""
    torch.set_num_threads(1)
    out = output_path(args, MODEL_NAME if config.prioritized else "dqn_path")
    steps = args.steps or config.steps
    trainer = Trainer(config, args.seed)
    if args.resume and out.exists():
        if checkpoint.load_metadata(out).get("architecture") != ARCHITECTURE:
            from hsched.domain.errors import ValidationError

            raise ValidationError("--resume", f"{out} is a path model of the old one-hot format; train a new one "
                                  "without --resume", str(out))
        trainer.load(checkpoint.load_state(out))
    trainer.run(steps, args.progress)
    state = trainer.state()  # before a comparison run reseeds the global RNGs
    runs = {config.agent: trainer}
    if args.compare:
        other = replace(config, prioritized=not config.prioritized)
        runs[other.agent] = Trainer(other, args.seed)
        runs[other.agent].run(steps, args.progress)
    about = f"{len(trainer.graphs)} graphs, seed {args.seed}"
    curve = plot_curves(out.with_name(out.stem + "_curve.png"),
                        {name.upper(): (t.curve["step"], t.curve["return"]) for name, t in runs.items()},
                        title=f"Return per episode, latency reward ({about})", xlabel="environment steps",
                        ylabel="episode return", window=200)
    match = plot_curves(out.with_name(out.stem + "_dijkstra.png"),
                        {name.upper(): ([e[0] for e in t.evals], [100 * e[1] / e[2] for e in t.evals])
                         for name, t in runs.items()},
                        title=f"Greedy paths as short as Dijkstra's, training graphs ({about})",
                        xlabel="environment steps", ylabel="(start, target) pairs (%)", window=1)
    figures = {name: t.metadata()["evaluation"] for name, t in runs.items()}
    checkpoint.save(out, state, trainer.metadata({"curve_png": curve.name, "dijkstra_png": match.name,
                                                  "comparison": figures if args.compare else None},
                                                 held_out=True))
    return {"model": str(out), "curve": str(curve), "dijkstra_curve": str(match), **figures}


def _on_data(config: DqnConfig, args: TrainArgs) -> DqnConfig:
    """`hsched train --fleet F`: the agent trains on F's WAN alone (the model still runs on any WAN); a trace
    does not apply (it routes, no tasks)."""
    if args.trace:
        from hsched.domain.errors import ValidationError

        raise ValidationError("--trace", "does not apply to a path agent (it learns WAN graphs, no tasks)")
    return replace(config, graphs=(str(args.fleet),)) if args.fleet else config


def train_dqn(args: TrainArgs) -> dict[str, Any]:
    return train(_on_data(DqnConfig(prioritized=False), args), args)


def train_per_dqn(args: TrainArgs) -> dict[str, Any]:
    return train(_on_data(DqnConfig(prioritized=True), args), args)


# ------------------------------------------------------------------------------------------------------------
# serving


def load_net(path: str | Path) -> tuple[PathGnn, dict[str, Any]]:
    """The network of the model at `path` and its metadata. FileNotFoundError without a model, ModelMismatch
    for a model of another format (the old one-hot agent, tied to one graph)."""
    path = checkpoint.model_path(str(path))
    if not path.exists():
        raise FileNotFoundError(f"no model at {path}")
    meta = checkpoint.load_metadata(path)
    if meta.get("architecture") != ARCHITECTURE:
        trained = meta.get("graph", {})
        raise ModelMismatch(
            f"{path.name} is a path model of the old one-hot format (tied to the "
            f"{len(trained.get('vertices', []))} vertices of {trained.get('source', 'one WAN')}); the graph-relative "
            f"agent ({ARCHITECTURE}) needs a new model: retrain with `hsched train per-dqn`")
    h = meta["hyperparameters"]
    net = PathGnn(h["hidden"], h["rounds"])
    net.load_state_dict(checkpoint.load_state(path)["q"])
    return net.eval(), meta


def load_path_finder(path: str | Path, graph: WanGraph, name: str = "per-dqn") -> PathFinder:
    """The agent at `path` as a PathFinder on any `graph`: greedy walks (DC → entry vertex, reversed).

    The greedy move of every (vertex, target) pair comes from batched forward passes, recomputed when the
    graph's links change (graph.version), so a path is table lookups. The selector still checks every path
    against Dijkstra's (hsched.costs.rank_datacenters).
    """
    net, _ = load_net(path)
    feats = GraphFeatures(graph)
    cache = FeatureCache([feats])
    n = feats.n
    table = [greedy_tables(net, cache, 0, range(n))]

    def policy(obs: np.ndarray, info: dict[str, Any]) -> int:
        if feats.refresh():
            cache.clear()
            table[0] = greedy_tables(net, cache, 0, range(n))
        return int(table[0][int(np.argmax(obs[n:])), int(np.argmax(obs[:n]))])

    return PolicyPathFinder(graph, policy, name=name)
