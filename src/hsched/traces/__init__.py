"""Loaders for the real public traces shipped in the repository's `data/` folder.

Each loader converts the source's units once, into hsched's integer units (milli-cores, MiB, Mbit/s, seconds):

- `topology_zoo`: Internet Topology Zoo WAN graphs (GraphML) → vertices (lat, lon) and `Link`s.
- `swf`: Parallel Workloads Archive job logs (Standard Workload Format) → `SwfJob` → `TaskSpec`.
- `openb`: Alibaba GPU-sharing cluster trace "openb" (2023) nodes and pods → `TaskSpec`.
- `pai`: Alibaba PAI 2020 machine inventory → node-pool configurations.
- `decima`: Decima TPC-H Spark DAGs (stages, dependencies, task durations) → `DagJob` → `TaskSpec` per stage.
- `alibaba2018`: Alibaba cluster-trace-v2018 batch DAG jobs (tasks, dependencies from task names, instances,
  CPU/memory, durations) → `AlibabaJob`.

Provenance, licences and units of every file are in `data/<dataset>/README.md`.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["DATA_ENV_VAR", "data_dir"]

DATA_ENV_VAR = "HSCHED_DATA"


def data_dir() -> Path:
    """The folder holding hsched's data sets: `$HSCHED_DATA` if set, else the repository's `data/`."""
    override = os.environ.get(DATA_ENV_VAR)
    if override:
        path = Path(override).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"{DATA_ENV_VAR}={override!r} is not a directory")
        return path
    path = Path(__file__).resolve().parents[3] / "data"  # src/hsched/traces → repo root
    if not path.is_dir():
        raise FileNotFoundError(
            f"hsched data folder not found at {path}. It ships with the source repository (data/); "
            f"when hsched is installed elsewhere, point {DATA_ENV_VAR} at a copy of that folder.")
    return path
