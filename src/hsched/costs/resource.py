"""Paper 003 eq.1: what it costs to run a task in one data center.

    cost = t · (a·p_cpu + b·p_mem + c·p_disk + g·p_bw + u·p_gpu)

for a task needing a cores, b GiB memory, c GiB disk, g Mbit/s bandwidth and u whole-GPU equivalents
for t hours, at the DC's hourly unit prices p_*. The paper's eq.1 has no GPU term; GPUs are priced the
same way (per card-hour of whole-card equivalents) because the fleet also holds GPU clusters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hsched.domain.errors import ValidationError
from hsched.domain.fleet import Prices
from hsched.domain.resources import MIB_PER_GIB, MILLI, Resources

SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True, slots=True)
class ResourceCost:
    """Eq.1 split per resource, so a decision can be explained (fleet currency)."""

    cpu: float
    memory: float
    disk: float
    bandwidth: float
    gpu: float

    @property
    def total(self) -> float:
        return self.cpu + self.memory + self.disk + self.bandwidth + self.gpu


def resource_cost(prices: Prices, resources: Resources, runtime_s: float) -> ResourceCost:
    """Eq.1 for `resources` held `runtime_s` seconds. Pass the TOTAL request (`TaskSpec.total`)."""
    if not math.isfinite(runtime_s) or runtime_s < 0:
        raise ValidationError("runtime_s", "must be a finite number >= 0", runtime_s)
    hours = runtime_s / SECONDS_PER_HOUR
    return ResourceCost(
        cpu=hours * resources.cpu_milli / MILLI * prices.cpu_core_hour,
        memory=hours * resources.memory_mib / MIB_PER_GIB * prices.memory_gib_hour,
        disk=hours * resources.disk_mib / MIB_PER_GIB * prices.disk_gib_hour,
        bandwidth=hours * resources.bandwidth_mbps * prices.bandwidth_mbps_hour,
        gpu=hours * resources.gpu_units * prices.gpu_hour,
    )
