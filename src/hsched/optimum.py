"""Exact offline optima for small placement instances, so every report can state each policy's gap.

Two mixed-integer programs, solved with HiGHS (``highspy``; OR-Tools is not usable here: it pins
protobuf < 7, which grpcio 1.85 cannot use).

``max_deployed`` — the GPU-cluster placement of paper 000 (§2, eq.8-12): which tasks to deploy, on which
node and on which GPU cards, against the CURRENT free amounts of the given ClusterStates::

    x[t,c,k]   ∈ {0,1}  task t runs on node k of cluster c
    y[t,c,k,g] ∈ {0,1}  one of its GPU slices is on card g of that node (slices below 100 % of a card)
    u[c,k,g]   ∈ {0,1}  card g (empty now) is taken whole by one slice of 100 % (whole-card slices are
                        interchangeable on a node's empty cards, so they are counted, not assigned)
    Σ_{c,k} x[t,c,k] <= 1                                  a task runs at most once, anywhere (eq.11)
    Σ_g y[t,c,k,g] = gpu_count_t · x[t,c,k]                slices on distinct cards of one node
    Σ_{t whole} gpu_count_t · x[t,c,k] = Σ_g u[c,k,g]
    Σ_t r_t · x[t,c,k] <= free_r[c,k]                      r: cpu milli-cores, memory/disk MiB, bandwidth Mbit/s
    Σ_t pct_t · y[t,c,k,g] + 100 · u[c,k,g] <= free_core[c,k,g]      (percent of one card; eq.12 per card)
    Σ_t gmem_t · y[t,c,k,g] + cap_gmem · u[c,k,g] <= free_gmem[c,k,g] (MiB)
    x[t,c,k] exists only where t fits node k alone now, with an allowed GPU model
    Σ_{c,k} x[t,c,k] = z_j  for every task t of group j    optional all-or-nothing groups (``groups``: the
                        replicas of one job, each given as a single-replica task; z_j ∈ {0,1} "job j runs");
                        the replicas of a job may land on different nodes and clusters

  objective "deployed" (default), lexicographic: first max Σ x (tasks deployed; with groups Σ_j z_j + Σ x
  of the tasks in no group: jobs deployed, a task in no group being a job of its own), then, with that count
  fixed, max Σ gpu_count_t · pct_t · x (GPU core percent allocated: prefer the big tasks). The count is an
  integer objective, so HiGHS runs with an absolute gap < 1: "optimal" means exactly optimal, not "within
  0.01 %". The tie-break stage gets at most ``TIE_BREAK_SHARE`` of the time limit (``secondary_optimal``).
  objective "utilisation": max eq.9, the mean over clusters of eq.8 (the mean over the resources a cluster
  has, among CPU, memory, GPU memory and GPU core, of allocated / total, what is already allocated included).

``min_peak_inlet`` — the DC placement of paper 003 (§1.2): every part of every task (``split_task``) on one
server, given the room model (``hsched.thermal.RoomModel``), which is linear in the placement::

    P_k     = P0_k + slope_k · Δcores_k + gslope_k · Δcards_k      W  (eq.5 + GPU term; P0 = the current load)
    inlet_i = T_sup + Σ_k D[i,k] · P_k                             °C (D in K/W)

  lexicographic: first min max_i inlet_i, then, at that peak, min the number of overloaded servers (CPU
  utilisation > 0.8 after placing, paper 003's φ_u; servers overloaded already count too). In the room's
  "redline" supply mode T_sup = clip(redline − max rise, t_min, t_max) is a non-increasing function of the
  peak rise whose sum with it is non-decreasing, so minimising the peak rise minimises the peak inlet in
  both modes. The reported peak is ``RoomModel.evaluate`` of the solution; the bound is that same function
  of the solver's bound on the rise.

Both programs break the symmetry of interchangeable nodes (see ``_Placing``) and are checked against the
library heuristics (``heuristic_runs``: ``plan`` task by task): a proven optimum that a heuristic beats
raises RuntimeError (a modelling bug), and at the time limit the better of the solver's incumbent and the
best heuristic is returned, so a time-limited answer is never worse than the best heuristic. Status:
"optimal" (proven), "time_limit" (the best solution found and the proven ``bound``), "infeasible"
(``min_peak_inlet``: the parts cannot all be placed). Exact answers come in well under a second for a few
nodes and a dozen tasks and in seconds for ~6 nodes × 4 cards / 18 tasks; a 20-node × 8-card / 60-task
instance usually ends at the time limit with a bound (the LP relaxation of bin packing is weak): see
``tests/test_optimum.py::test_print_solver_times_on_a_20_node_8_card_60_task_instance``.
"""

from __future__ import annotations

import copy
import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import highspy
import numpy as np

from hsched.domain.cluster import ClusterState, GpuShare, OverAllocation, Part
from hsched.domain.resources import MILLI, Resources
from hsched.domain.task import TaskSpec
from hsched.policies.heuristics import HEURISTICS, make_policy
from hsched.policies.placement import Outcome, PartDemand, plan, split_task
from hsched.thermal.room import RoomModel

OVERLOAD_NUM, OVERLOAD_DEN = 4, 5  # paper 003 φ_u = 0.8: a server above 80 % CPU utilisation is overloaded
TIE_BREAK_SHARE = 0.25  # at most this share of max_deployed's time limit goes to the tie-break stage
_INF = math.inf


class Placement(NamedTuple):
    """Where one part goes: cluster index (into the list of states), node index, GPU card indices."""

    cluster: int
    node: int
    cards: tuple[int, ...] = ()


