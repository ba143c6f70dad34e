"""hsched.eval.thermal (paper 003 table 5 / fig.9): the quick run writes the tables and the PNGs, and a row
added through the POLICY_FACTORIES hook shows up."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hsched.eval import EXPERIMENTS, thermal
from hsched.eval.report import EvalContext


def test_pct_and_resample() -> None:
    assert thermal._pct(0.9, 1.2) == pytest.approx(-25.0)  # (0.9 − 1.2) / 1.2 = −25 %
    assert math.isnan(thermal._pct(3.0, 0.0))
    # a value holds from its time on: 5 on [0, 1), 7 on [1, 4), 2 from 4
    got = thermal._resample(
        np.array([0.0, 1.0, 4.0]), np.array([5.0, 7.0, 2.0]), np.array([0.0, 0.5, 1.0, 3.9, 9])
    )
    assert got.tolist() == [5.0, 5.0, 7.0, 7.0, 2.0]


def test_quick_run_writes_table_deltas_and_pngs(tmp_path, monkeypatch) -> None:
    assert EXPERIMENTS["thermal"][0] == "hsched.eval.thermal:run"
    # the hook: a learned agent is a callable (obs, action_mask) -> action; here "the last feasible server"
    hooked = {
        **thermal.POLICY_FACTORIES,
        "Last": lambda seed: lambda obs, mask: int(np.flatnonzero(mask)[-1]),
    }
    monkeypatch.setattr(thermal, "POLICY_FACTORIES", hooked)
    calls: list[tuple[str, int, int]] = []
    ctx = EvalContext(seeds=[0, 1], out_dir=tmp_path, quick=True, progress=lambda *a: calls.append(a))
    report = thermal.run(ctx)

    assert "Quick run" in report
    assert report.count("| policy | mean reward | mean PUE | mean overloads | mean rack outlet °C |") == 2
    assert report.count("| policy | ΔPUE vs RR % | ΔPUE vs Greedy % |") == 2
    for name in ("RR", "Greedy", "BestFit", "FirstFit", "Random", "Utilization", "Last", "paper: Double DQN"):
        assert f"| {name} |" in report
    rr_delta = next(line for line in report.splitlines() if line.startswith("| RR | 0.00 ± 0.00"))
    assert "0.000 ± 0.000" in rr_delta  # RR against itself: no outlet difference
    assert "| paper: Double DQN | -2.5 | -1.7 | -42.1 | -13.2 | -0.4 | -0.2 |" in report

    for name in ("thermal_outlet.png", "thermal_pue.png", "thermal_outlet_redline.png"):
        png = tmp_path / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and str(png) in report
    total = 2 * 2 * len(hooked)  # modes × seeds × policies
    assert calls[0] == ("thermal", 0, total) and calls[-1][1:] == (total, total)
