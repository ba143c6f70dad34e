"""hsched eval stage1 (paper 003 fig.6): the report's structure, exactness properties and one hand-computed DC."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hsched.costs import WanGraph
from hsched.domain.fleet import load_fleet
from hsched.eval import EXPERIMENTS
from hsched.eval.report import EvalContext
from hsched.eval.stage1 import EXAMPLE_TASK, PATH_METHODS, STRANDING_ROW, PathMethod, costs_along, run


def _table_rows(report: str, first_header: str) -> list[list[str]]:
    """The body rows of the markdown table whose header starts with `| first_header |`."""
    lines = report.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def _mean(cell: str) -> float:
    return float(cell.split("±")[0])


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, list]:
    out = tmp_path_factory.mktemp("stage1")
    calls: list[tuple[str, int, int]] = []
    report = run(EvalContext(seeds=[0, 1], out_dir=out, quick=True,
                             progress=lambda label, done, total: calls.append((label, done, total))))
    return report, out, calls


def test_registered() -> None:
    assert EXPERIMENTS["stage1"][0] == "hsched.eval.stage1:run"


def _ran(report: str) -> list[str]:
    """The methods with rows: all of PATH_METHODS but a learned row whose model is missing (said in the report)."""
    return [m for m in PATH_METHODS if f"The {m} row is skipped" not in report]


def test_report_has_a_row_per_dc_and_method(quick_run: tuple[str, Path, list]) -> None:
    report, _, _ = quick_run
    rows = _table_rows(report, "DC")
    fleet = load_fleet()
    pairs = {(r[0], r[1]) for r in rows}
    assert len(rows) == len(fleet.datacenters) * len(_ran(report))
    assert {"min-cost", "crf", "spf", "eq11-optimum"} <= set(_ran(report))
    assert pairs == {(dc.name, m) for dc in fleet.datacenters for m in _ran(report)}
    assert all("±" in r[6] for r in rows)  # mean ± std over the seeds
    assert "QUICK" in report


def test_min_cost_is_never_above_the_other_methods(quick_run: tuple[str, Path, list]) -> None:
    report, _, _ = quick_run
    total: dict[tuple[str, str], float] = {(r[0], r[1]): _mean(r[6]) for r in _table_rows(report, "DC")}
    dcs = {dc for dc, _ in total}
    for dc in dcs:
        assert total[dc, "min-cost"] <= total[dc, "crf"] + 1e-9, dc
        assert total[dc, "min-cost"] <= total[dc, "eq11-optimum"] + 1e-9, dc
        assert total[dc, "spf"] == total[dc, "min-cost"], dc  # same (shortest) path to a given DC
    assert sum(total[dc, "crf"] > total[dc, "min-cost"] for dc in dcs) >= 5  # random paths do cost more
    # ranking view: min-cost is the optimum, every other method's gap is >= 0
    ranking = {r[0]: r for r in _table_rows(report, "method")}
    assert set(ranking) == {"min-cost", "crf", "spf", STRANDING_ROW} | ({"per-dqn"} & set(_ran(report)))
    assert _mean(ranking["min-cost"][3]) == 0.0 and _mean(ranking["min-cost"][4]) == 100.0
    assert all(_mean(ranking[m][3]) >= 0.0 for m in ranking)
    assert _mean(ranking["crf"][3]) > 0.0
    # the GPU-stranding row: its eq.3 gap is what it pays to strand no GPU; its stranded GPUs are never more
    stranded = {m: float(ranking[m][-1]) for m in ranking}
    assert stranded[STRANDING_ROW] <= stranded["min-cost"]
    assert stranded[STRANDING_ROW] == 0.0 or _mean(ranking[STRANDING_ROW][3]) > 0.0


def test_pngs_and_progress(quick_run: tuple[str, Path, list]) -> None:
    report, out, calls = quick_run
    for name in ("stage1_total_cost_per_dc.png", "stage1_network_cost_per_dc.png", "stage1_picks_per_dc.png"):
        png = out / name
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert name in report
    labels = {label for label, _, _ in calls}
    assert labels == {"stage1 fig.6 cost per DC", "stage1 ranking"}
    for label in labels:
        done, total = max((d, t) for lab, d, t in calls if lab == label)
        assert done == total


def test_one_dc_by_hand() -> None:
    # Denver (default.yaml): cpu 0.038, memory 0.0047 /GiB, disk 0.00010 /GiB, bandwidth 0.0004 /Mbit/s, per hour.
    # Eq.1, 1 h: 2048 × 0.038 + 4 × 0.0047 + 128 × 0.00010 + 200 × 0.0004
    #          = 77.824 + 0.0188 + 0.0128 + 0.08 = 77.9356 USD.
    # Eq.2: the only 2-hop path is scheduler –(10 km → 0.05 ms)– Kansas City –(891.8 km great circle, × 5 µs/km
    # = 4.4590 ms)– Denver: 4.5090 ms; 0.002 USD/GB·ms × 100 GB × 4.5090 ms = 0.90181 USD. Total 78.8374 USD.
    fleet = load_fleet()
    graph = WanGraph(fleet.wan)
    cand = costs_along(fleet, graph, EXAMPLE_TASK, "scheduler", graph.dijkstra)["denver"]
    assert cand.path.vertices == ("scheduler", "Kansas City", "Denver")
    assert cand.path.latency_ms == pytest.approx(0.05 + 4.4590, abs=1e-4)
    assert cand.resource.total == pytest.approx(77.9356, abs=1e-9)
    assert cand.network_cost == pytest.approx(0.002 * 100 * 4.50903, abs=1e-5)
    assert cand.total == pytest.approx(78.8374, abs=1e-4)


def test_report_row_matches_the_hand_value(quick_run: tuple[str, Path, list]) -> None:
    report, _, _ = quick_run
    row = next(r for r in _table_rows(report, "DC") if r[:2] == ["denver", "min-cost"])
    assert row[2] == "77.936" and row[6] == "78.837 ± 0.000"


def test_methods_hook_takes_a_new_path_finder(tmp_path: Path) -> None:
    """The PER-DQN row plugs in as a PathMethod; a finder with invalid paths is replaced and reported."""

    class Teleport:
        name = "teleport"

        def path(self, src: str, dst: str) -> tuple[str, ...]:
            return (src, dst)  # skips the links in between: invalid unless they are neighbours

    methods = {"min-cost": PATH_METHODS["min-cost"],
               "teleport": PathMethod("min-cost", lambda g, seed: Teleport(), "jumps straight to the DC")}
    report = run(EvalContext(seeds=[3], out_dir=tmp_path, quick=True), methods=methods)
    rows = {(r[0], r[1]): r for r in _table_rows(report, "DC")}
    assert rows["kansas-city", "teleport"][7] == "0/1"  # scheduler–Kansas City is a real link
    assert rows["denver", "teleport"][7] == "1/1"  # replaced by Dijkstra's, and counted
    assert rows["denver", "teleport"][6] == rows["denver", "min-cost"][6]
    ranking = {r[0]: r for r in _table_rows(report, "method")}
    assert int(ranking["teleport"][5]) > 0  # paths replaced in the ranking view too
    assert re.search(r"\| teleport \| jumps straight", report)


def test_the_per_dqn_row_routes_like_dijkstra_with_the_shipped_model(quick_run: tuple[str, Path, list]) -> None:
    report, _, _ = quick_run
    if "per-dqn" not in _ran(report):
        pytest.skip("models/per_dqn_path.pt is not there")
    rows = {(r[0], r[1]): r for r in _table_rows(report, "DC")}
    for dc in load_fleet().datacenters:
        assert rows[dc.name, "per-dqn"][3] == rows[dc.name, "min-cost"][3], dc.name  # same path latency
        assert len(rows[dc.name, "per-dqn"]) == 7 or rows[dc.name, "per-dqn"][7] == "0/2"  # none replaced
    ranking = {r[0]: r for r in _table_rows(report, "method")}
    assert _mean(ranking["per-dqn"][3]) == 0.0  # same DCs, same costs as min-cost


def test_the_per_dqn_row_is_skipped_with_a_note_without_its_model(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HSCHED_MODELS_DIR", str(tmp_path))  # an empty models dir
    methods = {m: PATH_METHODS[m] for m in ("min-cost", "per-dqn")}
    report = run(EvalContext(seeds=[0], out_dir=tmp_path, quick=True), methods=methods)
    assert "The per-dqn row is skipped: no model at" in report
    assert {r[1] for r in _table_rows(report, "DC")} == {"min-cost"}


def test_a_one_vertex_wan_skips_the_path_mdp_rows_with_a_note(tmp_path: Path) -> None:
    """One DC at the scheduler vertex: no path to choose. The PER-DQN row crashed (an IndexError in its greedy
    tables of a WAN without links) and the eq.11 optimum cannot be built; both are skipped with a note."""
    fleet = tmp_path / "one.yaml"
    fleet.write_text("version: 1\nname: one\nnetwork_price_per_gb_ms: 0.01\n"
                     "wan: {vertices: [{name: s, lat: 0.0, lon: 0.0}], scheduler_vertex: s}\n"
                     "datacenters:\n  - name: only\n    vertex: s\n"
                     "    prices: {cpu_core_hour: 0.03, memory_gib_hour: 0.004}\n"
                     "    layout: {racks: 2, servers_per_rack: 2, rows: 1}\n"
                     "    node_pools: [{name: cpu, count: 4, cpu_cores: 24, memory_gib: 96, disk_gib: 500}]\n")
    report = run(EvalContext(seeds=[0], out_dir=tmp_path, quick=True, fleet_path=str(fleet)))
    for row in ("per-dqn", "eq11-optimum"):
        assert f"The {row} row is skipped: the WAN has one vertex: no path to choose." in report
    assert {r[1] for r in _table_rows(report, "DC")} == {"min-cost", "crf", "spf"}
