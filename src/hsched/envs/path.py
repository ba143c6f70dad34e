"""The path-finding MDP of paper 003 §2.1 as a Gymnasium environment (`hsched/Path-v0`).

The agent walks the WAN graph one link at a time:

- state: the current vertex. The observation is `one_hot(current) ⧺ one_hot(target)` (float32, length 2n),
  so one network can serve several targets (the paper trains one per target; with the target in the
  observation, a single agent learns the paths to every entry vertex). The shipped PER-DQN agent does not
  read this one-hot vector: it rebuilds the same state as graph-relative features
  (hsched.envs.path_features), which is what lets one model run on any WAN;
- action: `Discrete(n)`, "go to vertex j" (index into `PathEnv.vertices`, the WanGraph's vertex order);
- reward, eq.11 (see `eq11`): −1 (`invalid_reward`) for a move along a link that does not exist, the agent
  stays where it is; `1/w` for a step along a link of weight `w`; `goal_reward` when the step reaches the
  target, which ends the episode (terminated). Eq.11 is piecewise: the arriving step earns the goal reward,
  not 1/w plus the goal reward.

Link weight `w` = the link's latency in ms from `WanGraph` (parallel links collapsed to the fastest, as
the selector does), the same weight `DijkstraPathFinder` minimises and eq.2 charges for, so the env, the
selector and the exact reference agree on what "shortest" means. Latencies below `MIN_LATENCY_MS` (0.05 ms,
the Topology Zoo floor for co-located PoPs) count as 0.05 ms, so a probe reporting 0 ms cannot divide by 0.

What eq.11 rewards (an honest note on the paper's design). The step reward 1/w is larger for a shorter
link, but the rewards of a path ADD UP: a path with more, shorter links can out-earn a shorter path, and
walking back and forth on a short link earns 1/w forever. Two consequences:

1. The goal reward must dominate every loop, or the return-maximising policy never arrives. With
   discount γ a loop is worth at most r_max / (1 − γ) (r_max = the largest 1/w of a link not entering the
   target), while the fewest-hop path of d ≤ D links is worth at least γ^(D−1) · goal. The default
   `goal_reward=None` takes the smallest two-significant-digit value above r_max / ((1 − γ) γ^(D−1)) for
   the env's `gamma` (default 0.99, the discount the goal is sized for; pass the agent's). Then the
   return-maximising policy reaches the target from every start (tests/test_env_path.py checks it by value
   iteration on Abilene). On the default fleet (target = scheduler vertex): r_max = 1/1.317 ms
   (Chicago–Indianapolis), D = 4, goal = 79.
2. Even then, the return-maximising path is not always the lowest-latency one: it trades hops (each
   extra hop delays the goal, costing about (1 − γ) · goal) against the 1/w it collects on short links.
   On the default fleet (γ = 0.99) the eq.11 optimum matches Dijkstra from 9 of the 11 DCs; from
   Washington DC it detours via New York–Chicago (12.39 ms vs 11.50 ms) and from Los Angeles it takes
   the 11 ms Houston link (16.29 ms vs 14.54 ms). `value_iteration` / `optimal_policy` compute that
   optimum exactly, so a trained agent can be compared with it and with Dijkstra; the selector never
   trusts an agent path longer than Dijkstra's (hsched.costs.selection).

The latency reward (`reward="latency"`, what the learned path agents train on). Because of point 2, an
agent that maximises eq.11 perfectly still routes 2 of the 11 Abilene DCs off the shortest path, and the
selector would then replace those paths. The alternative reward is the link's latency as a cost:
`−w / latency_ref_ms` per move along a link of weight `w` (floored as above), plus `goal_reward` (default 1)
added on the arriving move; a missing link still earns `invalid_reward`. Undiscounted (γ = 1), the return of
a walk that arrives is `goal − latency(walk) / latency_ref_ms`, so the return-maximising walk IS the
lowest-latency path (Dijkstra's; ties between equal-latency paths aside), and every loop only costs. With
the default `latency_ref_ms` (the largest shortest-path latency from any vertex to a target) the optimal
returns lie in [0, 1), a scale a Q-network fits easily. `value_iteration(..., reward="latency", gamma=1)`
is then Bellman-Ford: tests/test_env_path.py checks it equals Dijkstra for every Abilene pair.

Speed: adjacency and weights are precomputed into Python lists (no networkx per step); a link update on
the WanGraph (`graph.version` moves) is picked up at the next `reset`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces

from hsched.costs.graph import WanGraph
from hsched.costs.paths import VertexPath
from hsched.domain.errors import ValidationError
from hsched.domain.fleet import Wan
from hsched.traces.topology_zoo import MIN_LATENCY_MS

ENV_ID = "hsched/Path-v0"
DEFAULT_GAMMA = 0.99
INVALID_REWARD = -1.0
REWARDS = ("eq11", "latency")  # paper 003 eq.11; −latency per link (return-optimal = Dijkstra, γ = 1)

Policy = Callable[[np.ndarray, dict[str, Any]], int]  # (observation, info) -> action


# ------------------------------------------------------------------------------------------------------------
# eq.11


def eq11(weight_ms: float | None, *, arrived: bool, goal_reward: float,
         invalid_reward: float = INVALID_REWARD) -> float:
    """Paper 003 eq.11 for one move: `invalid_reward` when there is no link (weight None), `goal_reward` when
    the move reaches the target, else 1/w (w in ms, floored at MIN_LATENCY_MS)."""
    if weight_ms is None:
        return invalid_reward
    if arrived:
        return goal_reward
    return 1.0 / max(weight_ms, MIN_LATENCY_MS)


def latency_reward(weight_ms: float | None, *, arrived: bool, ref_ms: float, goal_reward: float = 1.0,
                   invalid_reward: float = INVALID_REWARD) -> float:
    """The latency reward for one move: `invalid_reward` when there is no link, else −w/ref_ms (w floored at
    MIN_LATENCY_MS, as in eq.11), plus `goal_reward` when the move reaches the target."""
    if weight_ms is None:
        return invalid_reward
    return -max(weight_ms, MIN_LATENCY_MS) / ref_ms + (goal_reward if arrived else 0.0)


def latency_ref_for(graph: WanGraph, targets: Sequence[str] | str | None = None) -> float:
    """The default `latency_ref_ms`: the largest shortest-path latency from any vertex to one of `targets`
    (default: the scheduler vertex), at least MIN_LATENCY_MS."""
    if targets is None:
        targets = [graph.wan.scheduler_vertex]
    elif isinstance(targets, str):
        targets = [targets]
    worst = max((graph.path_metrics(p).latency_ms for t in targets for p in graph.dijkstra.paths_from(t).values()),
                default=0.0)
    return max(worst, MIN_LATENCY_MS)


def reward_eq11(graph: WanGraph, u: str, v: str, *, target: str | None = None, goal_reward: float,
                invalid_reward: float = INVALID_REWARD) -> float:
    """Eq.11 for the move u → v on `graph` (target defaults to the WAN's scheduler vertex)."""
    for name, vertex in (("u", u), ("v", v)):
        if vertex not in graph:
            raise ValidationError(name, "must name a vertex of the WAN", vertex)
    target = graph.wan.scheduler_vertex if target is None else target
    data = graph.graph.adj[u].get(v)
    return eq11(None if data is None else data["latency_ms"], arrived=v == target, goal_reward=goal_reward,
                invalid_reward=invalid_reward)


# ------------------------------------------------------------------------------------------------------------
# graph helpers


def _as_graph(graph: WanGraph | Wan | str | Path | None, target: str | None) -> WanGraph:
    if isinstance(graph, WanGraph):
        return graph
    if isinstance(graph, Wan):
        return WanGraph(graph)
    if graph is None:
        from hsched.domain.fleet import load_fleet

        return WanGraph(load_fleet().wan)
    from hsched.traces.topology_zoo import load_graphml

    vertices, links, source = load_graphml(graph)
    if not vertices:
        raise ValidationError("graph", "the GraphML file has no located vertices", str(graph))
    scheduler = target if target is not None else next(iter(vertices))
    return WanGraph(Wan(vertices=vertices, links=tuple(links), scheduler_vertex=scheduler,
                        entry_vertices=tuple(vertices), source=source))


def _hops_to(adj: Sequence[Sequence[int]], target: int) -> list[int]:
    """BFS hop count from every vertex to `target` (-1 = cannot reach it; links are undirected)."""
    hops = [-1] * len(adj)
    hops[target] = 0
    queue = deque([target])
    while queue:
        u = queue.popleft()
        for v in adj[u]:
            if hops[v] < 0:
                hops[v] = hops[u] + 1
                queue.append(v)
    return hops


def _round_up_2sig(x: float) -> float:
    if x <= 0:
        return 0.0
    step = 10.0 ** (math.floor(math.log10(x)) - 1)
    return math.ceil(x / step * (1 + 1e-12)) * step


def goal_reward_for(graph: WanGraph, targets: Sequence[str] | str | None = None,
                    gamma: float = DEFAULT_GAMMA) -> float:
    """The default goal reward: the smallest two-significant-digit value with γ^(D−1)·goal > r_max/(1−γ).

    r_max = the largest step reward 1/w on a link that does not enter the target, D = the largest
    fewest-hop distance from a vertex that can reach the target. Above it, arriving beats every loop for
    discount `gamma`, so the return-maximising policy of eq.11 terminates (see the module docstring).
    At least 1.0. Max over `targets` (default: the scheduler vertex).
    """
    if not 0 < gamma < 1:
        raise ValidationError("gamma", "must be in (0, 1)", gamma)
    if targets is None:
        targets = [graph.wan.scheduler_vertex]
    elif isinstance(targets, str):
        targets = [targets]
    names = graph.vertices
    index = {v: i for i, v in enumerate(names)}
    adj = [[index[v] for v in graph.graph.adj[u]] for u in names]
    bound = 0.0
    for target in targets:
        t = index[target]
        hops = _hops_to(adj, t)
        depth = max(hops)
        r_max = max((eq11(d["latency_ms"], arrived=False, goal_reward=0.0)
                     for a, b, d in graph.graph.edges(data=True) if t not in (index[a], index[b])
                     and hops[index[a]] >= 0), default=0.0)
        if depth >= 1:
            bound = max(bound, r_max / ((1 - gamma) * gamma ** (depth - 1)))
    return max(1.0, _round_up_2sig(bound * (1 + 1e-9)))


# ------------------------------------------------------------------------------------------------------------
# the environment


class PathEnv(gymnasium.Env[np.ndarray, np.int64]):
    """Paper 003 §2.1 on any WAN graph; see the module docstring for the MDP and eq.11.

    Args:
        graph: a WanGraph (shared, link updates picked up at reset), a Wan, a Topology Zoo GraphML path, or
            None for the default fleet's WAN (Abilene + the scheduler vertex).
        target: the vertex to reach (default: the WAN's scheduler vertex, paper vertex 0), or a sequence of
            vertices, one drawn uniformly per reset. `reset(options={"target": v})` overrides it once.
        start: a fixed start vertex, or None for a uniformly random vertex that can reach the target (never
            the target itself). `reset(options={"start": v})` overrides it once.
        max_steps: truncation after this many moves (default 2 × vertex count; invalid moves count).
        goal_reward: the reward on arrival; None = `goal_reward_for(graph, targets, gamma)` for eq.11, 1.0 for
            the latency reward.
        invalid_reward: the reward for a move along a missing link (paper: −1).
        gamma: only used to size eq.11's default goal reward (the discount of the agent that will train on
            it); the latency reward is meant undiscounted.
        reward: "eq11" (default, the paper's) or "latency" (see the module docstring).
        latency_ref_ms: the latency reward's scale; None = `latency_ref_for(graph, targets)`.

    `info` after reset and step: "action_mask" (int8, 1 = a link to that vertex exists; a fresh array per
    call, as Gymnasium's checker requires), "path" (vertex names visited so far, start first), "target".
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}  # noqa: RUF012 (gymnasium declares it a class attribute)

    def __init__(self, graph: WanGraph | Wan | str | Path | None = None,
                 target: str | Sequence[str] | None = None, *, start: str | None = None,
                 max_steps: int | None = None, goal_reward: float | None = None,
                 invalid_reward: float = INVALID_REWARD, gamma: float = DEFAULT_GAMMA,
                 render_mode: str | None = None, reward: str = "eq11",
                 latency_ref_ms: float | None = None) -> None:
        if reward not in REWARDS:
            raise ValidationError("reward", f"must be one of {', '.join(REWARDS)}", reward)
        self.graph = _as_graph(graph, target if isinstance(target, str) else None)
        self.vertices: tuple[str, ...] = self.graph.vertices
        self.index = {v: i for i, v in enumerate(self.vertices)}
        n = self.n = len(self.vertices)
        if n < 2:
            raise ValidationError("graph", "needs at least two vertices", n)
        if target is None:
            targets: tuple[str, ...] = (self.graph.wan.scheduler_vertex,)
        elif isinstance(target, str):
            targets = (target,)
        else:
            targets = tuple(target)
        if not targets:
            raise ValidationError("target", "must name at least one vertex")
        for i, t in enumerate(targets):
            self._vertex("target" if isinstance(target, str | None) else f"target[{i}]", t)
        self.targets = targets
        if start is not None:
            self._vertex("start", start)
        self.start = start
        self.max_steps = 2 * n if max_steps is None else int(max_steps)
        if self.max_steps < 1:
            raise ValidationError("max_steps", "must be >= 1", max_steps)
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValidationError("render_mode", "must be None or 'ansi'", render_mode)
        self.render_mode = render_mode
        self.gamma = gamma
        self.reward = reward
        if reward == "latency":
            self.latency_ref_ms = float(latency_ref_for(self.graph, targets) if latency_ref_ms is None
                                        else latency_ref_ms)
            if not self.latency_ref_ms > 0:
                raise ValidationError("latency_ref_ms", "must be > 0", latency_ref_ms)
            self.goal_reward = 1.0 if goal_reward is None else float(goal_reward)
        else:
            self.latency_ref_ms = None
            self.goal_reward = float(goal_reward_for(self.graph, targets, gamma) if goal_reward is None
                                     else goal_reward)
        self.invalid_reward = float(invalid_reward)

        self.observation_space = spaces.Box(0.0, 1.0, shape=(2 * n,), dtype=np.float32)
        self.action_space = spaces.Discrete(n)
        self._build()
        self._u = self._t = 0
        self._steps = 0
        self._path: list[str] = []

    # -- precomputed tables ----------------------------------------------------------------------------------

    def _vertex(self, field: str, name: str) -> int:
        i = self.index.get(name)
        if i is None:
            raise ValidationError(field, "must name a vertex of the WAN", name)
        return i

    def _build(self) -> None:
        """Adjacency, weights and masks from the graph as it is now (again after a link update)."""
        adj = self.graph.graph.adj
        self._weights: list[dict[int, float]] = [
            {self.index[v]: d["latency_ms"] for v, d in adj[u].items()} for u in self.vertices]
        self._neighbors = [list(w) for w in self._weights]
        masks = np.zeros((self.n, self.n), dtype=np.int8)
        for u, w in enumerate(self._weights):
            masks[u, list(w)] = 1
        masks.setflags(write=False)
        self._masks = masks
        self._starts: dict[int, tuple[list[int], list[int]]] = {}  # target -> (hops to it, possible starts)
        self._version = self.graph.version

    def _starts_for(self, t: int) -> tuple[list[int], list[int]]:
        """Fewest-hop distances to target t (-1 = unreachable) and the vertices that can start (hops > 0)."""
        found = self._starts.get(t)
        if found is None:
            hops = _hops_to(self._neighbors, t)
            found = self._starts[t] = (hops, [i for i, h in enumerate(hops) if h > 0])
        return found

    # -- gymnasium API ---------------------------------------------------------------------------------------

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        if self.graph.version != self._version:
            self._build()
        options = options or {}
        rng = self.np_random
        target = options.get("target")
        if target is None:
            target = self.targets[0] if len(self.targets) == 1 else self.targets[rng.integers(len(self.targets))]
        t = self._vertex("options.target" if "target" in options else "target", target)
        hops, starts = self._starts_for(t)
        start = options.get("start", self.start)
        if start is None:
            if not starts:
                raise ValidationError("target", "no other vertex can reach it", target)
            u = starts[int(rng.integers(len(starts)))]
        else:
            field = "options.start" if "start" in options else "start"
            u = self._vertex(field, start)
            if u == t:
                raise ValidationError(field, "must differ from the target", start)
            if hops[u] < 0:
                raise ValidationError(field, f"cannot reach the target {target!r}", start)
        self._u, self._t, self._steps = u, t, 0
        self._path = [self.vertices[u]]
        return self._obs(), self._info()

    def step(self, action: int | np.integer) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        a = int(action)
        if not 0 <= a < self.n:
            raise ValueError(f"action {action} is outside Discrete({self.n})")
        w = self._weights[self._u].get(a)
        arrived = w is not None and a == self._t
        reward = self.move_reward(w, arrived)
        if w is not None:
            self._u = a
            self._path.append(self.vertices[a])
        self._steps += 1
        truncated = not arrived and self._steps >= self.max_steps
        return self._obs(), reward, arrived, truncated, self._info()

    def render(self) -> str | None:
        if self.render_mode == "ansi":
            return " → ".join(self._path) + f"  (target {self.vertices[self._t]})"
        return None

    # -- helpers ---------------------------------------------------------------------------------------------

    def move_reward(self, weight_ms: float | None, arrived: bool) -> float:
        """This env's reward for one move (eq.11 or the latency reward) along a link of `weight_ms` (None: no
        link)."""
        if self.reward == "latency":
            return latency_reward(weight_ms, arrived=arrived, ref_ms=self.latency_ref_ms,
                                  goal_reward=self.goal_reward, invalid_reward=self.invalid_reward)
        return eq11(weight_ms, arrived=arrived, goal_reward=self.goal_reward, invalid_reward=self.invalid_reward)

    def get_state(self) -> dict[str, Any]:
        """The episode in progress and the env's random stream, for a training checkpoint."""
        return {"u": self._u, "t": self._t, "steps": self._steps, "path": list(self._path),
                "np_random": self.np_random.bit_generator.state}

    def set_state(self, state: dict[str, Any]) -> tuple[np.ndarray, dict[str, Any]]:
        """Continue the episode saved by `get_state`; returns its current (observation, info)."""
        if self.graph.version != self._version:
            self._build()
        self.np_random.bit_generator.state = state["np_random"]
        self._u, self._t, self._steps = int(state["u"]), int(state["t"]), int(state["steps"])
        self._path = list(state["path"])
        return self._obs(), self._info()

    def _obs(self) -> np.ndarray:
        obs = np.zeros(2 * self.n, dtype=np.float32)
        obs[self._u] = 1.0
        obs[self.n + self._t] = 1.0
        return obs

    def _info(self) -> dict[str, Any]:
        return {"action_mask": self._masks[self._u].copy(), "path": tuple(self._path), "target": self.vertices[self._t]}

    @property
    def current(self) -> str:
        return self.vertices[self._u]

    @property
    def target(self) -> str:
        return self.vertices[self._t]


