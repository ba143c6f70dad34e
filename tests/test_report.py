"""hsched.eval.report: the shared figure style (palette, y limits, error bars, reference lines) and the
identical-column note of the markdown tables; one eval's figure rendered to PNG on a tiny run."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hsched.eval.report import (
    OKABE_ITO,
    REFERENCE_COLOUR,
    markdown_table,
    mean_std,
    plot_bars,
    plot_lines,
    plot_per_label,
    style,
    summarise,
    y_limits,
)

PNG = b"\x89PNG\r\n\x1a\n"


def test_mean_std_leaves_out_seeds_without_a_value_and_says_so():
    assert mean_std([1.0, 3.0], 2) == "2.00 ± 1.41"  # sample std: sqrt(((1-2)² + (3-2)²) / 1)
    assert mean_std([5.0], 1) == "5.0 ± 0.0"
    assert mean_std([1.0, float("nan"), 3.0], 2) == "2.00 ± 1.41 (2 of 3 seeds)"
    assert mean_std([float("nan"), float("nan")]) == mean_std([]) == "-"  # (statistics.stdev raised on a NaN)


def test_palette_distinct_for_16_series():
    styles = [style(i) for i in range(16)]
    assert len({(s.colour, s.marker) for s in styles}) == 16
    # a colour that comes back is hollow and hatched/dashed: (colour, marker, fill, hatch) all distinct too
    assert len({(s.colour, s.hatch) for s in styles}) == 16
    assert all(s.colour in OKABE_ITO and s.colour != REFERENCE_COLOUR for s in styles)
    # the GPU eval's 11 rows: PPO (the 11th) does not take BestFit's (the 1st) colour
    assert styles[10].colour != styles[0].colour


def test_summarise_std_and_ci95():
    # hand-computed: values 1, 2, 3: mean 2, sample std 1; 95 % CI half-width t(2 df) · 1/√3 = 4.303/1.732
    assert summarise([1, 2, 3]) == (2.0, 1.0)
    m, h = summarise([1, 2, 3], "ci95")
    assert m == 2.0 and h == pytest.approx(4.303 / 3 ** 0.5)
    assert summarise(5.0) == (5.0, 0.0) and summarise([4.0]) == (4.0, 0.0)
    with pytest.raises(ValueError, match="error"):
        summarise([1, 2], "sem")


def test_y_limits_small_differences_not_from_zero():
    # deployed counts 177 ± 5.7 … 179.5 ± 4.9 with a MILP bound at 209: fitted, says it is cut
    bottom, top, cut = y_limits([171.3, 174.6], [182.7, 184.4], refs=[209.0])
    assert cut and 0 < bottom <= 171.3 and top >= 209.0
    assert bottom > 150  # the ±5-task differences take most of the axis


def test_y_limits_large_differences_from_zero():
    bottom, top, cut = y_limits([0.2, 0.9], [0.25, 0.95])
    assert (bottom, cut) == (0.0, False) and top >= 0.95


def test_y_limits_negative_and_degenerate():
    assert y_limits([], []) == (0.0, 1.0, False)
    assert y_limits([0.0], [0.0]) == (-1.0, 1.0, False)
    bottom, top, cut = y_limits([-105.0], [-100.0])
    assert cut and bottom <= -105.0 and -100.0 <= top < 0


@given(st.lists(st.tuples(st.floats(-1e6, 1e6), st.floats(0, 1e4)), min_size=1, max_size=12),
       st.lists(st.floats(-1e6, 1e6), max_size=3))
def test_y_limits_contain_every_error_bar_and_reference(points, refs):
    lows = [m - e for m, e in points]
    highs = [m + e for m, e in points]
    bottom, top, cut = y_limits(lows, highs, refs)
    assert bottom < top
    assert all(bottom <= v <= top for v in (*lows, *highs, *refs))
    assert cut == (not bottom <= 0.0 <= top)


def test_identical_columns_note():
    headers = ["policy", "GPU memory", "GPU core", "CPU"]
    same = markdown_table(headers, [["a", "0.94 ± 0.01", "0.94 ± 0.01", "0.33"], ["b", "0.93", "0.93", "0.32"]])
    assert "Identical columns" in same and "“GPU memory” = “GPU core”" in same and "CPU”" not in same
    differ = markdown_table(headers, [["a", "0.94", "0.93", "0.33"], ["b", "0.93", "0.93", "0.32"]])
    assert "Identical" not in differ
    # one row: equal cells are a coincidence; placeholder-only columns and the label column are not compared
    assert "Identical" not in markdown_table(headers, [["a", "1", "1", "1"]])
    assert "Identical" not in markdown_table(["policy", "x", "y"], [["a", "-", "-"], ["a", "-", "-"]])


def _check_png(path) -> None:
    assert path.read_bytes()[:8] == PNG and path.stat().st_size > 5000


def test_plots_render_with_errors_refs_and_many_series(tmp_path):
    import matplotlib.pyplot as plt

    samples = {f"policy {i}": [170.0 + i % 5, 175.0 + i % 3] for i in range(12)}
    _check_png(plot_per_label(tmp_path / "per.png", "deployed", "tasks", samples, refs={"bound": 190.0}))
    bars = {f"s{i}": [[0.9, 0.92], [0.3, 0.31]] for i in range(10)}
    _check_png(plot_bars(tmp_path / "bars.png", "util", "share", ["GPU", "CPU"], bars, separate_axes=True))
    _check_png(plot_lines(tmp_path / "lines.png", "jct", "executors", "s",
                          {"a": ([1, 2], [[10.0, 11.0], [8.0, 9.0]])}, refs={"bound": ([1, 2], [5.0, 4.0])},
                          error="ci95"))
    assert not plt.get_fignums()  # every figure closed


def test_gpu_eval_figures_on_a_tiny_run(tmp_path, monkeypatch):
    """A tiny `hsched eval gpu` run (2 heuristics, 30 tasks, 2 seeds) renders its figures; the deployed
    figure's y axis is fitted around the data and includes every error bar; the MILP bound is a line."""
    import matplotlib

    matplotlib.use("Agg")
    from hsched.eval import gpu, report
    from hsched.eval.report import EvalContext

    monkeypatch.setattr(gpu, "HEURISTICS", (("bestfit", "BestFit"), ("random", "Random")))
    monkeypatch.setattr(gpu, "LEARNED_POLICIES", {})
    ctx = EvalContext(seeds=[0, 1], out_dir=tmp_path, quick=True)
    setting = dataclasses.replace(gpu.settings(ctx)[0], n_tasks=30)
    rows = gpu.evaluate(ctx, setting, with_optimum=False)
    # a hand-made optimum row (the MILP is not solved in a smoke test): bound 35, best placement 33
    for seed_metrics in rows.by_label["BestFit"]:
        rows.add(gpu.OPTIMUM_LABEL, dict(seed_metrics, deployed=33.0, bound=35.0, optimal=0.0))
    seen = {}
    real = report.y_limits

    def spy(lows, highs, refs=(), **kw):
        out = real(lows, highs, refs, **kw)
        seen.setdefault("calls", []).append((list(lows), list(highs), list(refs), out))
        return out

    monkeypatch.setattr(report, "y_limits", spy)
    files = gpu._plots(ctx, setting, rows, "paper")
    assert len(files) == 5
    for f in files:
        _check_png(tmp_path / f.rsplit("/", 1)[-1])
    # the deployed figure: the second plot_per_label call after the utilisation panels
    deployed = [c for c in seen["calls"] if 35.0 in c[2]]
    assert len(deployed) == 1
    lows, highs, refs, (bottom, top, _) = deployed[0]
    assert refs == [35.0, 33.0] and len(lows) == 2  # optimum drawn as lines, not as a bar
    assert bottom <= min(lows) and top >= max(highs) and top >= 35.0
