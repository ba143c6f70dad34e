"""Shared pieces of the evaluation reports: run context, mean ± std over seeds, markdown tables, plots."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hsched.domain.fleet import Fleet
    from hsched.traces.catalog import TraceRef


@dataclass
class EvalContext:
    seeds: list[int]
    out_dir: Path  # PNGs (and the markdown report) go here
    quick: bool = False  # smaller slices for tests / smoke runs; the report says so
    progress: Callable[[str, int, int], None] = field(default=lambda label, done, total: None)
    # `hsched eval --fleet F --trace T --cores-per-proc N --tasks K`: the data an experiment runs on
    # (None: its own default: the default fleet, the paper's trace); each report names what it used
    fleet_path: str | None = None
    trace: str | None = None
    cores_per_proc: int = 1
    tasks: int | None = None  # how many trace tasks (None: the experiment's default)

    def png(self, name: str) -> Path:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        return self.out_dir / name

    def fleet(self) -> Fleet:
        from hsched.domain.fleet import load_fleet

        return load_fleet(self.fleet_path)

    def trace_ref(self, default: str) -> TraceRef:
        """`--trace` (with `--cores-per-proc`), else the experiment's `default` catalogue trace."""
        from hsched.traces.catalog import resolve_trace

        return resolve_trace(self.trace or default, self.cores_per_proc)

    def trace_for(self, kind: str, default: str) -> tuple[TraceRef, str]:
        """The trace of the `kind` ("swf" CPU jobs / "openb" GPU pods) an experiment needs: `--trace` when it is
        of that kind, else `default` with a note saying why (so `eval all --trace T` runs every experiment)."""
        from hsched.traces.catalog import resolve_trace

        if self.trace:
            ref = resolve_trace(self.trace, self.cores_per_proc)
            if ref.kind == kind:
                return ref, ""
            return resolve_trace(default), (f"--trace {self.trace} is {'an SWF log (CPU jobs, no GPUs)' if ref.kind == 'swf' else 'an openb pod list'}; "
                                            f"this experiment needs {'GPU pods' if kind == 'openb' else 'an SWF log'} "
                                            f"and ran on its default {default}")
        return resolve_trace(default), ""

    def fleet_label(self, fleet: Fleet) -> str:
        src = self.fleet_path or "the default fleet"
        return f"fleet `{fleet.name}` ({src}; WAN: {fleet.wan.source or 'inline'}, {len(fleet.datacenters)} DCs)"


def mean_std(values: Sequence[float], digits: int = 3) -> str:
    """'m ± s' over seeds (s = sample standard deviation; '± 0' for one seed)."""
    vals = [float(v) for v in values]
    if not vals:
        return "-"
    m = statistics.fmean(vals)
    s = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return f"{m:.{digits}f} ± {s:.{digits}f}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]], align_right_from: int = 1) -> str:
    def cell(v: object) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    sep = ["---" if i < align_right_from else "---:" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def plot_lines(path: Path, title: str, xlabel: str, ylabel: str, series: dict[str, tuple[Sequence[float], Sequence[float]]]) -> Path:
    """One PNG with a line per series {label: (x, y)} (matplotlib, Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    for label, (x, y) in series.items():
        ax.plot(x, y, label=label, linewidth=1.4)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_bars(path: Path, title: str, ylabel: str, groups: Sequence[str], bars: dict[str, Sequence[float]]) -> Path:
    """Grouped bars: one group per entry of `groups`, one bar per series in `bars` ({label: values})."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(max(8, len(groups) * 0.8), 4.5), dpi=110)
    width = 0.8 / max(len(bars), 1)
    x = np.arange(len(groups))
    for i, (label, values) in enumerate(bars.items()):
        ax.bar(x + i * width - 0.4 + width / 2, values, width, label=label)
    ax.set_xticks(x, groups, rotation=30, ha="right")
    ax.set(title=title, ylabel=ylabel)
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