@dataclass(frozen=True)
class OptimumResult:
    """An exact (or time-limited) optimum.

    ``objective``: the primary objective of the returned assignment: tasks deployed ("max_deployed"; with
    ``groups``: groups deployed, a task in no group counting as a group of its own; ``deployed`` still counts
    tasks), eq.9
    mean utilisation in 0..1 ("max_utilisation"), or the peak inlet in °C ("min_peak_inlet"). ``bound``: the
    best proven bound on it (an upper bound when maximising, a lower bound when minimising), equal to
    ``objective`` when ``status == "optimal"``. ``secondary``: the tie-break value (GPU core percent allocated
    by the deployed tasks / number of overloaded servers); ``secondary_optimal`` says whether that stage was
    proven too. ``assignment[t]``: one Placement per part of task t (``split_task`` order; exactly one for
    ``max_deployed``), or None when t is not deployed.
    """

    kind: str
    status: str
    objective: float | None
    bound: float | None
    deployed: int
    assignment: tuple[tuple[Placement, ...] | None, ...]
    demands: tuple[tuple[PartDemand, ...], ...] = field(repr=False)
    solve_time_s: float
    secondary: float | None = None
    secondary_optimal: bool = False
    message: str = ""

    @property
    def optimal(self) -> bool:
        return self.status == "optimal"

    def placement(self, task: int) -> Placement | None:
        """The single Placement of a one-part task (every ``max_deployed`` task), or None if not deployed."""
        a = self.assignment[task]
        if a is None:
            return None
        if len(a) != 1:
            raise ValueError(f"task {task} has {len(a)} parts; read assignment[{task}] instead")
        return a[0]

    def as_parts(self, task: int) -> tuple[int, tuple[Part, ...]] | None:
        """(cluster index, the Parts for ``ClusterState.apply``) of task ``task``, or None if not deployed.
        A task's parts are always in one cluster."""
        a = self.assignment[task]
        if a is None:
            return None
        parts = []
        for d, p in zip(self.demands[task], a, strict=True):
            r = d.demand
            gpus = tuple(GpuShare(g, r.gpu_core_percent, r.gpu_memory_mib) for g in p.cards)
            parts.append(Part(d.replica, d.part, p.node, r.cpu_milli, r.memory_mib, r.disk_mib, r.bandwidth_mbps,
                              gpus))
        return a[0].cluster, tuple(parts)

    def apply(self, states: ClusterState | Sequence[ClusterState], prefix: str = "optimum-") -> list[str]:
        """Apply every deployed task to ``states`` (task ids ``f"{prefix}{t}"``) and return the ids. All or
        nothing: on OverAllocation the tasks applied so far are released again and the error is raised."""
        states = [states] if isinstance(states, ClusterState) else list(states)
        done: list[tuple[ClusterState, str]] = []
        try:
            for t in range(len(self.assignment)):
                cp = self.as_parts(t)
                if cp is None:
                    continue
                cluster, parts = cp
                task_id = f"{prefix}{t}"
                states[cluster].apply(task_id, parts)
                done.append((states[cluster], task_id))
        except OverAllocation:
            for state, task_id in reversed(done):
                state.release(task_id)
            raise
        return [task_id for _, task_id in done]


def gap_percent(heuristic_value: float, optimum_value: float, sense: str = "max") -> float:
    """How far a heuristic is from the optimum, in percent of the optimum.

    ``sense="max"`` (tasks deployed, utilisation): 100 · (opt − heuristic) / |opt|;
    ``sense="min"`` (a cost, a temperature rise): 100 · (heuristic − opt) / |opt|.
    0 means the heuristic is optimal. A negative gap means it beat the value given as the optimum, which can
    only happen against a time-limited incumbent (compare with the result's ``bound`` instead). An optimum of
    0 gives 0 when the heuristic reaches 0 too, else ±inf. For temperatures pass rises (K), not °C.
    """
    if sense not in ("max", "min"):
        raise ValueError(f"sense must be 'max' or 'min', got {sense!r}")
    diff = optimum_value - heuristic_value if sense == "max" else heuristic_value - optimum_value
    if optimum_value == 0:
        return 0.0 if diff == 0 else math.copysign(_INF, diff)
    return 100.0 * diff / abs(optimum_value)


# ---------------------------------------------------------------------------------------------------------------
# A small MILP builder over highspy


class _Milp:
    def __init__(self) -> None:
        self.cost: list[float] = []
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.integer: list[bool] = []
        self.row_lower: list[float] = []
        self.row_upper: list[float] = []
        self.coo_row: list[int] = []
        self.coo_col: list[int] = []
        self.coo_val: list[float] = []

    def var(self, cost: float = 0.0, lower: float = 0.0, upper: float = 1.0, integer: bool = True) -> int:
        self.cost.append(cost)
        self.lower.append(lower)
        self.upper.append(upper)
        self.integer.append(integer)
        return len(self.cost) - 1

    def row(self, cols: Sequence[int], vals: Sequence[float], lower: float = -_INF, upper: float = _INF) -> None:
        r = len(self.row_lower)
        self.row_lower.append(lower)
        self.row_upper.append(upper)
        self.coo_row.extend([r] * len(cols))
        self.coo_col.extend(cols)
        self.coo_val.extend(vals)

    def highs(self, maximize: bool) -> highspy.Highs:
        n, m = len(self.cost), len(self.row_lower)
        rows = np.array(self.coo_row, dtype=np.int64)
        cols = np.array(self.coo_col, dtype=np.int64)
        order = np.lexsort((rows, cols))
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = n, m
        lp.col_cost_ = np.array(self.cost, dtype=np.float64)
        lp.col_lower_ = np.array(self.lower, dtype=np.float64)
        lp.col_upper_ = np.array(self.upper, dtype=np.float64)
        lp.row_lower_ = np.array(self.row_lower, dtype=np.float64)
        lp.row_upper_ = np.array(self.row_upper, dtype=np.float64)
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = n, m
        lp.a_matrix_.start_ = np.searchsorted(cols[order], np.arange(n + 1)).astype(np.int32)
        lp.a_matrix_.index_ = rows[order].astype(np.int32)
        lp.a_matrix_.value_ = np.array(self.coo_val, dtype=np.float64)[order]
        lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous
                           for i in self.integer]
        lp.sense_ = highspy.ObjSense.kMaximize if maximize else highspy.ObjSense.kMinimize
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("random_seed", 0)
        h.setOptionValue("threads", 1)
        h.passModel(lp)
        return h


class _Run(NamedTuple):
    status: str  # optimal | time_limit | infeasible | error
    values: np.ndarray | None  # primal solution, None when there is none
    objective: float | None
    bound: float | None


def _run(h: highspy.Highs, time_limit_s: float, abs_gap: float, rel_gap: float) -> _Run:
    h.setOptionValue("time_limit", max(float(time_limit_s), 0.01))
    h.setOptionValue("mip_abs_gap", abs_gap)
    h.setOptionValue("mip_rel_gap", rel_gap)
    h.run()
    ms = h.getModelStatus()
    info = h.getInfo()
    has_solution = info.primal_solution_status == 2  # kSolutionStatusFeasible
    values = np.array(h.getSolution().col_value) if has_solution else None
    objective = float(info.objective_function_value) if has_solution else None
    bound = float(info.mip_dual_bound) if math.isfinite(info.mip_dual_bound) else None
    if ms == highspy.HighsModelStatus.kOptimal:
        return _Run("optimal", values, objective, objective if bound is None else bound)
    if ms == highspy.HighsModelStatus.kInfeasible:
        return _Run("infeasible", None, None, None)
    if ms in (highspy.HighsModelStatus.kTimeLimit, highspy.HighsModelStatus.kInterrupt,
              highspy.HighsModelStatus.kIterationLimit, highspy.HighsModelStatus.kSolutionLimit):
        return _Run("time_limit", values, objective, bound)
    return _Run("error", values, objective, bound)


