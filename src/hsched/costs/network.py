"""Paper 003 eq.2 (network cost) and the quality of a WAN path (paper 002 eq.1-3).

Eq.2: moving the task's data from its entry vertex to the DC costs

    price_per_gb_ms · data_gb · Σ_{e ∈ path} latency_ms(e)

The paper prices the transfer by delay because "once bandwidth and data size are fixed, delay is mainly
set by distance": a link's weight is its latency, by default fibre propagation over the great-circle
distance, overridden at run time by measured latency (link-metric updates).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

MB_PER_GB = 1000.0  # data sizes are decimal: MB = 10^6 bytes, GB = 10^9 bytes


def network_cost(price_per_gb_ms: float, data_size_mb: float, path_latency_ms: float) -> float:
    """Eq.2: price per GB·ms × data moved (GB) × path latency (ms)."""
    return price_per_gb_ms * (data_size_mb / MB_PER_GB) * path_latency_ms


@dataclass(frozen=True, slots=True)
class PathMetrics:
    """End-to-end quality of a path, composed from its links.

    - latency_ms: sum over links (propagation and queueing add up).
    - jitter_ms: sum over links. Paper 002 (eq.2) measures jitter end to end, per path; composing
      per-link values by summing is the worst case (all deviations aligned). Independent variations
      would add in quadrature and give less, but a bound used to *filter* DCs must not under-estimate.
    - loss_percent: 1 − Π(1 − l_e/100), in percent: a packet survives only if every link keeps it
      (independent drops), so two 1 % links lose 1.99 %, not 2 %.
    - bottleneck_bandwidth_mbps: min over links whose bandwidth is known; 0 = unknown.
    - hops: number of links (0 when the DC sits on the entry vertex).
    """

    vertices: tuple[str, ...]
    latency_ms: float
    jitter_ms: float
    loss_percent: float
    bottleneck_bandwidth_mbps: float
    hops: int

    @classmethod
    def compose(cls, vertices: tuple[str, ...], links: Iterable[Mapping[str, float]]) -> PathMetrics:
        """Compose per-link metrics (mappings with latency_ms, jitter_ms, loss_percent, bandwidth_mbps)."""
        latency = jitter = 0.0
        delivered = 1.0
        bottleneck = math.inf
        hops = 0
        for link in links:
            latency += link["latency_ms"]
            jitter += link["jitter_ms"]
            delivered *= 1.0 - link["loss_percent"] / 100.0
            if link["bandwidth_mbps"] > 0:
                bottleneck = min(bottleneck, link["bandwidth_mbps"])
            hops += 1
        return cls(vertices, latency, jitter, (1.0 - delivered) * 100.0,
                   0.0 if bottleneck == math.inf else bottleneck, hops)
