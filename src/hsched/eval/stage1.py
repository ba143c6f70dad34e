"""`hsched eval stage1`: paper 003 fig.6 — the total cost of sending a task to each DC, per path method.

Two views, both computed by the selector's own cost code (`hsched.costs.rank_datacenters`: eq.1 + eq.2):

1. Fig.6 (cost per DC). The paper's example task — 2 048 CPU cores, 4 GB memory, 200 Mbit/s bandwidth,
   128 GB disk — run for `RUNTIME_S` (1 h) and moving `DATA_SIZE_GB` of input from the scheduler vertex to
   each DC of the fleet (default: the 11 of the default fleet; `--fleet`). The paper gives no data size; 100 GB (≈ 50 MB per core) is
   our choice: at the fleet's network price (0.002 USD per GB·ms) it makes the path visible in the total
   (≈ 1-3 %), while 10 GB would move it by well under 1 %. A sensitivity table shows 10 GB and 1 TB too.
   Memory and disk are read as GiB, the unit the fleet's prices are quoted in.
   Per DC, each method contributes the path it would use:
   - min-cost: Dijkstra's lowest-latency path (exact for eq.3);
   - crf: a random simple path (paper: "communication path chosen at random"), drawn per seed;
   - spf: "nearest DC first" is a rule for *choosing* a DC; the path to a given DC is the shortest one,
     so its per-DC cost equals min-cost's. It is reported anyway, for completeness with the paper's figure;
     the methods differ in the ranking view;
   - eq11-optimum: the exact optimum of the path MDP of paper 003 §2.1 (hsched.envs.path, value
     iteration, γ = 0.99) — what a perfectly trained PER-DQN agent maximising eq.11 would route. A
     reference row, not a selector method: it shows where eq.11's optimum is not the shortest path.
   - per-dqn: the shipped PER-DQN agent (models/per_dqn_path.pt, hsched.rl.dqn, trained on the latency
     reward whose optimum is Dijkstra's), ranked by eq.3 like min-cost; a path of it that is invalid or
     longer than Dijkstra's would be replaced by the selector and counted. Skipped, with a note in the
     report, when the model is missing or of another architecture (ModelMismatch).
2. Ranking view: `TASKS` real jobs (default LLNL Thunder, the 500 evaluation jobs after the 5 000 used by
   stage 2; `--trace` any SWF log, `--cores-per-proc`, `--tasks`), each entering the WAN at a vertex drawn per seed, data size = memory request (the convention
   of bench/stack_bench.py: SWF logs record no data size). Each method picks its top-ranked DC among the
   DCs that can structurally hold the task (`DcSelector.structural_misfit`, the selector's capacity
   filter on empty DCs). min-cost is optimal for eq.3 given capacity; the others are compared with it by
   total cost, gap % = Σ method / Σ optimum − 1, and how often they pick the optimal DC.

   A DC no path can carry the example task to, and a task no reachable DC can hold (unreachable, or its network
   bounds such as bandwidth broken), are reported, not a crash. The `min-cost+stranding` row ranks with the
   selector's GPU-stranding term (hsched.costs.stranding) from empty DCs; every row says how many tasks went to
   GPU DCs and the GPUs they would strand there.

Mean ± sample std over `ctx.seeds` (seeds drive the CRF paths and the entry vertices).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from hsched.costs import MB_PER_GB, Candidate, PathFinder, RandomPathFinder, WanGraph, rank_datacenters
from hsched.costs.selection import exclusion_summary
from hsched.costs.stranding import StrandingConfig, free_of, stranded_gpus
from hsched.domain.cluster import ClusterState
from hsched.domain.fleet import DataCenter, Fleet
from hsched.domain.resources import MIB_PER_GIB, MILLI, Resources
from hsched.domain.task import TaskSpec
from hsched.eval.report import EvalContext, markdown_table, mean_std, plot_bars
from hsched.traces.catalog import LABELS, TraceRef

RUNTIME_S = 3600.0
DATA_SIZE_GB = 100.0
SENSITIVITY_GB = (10.0, 100.0, 1000.0)
TASKS, QUICK_TASKS = 500, 40
THUNDER = "pwa_swf/LLNL-Thunder-2007-1.1-cln.swf.gz"
THUNDER_SKIP = 5000  # DESIGN §3.2: 2 000 warm-up + 3 000 training jobs; the 500 after them evaluate
ORACLE_GAMMA = 0.99

EXAMPLE_TASK = TaskSpec(
    resources=Resources(cpu_milli=2048 * MILLI, memory_mib=4 * MIB_PER_GIB, disk_mib=128 * MIB_PER_GIB,
                        bandwidth_mbps=200),
    runtime_s=RUNTIME_S, name="paper-003-example", data_size_mb=DATA_SIZE_GB * MB_PER_GB)


@dataclass(frozen=True)
class PathMethod:
    """A row of fig.6: how `rank_datacenters` ranks (`rank`: min-cost / crf / spf) and where paths come
    from (`finder(graph, seed)`; a min-cost/spf finder's path that is invalid or longer than Dijkstra's
    is replaced by the selector and counted in the report)."""

    rank: str
    finder: Callable[[WanGraph, int], PathFinder]
    about: str
    reference: bool = False  # a reference row (not a selector method): not in the ranking view
    stranding: bool = False  # rank with the GPU-stranding term (hsched.costs.stranding), as the selector does
    unavailable: Callable[[WanGraph], str] | None = None  # why the row cannot run here ("" = it can)


def _eq11_optimum(graph: WanGraph, seed: int) -> PathFinder:
    from hsched.envs.path import PolicyPathFinder, optimal_policy

    return PolicyPathFinder(graph, optimal_policy(graph, gamma=ORACLE_GAMMA), name="eq11-optimum")


PER_DQN_MODEL = "per_dqn_path"
STRANDING_ROW = "min-cost+stranding"



def _per_dqn(graph: WanGraph, seed: int) -> PathFinder:
    from hsched.rl.dqn import load_path_finder

    return load_path_finder(PER_DQN_MODEL, graph, name="per-dqn")


def own_paths(graph: WanGraph, finder: PathFinder, entries: Sequence[str], vertices: Sequence[str]) -> dict[str, int]:
    """The agent's OWN paths (before the selector's guard) for every (entry, DC vertex) pair: how many are as
    short as Dijkstra's, and how many are invalid (a loop, or no arrival within the step cap)."""
    from hsched.costs.selection import no_longer

    pairs = equal = invalid = 0
    for entry in entries:
        for v in vertices:
            best = graph.dijkstra.path(entry, v)
            if best is None:
                continue
            pairs += 1
            path = finder.path(entry, v)
            if path is None or not graph.is_valid_path(path, entry, v):
                invalid += 1
            elif no_longer(graph.path_metrics(path).latency_ms, graph.path_metrics(best).latency_ms):
                equal += 1
    return {"pairs": pairs, "equal": equal, "invalid": invalid}


