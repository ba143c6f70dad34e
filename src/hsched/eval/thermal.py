"""`hsched eval thermal`: paper 003 table 5 and fig.9 — placement inside one DC, with the room's thermal model.

Setup (the same for every policy and seed)
-------------------------------------------
* Room: "chicago" of the default fleet, paper 003 §3.2.2's 16 racks × 42 1U servers × 24 cores, 100 W idle /
  300 W full, recirculation matrix D from the room geometry (hsched.thermal). Environment:
  `hsched.envs.dc.DcPlacementEnv`; every policy acts through `run_policy`, i.e. the placer's own
  `plan()`/`select()` code.
* Jobs: LLNL Thunder. Jobs 0-1999 warm the room up: they are placed by round robin, so every policy starts from
  the same warmed-up room (paper: "the same initial state"). Then 500 evaluation jobs are played, shifted in
  time to follow the warm-up. Seed s plays the jobs 5000 + 500·s … 5499 + 500·s, so seed 0 is exactly the
  paper's split (2 000 warm-up, 3 000 training, 500 evaluation). The seed also seeds the Random policy.
  `ctx.quick`: 200 warm-up jobs and 50 evaluation jobs (seed s: jobs 500 + 50·s …).
* Two CRAC modes. "fixed": the room's supply air (chicago: 20 °C, as in the paper). In this mode PUE cannot
  depend on the placement: cooling power is P_IT / CoP(T_supply). "redline": the CRAC runs the warmest supply
  that keeps the hottest inlet at the room's redline (27 °C), so hot spots cost cooling power. This is the only
  way PUE moves in our model. The report names both from the room's parameters as run.
* Metrics. Mean reward is per decision (eq.12, `RewardConfig` defaults). PUE, overloads (servers with
  u > 0.8) and mean rack outlet temperature are time-weighted over the evaluation window, from the first to
  the last decision. Each cell is the mean ± std over seeds. The Δ columns are per-seed differences against
  RR / Greedy on the same jobs: % for PUE and overloads, °C for the outlet (as the paper reports them).

Gap to the optimum on small instances
-------------------------------------
The 500-job online episodes have no tractable exact optimum, so the report adds small offline instances of the
same DC-placement problem, one per seed, solved exactly by `hsched.optimum.min_peak_inlet` (HiGHS):
* Room: `OPT_ROOM` racks × servers of the evaluated room's server type (chicago: 24 cores, 100 W / 300 W) and
  thermal parameters, its own recirculation matrix from the shrunk geometry (`room_for`).
* Pre-load: the Thunder jobs just before the seed's first evaluation job, walking back, each taken if it keeps
  the busy cores within `OPT_PRELOAD` of the room; placed in trace order by round robin (as the warm-up).
* Batch: the seed's evaluation jobs in trace order (split by `split_task`), each taken if the batch stays
  within `OPT_BATCH_PARTS` parts and `OPT_BATCH_FILL` of the free cores; if the parts cannot all be placed at
  once the last job is dropped until they can. Every policy row of `POLICY_FACTORIES` that is a `NodePolicy`
  places the batch job by job through `plan()` (the placer's code) with the state updated in between.
* Reported: peak inlet (°C), its rise over the supply air (K), the gap of that rise to the optimum's rise
  (`gap_percent`, sense "min"), and the servers above 80 % CPU after placing. The optimum minimises the peak
  rise, then the overloaded servers at that peak. A policy that leaves a job of the batch unplaced has no
  cell for that seed (the count of complete placements is shown).

Double DQN (paper 003 §3.2.3) is the model `double_dqn_dc` of the models dir (hsched.rl.ddqn; shipped: trained
on Thunder's "train" jobs 2000-4499, its reward constants chosen on jobs 4500-4999), served through
`plan()`/`select()` like the heuristics; the report says what its metadata says it was trained on, and calls
these evaluation jobs held out only when that is this run's trace and none of them. Without the file the row is
left out and the report says so. The optimum row of the 500-job episodes would plug into `POLICY_FACTORIES`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hsched.domain.cluster import ClusterState
from hsched.domain.fleet import DataCenter, RoomLayout, load_fleet
from hsched.domain.resources import MILLI
from hsched.domain.task import TaskSpec
from hsched.envs.dc import (
    DEFAULT_DC,
    DELTAS,
    METRICS,
    MODES,
    PAPER_SPLIT,
    THUNDER,
    RewardConfig,
    delta_values,
    eval_env,
    run_policy,
    same_trace,
    thunder_jobs,
)
from hsched.eval.report import EvalContext, markdown_table, mean_std, plot_lines
from hsched.optimum import OVERLOAD_DEN, OVERLOAD_NUM, OptimumResult, gap_percent, min_peak_inlet
from hsched.policies.heuristics import make_policy
from hsched.policies.placement import Outcome, plan, split_task
from hsched.rl.checkpoint import load_metadata, model_path
from hsched.thermal import RoomModel, ThermalParams
from hsched.thermal.datacenter import room_for, room_state
from hsched.traces.catalog import TraceRef

# Each row of the table is a factory: seed -> NodePolicy (it acts through plan/select, like the placer) or a
# callable (obs, action_mask) -> action. Hook for a row still to come:
#   POLICY_FACTORIES["Optimum"] = lambda seed: <callable that replays the exact optimum's actions>.
# run() picks it up with no other change.
POLICY_FACTORIES: dict[str, Callable[[int], Any]] = {
    "RR": lambda seed: make_policy("rr"),
    "Greedy": lambda seed: make_policy("greedy"),
    "BestFit": lambda seed: make_policy("bestfit"),
    "FirstFit": lambda seed: make_policy("firstfit"),
    "Random": lambda seed: make_policy("random", seed),
    "Utilization": lambda seed: make_policy("utilization"),
}

DOUBLE_DQN_MODEL = "double_dqn_dc"


def _double_dqn(seed: int, dc: DataCenter | None = None) -> Any:
    """The shipped Double DQN as the placer serves it (hsched.rl.ddqn.load_policy, the same NodePolicy)."""
    from hsched.rl.ddqn import load_policy

    return load_policy(model_path(DOUBLE_DQN_MODEL), dc or load_fleet().datacenter(DEFAULT_DC))


if model_path(DOUBLE_DQN_MODEL).exists():
    POLICY_FACTORIES["Double DQN"] = _double_dqn

QUICK_SPLIT = (200, 300, 50)  # warm-up, train, eval jobs for ctx.quick
PAPER_DELTAS = {
    "pue": (-2.5, -1.7),
    "overloads": (-42.1, -13.2),
    "outlet": (-0.4, -0.2),
}  # DDQN vs RR, Greedy
GRID_POINTS = 300

# the small exact instances (see the module docstring); index [ctx.quick]
OPT_ROOM = ((2, 12), (2, 5))  # racks × servers per rack
OPT_BATCH_PARTS = (32, 10)  # at most this many parts (split_task) in a batch
OPT_TIME_LIMIT_S = (60.0, 10.0)  # min_peak_inlet's time limit per instance
OPT_PRELOAD = 0.5  # share of the room's cores the pre-load may keep busy
OPT_BATCH_FILL = 0.6  # share of the free cores the batch may ask for


def _data(ctx: EvalContext, split: tuple[int, int, int]) -> tuple[DataCenter, TraceRef, tuple[int, int, int], str]:
    """The room, trace and split this run uses: `--fleet`'s first CPU-only DC (default: chicago), `--trace` when it
    is an SWF log (default: Thunder); a trace too short for the split gets a proportionally smaller one."""
    from hsched.traces.catalog import trace_jobs

    fleet = ctx.fleet()
    if ctx.fleet_path:
        dc = next((d for d in fleet.datacenters if not any(p.gpu_count for p in d.pools)), None)
        if dc is None:
            raise _NoRoom(f"{ctx.fleet_label(fleet)} has no CPU-only data center")
    else:
        dc = fleet.datacenter(DEFAULT_DC)
    ref, note = ctx.trace_for("swf", "thunder")
    warm, train, evaluation = split
    need = warm + train + evaluation * len(ctx.seeds)
    if ref.name != "thunder":
        have = len(trace_jobs(ref, limit=need))
        if have < need:  # keep the proportions; every seed still gets its own evaluation window
            scale = have / need
            warm, train = int(warm * scale), int(train * scale)
            evaluation = max(1, (have - warm - train) // len(ctx.seeds))
    return dc, ref, (warm, train, evaluation), note


class _NoRoom(Exception):
    pass


def _cell(values: list[float], digits: int) -> str:
    finite = [v for v in values if math.isfinite(v)]
    return mean_std(finite, digits) if len(finite) == len(values) else "n/a (reference is 0)"


def _resample(times: np.ndarray, values: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """A piecewise-constant series (value holds from its time on) sampled at `grid`."""
    idx = np.searchsorted(times, grid, side="right") - 1
    return values[np.clip(idx, 0, len(values) - 1)]


def run(ctx: EvalContext) -> str:
    try:
        dc, trace_ref, split, trace_note = _data(ctx, QUICK_SPLIT if ctx.quick else PAPER_SPLIT)
    except _NoRoom as exc:
        return f"## Paper 003 table 5 / fig.9\n\nSkipped: {exc}.\n"
    from hsched.policies.learned import ModelMismatch

    try:  # a model that cannot serve this room (another fleet's, unreadable) leaves its row out, with why
        if "Double DQN" in POLICY_FACTORIES:
            _double_dqn(0, dc)
    except ModelMismatch as exc:
        unusable = POLICY_FACTORIES.pop("Double DQN")
        try:
            return _run(ctx, dc, trace_ref, split, trace_note, unusable=str(exc))
        finally:
            POLICY_FACTORIES["Double DQN"] = unusable
    return _run(ctx, dc, trace_ref, split, trace_note)


def _run(ctx: EvalContext, dc: DataCenter, trace_ref: TraceRef, split: tuple[int, int, int], trace_note: str,
         unusable: str = "") -> str:
    warm, train, evaluation = split
    results: dict[str, dict[str, list[dict[str, float]]]] = {
        m: {p: [] for p in POLICY_FACTORIES} for m in MODES
    }
    series: dict[str, dict[str, list[tuple[np.ndarray, dict[str, np.ndarray]]]]] = {
        m: {p: [] for p in POLICY_FACTORIES} for m in MODES
    }
    params: dict[str, ThermalParams] = {}  # each mode's room as run (its supply air, redline)
    total, done = len(MODES) * len(ctx.seeds) * len(POLICY_FACTORIES) + len(ctx.seeds), 0
    ctx.progress("thermal", 0, total)
    for mode in MODES:
        for seed in ctx.seeds:
            env = eval_env(mode, seed, split, dc, trace_ref)
            params[mode] = env.room.params
            for name, factory in POLICY_FACTORIES.items():
                policy = _double_dqn(seed, dc) if name == "Double DQN" and ctx.fleet_path else factory(seed)
                results[mode][name].append(run_policy(env, policy, seed=seed))
                hours = (np.asarray(env.series["time_s"]) - env.episode_t0) / 3600.0
                series[mode][name].append((hours, {k: np.asarray(v) for k, v in env.series.items()}))
                done += 1
                ctx.progress(f"thermal {mode} seed {seed} {name}", done, total)

    first = warm + train
    lines = [
        "## Paper 003 table 5 / fig.9: thermal-aware placement inside one data center",
        "",
        f"Room `{dc.name}` of {ctx.fleet_label(ctx.fleet()) if ctx.fleet_path else 'the default fleet'}: "
        f"{dc.layout.racks} racks × {dc.layout.servers_per_rack} slots, {dc.node_count} servers, "
        f"{dc.capacity_total().cpu_cores:g} cores. Trace {trace_ref.label}"
        + (f" ({trace_note})" if trace_note else "")
        + f": jobs 0-{warm - 1} warm the room up (placed by round robin; every policy starts from the "
        f"same state). Then {evaluation} evaluation jobs: seed s plays jobs {first} + {evaluation}·s onwards. "
        f"Seeds {list(ctx.seeds)} (they also seed Random). Eq.12 reward with the `RewardConfig` defaults "
        f"{_reward_text(RewardConfig())}. Mean reward is per decision. PUE, overloads (servers with u > 0.8) "
        "and rack outlet temperature are time-weighted over the evaluation window, as is the room's CPU load (the "
        "share of its cores busy: what makes runs on two traces comparable). Cells are mean ± std over "
        "seeds. The Δ columns are per-seed differences against RR and Greedy: % for PUE and overloads, °C "
        "for the outlet." + (f" **Quick run: {warm} warm-up and {evaluation} evaluation jobs.**" if ctx.quick else ""),
    ]
    for mode in MODES:
        res = results[mode]
        rows = []
        for name, runs in res.items():
            rows.append(
                [
                    name,
                    *(_cell([r[key] for r in runs], digits) for key, _, digits in METRICS),
                    mean_std([100 * r["mean_cpu_load"] for r in runs], 1),
                    mean_std([r["placed"] for r in runs], 0),
                    mean_std([r["deferred"] for r in runs], 0),
                    mean_std([r["sim_hours"] for r in runs], 2),
                ]
            )
        lines += [
            "",
            f"### {_crac(params[mode], heading=True)}",
            "",
            markdown_table(
                ["policy", *(label for _, label, _ in METRICS), "room CPU load %", "placed", "deferred", "hours"],
                rows,
            ),
        ]
        delta_rows = []
        for name, runs in res.items():
            row: list[object] = [name]
            for key, unit in DELTAS:
                for ref in ("RR", "Greedy"):
                    row.append(_cell(delta_values(runs, res[ref], key, unit), 2 if unit == "%" else 3))
            delta_rows.append(row)
        delta_rows.append(
            ["paper: Double DQN", *(f"{v:+.1f}" for pair in PAPER_DELTAS.values() for v in pair)]
        )
        lines += [
            "",
            markdown_table(
                [
                    "policy",
                    "ΔPUE vs RR %",
                    "ΔPUE vs Greedy %",
                    "Δoverloads vs RR %",
                    "Δoverloads vs Greedy %",
                    "Δoutlet vs RR °C",
                    "Δoutlet vs Greedy °C",
                ],
                delta_rows,
            ),
        ]
        if mode == "fixed":
            pues = {round(r["mean_pue"], 9) for runs in res.values() for r in runs}
            if len(pues) == 1:
                p = params[mode]
                lines += [
                    "",
                    f"With a fixed supply temperature every policy has the same PUE ({pues.pop():.4f}). "
                    f"Here PUE = 1 + 1/CoP({p.t_supply_c:g} °C) + {100 * p.p_other_fraction:g} % other, "
                    "whatever the placement. The redline mode below is where placement changes PUE.",
                ]

    optimum_lines, done = _optimum_section(ctx, first, evaluation, done, total, dc, trace_ref)
    lines += optimum_lines

    pngs = [
        _plot(
            ctx,
            series["fixed"],
            "mean_rack_outlet_c",
            "thermal_outlet.png",
            f"Mean rack outlet temperature, {_crac(params['fixed'])} (paper 003 fig.9)",
            "°C",
        ),
        _plot(
            ctx,
            series["redline"],
            "pue",
            "thermal_pue.png",
            f"PUE over time, {_crac(params['redline'])}",
            "PUE",
        ),
        _plot(
            ctx,
            series["redline"],
            "mean_rack_outlet_c",
            "thermal_outlet_redline.png",
            f"Mean rack outlet temperature, {_crac(params['redline'])}",
            "°C",
        ),
    ]
    lines += [
        "",
        _double_dqn_note(trace_ref, [(first + evaluation * s, first + evaluation * (s + 1)) for s in ctx.seeds],
                         unusable),
        f"The exact optimum is stated on the small instances above: the {evaluation}-job online episodes have "
        "no tractable one.",
        "",
        "PNG files:",
        *(f"- {p}" for p in pngs),
    ]
    return "\n".join(lines) + "\n"


def _crac(params: ThermalParams, heading: bool = False) -> str:
    """How the report names a room's CRAC setting, from the parameters it ran with."""
    if params.supply_mode == "fixed":
        return f"{'F' if heading else 'f'}ixed {params.t_supply_c:g} °C supply air"
    return f"CRAC holding the hottest inlet at the {params.redline_c:g} °C redline"