def _warm_start(h: highspy.Highs, values: np.ndarray, ncols: int | None = None) -> None:
    """Hand a solution (of the first ``ncols`` columns, HiGHS completes the rest) to HiGHS as an incumbent."""
    n = len(values) if ncols is None else ncols
    h.setSolution(n, np.arange(n, dtype=np.int32), np.asarray(values[:n], dtype=np.float64))


# ---------------------------------------------------------------------------------------------------------------
# The placement columns and rows shared by both programs


@dataclass
class _Item:
    """One part to place (a task for max_deployed, a split part for min_peak_inlet)."""

    task: int
    demand: Resources
    gpu_models: tuple[str, ...]
    x: dict[tuple[int, int], int] = field(default_factory=dict)  # (cluster, node) -> column
    y: dict[tuple[int, int], dict[int, int]] = field(default_factory=dict)  # (cluster, node) -> {card: col}
    # a GPU item placed at (c, k) without a y entry there takes whole empty cards, counted by the u columns


class _Placing:
    """The x/y/u columns of a placement problem, its capacity rows, and its symmetry-breaking rows.

    Nodes of one cluster identical in every capacity, free amount and GPU model are interchangeable
    (``node_symmetry``; not in the thermal problem, where every server sits elsewhere in the room): rows order
    each class by load (Σ of the items' CPU + memory shares of a node), descending. Every solution has a
    permuted twin that satisfies them (``start`` builds it), and the search skips the copies. Interchangeable
    cards are left to HiGHS' own symmetry detection (explicit card-ordering rows measured slower), after the u
    columns have removed the biggest source: which empty cards the whole-card slices take.
    """

    def __init__(self, m: _Milp, states: Sequence[ClusterState], items: list[_Item], x_cost: Sequence[float],
                 node_symmetry: bool) -> None:
        self.states, self.items = states, items
        node_use: dict[tuple[int, int], list[tuple[int, Resources]]] = {}
        card_use: dict[tuple[int, int, int], list[tuple[int, Resources]]] = {}
        whole_use: dict[tuple[int, int], list[tuple[int, Resources]]] = {}
        empty = {(c, k): self._empty_cards(c, k) for c, s in enumerate(states) for k in range(s.n)}
        for item, cost in zip(items, x_cost, strict=True):
            r = item.demand
            for c, state in enumerate(states):
                for k in np.flatnonzero(state.feasible(r, item.gpu_models)):
                    k = int(k)
                    col = item.x[(c, k)] = m.var(cost)
                    node_use.setdefault((c, k), []).append((col, r))
                    if not r.gpu_count:
                        continue
                    if r.gpu_core_percent == 100 and all(state.gpu_free_memory[k, g] >= r.gpu_memory_mib
                                                         for g in empty[(c, k)]):
                        whole_use.setdefault((c, k), []).append((col, r))
                        continue
                    cards = np.flatnonzero((state.gpu_free_core[k] >= r.gpu_core_percent)
                                           & (state.gpu_free_memory[k] >= r.gpu_memory_mib))
                    ys = item.y[(c, k)] = {int(g): m.var() for g in cards}
                    m.row([*ys.values(), col], [1.0] * len(ys) + [-float(r.gpu_count)], 0.0, 0.0)
                    for g, yc in ys.items():
                        card_use.setdefault((c, k, g), []).append((yc, r))
        self.u: dict[tuple[int, int], dict[int, int]] = {}
        for (c, k), uses in whole_use.items():
            us = self.u[(c, k)] = {g: m.var() for g in empty[(c, k)]}
            m.row([col for col, _ in uses] + list(us.values()),
                  [float(r.gpu_count) for _, r in uses] + [-1.0] * len(us), 0.0, 0.0)
        self.ncols = len(m.cost)  # the x, y and u columns are 0 .. ncols-1
        for (c, k), uses in node_use.items():
            s = states[c]
            for attr, free in (("cpu_milli", s.free_cpu), ("memory_mib", s.free_memory), ("disk_mib", s.free_disk),
                               ("bandwidth_mbps", s.free_bandwidth)):
                amounts = [getattr(r, attr) for _, r in uses]
                if sum(amounts) > free[k]:
                    m.row([col for col, _ in uses], amounts, upper=float(free[k]))
        for c, s in enumerate(states):
            for k in range(s.n):
                us = self.u.get((c, k), {})
                for g in range(s.gpu_free_core.shape[1]):
                    uses = card_use.get((c, k, g), [])
                    for attr, free in (("gpu_core_percent", s.gpu_free_core[k, g]),
                                       ("gpu_memory_mib", s.gpu_free_memory[k, g])):
                        amounts = [float(getattr(r, attr)) for _, r in uses]
                        if g in us:
                            m.row([col for col, _ in uses] + [us[g]], [*amounts, float(free)], upper=float(free))
                        elif sum(amounts) > free:
                            m.row([col for col, _ in uses], amounts, upper=float(free))
        self.node_classes: list[tuple[int, list[int], list[float]]] = []  # (cluster, nodes, weight per item)
        for c, nodes in (self._node_classes() if node_symmetry else []):
            t = states[c].table
            cpu, mem = max(int(t.cpu_milli[nodes[0]]), 1), max(int(t.memory_mib[nodes[0]]), 1)
            weight = [it.demand.cpu_milli / cpu + it.demand.memory_mib / mem for it in items]
            self.node_classes.append((c, nodes, weight))
            for a, b in itertools.pairwise(nodes):
                cols = [(it.x[(c, a)], it.x[(c, b)], w) for it, w in zip(items, weight, strict=True) if (c, a) in it.x]
                if cols:
                    m.row([p[0] for p in cols] + [p[1] for p in cols], [p[2] for p in cols] + [-p[2] for p in cols],
                          lower=0.0)

    def _empty_cards(self, c: int, k: int) -> list[int]:
        s = self.states[c]
        t = s.table
        return [g for g in range(int(t.gpu_count[k]))
                if s.gpu_free_core[k, g] == t.gpu_core_percent[k, g] >= 100
                and s.gpu_free_memory[k, g] == t.gpu_memory_mib[k, g]]

    def _node_key(self, c: int, k: int) -> tuple:
        s, t = self.states[c], self.states[c].table
        return (t.gpu_model[k], int(s.free_cpu[k]), int(s.free_memory[k]), int(s.free_disk[k]),
                int(s.free_bandwidth[k]), int(t.cpu_milli[k]), int(t.memory_mib[k]), int(t.disk_mib[k]),
                int(t.bandwidth_mbps[k]), s.gpu_free_core[k].tobytes(), s.gpu_free_memory[k].tobytes(),
                t.gpu_core_percent[k].tobytes(), t.gpu_memory_mib[k].tobytes())

    def _node_classes(self) -> list[tuple[int, list[int]]]:
        out = []
        for c, s in enumerate(self.states):
            groups: dict[tuple, list[int]] = {}
            for k in range(s.n):
                groups.setdefault(self._node_key(c, k), []).append(k)
            out += [(c, ks) for ks in groups.values() if len(ks) > 1]
        return out

    def chosen(self, values: np.ndarray) -> list[Placement | None]:
        """The placement of every item in a solution; whole-card slices get the node's u cards in item order."""
        pools = {ck: [g for g, col in us.items() if values[col] > 0.5] for ck, us in self.u.items()}
        out: list[Placement | None] = []
        for item in self.items:
            p = None
            for (c, k), col in item.x.items():
                if values[col] <= 0.5:
                    continue
                if (c, k) in item.y:
                    cards = tuple(sorted(g for g, yc in item.y[(c, k)].items() if values[yc] > 0.5))
                else:
                    n, pool = item.demand.gpu_count, pools.get((c, k), [])
                    cards, pools[(c, k)] = tuple(pool[:n]), pool[n:]
                p = Placement(c, k, cards)
                break
            out.append(p)
        return out

    def start(self, placements: Sequence[Placement | None]) -> np.ndarray:
        """The x/y/u values of ``placements`` (one per item), permuted within the symmetry classes so that they
        satisfy the symmetry-breaking rows: a MIP start HiGHS accepts."""
        placements = list(placements)
        for c, nodes, weight in self.node_classes:  # the most loaded node first; its cards move along with it
            load = {k: sum(w for w, p in zip(weight, placements, strict=True) if p and p.cluster == c and p.node == k)
                    for k in nodes}
            move = dict(zip(sorted(nodes, key=lambda k: -load[k]), nodes, strict=True))
            placements = [p._replace(node=move[p.node]) if p and p.cluster == c and p.node in move else p
                          for p in placements]
        values = np.zeros(self.ncols)
        for item, p in zip(self.items, placements, strict=True):
            if p is None:
                continue
            ck = (p.cluster, p.node)
            values[item.x[ck]] = 1.0
            for g in p.cards:
                values[item.y[ck][g] if ck in item.y else self.u[ck][g]] = 1.0
        return values


