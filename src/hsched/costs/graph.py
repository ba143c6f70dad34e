"""The WAN as a weighted graph whose link metrics can change at run time.

Link weight = latency (paper 003: communication cost is set by delay, delay by distance). Measured
latency/jitter/loss/bandwidth arrive on the link-metrics stream (paper 002) and are applied with
`update_link`, which bumps `version`; every cache derived from the graph (shortest-path trees, path
metrics) is keyed on that version, so nothing stale survives an update.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise

import networkx as nx

from hsched.costs.network import PathMetrics
from hsched.costs.paths import DijkstraPathFinder
from hsched.domain.errors import ValidationError
from hsched.domain.fleet import MAX_LINK_MS, Link, Wan

_METRICS = ("latency_ms", "jitter_ms", "loss_percent", "bandwidth_mbps")  # what a probe may update
_METRICS_CACHE_LIMIT = 65_536  # distinct paths; random (CRF) paths could otherwise grow it without bound


class WanGraph:
    """A networkx.Graph of the WAN, one edge per vertex pair.

    Parallel links between the same pair collapse to the one with the lowest latency: routing picks the
    fastest member of a bundle, a simple graph is what Dijkstra and the path agent (action = next vertex)
    work on, and a probe measures the pair, not an individual cable. `graph` is read-only for callers:
    mutate through `update_link` so `version` moves.
    """

    def __init__(self, wan: Wan) -> None:
        self.wan = wan
        self.graph = nx.Graph()
        self.graph.add_nodes_from(wan.vertices)
        for i, link in enumerate(wan.links):
            for end, key in ((link.a, "a"), (link.b, "b")):
                if end not in wan.vertices:
                    raise ValidationError(f"wan.links[{i}].{key}", "must name a vertex", end)
            if link.a == link.b:
                raise ValidationError(f"wan.links[{i}].b", "must differ from a (no self-loops)", link.b)
            kept = self.graph.get_edge_data(link.a, link.b)
            if kept is None or link.latency_ms < kept["latency_ms"]:
                self.graph.add_edge(link.a, link.b, distance_km=link.distance_km, latency_ms=link.latency_ms,
                                    jitter_ms=link.jitter_ms, loss_percent=link.loss_percent,
                                    bandwidth_mbps=link.bandwidth_mbps)
        # each link's metrics as the fleet file gives them: what `update_link(reset=True)` goes back to
        self._as_filed = {frozenset((a, b)): {k: data[k] for k in _METRICS} for a, b, data in self.graph.edges(data=True)}
        self.version = 0
        self._metrics: dict[tuple[str, ...], PathMetrics] = {}
        self._metrics_version = 0
        self._dijkstra: DijkstraPathFinder | None = None

    def __contains__(self, vertex: object) -> bool:
        return vertex in self.graph

    @property
    def vertices(self) -> tuple[str, ...]:
        return tuple(self.graph)

    def neighbors(self, vertex: str) -> tuple[str, ...]:
        return tuple(self.graph.adj[vertex])

    def link(self, a: str, b: str) -> Link:
        """A snapshot of the current metrics of the a–b link (KeyError if there is none)."""
        data = self.graph.adj[a][b]
        return Link(a, b, data["distance_km"], data["latency_ms"], data["bandwidth_mbps"], data["jitter_ms"],
                    data["loss_percent"])

    @property
    def dijkstra(self) -> DijkstraPathFinder:
        """The shared exact path finder, so every user of this graph shares one shortest-path cache."""
        if self._dijkstra is None:
            self._dijkstra = DijkstraPathFinder(self)
        return self._dijkstra

    def update_link(self, a: str, b: str, *, latency_ms: float | None = None, jitter_ms: float | None = None,
                    loss_percent: float | None = None, bandwidth_mbps: float | None = None,
                    reset: bool = False) -> bool:
        """Apply a measured metric update to the a–b link; returns whether anything changed. `reset`: every metric
        back to the fleet file's (a probe's earlier update no longer applies; no metric may be given with it).

        Everything is validated before anything is written. `version` moves only on a real change, so a
        probe that keeps reporting the same value does not flush the path caches.
        """
        for name, vertex in (("a", a), ("b", b)):
            if vertex not in self.graph:
                raise ValidationError(name, "must name a vertex of the WAN", vertex)
        data = self.graph.get_edge_data(a, b)
        if data is None:
            raise ValidationError("b", f"must be linked to {a!r} (there is no {a}–{b} link)", b)
        given = {"latency_ms": latency_ms, "jitter_ms": jitter_ms, "loss_percent": loss_percent,
                 "bandwidth_mbps": bandwidth_mbps}
        updates = {k: v for k, v in given.items() if v is not None}
        if reset:
            if updates:
                raise ValidationError("reset", f"takes no metric with it (got {', '.join(updates)})")
            updates = dict(self._as_filed[frozenset((a, b))])
        for name, value in updates.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                    or value < 0:
                raise ValidationError(name, "must be a finite number >= 0", value)
        if updates.get("loss_percent", 0) > 100:
            raise ValidationError("loss_percent", "must be <= 100", loss_percent)
        for name in ("latency_ms", "jitter_ms"):
            if updates.get(name, 0) > MAX_LINK_MS:
                raise ValidationError(name, f"must be <= {MAX_LINK_MS:g} (a minute: a path's sum must stay finite)",
                                      updates[name])
        changed = {k: float(v) for k, v in updates.items() if data[k] != v}
        if changed:
            data.update(changed)
            self.version += 1
        return bool(changed)

    def path_metrics(self, vertices: Sequence[str]) -> PathMetrics:
        """Compose the metrics of a vertex sequence; ValidationError if a vertex or an edge does not exist."""
        key = tuple(vertices)
        if self._metrics_version != self.version or len(self._metrics) >= _METRICS_CACHE_LIMIT:
            self._metrics.clear()
            self._metrics_version = self.version
        cached = self._metrics.get(key)
        if cached is not None:
            return cached
        if not key:
            raise ValidationError("vertices", "must name at least one vertex")
        adj = self.graph.adj
        if key[0] not in adj:
            raise ValidationError("vertices[0]", "must name a vertex of the WAN", key[0])
        edges = []
        for i in range(1, len(key)):
            data = adj[key[i - 1]].get(key[i])
            if data is None:
                raise ValidationError(f"vertices[{i}]", f"must be linked to {key[i - 1]!r}", key[i])
            edges.append(data)
        metrics = PathMetrics.compose(key, edges)
        self._metrics[key] = metrics
        return metrics

    def is_valid_path(self, vertices: Sequence[str], src: str, dst: str) -> bool:
        """True for a simple path src → dst over existing links.

        Revisiting a vertex is rejected: a loop only adds latency, so a path finder that produces one
        (e.g. an under-trained agent) is reported rather than trusted.
        """
        if not vertices or vertices[0] != src or vertices[-1] != dst or src not in self.graph:
            return False
        if len(set(vertices)) != len(vertices):
            return False
        adj = self.graph.adj
        return all(b in adj.get(a, ()) for a, b in pairwise(vertices))
