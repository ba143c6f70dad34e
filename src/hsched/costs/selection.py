"""Stage 1 (paper 003 §1.1.3): rank the data centers for a task by cost.

Methods:
- "min-cost" (eq.3): total = resource cost (eq.1) + network cost (eq.2) along the path finder's path
  (Dijkstra by default, the PER-DQN agent when given), plus the GPU-stranding term of a CPU-only task in a DC
  with GPU hosts when the caller gives it (hsched.costs.stranding; the selector does, on by default);
  ascending total.
- "crf" (cheapest compute first): ascending resource cost; network cost along a random path.
- "spf" (shortest path first): ascending path latency; costs along that path.

Every method filters DCs by the task's network requirements (paper 002: filter clusters first, then
schedule) using the metrics of the path it actually uses. Capacity is not checked here: the selector
service does it from the placers' summaries.

A request does no graph search when the caches are warm: shortest paths are cached per entry vertex
(`WanGraph.dijkstra`), path metrics per path, so ranking ~50 DCs is lookups and arithmetic.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from hsched.costs.graph import WanGraph
from hsched.costs.network import PathMetrics, network_cost
from hsched.costs.paths import DijkstraPathFinder, PathFinder, RandomPathFinder, VertexPath
from hsched.costs.resource import SECONDS_PER_HOUR, ResourceCost, resource_cost
from hsched.costs.stranding import OFF, GpuHostFree, StrandingConfig, stranding_cost
from hsched.domain.errors import ValidationError
from hsched.domain.fleet import DataCenter
from hsched.domain.task import NetworkRequirements, TaskSpec

METHODS = ("min-cost", "crf", "spf")
_REL_TOL = 1e-9  # an agent path is "worse" only beyond float noise


@dataclass(frozen=True, slots=True)
class Candidate:
    datacenter: str
    vertex: str
    resource: ResourceCost  # eq.1
    network_cost: float  # eq.2
    total: float  # eq.3: resource.total + network_cost
    path: PathMetrics
    path_source: str = "dijkstra"  # name of the path finder whose path was used
    note: str = ""  # why another finder's path was replaced by Dijkstra's, if it was
    stranding: float = 0.0  # GPU capacity a CPU-only task would strand, priced (hsched.costs.stranding); in total


_SORT_KEYS: dict[str, Callable[[Candidate], tuple]] = {
    "min-cost": lambda c: (c.total, c.datacenter),
    "crf": lambda c: (c.resource.total, c.total, c.datacenter),
    "spf": lambda c: (c.path.latency_ms, c.total, c.datacenter),
}


def rank_datacenters(
    task: TaskSpec,
    datacenters: Sequence[DataCenter],
    graph: WanGraph,
    network_price_per_gb_ms: float,
    entry_vertex: str,
    method: str = "min-cost",
    path_finder: PathFinder | None = None,
    random_path_finder: PathFinder | None = None,
    gpu_hosts: Mapping[str, GpuHostFree] | None = None,
    stranding: StrandingConfig = OFF,
) -> tuple[list[Candidate], list[tuple[str, str]]]:
    """Feasible DCs in rank order, and the excluded ones as (name, reason).

    entry_vertex: where the task's data enters the WAN (task.entry_vertex, or the WAN's scheduler vertex
    when the task names none; the caller resolves it). path_finder: routes for "min-cost" and "spf"
    (default: Dijkstra). A non-Dijkstra path that is missing, invalid or longer than Dijkstra's is
    replaced by Dijkstra's and the reason put in `Candidate.note`, never silently used.
    random_path_finder: routes for "crf" (default: a RandomPathFinder seeded 0, created per call, so
    the ranking is a pure function of its inputs; pass a long-lived one to draw fresh paths per request).
    gpu_hosts / stranding: each DC's free resources by host kind and the GPU-stranding term's settings
    (hsched.costs.stranding); the term is added to the total (eq.3 + stranding), 0 when off or not given.
    """
    if method not in _SORT_KEYS:
        raise ValidationError("method", f"must be one of {', '.join(METHODS)}", method)
    if entry_vertex not in graph:
        raise ValidationError("entry_vertex", "must name a vertex of the WAN", entry_vertex)
    exact = graph.dijkstra
    if method == "crf":
        finder: PathFinder = random_path_finder or RandomPathFinder(graph, seed=0)
    else:
        finder = path_finder or exact
    requested = task.total
    candidates: list[Candidate] = []
    excluded: list[tuple[str, str]] = []
    shortest = exact.paths_from(entry_vertex)  # cached per entry vertex: no graph search on a warm request
    for dc in datacenters:
        best = shortest.get(dc.vertex)
        if best is None:
            known = dc.vertex in graph
            excluded.append((dc.name, f"unreachable from {entry_vertex}" if known
                             else f"vertex {dc.vertex!r} is not in the WAN"))
            continue
        if finder is exact or (isinstance(finder, DijkstraPathFinder) and finder.graph is graph):
            path, source, note = best, exact.name, ""
        else:
            path, source, note = _route(graph, finder, best, entry_vertex, dc.vertex,
                                        must_be_shortest=method != "crf")
        metrics = graph.path_metrics(path)
        reasons = _violations(metrics, task.network, requested.bandwidth_mbps)
        if reasons:
            excluded.append((dc.name, "; ".join(reasons)))
            continue
        # a task that runs until released has no runtime to price: DCs are ranked by an hour of it
        runtime = task.runtime_s or SECONDS_PER_HOUR
        resource = resource_cost(dc.prices, requested, runtime)
        network = network_cost(network_price_per_gb_ms, task.data_size_mb, metrics.latency_ms)
        strand = (stranding_cost(requested, gpu_hosts.get(dc.name), dc.prices.gpu_hour, runtime, stranding)
                  if gpu_hosts else 0.0)
        candidates.append(Candidate(dc.name, dc.vertex, resource, network, resource.total + network + strand,
                                    metrics, source, note, strand))
    candidates.sort(key=_SORT_KEYS[method])
    return candidates, excluded


def _route(graph: WanGraph, finder: PathFinder, best: VertexPath, src: str, dst: str, *,
           must_be_shortest: bool) -> tuple[VertexPath, str, str]:
    """The path to use, the name of the finder it came from, and a note if Dijkstra's `best` stepped in."""
    path = finder.path(src, dst)
    if path is None or not graph.is_valid_path(path, src, dst):
        problem = "found no path" if path is None else f"gave an invalid path {'→'.join(path)}"
        return best, DijkstraPathFinder.name, f"{finder.name} {problem}; used dijkstra"
    if must_be_shortest:
        got, opt = graph.path_metrics(path).latency_ms, graph.path_metrics(best).latency_ms
        if not no_longer(got, opt):
            note = f"{finder.name} path {_num(got)} ms > dijkstra {_num(opt)} ms; used dijkstra"
            return best, DijkstraPathFinder.name, note
    return path, finder.name, ""