def _one_vertex(graph: WanGraph) -> str:
    """The path MDP (eq.11) needs two vertices: a WAN of one has no path to choose."""
    return "the WAN has one vertex: no path to choose" if len(graph.vertices) < 2 else ""


def _per_dqn_unavailable(graph: WanGraph) -> str:
    from hsched.rl.dqn import ModelMismatch

    if why := _one_vertex(graph):
        return why
    try:
        _per_dqn(graph, 0)
    except (FileNotFoundError, ModelMismatch) as exc:
        return str(exc)
    return ""


PATH_METHODS: dict[str, PathMethod] = {
    "min-cost": PathMethod("min-cost", lambda g, seed: g.dijkstra, "Dijkstra paths, ranked by eq.3 total"),
    "crf": PathMethod("crf", lambda g, seed: RandomPathFinder(g, seed=seed),
                      "random simple path, ranked by resource cost (eq.1)"),
    "spf": PathMethod("spf", lambda g, seed: g.dijkstra, "Dijkstra paths, ranked by path latency"),
    "per-dqn": PathMethod("min-cost", _per_dqn, "PER-DQN agent's paths (models/per_dqn_path.pt), ranked by eq.3 "
                          "total", unavailable=_per_dqn_unavailable),
    "eq11-optimum": PathMethod("min-cost", _eq11_optimum,
                               f"exact optimum of the path MDP (eq.11, value iteration, γ = {ORACLE_GAMMA})",
                               reference=True, unavailable=_one_vertex),
}