def _by_task(items: Sequence[_Item], placements: Sequence[Placement | None], tasks: Sequence[TaskSpec]
             ) -> tuple[tuple[Placement, ...] | None, ...]:
    """Per-item placements regrouped per task (None for a task with an unplaced part)."""
    per_task: list[list[Placement] | None] = [[] for _ in tasks]
    for item, p in zip(items, placements, strict=True):
        ps = per_task[item.task]
        if ps is not None:
            per_task[item.task] = None if p is None else [*ps, p]
    return tuple(None if ps is None else tuple(ps) for ps in per_task)


def _scratch(state: ClusterState) -> ClusterState:
    """A copy of the free arrays and allocations (the fleet description and the node table are shared)."""
    s = copy.copy(state)
    for name in ("free_cpu", "free_memory", "free_disk", "free_bandwidth", "gpu_free_core", "gpu_free_memory"):
        setattr(s, name, getattr(state, name).copy())
    s.allocations = dict(state.allocations)
    return s


def _verify(result: OptimumResult, states: Sequence[ClusterState]) -> None:
    """The solver's integers must apply exactly; a failure here is a modelling bug, never a user error."""
    try:
        result.apply([_scratch(s) for s in states])
    except OverAllocation as exc:
        raise RuntimeError(f"optimum: the solver's assignment does not apply ({exc}); this is a bug") from exc


def heuristic_runs(states: ClusterState | Sequence[ClusterState], tasks: Sequence[TaskSpec],
                   groups: Sequence[Sequence[int]] | None = None) -> dict[str, list[tuple[Placement, ...] | None]]:
    """Every library heuristic's sequential placement of ``tasks``: ``plan`` task by task with the state updated
    in between, a task that fits nowhere skipped, a task going to the first cluster that takes it. Keys are
    ``"<policy>"`` (the given order) and ``"<policy>/smallest-first"`` (ascending GPU, then CPU, then memory
    demand); values are per-task Placements as in ``OptimumResult.assignment``. The MIP starts of both programs.

    ``groups`` (as in ``max_deployed``; a task in no group is a group of its own): the tasks of a group are
    placed one after the other (each on the first cluster that takes it) and all rolled back when one of them
    does not fit, so a group is placed whole or not at all; the orders are then of groups (smallest-first: by
    the group's summed demand).
    """
    states = [states] if isinstance(states, ClusterState) else list(states)
    units = _units(len(tasks), groups)

    def size(unit: Sequence[int]) -> tuple[int, int, int]:
        return (sum(tasks[i].total.gpu_count * tasks[i].resources.gpu_core_percent for i in unit),
                sum(tasks[i].total.cpu_milli for i in unit), sum(tasks[i].total.memory_mib for i in unit))

    runs = {}
    for suffix, order in (("", units), ("/smallest-first", sorted(units, key=size))):
        for name in sorted(HEURISTICS):
            scratch = [_scratch(s) for s in states]
            policies = [make_policy(name) for _ in states]
            out: list[tuple[Placement, ...] | None] = [None] * len(tasks)
            for unit in order:
                applied: list[tuple[ClusterState, str]] = []
                for i in unit:
                    for c, (s, policy) in enumerate(zip(scratch, policies, strict=True)):
                        p = plan(s, tasks[i], policy)
                        if p.outcome is Outcome.PLACED:
                            s.apply(f"start-{i}", p.parts)
                            applied.append((s, f"start-{i}"))
                            out[i] = tuple(Placement(c, part.node, tuple(g.card for g in part.gpus))
                                           for part in p.parts)
                            break
                    else:  # task i fits nowhere: roll its group back
                        for s, task_id in applied:
                            s.release(task_id)
                        for j in unit:
                            out[j] = None
                        break
            runs[name + suffix] = out
    return runs


