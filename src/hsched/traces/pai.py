"""Alibaba PAI 2020 machine inventory (`pai_machine_spec`, data/alibaba_pai_gpu_2020/).

PAI states CPU in cores and memory in GB (whole-number RAM sizes, 384/512, treated as GiB by hsched).
"""

from __future__ import annotations

import csv
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from hsched.domain.resources import MIB_PER_GIB, MILLI
from hsched.traces._io import open_text

PAI_COLUMNS = ("machine", "gpu_type", "cap_cpu", "cap_mem", "cap_gpu")


@dataclass(frozen=True, slots=True)
class PaiMachine:
    machine: str  # anonymised 24-hex id
    gpu_type: str  # P100, T4, MISC (K40m/K80/M60 class), V100, V100M32, CPU (no GPU)
    cap_cpu: int  # CPU cores
    cap_mem: int  # memory, GB
    cap_gpu: int  # GPUs

    @property
    def cpu_milli(self) -> int:
        return self.cap_cpu * MILLI

    @property
    def memory_mib(self) -> int:
        return self.cap_mem * MIB_PER_GIB


def load_pai_machines(csv_path: str | Path, header_path: str | Path | None = None) -> list[PaiMachine]:
    """Read the headerless `pai_machine_spec.csv`; column names come from `header_path`
    (default: `pai_machine_spec.header` beside the CSV, else the published order `PAI_COLUMNS`)."""
    csv_path = Path(csv_path)
    header = Path(header_path) if header_path else csv_path.with_suffix(".header")
    columns = header.read_text().strip().split(",") if header.is_file() else list(PAI_COLUMNS)
    if sorted(columns) != sorted(PAI_COLUMNS):
        raise ValueError(f"{header}: expected columns {PAI_COLUMNS}, got {columns}")
    with open_text(csv_path) as fh:
        return [PaiMachine(r["machine"], r["gpu_type"], int(r["cap_cpu"]), int(r["cap_mem"]), int(r["cap_gpu"]))
                for r in csv.DictReader(fh, fieldnames=columns) if r["machine"]]


def pai_machine_configs(machines: list[PaiMachine]) -> list[tuple[str, int, int, int, int]]:
    """Distinct `(gpu_type, cap_cpu cores, cap_mem GB, cap_gpu, count)`, most common first (ties by config)."""
    counts = Counter((m.gpu_type, m.cap_cpu, m.cap_mem, m.cap_gpu) for m in machines)
    return [(*cfg, n) for cfg, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
