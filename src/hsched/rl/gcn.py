"""Graph embeddings of job DAGs (Decima, Mao et al. SIGCOMM'19 §5.1; used by papers 004 and 001), plain torch.

A *graph batch* holds several observations; an observation holds several DAGs (the jobs in the system); a
DAG holds nodes (stages) with a feature vector each and (parent, child) edges. Three embeddings come out:

- **node**: information flows from children to parents, so a stage's embedding summarises everything that
  depends on it (the critical path below it, the work it unlocks):

      e_v = h(x_v) + [v has children] · g( Σ_{u ∈ children(v)} f(e_u) )

  computed leaves first, one *level* at a time (a node's level is the length of its longest path to a
  leaf: all its children are on lower levels, so one pass over the levels is exact — no fixed number of
  message-passing rounds to tune). `h` projects the raw features; f, g are small MLPs shared by all levels.
- **DAG summary**: y_i = g_d( Σ_{v ∈ DAG i} f_d([x_v, e_v]) )
- **global summary** (per observation): z = g_z( Σ_{DAG i ∈ observation} f_z(y_i) )

Sums (not means) as in Decima: the size of a DAG and the number of jobs are information a scheduler needs.

API (stable; other modules build on it):

    batch = GraphBatch.build([[DagGraph(features, edges), ...], ...])   # observations × DAGs
    gcn = DagGCN(in_features=F, seed=0)                                   # hidden=16, embed=8 (Decima)
    out = gcn(batch)        # GcnOutput(node [N, E], dag [D, E], global_ [O, E])

Row order: `out.node` follows the nodes observation by observation, DAG by DAG, node by node
(`batch.node_dag[n]` is node n's DAG row, `batch.dag_obs[d]` DAG d's observation row); `out.dag` follows
the DAGs in the same order; `out.global_` has one row per observation. `batch.node_offsets[d]` is the
first node row of DAG d. Deterministic: the weights depend only on `seed` (or torch's global RNG when
None), and the forward pass uses only index_add/index_copy on the CPU, deterministic under
`torch.use_deterministic_algorithms(True)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from torch import nn

from hsched.domain.dag import paths_to_end

HIDDEN = 16  # Decima's hidden width
EMBED = 8    # Decima's embedding width


@dataclass(frozen=True)
class DagGraph:
    """One DAG: `features` [n, F] (one row per node) and (parent, child) edges on node indices 0..n-1."""

    features: np.ndarray
    edges: Sequence[tuple[int, int]]


def node_levels(num_nodes: int, edges: Sequence[tuple[int, int]]) -> np.ndarray:
    """Per node, the length of its longest path to a leaf (leaves: 0). Raises ValueError on a cycle."""
    parents: list[list[int]] = [[] for _ in range(num_nodes)]
    for p, c in edges:
        if not (0 <= p < num_nodes and 0 <= c < num_nodes):
            raise ValueError(f"edges: ({p}, {c}) names a node outside 0..{num_nodes - 1}")
        parents[c].append(p)
    # nodes on the longest chain below, itself included, minus one (exact in floats at any DAG size here)
    return np.asarray(paths_to_end([1.0] * num_nodes, parents, "edges"), dtype=np.int64).reshape(num_nodes) - 1


@lru_cache(maxsize=8192)
def _levels(num_nodes: int, edges: tuple[tuple[int, int], ...]) -> np.ndarray:
    """`node_levels`, cached: a scheduler sees the same few job shapes at every decision."""
    levels = node_levels(num_nodes, edges)
    levels.flags.writeable = False
    return levels


@dataclass(frozen=True)
class GraphBatch:
    """Observations × DAGs × nodes flattened into tensors (build with `GraphBatch.build`)."""

    x: torch.Tensor              # [N, F] float32 node features
    node_dag: torch.Tensor       # [N] int64: the DAG row of each node
    dag_obs: torch.Tensor        # [D] int64: the observation row of each DAG
    num_obs: int
    node_offsets: torch.Tensor   # [D + 1] int64: DAG d's nodes are rows node_offsets[d]:node_offsets[d+1]
    # per level 1..max: (nodes of that level, for each edge into the level: position of its parent in
    # that level's node list, child row)
    levels: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...]

    @property
    def num_nodes(self) -> int:
        return int(self.x.shape[0])

    @property
    def num_dags(self) -> int:
        return int(self.dag_obs.shape[0])

    @staticmethod
    def build(observations: Sequence[Sequence[DagGraph]], in_features: int | None = None) -> GraphBatch:
        """Flatten `observations` (each a sequence of DAGs; an observation may have no DAG)."""
        xs: list[np.ndarray] = []
        node_dag: list[np.ndarray] = []
        dag_obs: list[int] = []
        offsets = [0]
        level_nodes: dict[int, list[np.ndarray]] = {}
        level_edges: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        base = 0
        width = in_features
        for o, dags in enumerate(observations):
            for dag in dags:
                feats = np.asarray(dag.features, dtype=np.float32)
                if feats.ndim != 2:
                    raise ValueError(f"features: expected a 2-D [nodes, features] array, got shape {feats.shape}")
                if width is None:
                    width = feats.shape[1]
                if feats.shape[1] != width:
                    raise ValueError(f"features: {feats.shape[1]} columns, expected {width}")
                n = feats.shape[0]
                d = len(dag_obs)
                lv = _levels(n, tuple(map(tuple, dag.edges)))
                edges = np.asarray(list(dag.edges), dtype=np.int64).reshape(-1, 2)
                for level in np.unique(lv[lv > 0]):
                    level_nodes.setdefault(int(level), []).append(np.flatnonzero(lv == level) + base)
                    into = edges[lv[edges[:, 0]] == level] if len(edges) else edges
                    level_edges.setdefault(int(level), []).append((into[:, 0] + base, into[:, 1] + base))
                xs.append(feats)
                node_dag.append(np.full(n, d, dtype=np.int64))
                dag_obs.append(o)
                base += n
                offsets.append(base)
        width = width if width is not None else 0
        levels = []
        for level in sorted(level_nodes):
            nodes = np.concatenate(level_nodes[level])
            position = np.full(base, -1, dtype=np.int64)
            position[nodes] = np.arange(len(nodes))
            parents = np.concatenate([p for p, _ in level_edges[level]])
            children = np.concatenate([c for _, c in level_edges[level]])
            levels.append((torch.from_numpy(nodes), torch.from_numpy(position[parents]), torch.from_numpy(children)))
        return GraphBatch(
            x=torch.from_numpy(np.concatenate(xs) if xs else np.zeros((0, width), dtype=np.float32)),
            node_dag=torch.from_numpy(np.concatenate(node_dag) if node_dag else np.zeros(0, dtype=np.int64)),
            dag_obs=torch.tensor(dag_obs, dtype=torch.int64),
            num_obs=len(observations),
            node_offsets=torch.tensor(offsets, dtype=torch.int64),
            levels=tuple(levels),
        )


@dataclass(frozen=True)
class GcnOutput:
    node: torch.Tensor     # [N, embed]
    dag: torch.Tensor      # [D, embed]
    global_: torch.Tensor  # [O, embed]


def _mlp(inputs: int, hidden: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(inputs, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, outputs))


class DagGCN(nn.Module):
    """Decima's graph neural network: node, per-DAG and per-observation embeddings (see module docstring)."""

    def __init__(self, in_features: int, *, hidden: int = HIDDEN, embed: int = EMBED, seed: int | None = None) -> None:
        super().__init__()
        self.in_features, self.hidden, self.embed = in_features, hidden, embed
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            self.prep = _mlp(in_features, hidden, embed)           # h
            self.message = _mlp(embed, hidden, embed)              # f
            self.update = _mlp(embed, hidden, embed)               # g
            self.dag_in = _mlp(in_features + embed, hidden, embed)  # f_d
            self.dag_out = _mlp(embed, hidden, embed)              # g_d
            self.global_in = _mlp(embed, hidden, embed)            # f_z
            self.global_out = _mlp(embed, hidden, embed)           # g_z

    def node_embeddings(self, batch: GraphBatch) -> torch.Tensor:
        e = self.prep(batch.x)
        for nodes, parent_pos, children in batch.levels:
            msg = torch.zeros(len(nodes), self.embed, dtype=e.dtype).index_add(0, parent_pos, self.message(e[children]))
            e = e.index_copy(0, nodes, e[nodes] + self.update(msg))
        return e

    def forward(self, batch: GraphBatch) -> GcnOutput:
        if batch.x.shape[1] != self.in_features:
            raise ValueError(f"features: {batch.x.shape[1]} columns, this GCN takes {self.in_features}")
        node = self.node_embeddings(batch)
        per_node = self.dag_in(torch.cat([batch.x, node], dim=1))
        dag = self.dag_out(torch.zeros(batch.num_dags, self.embed, dtype=node.dtype).index_add(0, batch.node_dag, per_node))
        per_dag = self.global_in(dag)
        glob = self.global_out(torch.zeros(batch.num_obs, self.embed, dtype=node.dtype).index_add(0, batch.dag_obs, per_dag))
        return GcnOutput(node=node, dag=dag, global_=glob)
