"""GPU stranding: what a CPU-only task costs in GPU capacity it leaves unusable (docs/gpu_stranding.md).

CPU is cheapest in the GPU clusters, so min-cost (eq.3) alone sends CPU-only work there; it fills the GPU
hosts' CPU and memory, and later GPU tasks wait while the cards sit idle. In the spirit of FGD (ATC'23) —
price the GPUs a placement makes unusable — at cluster level in the selector, and as a reserve per host in
the placer:

Each idle GPU (a card with any core % free) of a GPU host h keeps `share` of that host's CPU
and memory per GPU (cpu_h / gpus_h, mem_h / gpus_h) for GPU tasks: reserve_h = min(free_h, share · per-GPU_h
· idle_h). For a CPU-only task of a cores and b GiB in a DC whose GPU hosts have F_c, F_m free and reserves
R_c = Σ reserve_h, R_m, and whose CPU-only hosts have O_c, O_m free:

    on GPU hosts  a' = max(0, a − O_c),                b' = max(0, b − O_m)
    taken     x_c = max(0, a' − (F_c − R_c)),          x_m = max(0, b' − (F_m − R_m))
    stranded  s   = min(G, max(x_c / c̄, x_m / m̄))      GPUs (c̄, m̄: the DC's GPU hosts' CPU and memory per GPU,
                                                      times share; G: idle GPUs)
    cost      = weight · s · p_gpu · t                 (p_gpu per GPU-hour, t hours: eq.1's units)

The selector adds the cost to eq.3's total (min-cost ranks by it; 0 for GPU tasks, DCs without GPUs, and
weight or share 0). The placer side (`reserve_mask`) keeps each GPU host's reserve from CPU-only parts, so what
the selector assumes (CPU-only work takes the spare, not the reserve) is what happens on the hosts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from hsched.domain.errors import ValidationError
from hsched.domain.resources import Resources

# 1 = an idle GPU keeps its whole per-GPU slice of its host's CPU and memory: CPU-only work gets a GPU host's
# CPU only as its GPUs are taken, or what GPU tasks leave of their slices (openb's GPU pods ask for a median
# 9.8 cores and 30.5 GiB per GPU; the default fleet's GPU hosts have 8-52 cores and 48-256 GiB per GPU).
DEFAULT_SHARE = 1.0


@dataclass(frozen=True, slots=True)
class StrandingConfig:
    weight: float = 1.0  # 0 = off: eq.3 as the paper has it (the selector's term)
    share: float = DEFAULT_SHARE  # of a GPU host's per-GPU CPU and memory kept per idle GPU (0 = no reserve)

    def __post_init__(self) -> None:
        for name in ("weight", "share"):
            value = getattr(self, name)
            if not np.isfinite(value) or value < 0:
                raise ValidationError(name, "must be a finite number >= 0", value)
        if self.share > 1:
            raise ValidationError("share", "must be in 0..1", self.share)

    @property
    def on(self) -> bool:
        return self.weight > 0 and self.share > 0


OFF = StrandingConfig(weight=0.0, share=0.0)


@dataclass(frozen=True, slots=True)
class GpuHostFree:
    """One DC's free resources by host kind (milli-cores, MiB, whole-GPU equivalents), as its placer publishes
    them. `*_slice` = Σ over GPU hosts of (per-GPU capacity × idle GPUs): the reserve at share 1."""

    gpu_host_cpu_milli: int = 0
    gpu_host_memory_mib: int = 0
    gpus: float = 0.0
    cpu_slice_milli: float = 0.0
    memory_slice_mib: float = 0.0
    cpu_per_gpu_milli: float = 0.0  # the DC's GPU hosts: Σ CPU / Σ GPUs
    memory_per_gpu_mib: float = 0.0
    cpu_host_cpu_milli: int = 0
    cpu_host_memory_mib: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> GpuHostFree | None:
        if not d:
            return None
        try:
            return cls(**{k: d[k] for k in cls.__slots__})
        except KeyError:  # an older placer's summary
            return None


def _idle_gpus(state: Any) -> np.ndarray:
    """Per host, the cards with room left: a card shared by GPU pods keeps its whole slice of the host (GPU-
    sharing pods ask for far more CPU and memory than their share of a card: openb's 0.32-card pods 4-8 cores,
    22-30 GiB)."""
    t = state.table
    return ((t.gpu_core_percent > 0) & (state.gpu_free_core > 0)).sum(axis=1).astype(np.float64)


def free_of(state: Any) -> GpuHostFree:
    """The split of a ClusterState's free resources (the placer publishes it in its summary). A cordoned host's
    room is not free (nothing may be placed there), though it still counts in the per-GPU ratios of the fleet."""
    t = state.table
    g = t.gpu_count > 0
    on = state.schedulable()
    free_g, free_c = g & on, ~g & on
    idle = _idle_gpus(state)
    gpus = np.maximum(t.gpu_count, 1)
    total_gpus = max(int(t.gpu_count[g].sum()), 1)
    return GpuHostFree(
        int(state.free_cpu[free_g].sum()), int(state.free_memory[free_g].sum()), float(idle[free_g].sum()),
        float((t.cpu_milli / gpus * idle)[free_g].sum()), float((t.memory_mib / gpus * idle)[free_g].sum()),
        float(t.cpu_milli[g].sum() / total_gpus), float(t.memory_mib[g].sum() / total_gpus),
        int(state.free_cpu[free_c].sum()), int(state.free_memory[free_c].sum()))


def stranded_gpus(total: Resources, free: GpuHostFree, cfg: StrandingConfig) -> float:
    """GPUs (whole-card equivalents) a task of `total` resources would leave without the CPU or memory to use
    them (module docstring); 0 for a GPU task."""
    if total.gpu_count or free.gpus <= 0 or not cfg.on:
        return 0.0
    out = 0.0
    for need, gpu_free, other_free, slice_, per_gpu in (
            (total.cpu_milli, free.gpu_host_cpu_milli, free.cpu_host_cpu_milli, free.cpu_slice_milli,
             free.cpu_per_gpu_milli),
            (total.memory_mib, free.gpu_host_memory_mib, free.cpu_host_memory_mib, free.memory_slice_mib,
             free.memory_per_gpu_mib)):
        if per_gpu <= 0:
            continue
        reserve = min(gpu_free, cfg.share * slice_)
        taken = max(0.0, max(0, need - other_free) - (gpu_free - reserve))
        out = max(out, taken / (cfg.share * per_gpu))
    return min(out, free.gpus)


def stranding_cost(total: Resources, free: GpuHostFree | None, gpu_hour: float, runtime_s: float,
                   cfg: StrandingConfig) -> float:
    """weight · stranded GPUs · price per GPU-hour · hours."""
    if free is None or not cfg.on:
        return 0.0
    return cfg.weight * stranded_gpus(total, free, cfg) * gpu_hour * runtime_s / 3600.0


def reserve_mask(state: Any, demand: Resources, cfg: StrandingConfig) -> np.ndarray:
    """Nodes a CPU-only part may use without eating its GPU host's reserve (all True for a GPU part)."""
    t = state.table
    if demand.gpu_count or cfg.share <= 0:
        return np.ones(len(t), dtype=bool)
    idle = _idle_gpus(state)
    gpus = np.maximum(t.gpu_count, 1)
    ok = (state.free_cpu - demand.cpu_milli >= cfg.share * t.cpu_milli / gpus * idle) & (
        state.free_memory - demand.memory_mib >= cfg.share * t.memory_mib / gpus * idle)
    return ok | (t.gpu_count == 0)


