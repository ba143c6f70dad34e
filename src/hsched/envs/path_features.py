"""Graph-relative features of the path MDP (hsched.envs.path): what the graph-agnostic path agent sees.

The one-hot observation of `PathEnv` names vertices of one graph, so a network reading it is tied to that
graph. These features describe the same state (current vertex u, target t) in terms that exist on every
WAN, so one set of weights runs on any graph:

- per directed link u → v: its latency w(u, v) (the fastest of parallel links, floored at MIN_LATENCY_MS,
  as the env charges it);
- per vertex v: the great-circle (haversine) distance to the target, as fibre latency (km × 5 µs/km), and
  whether v is the target; its degree and the min / mean latency of its links.

Every latency is divided by the graph's own scale: the median link latency (`scale_ms`), so a small
national WAN and a continental one look alike to the network (hops of about 1 unit). Nothing here runs a
shortest-path algorithm: the haversine distance is geometry, a lower bound on any path's latency when links
are fibre over the great circle (the Topology Zoo loader's model), not the answer.

Pure numpy (no torch): the env side; hsched.rl.dqn turns it into tensors. Rebuilt when `graph.version`
moves (a link update changes latencies).
"""

from __future__ import annotations

import numpy as np

from hsched.costs.graph import WanGraph
from hsched.domain.fleet import FIBRE_MS_PER_KM
from hsched.traces.topology_zoo import EARTH_RADIUS_KM, MIN_LATENCY_MS

NODE_FEATURES = 5  # geo-to-target, is-target, log(1+degree), min link, mean link
EDGE_FEATURES = 3  # link latency, geo-to-target of the source, geo-to-target of the destination


def _geo_ms(coords: np.ndarray) -> np.ndarray:
    """[n, n] great-circle fibre latency (ms) between every pair of (lat, lon) degree rows."""
    lat, lon = np.radians(coords[:, 0]), np.radians(coords[:, 1])
    dlat = lat[:, None] - lat[None, :]
    dlon = lon[:, None] - lon[None, :]
    h = np.sin(dlat / 2) ** 2 + np.cos(lat)[:, None] * np.cos(lat)[None, :] * np.sin(dlon / 2) ** 2
    return 2 * EARTH_RADIUS_KM * np.arcsin(np.minimum(1.0, np.sqrt(h))) * FIBRE_MS_PER_KM


class GraphFeatures:
    """The graph-relative view of one WanGraph (vertex order = `graph.vertices`, as PathEnv's).

    Directed links are stored as CSR: the links leaving u are `src[ptr[u]:ptr[u+1]]` → `dst[...]`, and the
    action mask at u is exactly those destinations (a move along a missing link cannot be expressed).
    """

    def __init__(self, graph: WanGraph) -> None:
        self.graph = graph
        self._build()

    def _build(self) -> None:
        g = self.graph
        self.version = g.version
        self.vertices = g.vertices
        self.index = {v: i for i, v in enumerate(self.vertices)}
        n = self.n = len(self.vertices)
        coords = np.array([g.wan.vertices[v] for v in self.vertices], dtype=np.float64).reshape(n, 2)
        src, dst, lat = [], [], []
        for u in self.vertices:
            for v, data in sorted(g.graph.adj[u].items(), key=lambda kv: self.index[kv[0]]):
                src.append(self.index[u])
                dst.append(self.index[v])
                lat.append(max(float(data["latency_ms"]), MIN_LATENCY_MS))
        self.src = np.array(src, dtype=np.int64)
        self.dst = np.array(dst, dtype=np.int64)
        latency = np.array(lat, dtype=np.float64)
        self.scale_ms = float(max(np.median(latency), MIN_LATENCY_MS)) if len(latency) else 1.0
        self.w = (latency / self.scale_ms).astype(np.float32)  # per directed link, in graph units
        self.ptr = np.zeros(n + 1, dtype=np.int64)
        np.add.at(self.ptr, self.src + 1, 1)
        self.ptr = np.cumsum(self.ptr)
        self.geo = (_geo_ms(coords) / self.scale_ms).astype(np.float32)  # [v, t], graph units
        degree = np.diff(self.ptr)
        wmin = np.full(n, 0.0, dtype=np.float32)
        wmean = np.full(n, 0.0, dtype=np.float32)
        for u in range(n):
            ws = self.w[self.ptr[u]:self.ptr[u + 1]]
            if len(ws):
                wmin[u], wmean[u] = ws.min(), ws.mean()
        self._static = np.stack([np.log1p(degree).astype(np.float32), wmin, wmean], axis=1)

    def refresh(self) -> bool:
        """Rebuild after a link update (graph.version moved); returns whether it did."""
        if self.graph.version == self.version:
            return False
        self._build()
        return True

    @property
    def edges(self) -> int:
        return len(self.src)

    def neighbours(self, u: int) -> np.ndarray:
        """The vertices u links to (its legal moves), ascending."""
        return self.dst[self.ptr[u]:self.ptr[u + 1]]

    def mask(self, u: int) -> np.ndarray:
        """int8 over vertices, 1 = u links there: the same mask PathEnv puts in info["action_mask"]."""
        m = np.zeros(self.n, dtype=np.int8)
        m[self.neighbours(u)] = 1
        return m

    def node_features(self, t: int) -> np.ndarray:
        """[n, NODE_FEATURES] float32 for target t."""
        is_target = np.zeros((self.n, 1), dtype=np.float32)
        is_target[t] = 1.0
        return np.concatenate([self.geo[:, t:t + 1], is_target, self._static], axis=1)

    def edge_features(self, t: int) -> np.ndarray:
        """[edges, EDGE_FEATURES] float32 for target t (row i = directed link src[i] → dst[i])."""
        return np.stack([self.w, self.geo[self.src, t], self.geo[self.dst, t]], axis=1)

    def neighbour_features(self, u: int, t: int) -> tuple[np.ndarray, np.ndarray]:
        """(neighbours of u, [degree, 2] = (link latency, neighbour's geo-to-target)) in graph units."""
        lo, hi = self.ptr[u], self.ptr[u + 1]
        return self.dst[lo:hi], np.stack([self.w[lo:hi], self.geo[self.dst[lo:hi], t]], axis=1)

