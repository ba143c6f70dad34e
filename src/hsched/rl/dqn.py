"""DQN and PER-DQN path agents (paper 003 §2.1) that run on any WAN, plus their serving.

The MDP is `hsched/Path-v0` (hsched.envs.path, latency reward: −w/scale per link, +1 on arrival, γ = 1, so
the return-optimal walk is the lowest-latency path). What changed from a one-hot agent is what the network
sees and what it outputs, so that one set of weights serves every graph:

- Observation: the graph itself in graph-relative terms (hsched.envs.path_features): per directed link its
  latency and great-circle length, in units of the graph's median link latency, and which
  vertex is the target. No shortest-path distance is an input.
- Action: a choice among the current vertex's neighbours (the graph's links out of u; a move along a
  missing link cannot be expressed, so it is never taken and never trained).
- Network (`PathPlanner`, plain torch): a value-iteration network on the graph (VIN, Tamar et al. 2016, on
  irregular graphs as in GVIN, Niu et al. 2018; the "algorithmic alignment" of a min-aggregating GNN with
  Bellman-Ford, Xu et al. 2020). A linear model gives each link a learned cost c(u → v) = θ · (features, 1) > 0;
  the planning layer computes every vertex's cost-to-go C(v | t) as the fixed point of the Bellman backup
  over those costs, C(v) = min over v's links (c(v → x) + C(x)), C(t) = 0, iterated (at most n − 1 times)
  until nothing changes, so it reaches across any graph, however wide. Q is "reward of the move + value of
  where it lands":

      Q(u → v | t) = 1 − c(u → v) − C(v | t)

  What is learned is the cost model: from the rewards alone, TD learning drives c towards the env's
  per-link cost (here the latency, −reward), and the planner turns those costs into paths on any graph.
  The greedy walk descends a cost-to-go that every positive-cost move lowers, so it never loops; how often
  it equals Dijkstra's path is how exactly the learned costs rank near-equal paths (on real WANs two
  routes can differ by 2e-5 of their length: collinear PoPs). An untrained network (cost 1 per link)
  routes by hop count.
  Everything the Q-value depends on is graph-relative, so the weights are graph-free.
- Learner (unchanged, paper 003's): Q-learning with a target network (hard updates), Double-DQN targets
  over the neighbours of the next vertex, and proportional prioritized replay (`PER-DQN`, priorities
  (|δ| + ε)^α, IS weights annealed to 1; hsched.rl.buffers) or uniform replay (`DQN`). A transition is
  stored as integers (graph, target, u → v), the features are rebuilt from the graph at update time.
- Training distribution (`TRAIN_GRAPHS`): the default fleet's WAN and every Topology Zoo graph in data/
  (data/topology_zoo: graphml/ and the archive of 235 more) with >= 4 linked, located PoPs, except the
  networks of `HELD_OUT_FAMILIES` (every dated version of a held-out network is held out with it): about
  200 graphs of 4-99 vertices. Episodes draw a graph (small graphs only during the first
  `curriculum_steps`, then weighted by vertex count) and a (start, target) pair uniformly over all ordered
  pairs. The graphs of `HELD_OUT_GRAPHS` (up to 143 vertices) and a constructed 183-vertex graph of four of
  them are never trained on: they are the evaluation (bench/path_agents.py).
- Evaluation: deterministic greedy walks from every start to every target with a 2n step cap and loop
  detection; a pair "matches" when the walk arrives over a simple path no longer than Dijkstra's (the
  selector's own acceptance test), "invalid" when it loops or never arrives.

Checkpoints (`args.out`, default a run directory) hold the nets, optimiser, replay buffer, RNG states and
the episode in progress, so `resume` continues where it stopped. While it trains, the same state is saved at
the first episode boundary after every `--checkpoint-seconds` to `checkpoint.training_path(out)`, which a
resume of a killed run reads (the finished run's save at `out` removes it). A model file of another architecture (the
old one-hot agent, or the earlier message-passing one) is refused with a ModelMismatch that says to retrain.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from hsched.costs.graph import WanGraph
from hsched.costs.paths import PathFinder
from hsched.costs.selection import no_longer
from hsched.domain.errors import ValidationError
from hsched.domain.fleet import load_fleet
from hsched.envs.path import ENV_ID, PathEnv, PolicyPathFinder
from hsched.envs.path_features import LINK_FEATURES, GraphFeatures
from hsched.policies.learned import ModelMismatch  # also: a model of the old one-hot format
from hsched.rl import checkpoint
from hsched.rl.buffers import Batch, PrioritizedReplayBuffer, ReplayBuffer
from hsched.rl.schedules import ExponentialSchedule, LinearSchedule, hard_update, soft_update
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

MODEL_NAME = "per_dqn_path"
ARCHITECTURE = "graph-vin-v1"  # the json's "architecture": what load_path_finder accepts
DEFAULT_FLEET = "fleet:default"  # the default fleet's WAN (Abilene + the scheduler vertex)
# Held out: never trained on, the evaluation (bench/path_agents.py). Every dated version of a held-out network is
# held out with it (a name starting with one of these). Uninett (71 linked PoPs), GÉANT (multi-country), the two
# Chinese networks (another continent; duplicate city names, parallel links), and the two largest Zoo graphs
# here: TataNld (143 linked, located PoPs) and GTS Central Europe (GtsCe, 131; its national Gts* graphs too).
HELD_OUT_FAMILIES: tuple[str, ...] = ("Uninett", "Geant", "Cernet", "Chinanet", "TataNld", "Gts")
HELD_OUT_GRAPHS: tuple[str, ...] = ("Uninett", "Geant2012", "Cernet", "Chinanet", "TataNld", "GtsCe")
# the constructed large graph (hsched.traces.topology_zoo.join_graphs) is built from these held-out graphs
CONSTRUCTED_FROM: tuple[str, ...] = ("Uninett", "Geant2012", "Cernet", "Chinanet")
ZOO_TRAINING = "zoo:training"  # every Zoo graph in data/ outside HELD_OUT_FAMILIES with >= MIN_VERTICES
MIN_VERTICES = 4
TRAIN_GRAPHS: tuple[str, ...] = (DEFAULT_FLEET, ZOO_TRAINING)
# graphs whose every ordered pair the trainer checks every `eval_every` steps (all training graphs: at the end)
MONITOR_GRAPHS: tuple[str, ...] = (DEFAULT_FLEET, "Abilene", "Sprint", "Aarnet", "AttMpls", "Hibernia", "Garr200004",
                                   "Renater2010", "Deltacom", "Interoute")


def is_held_out(name: str) -> bool:
    return name.startswith(HELD_OUT_FAMILIES)


@dataclass(frozen=True)
class DqnConfig:
    """Hyper-parameters (all in env steps, independent of the budget, so a resumed run is the same run)."""

    prioritized: bool = True       # PER-DQN (True) or uniform-replay DQN
    double: bool = True            # Double-DQN target (online argmin, target value) or the target's own
    graphs: tuple[str, ...] = TRAIN_GRAPHS  # Zoo names, GraphML / fleet YAML paths, DEFAULT_FLEET, ZOO_TRAINING
    steps: int = 15_000            # default budget (TrainArgs.steps overrides)
    learning_starts: int = 500
    buffer_size: int = 50_000
    batch_size: int = 64
    lr: float = 1e-2
    lr_end: float = 1e-5           # geometric decay (see Trainer.lr)
    lr_steps: int = 15_000
    train_every: int = 1
    target_every: int = 250
    average_tau: float = 0.002     # Polyak rate of the served weights (an average over ~1 / tau updates)
    eps_start: float = 1.0
    eps_end: float = 0.05
    eps_steps: int = 8_000
    per_alpha: float = 0.6
    per_beta0: float = 0.4
    per_beta_steps: int = 15_000
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


def load_graph(source: str | None) -> WanGraph:
    """A WanGraph from DEFAULT_FLEET/None (the default fleet), a fleet YAML, a GraphML path or a Zoo name."""
    if source is None or source == DEFAULT_FLEET:
        return WanGraph(load_fleet().wan)
    if Path(source).suffix in (".yaml", ".yml"):
        return WanGraph(load_fleet(source).wan)
    from hsched.domain.fleet import Wan
    from hsched.traces.topology_zoo import largest_component, load_graphml, zoo_graphml

    vertices, links, label = load_graphml(zoo_graphml(source) if not Path(source).suffix
                                          and not Path(source).exists() else source)
    vertices, links, dropped = largest_component(vertices, links)
    if len(vertices) < 2:
        raise ValidationError("graph", "needs at least two linked vertices with coordinates", source)
    return WanGraph(Wan(vertices=vertices, links=tuple(links), scheduler_vertex=next(iter(vertices)),
                        entry_vertices=tuple(vertices), source=label, pruned=dropped))


def training_graphs(sources: Sequence[str]) -> dict[str, WanGraph]:
    """{source: graph} for `sources`, ZOO_TRAINING expanded to the Zoo graphs it stands for, in order."""
    from hsched.traces.topology_zoo import zoo_names

    out: dict[str, WanGraph] = {}
    for source in sources:
        if source != ZOO_TRAINING:
            out[source] = load_graph(source)
            continue
        for name in zoo_names():
            if is_held_out(name) or name in out:
                continue
            try:
                graph = load_graph(name)
            except ValidationError:  # no two linked, located PoPs
                continue
            if len(graph.vertices) >= MIN_VERTICES:
                out[name] = graph
    return out


def constructed_graph(names: Sequence[str] = CONSTRUCTED_FROM, bridges: int = 2) -> WanGraph:
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


class PathPlanner(nn.Module):
    """A value-iteration network over the graph (see the module doc): a learned cost per link, and the
    cost-to-go of every vertex as the fixed point of the Bellman backup over those costs."""

    def __init__(self) -> None:
        super().__init__()
        self.cost = nn.Linear(LINK_FEATURES, 1)
        # start from cost 1 on every link, whatever its features (routing by hop count): a neutral start
        nn.init.zeros_(self.cost.weight)
        nn.init.ones_(self.cost.bias)

    def link_cost(self, g: GraphBatch) -> torch.Tensor:
        """[E] the learned cost of each link: a linear function of its features, at least MIN_LINK_COST (so
        every loop costs and the backup converges). Linear because paths that differ by 2e-5 of their length
        must be ranked right (collinear PoPs): an MLP fitted the latencies only to ~1e-3 here, and a
        log-linear model learned its exponent from the rare very short and very long links, slowly."""
        return self.cost(g.link_x).squeeze(1).clamp(min=MIN_LINK_COST)

    def forward(self, g: GraphBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """([E] link costs, [N] cost-to-go of every vertex to its instance's target; UNREACHED if none)."""
        cost = self.link_cost(g)
        return cost, plan(cost, g)


MIN_LINK_COST = 1e-4  # graph units
UNREACHED = 1e30     # the cost-to-go of a vertex with no way to its target (yet)


def plan(cost: torch.Tensor, g: GraphBatch) -> torch.Tensor:
    """[N] cost-to-go C(v) = min over v's links (cost(v → x) + C(x)), C(target) = 0: Bellman-Ford from
    C = UNREACHED, run to its fixed point (at most N − 1 backups, each one link deeper). Differentiable: the
    gradient of C(v) is the sum over the links of v's chosen way to the target."""
    n = len(g.is_target)
    target = g.is_target > 0
    unreached = torch.tensor(UNREACHED, dtype=cost.dtype)
    c = torch.where(target, 0.0, unreached)
    for _ in range(max(n - 1, 1)):
        new = torch.where(target, 0.0, torch.minimum(node_min(cost + c[g.dst], g.src, n), unreached))
        if torch.equal(new.detach(), c.detach()):
            break
        c = new
    return c


@dataclass
class GraphBatch:
    """The disjoint union of several (graph, target) instances, ready for `PathPlanner`."""

    link_x: torch.Tensor     # [E, LINK_FEATURES]
    src: torch.Tensor        # [E] int64, global vertex ids
    dst: torch.Tensor
    is_target: torch.Tensor  # [N] float
    offsets: list[int] = field(default_factory=list)       # first global vertex id of each instance
    edge_offsets: list[int] = field(default_factory=list)  # first global link id of each instance

    def cost_to_go(self, cost: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """[E] the estimated cost of taking link a → b and then b's way to the target: cost(a → b) + C(b)."""
        return cost + c[self.dst]


class FeatureCache:
    """Torch tensors of every graph, built once: batches of (graph, target) instances are concatenations."""

    def __init__(self, features: Sequence[GraphFeatures]) -> None:
        self.features = list(features)
        self._cache: dict[int, tuple[torch.Tensor, ...]] = {}

    def graph(self, g: int) -> tuple[torch.Tensor, ...]:
        got = self._cache.get(g)
        if got is None:
            feats = self.features[g]
            got = self._cache[g] = (torch.from_numpy(feats.link_x), torch.from_numpy(feats.src),
                                    torch.from_numpy(feats.dst))
        return got

    def batch(self, instances: Sequence[tuple[int, int]]) -> GraphBatch:
        parts = [self.graph(g) for g, _t in instances]
        offsets, edge_offsets, total, edges = [], [], 0, 0
        for g, _t in instances:
            offsets.append(total)
            edge_offsets.append(edges)
            total += self.features[g].n
            edges += self.features[g].edges
        is_target = torch.zeros(total)
        is_target[[o + t for o, (_g, t) in zip(offsets, instances, strict=True)]] = 1.0
        return GraphBatch(
            link_x=torch.cat([p[0] for p in parts]),
            src=torch.cat([p[1] + o for p, o in zip(parts, offsets, strict=True)]),
            dst=torch.cat([p[2] + o for p, o in zip(parts, offsets, strict=True)]),
            is_target=is_target, offsets=offsets, edge_offsets=edge_offsets)

    def clear(self) -> None:
        self._cache.clear()


def node_min(values: torch.Tensor, src: torch.Tensor, n: int) -> torch.Tensor:
    """[n] min over the links leaving each vertex (inf for a vertex without links)."""
    return torch.full((n,), torch.inf, dtype=values.dtype).scatter_reduce(0, src, values, "amin", include_self=False)


def greedy_tables(net: PathPlanner, cache: FeatureCache, g: int, targets: Sequence[int]) -> np.ndarray:
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
            src = batch.src.numpy()
            if not src.size:  # a WAN without links (one vertex): no move anywhere, every entry stays -1
                continue
            cost = batch.cost_to_go(*net(batch)).numpy()
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


def evaluate_graph(net: PathPlanner, graph: WanGraph, targets: Sequence[str] | None = None,
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


def held_out_evaluation(net: PathPlanner) -> dict[str, Any]:
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
        if graphs is None:
            named = training_graphs(config.graphs)
            self.sources, self.graphs = list(named), list(named.values())
        else:
            self.sources, self.graphs = [graph_label(g) for g in graphs], list(graphs)
        # the graphs checked every eval_every steps: the monitor graphs trained on, else all of them
        self.monitored = [i for i, s in enumerate(self.sources) if s in MONITOR_GRAPHS] or list(range(len(self.graphs)))
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
        self.q = PathPlanner()
        self.target = PathPlanner()
        self.target.load_state_dict(self.q.state_dict())
        # the served weights: a Polyak average of the online net's, which smooths Adam's per-step jitter out of
        # the link costs (their precision decides near-equal paths)
        self.served = PathPlanner()
        self.served.load_state_dict(self.q.state_dict())
        self.optimizer = torch.optim.Adam(self.q.parameters(), lr=config.lr)
        kwargs = {"capacity": config.buffer_size, "obs_shape": 3, "obs_dtype": np.int32, "seed": self.rng}
        self.buffer: ReplayBuffer = (
            PrioritizedReplayBuffer(**kwargs, alpha=config.per_alpha, beta0=config.per_beta0,
                                    beta_steps=config.per_beta_steps, eps=config.per_eps)
            if config.prioritized else ReplayBuffer(**kwargs))
        self.epsilon = LinearSchedule(config.eps_start, config.eps_end, config.eps_steps)
        # geometric decay: the link costs must rank near-equal paths (2e-5 apart on real WANs), and Adam moves
        # every weight by ~lr per step, so the last steps need a learning rate orders below the first
        self.lr = ExponentialSchedule(config.lr, config.lr_end, (config.lr_end / config.lr) ** (1 / config.lr_steps))
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
                self._cost = batch.cost_to_go(*self.q(batch)).numpy()
        lo, hi = feats.ptr[self.u], feats.ptr[self.u + 1]
        return int(neighbours[int(np.argmin(self._cost[lo:hi]))])

    # -- learning -------------------------------------------------------------------------------------------

    def td(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(Q(u → v) of the online net [B], target y [B]) for a batch of stored transitions."""
        obs = batch.obs.astype(np.int64)
        keys = list(dict.fromkeys(zip(obs[:, 0].tolist(), obs[:, 1].tolist(), strict=True)))
        slot = {k: i for i, k in enumerate(keys)}
        union = self.cache.batch(keys)
        where = [slot[(int(g), int(t))] for g, t, _ in obs]
        v = torch.tensor([union.offsets[i] + int(a) for i, a in zip(where, batch.actions, strict=True)])
        link = torch.tensor([union.edge_offsets[i] + self.features[int(g)].link(int(u), int(a))
                             for i, (g, _t, u), a in zip(where, obs, batch.actions, strict=True)])
        cost, to_go = self.q(union)
        q = 1.0 - cost[link] - to_go[v]  # to_go is 0 at the target: an arriving move is 1 − its cost
        n = len(union.is_target)
        with torch.no_grad():
            target_cost = union.cost_to_go(*self.target(union))
            if self.config.double:
                online_cost = union.cost_to_go(cost.detach(), to_go.detach())
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
        feats = self.features[self.g]
        w = float(feats.w[feats.link(self.u, action)])
        n = feats.n
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
            with torch.no_grad():
                soft_update(self.served.state_dict(), self.q.state_dict(), c.average_tau)
        if self.step % c.target_every == 0:
            with torch.no_grad():
                hard_update(self.target.state_dict(), self.q.state_dict())
        if self.step % c.eval_every == 0:
            self.evaluate()

    def evaluate(self, record: bool = True) -> dict[str, Any]:
        """Greedy walks over all ordered pairs of the monitored training graphs (`record`) or of every training
        graph vs Dijkstra (summed)."""
        total = {"pairs": 0, "matched": 0, "invalid": 0}
        for graph in (self.graphs[i] for i in self.monitored) if record else self.graphs:
            r = evaluate_graph(self.served, graph)
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

    def run(self, until: int, show: bool = True, label: str = "",
            boundary: Callable[[], None] | None = None) -> None:
        """Train to `until` env steps; `boundary()` after each step that ended an episode (where a resumable
        state may be saved: the greedy costs cached per episode, which a state does not hold, are unset)."""
        c = self.config
        t0, cpu0 = time.perf_counter(), time.process_time()
        with progress(label or f"train {c.agent} paths", until, show) as advance:
            shown = self.step
            advance(shown)
            while self.step < until:
                episodes = len(self.curve["step"])
                self.train_step()
                if boundary is not None and len(self.curve["step"]) > episodes:
                    now, cpu = time.perf_counter(), time.process_time()
                    self.train_seconds += now - t0
                    self.cpu_seconds += cpu - cpu0
                    t0, cpu0 = now, cpu
                    boundary()
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
        return {"q": self.q.state_dict(), "target": self.target.state_dict(), "served": self.served.state_dict(),
                "optimizer": self.optimizer.state_dict(), "buffer": buffer, "rng": rng_state(self.rng),
                "envs": [e.get_state() for e in self.envs], "episode": (self.g, self.u, self.t),
                "step": self.step, "episode_return": self.episode_return, "curve": self.curve,
                "evals": self.evals, "solved_at": self.solved_at, "train_seconds": self.train_seconds,
                "cpu_seconds": self.cpu_seconds}

    def load(self, state: dict[str, Any]) -> None:
        self.q.load_state_dict(state["q"])
        self.served.load_state_dict(state["served"])
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
            "input": {"link_features": LINK_FEATURES, "note": "graph-relative; any vertex count"},
            "evaluation": {"steps": self.step, "paths_equal_dijkstra": final["matched"], "pairs": final["pairs"],
                           "invalid_paths": final["invalid"],
                           "summary": f"{final['matched']} of {final['pairs']} (start, target) greedy paths on "
                                      "the training graphs are as short as Dijkstra's",
                           "solved_at_step": self.solved_at, "train_seconds": round(self.train_seconds, 1),
                           "train_cpu_seconds": round(self.cpu_seconds, 1)},
            "held_out_evaluation": (held_out_evaluation(self.served)
                                    if held_out and set(self.config.graphs) == set(TRAIN_GRAPHS) else None),
            **(extra or {}),
        }


def train(config: DqnConfig, args: TrainArgs) -> dict[str, Any]:
    """Train (or resume) `config` to `args.steps`, save it at `args.out`, plot its curve; with
    `args.compare`, also train the other replay kind with the same seed and budget and plot both."""
    torch.set_num_threads(1)
    out = output_path(args, MODEL_NAME if config.prioritized else "dqn_path")
    steps = args.steps or config.steps
    config = replace(config, steps=steps)  # the budget as run, in the metadata
    check_budget(steps, config.learning_starts, config.train_every)
    resume = checkpoint.Resumable(checkpoint.training_path(out), run_identity(args, config.agent, config, ("steps",)),
                                  args.checkpoint_seconds, final=out)
    if args.resume and checkpoint.load_metadata(src := resume.check()).get("architecture") != ARCHITECTURE:
        raise ValidationError("--resume", f"{src} is a path model of the old one-hot format; train a new one "
                              "without --resume", str(src))
    trainer = Trainer(config, args.seed)
    if args.resume:
        trainer.load(resume.load())

    def boundary() -> None:
        if resume.due():
            resume.save(trainer.state(), {"agent": config.agent, "architecture": ARCHITECTURE, "model": str(out),
                                          "step": trainer.step})

    trainer.run(steps, args.progress, boundary=boundary)
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
                        title=f"Greedy paths as short as Dijkstra's, {len(trainer.monitored)} monitored training "
                              f"graphs ({about})",
                        xlabel="environment steps", ylabel="(start, target) pairs (%)", window=1)
    figures = {name: t.metadata()["evaluation"] for name, t in runs.items()}
    resume.save(state, trainer.metadata({"curve_png": curve.name, "dijkstra_png": match.name,
                                         "comparison": figures if args.compare else None}, held_out=True),
                final=True)
    return {"model": str(out), "curve": str(curve), "dijkstra_curve": str(match), **figures}


def _on_data(config: DqnConfig, args: TrainArgs) -> DqnConfig:
    """`hsched train --fleet F`: the agent trains on F's WAN alone (the model still runs on any WAN); a trace
    does not apply (it routes, no tasks)."""
    if args.trace:
        raise ValidationError("--trace", "does not apply to a path agent (it learns WAN graphs, no tasks)")
    return replace(config, graphs=(str(args.fleet),)) if args.fleet else config


def train_dqn(args: TrainArgs) -> dict[str, Any]:
    return train(_on_data(DqnConfig(prioritized=False), args), args)


def train_per_dqn(args: TrainArgs) -> dict[str, Any]:
    return train(_on_data(DqnConfig(prioritized=True), args), args)


# ------------------------------------------------------------------------------------------------------------
# serving


def load_net(path: str | Path) -> tuple[PathPlanner, dict[str, Any]]:
    """The network of the model at `path` and its metadata. FileNotFoundError without a model, ModelMismatch
    for a model of another format (the old one-hot agent, tied to one graph)."""
    path = checkpoint.model_path(str(path))
    if not path.exists():
        raise FileNotFoundError(f"no model at {path}")
    meta = checkpoint.load_metadata(path)
    if meta.get("architecture") not in (ARCHITECTURE, None):
        raise ModelMismatch(f"{path.name} is a path model of architecture {meta['architecture']!r}; this hsched "
                            f"serves {ARCHITECTURE!r}: retrain with `hsched train per-dqn`")
    if meta.get("architecture") != ARCHITECTURE:
        trained = meta.get("graph", {})
        raise ModelMismatch(
            f"{path.name} is a path model of the old one-hot format (tied to the "
            f"{len(trained.get('vertices', []))} vertices of {trained.get('source', 'one WAN')}); the graph-relative "
            f"agent ({ARCHITECTURE}) needs a new model: retrain with `hsched train per-dqn`")
    net = PathPlanner()
    net.load_state_dict(checkpoint.load_state(path)["served"])
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