def _jobs(span: list[int]) -> str:
    return f"{span[0]}-{span[1] - 1}"


def _double_dqn_note(trace: TraceRef, windows: list[tuple[int, int]], unusable: str = "") -> str:
    """The Double DQN row's model as its own metadata describes it: the trace and jobs it was trained on (and
    the validation jobs its reward was chosen on); "never on these evaluation jobs" only when that trace is
    this run's `trace` and none of those jobs is in this run's evaluation `windows` ([first, end) per seed)."""
    path = model_path(DOUBLE_DQN_MODEL)
    if "Double DQN" not in POLICY_FACTORIES:
        return f"Double DQN: no row, {unusable}. " if unusable else \
            f"Double DQN: no row, `{path}` is missing (`hsched train double-dqn` writes it). "
    meta = load_metadata(path)
    data = meta.get("data", {})
    seen = [span for span in (data.get("train_jobs"), data.get("validation_jobs")) if span]
    chosen = data.get("validation_jobs") if meta.get("reward_selection") else None
    trained = f"trained on `{data['trace']}`" if data.get("trace") else "trained on jobs its metadata does not name"
    for flag in ("cores_per_proc", "time_compression"):
        if data.get(flag, 1) != 1:
            trained += f" at --{flag.replace('_', '-')} {data[flag]:g}"
    if data.get("train_jobs"):
        trained += f", jobs {_jobs(data['train_jobs'])}"
    if chosen:
        trained += f", with eq.12's constants chosen on its validation jobs {_jobs(chosen)}"
    evaluated = f"{windows[0][0]}-{windows[-1][1] - 1}"
    if not same_trace(data, trace):
        held_out = f"another trace than this run's, {trace.label}"
    elif any(a < end and start < b for a, b in seen for start, end in windows):
        held_out = f"this run's trace, and those jobs overlap these evaluation jobs ({evaluated}): not held out"
    else:
        held_out = f"this run's trace, never on these evaluation jobs ({evaluated})"
    return (
        f"Double DQN: the model `{path}` (`hsched.rl.ddqn`), {trained}: {held_out}. Served through "
        "`plan()`/`select()`. Its features are the servers' utilisation, recirculation rise over the "
        "supply air and heat influence, the same in both CRAC modes. In the redline mode a lower PUE goes with "
        "a warmer outlet: the CRAC lets the supply air warm up as far as the hottest inlet allows. "
    )


