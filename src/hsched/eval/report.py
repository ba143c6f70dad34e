"""Shared pieces of the evaluation reports: run context, mean ± std over seeds, markdown tables, plots."""

from __future__ import annotations

import math
import statistics
import textwrap
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
    # `hsched eval --fleet F --trace T --cores-per-proc N --time-compression X --tasks K`: the data an experiment runs on
    # (None: its own default: the default fleet, the paper's trace); each report names what it used
    fleet_path: str | None = None
    trace: str | None = None
    cores_per_proc: int = 1
    time_compression: float = 1.0
    tasks: int | None = None  # how many trace tasks (None: the experiment's default)

    def png(self, name: str) -> Path:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        return self.out_dir / name

    def fleet(self) -> Fleet:
        from hsched.domain.fleet import load_fleet

        return load_fleet(self.fleet_path)

    def trace_ref(self, default: str) -> TraceRef:
        """`--trace` (with its scaling flags), else the experiment's `default` catalogue trace."""
        from hsched.traces.catalog import resolve_trace

        return resolve_trace(self.trace or default, self.cores_per_proc, time_compression=self.time_compression)

    def trace_for(self, kind: str, default: str) -> tuple[TraceRef, str]:
        """The trace of the `kind` ("swf" CPU jobs / "openb" GPU pods) an experiment needs: `--trace` when it is
        of that kind, else `default` with a note saying why (so `eval all --trace T` runs every experiment)."""
        from hsched.traces.catalog import resolve_trace

        if self.trace:
            ref = self.trace_ref(default)
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
    """'m ± s' over seeds (s = sample standard deviation; '± 0' for one seed); a seed without a value (NaN: e.g.
    nothing placed) is left out and the cell says over how many seeds it is."""
    given = [float(v) for v in values]
    vals = [v for v in given if math.isfinite(v)]
    if not vals:
        return "-"
    m = statistics.fmean(vals)
    s = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return f"{m:.{digits}f} ± {s:.{digits}f}" + (f" ({len(vals)} of {len(given)} seeds)" if len(vals) < len(given)
                                                  else "")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]], align_right_from: int = 1) -> str:
    """A markdown table; when value columns (from `align_right_from`) are equal in every row, a one-line note
    under it says so, so a reader does not look for a difference that is not there."""

    def cell(v: object) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    sep = ["---" if i < align_right_from else "---:" for i in range(len(headers))]
    cells = [[cell(v) for v in row] for row in rows]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    note = identical_columns_note(headers, cells, align_right_from)
    return "\n".join(lines) + (f"\n\n{note}" if note else "")


PLACEHOLDERS = {"", "-", "n/a", "not trained"}


def identical_columns(headers: Sequence[str], rows: Sequence[Sequence[str]], first: int = 1) -> list[list[str]]:
    """Groups (≥ 2 headers, in table order) of value columns whose cells are equal in every row. Needs two
    rows or more (one row makes equal cells a coincidence), and columns of placeholders only are left out."""
    if len(rows) < 2:
        return []
    columns: dict[tuple[str, ...], list[str]] = {}
    for j in range(first, len(headers)):
        col = tuple(str(row[j]) if j < len(row) else "" for row in rows)
        if all(c in PLACEHOLDERS for c in col):
            continue
        columns.setdefault(col, []).append(str(headers[j]))
    return [group for group in columns.values() if len(group) > 1]


def identical_columns_note(headers: Sequence[str], rows: Sequence[Sequence[str]], first: int = 1) -> str:
    groups = identical_columns(headers, rows, first)
    if not groups:
        return ""
    said = "; ".join(" = ".join(f"“{h}”" for h in group) for group in groups)
    return f"_Identical columns (equal in every row): {said}._"


# ---- figures ---------------------------------------------------------------------------------------------
# One implementation of the figure style for every eval: a colour-blind-safe palette (Okabe & Ito, "Color
# Universal Design", 2008) with a marker (lines, dot plots) and a hatch (bars) per series, so series stay
# distinguishable beyond the palette's 7 data colours and in greyscale; black is kept for reference lines
# (optima, bounds). Error bars over seeds say what they are; the y axis is fitted to the data when the
# differences are small next to the level, and then says it does not start at 0 (and bars turn into dots,
# whose position, not length, carries the value); legends sit outside the axes.

