"""Path finders: how a task's data is routed from its entry vertex to a DC.

`PathFinder` is the small interface the selector calls; the learned PER-DQN agent (paper 003 §2.1)
implements it too. `DijkstraPathFinder` is the exact reference and the safety net; `RandomPathFinder` is
the CRF baseline's "random communication path".
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import networkx as nx

from hsched.domain.errors import ValidationError

if TYPE_CHECKING:
    from hsched.costs.graph import WanGraph

VertexPath = tuple[str, ...]


@runtime_checkable
class PathFinder(Protocol):
    name: str

    def path(self, src: str, dst: str) -> VertexPath | None:
        """Vertices from src to dst inclusive ((src,) when src == dst), or None if dst is unreachable."""
        ...


def _check_vertex(graph: WanGraph, field: str, vertex: str) -> None:
    if vertex not in graph:
        raise ValidationError(field, "must name a vertex of the WAN", vertex)


class DijkstraPathFinder:
    """Exact lowest-latency paths (networkx single_source_dijkstra).

    One Dijkstra run per source vertex yields the paths to every vertex; they are cached and dropped when
    `graph.version` moves, so a warm request is a dictionary lookup (DESIGN §6: ~1.3 ms per run on
    1 000 vertices, about three gRPC hops, so it must never run per request).
    """

    name = "dijkstra"

    def __init__(self, graph: WanGraph) -> None:
        self.graph = graph
        self.runs = 0  # Dijkstra runs so far; tests and benchmarks check the cache with it
        self._version = graph.version
        self._trees: dict[str, dict[str, VertexPath]] = {}

    def paths_from(self, src: str) -> Mapping[str, VertexPath]:
        """Shortest paths from src to every reachable vertex (cached per src)."""
        if self._version != self.graph.version:
            self._trees.clear()
            self._version = self.graph.version
        tree = self._trees.get(src)
        if tree is None:
            _check_vertex(self.graph, "src", src)
            _, paths = nx.single_source_dijkstra(self.graph.graph, src, weight="latency_ms")
            tree = self._trees[src] = {v: tuple(p) for v, p in paths.items()}
            self.runs += 1
        return tree

    def warm(self, sources: Iterable[str]) -> None:
        """Precompute the trees of the entry vertices (at start-up and after a link update)."""
        for src in sources:
            self.paths_from(src)

    def path(self, src: str, dst: str) -> VertexPath | None:
        tree = self.paths_from(src)
        found = tree.get(dst)
        if found is None:
            _check_vertex(self.graph, "dst", dst)
        return found


class RandomPathFinder:
    """A random simple path: a random walk that never revisits a vertex and restarts at dead ends.

    After `max_attempts` failed walks it falls back to the Dijkstra path (counted in `fallbacks`), so it
    always answers when dst is reachable. Seeded, so a baseline run is reproducible. A walk costs up to
    O(V): instant on the paper's 12-vertex WAN, ~1 ms per DC on a 1 000-vertex Zoo graph (a baseline,
    not a serving path).
    """

    name = "random"

    def __init__(self, graph: WanGraph, seed: int | None = 0, max_attempts: int = 64) -> None:
        self.graph = graph
        self.rng = random.Random(seed)
        self.max_attempts = max_attempts
        self.fallbacks = 0

    def path(self, src: str, dst: str) -> VertexPath | None:
        _check_vertex(self.graph, "src", src)
        _check_vertex(self.graph, "dst", dst)
        exact = self.graph.dijkstra
        if src == dst or exact.path(src, dst) is None:  # cached lookup; spares hopeless walks
            return exact.path(src, dst)
        adj = self.graph.graph.adj
        for _ in range(self.max_attempts):
            walk, seen, here = [src], {src}, src
            while here != dst:
                options = [v for v in adj[here] if v not in seen]
                if not options:
                    break  # dead end: restart from src
                here = self.rng.choice(options)
                walk.append(here)
                seen.add(here)
            else:
                return tuple(walk)
        self.fallbacks += 1
        return exact.path(src, dst)
