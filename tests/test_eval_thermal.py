"""hsched.eval.thermal (paper 003 table 5 / fig.9): the quick run writes the tables and the PNGs, a row
added through the POLICY_FACTORIES hook shows up, every policy's gap to the exact optimum of the small
instances is stated, and the report names the data it ran on: the room's supply air and redline, and what the
Double DQN model's own metadata says it was trained on."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from hsched.envs.dc import percent_change
from hsched.eval import EXPERIMENTS, thermal
from hsched.eval.report import EvalContext
from hsched.rl.ddqn import train_double_dqn
from hsched.rl.training import TrainArgs
from hsched.traces.catalog import resolve_trace
from tests.conftest import SMALL_FLEET
from tests.test_rl_ddqn import TINY, kth_slice


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


def _hot_fleet(tmp_path: Path) -> Path:
    """The small fleet with its first CPU room ("cheap") at 30 °C supply air and a 35 °C redline."""
    data = yaml.safe_load(Path(SMALL_FLEET).read_text())
    data["datacenters"][0]["thermal"] = {"t_supply_c": 30, "redline_c": 35}
    path = tmp_path / "hot.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_report_names_the_supply_air_and_redline_the_room_ran_with(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(thermal, "POLICY_FACTORIES", {k: thermal.POLICY_FACTORIES[k] for k in ("RR", "Greedy")})
    report = thermal.run(EvalContext(seeds=[0], out_dir=tmp_path, quick=True, fleet_path=str(_hot_fleet(tmp_path))))
    assert "Room `cheap`" in report
    assert "\n### Fixed 30 °C supply air\n" in report
    assert "\n### CRAC holding the hottest inlet at the 35 °C redline\n" in report
    assert "Here PUE = 1 + 1/CoP(30 °C) + 5 % other" in report
    assert "thermal parameters (fixed 30 °C supply air)" in report  # the small exact instances' room
    assert "20 °C" not in report and "27 °C" not in report  # the default room's, which did not run


def test_the_double_dqn_note_says_what_its_model_was_trained_on(tmp_path, monkeypatch) -> None:
    trace = kth_slice(tmp_path / "kth300.swf", 300)
    other = kth_slice(tmp_path / "other.swf", 300, skip=300)
    models = tmp_path / "models"
    train_double_dqn(TrainArgs(seed=0, steps=300, out=models / "double_dqn_dc.pt", progress=False,
                               fleet=Path(SMALL_FLEET), trace=str(trace)), TINY)
    monkeypatch.setenv("HSCHED_MODELS_DIR", str(models))
    monkeypatch.setattr(thermal, "POLICY_FACTORIES", {"RR": thermal.POLICY_FACTORIES["RR"],
                                                      "Greedy": thermal.POLICY_FACTORIES["Greedy"],
                                                      "Double DQN": thermal._double_dqn})

    def note(on: Path) -> str:
        report = thermal.run(EvalContext(seeds=[0], out_dir=tmp_path / on.stem, quick=True, fleet_path=SMALL_FLEET,
                                         trace=str(on)))
        assert "| Double DQN |" in report and "500-job" not in report
        return next(line for line in report.splitlines() if line.startswith("Double DQN: "))

    # its metadata's trace and jobs (the trainer's 2 : 3 split of 300 jobs), which this run's evaluation jobs
    # (the eval's own split of the same 300) fall among: not held out
    same = note(trace)
    assert f"/double_dqn_dc.pt` (`hsched.rl.ddqn`), trained on `{trace.resolve()}`, jobs 120-299: this run's trace, " \
           "and those jobs overlap these evaluation jobs (" in same
    assert "never" not in same and "validation" not in same  # no claim its metadata does not make
    elsewhere = note(other)
    assert f"trained on `{trace.resolve()}`, jobs 120-299: another trace than this run's, {other}" in elsewhere
    assert "never" not in elsewhere

    # the shipped model (Thunder jobs 2000-4499, its reward chosen on 4500-4999) on Thunder's quick windows
    monkeypatch.setenv("HSCHED_MODELS_DIR", str(Path(__file__).parents[1] / "models"))
    thunder = resolve_trace("thunder")
    held_out = thermal._double_dqn_note(thunder, [(500, 550), (550, 600)])
    assert ("trained on `pwa_swf/LLNL-Thunder-2007-1.1-cln.swf.gz`, jobs 2000-4499, with eq.12's constants chosen on "
            "its validation jobs 4500-4999: this run's trace, never on these evaluation jobs (500-599).") in held_out
    assert "not held out" in thermal._double_dqn_note(thunder, [(4900, 5000)])


def test_a_double_dqn_model_that_cannot_serve_the_room_leaves_its_row_out_with_why(tmp_path, monkeypatch) -> None:
    """A truncated model in HSCHED_MODELS_DIR: the report says why there is no Double DQN row (it was a torch
    traceback), and the other rows are computed."""
    models = tmp_path / "models"
    models.mkdir()
    shipped = thermal.model_path(thermal.DOUBLE_DQN_MODEL)
    (models / "double_dqn_dc.pt").write_bytes(shipped.read_bytes()[:5000])
    (models / "double_dqn_dc.json").write_text(shipped.with_suffix(".json").read_text())
    monkeypatch.setenv("HSCHED_MODELS_DIR", str(models))
    monkeypatch.setattr(thermal, "POLICY_FACTORIES", {"RR": thermal.POLICY_FACTORIES["RR"],
                                                      "Greedy": thermal.POLICY_FACTORIES["Greedy"],
                                                      "Double DQN": thermal._double_dqn})
    report = thermal.run(EvalContext(seeds=[0], out_dir=tmp_path / "out", quick=True))
    assert "| RR |" in report and "| Double DQN |" not in report
    assert f"Double DQN: no row, {models / 'double_dqn_dc.pt'} is not a readable checkpoint (" in report
    assert list(thermal.POLICY_FACTORIES) == ["RR", "Greedy", "Double DQN"]  # left as it was for the next run
