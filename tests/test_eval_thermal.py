"""hsched.eval.thermal (paper 003 table 5 / fig.9): the quick run writes the tables and the PNGs, a row
added through the POLICY_FACTORIES hook shows up, and every policy's gap to the exact optimum of the small
instances is stated."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hsched.envs.dc import percent_change
from hsched.eval import EXPERIMENTS, thermal
from hsched.eval.report import EvalContext


def test_pct_and_resample() -> None:
    assert percent_change(0.9, 1.2) == pytest.approx(-25.0)  # (0.9 − 1.2) / 1.2 = −25 %
    assert math.isnan(percent_change(3.0, 0.0))
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
    assert report.count("| policy | mean reward | mean PUE | mean overloads | mean rack outlet °C | room CPU load % |") == 2
    rr = next(line for line in report.splitlines() if line.startswith("| RR |"))  # the first table's row
    load = float(rr.split("|")[6].split("±")[0])  # the room's time-weighted CPU load, % of its cores
    assert 0 < load < 100
    assert report.count("| policy | ΔPUE vs RR % | ΔPUE vs Greedy % |") == 2
    for name in ("RR", "Greedy", "BestFit", "FirstFit", "Random", "Utilization", "Last", "paper: Double DQN"):
        assert f"| {name} |" in report
    rr_delta = next(line for line in report.splitlines() if line.startswith("| RR | 0.00 ± 0.00"))
    assert "0.000 ± 0.000" in rr_delta  # RR against itself: no outlet difference
    assert "| paper: Double DQN | -2.5 | -1.7 | -42.1 | -13.2 | -0.4 | -0.2 |" in report

    for name in ("thermal_outlet.png", "thermal_pue.png", "thermal_outlet_redline.png"):
        png = tmp_path / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and str(png) in report
    total = 2 * 2 * len(hooked) + 2  # modes × seeds × policies, then one small exact instance per seed
    assert calls[0] == ("thermal", 0, total) and calls[-1][1:] == (total, total)


def _table_after(text: str, header: str) -> list[list[str]]:
    """The cells of the markdown table whose header line starts with `header` (separator row skipped)."""
    lines = text.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[i + 2 :]:
        if not line.startswith("| "):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
    return rows


def test_quick_run_states_each_policys_gap_to_the_optimum(tmp_path) -> None:
    report = thermal.run(EvalContext(seeds=[0, 1], out_dir=tmp_path, quick=True))
    heading = "### Gap to the optimum on small instances"
    assert report.count(heading) == 1
    section = report.split(heading)[1]

    instances = _table_after(section, "| seed | pre-load jobs |")
    assert [row[0] for row in instances] == ["0", "1"]
    assert all(row[7] == "optimal" for row in instances)

    rows = {row[0]: row for row in _table_after(section, "| policy | complete | peak inlet °C |")}
    (optimum,) = [label for label in rows if label.startswith("Optimum (MILP, ")]
    assert optimum.startswith("Optimum (MILP, optimal 2/2; solve ")  # every seed proven optimal
    opt_rise = float(rows[optimum][3].split(" ± ")[0])
    assert set(rows) == {*thermal.POLICY_FACTORIES, optimum}
    for name in thermal.POLICY_FACTORIES:
        complete, peak, rise, gap, overloaded = rows[name][1:]
        assert complete in ("1/2", "2/2")  # at least one seed where the whole batch was placed
        assert float(gap.split(" ± ")[0]) >= 0.0
        assert float(rise.split(" ± ")[0]) >= opt_rise - 1e-3 or complete != "2/2"
        assert " ± " in peak and " ± " in overloaded


def test_small_instances_are_exact_and_no_policy_is_cooler_than_the_optimum() -> None:
    warm, train, evaluation = thermal.QUICK_SPLIT
    racks, spr = thermal.OPT_ROOM[True]
    for seed in (0, 1, 2):
        inst = thermal.small_instance(seed, warm + train, evaluation, quick=True)
        state = inst.state
        assert state.n == inst.room.n == racks * spr
        busy = int((state.table.cpu_milli - state.free_cpu).sum())
        assert 0 < busy <= thermal.OPT_PRELOAD * int(state.table.cpu_milli.sum())
        first = warm + train + evaluation * seed
        assert inst.job_ids and inst.job_ids[0] >= first and inst.job_ids[-1] < first + evaluation
        assert inst.parts <= thermal.OPT_BATCH_PARTS[True]
        before = state.snapshot()

        inst, result = thermal.solve_small_instance(inst, time_limit_s=10.0)
        assert result.optimal and result.deployed == len(inst.tasks)
        after = thermal._copy(inst.state)
        result.apply(after)
        opt = thermal._measure(inst.room, after)
        assert opt["peak"] == pytest.approx(result.objective)
        assert opt["overloaded"] == result.secondary
        for name, factory in thermal.POLICY_FACTORIES.items():
            placed = thermal.place_batch(inst, factory(seed))
            if placed is None:
                continue
            assert len(placed.allocations) == len(state.allocations) + len(inst.tasks), name
            got = thermal._measure(inst.room, placed)
            assert got["rise"] >= opt["rise"] - 1e-9, name
        assert all((a == b).all() for a, b in zip(before, state.snapshot(), strict=True))  # untouched