def _units(n: int, groups: Sequence[Sequence[int]] | None) -> list[list[int]]:
    """The all-or-nothing units of ``n`` tasks: the groups (validated: indices in range, no task twice, no empty
    group), then every task in no group on its own, in task order."""
    seen: set[int] = set()
    units = []
    for g, group in enumerate(groups or ()):
        unit = [int(i) for i in group]
        if not unit:
            raise ValueError(f"group {g} is empty")
        for i in unit:
            if not 0 <= i < n:
                raise ValueError(f"group {g} names task {i}; there are {n} tasks")
            if i in seen:
                raise ValueError(f"task {i} is in more than one group (or twice in group {g})")
            seen.add(i)
        units.append(unit)
    return units + [[i] for i in range(n) if i not in seen]


# ---------------------------------------------------------------------------------------------------------------
# 1. GPU placement: max tasks deployed / max utilisation (paper 000)


def _capacity_bound(states: Sequence[ClusterState], tasks: Sequence[TaskSpec], units: Sequence[Sequence[int]]) -> int:
    """An upper bound on the units (groups, single tasks) deployable at once, valid whatever the solver reached:
    for each resource (CPU, memory, GPU core, GPU memory), k units need at least the k smallest unit demands,
    so at most as many as fit, smallest first, in the free amount summed over every node and card. Pass only
    the units whose every task fits some node alone."""
    free = {"cpu": sum(int(s.free_cpu.sum()) for s in states), "mem": sum(int(s.free_memory.sum()) for s in states),
            "core": sum(int(s.gpu_free_core.sum()) for s in states),
            "gmem": sum(int(s.gpu_free_memory.sum()) for s in states)}

    def need(i: int) -> dict[str, int]:
        r = tasks[i].resources
        return {"cpu": r.cpu_milli, "mem": r.memory_mib, "core": r.gpu_count * r.gpu_core_percent,
                "gmem": r.gpu_count * r.gpu_memory_mib}

    needs = [[need(i) for i in u] for u in units]
    bound = len(units)
    for key, amount in free.items():
        total = fitted = 0
        for d in sorted(sum(n[key] for n in unit) for unit in needs):
            total += d
            if total > amount:
                break
            fitted += 1
        bound = min(bound, fitted)
    return bound


def _utilisation_weight(states: Sequence[ClusterState], r: Resources, c: int) -> float:
    """Eq.8-9 coefficient of deploying demand r in cluster c: Σ_res r_res / total_res / (|R_c| · N)."""
    t = states[c].table
    totals = [(r.cpu_milli, int(t.cpu_milli.sum())), (r.memory_mib, int(t.memory_mib.sum())),
              (r.gpu_count * r.gpu_memory_mib, int(t.gpu_memory_mib.sum())),
              (r.gpu_count * r.gpu_core_percent, int(t.gpu_core_percent.sum()))]
    present = [(a, b) for a, b in totals if b > 0]
    return sum(a / b for a, b in present) / (len(present) * len(states))


def cluster_utilisation(states: ClusterState | Sequence[ClusterState]) -> float:
    """Paper 000 eq.9: the mean over clusters of eq.8 (the mean allocated/total over the resources among CPU,
    memory, GPU memory and GPU core that the cluster has), 0..1."""
    states = [states] if isinstance(states, ClusterState) else list(states)
    out = 0.0
    for s in states:
        u, t = s.utilisation(), s.table
        present = [u[key] for key, cap in (("cpu", t.cpu_milli), ("memory", t.memory_mib),
                                           ("gpu_memory", t.gpu_memory_mib), ("gpu_core", t.gpu_core_percent))
                   if int(cap.sum()) > 0]
        out += sum(present) / len(present)
    return out / len(states)


