"""`hsched eval gpu` (paper 000 tables 6-9) and `hsched eval node-vs-cluster` (paper 002 table 2): quick runs
write their tables and PNGs; the Volcano Global emulation's pieces by hand."""

from __future__ import annotations

import dataclasses

import pytest

from hsched.domain.cluster import ClusterState, GpuShare, Part
from hsched.domain.resources import Resources
from hsched.domain.task import TaskSpec
from hsched.envs.gpu import MultiClusterState
from hsched.eval.node_vs_cluster import (
    aggregate_replicas,
    divide_replicas,
    run_cluster_level,
    run_node_level,
    sample_jobs,
)
from hsched.eval.report import EvalContext
from hsched.policies.heuristics import make_policy
from tests.test_env_gpu import GIB, fleet, gpu_pool


def _check_pngs(report: str, ctx: EvalContext, prefix: str, count: int) -> None:
    pngs = sorted(ctx.out_dir.glob(f"{prefix}*.png"))
    assert len(pngs) == count
    for p in pngs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
        assert str(p) in report


def test_eval_gpu_quick(tmp_path):
    from hsched.eval.gpu import run

    ctx = EvalContext(seeds=[0, 1], out_dir=tmp_path, quick=True)
    report = run(ctx)
    for heading in ("Table 6 layout", "Table 7 layout", "Table 8 layout", "Table 9 layout"):
        assert heading in report
    for row in ("| BestFit |", "| Greedy (paper 000: first fit) |", "| Random |", "| Utilization |",
                "| FGD |"):
        assert report.count(row) == 4  # one row per table
    assert "of 220" in report and " ± " in report
    # the learned rows name the file served and what it was trained on
    assert "EADE-DDPG row: " in report and "eade_ddpg_gpu.pt (trained on alibaba_openb_gpu_2023" in report
    _check_pngs(report, ctx, "gpu_paper_", 5)


def test_eval_gpu_learned_hook(tmp_path, monkeypatch):
    from hsched.eval import gpu

    stub = {"EADE-DDPG (stub)": lambda view, seed: make_policy("firstfit")}
    monkeypatch.setattr(gpu, "LEARNED_POLICIES", stub)
    monkeypatch.setattr(gpu, "HEURISTICS", (("bestfit", "BestFit"),))
    report = gpu.run(EvalContext(seeds=[0], out_dir=tmp_path, quick=True))
    assert report.count("| EADE-DDPG (stub) |") == 4


def test_eval_node_vs_cluster_quick(tmp_path):
    from hsched.eval.node_vs_cluster import run

    ctx = EvalContext(seeds=[0], out_dir=tmp_path, quick=True)
    report = run(ctx)
    for row in ("| BestFit | node |", "| FGD | node |", "| Volcano-divided | cluster |",
                "| Volcano-duplicated | cluster |"):
        assert row in report
    assert "jobs deployed" in report and "| gap to optimum |" in report and "optimum (offline MILP)" not in report
    _check_pngs(report, ctx, "node_vs_cluster_", 3)


def test_eval_node_vs_cluster_quick_with_the_optimum_row(tmp_path):
    from hsched.eval.node_vs_cluster import run

    report = run(EvalContext(seeds=[0], out_dir=tmp_path, quick=True), optimum_time_limit_s=3.0)
    row = next(line for line in report.splitlines() if line.startswith("| optimum (offline MILP) |"))
    assert "(bound " in row and "; proven " in row
    best = next(line for line in report.splitlines() if line.startswith("| BestFit | node |"))
    deployed = {r: float(r.split(" | ")[2].split(" ± ")[0]) for r in (row, best)}
    assert deployed[row] >= deployed[best]  # never below a heuristic placing jobs whole
    for line in (row, best):
        gap = line.split(" | ")[3]
        assert gap.startswith("≤ ") and float(gap[2:].split(" ± ")[0]) >= 0.0
    assert "Optimum row:" in report and "time limit 3 s per seed" in report


def test_optimum_deploys_whole_jobs_where_a_greedy_fifo_breaks_one():
    """One cluster, two nodes × one card: J0 = 2 × 70 %, J1 = 2 × 40 %, J2 = 1 × 70 % (FIFO). Node-level
    first fit deploys J0 (one 70 % per card) and then neither J1 nor J2; the optimum skips J0 and deploys J1
    (both replicas on one card) and J2: 2 jobs, proven."""
    from hsched.eval.node_vs_cluster import run_optimum

    (dc,) = fleet([gpu_pool(count=2)])
    view = MultiClusterState([dc])
    job = TaskSpec(Resources(1000, 1024, 0, 0, 1, 70, 1 * GIB), runtime_s=1.0)
    jobs = [dataclasses.replace(job, replicas=2),
            dataclasses.replace(job, replicas=2, resources=dataclasses.replace(job.resources, gpu_core_percent=40)),
            job]
    assert run_node_level(view, jobs, make_policy("firstfit")).deployed == 1
    opt = run_optimum(view, jobs, time_limit_s=10.0)
    assert (opt.deployed, opt.replicas_placed, opt.bound, opt.optimal) == (2, 3, 2.0, True)
    assert sorted(view.fleet.gpu_free_core[:, 0].tolist()) == [20, 30]


