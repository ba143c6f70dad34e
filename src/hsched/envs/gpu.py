"""Paper 000's multi-cluster GPU placement MDP (§2-3.1) as a Gymnasium environment (`hsched/GpuCluster-v0`).

Fleet. Several clusters (each a `DataCenter`, hosts with CPU, memory and GPU cards that have GPU memory and
GPU core; paper 000 eq.1-5). Every host of every cluster is one action: hosts are flattened cluster by
cluster (`MultiClusterState.offsets`), and the last action is "wait" (the delay action). Presets:

- `"paper000"` (default): paper 000 §4.1's scale, 16 clusters × 4 hosts = 64 hosts, drawn (seed 0,
  without replacement) from the real 2-GPU machines of the openb node list — T4 (104 cores, 512 GiB) and
  P100 (16 or 64 cores), all 16 GiB cards: the closest openb comes to the paper's one-model (P4) fleet.
  128 GPUs: 220 openb tasks (≈ 164 GPUs of demand) do not all fit, the regime of the paper's tables 6-9
  (182-209 of 220 deployed); the trace's few 4- and 8-GPU pods never fit a 2-GPU host (always "judged").
  See `paper000_datacenters`.
- `"default"`: the three GPU DCs of the default fleet (kansas-city from the openb node list, houston and
  indianapolis from the PAI 2020 machine table; 340 hosts, 1 316 GPUs).
- any sequence of DataCenters (e.g. from `parse_fleet`).

Tasks (paper 000 eq.6-7, §4.1 "220 tasks drawn at random from the data set, deployed in sequence"). At
every `reset(seed=s)` the env draws `n_tasks` pods uniformly without replacement from the openb pod list
(default `openb_pod_list_default`, all 8 152 pods, GPU-sharing, whole-GPU, multi-GPU and CPU-only alike;
`hsched.traces.openb.openb_pod_to_task`: GPU memory proportional to the core share of a 16 GiB card), with
the env's seeded generator, and queues them in trace order (FIFO). The same seed gives the same tasks, so
policies compared on one seed see the same workload. `tasks=` fixes the list instead.

One step = one decision about the task at the head of the queue (a task = one host, paper 000 §2):

- host h with room (action mask 1): the task is placed on h, its GPU slices on the cards
  `ClusterState.choose_cards` picks (a slice never spans cards); reward eq.15-17 of h's cluster
  (`hsched.metrics.placement_reward`, scores measured after the placement), in [−τ, 0], τ = 10.
- host h without room: the deployment fails, reward −50; the task is dropped (counted `failed`).
- wait (delay action): the task goes to the back of the queue and is offered again after the tasks
  queued behind it (by then releases may have made room). If some host had room, this is the paper's
  "a cluster could deploy it but the agent did not": reward −50. If no host had room it is a correct
  delay: reward `judged_reward` (0). A task delayed more than `max_waits` times (default 1: one retry)
  leaves the queue undeployed — as a correct judgement (eq.26's n_suc_jud) if nothing had room at its
  last delay, else as `failed`.

Time and releases. The clock advances one tick per step. With `runtime_scale_s=None` (default, paper 000's
setting: 220 tasks deployed in sequence, tables 6-9 read the state at the end) placed tasks hold their
resources until the episode ends; capacity then only shrinks, so a correctly delayed task never fits later
and the delay is the paper's "judged: no cluster can host it" (eq.26). With `runtime_scale_s=x`, a task
placed at tick t finishes at tick t + ceil(runtime_s / x) (its openb runtime compressed x:1; x = 60 makes a
minute of trace time one decision) and its resources are released then, before the next decision; a
delayed task can then fit when it comes round again (raise `max_waits` to let it wait longer).

Episode: terminated when the queue is empty (at most n_tasks × (max_waits + 1) steps); never truncated.

Observation (paper 000 eq.13, S = {R_a, Task}), a Dict of float32 arrays in [0, 1]:

- "hosts" [H, 6]: per host the remaining CPU, memory, GPU memory (all cards), GPU core (all cards), each
  divided by the largest host's capacity of that resource in the fleet (so hosts compare), then the best
  single card's idle core share and idle GPU memory (÷ the largest card's memory): a slice never spans
  cards, so the card-level room matters.
- "clusters" [N, 4]: per cluster the free share (1 − utilisation) of GPU memory, GPU core, CPU, memory
  (the paper's per-cluster state, its actor input "16×4"); 0 where a cluster lacks the resource.
- "task" [7]: the head task's CPU, memory, GPU count, GPU core percent and GPU memory per slice (scaled by
  the largest host / card, clipped to 1), its delays so far ÷ (max_waits + 1), and the queue length ÷ n_tasks.
- "hints" [H, 4]: heuristic scores of each host for the head task (`host_hints`): the Utilization
  heuristic's fit, the eq.16 Score the host's cluster would get with the task (the score-greedy expert's
  estimate, paper 000 §3.2) and two packing terms (`hsched.policies.heuristics.gpu_stranding`,
  `card_tightness`). Not part of the paper's state: inputs a learned policy can start from.

`info["action_mask"]` (int8 [H + 1], a fresh array every step): 1 for every host where the head task fits
now (`ClusterState.feasible` over all hosts, the placer's mask) and, last, 1 for "wait" only when no host
fits (the only delay the reward does not punish). Also `info["event"]` (what the last action did:
"placed", "failed", "delayed", "judged"), running counts "deployed", "judged", "failed", and at the end
`info["episode"]` = `episode_metrics()` (the paper's metrics, hsched.metrics).

Speed: all hosts of all clusters live in one set of NumPy arrays (`MultiClusterState`): each cluster's
ClusterState holds views into them, so one `feasible` call masks every host, an allocation on a cluster
is seen by the fleet-wide arrays at once, and per-step work is O(hosts) vectorised plus O(1) Python
(observation rows and utilisation rows are updated only for the hosts and clusters a step touched).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces

from hsched.domain.cluster import ClusterState, Part, rows_of
from hsched.domain.fleet import DataCenter, NodeTable, RoomLayout, load_fleet, parse_fleet
from hsched.domain.resources import MIB_PER_GIB, Resources
from hsched.domain.task import TaskSpec
from hsched.metrics import (
    FAILURE_REWARD,
    RESOURCES,
    TAU,
    TaskDistribution,
    deployed_count,
    mean_utilisation,
    paper_summary,
    placement_reward,
    utilisation_matrix,
    utilisation_row,
)
from hsched.policies.base import NodePolicy, select
from hsched.policies.fgd import FragmentationGradientDescent, openb_distribution, openb_tasks
from hsched.policies.heuristics import Utilization, card_tightness, gpu_stranding, make_policy

ENV_ID = "hsched/GpuCluster-v0"
OPENB_NODE_LIST = "alibaba_openb_gpu_2023/openb_node_list_gpu_node.csv"
# Card memory per openb GPU model (vendor specs; openb's G2/G3 are undisclosed: 24/32 GiB as in default.yaml).
OPENB_CARD_MEMORY_GIB = {"T4": 16, "P100": 16, "V100M16": 16, "V100M32": 32, "G2": 24, "G3": 32, "A10": 24}
HOST_FEATURES = ("free_cpu", "free_memory", "free_gpu_memory", "free_gpu_core", "best_card_core",
                 "best_card_memory")
TASK_FEATURES = ("cpu", "memory", "gpu_count", "gpu_core_percent", "gpu_memory", "waits", "queue")
HINT_FEATURES = ("fit", "cluster_score", "gpu_stranding", "card_tightness")
_UTILIZATION = Utilization()
EVENTS = ("placed", "failed", "delayed", "judged")


# ------------------------------------------------------------------------------------------------------------
# fleets


def paper000_datacenters(clusters: int = 16, hosts_per_cluster: int = 4, seed: int = 0,
                         gpus_per_host: int = 2, node_list: str | Path | None = None,
                         replace: bool = False) -> tuple[DataCenter, ...]:
    """Paper 000 §4.1's multi-cluster fleet: `clusters` × `hosts_per_cluster` hosts drawn uniformly without
    replacement (with, if `replace`: for fleets larger than the node list) by numpy seed `seed` from the openb
    GPU nodes with `gpus_per_host` GPUs, cluster k taking draws k·h … k·h + h − 1. Built through
    `parse_fleet` (validated like any fleet file)."""
    from hsched.traces import data_dir
    from hsched.traces.openb import load_openb_nodes

    nodes = [n for n in load_openb_nodes(node_list or data_dir() / OPENB_NODE_LIST) if n.gpu == gpus_per_host]
    need = clusters * hosts_per_cluster
    if need > len(nodes) and not replace:
        raise ValueError(f"{need} hosts asked, the node list has {len(nodes)} with {gpus_per_host} GPUs "
                         "(replace=True draws with replacement)")
    pick = np.random.default_rng(seed).choice(len(nodes), size=need, replace=replace)
    dcs = []
    for c in range(clusters):
        members = [nodes[i] for i in pick[c * hosts_per_cluster:(c + 1) * hosts_per_cluster]]
        pools: dict[tuple, int] = {}
        for n in members:  # one pool per distinct machine configuration, in draw order
            key = (n.cpu_milli, n.memory_mib, n.gpu, n.model)
            pools[key] = pools.get(key, 0) + 1
        dcs.append({
            "name": f"c{c:02d}", "vertex": "v",
            "prices": {"cpu_core_hour": 0.0, "memory_gib_hour": 0.0},
            "layout": {"racks": 1, "servers_per_rack": hosts_per_cluster, "rows": 1},
            "node_pools": [{"name": f"{model.lower()}-{cpu // 1000}c-{i}", "count": count,
                            "cpu_cores": cpu / 1000, "memory_gib": mem / MIB_PER_GIB, "bandwidth_mbps": 0,
                            "gpus": {"count": gpu, "model": model,
                                     "memory_gib": OPENB_CARD_MEMORY_GIB[model]}}
                           for i, ((cpu, mem, gpu, model), count) in enumerate(pools.items())],
        })
    fleet = parse_fleet({"version": 1, "name": "paper000", "network_price_per_gb_ms": 0.0,
                         "wan": {"vertices": [{"name": "v", "lat": 0.0, "lon": 0.0}],
                                 "scheduler_vertex": "v"},
                         "datacenters": dcs})
    return fleet.datacenters


def fleet_gpu_datacenters(path: str | Path | None = None) -> tuple[DataCenter, ...]:
    """The DCs of a fleet file (default: the embedded default fleet) that have GPUs."""
    return tuple(dc for dc in load_fleet(path).datacenters if any(p.gpu_count for p in dc.pools))


def scaled_datacenters(dcs: Sequence[DataCenter], factor: float) -> tuple[DataCenter, ...]:
    """The same DCs with every node pool's count × `factor` (rounded, at least 1): the same machine mix at
    another scale (quick runs, the 10× benchmark)."""
    out = []
    for dc in dcs:
        pools = tuple(dataclasses.replace(p, count=max(1, round(p.count * factor))) for p in dc.pools)
        n = sum(p.count for p in pools)
        layout = dc.layout if n <= dc.layout.slots else RoomLayout(racks=1, servers_per_rack=n, rows=1)
        out.append(dataclasses.replace(dc, pools=pools, layout=layout))
    return tuple(out)


def resolve_datacenters(datacenters: str | Sequence[DataCenter]) -> tuple[DataCenter, ...]:
    if isinstance(datacenters, str):
        if datacenters == "paper000":
            return paper000_datacenters()
        if datacenters == "default":
            return fleet_gpu_datacenters()
        raise ValueError(f"datacenters: unknown preset {datacenters!r}; use 'paper000', 'default' or "
                         "DataCenters")
    dcs = tuple(datacenters)
    if not dcs:
        raise ValueError("datacenters: at least one cluster is needed")
    return dcs


def sample_tasks(pool: Sequence[TaskSpec], n: int, rng: np.random.Generator) -> list[TaskSpec]:
    """`n` tasks drawn uniformly without replacement from `pool` (with replacement only if n > len(pool)),
    in pool (trace) order: the FIFO of paper 000 §4.3."""
    idx = np.sort(rng.choice(len(pool), size=n, replace=n > len(pool)))
    return [pool[i] for i in idx]


# ------------------------------------------------------------------------------------------------------------
# observation features (one definition, shared by the env and by the learned policies the placer serves)


def host_scale(table: NodeTable) -> np.ndarray:
    """What each of HOST_FEATURES is divided by: the largest host's CPU, memory, GPU memory and GPU core
    (summed over its cards) in `table`, 100 (a card's core percent), the largest card's memory."""
    return np.array([max(int(table.cpu_milli.max(initial=0)), 1), max(int(table.memory_mib.max(initial=0)), 1),
                     max(int(table.gpu_memory_mib.sum(axis=1).max(initial=0)), 1),
                     max(int(table.gpu_core_percent.sum(axis=1).max(initial=0)), 1), 100,
                     max(int(table.gpu_memory_mib.max(initial=0)), 1)], dtype=np.float64)


def task_scale(table: NodeTable) -> np.ndarray:
    """What the task's demand features (TASK_FEATURES[:5]) are divided by: the largest host's CPU and memory,
    the most GPUs on one host, 100 (core percent), the largest card's memory."""
    hs = host_scale(table)
    return np.array([hs[0], hs[1], max(int(table.gpu_count.max(initial=0)), 1), 100, hs[5]], dtype=np.float64)


def host_features(state: ClusterState, scale: np.ndarray, rows: slice | np.ndarray = slice(None),
                  out: np.ndarray | None = None) -> np.ndarray:
    """HOST_FEATURES of `state`'s hosts `rows` ([n, 6] float32, see the module docstring); written into `out`
    (a float32 [n, 6] view, e.g. the actor's item rows) when given."""
    core, gmem = rows_of(state.gpu_free_core, rows), rows_of(state.gpu_free_memory, rows)
    raw = (state.free_cpu[rows], state.free_memory[rows], gmem.sum(axis=1), core.sum(axis=1),
           core.max(axis=1, initial=0), gmem.max(axis=1, initial=0))
    if out is None:
        out = np.empty((len(raw[0]), len(raw)), dtype=np.float32)
    for j, column in enumerate(raw):  # raw / scale in float64, then rounded to float32 as it is stored
        np.divide(column, scale[j], out=out[:, j], casting="same_kind")
    return out


def demand_features(demands: Sequence[Resources], scale: np.ndarray) -> np.ndarray:
    """The demand part of TASK_FEATURES (the first 5) for each of `demands`: [n, 5] float32, clipped to 1."""
    raw = np.array([[d.cpu_milli, d.memory_mib, d.gpu_count, d.gpu_core_percent, d.gpu_memory_mib]
                    for d in demands], dtype=np.float64).reshape(len(demands), 5)
    return np.minimum(raw / scale, 1.0).astype(np.float32)


def free_shares(u: np.ndarray) -> np.ndarray:
    """The "clusters" observation from a utilisation matrix [N, 4]: 1 − utilisation, 0 where a cluster lacks
    the resource (NaN)."""
    # np.where rather than nan_to_num (~10 µs of Python per call, every EADE-DDPG decision): the same float32
    # values, as u is finite or NaN (a utilisation)
    return np.where(np.isnan(u), 0.0, 1.0 - u).astype(np.float32)


def cluster_totals(states: Sequence[ClusterState]) -> np.ndarray:
    """[N, 4] capacity of each cluster per resource, columns in RESOURCES order."""
    assert RESOURCES == ("gpu_memory", "gpu_core", "cpu", "memory")
    return np.array([[s.table.gpu_memory_mib.sum(), s.table.gpu_core_percent.sum(), s.table.cpu_milli.sum(),
                      s.table.memory_mib.sum()] for s in states], dtype=np.float64).reshape(len(states), 4)


def placement_scores(u: np.ndarray, totals: np.ndarray, demand: Resources) -> np.ndarray:
    """[N]: paper 000 eq.16's normalised Score each cluster c would get if `demand` were deployed on it
    (eq.15 utilisation of c measured after the placement, min/max over all clusters; 1 when all tie) — the
    score-greedy expert's estimate (§3.2); eq.17's reward is (Score − 1) τ. `u` = utilisation_matrix."""
    if len(u) == 1:  # one cluster is its own min and max: the formula's 1 (a placer serving its DC, every decision)
        return np.ones(1)
    add = np.array([demand.gpu_count * demand.gpu_memory_mib, demand.gpu_count * demand.gpu_core_percent,
                    demand.cpu_milli, demand.memory_mib], dtype=np.float64)
    share = np.divide(add, totals, out=np.zeros_like(totals), where=totals > 0)
    before = mean_utilisation(u)
    after = mean_utilisation(u + share)  # NaN columns (no such resource) stay NaN and are left out
    grid = np.repeat(before[None, :], len(before), axis=0)
    np.fill_diagonal(grid, after)  # row c: every cluster's score with the task on c
    lo, hi = grid.min(axis=1), grid.max(axis=1)
    return np.where(hi - lo > 1e-12, (after - lo) / np.maximum(hi - lo, 1e-300), 1.0)


def host_hints(state: ClusterState, demand: Resources, u: np.ndarray, totals: np.ndarray,
               host_cluster: np.ndarray, nodes: np.ndarray | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """HINT_FEATURES [n, 4] float32 of `state`'s hosts for `demand`: the Utilization heuristic's fit (cosine
    of the host's free and the task's demanded capacity shares, clipped to [0, 1]), the eq.16 Score of the
    host's cluster after the placement (`placement_scores`; hosts are in cluster `host_cluster[h]` of the
    utilisation matrix `u`), and the expert's two packing terms (`gpu_stranding`, `card_tightness`, in
    [0, 1]). Heuristic scores as inputs, so a learned policy can start from them. Written into `out` (a float32
    [n, 4] view) when given."""
    i = slice(None) if nodes is None else nodes  # `nodes`: those hosts' rows only (a bounded candidate set)
    fit = np.clip(_UTILIZATION.scores_at(state, demand, nodes), 0.0, 1.0)
    if out is None:
        out = np.empty((len(fit), len(HINT_FEATURES)), dtype=np.float32)
    # each column computed in float64 and rounded to float32 as it is stored
    out[:, 0] = fit
    out[:, 1] = placement_scores(u, totals, demand)[host_cluster[i]]
    out[:, 2] = gpu_stranding(state, demand, nodes)
    out[:, 3] = card_tightness(state, demand, nodes)
    return out


# ------------------------------------------------------------------------------------------------------------
# all clusters' hosts in one set of arrays


def _stack_tables(tables: Sequence[NodeTable]) -> NodeTable:
    cards = max(t.gpu_core_percent.shape[1] for t in tables)
    values: dict[str, Any] = {}
    pool_offset = np.cumsum([0] + [int(t.pool.max(initial=-1)) + 1 for t in tables])
    for f in dataclasses.fields(NodeTable):
        parts = [getattr(t, f.name) for t in tables]
        if isinstance(parts[0], tuple):
            values[f.name] = tuple(x for p in parts for x in p)
        elif parts[0].ndim == 2:
            values[f.name] = np.concatenate([np.pad(p, ((0, 0), (0, cards - p.shape[1]))) for p in parts])
        elif f.name == "pool":
            values[f.name] = np.concatenate([p + off for p, off in zip(parts, pool_offset, strict=False)])
        else:
            values[f.name] = np.concatenate(parts)
    return NodeTable(**values)


class MultiClusterState:
    """Several clusters' ClusterStates whose free arrays are views into one fleet-wide ClusterState.

    `fleet` (a ClusterState over every host, flattened cluster by cluster) is what masks and policies read:
    `fleet.feasible(demand)` masks all hosts at once, `select(policy, fleet, …)` ranks them. Allocations are
    applied through the owning cluster's state (`clusters[c]`, local node indices), which writes through
    the views, so both always agree. Host h belongs to cluster `host_cluster[h]`, local index
    h − offsets[c].
    """

    def __init__(self, datacenters: Sequence[DataCenter]) -> None:
        self.datacenters = tuple(datacenters)
        tables = [dc.node_table() for dc in self.datacenters]
        merged = _stack_tables(tables)
        n = len(merged)
        first = self.datacenters[0]
        fleet_dc = DataCenter(name="+".join(dc.name for dc in self.datacenters), vertex=first.vertex,
                              prices=first.prices, layout=RoomLayout(1, max(n, 1), 1),
                              pools=tuple(p for dc in self.datacenters for p in dc.pools))
        self.fleet = ClusterState(fleet_dc, merged)
        self.offsets = np.cumsum([0] + [len(t) for t in tables])
        self.host_cluster = np.repeat(np.arange(len(tables)), [len(t) for t in tables])
        self.clusters: list[ClusterState] = []
        for c, (dc, t) in enumerate(zip(self.datacenters, tables, strict=True)):
            s = ClusterState(dc, t)
            rows = slice(int(self.offsets[c]), int(self.offsets[c + 1]))
            cols = t.gpu_core_percent.shape[1]
            s.free_cpu, s.free_memory = self.fleet.free_cpu[rows], self.fleet.free_memory[rows]
            s.free_disk, s.free_bandwidth = self.fleet.free_disk[rows], self.fleet.free_bandwidth[rows]
            s.gpu_free_core = self.fleet.gpu_free_core[rows, :cols]
            s.gpu_free_memory = self.fleet.gpu_free_memory[rows, :cols]
            self.clusters.append(s)

    @property
    def hosts(self) -> int:
        return self.fleet.n

    def locate(self, host: int) -> tuple[int, int]:
        """(cluster index, node index inside that cluster) of a flattened host index."""
        c = int(self.host_cluster[host])
        return c, host - int(self.offsets[c])

    def apply_parts(self, task_id: str, parts: Sequence[Part]) -> list[int]:
        """Apply parts whose `node` is a flattened host index (e.g. a `plan()` on `fleet`) through the owning
        clusters' states (one allocation per cluster touched, id `task_id`); returns the clusters touched."""
        by_cluster: dict[int, list[Part]] = {}
        for p in parts:
            c, node = self.locate(p.node)
            by_cluster.setdefault(c, []).append(dataclasses.replace(p, node=node))
        done: list[int] = []
        try:
            for c, local in by_cluster.items():
                self.clusters[c].apply(task_id, tuple(local))
                done.append(c)
        except Exception:  # roll back the clusters already applied, then re-raise
            for c in done:
                self.clusters[c].release(task_id)
            raise
        return done

    def release(self, task_id: str) -> None:
        """Release `task_id` in every cluster that holds part of it."""
        for s in self.clusters:
            s.release(task_id)

    def place(self, task_id: str, host: int, demand: Resources) -> int:
        """Allocate one part of `demand` on `host` (cards: ClusterState.choose_cards); returns its cluster."""
        c, node = self.locate(host)
        s = self.clusters[c]
        s.apply(task_id, (Part(0, 0, node, demand.cpu_milli, demand.memory_mib, demand.disk_mib,
                               demand.bandwidth_mbps, s.choose_cards(node, demand)),))
        return c

    def reset(self) -> None:
        """Every host back to empty (in place: the views stay views)."""
        f, t = self.fleet, self.fleet.table
        f.free_cpu[:], f.free_memory[:] = t.cpu_milli, t.memory_mib
        f.free_disk[:], f.free_bandwidth[:] = t.disk_mib, t.bandwidth_mbps
        f.gpu_free_core[:], f.gpu_free_memory[:] = t.gpu_core_percent, t.gpu_memory_mib
        f.allocations.clear()
        for s in self.clusters:
            s.allocations.clear()


# ------------------------------------------------------------------------------------------------------------
# the environment


class GpuClusterEnv(gymnasium.Env[dict[str, np.ndarray], np.int64]):
    """Paper 000's multi-cluster GPU placement; see the module docstring for the MDP.

    Args:
        datacenters: "paper000" (16 × 4 openb hosts), "default" (the default fleet's 3 GPU DCs) or
            DataCenters.
        n_tasks: tasks per episode, drawn from `trace` at every reset (paper: 220).
        tasks: a fixed task list for every episode instead (n_tasks is then its length).
        trace: the pool tasks are drawn from: an openb pod-list path or TaskSpecs (default: the openb
            default pod list).
        runtime_scale_s: trace seconds per tick for releases; None = tasks hold resources to the episode end.
        max_waits: delays a task may take before it leaves the queue undeployed.
        tau, failure_reward, judged_reward: eq.17's τ, the failure reward (−50), the correct-delay reward (0).
    """

    # gymnasium declares metadata a class attribute
    metadata = {"render_modes": ["ansi"], "render_fps": 4}  # noqa: RUF012

    def __init__(self, datacenters: str | Sequence[DataCenter] = "paper000", *, n_tasks: int = 220,
                 tasks: Sequence[TaskSpec] | None = None,
                 trace: str | Path | Sequence[TaskSpec] | None = None,
                 runtime_scale_s: float | None = None, max_waits: int = 1, tau: float = TAU,
                 failure_reward: float = FAILURE_REWARD, judged_reward: float = 0.0,
                 render_mode: str | None = None) -> None:
        self.view = MultiClusterState(resolve_datacenters(datacenters))
        self.fixed_tasks = None if tasks is None else list(tasks)
        if self.fixed_tasks is not None:
            n_tasks = len(self.fixed_tasks)
        if n_tasks < 1:
            raise ValueError(f"n_tasks must be >= 1, got {n_tasks}")
        if runtime_scale_s is not None and not runtime_scale_s > 0:
            raise ValueError(f"runtime_scale_s must be > 0 or None, got {runtime_scale_s}")
        if max_waits < 0:
            raise ValueError(f"max_waits must be >= 0, got {max_waits}")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self.n_tasks = n_tasks
        self._trace = trace
        self._pool: tuple[TaskSpec, ...] | None = None
        self.runtime_scale_s = runtime_scale_s
        self.max_waits = max_waits
        self.tau, self.failure_reward = float(tau), float(failure_reward)
        self.judged_reward = float(judged_reward)
        self.render_mode = render_mode

        view = self.view
        H, N = view.hosts, len(view.clusters)
        self.wait_action = H
        self._host_scale = host_scale(view.fleet.table)
        self._host_scale_list = self._host_scale.tolist()
        self._task_scale = task_scale(view.fleet.table)
        self.observation_space = spaces.Dict({
            "hosts": spaces.Box(0.0, 1.0, shape=(H, len(HOST_FEATURES)), dtype=np.float32),
            "clusters": spaces.Box(0.0, 1.0, shape=(N, len(RESOURCES)), dtype=np.float32),
            "task": spaces.Box(0.0, 1.0, shape=(len(TASK_FEATURES),), dtype=np.float32),
            "hints": spaces.Box(0.0, 1.0, shape=(H, len(HINT_FEATURES)), dtype=np.float32),
        })
        self.action_space = spaces.Discrete(H + 1)
        self._distribution: TaskDistribution | None = None
        self.tasks: list[TaskSpec] = []
        self._reset_episode([])

    # -- public helpers --------------------------------------------------------------------------------------

    @property
    def pool(self) -> tuple[TaskSpec, ...]:
        """The tasks episodes are drawn from."""
        if self._pool is None:
            trace = self._trace
            is_path = trace is None or isinstance(trace, str | Path)
            self._pool = openb_tasks(trace) if is_path else tuple(trace)
            if not self._pool:
                raise ValueError("trace: the task pool is empty")
        return self._pool

    @property
    def distribution(self) -> TaskDistribution:
        """The workload's request histogram (the pool's, or the fixed tasks'), for FGD's fragmentation."""
        if self._distribution is None:
            if self.fixed_tasks is None and (self._trace is None or isinstance(self._trace, str | Path)):
                self._distribution = openb_distribution(self._trace)  # cached: envs on one trace share it
            else:
                self._distribution = TaskDistribution.from_tasks(self.fixed_tasks or self.pool)
        return self._distribution

    @property
    def clusters(self) -> list[ClusterState]:
        return self.view.clusters

    @property
    def current_task(self) -> TaskSpec | None:
        """The task the next action decides about (None once the queue is empty)."""
        return self.tasks[self._queue[0]] if self._queue else None

    def episode_metrics(self) -> dict[str, float]:
        """Paper 000's metrics on the current state (hsched.metrics): tables 6-9's utilisation mean/σ per
        resource across clusters, eq.26, eq.27, eq.28 (GPU memory + GPU core), eq.9, and FGD's expected
        fragmentation w.r.t. the workload (in GPUs, and as a share of the idle GPUs)."""
        # self._u == utilisation_matrix(self.clusters), kept up to date step by step; FGD over the fleet-wide
        # state: every node of every cluster in one array, one vectorised call
        out = {"tasks": float(len(self.tasks)), "deployed": float(self.deployed),
               "judged": float(self.judged), "failed": float(self.failed),
               "eq26": float(deployed_count(self.deployed, self.judged))}
        out.update(paper_summary(self._u, [self.view.fleet], self.distribution))
        return out

    # -- gymnasium API ---------------------------------------------------------------------------------------

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        super().reset(seed=seed)
        tasks = self.fixed_tasks if self.fixed_tasks is not None else sample_tasks(self.pool, self.n_tasks,
                                                                                    self.np_random)
        self._reset_episode(tasks)
        return self._obs(), self._info("reset")

    def step(self, action: int | np.integer
             ) -> tuple[dict[str, np.ndarray], float, bool, bool, dict[str, Any]]:
        if not self._queue:
            raise RuntimeError("step() after the episode ended: call reset()")
        a = int(action)
        if not 0 <= a <= self.wait_action:
            raise ValueError(f"action must be a host index 0..{self.wait_action - 1} or {self.wait_action} "
                             f"(wait), got {a}")
        k = self._queue.popleft()
        task = self.tasks[k]
        any_room = self._any_room
        if a == self.wait_action:
            reward = self.failure_reward if any_room else self.judged_reward
            self._waits[k] += 1
            if self._waits[k] <= self.max_waits:
                self._queue.append(k)
                event = "delayed"
            elif any_room:
                self.failed += 1
                event = "failed"
            else:
                self.judged += 1
                event = "judged"
        elif self._room[a]:
            c = self.view.place(f"t{k}", a, task.resources)
            self.deployed += 1
            self._touch(a, c)
            reward = placement_reward(self._scores, c, self.tau)
            if self.runtime_scale_s is not None:
                end = self._tick + max(1, math.ceil(task.runtime_s / self.runtime_scale_s))
                heapq.heappush(self._running, (end, k, a, c))
            event = "placed"
        else:
            reward = self.failure_reward
            self.failed += 1
            event = "failed"
        self._tick += 1
        while self._running and self._running[0][0] <= self._tick:
            _, done, host, c = heapq.heappop(self._running)
            self.view.clusters[c].release(f"t{done}")
            self._touch(host, c)
        terminated = not self._queue
        self._update_room()
        info = self._info(event)
        if terminated:
            info["episode"] = self.episode_metrics()
        return self._obs(), float(reward), terminated, False, info

    def render(self) -> str | None:
        if self.render_mode != "ansi":
            return None
        u = self._u
        lines = [f"tick {self._tick}: queue {len(self._queue)}, deployed {self.deployed}, "
                 f"judged {self.judged}, failed {self.failed}"]
        for c, s in enumerate(self.view.clusters):
            row = ", ".join(f"{r} {u[c, j]:.2f}" for j, r in enumerate(RESOURCES))
            lines.append(f"  {s.dc.name}: {row}")
        return "\n".join(lines)

    # -- internals -------------------------------------------------------------------------------------------

    def _reset_episode(self, tasks: list[TaskSpec]) -> None:
        self.view.reset()
        self.tasks = list(tasks)
        self._queue: deque[int] = deque(range(len(self.tasks)))
        self._task_features = demand_features([t.resources for t in self.tasks], self._task_scale)
        self._waits = np.zeros(len(self.tasks), dtype=np.int64)
        self._running: list[tuple[int, int, int, int]] = []
        self._tick = 0
        self.deployed = self.judged = self.failed = 0
        if not hasattr(self, "_present"):
            self._present = ~np.isnan(utilisation_matrix(self.view.clusters))  # resources each cluster has
            self._totals = cluster_totals(self.view.clusters)
        self._u = np.where(self._present, 0.0, np.nan)  # empty clusters (view.reset)
        self._scores = mean_utilisation(self._u)
        self._free = free_shares(self._u)  # the "clusters" observation
        self._host_obs = np.zeros((self.view.hosts, len(HOST_FEATURES)), dtype=np.float32)
        self._host_obs[:] = host_features(self.view.fleet, self._host_scale)
        self._update_room()

    def _touch(self, host: int, c: int) -> None:
        """Refresh what an allocation or release on `host` (cluster c) changed: its observation row and c's
        utilisation row and eq.8 score."""
        f, sc = self.view.fleet, self._host_scale_list
        # host_features for one row, on Python scalars: 6 values do not pay for numpy's per-call overhead
        core, gmem = f.gpu_free_core[host].tolist(), f.gpu_free_memory[host].tolist()
        self._host_obs[host] = [f.free_cpu.item(host) / sc[0], f.free_memory.item(host) / sc[1],
                                sum(gmem) / sc[2], sum(core) / sc[3], max(core) / sc[4], max(gmem) / sc[5]]
        row = utilisation_row(self.view.clusters[c], present=self._present[c])
        self._u[c] = row
        self._scores[c] = mean_utilisation(row)[0]
        self._free[c] = [0.0 if x != x else 1.0 - x for x in row.tolist()]  # x != x: NaN, no such resource

    def _update_room(self) -> None:
        if self._queue:
            task = self.tasks[self._queue[0]]
            self._room = self.view.fleet.feasible(task.resources, task.gpu_models)
            self._any_room = bool(self._room.any())
        else:
            self._room = np.zeros(self.view.hosts, dtype=bool)
            self._any_room = False

    def _obs(self) -> dict[str, np.ndarray]:
        task_vec = np.zeros(len(TASK_FEATURES), dtype=np.float32)
        hints = np.zeros((self.view.hosts, len(HINT_FEATURES)), dtype=np.float32)
        if self._queue:
            k = self._queue[0]
            task_vec[:5] = self._task_features[k]
            task_vec[5] = self._waits[k] / (self.max_waits + 1)
            task_vec[6] = len(self._queue) / len(self.tasks)
            hints = host_hints(self.view.fleet, self.tasks[k].resources, self._u, self._totals,
                               self.view.host_cluster)
        return {"hosts": self._host_obs.copy(), "clusters": self._free.copy(), "task": task_vec, "hints": hints}

    def _info(self, event: str) -> dict[str, Any]:
        mask = np.empty(self.view.hosts + 1, dtype=np.int8)
        mask[:-1] = self._room
        mask[-1] = bool(self._queue) and not self._any_room
        return {"action_mask": mask, "event": event, "deployed": self.deployed, "judged": self.judged,
                "failed": self.failed}


# ------------------------------------------------------------------------------------------------------------
# running a NodePolicy in the env


@dataclass(frozen=True)
class EpisodeResult:
    reward: float  # the episode's summed eq.15-17 reward
    steps: int
    metrics: dict[str, float]  # GpuClusterEnv.episode_metrics() at the end


# The heuristic baselines every GPU comparison runs (`hsched eval gpu`'s rows, the trainers' paired comparisons):
# (policy name, label).
GPU_BASELINES: tuple[tuple[str, str], ...] = (
    ("bestfit", "BestFit"),
    ("firstfit", "Greedy (paper 000: first fit)"),
    ("greedy", "Greedy (paper 003: most utilised)"),
    ("random", "Random"),
    ("utilization", "Utilization"),
    ("fgd", "FGD"),
)


def policy_for(name: str, env: GpuClusterEnv, seed: int) -> NodePolicy:
    """The baseline `name` of GPU_BASELINES for `env` (FGD needs the env's task distribution)."""
    if name == "fgd":
        return FragmentationGradientDescent(env.distribution)
    return make_policy(name, seed)


def run_policy(env: gymnasium.Env, policy: NodePolicy, *, seed: int | None = None,
               options: dict[str, Any] | None = None) -> EpisodeResult:
    """One episode of `policy` in a GpuClusterEnv (wrapped or not), decided exactly as the placer decides:
    the mask is `ClusterState.feasible` over every host (`info["action_mask"]`), the choice is
    `hsched.policies.base.select` over the fleet-wide ClusterState, and "wait" when no host has room."""
    base = env.unwrapped
    if not isinstance(base, GpuClusterEnv):
        raise TypeError(f"run_policy needs a GpuClusterEnv, got {type(base).__name__}")
    _, info = env.reset(seed=seed, options=options)
    total, steps = 0.0, 0
    while True:
        task = base.current_task
        assert task is not None
        room = info["action_mask"][:-1].astype(bool)
        choice = select(policy, base.view.fleet, task.resources, room)
        _, reward, terminated, truncated, info = env.step(base.wait_action if choice is None else choice.node)
        total += reward
        steps += 1
        if terminated or truncated:
            return EpisodeResult(total, steps, info.get("episode") or base.episode_metrics())


if ENV_ID not in gymnasium.registry:
    gymnasium.register(id=ENV_ID, entry_point="hsched.envs.gpu:GpuClusterEnv")
