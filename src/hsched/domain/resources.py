"""Resource amounts in integer units, so ledgers add and subtract exactly (no float drift).

CPU is in milli-cores (Kubernetes/openb convention), memory and disk in MiB, bandwidth in Mbit/s.
A GPU request is `gpu_count` slices, each `gpu_core_percent` of one card's cores and `gpu_memory_mib`
of its memory (HAMi-style vGPU); a slice never spans cards.
"""

from __future__ import annotations

from dataclasses import dataclass

from hsched.domain.errors import ValidationError

MIB_PER_GIB = 1024
MILLI = 1000


@dataclass(frozen=True, slots=True)
class Resources:
    cpu_milli: int = 0
    memory_mib: int = 0
    disk_mib: int = 0
    bandwidth_mbps: int = 0
    gpu_count: int = 0
    gpu_core_percent: int = 0  # per GPU slice, 1..100 when gpu_count > 0
    gpu_memory_mib: int = 0  # per GPU slice

    @property
    def cpu_cores(self) -> float:
        return self.cpu_milli / MILLI

    @property
    def gpu_units(self) -> float:
        """GPU demand in whole-card equivalents (cores), the unit prices are quoted in."""
        return self.gpu_count * self.gpu_core_percent / 100.0

    def scaled(self, factor: int) -> Resources:
        return Resources(
            self.cpu_milli * factor,
            self.memory_mib * factor,
            self.disk_mib * factor,
            self.bandwidth_mbps * factor,
            self.gpu_count * factor,
            self.gpu_core_percent,
            self.gpu_memory_mib,
        )

    def validate(self, prefix: str = "resources") -> None:
        """Raise ValidationError naming the first field that breaks a rule."""
        for name in ("cpu_milli", "memory_mib", "disk_mib", "bandwidth_mbps", "gpu_count",
                     "gpu_core_percent", "gpu_memory_mib"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValidationError(f"{prefix}.{name}", "must be an integer", value)
            if value < 0:
                raise ValidationError(f"{prefix}.{name}", "must be >= 0", value)
        if self.cpu_milli == 0 and self.gpu_count == 0:
            raise ValidationError(f"{prefix}.cpu_milli", "a task must request CPU (> 0) or at least one GPU", 0)
        if self.gpu_count > 0:
            if not 1 <= self.gpu_core_percent <= 100:
                raise ValidationError(f"{prefix}.gpu_core_percent",
                                      "must be in 1..100 when gpu_count > 0 (a slice never spans cards)",
                                      self.gpu_core_percent)
        elif self.gpu_core_percent or self.gpu_memory_mib:
            raise ValidationError(f"{prefix}.gpu_count", "must be > 0 when a GPU core percent or GPU memory is set",
                                  self.gpu_count)