def _reward_text(rc: RewardConfig) -> str:
    return (
        f"(r_job {rc.r_job}, overheat −{rc.overheat_penalty} above the redline, overload −{rc.overload_penalty} "
        f"above u = {rc.phi_u}, no room −{rc.invalid_penalty})"
    )


def _plot(
    ctx: EvalContext,
    runs: dict[str, list[tuple[np.ndarray, dict[str, np.ndarray]]]],
    key: str,
    filename: str,
    title: str,
    ylabel: str,
) -> str:
    """Each policy's series averaged over seeds on a common grid of hours since the first evaluation decision."""
    span = min(float(h[-1]) for per_seed in runs.values() for h, _ in per_seed)
    grid = np.linspace(0.0, max(span, 1e-9), GRID_POINTS)
    lines = {}
    for name, per_seed in runs.items():
        stacked = np.stack([_resample(h, s[key], grid) for h, s in per_seed])
        lines[name] = (grid.tolist(), stacked.mean(axis=0).tolist())
    return str(
        plot_lines(ctx.png(filename), title, "hours since the first evaluation decision", ylabel, lines)
    )


# ------------------------------------------------------------------------------------------------------------
# Gap to the optimum on small instances


@dataclass(frozen=True)
class SmallInstance:
    """A small offline instance of the DC placement: the pre-loaded room and a batch of Thunder jobs."""

    seed: int
    state: ClusterState  # the room after the pre-load (not modified by the solver or the policies)
    room: RoomModel
    tasks: tuple[TaskSpec, ...]  # the batch, whole jobs (their parts: split_task)
    job_ids: tuple[int, ...]  # trace indices of the batch jobs
    preload_jobs: int

    @property
    def parts(self) -> int:
        return sum(len(split_task(t, self.state.dc)) for t in self.tasks)