def max_deployed(state: ClusterState | Sequence[ClusterState], tasks: Sequence[TaskSpec], time_limit_s: float = 10.0,
                 objective: str = "deployed", groups: Sequence[Sequence[int]] | None = None) -> OptimumResult:
    """The most tasks that can be deployed now (``objective="utilisation"``: the highest eq.9 utilisation),
    each on at most one node of one of the clusters ``state``, its GPU slices on distinct cards of that node,
    against the states' current free amounts. ``state`` is not modified: apply the answer with
    ``result.apply(states)``.

    Tasks must be single-replica and within their clusters' split thresholds (a ValueError names the first
    that is not). ``time_limit_s`` bounds the whole solve, both lexicographic stages included.

    ``groups``: lists of task indices (disjoint) deployed all or nothing — give a job of n replicas as n
    single-replica tasks in one group. The count objective then counts groups (``result.objective`` and
    ``bound``; a task in no group is a group of its own), and the heuristic floor and check place groups whole
    (``heuristic_runs(..., groups)``). Each replica still goes to any node of any cluster.
    """
    if objective not in ("deployed", "utilisation"):
        raise ValueError(f"objective must be 'deployed' or 'utilisation', got {objective!r}")
    states = [state] if isinstance(state, ClusterState) else list(state)
    if not states:
        raise ValueError("max_deployed needs at least one ClusterState")
    for i, task in enumerate(tasks):
        label = f"task {i}" + (f" ({task.name!r})" if task.name else "")
        if task.replicas != 1:
            raise ValueError(f"{label} has {task.replicas} replicas; max_deployed places single-replica tasks "
                             "(give each replica as its own task, and a job's replicas as one of ``groups``)")
        for s in states:
            if len(split_task(task, s.dc)) != 1:
                raise ValueError(f"{label} needs splitting in {s.dc.name} ({task.resources.cpu_milli} milli-cores "
                                 f"> threshold {s.dc.effective_split_threshold_milli}); max_deployed places "
                                 "whole tasks only")
    start = time.perf_counter()
    units = _units(len(tasks), groups)  # the all-or-nothing units: groups, then the other tasks alone
    grouped = [u for u in units if len(u) > 1]
    in_group = {i for u in grouped for i in u}
    kind = "max_deployed" if objective == "deployed" else "max_utilisation"
    demands = tuple((PartDemand(0, 0, t.resources),) for t in tasks)
    items = [_Item(i, t.resources, t.gpu_models) for i, t in enumerate(tasks)]
    m = _Milp()
    placing = _Placing(m, states, items, [0.0 if i in in_group else 1.0 for i in range(len(items))],
                       node_symmetry=True)
    if objective == "utilisation":
        for item in items:
            for (c, _k), col in item.x.items():
                m.cost[col] = _utilisation_weight(states, item.demand, c)
    obj_cols = []  # the columns the count objective sums: x of the tasks in no group, z of the groups
    for item in items:
        if item.x and item.task not in in_group:
            m.row(list(item.x.values()), [1.0] * len(item.x), upper=1.0)
            obj_cols += item.x.values()
    z_cols = []
    for unit in grouped:  # Σ x[t] = z_j for every task t of group j (a task that fits nowhere forces z_j = 0)
        z = m.var(1.0 if objective == "deployed" else 0.0)
        z_cols.append(z)
        for i in unit:
            m.row([*items[i].x.values(), z], [1.0] * len(items[i].x) + [-1.0], 0.0, 0.0)
    obj_cols += z_cols
    cost = np.array(m.cost)
    gpu_weight = np.zeros(len(m.cost))  # stage 2: GPU core percent of the deployed tasks
    x_cols = []
    for item in items:
        for col in item.x.values():
            gpu_weight[col] = item.demand.gpu_count * item.demand.gpu_core_percent
            x_cols.append(col)
    item_cols = [np.array(list(item.x.values()), dtype=np.int64) for item in items]

    def deployed_of(values: np.ndarray) -> int:
        """Units (groups, tasks in no group) with every task placed."""
        placed = [bool(len(cols)) and bool((values[cols] > 0.5).any()) for cols in item_cols]
        return sum(all(placed[i] for i in u) for u in units)

    def full(placements: Sequence[Placement | None]) -> np.ndarray:
        """All column values (x/y/u, then z) of a placement that places groups whole."""
        values = np.zeros(len(m.cost))
        values[:placing.ncols] = placing.start(placements)
        for z, unit in zip(z_cols, grouped, strict=True):
            values[z] = float(all(placements[i] is not None for i in unit))
        return values

    def finish(values: np.ndarray, status: str, bound: float | None, secondary_optimal: bool,
               message: str = "") -> OptimumResult:
        assignment = tuple(None if p is None else (p,) for p in placing.chosen(values))
        deployed = sum(a is not None for a in assignment)
        whole = [all(assignment[i] is not None for i in u) for u in units]
        if sum(whole) != len(units) - sum(all(assignment[i] is None for i in u) for u in units):
            raise RuntimeError("optimum: a group deployed in part; this is a bug")
        result = OptimumResult(kind, status, float(sum(whole)), bound, deployed, assignment, demands,
                               time.perf_counter() - start, float(gpu_weight @ values) if len(values) else 0.0,
                               secondary_optimal, message)
        _verify(result, states)
        if objective == "utilisation":  # report eq.9 of the whole state after applying (not the LP value)
            after = [_scratch(s) for s in states]
            result.apply(after)
            value = cluster_utilisation(after)
            bound_u = None if bound is None else max(value, bound + cluster_utilisation(states))
            result = replace(result, objective=value, bound=value if status == "optimal" else bound_u)
        return result

    if not x_cols:  # nothing fits anywhere: deploying nothing is optimal
        return finish(np.zeros(len(m.cost)), "optimal", 0.0 if objective == "deployed" else None, True,
                      "no task fits any node now" if tasks else "no tasks")

    # the best heuristic run (the most deployed, then the most GPU percent / the highest eq.9): the answer when
    # the solver's incumbent is worse at the time limit, and a check of a proven optimum. (Not a MIP start:
    # HiGHS measured slower with one on these models.)
    runs = [full([a[0] if a else None for a in run]) for run in heuristic_runs(states, tasks, groups).values()]
    score = (lambda v: (deployed_of(v), float(gpu_weight @ v))) if objective == "deployed" else \
        (lambda v: (round(float(cost @ v), 9), 0.0))
    best = max(runs, key=score)
    h = m.highs(maximize=True)
    tol = 1e-9 if objective == "deployed" else 1e-6
    # stage 1: the count, an integer objective, so an absolute gap below 1 proves it exactly (or eq.9)
    run = _run(h, time_limit_s - (time.perf_counter() - start), abs_gap=0.99 if objective == "deployed" else 1e-9,
               rel_gap=0.0 if objective == "deployed" else 1e-7)
    if run.status == "optimal" and score(best)[0] > score(run.values)[0] + tol:
        raise RuntimeError(f"optimum: a heuristic beat the proven optimum ({score(best)[0]} > "
                           f"{score(run.values)[0]}); the model is wrong, this is a bug")
    if run.status not in ("optimal", "time_limit"):
        raise RuntimeError(f"optimum: HiGHS ended with {run.status!r} on a model where deploying nothing is "
                           "feasible; this is a bug")
    values = run.values if run.values is not None and score(run.values) >= score(best) else best
    if objective == "utilisation":
        return finish(values, run.status, run.bound, run.status == "optimal",
                      "" if run.status == "optimal" else "time limit: the best placement found and an upper bound")

    count = deployed_of(values)
    if run.status != "optimal":
        count_bound = _capacity_bound(states, tasks, [u for u in units if all(item_cols[i].size for i in u)])
        if run.bound is not None:
            count_bound = min(math.floor(run.bound + 1e-6), count_bound)
        return finish(values, "time_limit", float(max(count, count_bound)), False,
                      f"time limit: {count} deployed, at most {max(count, count_bound)} possible")
    # stage 2: with the count held, the most GPU core percent (an integer objective too)
    if count == 0 or not gpu_weight.any():
        return finish(values, "optimal", float(count), True)
    h.addRow(float(count), _INF, len(obj_cols), np.array(obj_cols, dtype=np.int32), np.ones(len(obj_cols)))
    h.changeColsCost(len(gpu_weight), np.arange(len(gpu_weight), dtype=np.int32), gpu_weight)
    _warm_start(h, values)
    budget = min(time_limit_s - (time.perf_counter() - start), max(0.5, TIE_BREAK_SHARE * time_limit_s))
    run2 = _run(h, max(budget, 0.1), abs_gap=0.99, rel_gap=0.0)
    if (run2.values is not None and deployed_of(run2.values) == count
            and gpu_weight @ run2.values >= gpu_weight @ values):
        values = run2.values
    return finish(values, "optimal", float(count), run2.status == "optimal")


# ---------------------------------------------------------------------------------------------------------------
# 2. DC placement: min peak inlet temperature, then the fewest overloaded servers (paper 003)