def costs_along(fleet: Fleet, graph: WanGraph, task: TaskSpec, entry: str, finder: PathFinder,
                excluded: dict[str, str] | None = None) -> dict[str, Candidate]:
    """The task's cost at every DC along `finder`'s own paths, by DC name; the DCs it cannot use (unreachable
    from `entry`, or the path breaks the task's network bounds, e.g. bandwidth) go into `excluded` with why.

    `rank_datacenters` with method "crf" is the selector's cost code for a finder whose paths are taken as
    they are (no shortest-path safety net; an invalid path is still replaced by Dijkstra's and noted);
    only the ranking order differs, and it does not matter here.
    """
    ranked, out = rank_datacenters(task, fleet.datacenters, graph, fleet.network_price_per_gb_ms, entry,
                                   "crf", random_path_finder=finder)
    if excluded is not None:
        excluded.update(out)
    return {c.datacenter: c for c in ranked}


def trace_tasks(ref: TraceRef, count: int) -> list[TaskSpec]:
    """`count` tasks of the trace (Thunder: the 500 after stage 2's 5 000), data size = memory request."""
    from hsched.traces.catalog import trace_tasks as load

    skip = THUNDER_SKIP if ref.name == "thunder" else 0
    return [dataclasses.replace(t, data_size_mb=t.resources.memory_mib * 1.0)
            for t in load(ref, limit=count, skip=skip)]


def _fig6(ctx: EvalContext, fleet: Fleet, graph: WanGraph, methods: dict[str, PathMethod]) -> tuple[str, list]:
    entry = fleet.wan.scheduler_vertex
    dcs = fleet.datacenters
    # per method, per DC, per seed: (network cost, total, latency, hops, replaced?)
    cells: dict[str, dict[str, list[Candidate]]] = {m: {dc.name: [] for dc in dcs} for m in methods}
    excluded: dict[str, dict[str, str]] = {m: {} for m in methods}  # DC -> why the example task cannot go there
    total_steps = len(ctx.seeds) * len(methods)
    done = 0
    for seed in ctx.seeds:
        for name, method in methods.items():
            got = costs_along(fleet, graph, EXAMPLE_TASK, entry, method.finder(graph, seed), excluded[name])
            for dc_name, cand in got.items():
                cells[name][dc_name].append(cand)
            done += 1
            ctx.progress("stage1 fig.6 cost per DC", done, total_steps)

    any_replaced = any(c.note for per_dc in cells.values() for cs in per_dc.values() for c in cs)
    rows = []
    for dc in dcs:
        for name in methods:
            cs = cells[name][dc.name]
            if not cs:  # no seed's path could carry the task there
                rows.append([dc.name, name, f"cannot take it: {excluded[name].get(dc.name, '?')}", "-", "-", "-",
                             "-"] + (["-"] if any_replaced else []))
                continue
            replaced = sum(c.note != "" for c in cs)
            rows.append([dc.name, name, f"{cs[0].resource.total:.3f}",
                         mean_std([c.path.latency_ms for c in cs], 2), mean_std([c.path.hops for c in cs], 1),
                         mean_std([c.network_cost for c in cs]), mean_std([c.total for c in cs])]
                        + ([f"{replaced}/{len(cs)}"] if any_replaced else []))
    table = markdown_table(["DC", "method", "resource eq.1 (USD)", "path latency (ms)", "hops",
                            "network eq.2 (USD)", "total (USD)"] + (["invalid path replaced"] if any_replaced
                                                                     else []), rows, align_right_from=2)

    groups = [dc.name for dc in dcs if all(cells[m][dc.name] for m in methods)]
    pngs = [
        plot_bars(ctx.png("stage1_total_cost_per_dc.png"),
                  f"Paper 003 fig.6: total cost per DC (task of 2048 cores, {DATA_SIZE_GB:g} GB data)",
                  "total cost eq.1 + eq.2 (USD)", groups,
                  {m: [[c.total for c in cells[m][g]] for g in groups] for m in methods}),
        plot_bars(ctx.png("stage1_network_cost_per_dc.png"),
                  f"Network cost (eq.2) per DC, {DATA_SIZE_GB:g} GB from the scheduler vertex",
                  "network cost (USD)", groups,
                  {m: [[c.network_cost for c in cells[m][g]] for g in groups] for m in methods}),
    ]

    # sensitivity to the data size: excess of each method's total over min-cost's, mean over DCs
    sens_rows = []
    for gb in SENSITIVITY_GB:
        task = dataclasses.replace(EXAMPLE_TASK, data_size_mb=gb * MB_PER_GB)
        excess: dict[str, list[float]] = {m: [] for m in methods}
        share: list[float] = []
        for seed in ctx.seeds:
            exact = costs_along(fleet, graph, task, entry, graph.dijkstra)
            if not exact:
                continue
            share.append(100 * float(np.mean([c.network_cost / c.total for c in exact.values()])))
            for name, method in methods.items():
                got = costs_along(fleet, graph, task, entry, method.finder(graph, seed))
                both = [d for d in exact if d in got]
                if both:
                    excess[name].append(100 * float(np.mean([got[d].total / exact[d].total - 1 for d in both])))
        sens_rows.append([f"{gb:g}", mean_std(share, 2)] + [mean_std(excess[m], 3) for m in methods if
                                                             m != "min-cost"])
    sens = markdown_table(["data (GB)", "network share of min-cost total (%)"]
                          + [f"{m} excess over min-cost (%)" for m in methods if m != "min-cost"], sens_rows)
    cannot = sorted({d: r for per in excluded.values() for d, r in per.items()}.items())
    note = ("\n\nDCs the example task cannot use from `" + entry + "` (left out of the plots): "
            + "; ".join(f"{d}: {r}" for d, r in cannot) + "." if cannot else "")
    return (table + note + "\n\nSensitivity to the data size (mean over the DCs it reaches):\n\n" + sens,
            pngs)


