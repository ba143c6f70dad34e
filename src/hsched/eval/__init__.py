"""`hsched eval <experiment>`: the source papers' experiments on the project's own fleet and traces.

Each experiment module exposes `run(ctx: EvalContext) -> str` returning its markdown report (tables,
then the list of PNG files it wrote). Registered by import path so experiments load only when asked.
"""

from __future__ import annotations

EXPERIMENTS: dict[str, tuple[str, str]] = {
    "stage1": ("hsched.eval.stage1:run", "paper 003 fig.6: total cost per DC for each selector method"),
    "thermal": ("hsched.eval.thermal:run", "paper 003 table 5 / fig.9: reward, PUE, overloads, rack outlet temp"),
    "gpu": ("hsched.eval.gpu:run", "paper 000 tables 6-9: utilisation, deployed, fragmentation, load variance"),
    "node-vs-cluster": ("hsched.eval.node_vs_cluster:run",
                        "paper 002 table 2: node-level vs cluster-level (Volcano-style) placement"),
    "dag": ("hsched.eval.dag:run", "paper 004 table 1: average JCT per executor count (FIFO, SJF-CP, Tetris*, "
                                   "A3C, BA3C) and the critical-path bound"),
    "colocation": ("hsched.eval.colocation:run",
                   "paper 001: slice types vs Q; JobFusion vs Decima, shortest-first, random (JCT, utilisation)"),
}

# experiments that run on `--fleet` / `--trace` (the others replay their own DAG workloads and say so)
DATA_AWARE = frozenset({"stage1", "thermal", "gpu", "node-vs-cluster"})