def _peak_from_rise(room: RoomModel, rise: float) -> float:
    """Peak inlet (°C) for a peak rise above supply (K): T_sup(rise) + rise, as RoomModel.evaluate computes it."""
    p = room.params
    if p.supply_mode == "fixed":
        return p.t_supply_c + rise
    return float(np.clip(p.redline_c - rise, p.t_supply_min_c, p.t_supply_max_c)) + rise


def _largest_rise_at_same_peak(room: RoomModel, rise: float) -> float:
    """The largest peak rise whose peak inlet equals that of `rise`: in redline mode the peak inlet is flat
    (= the redline) for every rise the CRAC can compensate, redline − t_max ≤ rise ≤ redline − t_min, so all
    of those placements tie on the first objective and the tie-break must consider them all. (`rise` comes
    from the solver: within 1e-6 of the plateau's start counts as on it.)"""
    p = room.params
    if p.supply_mode != "fixed" and p.redline_c - p.t_supply_max_c - 1e-6 <= rise <= p.redline_c - p.t_supply_min_c:
        return p.redline_c - p.t_supply_min_c
    return rise


def min_peak_inlet(state: ClusterState, room: RoomModel, tasks: Sequence[TaskSpec],
                   time_limit_s: float = 10.0) -> OptimumResult:
    """Place every part of every task (``split_task``; GPU slices on distinct cards) so that the hottest server
    inlet (°C) is as low as possible, then, at that peak, so that the fewest servers run above 80 % CPU.

    ``room`` must describe ``state``'s nodes in order (``hsched.thermal.datacenter.room_for``); the current
    load of ``state`` is the baseline. ``objective`` is the peak inlet of the returned placement in °C
    (``RoomModel.evaluate``), ``bound`` a proven lower bound on it, ``secondary`` the number of overloaded
    servers after placing (pre-existing ones included). Status "infeasible" when the parts cannot all be
    placed. The redline is not a constraint: the optimum is the coolest placement, whatever its peak.
    """
    if room.n != state.n:
        raise ValueError(f"room has {room.n} servers but the cluster has {state.n} nodes")
    start = time.perf_counter()
    demands = tuple(tuple(split_task(t, state.dc)) for t in tasks)
    items = [_Item(i, d.demand, tasks[i].gpu_models) for i, ds in enumerate(demands) for d in ds]
    t = state.table
    busy_milli = t.cpu_milli - state.free_cpu
    limit = t.cpu_milli * OVERLOAD_NUM // OVERLOAD_DEN  # integers: busy > 0.8·total ⇔ busy > ⌊0.8·total⌋

    def evaluate(assignment: tuple[tuple[Placement, ...] | None, ...]) -> tuple[float, int]:
        after = _scratch(state)
        OptimumResult("min_peak_inlet", "", None, None, 0, assignment, demands, 0.0).apply(after)
        peak = room.evaluate(after.busy_cpu() / MILLI, after.busy_gpu_cards()).max_inlet_c
        return peak, int(np.sum(t.cpu_milli - after.free_cpu > limit))

    def result(status: str, placements: Sequence[Placement | None] | None, bound: float | None,
               secondary_optimal: bool, message: str = "") -> OptimumResult:
        if placements is None:
            return OptimumResult("min_peak_inlet", status, None, bound, 0, tuple(None for _ in tasks), demands,
                                 time.perf_counter() - start, None, False, message)
        per_task: list[list[Placement]] = [[] for _ in tasks]
        for item, p in zip(items, placements, strict=True):
            if p is None:  # cannot happen: Σ x = 1 for every part
                raise RuntimeError("optimum: a part left unplaced in a feasible solution; this is a bug")
            per_task[item.task].append(p)
        assignment = tuple(tuple(ps) for ps in per_task)
        out = OptimumResult("min_peak_inlet", status, None, None, len(tasks), assignment, demands, 0.0)
        _verify(out, [state])
        peak, overloaded = evaluate(assignment)
        return replace(out, objective=peak,
                       bound=peak if status == "optimal" else None if bound is None else min(peak, bound),
                       solve_time_s=time.perf_counter() - start, secondary=float(overloaded),
                       secondary_optimal=secondary_optimal, message=message)

    m = _Milp()
    placing = _Placing(m, [state], items, [0.0] * len(items), node_symmetry=False)
    for item in items:
        if not item.x:
            return result("infeasible", None, None, False,
                          f"task {item.task}: a part ({item.demand.cpu_milli} milli-cores, {item.demand.gpu_count} "
                          "GPU) fits no node now")
        m.row(list(item.x.values()), [1.0] * len(item.x), 1.0, 1.0)

    # ΔP_k (W) = Σ_parts x · (slope_k · cores + gslope_k · cards);  rise_i (K) = (D @ P0)_i + Σ_k D[i,k] · ΔP_k
    slope = room.added_power_w(1.0)  # W per busy core
    gslope = room.gpu_full_w - room.gpu_idle_w  # W per busy whole card
    d = room.d  # the (n, n) matrix once: the MILP's rows are dense in it (small rooms only)
    base_rise = d @ room.power(busy_milli / MILLI, state.busy_gpu_cards())
    terms: dict[int, tuple[list[int], list[float]]] = {}
    for item in items:
        r = item.demand
        for (_c, k), col in item.x.items():
            cols, vals = terms.setdefault(k, ([], []))
            cols.append(col)
            vals.append(slope[k] * r.cpu_milli / MILLI + gslope[k] * r.gpu_units)
    dp: dict[int, int] = {}
    for k, (cols, vals) in terms.items():
        dp[k] = m.var(0.0, 0.0, _INF, integer=False)
        m.row([dp[k], *cols], [1.0, *(-v for v in vals)], 0.0, 0.0)
    z = m.var(1.0, float(base_rise.max()), _INF, integer=False)  # the peak rise above supply, K
    for i in range(room.n):
        ks = [k for k in dp if d[i, k] > 0]
        if ks:
            m.row([z, *(dp[k] for k in ks)], [1.0, *(-d[i, k] for k in ks)], lower=float(base_rise[i]))

    # overload indicators: busy_after_k > ⌊0.8 · total_k⌋ (milli-cores) forces o_k = 1
    overload_cols: list[int] = []
    for k in range(state.n):
        on_k = [(col, float(it.demand.cpu_milli)) for it in items for (_c, kk), col in it.x.items()
                if kk == k and it.demand.cpu_milli]
        if busy_milli[k] > limit[k] or busy_milli[k] + sum(v for _, v in on_k) <= limit[k]:
            continue  # overloaded already, or never can be
        o = m.var(0.0)
        overload_cols.append(o)
        m.row([c for c, _ in on_k] + [o], [v for _, v in on_k] + [-float(t.cpu_milli[k] - limit[k])],
              upper=float(limit[k] - busy_milli[k]))

    h = m.highs(maximize=False)
    run = _run(h, time_limit_s - (time.perf_counter() - start), abs_gap=1e-7, rel_gap=1e-7)
    if run.status == "infeasible":
        return result("infeasible", None, None, False, "the parts cannot all be placed on the current free resources")
    # the coolest complete heuristic placement: the answer when the solver has nothing better at the time
    # limit, and a check of a proven optimum
    complete = [tuple(run) for run in heuristic_runs(state, tasks).values() if all(a is not None for a in run)]
    best = min(complete, key=evaluate) if complete else None
    if run.values is not None and best is not None:
        heuristic_peak, mine = evaluate(best)[0], evaluate(_by_task(items, placing.chosen(run.values), tasks))[0]
        if run.status == "optimal" and heuristic_peak < mine - 1e-6:
            raise RuntimeError(f"optimum: a heuristic placement ({heuristic_peak:.6f} °C) beat the proven optimum "
                               f"({mine:.6f} °C); the model is wrong, this is a bug")
        if run.status != "optimal" and heuristic_peak < mine:
            run = run._replace(values=None)
    if run.values is None:
        bound = None if run.bound is None else _peak_from_rise(room, run.bound)
        if best is None:
            return result(run.status, None, bound, False, f"HiGHS ended with {run.status} before finding a placement")
        return result("time_limit", [p for a in best for p in a], bound, False,
                      "time limit: the best heuristic placement and a lower bound")
    values, status = run.values, run.status
    rise_bound = run.bound if run.bound is not None else float(base_rise.max())
    secondary_optimal = status == "optimal" and not overload_cols
    if status == "optimal" and overload_cols:  # stage 2: hold the peak, the fewest overloaded servers
        zstar = _largest_rise_at_same_peak(room, float(values[z]))
        h.changeColBounds(z, float(base_rise.max()), zstar + 1e-6 + 1e-9 * abs(zstar))
        costs = np.zeros(len(m.cost))
        costs[overload_cols] = 1.0
        h.changeColsCost(len(costs), np.arange(len(costs), dtype=np.int32), costs)
        _warm_start(h, values)
        run2 = _run(h, max(time_limit_s - (time.perf_counter() - start), 0.5), abs_gap=0.99, rel_gap=0.0)
        if run2.values is not None:
            values = run2.values
        secondary_optimal = run2.status == "optimal"
    return result(status, placing.chosen(values), _peak_from_rise(room, rise_bound), secondary_optimal,
                  "" if status == "optimal" else "time limit: the best placement found and a lower bound")