def _ranking(ctx: EvalContext, fleet: Fleet, graph: WanGraph, methods: dict[str, PathMethod],
             tasks: Sequence[TaskSpec], trace_name: str = "trace") -> tuple[str, list]:
    from hsched.engine.selector import DcSelector

    selector = DcSelector(fleet, graph=graph)  # its structural capacity filter (empty DCs)
    eligible: list[list[DataCenter]] = [[dc for dc in fleet.datacenters if not selector.structural_misfit(t, dc)]
                                        for t in tasks]
    entries = fleet.wan.entry_vertices
    if "min-cost" in methods and any(dc.capacity_total().gpu_count for dc in fleet.datacenters):
        methods = {**methods, STRANDING_ROW: PathMethod(
            "min-cost", lambda g, seed: g.dijkstra, "min-cost + GPU-stranding term, the selector's default "
            "(free resources of empty DCs)", stranding=True)}
    empty_free = {dc.name: free_of(ClusterState(dc)) for dc in fleet.datacenters if dc.capacity_total().gpu_count}
    strand_cfg = StrandingConfig()
    names = [m for m, pm in methods.items() if not pm.reference]
    mean_cost: dict[str, list[float]] = {m: [] for m in names}
    gap: dict[str, list[float]] = {m: [] for m in names}
    agree: dict[str, list[float]] = {m: [] for m in names}
    replaced: dict[str, int] = dict.fromkeys(names, 0)
    picks: dict[str, dict[str, float]] = {m: dict.fromkeys((dc.name for dc in fleet.datacenters), 0.0)
                                          for m in names}
    unplaceable = sum(not e for e in eligible)
    no_path: dict[int, int] = dict.fromkeys(ctx.seeds, 0)  # tasks that fit a DC but no path can carry there
    no_path_examples: list[str] = []
    unrouted: dict[str, int] = dict.fromkeys(names, 0)
    stranded: dict[str, float] = dict.fromkeys(names, 0.0)  # GPUs the picks strand, per seed
    total_steps = len(ctx.seeds) * len(tasks)
    done = 0
    for seed in ctx.seeds:
        rng = np.random.default_rng(seed)
        entry_of = [entries[i] for i in rng.integers(len(entries), size=len(tasks))]
        finders = {m: methods[m].finder(graph, seed) for m in names}
        totals: dict[str, list[float]] = {m: [] for m in names}
        chosen: dict[str, list[str]] = {m: [] for m in names}
        for i, (task, entry, dcs) in enumerate(zip(tasks, entry_of, eligible, strict=True)):
            if dcs:
                # reachable with the task's network bounds (Dijkstra's paths: the best a method can find)
                reach, far = rank_datacenters(task, dcs, graph, fleet.network_price_per_gb_ms, entry)
                if not reach:
                    no_path[seed] += 1
                    if len(no_path_examples) < 3:
                        no_path_examples.append(f"{task.name} from {entry}: {exclusion_summary(far)}")
                    dcs = []
                else:
                    dcs = [dc for dc in dcs if dc.name in {c.datacenter for c in reach}]
            if dcs:
                for m in names:
                    kind = methods[m].rank
                    ranked, _ = rank_datacenters(task, dcs, graph, fleet.network_price_per_gb_ms, entry, kind,
                                                 path_finder=None if kind == "crf" else finders[m],
                                                 random_path_finder=finders[m] if kind == "crf" else None,
                                                 gpu_hosts=empty_free if methods[m].stranding else None,
                                                 stranding=strand_cfg)
                    if not ranked:  # a random (crf) path broke a bound Dijkstra's met: counted, not a crash
                        unrouted[m] += 1
                        continue
                    best = ranked[0]
                    totals[m].append(best.total - best.stranding)  # eq.3 cost: comparable with min-cost's
                    if best.datacenter in empty_free:  # GPUs it strands there, alone in the empty DC
                        stranded[m] += stranded_gpus(task.total, empty_free[best.datacenter], strand_cfg) / len(
                            ctx.seeds)
                    chosen[m].append(best.datacenter)
                    replaced[m] += best.note != ""
                    picks[m][best.datacenter] += 1 / len(ctx.seeds)
            if (i + 1) % 50 == 0 or i + 1 == len(tasks):
                ctx.progress("stage1 ranking", done + i + 1, total_steps)
        done += len(tasks)
        optimum = np.array(totals["min-cost"])
        for m in names:
            got = np.array(totals[m])
            if not len(got) or len(got) != len(optimum):  # nothing placed, or crf paths lost some tasks
                mean_cost[m].append(float(got.mean()) if len(got) else float("nan"))
                continue
            mean_cost[m].append(float(got.mean()))
            gap[m].append(100 * (got.sum() / optimum.sum() - 1))
            agree[m].append(100 * float(np.mean([a == b for a, b in zip(chosen[m], chosen["min-cost"],
                                                                          strict=True)])))
    placed = len(tasks) - unplaceable - round(float(np.mean(list(no_path.values()))))
    picks_gpu = {m: sum(picks[m][d] for d in empty_free) for m in names}
    rows = [[m, methods[m].about, mean_std(mean_cost[m], 4), mean_std(gap[m], 2), mean_std(agree[m], 1)]
            + ([f"{replaced[m]}"] if any(replaced.values()) else [])
            + ([f"{100 * picks_gpu[m] / max(len(tasks), 1):.1f}", f"{stranded[m]:.1f}"] if empty_free else [])
            for m in names]
    headers = ["method", "rule", "mean eq.3 total per task (USD)", "gap to optimum (%)", "picks the optimal DC (%)"]
    headers += ["paths replaced"] if any(replaced.values()) else []
    headers += ["to GPU DCs (%)", "GPUs stranded per seed (each task alone)"] if empty_free else []
    table = markdown_table(headers, rows, align_right_from=2)
    pick_rows = [[dc.name] + [f"{100 * picks[m][dc.name] / max(placed, 1):.1f}" for m in names]
                 for dc in fleet.datacenters]
    pick_table = markdown_table(["DC"] + [f"{m} picks (%)" for m in names], pick_rows)
    png = plot_bars(ctx.png("stage1_picks_per_dc.png"),
                    f"Which DC each method picks ({placed} {trace_name} tasks, random entry vertices)",
                    "share of tasks (%)", [dc.name for dc in fleet.datacenters],
                    {m: [100 * picks[m][dc.name] / max(placed, 1) for dc in fleet.datacenters] for m in names})
    note = (f"{placed} of {len(tasks)} tasks fit at least one DC" + (f"; {unplaceable} fit none and are left out"
                                                                     if unplaceable else "") + ".")
    if any(no_path.values()):
        note += (f" {mean_std(list(no_path.values()), 1)} tasks per seed fit a DC that no path from their entry "
                 "vertex can carry them to (unreachable, or the path breaks their network bounds) and are left "
                 "out, e.g. " + " | ".join(no_path_examples) + ".")
    if any(unrouted.values()):
        note += " Tasks a method's own paths could not carry: " + ", ".join(
            f"{m} {n}" for m, n in unrouted.items() if n) + " (no gap for those seeds)."
    if "per-dqn" in names:
        own = own_paths(graph, methods["per-dqn"].finder(graph, ctx.seeds[0]), fleet.wan.entry_vertices,
                        sorted({dc.vertex for dc in fleet.datacenters}))
        note += (f" per-dqn's own greedy paths, before the guard: {own['equal']} of {own['pairs']} (entry, DC) "
                 f"paths as short as Dijkstra's ({100 * own['equal'] / max(own['pairs'], 1):.1f} %), "
                 f"{own['invalid']} invalid (loop or no arrival); the selector uses Dijkstra's path for the rest, "
                 "so the per-dqn row's paths are all valid.")
    return f"{table}\n\n{note}\n\nShare of the tasks each method sends to each DC (mean over seeds):\n\n" \
           f"{pick_table}", [png]