OKABE_ITO = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442")  # black: references
REFERENCE_COLOUR = "#000000"
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")  # 8 markers, 7 colours: coprime, pairs repeat at 56
HATCHES = ("", "//", "..", "xx", "\\\\", "++", "oo", "--")
LINESTYLES = ("-", "--", "-.", ":")
REFERENCE_LINESTYLES = ("--", ":", "-.")
ZOOM_BELOW = 0.5  # start the axis at 0 unless the data's spread is below this share of its largest magnitude
PAD = 0.08  # share of the data range added above and below a fitted axis
# two-sided 97.5 % Student t quantiles by degrees of freedom (no scipy dependency for one table)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


@dataclass(frozen=True)
class Style:
    colour: str
    marker: str
    hatch: str
    linestyle: str
    filled: bool  # hollow markers from the second round of the palette on

    def marker_kw(self) -> dict[str, object]:
        return {"color": self.colour, "marker": self.marker,
                "markerfacecolor": self.colour if self.filled else "white",
                "markeredgewidth": 1.0 if self.filled else 1.6}


def style(i: int) -> Style:
    """Series i's style: colour i mod 7 and marker i mod 8 (distinct pairs for 56 series); each further round
    of the palette adds a hatch, a line style and hollow markers, so a colour that comes back never looks
    the same."""
    lap = i // len(OKABE_ITO)
    return Style(OKABE_ITO[i % len(OKABE_ITO)], MARKERS[i % len(MARKERS)], HATCHES[lap % len(HATCHES)],
                 LINESTYLES[lap % len(LINESTYLES)], lap == 0)


def summarise(values: float | Sequence[float], error: str = "std") -> tuple[float, float]:
    """(mean, error half-width) of the per-seed values: `std` = sample standard deviation, `ci95` = 95 %
    Student t confidence interval of the mean; 0 for one value (or a plain number)."""
    if error not in ERROR_KINDS:
        raise ValueError(f"error: must be one of {sorted(ERROR_KINDS)}, got {error!r}")
    vals = [float(values)] if isinstance(values, int | float) else [float(v) for v in values]
    if not vals:
        raise ValueError("values: need at least one value")
    m = statistics.fmean(vals)
    if len(vals) < 2:
        return m, 0.0
    s = statistics.stdev(vals)
    if error == "std":
        return m, s
    t = _T975[len(vals) - 2] if len(vals) - 1 <= len(_T975) else 1.96
    return m, t * s / math.sqrt(len(vals))


ERROR_KINDS = {"std": "± 1 sample std", "ci95": "95 % CI (Student t)"}


def caption(title: str, error: str, n_seeds: int) -> str:
    """The title, and under it what the error bars are (none with one seed)."""
    return f"{title}\nerror bars: {ERROR_KINDS[error]} over {n_seeds} seeds" if n_seeds > 1 else title


def y_limits(lows: Sequence[float], highs: Sequence[float], refs: Sequence[float] = (),
             zoom_below: float = ZOOM_BELOW) -> tuple[float, float, bool]:
    """(bottom, top, cut) of a y axis that contains every error bar (lows = mean − error, highs = mean + error)
    and every reference line. It includes 0 unless the data's spread is below `zoom_below` of its largest
    magnitude (the ±5-task differences on 180 tasks), then it is fitted to the data with `PAD` either side;
    `cut` = the axis does not include 0, so the figure must say so."""
    vals = [float(v) for v in (*lows, *highs, *refs) if math.isfinite(float(v))]
    if not vals:
        return 0.0, 1.0, False
    lo, hi = min(vals), max(vals)
    scale = max(abs(lo), abs(hi))
    if scale == 0.0:
        return -1.0, 1.0, False
    spread = hi - lo
    pad = PAD * (spread if spread > 0 else scale)
    if lo >= 0 and spread >= zoom_below * hi:
        return 0.0, hi + pad, False
    if hi <= 0 and spread >= zoom_below * -lo:
        return lo - pad, 0.0, False
    bottom, top = lo - pad, hi + pad
    if lo >= 0 > bottom or hi <= 0 < top:  # the padding would reach across 0: stop at 0 instead
        bottom, top = max(bottom, 0.0) if lo >= 0 else bottom, min(top, 0.0) if hi <= 0 else top
    return bottom, top, not (bottom <= 0.0 <= top)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def _finish_axis(ax, ylabel: str, limits: tuple[float, float, bool]) -> None:
    """Apply `y_limits`' range; a cut axis says so in its label and gets a break mark where 0 would be."""
    bottom, top, cut = limits
    ax.set_ylim(bottom, top)
    if cut:
        ax.set_ylabel(f"{ylabel}\n(axis does not start at 0)" if ylabel else "(axis does not start at 0)")
        y = 0.0 if bottom > 0 else 1.0
        kw = dict(transform=ax.transAxes, color="k", clip_on=False, linewidth=1)
        for dy in (-0.012, 0.012):
            ax.plot((-0.015, 0.015), (y + dy - 0.01, y + dy + 0.01), **kw)
    else:
        ax.set_ylabel(ylabel)


