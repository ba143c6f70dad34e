"""`hsched eval dag`: paper 004's table 1 — average job completion time per executor count for FIFO,
SJF-CP, Tetris*, the single-head A3C and the action-branching A3C (BA3C), mean ± std over seeds — with the
exact reference (the critical-path lower bound of every job's JCT) and the gap to it; then
`hsched.eval.colocation`'s section (paper 001's comparison).

Setting (`hsched/DagScheduling-v0`, hsched.envs.dag): TPC-H DAGs at paper 004's sizes (2-100 GB), one job at
t = 0 and `STREAM_JOBS` more arriving as a Poisson process (mean inter-arrival 60 s: a 15-executor cluster
near 80 % busy), 2 s moving delay. Seed s draws the jobs and arrival times; every policy sees the same ones
for a given seed. Executor counts: paper 004's table 1 is not in the seed text we have; its text names the
counts 15 (the initial setting) and 29 ("at 29 executors and above Tetris* beats A3C"), so we evaluate
`EXECUTOR_COUNTS` = 15, 20, 25, 29, 35. The learned rows are the shipped models `models/ba3c_dag.pt` and
`models/a3c_dag.pt` (`hsched train ba3c` / `hsched train a3c`), acting greedily; a missing model is reported,
not replaced.

The exact references (per job, averaged like the JCTs; `hsched.envs.dag`): the critical-path bound — no
schedule finishes a job before its critical path (every stage one wave of its tasks, unlimited executors,
each task as short as its shortest measured draw) plus the moving delay of its first executor; it ignores
the executor count, so it is the same in every column. The capacity bound — moving delay + max(that critical
path, the job's shortest-draw work / N): the job alone on the whole cluster. Both ignore queueing behind
other jobs, so they are floors, not targets; the gap table is to the tighter one.

Seeds: evaluation seeds are 0, 1, 2, …; training, expert and validation (model selection) episodes use
seeds from 10 000 up (`hsched.rl.ba3c`), so nothing here was trained or selected on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hsched.envs.dag import (
    PAPER004_EXECUTOR_COUNTS,
    DagPolicy,
    DagSchedulingEnv,
    Fifo,
    SjfCp,
    TetrisStar,
    run_dag_policy,
)
from hsched.eval.colocation import section as colocation_section
from hsched.eval.report import EvalContext, markdown_table, mean_std, plot_lines

EXECUTOR_COUNTS = PAPER004_EXECUTOR_COUNTS
STREAM_JOBS, QUICK_STREAM_JOBS = 50, 8
QUICK_EXECUTOR_COUNTS = (15, 29)
INTERARRIVAL_S = 60.0
HEURISTICS: tuple[tuple[str, Callable[[], DagPolicy]], ...] = (("FIFO", Fifo), ("SJF-CP", SjfCp),
                                                              ("Tetris*", TetrisStar))
LEARNED: tuple[tuple[str, str, str], ...] = (("A3C (single head)", "a3c_dag", "a3c"), ("BA3C", "ba3c_dag", "ba3c"))
BOUND = "critical-path lower bound"
CAPACITY_BOUND = "capacity lower bound"
BOUNDS = (BOUND, CAPACITY_BOUND)


@dataclass
class Table:
    counts: tuple[int, ...]
    jct: dict[str, dict[int, list[float]]] = field(default_factory=dict)  # label → N → per-seed average JCT
    missing: dict[str, str] = field(default_factory=dict)

    def add(self, label: str, n: int, value: float) -> None:
        self.jct.setdefault(label, {}).setdefault(n, []).append(value)

    def mean(self, label: str, n: int) -> float:
        return float(np.mean(self.jct[label][n]))


def learned_policies(models_dir: Path | None = None) -> tuple[dict[str, DagPolicy], dict[str, str]]:
    """The shipped learned policies by row label, and the rows whose model is missing (label → why)."""
    from hsched.rl import checkpoint
    from hsched.rl.ba3c import load_dag_policy

    found: dict[str, DagPolicy] = {}
    missing: dict[str, str] = {}
    for label, model, agent in LEARNED:
        path = (models_dir / f"{model}.pt") if models_dir else checkpoint.model_path(model)
        if path.exists():
            found[label] = load_dag_policy(path)
        else:
            missing[label] = f"no model at {path} (run `hsched train {agent}`)"
    return found, missing


def evaluate(ctx: EvalContext, models_dir: Path | None = None) -> Table:
    counts = QUICK_EXECUTOR_COUNTS if ctx.quick else EXECUTOR_COUNTS
    stream = QUICK_STREAM_JOBS if ctx.quick else STREAM_JOBS
    learned, missing = learned_policies(models_dir)
    table = Table(counts, missing=missing)
    rows = [(label, make) for label, make in HEURISTICS] + [(label, (lambda p=p: p)) for label, p in learned.items()]
    total, done = len(counts) * len(ctx.seeds) * len(rows), 0
    for n in counts:
        env = DagSchedulingEnv(n, num_init_jobs=1, num_stream_jobs=stream, interarrival_s=INTERARRIVAL_S)
        for seed in ctx.seeds:
            for label, make in rows:
                ep = run_dag_policy(env, make(), seed=seed)
                table.add(label, n, ep.metrics["avg_jct_s"])
                if label == rows[0][0]:
                    table.add(BOUND, n, float(np.mean(ep.bounds)))
                    table.add(CAPACITY_BOUND, n, float(np.mean(ep.capacity_bounds)))
                done += 1
                ctx.progress("table 1", done, total)
    return table


def report(ctx: EvalContext, table: Table) -> str:
    counts = table.counts
    labels = [label for label in table.jct if label not in BOUNDS]
    bounds = [b for b in BOUNDS if b in table.jct]
    headers = ["policy", *[f"{n} executors" for n in counts]]
    rows = [[label, *[mean_std(table.jct[label][n], 1) for n in counts]] for label in labels]
    rows += [[b, *[mean_std(table.jct[b][n], 1) for n in counts]] for b in bounds]
    for label in table.missing:
        rows.append([label, *["not trained" for _ in counts]])
    out = [markdown_table(headers, rows)]
    for label, why in table.missing.items():
        out.append(f"- {label}: {why}")
    # gaps: each policy's mean over the bound's mean, and BA3C against the best other policy per column
    tight = CAPACITY_BOUND if CAPACITY_BOUND in table.jct else BOUND
    gap_rows = [[label, *[f"{table.mean(label, n) / table.mean(tight, n):.2f}×" for n in counts]] for label in labels]
    out += ["", f"Average JCT ÷ the {tight} (same seeds):", "",
            markdown_table(["policy", *[f"{n}" for n in counts]], gap_rows)]
    if "BA3C" in table.jct:
        diffs = []
        for n in counts:
            others = {label: table.mean(label, n) for label in labels if label != "BA3C"}
            best = min(others, key=others.__getitem__)
            mine = table.mean("BA3C", n)
            paired = np.array(table.jct["BA3C"][n]) - np.array(table.jct[best][n])
            diffs.append([f"{n}", best, f"{others[best]:.1f}", f"{mine:.1f}",
                          f"{100 * (mine - others[best]) / others[best]:+.1f} %",
                          f"{int((paired < 0).sum())}/{len(paired)}"])
        out += ["", "BA3C against the best other policy of each column (negative = BA3C faster; seeds where "
                    "BA3C's average JCT is lower):", "",
                markdown_table(["executors", "best other", "its JCT (s)", "BA3C (s)", "BA3C vs it", "seeds won"],
                               diffs)]
    # policies: mean ± std over seeds; the bounds (exact references, per executor count) as black lines
    series = {label: (list(counts), [table.jct[label][n] for n in counts]) for label in labels}
    refs = {f"{b} (mean)": (list(counts), [table.mean(b, n) for n in counts]) for b in bounds}
    png = plot_lines(ctx.png("dag_avg_jct.png"), "Average JCT per executor count (paper 004 table 1)",
                     "executors", "average JCT (s)", series, refs=refs)
    out += ["", f"Plot: {png}"]
    return "\n".join(out)


def run(ctx: EvalContext) -> str:
    stream = QUICK_STREAM_JOBS if ctx.quick else STREAM_JOBS
    head = (f"## Paper 004, table 1: average JCT (s) per executor count\n\nTPC-H jobs (paper 004's sizes), "
            f"1 at t = 0 + {stream} Poisson arrivals (mean {INTERARRIVAL_S:.0f} s), moving delay 2 s; seeds "
            f"{ctx.seeds}, task durations drawn per task from the measured waves (decima-sim), mean ± std over seeds" + (" (quick run: fewer jobs and executor counts)" if ctx.quick
                                                     else "") + ".\n")
    return head + report(ctx, evaluate(ctx)) + "\n\n" + colocation_section(ctx)