# ------------------------------------------------------------------------------------------------------------
# exact eq.11 optimum, rollouts, and the PathFinder adaptor for a trained policy


def value_iteration(graph: WanGraph, target: str | None = None, *, gamma: float = DEFAULT_GAMMA,
                    goal_reward: float | None = None, invalid_reward: float = INVALID_REWARD,
                    tol: float = 1e-9, max_iter: int = 100_000, reward: str = "eq11",
                    latency_ref_ms: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Optimal state values and greedy actions of the path MDP (infinite horizon, discount `gamma`).

    Returns (V, policy) indexed like `graph.vertices`; V[target] = 0 (terminal), policy[target] = -1. Uses
    the same `PathEnv` tables and reward (eq.11 by default, or `reward="latency"`, then with gamma = 1), so
    it is the exact optimum of the env the agent trains on (no time limit). O(n²) per sweep: for graphs up to
    a few hundred vertices.
    """
    env_gamma = gamma if 0 < gamma < 1 else DEFAULT_GAMMA  # PathEnv's gamma only sizes eq.11's default goal
    env = PathEnv(graph, target, gamma=env_gamma, goal_reward=goal_reward, invalid_reward=invalid_reward,
                  reward=reward, latency_ref_ms=latency_ref_ms)
    n, t = env.n, env.index[env.targets[0]]
    reward_table = np.empty((n, n))
    nxt = np.empty((n, n), dtype=np.int64)
    for u in range(n):
        for a in range(n):
            w = env._weights[u].get(a)
            reward_table[u, a] = env.move_reward(w, w is not None and a == t)
            nxt[u, a] = u if w is None else a
    cont = (nxt != t).astype(float)  # arriving ends the episode: no value after it
    values = np.zeros(n)
    for _ in range(max_iter):
        q = reward_table + gamma * cont * values[nxt]
        new = q.max(axis=1)
        new[t] = 0.0
        if np.max(np.abs(new - values)) < tol:
            values = new
            break
        values = new
    q = reward_table + gamma * cont * values[nxt]
    policy = q.argmax(axis=1)
    policy[t] = -1
    return values, policy


@dataclass(frozen=True, slots=True)
class PathRollout:
    path: VertexPath  # vertices visited, start first
    total_reward: float  # undiscounted
    terminated: bool  # reached the target
    steps: int


def rollout_path(env_or_graph: PathEnv | WanGraph | Wan, policy_fn: Policy, *, start: str | None = None,
                 target: str | None = None, seed: int | None = None) -> PathRollout:
    """Run `policy_fn(obs, info) -> action` for one episode (to arrival or truncation)."""
    env = env_or_graph if isinstance(env_or_graph, PathEnv) else PathEnv(env_or_graph, target)
    options = {k: v for k, v in (("start", start), ("target", target)) if v is not None}
    obs, info = env.reset(seed=seed, options=options or None)
    total, steps = 0.0, 0
    while True:
        obs, reward, terminated, truncated, info = env.step(policy_fn(obs, info))
        total += float(reward)
        steps += 1
        if terminated or truncated:
            return PathRollout(tuple(info["path"]), total, bool(terminated), steps)


def optimal_policy(graph: WanGraph, *, gamma: float = DEFAULT_GAMMA, goal_reward: float | None = None) -> Policy:
    """The exact eq.11 optimum as a policy `(obs, info) -> action` for whichever target the observation
    names: what a perfectly trained agent with discount `gamma` would do on `PathEnv(graph, target,
    gamma=gamma, goal_reward=goal_reward)` (default goal: `goal_reward_for` that target, as when one agent is
    trained per target, like the paper's). `value_iteration` runs once per target, again after a link update.
    """
    names = graph.vertices
    n = len(names)
    tables: dict[int, np.ndarray] = {}
    version = [graph.version]

    def act(obs: np.ndarray, info: dict[str, Any]) -> int:
        if version[0] != graph.version:
            tables.clear()
            version[0] = graph.version
        t = int(np.argmax(obs[n:]))
        table = tables.get(t)
        if table is None:
            table = tables[t] = value_iteration(graph, names[t], gamma=gamma, goal_reward=goal_reward)[1]
        return int(table[int(np.argmax(obs[:n]))])

    return act


class PolicyPathFinder:
    """A `PathFinder` (hsched.costs.paths) driven by a policy trained on `PathEnv`: the hook for PER-DQN.

    As in the paper, the agent walks from the DC to the target (the entry vertex), and the walk is reversed:
    `path(src, dst)` rolls out with target = src, start = dst. A walk that does not arrive within
    `max_steps` gives None; a walk with loops is returned as-is (the selector rejects and reports it).
    Paths are cached per (src, dst) until `graph.version` moves, so the policy must be deterministic.
    """

    def __init__(self, graph: WanGraph, policy_fn: Policy, name: str = "agent", max_steps: int | None = None,
                 **env_kwargs: Any) -> None:
        self.graph = graph
        self.policy_fn = policy_fn
        self.name = name
        self.env = PathEnv(graph, max_steps=max_steps, **env_kwargs)
        self._cache: dict[tuple[str, str], VertexPath | None] = {}
        self._version = graph.version

    def path(self, src: str, dst: str) -> VertexPath | None:
        if self._version != self.graph.version:
            self._cache.clear()
            self._version = self.graph.version
        key = (src, dst)
        if key in self._cache:
            return self._cache[key]
        if src not in self.graph or dst not in self.graph:
            raise ValidationError("src" if src not in self.graph else "dst", "must name a vertex of the WAN",
                                  src if src not in self.graph else dst)
        found: VertexPath | None
        if src == dst:
            found = (src,)
        elif self.graph.dijkstra.path(src, dst) is None:
            found = None
        else:
            run = rollout_path(self.env, self.policy_fn, start=dst, target=src, seed=0)
            found = tuple(reversed(run.path)) if run.terminated else None
        self._cache[key] = found
        return found


if ENV_ID not in gymnasium.registry:
    gymnasium.register(id=ENV_ID, entry_point="hsched.envs.path:PathEnv")
