"""`hsched eval gpu`: paper 000 tables 6-9 (utilisation mean/σ per resource across clusters, tasks deployed,
fragmentation, cross-cluster GPU load variance) for the heuristics and FGD, mean ± std over seeds.

Setting (paper 000 §4.1/§4.3): 220 openb tasks drawn per seed, deployed in FIFO order on 16 clusters × 4
hosts (`GpuClusterEnv("paper000")`, see hsched.envs.gpu), no releases during the episode, every policy
on the same tasks for a given seed. A full run adds the default fleet's three GPU DCs (340 hosts, 1 316
GPUs) with 1 800 tasks (≈ 1.2× their GPU capacity). Every policy decides through `run_policy`: the
placer's feasibility mask and `select()`, "wait" when no host has room.

Rows. Paper 000's baselines are defined over clusters; here they rank hosts (the placer is node level):
BestFit, "Greedy" = paper 000's (first host that fits, our "firstfit"), Random, Utilization; plus paper
003's Greedy (the most-utilised host, "greedy") and FGD (hsched.policies.fgd, workload = the openb trace).
The learned rows (DDPG, EADE-DDPG, TD3, SAC, PPO) plug in through `LEARNED_POLICIES` (see the hook below);
the exact optimum of the deployed count (hsched.optimum.max_deployed, an offline MILP that sees all tasks
at once: an upper bound for any online policy) is added in full runs (see `optimum_row`).

The deployed count is reported two ways: "deployed" = n_success (tasks placed) and eq.26's
N = n_success + n_suc_jud. With a feasibility mask a policy never fails, so eq.26's N is the task count
for every masked policy: n_success is the number that separates them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from hsched.domain.fleet import DataCenter
from hsched.envs.gpu import (
    GPU_BASELINES,
    GpuClusterEnv,
    fleet_gpu_datacenters,
    paper000_datacenters,
    policy_for,
    run_policy,
)
from hsched.eval.report import EvalContext, markdown_table, mean_std, plot_bars, plot_per_label
from hsched.metrics import RESOURCES, deployed_count, paper_summary, utilisation_matrix
from hsched.policies.learned import ModelMismatch
from hsched.rl.shipped import PolicyFactory, shipped_gpu_policies

HEURISTICS = GPU_BASELINES  # a module attribute of its own: tests narrow the table to a few rows
RESOURCE_LABELS = {"gpu_memory": "GPU memory", "gpu_core": "GPU core", "cpu": "CPU", "memory": "memory"}
OPTIMUM_LABEL = "optimum (offline MILP)"
OPTIMUM_TIME_LIMIT_S = 60.0
# Paper 000's values for its heuristics (tables 7-9), quoted under our tables for orientation.
PAPER_DEPLOYED = {"BestFit": 183, "Greedy": 182, "Random": 184, "Utilization": 188, "EADE-DDPG": 209}
PAPER_FRAGMENTATION = {"BestFit": 2.1640, "Greedy": 2.3220, "Random": 2.2553, "Utilization": 2.1457,
                       "EADE-DDPG": 1.9853}
PAPER_LOAD_VARIANCE = {"BestFit": 0.0067, "Greedy": 0.0129, "Random": 0.0111, "Utilization": 0.0096,
                       "EADE-DDPG": 0.0020}

# ---- LEARNED ROWS HOOK ------------------------------------------------------------------------------------
# Paper 000's learned rows: label -> factory(view, seed) returning a NodePolicy whose scores(state, demand, mask)
# rank the flattened hosts of `env.view.fleet` (the actor's score per host). They run through the same
# `run_policy` (same mask, same select) as the heuristics and get rows in every table and plot. The shipped
# DDPG and EADE-DDPG models (models/*.pt, `hsched train ddpg|eade-ddpg`) register below when present;
# LEARNED_NOTES says which rows were skipped and why.
LEARNED_POLICIES: dict[str, PolicyFactory] = {}
LEARNED_NOTES: list[str] = []


def register_shipped_models() -> None:
    policies, notes = shipped_gpu_policies()
    LEARNED_POLICIES.update(policies)
    LEARNED_NOTES.extend(notes)


register_shipped_models()


@dataclass
class Setting:
    name: str
    datacenters: tuple[DataCenter, ...]
    n_tasks: int
    note: str
    trace: str | None = None  # openb pod-list path the tasks are drawn from (None: the default pod list)


@dataclass
class Rows:
    """label -> one metrics dict per seed (GpuClusterEnv.episode_metrics keys)."""

    by_label: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def add(self, label: str, metrics: dict[str, float]) -> None:
        self.by_label.setdefault(label, []).append(metrics)

    def values(self, label: str, key: str) -> list[float]:
        return [m[key] for m in self.by_label[label]]


def settings(ctx: EvalContext) -> list[Setting]:
    if ctx.fleet_path or ctx.trace:  # `--fleet/--trace`: one setting on that data
        ref, _ = ctx.trace_for("openb", "openb")
        if ctx.fleet_path:
            fleet = ctx.fleet()
            dcs = fleet_gpu_datacenters(ctx.fleet_path)
            where = f"the GPU DCs of {ctx.fleet_label(fleet)}: {', '.join(d.name for d in dcs)}"
        else:
            dcs, where = paper000_datacenters(), "paper 000 scale: 16 clusters × 4 openb 2-GPU hosts"
        n = ctx.tasks or (220 if ctx.quick or not ctx.fleet_path else
                          max(20, round(1800 * sum(d.capacity_total().gpu_count for d in dcs) / 1316)))
        return [Setting(fleet.name if ctx.fleet_path else "paper 000 scale", dcs, n,
                        f"{where}; {n} tasks of {ref.label} per seed", str(ref.path))] if dcs else []
    out = [Setting("paper 000 scale", paper000_datacenters(), 220,
                   "16 clusters × 4 hosts (openb 2-GPU machines: T4, P100), 128 GPUs; "
                   "220 openb tasks per seed")]
    if not ctx.quick:
        out.append(Setting("default fleet GPU DCs", fleet_gpu_datacenters(), 1800,
                           "kansas-city, houston, indianapolis: 340 hosts, 1 316 GPUs; "
                           "1 800 openb tasks per seed"))
    return out


def optimum_row(env: GpuClusterEnv, seed: int,
                time_limit_s: float = OPTIMUM_TIME_LIMIT_S) -> dict[str, float]:
    """---- OPTIMUM ROW ---- the most tasks any placement could deploy for this seed's tasks on the empty
    fleet (hsched.optimum.max_deployed, HiGHS; offline: all tasks known at once, no order), with the
    metrics of that placement. "optimal" only when proven within `time_limit_s`; "bound" = the proven
    upper bound."""
    from hsched.optimum import max_deployed

    env.reset(seed=seed)
    result = max_deployed(env.clusters, env.tasks, time_limit_s=time_limit_s)
    result.apply(env.clusters)
    left = len(env.tasks) - result.deployed  # tasks the optimum leaves out: none of them fits any more
    out = {"tasks": float(len(env.tasks)), "deployed": float(result.deployed), "judged": float(left),
           "failed": 0.0, "eq26": float(deployed_count(result.deployed, left)),
           "bound": float(result.bound or result.deployed), "optimal": float(result.optimal)}
    out.update(paper_summary(utilisation_matrix(env.clusters), env.clusters, env.distribution))
    env.reset(seed=seed)
    return out


def evaluate(ctx: EvalContext, setting: Setting, with_optimum: bool) -> Rows:
    env = GpuClusterEnv(setting.datacenters, n_tasks=setting.n_tasks, trace=setting.trace)
    rows = Rows()
    if setting.n_tasks > len(env.pool):  # (sample_tasks) the same pod can then be asked for twice in one episode
        setting.note += (f" (the trace holds only {len(env.pool)}: drawn with replacement; --tasks sets how "
                         "many)")
    total = len(ctx.seeds) * (len(HEURISTICS) + len(LEARNED_POLICIES) + int(with_optimum))
    done = 0
    for seed in ctx.seeds:
        for name, label in HEURISTICS:
            rows.add(label, run_policy(env, policy_for(name, env, seed), seed=seed).metrics)
            done += 1
            ctx.progress(setting.name, done, total)
        for label, factory in LEARNED_POLICIES.items():
            done += 1
            try:
                policy = factory(env.view, seed)
            except ModelMismatch as exc:  # e.g. an SB3 MLP sized for another host count
                if seed == ctx.seeds[0]:
                    rows.notes.append(f"{label} row skipped: {exc}")
                ctx.progress(setting.name, done, total)
                continue
            rows.add(label, run_policy(env, policy, seed=seed).metrics)
            ctx.progress(setting.name, done, total)
        if with_optimum:
            t0 = time.perf_counter()
            rows.add(OPTIMUM_LABEL, optimum_row(env, seed))
            rows.notes.append(f"seed {seed}: optimum solved in {time.perf_counter() - t0:.0f} s")
            done += 1
            ctx.progress(setting.name, done, total)
    return rows


def _tables(setting: Setting, rows: Rows) -> str:
    labels = list(rows.by_label)

    def ms(label: str, key: str, digits: int) -> str:
        return mean_std(rows.values(label, key), digits)

    util_headers = ["algorithm"]
    for r in RESOURCES:
        util_headers += [f"{RESOURCE_LABELS[r]} mean ↑", f"{RESOURCE_LABELS[r]} σ ↓"]
    t6 = [[label] + [ms(label, f"{r}_{s}", 4) for r in RESOURCES for s in ("mean", "std")]
          for label in labels]

    def deployed_cell(label: str) -> str:
        cell = ms(label, "deployed", 1)
        if label == OPTIMUM_LABEL:
            proven = sum(int(v) for v in rows.values(label, "optimal"))
            cell += f" (bound {ms(label, 'bound', 1)}; proven {proven}/{len(rows.by_label[label])})"
        return cell

    def gap_cell(label: str) -> str:
        """Gap to the optimum, at most (bound - deployed) / bound per seed: the MILP's proven upper bound
        caps the optimum even when the solve stops at its time limit."""
        bounds = rows.values(OPTIMUM_LABEL, "bound") if OPTIMUM_LABEL in rows.by_label else []
        if not bounds:
            return "-"
        gaps = [100.0 * (b - d) / b for d, b in zip(rows.values(label, "deployed"), bounds, strict=True) if b]
        return "≤ " + mean_std(gaps, 1) + " %"

    t7 = [[label, deployed_cell(label), gap_cell(label), ms(label, "eq26", 1), ms(label, "judged", 1),
           ms(label, "failed", 1)] for label in labels]
    t8 = [[label, ms(label, "fragmentation", 4), ms(label, "fgd_fragmentation", 2),
           ms(label, "fgd_fragmentation_rate", 3)] for label in labels]
    t9 = [[label, ms(label, "gpu_load_variance", 5), ms(label, "eq9", 4)] for label in labels]

    def paper(values: dict[str, float]) -> str:
        return ", ".join(f"{k} {v}" for k, v in values.items())

    parts = [
        f"### {setting.name}: {setting.note}",
        "**Table 6 layout — utilisation across clusters (mean and σ over the clusters, then mean ± std over "
        "seeds)**",
        markdown_table(util_headers, t6),
        f"**Table 7 layout — tasks deployed of {setting.n_tasks}** (deployed = n_success; eq.26 N = "
        "n_success + n_suc_jud; judged = left undeployed because no host had room; failed = wrong actions, "
        "0 under the mask)",
        markdown_table(["algorithm", "deployed ↑", "gap to optimum", "eq.26 N", "judged", "failed"], t7),
        "Paper 000 table 7 (220 tasks, its 64-host fleet, cluster-level baselines): "
        f"{paper(PAPER_DEPLOYED)}.",
        "**Table 8 layout — fragmentation** (eq.27: mean over clusters of the summed free shares of the four "
        "resources, lower = fuller; FGD: expected idle GPUs a typical openb task could not use, and their "
        "share of the idle GPUs)",
        markdown_table(["algorithm", "eq.27 ↓", "FGD frag (GPUs) ↓", "FGD frag rate ↓"], t8),
        f"Paper 000 table 8: {paper(PAPER_FRAGMENTATION)}.",
        "**Table 9 layout — cross-cluster GPU load variance** (eq.28 over the clusters' mean GPU memory and "
        "GPU core utilisation; eq.9 = the objective, mean eq.8 utilisation)",
        markdown_table(["algorithm", "eq.28 ↓", "eq.9 ↑"], t9),
        f"Paper 000 table 9: {paper(PAPER_LOAD_VARIANCE)}.",
    ]
    solves = [n for n in rows.notes if " row skipped: " not in n]
    if solves:
        parts.append("Optimum: " + "; ".join(solves) + f" (time limit {OPTIMUM_TIME_LIMIT_S:.0f} s per seed).")
    parts += [n + "." for n in rows.notes if " row skipped: " in n]
    return "\n\n".join(parts)


def _plots(ctx: EvalContext, setting: Setting, rows: Rows, tag: str) -> list[str]:
    """Per-seed values with error bars; the optimum is a line (its bound and best placement) on the deployed
    plot, not a bar; GPU memory and GPU core share a group when they are equal for every policy and seed (an
    openb slice asks for the same share of a card's memory as of its cores)."""
    labels = [label for label in rows.by_label if label != OPTIMUM_LABEL]
    resources = list(RESOURCES)
    names = dict(RESOURCE_LABELS)
    if "gpu_memory" in resources and "gpu_core" in resources and np.allclose(
            [rows.values(label, "gpu_memory_mean") for label in labels],
            [rows.values(label, "gpu_core_mean") for label in labels], rtol=1e-5, atol=1e-9):  # float32 state
        resources.remove("gpu_core")
        names["gpu_memory"] = "GPU memory = GPU core"
    files = [plot_bars(ctx.png(f"gpu_{tag}_utilisation.png"), f"Utilisation across clusters ({setting.name})",
                       "mean utilisation", [names[r] for r in resources],
                       {label: [rows.values(label, f"{r}_mean") for r in resources] for label in labels},
                       separate_axes=True)]
    for key, title, ylabel in (("deployed", f"Tasks deployed of {setting.n_tasks}", "tasks"),
                               ("fragmentation", "Fragmentation, eq.27", "F"),
                               ("fgd_fragmentation", "FGD expected fragmentation", "GPUs"),
                               ("gpu_load_variance", "Cross-cluster GPU load variance, eq.28", "σ²")):
        refs = {}
        if key == "deployed" and OPTIMUM_LABEL in rows.by_label:
            refs = {"MILP upper bound (mean over seeds)": float(np.mean(rows.values(OPTIMUM_LABEL, "bound"))),
                    "MILP best placement (mean)": float(np.mean(rows.values(OPTIMUM_LABEL, "deployed")))}
        files.append(plot_per_label(ctx.png(f"gpu_{tag}_{key}.png"), f"{title} ({setting.name})", ylabel,
                                    {label: rows.values(label, key) for label in labels}, refs=refs))
    return [str(f) for f in files]


def run(ctx: EvalContext) -> str:
    out = ["## Paper 000 tables 6-9: multi-cluster GPU placement",
           f"Seeds {ctx.seeds}" + (" (quick run: paper scale only, no optimum)" if ctx.quick else "") + "."]
    files: list[str] = []
    custom = bool(ctx.fleet_path or ctx.trace)
    if custom and (note := ctx.trace_for("openb", "openb")[1]):
        out.append(note + ".")
    chosen = settings(ctx)
    if not chosen:
        out.append(f"Skipped: {ctx.fleet_label(ctx.fleet())} has no GPU data center.")
    for i, setting in enumerate(chosen):
        rows = evaluate(ctx, setting, with_optimum=not ctx.quick and not custom and i == 0)
        out.append(_tables(setting, rows))
        files += _plots(ctx, setting, rows, "paper" if i == 0 else "fleet")
    if LEARNED_NOTES:
        out.append("Learned rows: " + "; ".join(LEARNED_NOTES) + ".")
    out.append("PNG files:\n" + "\n".join(f"- {f}" for f in files))
    return "\n\n".join(out) + "\n"
