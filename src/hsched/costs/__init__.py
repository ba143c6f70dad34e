"""Stage-1 costs (paper 003 §1.1): resource cost (eq.1), network cost (eq.2), WAN paths, DC ranking (eq.3)."""

from hsched.costs.graph import WanGraph
from hsched.costs.network import MB_PER_GB, PathMetrics, network_cost
from hsched.costs.paths import DijkstraPathFinder, PathFinder, RandomPathFinder, VertexPath
from hsched.costs.resource import SECONDS_PER_HOUR, ResourceCost, resource_cost
from hsched.costs.selection import METHODS, Candidate, rank_datacenters

__all__ = [
    "MB_PER_GB",
    "METHODS",
    "SECONDS_PER_HOUR",
    "Candidate",
    "DijkstraPathFinder",
    "PathFinder",
    "PathMetrics",
    "RandomPathFinder",
    "ResourceCost",
    "VertexPath",
    "WanGraph",
    "network_cost",
    "rank_datacenters",
    "resource_cost",
]