# ---------------------------------------------------------------------------------------------------------------
# python -m hsched.optimum: time the exact solver against the heuristics on a synthetic GPU cluster


def synthetic_gpu_instance(nodes: int = 20, cards: int = 8, tasks: int = 60, seed: int = 0
                           ) -> tuple[ClusterState, list[TaskSpec]]:
    """An empty cluster of ``nodes`` × (64 cores, 256 GiB, ``cards`` × 40 GiB A100) and an openb-like task mix:
    55 % GPU-sharing tasks (one slice of 10-80 %), 30 % of 1/2/4 whole cards, 15 % of every card of a node;
    2-32 cores and 8-128 GiB each."""
    from hsched.domain.fleet import parse_fleet

    rng = np.random.default_rng(seed)
    data = {"version": 1, "name": "synthetic", "network_price_per_gb_ms": 0.0,
            "wan": {"vertices": [{"name": "s", "lat": 0.0, "lon": 0.0}], "scheduler_vertex": "s"},
            "datacenters": [{"name": "gpu", "vertex": "s", "prices": {"cpu_core_hour": 0.0, "memory_gib_hour": 0.0},
                             "layout": {"racks": 1, "servers_per_rack": nodes, "rows": 1},
                             "node_pools": [{"name": "a100", "count": nodes, "cpu_cores": 64, "memory_gib": 256,
                                             "gpus": {"count": cards, "model": "A100", "memory_gib": 40}}]}]}
    state = ClusterState(parse_fleet(data).datacenters[0])
    out = []
    for _ in range(tasks):
        kind = rng.random()
        if kind < 0.55:
            count, pct = 1, int(rng.choice([10, 20, 25, 30, 40, 50, 60, 70, 80]))
        elif kind < 0.85:
            count, pct = min(int(rng.choice([1, 2, 4])), cards), 100
        else:
            count, pct = cards, 100
        gmem = int(40 * 1024 * pct / 100 * rng.uniform(0.5, 1.0))
        out.append(TaskSpec(Resources(int(rng.integers(2, 33)) * MILLI, int(rng.integers(8, 129)) * 1024, 0, 0,
                                      count, pct, gmem), runtime_s=3600.0))
    return state, out


def main(argv: Sequence[str] | None = None) -> None:
    """Print max_deployed's status, bound and solve time next to the best heuristic on synthetic instances."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m hsched.optimum", description=main.__doc__)
    ap.add_argument("--nodes", type=int, default=20)
    ap.add_argument("--cards", type=int, default=8)
    ap.add_argument("--tasks", type=int, default=60)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--time-limit", type=float, default=10.0)
    args = ap.parse_args(argv)
    print(f"max_deployed on {args.nodes} nodes × {args.cards} cards, {args.tasks} tasks, time limit "
          f"{args.time_limit:g} s (HiGHS {highspy.Highs().version()}, 1 thread)")
    print("| seed | status | deployed | bound | solve s | best heuristic (given order) | its gap to the bound % |")
    print("|---:|---|---:|---:|---:|---|---:|")
    for seed in args.seeds:
        state, tasks = synthetic_gpu_instance(args.nodes, args.cards, args.tasks, seed)
        runs = heuristic_runs(state, tasks)
        name, run = max(((n, r) for n, r in runs.items() if "/" not in n), key=lambda nr: sum(map(bool, nr[1])))
        heuristic = sum(a is not None for a in run)
        t0 = time.perf_counter()
        r = max_deployed(state, tasks, time_limit_s=args.time_limit)
        elapsed = time.perf_counter() - t0
        print(f"| {seed} | {r.status} | {r.deployed} | {r.bound:g} | {elapsed:.2f} | {name}: {heuristic} | "
              f"{gap_percent(heuristic, r.bound or 0):.1f} |")


if __name__ == "__main__":
    main()
