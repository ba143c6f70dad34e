"""The allocation state of one data center: free resources per node and per GPU card, as NumPy arrays.

This is the fold target of a DC's ledger (hsched.state.ledger), the state the placer's policies read,
and the state the simulators step. `apply` and `release` keep the invariant that no free amount ever
goes below zero or above capacity: an allocation that would break it raises and changes nothing.

It also holds the execution clock's inputs as the ledger recorded them (`clocks`: when each allocated task
was placed and started, its runtime, class and tenant; `queued_ms`: when each deferred task was queued), so
a placer that takes a DC over resumes every task's clock from the fold alone — and what preemption and the
fair share need: `specs` (an offline task's spec, to requeue it when it is preempted), `ready_ms` (a requeued
victim waits out the preemption overhead before it is placed again), `arrival_ms` (and TaskClock.arrival_ms: a
requeued victim keeps its first arrival's place in line) and `tenant_usage` (what each tenant holds,
kept as allocations come and go, over `usage_vector`'s dimensions). And the nodes an operator cordoned
(`cordoned`, by node index: `feasible` leaves them out, so nothing new lands there; what runs there stays).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from hsched.domain.fleet import DataCenter, NodeTable
from hsched.domain.resources import Resources

# done events a fold remembers (ClusterState.finished): a gateway that stalled or died sends a Place again within
# seconds to minutes. A snapshot carries those of its last 10 minutes (hsched.state.ledger.SNAPSHOT_FINISHED_S)
FINISHED_MEMORY = 100_000


@dataclass(frozen=True, slots=True)
class GpuShare:
    card: int
    core_percent: int
    memory_mib: int


@dataclass(frozen=True, slots=True)
class Part:
    """One replica (or one subtask of a split replica) on one node."""

    replica: int
    part: int
    node: int
    cpu_milli: int
    memory_mib: int
    disk_mib: int
    bandwidth_mbps: int
    gpus: tuple[GpuShare, ...] = ()

    def to_json(self) -> list:
        return [self.replica, self.part, self.node, self.cpu_milli, self.memory_mib, self.disk_mib,
                self.bandwidth_mbps, [[g.card, g.core_percent, g.memory_mib] for g in self.gpus]]

    @staticmethod
    def from_json(v: list) -> Part:
        return Part(int(v[0]), int(v[1]), int(v[2]), int(v[3]), int(v[4]), int(v[5]), int(v[6]),
                    tuple(GpuShare(int(c), int(p), int(m)) for c, p, m in v[7]))


class TaskClock(NamedTuple):
    """What the execution clock needs of an allocated task, as its ledger events recorded it. (A tuple of
    scalars: the garbage collector stops tracking it, which matters with many thousands of tasks held.)"""

    placed_ms: int  # unix ms of the alloc; also tells two placements of one task apart (a requeued task)
    runtime_s: float = 0.0  # task time; 0 = runs until released
    priority_class: str = "offline"
    tenant: str = "default"
    started_ms: int = 0  # unix ms of the run event (the executor started it); 0 = not started yet
    delay_s: float = 0.0  # task seconds of extra start delay recorded at placement (a preemption's overhead)
    # unix ms it first joined this DC's deferred queue, when before placed_ms (0: placed on arrival): where a
    # preemption requeues it, so a victim keeps its place in line
    arrival_ms: int = 0

    def to_json(self) -> list:
        return [self.placed_ms, self.runtime_s, self.priority_class, self.tenant, self.started_ms, self.delay_s,
                *([self.arrival_ms] if self.arrival_ms else [])]

    @staticmethod
    def from_json(v: list) -> TaskClock:
        return TaskClock(int(v[0]), float(v[1]), str(v[2]), str(v[3]), int(v[4]), float(v[5]) if len(v) > 5 else 0.0,
                         int(v[6]) if len(v) > 6 else 0)

    @property
    def arrival(self) -> int:
        """Unix ms it arrived here: the queue position a preemption requeues it at."""
        return self.arrival_ms or self.placed_ms


def usage_of(parts: tuple[Part, ...]) -> tuple[int, int, int]:
    """What an allocation holds as (cpu milli, memory MiB, GPU core percent summed over cards) (fair share)."""
    cpu = memory = gpu = 0
    for p in parts:
        cpu, memory = cpu + p.cpu_milli, memory + p.memory_mib
        gpu += sum(g.core_percent for g in p.gpus)
    return cpu, memory, gpu


def usage_vector(parts: tuple[Part, ...]) -> np.ndarray:
    """`usage_of` as an array."""
    return np.array(usage_of(parts), dtype=np.float64)


class OverAllocation(RuntimeError):
    """An allocation that does not fit (a bug upstream, or a ledger from another fleet description)."""


_WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}  # a row of that many bools read as one integer


def count_per_row(flags: np.ndarray) -> np.ndarray:
    """True entries per row of a [n, cards] bool array ([n, cards, ...]: per row and trailing index, over the
    cards), as int16. Every GPU placement's filter (and FGD's card test per slice size) runs this: a row of
    1, 2, 4 or 8 cards (contiguous) is one machine word whose bytes are 0 or 1, so its population count is the
    count (~3 µs at 5,000 hosts); else a column loop (numpy's reductions along a short axis cost ~3-4× more)."""
    word = _WORDS.get(flags.shape[1]) if flags.ndim == 2 and flags.dtype == np.bool_ else None
    if word is not None and flags.flags.c_contiguous:
        return np.bitwise_count(flags.view(word)).reshape(-1).astype(np.int16)
    out = np.zeros(flags.shape[:1] + flags.shape[2:], dtype=np.int16)
    for j in range(flags.shape[1]):
        out += flags[:, j]
    return out


def row_sums(a: np.ndarray) -> np.ndarray:
    """Row sums of an integer [n, cards] array by a column loop (numpy's reduction along a short last axis is
    ~4× slower); the same integers as a.sum(axis=1)."""
    out = np.zeros(a.shape[0], dtype=a.dtype)
    for j in range(a.shape[1]):
        out += a[:, j]
    return out


def rows_of(a: np.ndarray, rows: slice | np.ndarray) -> np.ndarray:
    """a[rows]: a view for a slice; for an index array `take` along axis 0, the same rows ~6× faster than
    fancy indexing a 2-D array (a bounded candidate set's per-card rows, every learned decision)."""
    if isinstance(rows, slice) or (rows := np.asarray(rows)).dtype == bool:
        return a[rows]
    return a.take(rows, axis=0)


def small_row_sums(a: np.ndarray) -> np.ndarray:
    """`row_sums` for a few rows (a candidate set): numpy's own sum is faster there than the column loop;
    the same integers."""
    return a.sum(axis=1) if len(a) <= 512 else row_sums(a)


class ClusterState:
    def __init__(self, dc: DataCenter, table: NodeTable | None = None) -> None:
        self.dc = dc
        self.table = table if table is not None else dc.node_table()
        t = self.table
        self.free_cpu = t.cpu_milli.copy()
        self.free_memory = t.memory_mib.copy()
        self.free_disk = t.disk_mib.copy()
        self.free_bandwidth = t.bandwidth_mbps.copy()
        self.gpu_free_core = t.gpu_core_percent.copy()  # [n, max_gpus]
        self.gpu_free_memory = t.gpu_memory_mib.copy()
        self.allocations: dict[str, tuple[Part, ...]] = {}
        self.clocks: dict[str, TaskClock] = {}  # allocated tasks whose alloc event carried its clock data
        self.queued_ms: dict[str, int] = {}  # deferred tasks: unix ms they were queued (queue timeouts)
        # allocated tasks whose alloc event carried the spec (offline ones), as it carried it (task_to_dict): only a
        # preemption reads one, to requeue it, so no fold parses them
        self.specs: dict[str, dict] = {}
        self.ready_ms: dict[str, int] = {}  # deferred tasks not to be placed before this unix ms (requeued victims)
        # deferred tasks whose place in line is an earlier arrival than queued_ms (a requeued victim's first arrival)
        self.arrival_ms: dict[str, int] = {}
        self.tenant_usage: dict[str, np.ndarray] = {}  # per tenant, the usage_vector of its clocked allocations
        # tasks that ran to completion here (their done events, at most FINISHED_MEMORY, oldest first; a snapshot
        # carries the recent ones): a Place of one again is answered with how it ended, not run twice
        self.finished: dict[str, dict] = {}
        # nodes taken out of scheduling by an operator (cordon events): index -> {"reason", "at"}; `_open` is the
        # mask of the others (None while none is cordoned: the common case costs nothing)
        self.cordoned: dict[int, dict] = {}
        self._open: np.ndarray | None = None
        self._models = np.array(t.gpu_model)
        self._index: dict[str, int] | None = None

    # -- queries ---------------------------------------------------------------------------------------------

    @property
    def n(self) -> int:
        return len(self.table)

    def model_mask(self, gpu_models: tuple[str, ...]) -> np.ndarray | bool:
        """The nodes whose cards are one of `gpu_models` (True: any model allowed)."""
        return np.isin(self._models, list(gpu_models)) if gpu_models else True

    def feasible(self, demand: Resources, gpu_models: tuple[str, ...] = (), cordoned: bool = False) -> np.ndarray:
        """Nodes where `demand` (one part) fits right now; a GPU slice must fit on one card. Cordoned nodes only
        with `cordoned` (to tell why a task waits)."""
        # the same masks as (a >= x) & (b >= y) & …, combined in place (every decision filters every node)
        ok = self.free_cpu >= demand.cpu_milli
        ok &= self.free_memory >= demand.memory_mib
        ok &= self.free_disk >= demand.disk_mib
        ok &= self.free_bandwidth >= demand.bandwidth_mbps
        if demand.gpu_count:
            cards = self.gpu_free_core >= demand.gpu_core_percent
            cards &= self.gpu_free_memory >= demand.gpu_memory_mib
            ok &= count_per_row(cards) >= demand.gpu_count
            if gpu_models:
                ok &= self.model_mask(gpu_models)
        if self._open is not None and not cordoned:
            ok &= self._open
        return ok

    def free_totals(self) -> tuple[int, int, int, int]:
        """The free CPU, memory, disk and bandwidth summed over the nodes (`copies_within`'s first argument)."""
        return (int(self.free_cpu.sum()), int(self.free_memory.sum()), int(self.free_disk.sum()),
                int(self.free_bandwidth.sum()))

    def copies_within(self, totals: tuple[int, int, int, int], demand: Resources) -> int:
        """How many parts `demand` the free resources hold, summed over the nodes (`totals` = `free_totals()`)
        and, for a GPU part, the free cards one slice fits on: an upper bound of what fits one after another
        (it ignores that a part must fit on one node), for a count of one scalar division per resource."""
        needs = (demand.cpu_milli, demand.memory_mib, demand.disk_mib, demand.bandwidth_mbps)
        copies = min((free // need for free, need in zip(totals, needs, strict=True) if need > 0), default=1 << 20)
        if demand.gpu_count:
            cards = (self.gpu_free_core >= demand.gpu_core_percent) & (self.gpu_free_memory >= demand.gpu_memory_mib)
            copies = min(copies, int(cards.sum()) // demand.gpu_count)
        return int(copies)

    def could_ever_fit(self, demand: Resources, gpu_models: tuple[str, ...] = ()) -> np.ndarray:
        """Nodes where `demand` fits on an empty node (a structural check: deferring can help)."""
        t = self.table
        ok = ((t.cpu_milli >= demand.cpu_milli) & (t.memory_mib >= demand.memory_mib)
              & (t.disk_mib >= demand.disk_mib) & (t.bandwidth_mbps >= demand.bandwidth_mbps))
        if demand.gpu_count:
            cards = (t.gpu_core_percent >= demand.gpu_core_percent) & (t.gpu_memory_mib >= demand.gpu_memory_mib)
            ok &= (count_per_row(cards) >= demand.gpu_count) & self.model_mask(gpu_models)
        return ok

    def replicas_it_could_hold(self, demand: Resources, gpu_models: tuple[str, ...] = ()) -> int:
        """At most how many replicas of one-part `demand` the EMPTY DC could hold at once (a structural bound: each
        node by its CPU, memory, disk, bandwidth and, for a GPU demand, its cards of an allowed model — a card
        takes min(100 / core %, its memory / the slice's) of them, a replica needs gpu_count different cards).
        A task asking for more replicas than this waits for ever: refused instead."""
        t = self.table
        per_node = np.full(self.n, np.iinfo(np.int64).max, dtype=np.int64)
        for need, cap in ((demand.cpu_milli, t.cpu_milli), (demand.memory_mib, t.memory_mib),
                          (demand.disk_mib, t.disk_mib), (demand.bandwidth_mbps, t.bandwidth_mbps)):
            if need:
                per_node = np.minimum(per_node, cap // need)
        if demand.gpu_count:
            shares = t.gpu_core_percent // max(demand.gpu_core_percent, 1)
            if demand.gpu_memory_mib:
                shares = np.minimum(shares, t.gpu_memory_mib // demand.gpu_memory_mib)
            cards_ok = count_per_row(shares > 0) >= demand.gpu_count
            gpu_units = np.where(cards_ok & self.model_mask(gpu_models), shares.sum(axis=1) // demand.gpu_count, 0)
            per_node = np.minimum(per_node, gpu_units)
        return int(np.minimum(per_node, np.iinfo(np.int32).max).sum())

    def choose_cards(self, node: int, demand: Resources) -> tuple[GpuShare, ...]:
        """Pick the cards for a GPU demand on `node`: the fullest cards that still fit (binpack), which
        keeps whole cards free for whole-card tasks (less GPU fragmentation)."""
        if not demand.gpu_count:
            return ()
        core, mem = self.gpu_free_core[node], self.gpu_free_memory[node]
        fits = np.flatnonzero((core >= demand.gpu_core_percent) & (mem >= demand.gpu_memory_mib))
        if len(fits) < demand.gpu_count:
            raise OverAllocation(f"node {node} has {len(fits)} cards that fit, {demand.gpu_count} needed")
        order = fits[np.lexsort((fits, mem[fits], core[fits]))][: demand.gpu_count]
        return tuple(GpuShare(int(c), demand.gpu_core_percent, demand.gpu_memory_mib) for c in sorted(order))

    def node_index(self, name: str) -> int | None:
        """The index of the node called `name` (None: no such node)."""
        if self._index is None:
            self._index = {n: i for i, n in enumerate(self.table.names)}
        return self._index.get(name)

    def cordon(self, node: int, reason: str = "", at_ms: int = 0) -> None:
        """Take `node` out of scheduling (`feasible` leaves it out); its tasks stay. Cordoning it again updates
        the reason."""
        self.cordoned[node] = {"reason": reason, "at": at_ms}
        if self._open is None:
            self._open = np.ones(self.n, dtype=bool)
        self._open[node] = False

    def uncordon(self, node: int) -> None:
        if self.cordoned.pop(node, None) is not None:
            if self.cordoned:
                self._open[node] = True  # type: ignore[index]
            else:
                self._open = None

    def cordoned_with_room(self, demand: Resources, gpu_models: tuple[str, ...] = ()) -> list[int]:
        """The cordoned nodes where `demand` would fit now (why a task waits: only they have room)."""
        if not self.cordoned:
            return []
        ok = self.feasible(demand, gpu_models, cordoned=True)
        return [i for i in self.cordoned if ok[i]]

    def tasks_per_node(self) -> np.ndarray:
        """How many tasks hold resources on each node (a task of several parts on one node counts once)."""
        nodes = [n for parts in self.allocations.values() for n in {p.node for p in parts}]
        return np.bincount(np.asarray(nodes, dtype=np.int64), minlength=self.n)

    def schedulable(self) -> np.ndarray:
        """The mask of the nodes not cordoned."""
        return np.ones(self.n, dtype=bool) if self._open is None else self._open.copy()

    def capacity(self) -> dict[str, int]:
        """The room's total of each resource (NodeTable.totals)."""
        return self.table.totals

    def utilisation(self) -> dict[str, float]:
        cap = self.capacity()

        def used(free: np.ndarray, total: int) -> float:
            return float(1 - free.sum() / total) if total else 0.0

        return {"cpu": used(self.free_cpu, cap["cpu"]), "memory": used(self.free_memory, cap["memory"]),
                "gpu_core": used(self.gpu_free_core, cap["gpu_core"]),
                "gpu_memory": used(self.gpu_free_memory, cap["gpu_memory"])}

    def busy_cpu(self) -> np.ndarray:
        return self.table.cpu_milli - self.free_cpu

    def busy_gpu_percent(self) -> np.ndarray:
        """Allocated GPU core percent per node, summed over its cards (100 = one whole card)."""
        # the thermal guard's, every batch: capacity per node (summed once per table) minus the free sums
        return self.table.gpu_core_per_node - row_sums(self.gpu_free_core)

    def busy_gpu_cards(self) -> np.ndarray:
        """Busy GPU per node in whole-card equivalents."""
        return self.busy_gpu_percent() / 100.0

    # -- mutations -------------------------------------------------------------------------------------------

    def _delta(self, parts: tuple[Part, ...], sign: int) -> None:
        for p in parts:
            self.free_cpu[p.node] += sign * p.cpu_milli
            self.free_memory[p.node] += sign * p.memory_mib
            self.free_disk[p.node] += sign * p.disk_mib
            self.free_bandwidth[p.node] += sign * p.bandwidth_mbps
            for g in p.gpus:
                self.gpu_free_core[p.node, g.card] += sign * g.core_percent
                self.gpu_free_memory[p.node, g.card] += sign * g.memory_mib

    def _within_bounds(self, parts: tuple[Part, ...]) -> bool:
        """0 <= free <= capacity on every node and card the parts touch (scalar checks: parts are few)."""
        t = self.table
        for p in parts:
            n = p.node
            if not (0 <= self.free_cpu[n] <= t.cpu_milli[n] and 0 <= self.free_memory[n] <= t.memory_mib[n]
                    and 0 <= self.free_disk[n] <= t.disk_mib[n]
                    and 0 <= self.free_bandwidth[n] <= t.bandwidth_mbps[n]):
                return False
            for g in p.gpus:
                if not (0 <= self.gpu_free_core[n, g.card] <= t.gpu_core_percent[n, g.card]
                        and 0 <= self.gpu_free_memory[n, g.card] <= t.gpu_memory_mib[n, g.card]):
                    return False
        return True

    def apply(self, task_id: str, parts: tuple[Part, ...], clock: TaskClock | None = None,
              spec: dict | None = None) -> None:
        """Allocate `parts` to `task_id`; `clock` (None: a ledger from before the execution clock, or a
        simulator's own bookkeeping) and `spec` are kept while it holds them."""
        if task_id in self.allocations:
            raise OverAllocation(f"task {task_id} already holds an allocation here")
        if any(not 0 <= p.node < self.n for p in parts):
            raise OverAllocation(f"task {task_id}: node index out of range")
        if any(g.card >= self.gpu_free_core.shape[1] or g.card < 0 for p in parts for g in p.gpus):
            raise OverAllocation(f"task {task_id}: GPU card index out of range")
        if any(min(p.cpu_milli, p.memory_mib, p.disk_mib, p.bandwidth_mbps) < 0
               or any(g.core_percent < 0 or g.memory_mib < 0 for g in p.gpus) for p in parts):
            raise OverAllocation(f"task {task_id}: negative amounts (a later release would free more than capacity)")
        self._delta(parts, -1)
        if not self._within_bounds(parts):
            self._delta(parts, +1)
            raise OverAllocation(f"task {task_id} does not fit: it would over-allocate a node or a card")
        self.allocations[task_id] = parts
        if clock is not None:
            self.clocks[task_id] = clock
            self._use(clock.tenant, parts, +1)
        if spec is not None:
            self.specs[task_id] = spec

    def _use(self, tenant: str, parts: tuple[Part, ...], sign: int) -> None:
        used = self.tenant_usage.get(tenant, 0.0) + sign * usage_vector(parts)  # a new array: marks may share the old
        if sign < 0 and not used.any():
            self.tenant_usage.pop(tenant, None)
        else:
            self.tenant_usage[tenant] = used

    def start(self, task_id: str, at_ms: int) -> None:
        """The executor started `task_id` at `at_ms` (a run event); ignored for a task not held or unclocked."""
        clock = self.clocks.get(task_id)
        if clock is not None and task_id in self.allocations:
            self.clocks[task_id] = clock._replace(started_ms=at_ms)

    def note_finished(self, task_id: str, done: dict) -> None:
        """Remember that `task_id` ran to completion (its done event: ok, at, reason)."""
        self.finished.pop(task_id, None)
        self.finished[task_id] = done
        if len(self.finished) > FINISHED_MEMORY:
            del self.finished[next(iter(self.finished))]

    def release(self, task_id: str) -> tuple[Part, ...] | None:
        parts = self.allocations.pop(task_id, None)
        clock = self.clocks.pop(task_id, None)
        self.specs.pop(task_id, None)
        if parts is not None:
            self._delta(parts, +1)
            if clock is not None:
                self._use(clock.tenant, parts, -1)
        return parts

    def snapshot(self) -> tuple[np.ndarray, ...]:
        """The free arrays, for comparing two states (e.g. a rebuilt placer against the original)."""
        return (self.free_cpu.copy(), self.free_memory.copy(), self.free_disk.copy(), self.free_bandwidth.copy(),
                self.gpu_free_core.copy(), self.gpu_free_memory.copy())
