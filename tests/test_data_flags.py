"""`hsched eval` / `hsched train` on a fleet and trace other than the defaults (--fleet, --trace,
--cores-per-proc, --time-compression), run as the user runs them: the CLI in a subprocess. A fleet whose WAN is disconnected is a
one-line error naming the cut-off vertices (exit 1), or is pruned when the file asks for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hsched.domain.errors import FleetError
from hsched.domain.fleet import load_fleet, parse_fleet
from hsched.traces.catalog import resolve_trace, trace_jobs, trace_tasks

HERE = Path(__file__).parent
SMALL = HERE / "fleets" / "small.yaml"
SWF = HERE / "traces" / "small.swf"
OPENB = HERE / "traces" / "small_openb.csv"
TIMEOUT_S = 300


def hsched(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.run([sys.executable, "-m", "hsched.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)


def disconnected(tmp_path: Path, **wan: object) -> Path:
    data = yaml.safe_load(SMALL.read_text())
    data["wan"]["vertices"] += [{"name": "island", "lat": 5.0, "lon": 5.0}, {"name": "rock", "lat": 6.0, "lon": 6.0}]
    data["wan"]["links"].append({"a": "island", "b": "rock", "distance_km": 10})
    data["wan"].update(wan)
    path = tmp_path / "cut.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_trace_files_resolve_by_content() -> None:
    swf, openb = resolve_trace(str(SWF), cores_per_proc=3), resolve_trace(str(OPENB))
    assert (swf.kind, openb.kind) == ("swf", "openb")
    first = trace_tasks(swf, limit=1)[0]  # job 1: 2 processors × 3 cores
    assert first.resources.cpu_milli == 6000 and first.name == "swf-1"
    assert sum(t.resources.gpu_count > 0 for t in trace_tasks(openb)) > 0
    assert swf.label == f"{SWF} (3 cores per processor)" and openb.label == str(OPENB)  # the file, named once
    assert resolve_trace("thunder").label == "LLNL Thunder (LLNL-Thunder-2007-1.1-cln.swf.gz)"


def test_time_compression_divides_submit_times_only() -> None:
    plain = resolve_trace(str(SWF))
    fast = resolve_trace(str(SWF), time_compression=4.0)
    before, after = trace_jobs(plain, limit=2), trace_jobs(fast, limit=2)
    assert [t for t, _ in before] == [46.0, 60.0]  # the fixture's first two submit times
    assert [t for t, _ in after] == [11.5, 15.0]
    assert [task for _, task in after] == [task for _, task in before]  # the same tasks, runtimes included
    assert "submit times ÷ 4" in fast.label and "÷" not in plain.label


def test_eval_stage1_and_gpu_on_a_small_fleet_and_trace(tmp_path: Path) -> None:
    out = tmp_path / "reports"
    r = hsched("eval", "stage1", "--fleet", str(SMALL), "--trace", str(SWF), "--cores-per-proc", "2", "--seeds", "1",
               "--tasks", "12", "--out", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    report = (out / "stage1" / "report.md").read_text()
    assert "fleet `small`" in report and "small.swf" in report and "2 cores per processor" in report
    assert "12 tasks of" in report and "Thunder" not in report
    assert "| gpu | min-cost |" in report and "min-cost+stranding" in report
    r = hsched("eval", "gpu", "--fleet", str(SMALL), "--trace", str(OPENB), "--seeds", "1", "--quick", "--tasks", "15",
               "--out", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    report = (out / "gpu" / "report.md").read_text()
    assert "GPU DCs of fleet `small`" in report and f"15 tasks of {OPENB}" in report
    assert "with replacement" not in report
    r = hsched("eval", "gpu", "--fleet", str(SMALL), "--trace", str(OPENB), "--seeds", "1", "--quick", "--tasks", "80",
               "--out", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "80 tasks of" in (report := (out / "gpu" / "report.md").read_text()), report  # of the file's 60 pods
    assert "(the trace holds only 60: drawn with replacement" in report, report


def test_a_disconnected_fleet_is_one_line_naming_the_vertices(tmp_path: Path) -> None:
    path = disconnected(tmp_path)
    r = hsched("eval", "stage1", "--fleet", str(path), "--seeds", "1", "--quick", "--out", str(tmp_path), cwd=tmp_path)
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr
    assert "wan.links" in lines[0] and "'island', 'rock'" in lines[0] and "prune_disconnected" in lines[0]
    r = hsched("train", "per-dqn", "--fleet", str(path), "--steps", "10", "--out", str(tmp_path / "m.pt"),
               cwd=tmp_path)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "'island'" in r.stderr


def test_prune_disconnected_drops_the_cut_off_part_when_asked(tmp_path: Path) -> None:
    fleet = load_fleet(disconnected(tmp_path, prune_disconnected=True))
    assert fleet.wan.pruned == ("island", "rock") and "island" not in fleet.wan.vertices
    assert set(fleet.wan.entry_vertices) == {"s", "a", "b", "c"}
    data = yaml.safe_load(disconnected(tmp_path, prune_disconnected=True).read_text())
    data["datacenters"][0]["vertex"] = "island"
    with pytest.raises(FleetError, match=r"datacenters\[0\]\.vertex: is cut off"):
        parse_fleet(data)
    data = yaml.safe_load(disconnected(tmp_path, entry_vertices=["a", "rock"]).read_text())
    with pytest.raises(FleetError, match="entry vertices among them: 'rock'"):
        parse_fleet(data)


def test_bad_data_flags_are_usage_errors(tmp_path: Path) -> None:
    r = hsched("eval", "stage1", "--trace", str(tmp_path / "nope.swf"), "--out", str(tmp_path), cwd=tmp_path)
    assert r.returncode == 2 and "--trace" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = hsched("eval", "stage1", "--trace", "openb", "--cores-per-proc", "4", "--out", str(tmp_path), cwd=tmp_path)
    assert r.returncode == 2 and "--cores-per-proc: applies to SWF logs only" in r.stderr
    r = hsched("eval", "thermal", "--trace", "openb", "--time-compression", "3", "--out", str(tmp_path), cwd=tmp_path)
    assert r.returncode == 2 and "--time-compression: applies to SWF logs only" in r.stderr
    r = hsched("eval", "thermal", "--time-compression", "3", "--out", str(tmp_path), cwd=tmp_path)
    assert r.returncode == 2 and "--time-compression: scales an SWF --trace" in r.stderr
    r = hsched("eval", "thermal", "--trace", "kth", "--time-compression", "0", "--out", str(tmp_path), cwd=tmp_path)
    assert r.returncode == 2 and "--time-compression" in r.stderr and "> 0" in r.stderr
    r = hsched("train", "per-dqn", "--trace", "thunder", "--out", str(tmp_path / "m.pt"), cwd=tmp_path)
    assert r.returncode == 2 and "--trace: does not apply to a path agent" in r.stderr


def test_train_on_a_small_fleet_and_trace(tmp_path: Path) -> None:
    # a budget that ends before the first gradient update would save an untrained model: refused, one line
    r = hsched("train", "per-dqn", "--fleet", str(SMALL), "--steps", "200", "--out", str(tmp_path / "p.pt"),
               "--quiet", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "hsched: --steps: ends before the first gradient update, at env step 500 (learning_starts 500, "
        "train_every 1): give --steps >= 500 (got 200)"]
    r = hsched("train", "per-dqn", "--fleet", str(SMALL), "--steps", "500", "--out", str(tmp_path / "p.pt"),
               "--quiet", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert '"pairs": 12' in r.stdout  # the small WAN's 4 entry vertices × 3 other targets
    assert json.loads((tmp_path / "p.json").read_text())["hyperparameters"]["steps"] == 500
    r = hsched("train", "double-dqn", "--fleet", str(SMALL), "--trace", str(SWF), "--steps", "2000",
               "--out", str(tmp_path / "d.pt"), "--quiet", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    meta = json.loads((tmp_path / "d.json").read_text())
    assert meta["dc"] == meta["hyperparameters"]["dc"] == "cheap"  # the small fleet's first CPU-only room
    assert (meta["data"]["trace"], meta["data"]["fleet"]) == (str(SWF.resolve()), str(SMALL))


def test_stage1_reports_dcs_the_example_task_cannot_reach_instead_of_crashing(tmp_path: Path) -> None:
    from hsched.eval.report import EvalContext
    from hsched.eval.stage1 import PATH_METHODS, run

    data = yaml.safe_load(SMALL.read_text())
    for link in data["wan"]["links"]:
        if "c" in (link["a"], link["b"]):
            link["bandwidth_mbps"] = 100  # the example task asks for 200 Mbit/s: the gpu DC (at c) is out
    fleet = parse_fleet(data)
    ctx = EvalContext(seeds=[0], out_dir=tmp_path, quick=True, trace=str(SWF), tasks=5)
    report = run(ctx, fleet=fleet, methods={m: PATH_METHODS[m] for m in ("min-cost", "spf")})
    assert "| gpu | min-cost | cannot take it: bottleneck bandwidth 100 Mbit/s < requested 200 |" in report
    assert "DCs the example task cannot use from `s`" in report and "| cheap | min-cost | " in report