def small_dc(racks: int, servers_per_rack: int, base: DataCenter | None = None) -> DataCenter:
    """The paper room shrunk to racks × servers per rack: same server type, prices and thermal parameters."""
    base = base or load_fleet().datacenter(DEFAULT_DC)
    (pool,) = base.pools
    return dataclasses.replace(
        base,
        name=f"{base.name}-{racks}x{servers_per_rack}",
        layout=RoomLayout(racks=racks, servers_per_rack=servers_per_rack, rows=1),
        pools=(dataclasses.replace(pool, count=racks * servers_per_rack),),
    )


def _copy(state: ClusterState) -> ClusterState:
    out = ClusterState(state.dc, state.table)
    for task_id, parts in state.allocations.items():
        out.apply(task_id, parts)
    return out


def small_instance(seed: int, first: int, evaluation: int, quick: bool, base: DataCenter | None = None,
                   trace: str | TraceRef = THUNDER) -> SmallInstance:
    """Seed `seed`'s instance: the jobs before its first evaluation job (trace index first + evaluation·seed)
    pre-load the room by round robin, and its evaluation jobs make the batch (module docstring)."""
    start = first + evaluation * seed
    jobs = thunder_jobs(start + evaluation, trace)  # the same cached slice the env reads
    dc = small_dc(*OPT_ROOM[quick], base=base)
    state = ClusterState(dc)
    room = room_for(dc)
    cores = int(state.table.cpu_milli.sum())
    target, busy, preload = OPT_PRELOAD * cores, 0, []
    for i in range(start - 1, -1, -1):
        need = jobs[i].spec.total.cpu_milli
        if busy + need <= target:
            preload.append(i)
            busy += need
        if target - busy < MILLI:
            break
    rr = make_policy("rr")
    placed = 0
    for i in reversed(preload):
        p = plan(state, jobs[i].spec, rr)
        if p.outcome is Outcome.PLACED:
            state.apply(f"preload-{i}", p.parts)
            placed += 1
    budget = OPT_BATCH_FILL * int(state.free_cpu.sum())
    ids: list[int] = []
    parts = need = 0
    for i in range(start, start + evaluation):
        spec = jobs[i].spec
        n = len(split_task(spec, dc))
        if parts + n <= OPT_BATCH_PARTS[quick] and need + spec.total.cpu_milli <= budget:
            ids.append(i)
            parts += n
            need += spec.total.cpu_milli
        if parts == OPT_BATCH_PARTS[quick]:
            break
    return SmallInstance(seed, state, room, tuple(jobs[i].spec for i in ids), tuple(ids), placed)


