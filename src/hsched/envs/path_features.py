"""Graph-relative features of the path MDP (hsched.envs.path): what the graph-agnostic path agent sees.

The one-hot observation of `PathEnv` names vertices of one graph, so a network reading it is tied to that
graph. The agent instead reads the graph itself, in terms that exist on every WAN, so one set of weights
runs on any graph: per directed link u → v (the current vertex's legal moves are its links)

- its latency w(u, v) (the fastest of parallel links, floored at MIN_LATENCY_MS, as the env charges it), and
- its great-circle length (haversine distance × 5 µs/km, as fibre latency): geometry, which equals the
  latency for a Topology Zoo link and differs where a fleet file gives measured latencies.

Every latency is divided by the graph's own scale, the median link latency (`scale_ms`), so a small national
WAN and a continental one look alike to the network (links of about 1 unit). None of these features depends
on the target: the target enters as the vertex where the agent's cost-to-go is 0 (hsched.rl.dqn).

Pure numpy (no torch): the env side; hsched.rl.dqn turns it into tensors. Rebuilt when `graph.version`
moves (a link update changes latencies).
"""

from __future__ import annotations

import numpy as np

from hsched.costs.graph import WanGraph
from hsched.domain.fleet import FIBRE_MS_PER_KM
from hsched.traces.topology_zoo import EARTH_RADIUS_KM, MIN_LATENCY_MS

LINK_FEATURES = 2  # latency, great-circle length (graph units)


def _geo_ms(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Great-circle fibre latency (ms) between matching (lat, lon) degree rows of a and b."""
    lat1, lon1, lat2, lon2 = np.radians(a[:, 0]), np.radians(a[:, 1]), np.radians(b[:, 0]), np.radians(b[:, 1])
    h = np.sin((lat2 - lat1) / 2) ** 2 + np.cos(lat1) * np.cos(lat2) * np.sin((lon2 - lon1) / 2) ** 2
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
        length = (_geo_ms(coords[self.src], coords[self.dst]) / self.scale_ms).astype(np.float32)
        self.link_x = np.stack([self.w, length], axis=1).reshape(-1, LINK_FEATURES)

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

    def link(self, u: int, v: int) -> int:
        """The row of link u → v (u's links are sorted by destination); KeyError if there is none."""
        lo, hi = int(self.ptr[u]), int(self.ptr[u + 1])
        i = lo + int(np.searchsorted(self.dst[lo:hi], v))
        if i == hi or self.dst[i] != v:
            raise KeyError(f"no link {u} → {v}")
        return i

    def mask(self, u: int) -> np.ndarray:
        """int8 over vertices, 1 = u links there: the same mask PathEnv puts in info["action_mask"]."""
        m = np.zeros(self.n, dtype=np.int8)
        m[self.neighbours(u)] = 1
        return m