def _save(plt, fig, ax, path: Path, legend: bool) -> Path:
    """Legend outside the axes (right of `ax`), then the file; the figure is closed."""
    if legend:
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path


def _draw_refs(ax, refs: dict[str, float | tuple[Sequence[float], Sequence[float]]]) -> list[float]:
    """Reference lines (optimum, bound) in black: a number = a horizontal line, (x, y) = a line over x."""
    values: list[float] = []
    for j, (label, ref) in enumerate(refs.items()):
        ls = REFERENCE_LINESTYLES[j % len(REFERENCE_LINESTYLES)]
        if isinstance(ref, int | float):
            ax.axhline(float(ref), color=REFERENCE_COLOUR, linestyle=ls, linewidth=1.3, label=label, zorder=3)
            values.append(float(ref))
        else:
            x, y = ref
            ax.plot(x, y, color=REFERENCE_COLOUR, linestyle=ls, linewidth=1.3, label=label, zorder=3)
            values += [float(v) for v in y]
    return values


Samples = float | Sequence[float]


def plot_lines(path: Path, title: str, xlabel: str, ylabel: str,
               series: dict[str, tuple[Sequence[float], Sequence[Samples]]],
               refs: dict[str, float | tuple[Sequence[float], Sequence[float]]] | None = None,
               error: str = "std") -> Path:
    """One PNG with a line per series {label: (x, y)}; each y is a number or the per-seed values at that x
    (then the line is their mean with error bars, `error` as in `summarise`). `refs`: optimum / bound lines."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    lows: list[float] = []
    highs: list[float] = []
    n_seeds = 1
    for i, (label, (x, ys)) in enumerate(series.items()):
        st = style(i)
        stats = [summarise(y, error) for y in ys]
        n_seeds = max(n_seeds, *(1 if isinstance(y, int | float) else len(y) for y in ys)) if ys else n_seeds
        mean = [m for m, _ in stats]
        err = [e for _, e in stats]
        every = max(1, len(x) // 12)  # long time series: a marker every twelfth of the line
        ax.errorbar(x, mean, yerr=err if any(err) else None, label=label, **st.marker_kw(), markevery=every,
                    linestyle=st.linestyle, linewidth=1.4, markersize=5, capsize=3)
        lows += [m - e for m, e in stats]
        highs += [m + e for m, e in stats]
    ref_values = _draw_refs(ax, refs or {})
    ax.set(title=caption(title, error, n_seeds), xlabel=xlabel)
    ax.grid(alpha=0.3)
    _finish_axis(ax, ylabel, y_limits(lows, highs, ref_values))
    return _save(plt, fig, ax, path, legend=True)


def _dot(ax, x, y, err, st: Style, label: str | None) -> None:
    """A dot with its error bar (dot plots replace bars on a cut axis); the error bar's line style is the
    series' line style, so a colour's second round differs in the bar as well as in the hollow marker."""
    bars = ax.errorbar(x, y, yerr=err, label=label, **st.marker_kw(), linestyle="none", markersize=7,
                       capsize=3)
    for line in bars[2]:
        line.set_linestyle(st.linestyle)


def plot_bars(path: Path, title: str, ylabel: str, groups: Sequence[str], bars: dict[str, Sequence[Samples]],
              refs: dict[str, float] | None = None, error: str = "std", separate_axes: bool = False) -> Path:
    """Grouped bars: one group per entry of `groups`, one bar per series in `bars` ({label: value per group};
    a value is a number or the per-seed values, then the bar is their mean with an error bar). On an axis
    that does not start at 0 the bars become dots (a cut bar's length would lie). `refs`: horizontal lines.
    `separate_axes`: one panel per group, each with its own y axis (groups on different levels, e.g. GPU
    and CPU utilisation, where one shared axis would flatten the differences inside each group)."""
    plt = _pyplot()
    import numpy as np

    stats = {label: [summarise(v, error) for v in values] for label, values in bars.items()}
    n_seeds = max((1 if isinstance(v, int | float) else len(v)) for values in bars.values() for v in values)
    panels = [[g] for g in range(len(groups))] if separate_axes else [list(range(len(groups)))]
    width_in = len(groups) * max(0.8, 0.18 * len(bars)) + (1.2 * len(panels) if separate_axes else 0.0)
    fig, axes = plt.subplots(1, len(panels), dpi=110, squeeze=False, figsize=(max(8.0, width_in), 4.5))
    width = 0.8 / max(len(bars), 1)
    for ax, members in zip(axes[0], panels, strict=True):
        lows = [stats[label][g][0] - stats[label][g][1] for label in stats for g in members]
        highs = [stats[label][g][0] + stats[label][g][1] for label in stats for g in members]
        limits = y_limits(lows, highs, _draw_refs(ax, refs or {}))
        x = np.arange(len(members))
        for i, (label, s) in enumerate(stats.items()):
            st = style(i)
            pos = x + i * width - 0.4 + width / 2
            mean = [s[g][0] for g in members]
            err = [s[g][1] for g in members] if n_seeds > 1 else None
            if limits[2]:
                _dot(ax, pos, mean, err, st, label)
            else:
                ax.bar(pos, mean, width, label=label, color=st.colour, hatch=st.hatch, edgecolor="#333333",
                       linewidth=0.5, yerr=err, capsize=2, error_kw={"elinewidth": 0.9})
        names = [groups[g] for g in members]
        many = len(names) > 1
        ax.set_xticks(x, names, rotation=30 if many else 0, ha="right" if many else "center")
        ax.grid(alpha=0.3, axis="y")
        _finish_axis(ax, ylabel if ax is axes[0][0] else "", limits)  # each panel its own (honest) range
    if separate_axes:
        fig.suptitle(caption(title, error, n_seeds))
    else:
        axes[0][0].set_title(caption(title, error, n_seeds))
    return _save(plt, fig, axes[0][-1], path, legend=True)


def plot_per_label(path: Path, title: str, ylabel: str, samples: dict[str, Samples],
                   refs: dict[str, float] | None = None, error: str = "std") -> Path:
    """One bar (or dot, on a cut axis) per series, named on the x axis, each in its series' style (the same
    style as in the eval's grouped plots, by order); error bars over the per-seed values; `refs` as lines."""
    plt = _pyplot()

    labels = list(samples)
    stats = [summarise(samples[label], error) for label in labels]
    n_seeds = max(1 if isinstance(v, int | float) else len(v) for v in samples.values())
    fig, ax = plt.subplots(figsize=(max(7.0, 0.75 * len(labels) + 2), 4.5), dpi=110)
    ref_values = _draw_refs(ax, refs or {})
    limits = y_limits([m - e for m, e in stats], [m + e for m, e in stats], ref_values)
    for i, (m, e) in enumerate(stats):
        st = style(i)
        err = [e] if n_seeds > 1 else None
        if limits[2]:
            _dot(ax, [i], [m], err, st, None)
        else:
            ax.bar([i], [m], 0.7, color=st.colour, hatch=st.hatch, edgecolor="#333333", linewidth=0.5,
                   yerr=err, capsize=4)
    ax.set_xticks(range(len(labels)), [_wrap(label) for label in labels], rotation=30, ha="right", fontsize=8)
    ax.set_title(caption(title, error, n_seeds))
    ax.grid(alpha=0.3, axis="y")
    _finish_axis(ax, ylabel, limits)
    return _save(plt, fig, ax, path, legend=bool(refs))


def _wrap(label: str, width: int = 24) -> str:
    return "\n".join(textwrap.wrap(label, width)) or label