def test_divide_replicas_like_karmada_dynamic_weights():
    assert divide_replicas(4, [2, 2]) == [2, 2]
    assert divide_replicas(3, [3, 1, 0]) == [2, 1, 0]  # 9/4 = 2.25 and 3/4 = 0.75: the remainder to the 0.75
    assert divide_replicas(1, [1, 1]) == [1, 0]  # ties: the lower index
    assert divide_replicas(5, [10, 0, 5]) == [3, 0, 2]
    assert divide_replicas(2, [0, 0]) == [0, 0]
    assert sum(divide_replicas(7, [4, 4, 4])) == 7


def test_aggregate_estimate_hides_fragmentation():
    (dc,) = fleet([gpu_pool(count=2)])
    state = ClusterState(dc)
    for node in (0, 1):
        state.apply(f"x{node}", (Part(0, 0, node, 0, 0, 0, 0, (GpuShare(0, 50, 5 * GIB),)),))
    seventy = Resources(1000, 1024, 0, 0, 1, 70, 1 * GIB)
    assert aggregate_replicas(state, seventy) == 1  # 100 % idle in total ...
    assert not state.feasible(seventy).any()  # ... but 50 % on each card
    assert aggregate_replicas(state, Resources(1000, 1024, 0, 0, 1, 70, 1 * GIB), ("V100",)) == 0


def test_cluster_level_divided_fails_where_node_level_places():
    """C0: two cards, each half used (aggregate: 100 % idle); C1: one card 20 % used (80 % idle). A 70 % job:
    "divided" sends it to C0 by the aggregates (1 replica available in each; tie -> lower index) and C0's
    nodes cannot bind it; the node-level placer sees the cards and uses C1; "duplicated" tries both clusters
    and C1's copy binds."""
    dcs = fleet([gpu_pool(count=2)], [gpu_pool()])
    job = TaskSpec(Resources(1000, 1024, 0, 0, 1, 70, 1 * GIB), runtime_s=1.0)

    def loaded() -> MultiClusterState:
        view = MultiClusterState(dcs)
        for node in (0, 1):
            view.clusters[0].apply(f"x{node}", (Part(0, 0, node, 0, 0, 0, 0, (GpuShare(0, 50, 5 * GIB),)),))
        view.clusters[1].apply("y", (Part(0, 0, 0, 0, 0, 0, 0, (GpuShare(0, 20, 2 * GIB),)),))
        return view

    assert [aggregate_replicas(s, job.resources) for s in loaded().clusters] == [1, 1]
    assert run_cluster_level(loaded(), [job], "divided", reset=False).deployed == 0
    view = loaded()
    node = run_node_level(view, [job], make_policy("firstfit"), reset=False)
    assert node.deployed == 1 and view.clusters[1].gpu_free_core[0, 0] == 10
    view = loaded()
    dup = run_cluster_level(view, [job], "duplicated", reset=False)
    assert (dup.deployed, dup.redundant_gpus) == (1, 0.0) and not view.clusters[0].allocations.get("job0")
    # on an empty fleet both clusters bind a copy: one of them is redundant (0.7 GPU held for nothing)
    dup = run_cluster_level(view, [job], "duplicated")
    assert (dup.deployed, dup.redundant_gpus) == (1, pytest.approx(0.7))
    assert all("job0" in s.allocations for s in view.clusters)
    # divided with two replicas on the empty fleet: one to each cluster (available 2 and 1 -> shares 1 and 1)
    two = dataclasses.replace(job, replicas=2)
    div = run_cluster_level(view, [two], "divided")
    assert div.deployed == 1 and all("job0" in s.allocations for s in view.clusters)
    with pytest.raises(ValueError):
        run_cluster_level(view, [job], "mirrored")


def test_sample_jobs_are_seeded_gpu_jobs():
    jobs = sample_jobs(30, seed=5)
    assert jobs == sample_jobs(30, seed=5) and jobs != sample_jobs(30, seed=6)
    assert all(j.resources.gpu_count >= 1 and 1 <= j.replicas <= 4 for j in jobs)
    assert dataclasses.replace(jobs[0], replicas=1).total.gpu_count == jobs[0].resources.gpu_count