class GpuReservePolicy:
    """A node policy that keeps each GPU host's reserve (`reserve_mask`) from CPU-only parts, then lets the
    wrapped policy score as before (`hsched.policies.base.select` applies `narrow_mask`)."""

    def __init__(self, inner: Any, cfg: StrandingConfig) -> None:
        self.inner = inner
        self.cfg = cfg
        self.name = getattr(inner, "name", "policy")

    def narrow_mask(self, state: Any, demand: Resources, mask: np.ndarray) -> np.ndarray:
        return mask & reserve_mask(state, demand, self.cfg)

    def scores(self, state: Any, demand: Resources, mask: np.ndarray) -> np.ndarray:
        return self.inner.scores(state, demand, mask)

    def placed(self, node: int) -> None:
        self.inner.placed(node)

    def __getattr__(self, item: str) -> Any:  # anything else the placer reads off its policy
        return getattr(self.inner, item)


def parse_reserve(text: str | float, weight: float = 1.0, field: str = "--gpu-reserve") -> StrandingConfig:
    """`--gpu-reserve SHARE` (0..1 of a GPU host's per-GPU CPU and memory kept per idle GPU; 0 = off) and the
    selector's weight → StrandingConfig."""
    try:
        share = float(text)
    except ValueError:
        raise ValidationError(field, "must be a number in 0..1 (0 = off)", text) from None
    if not 0 <= share <= 1:
        raise ValidationError(field, "must be a number in 0..1 (0 = off)", text)
    return StrandingConfig(weight=weight if share else 0.0, share=share)


DEFAULT_RESERVE = f"{DEFAULT_SHARE:g}"
