"""`hsched eval node-vs-cluster`: paper 002 table 2 — node-level vGPU placement (hsched's placer) against
cluster-level placement as Volcano Global (Karmada + Volcano) does it, "divided" and "duplicated".

Paper 002 §4.4 deploys randomly generated GPU jobs on 3 heterogeneous Kubernetes clusters, FIFO, until
resources run out, and reports one number per algorithm: the jobs deployed successfully (table 2: DDPG 59,
Utilization 58, BestFit 54, Greedy 54, Random 53, Volcano-divided 53, Volcano-duplicated 39). Here:

Fleet: the default fleet's three GPU DCs (kansas-city: openb machines; houston, indianapolis: PAI 2020
machines; 340 hosts, 1 316 GPUs of 7 models). A quick run scales every node pool to 1/10 (35 hosts).
Jobs: per seed, GPU pods of the openb trace drawn uniformly without replacement (FIFO in trace order), each
made a job of 1-4 replicas (uniform; openb records single pods, paper 002 has multi-replica jobs). A job is
deployed only if ALL its replicas are placed (gang: Volcano's minAvailable = replicas); otherwise whatever
was placed for it is rolled back. No job ends during the run (paper 002 counts deployments). Enough jobs
to ask for ≈ 1.2× the fleet's GPUs.

Node level (paper 002's platform = hsched's placer): `hsched.policies.placement.plan` on the fleet-wide
state (every host of every cluster, per card): replicas one by one with the state updated in between, the
feasibility mask per node and card, a node policy choosing (rows: BestFit, paper 002's Greedy = first fit,
Random, Utilization, FGD; a DDPG row plugs in through `LEARNED_POLICIES`).

Cluster level (Volcano Global v1.11: Karmada's scheduler decides job → cluster(s) from each member
cluster's aggregate resource summary — allocatable minus allocated, summed over its nodes — without seeing
nodes or cards; then the member cluster's own scheduler binds the pods to nodes). Emulated as:

- estimate, per cluster, the replicas it can take from the aggregates alone (Karmada's general estimator:
  min over CPU, memory, GPU core and GPU memory of ⌊free_total / per-replica request⌋; 0 if the cluster has
  no GPU of an allowed model);
- "divided" (Karmada ReplicaScheduling Divided, dynamic weight by available replicas): the job's replicas
  are split across clusters in proportion to those estimates (largest remainder), and each cluster places
  its share on its nodes; if the estimates sum to fewer than the replicas, or any cluster cannot bind its
  share (the aggregate hid fragmentation across nodes and cards), the job fails;
- "duplicated" (Karmada Duplicated): the whole job is propagated to EVERY cluster whose estimate covers all
  replicas, and each of them runs a full copy; the job counts as deployed if at least one copy binds
  completely (copies that cannot bind completely are removed). Every bound copy keeps its resources — paper
  002: duplication "occupies more computing resources", which is why it deploys the fewest jobs.

Inside a member cluster, pods are bound by `plan` with `MEMBER_POLICY` (BestFit ≈ Volcano's binpack), on the
real node and card state: the member scheduler is not the handicap, the cluster-level decision is.

Optimum row (full runs): `hsched.optimum.max_deployed` with every job's replicas as one all-or-nothing group
(node-level placement: a job's replicas may land on different nodes and clusters), offline — all jobs known at
once, no FIFO order — on the same jobs and empty fleet, HiGHS with `OPTIMUM_TIME_LIMIT_S` per seed (model
building and the heuristic floor included). At the time limit it reports the best placement found (never
fewer jobs than the best of `hsched.optimum.heuristic_runs` placing the jobs whole, in the given and the
smallest-first orders) and the proven upper bound (HiGHS' dual bound, or the resource-sum bound when that
is lower: the most jobs whose summed demands, smallest first, fit in the fleet's free totals); every row's
"gap to optimum" is at most (bound − deployed) / bound, per seed.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hsched.domain.cluster import ClusterState
from hsched.domain.fleet import DataCenter
from hsched.domain.resources import Resources
from hsched.domain.task import TaskSpec
from hsched.envs.gpu import MultiClusterState, fleet_gpu_datacenters, scaled_datacenters
from hsched.eval.report import EvalContext, markdown_table, mean_std, plot_per_label
from hsched.metrics import TaskDistribution, fgd_fragmentation_rate, paper_summary, utilisation_matrix
from hsched.policies.base import NodePolicy
from hsched.policies.fgd import FragmentationGradientDescent, openb_tasks
from hsched.policies.heuristics import make_policy
from hsched.policies.placement import Outcome, plan

MAX_REPLICAS = 4
LOAD_FACTOR = 1.2  # jobs ask for ≈ this × the fleet's GPUs
MEMBER_POLICY = "bestfit"  # how a member cluster binds pods to nodes (Volcano binpack)
QUICK_SCALE = 0.1
OPTIMUM_LABEL = "optimum (offline MILP)"  # as in `hsched eval gpu`
OPTIMUM_TIME_LIMIT_S = 30.0  # per seed, full runs (quick runs skip the optimum unless asked)
NODE_LEVEL: tuple[tuple[str, str], ...] = (
    ("bestfit", "BestFit"),
    ("firstfit", "Greedy (first fit)"),
    ("random", "Random"),
    ("utilization", "Utilization"),
    ("fgd", "FGD"),
)
CLUSTER_LEVEL: tuple[tuple[str, str], ...] = (("divided", "Volcano-divided"),
                                              ("duplicated", "Volcano-duplicated"))
PAPER_TABLE_2 = {"DDPG": 59, "Utilization": 58, "BestFit": 54, "Greedy": 54, "Random": 53,
                 "Volcano-divided": 53, "Volcano-duplicated": 39}

# ---- LEARNED ROWS HOOK -------------------------------------------------------------------------------------
# Paper 002's DDPG row: label -> factory(view, seed) returning a NodePolicy over the flattened hosts of the
# fleet-wide ClusterState `view.fleet` (the view tells which cluster each host is in); it then places node
# level exactly like the heuristic rows (same plan(), mask, select()). The shipped DDPG and EADE-DDPG models
# (trained on paper 000's setting) register when present; LEARNED_NOTES says which were skipped.
LEARNED_POLICIES: dict[str, Callable[[MultiClusterState, int], NodePolicy]] = {}
LEARNED_NOTES: list[str] = []


def register_shipped_models() -> None:
    from hsched.rl.checkpoint import model_path
    from hsched.rl.shipped import SHIPPED_MODELS

    def factory(path: Path) -> Callable[[MultiClusterState, int], NodePolicy]:
        def make(view: MultiClusterState, seed: int) -> NodePolicy:
            from hsched.rl.ddpg import ActorPolicy, load_actor

            actor, state = load_actor(path)
            return ActorPolicy(actor, state["policy"], view)

        return make

    for label, name in SHIPPED_MODELS:
        path = model_path(name)
        if path.exists():
            LEARNED_POLICIES[label] = factory(path)
        else:
            LEARNED_NOTES.append(f"{label} row skipped: no model at {path}")


register_shipped_models()


@dataclass
class RunResult:
    jobs: int
    deployed: int = 0
    replicas_placed: int = 0
    redundant_gpus: float = 0.0  # GPUs held by duplicate copies beyond the first (duplicated only)
    bound: float | None = None  # the optimum row: proven upper bound on the jobs deployed
    optimal: bool = False  # the optimum row: proven optimal
    metrics: dict[str, float] = field(default_factory=dict)


def sample_jobs(n: int, seed: int, pool: Sequence[TaskSpec] | None = None,
                max_replicas: int = MAX_REPLICAS) -> list[TaskSpec]:
    """`n` GPU jobs: GPU pods of `pool` (default: the openb trace) drawn uniformly without replacement in
    trace order, each with 1..max_replicas replicas (uniform), by numpy seed `seed`."""
    gpu_pool = [t for t in (pool if pool is not None else openb_tasks()) if t.resources.gpu_count]
    rng = np.random.default_rng(seed)
    idx = np.sort(rng.choice(len(gpu_pool), size=n, replace=n > len(gpu_pool)))
    replicas = rng.integers(1, max_replicas + 1, size=n)
    return [dataclasses.replace(gpu_pool[i], replicas=int(r)) for i, r in zip(idx, replicas, strict=True)]


def jobs_for(datacenters: Sequence[DataCenter], seed: int, load: float = LOAD_FACTOR,
             pool: Sequence[TaskSpec] | None = None, n: int | None = None) -> list[TaskSpec]:
    """Enough jobs to ask for ≈ `load` × the fleet's GPUs (by the mean GPUs per job of the GPU pods of `pool`,
    default the openb trace), or `n` jobs."""
    gpus = sum(p.count * p.gpu_count for dc in datacenters for p in dc.pools)
    gpu_pool = [t for t in (pool if pool is not None else openb_tasks()) if t.resources.gpu_count]
    if not gpu_pool:
        raise ValueError("trace: has no GPU pods")
    per_job = float(np.mean([t.resources.gpu_units for t in gpu_pool])) * (1 + MAX_REPLICAS) / 2
    return sample_jobs(n or max(1, round(load * gpus / per_job)), seed, gpu_pool)


# ------------------------------------------------------------------------------------------------------------
# node level


def run_node_level(view: MultiClusterState, jobs: Sequence[TaskSpec], policy: NodePolicy,
                   reset: bool = True) -> RunResult:
    """hsched's placer over every host of every cluster: `plan` (replicas one by one, state updated between
    them) on the fleet-wide state; a job is applied only when all its replicas have a node and cards.
    Starts from an empty fleet unless `reset=False`."""
    if reset:
        view.reset()
    out = RunResult(len(jobs))
    for j, job in enumerate(jobs):
        p = plan(view.fleet, job, policy)
        if p.outcome is Outcome.PLACED:
            view.apply_parts(f"job{j}", p.parts)
            out.deployed += 1
            out.replicas_placed += job.replicas
    return out


# ------------------------------------------------------------------------------------------------------------
# cluster level (Volcano Global emulation)


def aggregate_replicas(state: ClusterState, demand: Resources, gpu_models: tuple[str, ...] = ()) -> int:
    """Replicas of `demand` a cluster can take judged from its aggregate free resources only (Karmada's
    general estimator over the member's resource summary): min over the requested resources of
    ⌊free summed over all nodes (and cards) / per-replica request⌋."""
    if gpu_models and not set(gpu_models) & set(state.table.gpu_model):
        return 0
    pairs = [(int(state.free_cpu.sum()), demand.cpu_milli), (int(state.free_memory.sum()), demand.memory_mib),
             (int(state.free_disk.sum()), demand.disk_mib),
             (int(state.free_bandwidth.sum()), demand.bandwidth_mbps)]
    if demand.gpu_count:
        pairs += [(int(state.gpu_free_core.sum()), demand.gpu_count * demand.gpu_core_percent),
                  (int(state.gpu_free_memory.sum()), demand.gpu_count * demand.gpu_memory_mib)]
    limits = [free // need for free, need in pairs if need > 0]
    return int(min(limits)) if limits else 1 << 30


def divide_replicas(replicas: int, available: Sequence[int]) -> list[int]:
    """Karmada "Divided" with dynamic weights = available replicas: shares ∝ `available`, the remainder to
    the largest fractional parts (then the larger weight, then the lower index); no share above its weight."""
    total = sum(available)
    if total <= 0:
        return [0] * len(available)
    shares = [replicas * a // total for a in available]
    order = sorted(range(len(available)),
                   key=lambda c: (-(replicas * available[c] % total), -available[c], c))
    for c in order:
        if sum(shares) >= replicas:
            break
        if shares[c] < available[c]:
            shares[c] += 1
    return shares


def _bind(state: ClusterState, job: TaskSpec, replicas: int, task_id: str) -> bool:
    """The member cluster binds `replicas` replicas of `job` to its nodes (plan with MEMBER_POLICY)."""
    p = plan(state, dataclasses.replace(job, replicas=replicas), make_policy(MEMBER_POLICY))
    if p.outcome is not Outcome.PLACED:
        return False
    state.apply(task_id, p.parts)
    return True


def run_cluster_level(view: MultiClusterState, jobs: Sequence[TaskSpec], mode: str,
                      reset: bool = True) -> RunResult:
    """Volcano Global emulation, mode "divided" or "duplicated" (see the module docstring). Starts from an
    empty fleet unless `reset=False`."""
    if mode not in ("divided", "duplicated"):
        raise ValueError(f"mode must be 'divided' or 'duplicated', got {mode!r}")
    if reset:
        view.reset()
    out = RunResult(len(jobs))
    for j, job in enumerate(jobs):
        task_id = f"job{j}"
        available = [aggregate_replicas(s, job.resources, job.gpu_models) for s in view.clusters]
        if mode == "divided":
            if sum(available) < job.replicas:
                continue
            bound: list[ClusterState] = []
            ok = True
            for s, share in zip(view.clusters, divide_replicas(job.replicas, available), strict=True):
                if share and not _bind(s, job, share, task_id):
                    ok = False
                    break
                if share:
                    bound.append(s)
            if not ok:
                for s in bound:
                    s.release(task_id)
                continue
            out.deployed += 1
            out.replicas_placed += job.replicas
        else:
            copies = sum(_bind(s, job, job.replicas, task_id)
                         for s, a in zip(view.clusters, available, strict=True) if a >= job.replicas)
            if copies:
                out.deployed += 1
                out.replicas_placed += job.replicas
                out.redundant_gpus += (copies - 1) * job.total.gpu_units
    return out


# ------------------------------------------------------------------------------------------------------------
# the optimum


def run_optimum(view: MultiClusterState, jobs: Sequence[TaskSpec], time_limit_s: float = OPTIMUM_TIME_LIMIT_S,
                reset: bool = True) -> RunResult:
    """The most jobs any node-level placement could deploy at once (`max_deployed` with each job's replicas
    as one all-or-nothing group, over every cluster's nodes and cards), applied to `view`; `bound` is the
    proven upper bound (= deployed when `optimal`). Starts from an empty fleet unless `reset=False`."""
    from hsched.optimum import max_deployed

    if reset:
        view.reset()
    tasks: list[TaskSpec] = []
    groups: list[list[int]] = []
    for job in jobs:
        groups.append(list(range(len(tasks), len(tasks) + job.replicas)))
        tasks += [dataclasses.replace(job, replicas=1)] * job.replicas
    result = max_deployed(view.clusters, tasks, time_limit_s=time_limit_s, groups=groups)
    result.apply(view.clusters)
    deployed = round(result.objective or 0)
    return RunResult(len(jobs), deployed, result.deployed,
                     bound=float(deployed if result.bound is None else result.bound), optimal=result.optimal)


# ------------------------------------------------------------------------------------------------------------
# the report


def _finish(view: MultiClusterState, result: RunResult, dist: TaskDistribution) -> RunResult:
    summary = paper_summary(utilisation_matrix(view.clusters), view.clusters, None)
    result.metrics = {"deployed": float(result.deployed),
                      "success_rate": result.deployed / max(result.jobs, 1),
                      "replicas": float(result.replicas_placed), "gpu_core": summary["gpu_core_mean"],
                      "gpu_memory": summary["gpu_memory_mean"], "fragmentation": summary["fragmentation"],
                      "fgd_rate": fgd_fragmentation_rate([view.fleet], dist),
                      "redundant_gpus": result.redundant_gpus}
    if result.bound is not None:
        result.metrics |= {"bound": result.bound, "optimal": float(result.optimal)}
    return result


def run(ctx: EvalContext, optimum_time_limit_s: float | None = None) -> str:
    """The report. The optimum row runs in full runs (`OPTIMUM_TIME_LIMIT_S` per seed), or in any run when
    `optimum_time_limit_s` is given (its time limit per seed)."""
    if optimum_time_limit_s is None and not ctx.quick:
        optimum_time_limit_s = OPTIMUM_TIME_LIMIT_S
    dcs = fleet_gpu_datacenters(ctx.fleet_path)
    fleet_text = ctx.fleet_label(ctx.fleet()) if ctx.fleet_path else "the default fleet"
    if not dcs:
        return f"## Paper 002 table 2\n\nSkipped: {fleet_text} has no GPU data center.\n"
    if ctx.quick and not ctx.fleet_path:
        dcs = scaled_datacenters(dcs, QUICK_SCALE)
    ref, trace_note = ctx.trace_for("openb", "openb")
    pool = openb_tasks(ref.path)
    view = MultiClusterState(dcs)
    hosts, gpus = view.hosts, sum(p.count * p.gpu_count for dc in dcs for p in dc.pools)
    # FGD's workload here is the jobs' one: the GPU pods of the trace
    dist = TaskDistribution.from_tasks(t for t in pool if t.resources.gpu_count)
    labels = ([label for _, label in NODE_LEVEL] + list(LEARNED_POLICIES)
              + [label for _, label in CLUSTER_LEVEL] + ([OPTIMUM_LABEL] if optimum_time_limit_s is not None else []))
    per_label: dict[str, list[dict[str, float]]] = {label: [] for label in labels}
    n_jobs: list[int] = []
    notes: list[str] = []
    total, done = len(ctx.seeds) * len(labels), 0

    def record(label: str, result: RunResult) -> None:
        nonlocal done
        per_label[label].append(_finish(view, result, dist).metrics)
        done += 1
        ctx.progress("node-vs-cluster", done, total)

    for seed in ctx.seeds:
        jobs = jobs_for(dcs, seed, pool=pool, n=ctx.tasks)
        n_jobs.append(len(jobs))
        for name, label in NODE_LEVEL:
            policy = FragmentationGradientDescent(dist) if name == "fgd" else make_policy(name, seed)
            record(label, run_node_level(view, jobs, policy))
        for label, factory in LEARNED_POLICIES.items():
            record(label, run_node_level(view, jobs, factory(view, seed)))
        for mode, label in CLUSTER_LEVEL:
            record(label, run_cluster_level(view, jobs, mode))
        if optimum_time_limit_s is not None:
            t0 = time.perf_counter()
            record(OPTIMUM_LABEL, run_optimum(view, jobs, optimum_time_limit_s))
            notes.append(f"seed {seed}: {time.perf_counter() - t0:.0f} s")

    columns = (("deployed", 1), ("success_rate", 3), ("replicas", 1), ("gpu_core", 4), ("gpu_memory", 4),
               ("fragmentation", 4), ("fgd_rate", 3), ("redundant_gpus", 1))
    level = ({label: "node" for label in labels} | {OPTIMUM_LABEL: "node (offline)"}
             | {label: "cluster" for _, label in CLUSTER_LEVEL})

    def deployed_cell(label: str) -> str:
        cell = mean_std([m["deployed"] for m in per_label[label]], 1)
        if label == OPTIMUM_LABEL:
            proven = sum(int(m["optimal"]) for m in per_label[label])
            cell += (f" (bound {mean_std([m['bound'] for m in per_label[label]], 1)}; "
                     f"proven {proven}/{len(per_label[label])})")
        return cell

    def gap_cell(label: str) -> str:
        """Gap to the optimum, at most (bound − deployed) / bound per seed (as `hsched eval gpu`): the MILP's
        proven upper bound caps the optimum even when the solve stops at its time limit."""
        if OPTIMUM_LABEL not in per_label:
            return "-"
        gaps = [100.0 * (o["bound"] - m["deployed"]) / o["bound"]
                for m, o in zip(per_label[label], per_label[OPTIMUM_LABEL], strict=True) if o["bound"]]
        return "≤ " + mean_std(gaps, 1) + " %" if gaps else "-"

    rows = [[label, level[label], deployed_cell(label), gap_cell(label),
             *(mean_std([m[k] for m in per_label[label]], d) for k, d in columns[1:])]
            for label in labels]
    table = markdown_table(
        ["algorithm", "level", "jobs deployed ↑", "gap to optimum", "success rate ↑", "replicas placed",
         "GPU core util ↑", "GPU memory util ↑", "eq.27 frag ↓", "FGD frag rate ↓", "duplicate GPUs held"], rows,
        align_right_from=2)
    files = []
    for key, title, ylabel in (("deployed", "Jobs deployed", "jobs"),
                               ("gpu_core", "GPU core utilisation", "share"),
                               ("fragmentation", "Fragmentation, eq.27", "F")):
        # the optimum is a line (its proven bound and best placement) on the deployed plot, not a bar
        refs = {}
        if key == "deployed" and OPTIMUM_LABEL in per_label:
            opt = per_label[OPTIMUM_LABEL]
            refs = {"MILP upper bound (mean over seeds)": float(np.mean([m["bound"] for m in opt])),
                    "MILP best placement (mean)": float(np.mean([m["deployed"] for m in opt]))}
        files.append(str(plot_per_label(ctx.png(f"node_vs_cluster_{key}.png"),
                                        f"{title} (paper 002 table 2 setting)", ylabel,
                                        {label: [m[key] for m in per_label[label]] for label in labels
                                         if label != OPTIMUM_LABEL}, refs=refs)))
    paper = ", ".join(f"{k} {v}" for k, v in PAPER_TABLE_2.items())
    scale = f" (quick run: node pools × {QUICK_SCALE})" if ctx.quick and not ctx.fleet_path else ""
    return "\n\n".join([
        "## Paper 002 table 2: node-level vGPU placement vs cluster-level (Volcano Global) placement",
        f"Data: {fleet_text}: {len(dcs)} GPU DCs ({', '.join(dc.name for dc in dcs)}), {hosts} hosts, {gpus} GPUs"
        f"{scale}; {mean_std(n_jobs, 0)} jobs of 1-{MAX_REPLICAS} GPU replicas of {ref.label} per seed"
        + ("" if ctx.tasks else f" (≈ {LOAD_FACTOR}× the GPUs)")
        + f", gang-deployed in FIFO order; seeds {ctx.seeds}. Member clusters bind with {MEMBER_POLICY}."
        + (f" {trace_note}." if trace_note else ""),
        table,
        f"Paper 002 table 2 (jobs deployed, 3 clusters of 2080 Ti / 1660 Super): {paper}."
        + (" Learned rows: " + "; ".join(LEARNED_NOTES) + "." if LEARNED_NOTES else "")
        + (" DDPG / EADE-DDPG: the paper-000 models (2-GPU openb hosts, single-replica tasks) served as is."
           if LEARNED_POLICIES else ""),
        (f"Optimum row: `hsched.optimum.max_deployed` with each job's replicas as one all-or-nothing group "
         "(node-level placement, replicas may use different nodes and clusters), offline (all jobs at once, no "
         f"FIFO order), time limit {optimum_time_limit_s:g} s per seed including model building; at the time "
         "limit it shows the best placement found (never below the best library heuristic placing jobs whole "
         "in the given or the smallest-first order) and a proven upper bound (HiGHS' bound or, when lower, the "
         "resource-sum bound). Gap to optimum: at most (bound − deployed) / bound, per seed. Solve times: "
         + "; ".join(notes) + ".") if optimum_time_limit_s is not None else
        "No optimum row in quick runs (full runs solve `hsched.optimum.max_deployed` with each job's replicas "
        f"as one all-or-nothing group, {OPTIMUM_TIME_LIMIT_S:g} s per seed).",
        "PNG files:\n" + "\n".join(f"- {f}" for f in files),
    ]) + "\n"