def _measure(room: RoomModel, state: ClusterState) -> dict[str, float]:
    """Peak inlet (°C), its rise over the supply air (K) and the servers above 80 % CPU (paper 003's φ_u)."""
    s = room_state(room, state)
    t = state.table
    overloaded = int(np.sum(t.cpu_milli - state.free_cpu > t.cpu_milli * OVERLOAD_NUM // OVERLOAD_DEN))
    return {"peak": s.max_inlet_c, "rise": s.max_inlet_c - s.t_supply_c, "overloaded": float(overloaded)}


def solve_small_instance(inst: SmallInstance, time_limit_s: float) -> tuple[SmallInstance, OptimumResult]:
    """The exact optimum of `inst`; while its batch cannot be placed at once, its last job is dropped."""
    while True:
        result = min_peak_inlet(inst.state, inst.room, inst.tasks, time_limit_s=time_limit_s)
        if result.status != "infeasible" or not inst.tasks:
            return inst, result
        inst = dataclasses.replace(inst, tasks=inst.tasks[:-1], job_ids=inst.job_ids[:-1])


def place_batch(inst: SmallInstance, policy: Any) -> ClusterState | None:
    """The batch placed job by job through `plan()` (state updated in between) on a copy of the pre-loaded
    room; None when some job finds no room."""
    state = _copy(inst.state)
    for i, task in zip(inst.job_ids, inst.tasks, strict=True):
        p = plan(state, task, policy)
        if p.outcome is not Outcome.PLACED:
            return None
        state.apply(f"batch-{i}", p.parts)
    return state


def _optimum_section(
    ctx: EvalContext, first: int, evaluation: int, done: int, total: int, base_dc: DataCenter | None = None,
    trace: str | TraceRef = THUNDER,
) -> tuple[list[str], int]:
    quick = ctx.quick
    names = [name for name, factory in POLICY_FACTORIES.items() if _is_node_policy(factory(0))]
    skipped = [name for name in POLICY_FACTORIES if name not in names]
    per_policy: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    optimum: list[dict[str, float]] = []
    statuses: list[str] = []
    instances: list[list[object]] = []
    for seed in ctx.seeds:
        inst, result = solve_small_instance(
            small_instance(seed, first, evaluation, quick, base_dc, trace), OPT_TIME_LIMIT_S[quick]
        )
        if result.objective is None:  # no placement at all (an empty batch is trivially placed)
            raise RuntimeError(f"thermal optimum, seed {seed}: {result.status} {result.message}")
        after = _copy(inst.state)
        result.apply(after)
        opt = _measure(inst.room, after)
        opt["time"] = result.solve_time_s
        optimum.append(opt)
        statuses.append(result.status)
        for name in names:
            state = place_batch(inst, POLICY_FACTORIES[name](seed))
            if state is None:
                continue
            m = _measure(inst.room, state)
            gap = gap_percent(m["rise"], opt["rise"], sense="min")
            if result.optimal and -1e-6 < gap < 0:  # equal to the optimum up to rounding
                gap = 0.0
            per_policy[name].append({**m, "gap": gap})
        base = _measure(inst.room, inst.state)
        ids = f"{inst.job_ids[0]}-{inst.job_ids[-1]}" if inst.job_ids else "none"
        instances.append(
            [
                seed,
                inst.preload_jobs,
                int((inst.state.table.cpu_milli - inst.state.free_cpu).sum()) // MILLI,
                f"{base['peak']:.2f}",
                f"{len(inst.tasks)} ({ids})",
                inst.parts,
                sum(t.total.cpu_milli for t in inst.tasks) // MILLI,
                result.status,
                f"{result.solve_time_s:.2f}",
            ]
        )
        done += 1
        ctx.progress(f"thermal optimum seed {seed}", done, total)

    racks, spr = OPT_ROOM[quick]
    dc = small_dc(racks, spr, base=base_dc)
    params = room_for(dc).params
    n_seeds = len(ctx.seeds)
    rows: list[list[object]] = []
    for name in names:
        runs = per_policy[name]
        rows.append(
            [
                name,
                f"{len(runs)}/{n_seeds}",
                mean_std([r["peak"] for r in runs], 3),
                mean_std([r["rise"] for r in runs], 3),
                mean_std([r["gap"] for r in runs], 2),
                mean_std([r["overloaded"] for r in runs], 2),
            ]
        )
    counts = {s: statuses.count(s) for s in dict.fromkeys(statuses)}
    status = ", ".join(f"{s} {c}/{n_seeds}" for s, c in counts.items())
    rows.append(
        [
            f"Optimum (MILP, {status}; solve {mean_std([o['time'] for o in optimum], 2)} s)",
            f"{n_seeds}/{n_seeds}",
            mean_std([o["peak"] for o in optimum], 3),
            mean_std([o["rise"] for o in optimum], 3),
            mean_std([0.0] * n_seeds, 2),
            mean_std([o["overloaded"] for o in optimum], 2),
        ]
    )
    lines = [
        "",
        "### Gap to the optimum on small instances",
        "",
        "The exact optimum of the whole episode is out of reach, so each seed also gets a small offline "
        "instance of the same problem, solved exactly by `hsched.optimum.min_peak_inlet` (HiGHS MILP, time "
        f"limit {OPT_TIME_LIMIT_S[quick]:g} s): a room of {racks} rack(s) × {spr} servers "
        f"({dc.capacity_total().cpu_milli // MILLI} cores) of the room's server type and thermal parameters "
        f"({_crac(params)}), with its own recirculation matrix. Pre-load: the trace jobs just before the "
        f"seed's first evaluation job, walking back, while they keep at most {OPT_PRELOAD:.0%} of the cores "
        "busy, placed by round robin. Batch: the seed's evaluation jobs in trace order while they stay "
        f"within {OPT_BATCH_PARTS[quick]} parts (`split_task`) and {OPT_BATCH_FILL:.0%} of the free "
        "cores; all its parts are placed at once. Each policy places the batch job by job through `plan()`. "
        "Gap = (policy's peak rise − optimum's peak rise) / optimum's peak rise, rises over the supply air "
        "in K (`gap_percent`, sense min). Overloaded: servers above 80 % CPU after placing (the optimum's "
        "tie-break, at its own peak only: a hotter placement can have fewer). Cells: mean ± std over the "
        "seeds where the policy placed the whole batch (column \"complete\"). In the redline CRAC mode the "
        "same placements are optimal (minimising the rise minimises the peak in both modes), but there the "
        f"peak inlet reads the {params.redline_c:g} °C redline for any rise up to "
        f"{params.redline_c - params.t_supply_min_c:g} K, so the fixed mode is shown.",
        "",
        markdown_table(
            ["seed", "pre-load jobs", "busy cores", "peak before °C", "batch jobs (trace ids)", "parts",
             "batch cores", "optimum status", "solve s"],
            instances,
        ),
        "",
        markdown_table(
            ["policy", "complete", "peak inlet °C", "peak rise K", "gap to optimum %", "overloaded servers"],
            rows,
        ),
    ]
    if skipped:
        lines += [
            "",
            f"Not run on these instances (not a `NodePolicy`, they act on the env): {', '.join(skipped)}.",
        ]
    return lines, done


def _is_node_policy(policy: object) -> bool:
    return hasattr(policy, "scores") and hasattr(policy, "placed")