def run(ctx: EvalContext, fleet: Fleet | None = None, methods: dict[str, PathMethod] | None = None) -> str:
    """The stage-1 report (markdown) for `ctx`; writes three PNGs into `ctx.out_dir`."""
    fleet = fleet or ctx.fleet()
    methods = methods or PATH_METHODS
    if not ctx.seeds:
        raise ValueError("EvalContext.seeds must name at least one seed")
    graph = WanGraph(fleet.wan)
    skipped = {m: why for m, pm in methods.items() if pm.unavailable and (why := pm.unavailable(graph))}
    methods = {m: pm for m, pm in methods.items() if m not in skipped}
    ref = ctx.trace_ref("thunder")
    tasks = trace_tasks(ref, ctx.tasks or (QUICK_TASKS if ctx.quick else TASKS))
    fig6, pngs = _fig6(ctx, fleet, graph, methods)
    ranking, more = _ranking(ctx, fleet, graph, methods, tasks, LABELS.get(ref.name, ref.name))
    r = EXAMPLE_TASK.resources
    lines = [
        "# Stage 1: data-center selection cost (paper 003 fig.6)",
        "",
        f"Data: {ctx.fleet_label(fleet)}, network price {fleet.network_price_per_gb_ms} USD per GB·ms; "
        f"trace {ref.label}. Seeds {ctx.seeds}"
        + (" — QUICK run (fewer tasks)." if ctx.quick else "."),
        "",
        f"## Cost per DC — task of {r.cpu_cores:g} cores, {r.memory_mib / MIB_PER_GIB:g} GiB memory, "
        f"{r.bandwidth_mbps} Mbit/s, {r.disk_mib / MIB_PER_GIB:g} GiB disk for {RUNTIME_S / 3600:g} h, "
        f"{DATA_SIZE_GB:g} GB of data from `{fleet.wan.scheduler_vertex}`",
        "",
        "Paper 003's example task, priced at every DC as in its fig.6 whether or not one of the DC's nodes could "
        "hold it (the ranking below leaves out the tasks no DC can hold). "
        "spf's cost to a *given* DC is min-cost's (both route on the shortest path; spf differs only in which "
        "DC it picks). eq11-optimum is a reference row: the path MDP's exact optimum, not a selector method.",
        *[f"The {m} row is skipped: {why}." for m, why in skipped.items()],
        "",
        fig6,
        "",
        f"## Ranking — {len(tasks)} tasks of {ref.label}"
        + (f" (after its first {THUNDER_SKIP})" if ref.name == "thunder" else "")
        + ", entry vertex drawn per seed, data = memory request",
        "",
        ranking,
        "",
        "Plots: " + ", ".join(f"`{p}`" for p in [*pngs, *more]),
    ]
    return "\n".join(lines) + "\n"