def no_longer(latency_ms: float, shortest_ms: float) -> bool:
    """Whether a path of `latency_ms` is as short as the shortest one (`shortest_ms`), float noise aside: the
    test an agent's path must pass to be used (the path agents' training evaluation uses it too)."""
    return latency_ms <= shortest_ms * (1 + _REL_TOL) + _REL_TOL


def _violations(path: PathMetrics, need: NetworkRequirements, bandwidth_mbps: float) -> list[str]:
    """Human reasons the path breaks the task's network requirements (0 = no bound, 0 bandwidth = unknown)."""
    reasons = [f"path {what} {_num(got)} {unit} > {bound} {_num(limit)}"
               for what, got, unit, bound, limit in (
                   ("latency", path.latency_ms, "ms", "max_latency_ms", need.max_latency_ms),
                   ("jitter", path.jitter_ms, "ms", "max_jitter_ms", need.max_jitter_ms),
                   ("loss", path.loss_percent, "%", "max_loss_percent", need.max_loss_percent))
               if limit and got > limit]
    if bandwidth_mbps and path.bottleneck_bandwidth_mbps and bandwidth_mbps > path.bottleneck_bandwidth_mbps:
        reasons.append(f"bottleneck bandwidth {_num(path.bottleneck_bandwidth_mbps)} Mbit/s "
                       f"< requested {_num(bandwidth_mbps)}")
    return reasons


def _num(x: float) -> str:
    """41.2 → '41.2', 30.0 → '30', 1.99 → '1.99': short but never rounding a violation into equality."""
    return f"{x:.3f}".rstrip("0").rstrip(".")


def exclusion_summary(excluded: Iterable[tuple[str, str]], shown_groups: int = 3, shown_names: int = 3) -> str:
    """Why no data center could take a task, short: the DCs grouped by the same reason (a DC's own name in its
    reason reads "the DC"), the largest groups first, a few names each; the whole list stays in the task's
    explanation (`hsched get --json`). A reason only one DC gave is shown as it is."""
    groups: dict[str, list[tuple[str, str]]] = {}
    for dc, reason in excluded:
        shared = re.sub(rf"(?<![\w-]){re.escape(dc)}(?![\w-])", "the DC", reason) if dc else reason
        groups.setdefault(shared, []).append((dc, reason))
    ranked = sorted(groups.items(), key=lambda g: -len(g[1]))  # stable: ties keep the selector's order
    out = []
    for shared, members in ranked[:shown_groups]:
        if len(members) == 1:
            out.append(f"{members[0][0]}: {members[0][1]}")
            continue
        names = [dc for dc, _ in members]
        more = f", +{len(names) - shown_names}" if len(names) > shown_names else ""
        out.append(f"{len(names)} DCs ({', '.join(names[:shown_names])}{more}): {shared}")
    if len(ranked) > shown_groups:
        out.append(f"{len(ranked) - shown_groups} more reason(s) in the task's explanation")
    return "; ".join(out)
