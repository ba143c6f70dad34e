"""The placer's engine for one data center: decisions, deferred queue, ledger, thermal guard.

Place and Release calls are queued and handled in batches by one task (group commit): the batch is
decided in memory in arrival order — each decision sees the ones before it — then checked once with
the thermal model and written to the ledger in one fenced append, and only then answered. Under load
this amortises the thermal check and the Redis write over many tasks; at low load a batch is a
single call. If the batch as a whole would push an inlet past the redline, it is undone and replayed
one call at a time, each checked on its own.

Batches are bounded by time as well as by count (MAX_BATCH): deciding in memory does not yield the event loop,
so a batch stops taking ops once its decisions have used `batch_budget_s` (at least one op is decided); the
ops it did not reach keep their order and open the next batch, after the loop has run once. The arithmetic:
the lease is renewed by a thread (hsched.state.lease) that needs only the GIL (CPython hands it over every
5 ms), but that thread lets the lease lapse when the loop has not run for `max_loop_stall_s` (a wedged
leader), and health probes, summary heartbeats and calls are all served by the loop. The default budget,
BATCH_BUDGET_SHARE (0.1) × min(lease, max_loop_stall_s) — 0.3 s with the defaults (3 s lease, 30 s) — keeps
a batch's hold on the loop (the budget, plus the decision that crosses it, the thermal check and, after a
thermal refusal, the re-decision of the batch's ops one by one, which yields between ops) about ten times
below the shortest of them, whatever a decision costs: 256 decisions of a policy at 10 ms (FGD or Double DQN
from 2,000 nodes) are 2.6 s, of EADE-DDPG at 5,000 hosts (0.55 s) 140 s, past the 30 s watchdog. The price
is one thermal check and one append per budget's worth of decisions: nothing for bestfit (some 250 decisions
with the guard at 5,000 servers fit in 0.3 s), about the check's cost over the budget for a slow policy
(docs/operations.md has the figures).

The thermal guard is normally the DC's room model evaluated in-process over this engine's own state
(hsched.thermal.guard.RoomGuard): the placer is the single writer of the ledger, so its state is the truth.

Lease (see hsched.state.lease): the engine serves only while it holds the DC's lease with a fencing token
and has the ledger folded under that token. A lost lease (a renewal refused or impossible for a lease
period, or an append fenced out) stops it at once: calls are refused (Fenced → UNAVAILABLE), summaries
stop, and `_keep_lease` keeps trying to take the lease again. When no other placer holds it, it takes a NEW
token (fencing out anything it had in flight), folds the ledger afresh — another placer may have written
meanwhile — and serves again. A placer started while another holds the lease runs the same loop as a
standby and takes over when the holder's lease lapses.

Priorities (issue 15, paper 001's co-location): an online task that finds no room (it would be refused or
deferred) evicts offline tasks — PLACED or RUNNING, never online ones — from one node, the set that loses the
least work (hsched.policies.preemption), checked by the same planner, masks and thermal headroom as any
placement; in the batch's one append: a `preempt` event per victim, the online task's alloc (which starts after
the executor's preemption overhead, `delay_s`) and a `defer` requeueing each victim with its spec (not placed
again before that overhead has passed: "after"). The deferred queue is served online first, then the tenant
furthest below its deserved share (Volcano proportion, hsched.policies.fairshare), then by priority and
arrival (a requeued victim keeps its first arrival's place: the defer's "arrival"). An online task that waits
in the queue (no eviction could make room when it came) and still does not fit when the queue is served evicts
the same way from there, in the same append as whatever freed the room: the state moved while it waited (tasks
finished, offline tasks took part of the room, the heat changed). Only
freed resources can turn an impossible eviction into a possible one (a newly placed offline task gives back
just its own room), so a waiting online task is searched for again only after something was freed since its
last search that found nothing (`_freed_count`), at most `queue_eviction_searches` of them per pass (the rest
by a further pass right after), and one search per shape of task per pass. Before any search (at arrival too),
a cheap count per node (`_one_node_could_let_in`) rules out tasks no one-node eviction could hold; a pass on a
conservative thermal headroom leaves its searches to the batch's re-decision on exact numbers. A placer that
takes the lease serves its queue once (its predecessor may have died before a pass).

Slice types (issue 15, paper 001 §2.1): with `slices`, every fold of the ledger is a SlicedState — the nodes cut
into container slices — and the same planner gives each part one free slice of the smallest type that covers it
(hsched.engine.slices); nothing else here changes.

The gRPC service (services/placer) only translates protobuf to these calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import redis.asyncio as aioredis
from opentelemetry import context as otel_context
from opentelemetry import trace
from redis import Redis as SyncRedis

from hsched.cancel import cancel_and_wait
from hsched.costs.stranding import free_of
from hsched.domain.cluster import ClusterState, Part, usage_vector
from hsched.domain.errors import ValidationError
from hsched.domain.fleet import DataCenter
from hsched.domain.resources import Resources
from hsched.domain.task import ONLINE, TaskSpec, task_to_dict
from hsched.engine.executor import Executor, Report
from hsched.engine.slices import SliceCatalog, SlicedState, state_factory
from hsched.envs.dag import DagPolicy
from hsched.policies.base import NodePolicy
from hsched.policies.dagqueue import MAX_BAND_STAGES, QueuedStage, choose_stage, job_of_task
from hsched.policies.fairshare import (
    FairQueue,
    TenantWeights,
    Waiting,
    capacity_vector,
    demand_vector,
)
from hsched.policies.heuristics import FirstFit
from hsched.policies.placement import Outcome, Plan, part_power_w, plan, split_task
from hsched.policies.preemption import Eviction, candidate, choose_victims, lost_work
from hsched.state.keys import Keys
from hsched.state.lease import LeaseKeeper
from hsched.state.ledger import (
    FREEING,
    INDETERMINATE,
    UNQUEUING,
    Fenced,
    LayoutConflict,
    LeaseHeld,
    Ledger,
    Retention,
    fold_event,
    node_layout,
    recorded_layout,
    replay,
    snapshot_and_trim,
)
from hsched.telemetry.tracing import traceparent
from hsched.thermal.guard import LoadDelta, RoomGuard, ThermalCheck
from hsched.thermal.room import RoomModel

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

MAX_BATCH = 256
# A batch stops taking ops once its decisions have used this share of min(lease, max_loop_stall_s) (module doc)
BATCH_BUDGET_SHARE = 0.1
SUMMARY_HEARTBEAT_S = 5.0  # a serving placer publishes its summary at least this often (readers judge staleness)
# a release's pass over the queue: at most this many placement decisions, and this many waiting tasks looked at. A
# task of a shape (and class) that found no room earlier in the pass is passed over without a decision — the pass
# only fills the DC, so it would not fit either — else 64 waiting T4 tasks kept a freed A100 from any task behind
MAX_QUEUE_TRIES_PER_RELEASE = 64
MAX_QUEUE_SCAN_PER_RELEASE = 4096
QUEUE_EVICTION_SEARCHES = 4  # eviction searches for waiting online tasks per pass of the queue (the rest: next pass)
REPORT_RETRY_S = 0.5  # a lifecycle event that could not be written is tried again after this


class ThermalGuard(Protocol):
    """What the placer asks the thermal model (RoomGuard in-process, or the thermal service over gRPC)."""

    async def headroom(self, min_ledger_id: str) -> np.ndarray:
        """Per node, the extra IT power (W) it can take alone before any inlet passes the redline."""
        ...

    async def check(self, deltas: list[LoadDelta], min_ledger_id: str) -> ThermalCheck:
        """The effect of a load change; ok is False if it would push an inlet past the redline. Also
        returns the headroom after the change, which the next batch starts from (no extra call)."""
        ...

    async def now(self, min_ledger_id: str) -> ThermalCheck:
        """The room now (before = after), for views: no headroom is computed."""
        ...


@dataclass
class PlaceResult:
    outcome: str  # placed | deferred | no_room | unschedulable | expired (the caller's deadline had passed) | finished
    parts: tuple[Part, ...] = ()
    alternatives: tuple[tuple[int, float], ...] = ()
    reason: str = ""
    notes: list[str] = field(default_factory=list)
    ledger_id: str = ""
    thermal: ThermalCheck | None = None
    thermal_limited: bool = False
    finished: dict | None = None  # outcome finished: how it ended (ok, at, reason), ClusterState.finished


@dataclass
class ReleaseResult:
    released: bool
    freed: Resources = field(default_factory=Resources)
    placed_from_queue: list[tuple[str, tuple[Part, ...]]] = field(default_factory=list)
    thermal_limited: bool = False  # a waiting online task is to be searched for on exact headroom (_decide_batch)


@dataclass
class CordonResult(ReleaseResult):
    """An operator's cordon or uncordon: the nodes whose state changed, the offline tasks evicted (preempted and
    requeued: `evict`) and, per node left cordoned, the tasks still on it (online ones run to completion)."""
    changed: list[str] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)
    remaining: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class NodeChange:
    nodes: tuple[str, ...]
    schedulable: bool
    reason: str = ""
    evict: bool = False  # cordon only: preempt and requeue the nodes' offline tasks (a drain)


@dataclass
class _Op:
    kind: str  # place | release | run | done | expire (reports of the execution clock) | drain (the queue) | cordon
    task_id: str
    spec: TaskSpec | None = None
    allow_defer: bool = False
    not_after: float | None = None  # Unix time after which the caller has given up (place only)
    preempt: bool = True  # an online task that does not fit may evict offline ones (place only)
    future: asyncio.Future = None  # type: ignore[assignment]
    result: PlaceResult | ReleaseResult | None = None
    events: list[dict] = field(default_factory=list)
    trace_context: otel_context.Context | None = None
    report: Report | None = None  # run | done | expire
    searched: dict[str, int] = field(default_factory=dict)  # waiting online tasks' failed evictions (_freed_count)
    searches_left_over: bool = False  # a queue pass had more waiting online tasks to search than its budget
    change: NodeChange | None = None  # cordon


class _QueueSave:
    """The deferred queue's (task, spec) items as an undo scope opened on them; None: unchanged since."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: list[tuple[str, TaskSpec]] | None = None


def _now_ms() -> int:
    return int(time.time() * 1000)


def deltas_of(parts: tuple[Part, ...], sign: int = 1) -> list[LoadDelta]:
    return [LoadDelta(p.node, sign * p.cpu_milli, sign * sum(g.core_percent for g in p.gpus) / 100.0) for p in parts]


def freed_total(parts: tuple[Part, ...]) -> Resources:
    return Resources(sum(p.cpu_milli for p in parts), sum(p.memory_mib for p in parts), sum(p.disk_mib for p in parts),
                     sum(p.bandwidth_mbps for p in parts), sum(len(p.gpus) for p in parts))


class PlacerEngine:
    def __init__(self, dc: DataCenter, redis: aioredis.Redis, keys: Keys, policy: NodePolicy, owner: str,
                 thermal: ThermalGuard | RoomModel | None = None, lease_ms: int = 3000, fenced_exit_s: float = 0.0,
                 max_loop_stall_s: float = 30.0, lease_client: SyncRedis | None = None,
                 retention: Retention | None = None, executor: Executor | None = None,
                 tenant_weights: TenantWeights | None = None, dag_policy: DagPolicy | None = None,
                 slices: SliceCatalog | None = None, batch_budget_s: float | None = None) -> None:
        """`thermal`: the DC's room model (checked in-process over this engine's state), another ThermalGuard,
        or None for no thermal guard. `fenced_exit_s` (0 = never): after losing its lease, give up (`gave_up` is
        set) if it cannot take it back for that long, so a supervisor restarts the process. `lease_client`: a
        synchronous client for the renewal thread (hsched.state.lease; default: one like `redis`). `executor`:
        runs the placed tasks and reports their start and end (hsched.engine.executor); None = no execution
        clock: tasks hold their resources until released, and queue timeouts pass in wall time.
        `tenant_weights`: the tenants' weights in the deferred queue's fair share (default: equal).
        `dag_policy`: which DAG job's stage the queue serves first within a class/tenant/priority band
        (hsched.policies.dagqueue; None = arrival order). `slices`: pre-partition every node into slices of
        these types and place each part in one (hsched.engine.slices; None = no slices). `batch_budget_s`: the
        decision time after which a batch takes no more ops (default: BATCH_BUDGET_SHARE of the shorter of the
        lease and `max_loop_stall_s`; see the module docstring)."""
        self.dc = dc
        self.redis = redis
        self.keys = keys
        self.policy = policy
        self._new_state = state_factory(slices)  # every fold of the ledger is one of these
        self.state = self._new_state(dc)
        self.thermal = RoomGuard(thermal, self.state) if isinstance(thermal, RoomModel) else thermal
        # a published room model to swap into the in-process guard between batches (set_room_model)
        self._next_room: tuple[RoomModel, int, str] | None = None
        self.queue: OrderedDict[str, TaskSpec] = OrderedDict()
        self.ledger = Ledger(redis, keys, dc.name, owner, lease_ms=lease_ms)
        self.last_id = "0-0"
        self.last_thermal: ThermalCheck | None = None
        # Headroom for the state at self.last_id: exact (RoomGuard's checks always are), or a conservative bound
        # (after frees only, which only add headroom), refreshed before a thermal refusal.
        self._headroom: np.ndarray | None = None
        self._headroom_exact = False
        # lease: `holding` = the lease is ours and self.state is the ledger's fold under self.ledger.token
        self.holding = False
        self.held_before = False
        self.holder: str | None = None  # the lease's owner as last seen while not holding it
        self.lost_reason = ""
        self.lost_at: float | None = None  # monotonic time this placer lost the lease it held (None: holds it)
        self.fenced_exit_s = fenced_exit_s
        self.max_loop_stall_s = max_loop_stall_s
        if batch_budget_s is None:
            batch_budget_s = BATCH_BUDGET_SHARE * min(lease_ms / 1000, max_loop_stall_s)
        if not batch_budget_s > 0:
            raise ValueError(f"batch_budget_s must be > 0, got {batch_budget_s}")
        self.batch_budget_s = batch_budget_s
        self.gave_up = asyncio.Event()  # set after fenced_exit_s without the lease
        self._keeper: LeaseKeeper | None = None
        self._lease_client = lease_client
        self._lost = asyncio.Event()  # set when `holding` turns False; _keep_lease steps down and re-acquires
        self._writing = asyncio.Lock()  # held by a batch in flight, and by a take-over (never both)
        self._watchers: list[Callable[[bool], Awaitable[None]]] = []
        self._ops: asyncio.Queue[_Op] = asyncio.Queue()
        self._carried: deque[_Op] = deque()  # ops a batch took but left undecided (its budget ran out): next first
        self.batches_total = 0  # batches decided since this engine started (bench/engine_cpu.py: ops per batch)
        self._tasks: list[asyncio.Task] = []
        self._dirty = asyncio.Event()
        self.retention = retention or Retention()
        self._since_snapshot = 0  # ledger entries appended since the last snapshot
        self._held_back = False  # the last trim kept entries younger than the margin
        self._snapshot_due = asyncio.Event()
        self.executor = executor
        if executor is not None:
            executor.attach(self._on_report)
        self._expiries: dict[str, asyncio.TimerHandle] = {}  # deferred tasks with a queue timeout
        self._closing = False
        self.tenant_weights = tenant_weights or TenantWeights()
        self.dag_policy = dag_policy
        self.dag_decisions = 0  # times the DAG policy chose among two or more stages
        self._capacity = capacity_vector(self.state.table)
        self._capacity_t = tuple(float(c) for c in self._capacity)
        self._probe = FirstFit()  # "would it fit?" for preemption: any feasible placement will do
        self._ready_timers: dict[int, asyncio.TimerHandle] = {}  # unix ms -> a drain when requeued victims are ready
        self.preemptions_total = 0  # victims evicted (written to the ledger) since this engine started
        self._refold_due = False  # set by a failed append of lifecycle events that may have landed
        self._queue_saves: list[_QueueSave] = []  # open undo scopes (_queue_saved)
        # waiting online tasks evict too (module docstring): how many freeing events this engine has folded, and
        # per waiting online task that count at its last eviction search that found nothing (written batches only)
        self.queue_eviction_searches = QUEUE_EVICTION_SEARCHES
        self._freed_count = 0
        self._eviction_searched: dict[str, int] = {}
        self._state_version = 0  # bumped by every change of self.state (a cache key)
        self._offline_cache: tuple[int, tuple[list[str], np.ndarray | None]] | None = None
        self.queue_eviction_searches_total = 0  # searches done for waiting online tasks (bench/preempt_cpu.py)

    @property
    def fenced(self) -> bool:
        """Not serving: the lease is lost (or never was taken, as a standby)."""
        return not self.holding

    @property
    def _poll_s(self) -> float:
        return max(0.05, self.ledger.lease_ms / 4000)

    # -- lifecycle -------------------------------------------------------------------------------------------

    async def start(self, wait_for_lease_s: float = 10.0, standby: bool = False) -> None:
        """Take the DC's lease, fold its ledger and serve. If another placer holds the lease: with `standby`,
        run anyway without serving and take over once that lease lapses; without, wait up to
        `wait_for_lease_s` for it to lapse, then raise LeaseHeld."""
        loop = asyncio.get_running_loop()
        self._keeper = LeaseKeeper(self.ledger, loop, self._lease_lost, self.max_loop_stall_s, self._lease_client)
        deadline = loop.time() + wait_for_lease_s
        try:
            while not await self._take_over():
                if standby:
                    log.warning("placer %s: standby, the lease is held by %s", self.dc.name, self.holder)
                    self._lost.set()  # _keep_lease takes over when the holder's lease lapses
                    break
                if loop.time() >= deadline:
                    raise LeaseHeld(f"data center {self.dc.name} is owned by placer {self.holder!r}; "
                                    f"it lapses {self.ledger.lease_ms} ms after that placer stops")
                await asyncio.sleep(self._poll_s)
        except BaseException:
            self._keeper.close()
            raise
        self._tasks = [asyncio.create_task(self._run(), name=f"placer-{self.dc.name}"),
                       asyncio.create_task(self._keep_lease(), name=f"lease-{self.dc.name}"),
                       asyncio.create_task(self._publish_summaries(), name=f"summary-{self.dc.name}"),
                       asyncio.create_task(self._retain(), name=f"retain-{self.dc.name}")]

    async def stop(self) -> None:
        self._closing = True
        self._stop_clocks()
        await cancel_and_wait(self._tasks)
        if self._keeper:
            await asyncio.to_thread(self._keeper.close)
        if self.holding:
            self.holding = False
            try:
                await self.ledger.release_lease()
            except Exception as exc:  # noqa: BLE001 - Redis away (or just back, the pooled connection stale)
                log.warning("placer %s: cannot give its lease up (%s: %s); it lapses by itself", self.dc.name,
                            type(exc).__name__, exc)

    def add_serving_watcher(self, watcher: Callable[[bool], Awaitable[None]]) -> None:
        """`watcher(serving)` is awaited whenever the engine starts or stops serving (health status)."""
        self._watchers.append(watcher)

    def unavailable_reason(self) -> str:
        """Why calls are refused now (for UNAVAILABLE)."""
        if self.holder and self.holder != self.ledger.owner:
            lost = f" (this placer lost its lease: {self.lost_reason})" if self.held_before else ""
            return f"standby for {self.dc.name}, holder is {self.holder}{lost}"
        if self.held_before:
            return f"placer for {self.dc.name} lost its lease ({self.lost_reason}); re-acquiring it"
        return f"placer for {self.dc.name} does not hold the lease yet"

    # -- lease -----------------------------------------------------------------------------------------------

    def _lease_lost(self, token: int, reason: str) -> None:
        """(on the loop) The lease taken with `token` is gone: stop serving at once."""
        if token != self.ledger.token or not self.holding:
            return
        self.holding, self.lost_reason, self.lost_at = False, reason, time.monotonic()
        self._stop_clocks()  # what they would report is the next holder's to write
        self._lost.set()

    async def _take_over(self) -> bool:
        """If no other placer holds the lease: take it with a new fencing token, fold the ledger into a fresh
        state and serve. False (and `holder` set) if another placer holds it."""
        assert self._keeper is not None
        async with self._writing:  # no batch in flight: nothing of ours is appended under the old token any more
            token = await self.ledger.try_acquire()
            if token is None:
                self.holder = await self.ledger.holder()
                return False
            self._keeper.hold(token)  # renewed while folding: a long ledger can take longer than a lease
            if self.ledger.pending_undo:  # cancellations owed for appends of unknown outcome: into the fold too
                await self.ledger.settle()
            state, queue = self._new_state(self.dc, self.state.table), OrderedDict()
            try:
                last_id = await replay(self.redis, self.ledger.stream, state, queue)
            except LayoutConflict:  # this fleet file cannot serve the ledger: leave the DC to one that can
                self._keeper.drop()
                await self.ledger.release_lease()
                raise
            if self._keeper.token != token:  # lost again while folding; _keep_lease tries again
                return False
            if await recorded_layout(self.redis, self.ledger.stream) != node_layout(state.table):
                # before any append: the entries after a snapshot are read in its node layout (a fleet change,
                # carried over by the fold above, or a ledger that has none recorded yet)
                await snapshot_and_trim(self.ledger, state, queue, last_id, self.retention.trim_margin_s)
            if self._keeper.token != token:  # lost during the awaits above: its report found nothing held to stop
                return False  # (no await from here to `holding`: a later loss is reported once serving)
            self._adopt(state, queue, last_id)
            self._refold_due = False
            self.holding, self.held_before, self.holder, self.lost_at = True, True, self.ledger.owner, None
            self._resume_clocks()
            if queue:  # serve it once: a pass the previous holder had not run yet (e.g. a waiting online task's eviction)
                self._internal(_Op("drain", ""))
        log.info("placer %s: token %s, rebuilt %d allocations and %d deferred tasks from the ledger up to %s",
                 self.dc.name, token, len(state.allocations), len(queue), last_id)
        self._dirty.set()
        return True

    def _adopt(self, state: ClusterState, queue: OrderedDict[str, TaskSpec], last_id: str) -> None:
        """Serve from a fresh fold of the ledger."""
        self.state, self.queue, self.last_id = state, queue, last_id
        self._state_version += 1
        self._eviction_searched.clear()  # a new fold: every waiting online task is searched for once more
        if isinstance(self.thermal, RoomGuard):  # its cached exact headroom describes the old state
            self.thermal = RoomGuard(self.thermal.room, state, self.thermal.version)
        self._headroom, self._headroom_exact, self.last_thermal = None, False, None

    async def _refold(self) -> None:
        """After an append of lifecycle events whose outcome was unknown: memory becomes the ledger's fold
        again (those events may have landed), so a retry never writes a completion twice."""
        await self.ledger.settle()
        state, queue = self._new_state(self.dc, self.state.table), OrderedDict()
        last_id = await replay(self.redis, self.ledger.stream, state, queue)
        self._adopt(state, queue, last_id)
        self._refold_due = False
        self._resume_clocks()
        if self.queue:  # a completion that landed may have freed room its cancelled drain no longer gives
            self._internal(_Op("drain", ""))
        log.info("placer %s: refolded the ledger up to %s after an append of unknown outcome", self.dc.name,
                 last_id)

    async def _keep_lease(self) -> None:
        """Step down when the lease is lost; take it back (or over, as a standby) when nobody else holds it."""
        assert self._keeper is not None
        while True:
            await self._lost.wait()
            self._lost.clear()
            if self.holding:
                continue
            self._keeper.drop()
            if self.held_before:
                log.error("placer %s stopped serving: %s", self.dc.name, self.unavailable_reason())
            await self._notify(False)
            failing = False
            while True:
                try:
                    if await self._take_over():
                        break
                    failing = False
                except Exception as exc:  # noqa: BLE001 - Redis away: keep trying, the lease is not ours meanwhile
                    if not failing:
                        log.warning("placer %s: cannot take the lease yet (%s); retrying", self.dc.name, exc)
                    failing = True
                if self.fenced_exit_s and self.lost_at is not None \
                        and time.monotonic() - self.lost_at > self.fenced_exit_s:
                    self.gave_up.set()
                    return
                await asyncio.sleep(self._poll_s)
            log.warning("placer %s serving with fencing token %s", self.dc.name, self.ledger.token)
            await self._notify(True)

    async def _notify(self, serving: bool) -> None:
        for watcher in self._watchers:
            try:
                await watcher(serving)
            except Exception:  # a failing watcher must not stop the lease loop
                log.exception("placer %s: serving watcher failed", self.dc.name)

    # -- API -------------------------------------------------------------------------------------------------

    async def place(self, task_id: str, spec: TaskSpec, allow_defer: bool = True,
                    not_after: float | None = None, preempt: bool = True) -> PlaceResult:
        """Place (or queue) `task_id`; nothing is committed for it once Unix time `not_after` has passed: a
        caller that gave up may have placed the task elsewhere (outcome "expired"). `preempt=False`: an online
        task that does not fit gets NO_ROOM (or is queued) without evicting anything."""
        return await self._submit(_Op("place", task_id, spec, allow_defer, not_after,  # type: ignore[return-value]
                                      preempt=preempt))

    async def release(self, task_id: str) -> ReleaseResult:
        return await self._submit(_Op("release", task_id))  # type: ignore[return-value]

    async def set_schedulable(self, change: NodeChange) -> CordonResult:
        """Cordon (`change.schedulable` False: no new placements on the nodes, what runs there stays; with `evict`,
        their offline tasks are preempted and requeued, as kubectl drain evicts) or uncordon nodes, by name; the
        change is in the ledger (fenced like every write) before it is answered. Unknown names: ValidationError."""
        for i, name in enumerate(change.nodes):
            if self.state.node_index(name) is None:
                raise ValidationError(f"nodes[{i}]", f"must be a node of {self.dc.name} (hsched nodes "
                                                     f"{self.dc.name} lists them)", name)
        return await self._submit(_Op("cordon", "", change=change))  # type: ignore[return-value]

    async def _submit(self, op: _Op) -> PlaceResult | ReleaseResult:
        if not self.holding:
            raise Fenced(self.unavailable_reason())
        op.future = asyncio.get_running_loop().create_future()
        op.trace_context = otel_context.get_current()
        self._ops.put_nowait(op)
        return await op.future

    # -- the batch loop --------------------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            if self._carried:  # the rest of a batch that ran out of time, ahead of anything that came since
                batch = list(self._carried)
                self._carried.clear()
                await asyncio.sleep(0)  # the loop runs between batches (lease watchdog, health, summaries)
            else:
                batch = [await self._ops.get()]
            while not self._ops.empty() and len(batch) < MAX_BATCH:
                batch.append(self._ops.get_nowait())
            async with self._writing:
                if not self.holding:  # queued before the lease was lost: nothing was decided for them
                    refused = Fenced(self.unavailable_reason())
                    for op in batch:
                        if not op.future.done():
                            op.future.set_exception(refused)
                    continue
                if self._refold_due:
                    lease_token = self.ledger.token
                    try:
                        await self._refold()
                    except Exception as exc:  # noqa: BLE001 - Redis still away: these ops fail, the next try refolds
                        if isinstance(exc, Fenced):  # the owed cancellations cannot be written under this token:
                            log.error("%s", exc)  # step down and take the lease again (a new fold settles them)
                            self._lease_lost(lease_token, str(exc))
                        for op in batch:
                            if not op.future.done():
                                op.future.set_exception(exc)
                        continue
                await self._run_batch(batch)
                self.batches_total += 1

    def set_room_model(self, room: RoomModel, version: int, source: str = "") -> None:
        """Check the batches after the current one against `room`, the thermal service's published `version`
        of this DC's model (`source`: a few words for the log). Only the in-process guard takes it: the thermal
        service (--thermal-guard service) serves its own latest version."""
        if isinstance(self.thermal, RoomGuard):
            self._next_room = (room, version, source)
            if self._ops.empty():  # an idle DC: a batch of its own swaps it now (and the queue gets a look)
                self._internal(_Op("drain", ""))

    def _swap_room(self) -> None:
        """Between batches (the writing lock held): the guard's model becomes the latest published one, whole."""
        if self._next_room is None or not isinstance(self.thermal, RoomGuard):
            return
        room, version, source = self._next_room
        self._next_room = None
        if room.n != self.state.n:
            log.error("placer %s: thermal model version %d has %d servers, the room %d: keeping version %d",
                      self.dc.name, version, room.n, self.state.n, self.thermal.version)
            return
        old = self.thermal.version
        self.thermal = RoomGuard(room, self.state, version)
        self._headroom, self._headroom_exact = None, False  # the old model's numbers
        log.info("placer %s: thermal model version %d replaces version %d%s", self.dc.name, version, old,
                 f" ({source})" if source else "")

    def _model_note(self, result: PlaceResult) -> None:
        """Every placement explanation names the room model version its thermal check used."""
        if result.thermal is not None:
            version = result.thermal.model_version
        elif isinstance(self.thermal, RoomGuard):
            version = self.thermal.version
        else:
            return  # no guard; or the service's version, known from its checks only
        result.notes.append(f"thermal model version {version}" + (
            " (the default model of the fleet's room: the thermal service has published none)" if version == 0
            else " (published by the thermal service)"))

    async def _run_batch(self, batch: list[_Op]) -> None:
        self._swap_room()
        # The batch's thermal calls join the trace of its first call (one Submit, one trace).
        token = otel_context.attach(batch[0].trace_context) if batch[0].trace_context else None
        lease_token = self.ledger.token
        try:
            await self._process(batch)
        except Exception as exc:
            if isinstance(exc, Fenced):
                log.error("%s", exc)
                self._lease_lost(lease_token, str(exc))
            elif isinstance(exc, INDETERMINATE) and any(op.report is not None for op in batch):
                log.warning("placer %s: batch of unknown outcome (%s); the ledger is folded again before the next",
                            self.dc.name, exc)
                self._refold_due = True
            else:
                log.exception("placer %s: batch failed", self.dc.name)
            for op in batch:
                if not op.future.done():
                    op.future.set_exception(exc)
        finally:
            if token is not None:
                otel_context.detach(token)

    async def _process(self, batch: list[_Op]) -> None:
        with self._queue_saved() as queue_before:
            try:
                await self._decide_batch(batch, queue_before)
                # keys starting with "_" are in-memory bookkeeping (_undo, the ledger's cancellations), never stored
                events = [e for op in batch for e in op.events]
                if events:
                    self.last_id = await self.ledger.append(events)
                    self._since_snapshot += len(events)
                    if self._since_snapshot >= self.retention.snapshot_entries:
                        self._snapshot_due.set()
            except BaseException as exc:
                if isinstance(exc, INDETERMINATE):
                    self._requeue_in_doubt(batch, queue_before)
                self._undo(batch, queue_before)  # memory must stay the fold of the ledger
                raise
        if events:
            self._dirty.set()
            self._follow_events(events)
        for op in batch:
            self._eviction_searched.update((t, n) for t, n in op.searched.items() if t in self.queue)
        if any(op.searches_left_over for op in batch):
            self._internal(_Op("drain", ""))  # the waiting online tasks this pass had no budget left for
        for op in batch:
            if isinstance(op.result, PlaceResult) and op.events:
                op.result.ledger_id = self.last_id
            if isinstance(op.result, PlaceResult) and op.kind == "place" and self.thermal:
                self._model_note(op.result)
            if not op.future.done():  # the caller may have gone (cancelled); its decision stands in the ledger
                op.future.set_result(op.result)

    async def _fresh_headroom(self) -> np.ndarray | None:
        if not self.thermal:
            return None
        self._headroom, self._headroom_exact = await self.thermal.headroom(self.last_id), True
        return self._headroom.copy()

    async def _decide_batch(self, batch: list[_Op], queue_before: _QueueSave) -> None:
        """Decide the batch in memory; `queue_before`: the undo scope opened before it."""
        if not self.thermal:
            self._decide_in_budget(batch, None)
            return
        headroom = self._headroom.copy() if self._headroom is not None else await self._fresh_headroom()
        self._decide_in_budget(batch, headroom)
        if not self._headroom_exact and any(op.result is not None and op.result.thermal_limited for op in batch):
            # refused on a conservative headroom: decide again on exact numbers before saying no
            self._undo(batch, queue_before)
            for op in batch:
                op.result, op.events = None, []
                op.searched.clear()
            headroom = await self._fresh_headroom()
            for op in batch:
                self._decide(op, headroom)
        check = await self._check(batch)
        if check is None:  # frees, drops and deferrals only: the decremented copy is still conservative
            self._headroom, self._headroom_exact = headroom, False
            return
        if check.ok:
            self._headroom = check.headroom_w
            self._headroom_exact = check.headroom_w is not None and check.headroom_exact
            self._attach_thermal(batch, check)
            return
        # The batch together is too hot: undo it and decide each call alone against fresh numbers.
        self._headroom = None
        self._undo(batch, queue_before)
        for op in batch:
            op.result, op.events = None, []
            op.searched.clear()
        if len(batch) == 1:
            await self._decide_alone(batch[0], [], thermal_veto=check)
        else:
            for i, op in enumerate(batch):
                if i:
                    await asyncio.sleep(0)  # an exact headroom each: let the loop run between them
                await self._decide_alone(op, batch[:i])

    def _decide_in_budget(self, batch: list[_Op], headroom: np.ndarray | None) -> None:
        """Decide the batch's ops in order until their decisions have used `batch_budget_s` (at least one op);
        the rest leave the batch, undecided, and open the next one (`_carried`): a batch holds the event loop
        for about the budget whatever the policy costs."""
        deadline = time.perf_counter() + self.batch_budget_s
        for k, op in enumerate(batch):
            if k and time.perf_counter() >= deadline:
                self._carried.extendleft(reversed(batch[k:]))
                del batch[k:]
                return
            self._decide(op, headroom)

    async def _decide_alone(self, op: _Op, prior: list[_Op], thermal_veto: ThermalCheck | None = None) -> None:
        """Decide `op` on its own, after the already decided (not yet written) `prior` calls of its batch."""
        if thermal_veto is None:
            with self._queue_saved() as queue_before:
                self._decide(op, await self._fresh_headroom())
                check = await self._check([*prior, op])
                self._headroom = None  # fetched for the state before `prior`: not reusable
                if check is None or check.ok:
                    self._attach_thermal([op], check)
                    return
                thermal_veto = check
                self._undo([op], queue_before)
            op.events = []
            op.searched.clear()
        # Too hot even alone: a place waits in the queue (or is refused); a release still frees.
        if op.kind == "place":
            over = ", ".join(map(str, thermal_veto.nodes_over_redline[:5]))
            reason = (f"placing it would raise the inlet to {thermal_veto.max_inlet_after_c:.1f} °C, past the "
                      f"{thermal_veto.redline_c:.1f} °C redline (nodes {over})")
            op.result = self._refuse(op, Outcome.NO_ROOM, reason, [])
            if isinstance(op.result, PlaceResult):
                op.result.thermal = thermal_veto
        else:
            self._decide(op, None, try_queue=False)

    async def _check(self, batch: list[_Op]) -> ThermalCheck | None:
        # The room model is at the ledger before this batch: send every change of the batch, frees
        # included (a release followed by a queued task taking the same cores is a net zero).
        deltas: list[LoadDelta] = []
        placing = False
        for op in batch:
            for e in op.events:
                if e["t"] == "alloc":
                    placing = True
                    deltas += deltas_of(e["_parts"])
                elif "_parts" in e:  # free, done
                    deltas += deltas_of(e["_parts"], sign=-1)
        if not self.thermal or not placing:
            return None
        with tracer.start_as_current_span("thermal check", attributes={"hsched.datacenter": self.dc.name}):
            check = await self.thermal.check(deltas, self.last_id)
        self.last_thermal = check
        return check

    def _attach_thermal(self, batch: list[_Op], check: ThermalCheck | None) -> None:
        for op in batch:
            if isinstance(op.result, PlaceResult) and op.result.outcome == "placed":
                op.result.thermal = check

    def _requeue_in_doubt(self, batch: list[_Op], queue_before: _QueueSave) -> None:
        """The ledger cancels an alloc of unknown outcome with a free; one that took a task from the deferred
        queue also puts it back there, as memory does (else a refold or a restart would lose the task)."""
        specs = dict(queue_before.items or ())
        for op in batch:
            for e in op.events:
                if e["t"] == "alloc" and e["task"] in specs:
                    queued = e["_queued_ms"] or 0  # back in its place in line, not behind what queued since
                    self.ledger.pending_undo.append({"t": "defer", "task": e["task"],
                                                     "spec": task_to_dict(specs[e["task"]]), "at": queued,
                                                     "arrival": e.get("arrival") or queued})

    def _undo(self, batch: list[_Op], queue_before: _QueueSave) -> None:
        self._state_version += 1
        state = self.state
        for op in reversed(batch):
            for e in reversed(op.events):
                task = e["task"]
                if e["t"] == "cordon":
                    for cancel in e["_undo"]:
                        fold_event(cancel, self.state, self.queue)
                    continue
                if e["t"] == "alloc":
                    self.state.release(task)
                elif "_parts" in e:  # an event that freed them (free, done, preempt)
                    self.state.apply(task, e["_parts"], e["_clock"], e["_spec"])
                    self.state.finished.pop(task, None)
                # the fold's bookkeeping as it was before the event (_emit noted it)
                for book, before in ((state.clocks, e["_clock"]), (state.queued_ms, e["_queued_ms"]),
                                     (state.specs, e["_spec"]), (state.ready_ms, e["_ready_ms"]),
                                     (state.arrival_ms, e["_arrival_ms"])):
                    if before is None:
                        book.pop(task, None)
                    else:
                        book[task] = before
        if queue_before.items is not None:
            self.queue = OrderedDict(queue_before.items)

    @contextlib.contextmanager
    def _queue_saved(self) -> Iterator[_QueueSave]:
        """An undo scope: the deferred queue as it is now, for `_undo` — copied by `_emit` only when a decision
        first changes the queue (most never do; a copy up front cost O(queue) per batch)."""
        save = _QueueSave()
        self._queue_saves.append(save)
        try:
            yield save
        finally:
            self._queue_saves.remove(save)

    # -- decisions (pure in-memory; each appends its ledger events to op.events and folds them) --------------

    def _emit(self, op: _Op, event: dict) -> None:
        task, state = event["task"], self.state
        before = (state.clocks.get(task), state.queued_ms.get(task), state.specs.get(task), state.ready_ms.get(task),
                  state.arrival_ms.get(task))
        if event["t"] == "defer" or task in self.queue:  # it changes the queue: open undo scopes copy it first
            unsaved = [save for save in self._queue_saves if save.items is None]
            if unsaved:
                items = list(self.queue.items())
                for save in unsaved:
                    save.items = items
        fold_event(event, state, self.queue, event.get("_parts"))
        self._state_version += 1
        if event["t"] in FREEING or (event["t"] == "cordon" and not event["on"]):  # an uncordon opens room too
            self._freed_count += 1  # never undone: at worst one search more
        # for _undo (keys with "_" are not written)
        event["_clock"], event["_queued_ms"], event["_spec"], event["_ready_ms"], event["_arrival_ms"] = before
        op.events.append(event)

    def _decide(self, op: _Op, headroom: np.ndarray | None, try_queue: bool = True) -> None:
        if op.kind == "place":
            op.result = self._decide_place(op, headroom)
        elif op.kind == "release":
            op.result = self._decide_release(op, headroom, try_queue)
        elif op.kind == "drain":
            op.result = ReleaseResult(False)
            if try_queue:
                self._drain_queue(op, headroom, op.result)
        elif op.kind == "cordon":
            op.result = self._decide_cordon(op, headroom, try_queue)
        else:
            op.result = self._decide_report(op, headroom, try_queue)

    def _decide_place(self, op: _Op, headroom: np.ndarray | None) -> PlaceResult:
        assert op.spec is not None
        held = self.state.allocations.get(op.task_id)
        if held is not None:  # a retried Place: answer what the ledger already says
            return PlaceResult("placed", held, notes=["already placed (retried call): same answer as before"],
                               ledger_id=self.last_id)
        if op.task_id in self.queue:
            return PlaceResult("deferred", reason="already waiting in the deferred queue", ledger_id=self.last_id)
        if (ended := self.state.finished.get(op.task_id)) is not None:  # not run twice (a DAG job's fixed ids)
            return PlaceResult("finished", reason=ended["reason"] or ("it succeeded" if ended["ok"] else "it failed"),
                               ledger_id=self.last_id, finished=ended,
                               notes=["already ran to completion here: not run again"])
        if op.not_after is not None and time.time() > op.not_after:
            return PlaceResult("expired", reason="the caller's deadline passed before the decision: nothing was "
                                                 "placed or queued")
        decision = plan(self.state, op.spec, self.policy, headroom)
        if decision.outcome is Outcome.PLACED:
            self._alloc(op, op.task_id, op.spec, decision.parts, headroom, decision.part_power_w)
            return PlaceResult("placed", decision.parts, decision.alternatives, notes=decision.notes)
        thermal_limited = decision.thermal_limited
        if decision.outcome is Outcome.NO_ROOM and op.spec.effective_class == ONLINE and op.preempt:
            inexact = headroom is not None and not self._headroom_exact
            if not (inexact and thermal_limited):  # else: first decided again on exact numbers (_decide_batch)
                preempted = self._preempt_for(op, op.task_id, op.spec, headroom)
                if preempted is not None:
                    placed, eviction = preempted
                    return PlaceResult("placed", placed.parts, placed.alternatives,
                                       notes=[*decision.notes, *placed.notes, self._eviction_note(eviction)])
                if not inexact:
                    op.searched[op.task_id] = self._freed_count
                thermal_limited = thermal_limited or inexact  # a conservative bound may have ruled victims out
        refusal = self._refuse(op, decision.outcome, decision.reason, decision.notes)
        refusal.thermal_limited = thermal_limited
        return refusal

    def _preempt_for(self, op: _Op, task_id: str, spec: TaskSpec,
                     headroom: np.ndarray | None) -> tuple[Plan, Eviction] | None:
        """Evict the offline tasks of one node that lose the least work and place the online task `task_id` (op's
        own, or a waiting one op's pass of the queue serves) in the room, as part of op (module docstring);
        None (nothing changed) when no such eviction would let it in."""
        now = _now_ms()
        state = self.state
        if not self._eviction_could_help(spec):
            return None
        offline, _ = self._offline_view()
        smallest = _smallest_part(spec, self.dc)
        reclaimable = self._reclaimable(spec, offline)
        cands = []
        for t in offline:
            parts = state.allocations[t]
            if any(reclaimable[p.node] for p in parts):
                lost = lost_work(parts, state.clocks[t].started_ms, now, self._capacity_t, self.time_factor)
                cands.append(candidate(t, [p for p in parts if reclaimable[p.node]], lost))
        if not cands:
            return None
        power: dict[str, list[tuple[int, float]]] = {}  # victim -> the heat its parts make, per node

        def fits(victims: tuple[str, ...]) -> bool:
            freed = [state.allocations[t] for t in victims]
            if not _room_for_some_part(state, freed, smallest):
                return False  # cheap necessary condition: the planner need not be asked
            room = None if headroom is None else headroom.copy()
            for t, parts in zip(victims, freed, strict=True):
                state._delta(parts, +1)  # tentative, undone below (as plan() itself does)
                if room is not None:
                    if t not in power:
                        power[t] = [(p.node, part_power_w(state, _demand_of(p), p.node)[0]) for p in parts]
                    for node, watts in power[t]:
                        room[node] += watts
            try:
                return plan(state, spec, self._probe, room).outcome is Outcome.PLACED
            finally:
                for parts in freed:
                    state._delta(parts, -1)

        eviction = choose_victims(cands, fits, min_victims=lambda node, on_node: _fewest_victims(
            state, node, [state.allocations[c.task_id] for c in on_node], smallest))
        if eviction is None:
            return None
        requeues = self._evict(op, task_id, eviction, headroom, now)
        decision = plan(state, spec, self.policy, headroom)
        if decision.outcome is not Outcome.PLACED:  # the policy's greedy part order missed what the probe found
            decision = plan(state, spec, self._probe, headroom)
        assert decision.outcome is Outcome.PLACED, "fits() said the eviction lets the task in"
        self._alloc(op, task_id, spec, decision.parts, headroom, decision.part_power_w, preempting=True)
        alloc = op.events[-1]
        # the context switch (paper 001's preemption overhead, drawn once and recorded in the alloc) delays the
        # online task's start and keeps the victims from being placed again before it has passed
        ready_ms = alloc["at"] + round(alloc.get("delay_s", 0.0) * 1000 / self.time_factor)
        for requeue in requeues:
            if ready_ms > requeue["at"]:
                requeue["after"] = ready_ms
            self._emit(op, requeue)
        return decision, eviction

    def _eviction_note(self, eviction: Eviction) -> str:
        return (f"preempted {len(eviction.victims)} offline task(s) on node {self.state.table.names[eviction.node]}: "
                f"{', '.join(eviction.victims)} (lost work {eviction.lost_work:.4g} DC-seconds); requeued")

    def _eviction_could_help(self, spec: TaskSpec) -> bool:
        """Cheap and blind to heat: False when no one-node eviction could let `spec` in (`_one_node_could_let_in`)."""
        offline, held = self._offline_view()
        return bool(offline) and (held is None or _one_node_could_let_in(
            self.state, held, _smallest_part(spec, self.dc), len(split_task(spec, self.dc))))

    def _offline_view(self) -> tuple[list[str], np.ndarray | None]:
        """The preemptible (offline) tasks held, and what they hold per node (CPU, memory, disk, bandwidth; None when
        one spans nodes); kept until the state changes, so a pass's searches share it."""
        if self._offline_cache is not None and self._offline_cache[0] == self._state_version:
            return self._offline_cache[1]
        state = self.state
        offline = [t for t, clock in state.clocks.items() if clock.priority_class != ONLINE and t in state.specs]
        nodes, amounts = [], []
        for t in offline:
            parts = state.allocations[t]
            if any(p.node != parts[0].node for p in parts):
                nodes = None
                break
            for p in parts:
                nodes.append(p.node)
                amounts.append((p.cpu_milli, p.memory_mib, p.disk_mib, p.bandwidth_mbps))
        held = None
        if nodes is not None:
            held = np.zeros((state.n, 4), dtype=np.int64)
            if nodes:
                np.add.at(held, np.asarray(nodes), np.asarray(amounts, dtype=np.int64))
        self._offline_cache = (self._state_version, (offline, held))
        return offline, held

    def _reclaimable(self, spec: TaskSpec, offline: list[str]) -> np.ndarray:
        """Nodes where a part of `spec` would fit if all their offline tasks were gone: the only nodes whose
        evictions are worth asking the planner about (a cheap necessary condition, one mask per part size)."""
        held = [self.state.allocations[t] for t in offline]
        for parts in held:
            self.state._delta(parts, +1)
        try:
            mask = np.zeros(self.state.n, dtype=bool)
            for demand in {d.demand for d in split_task(spec, self.dc)}:
                mask |= self.state.feasible(demand, spec.gpu_models)
            return mask
        finally:
            for parts in held:
                self.state._delta(parts, -1)

    def _evict(self, op: _Op, task_id: str, eviction: Eviction, headroom: np.ndarray | None, now: int,
               reason: str = "") -> list[dict]:
        """A preempt event per victim (frees it); returns their requeues (defer with the spec), emitted by the
        caller after the online task's alloc, which draws the preemption overhead they wait out. `task_id`: the
        online task the room is for ("" for a drain, whose `reason` the event carries)."""
        requeues = []
        for victim in eviction.victims:
            parts, spec, clock = (self.state.allocations[victim], self.state.specs[victim],
                                  self.state.clocks[victim])
            event = {"t": "preempt", "task": victim, "by": task_id, "at": now, **({"reason": reason} if reason else {})}
            self._emit(op, event)
            event["_parts"] = parts  # for _undo and the thermal check only; stripped before the ledger write
            # if the append's outcome is unknown, the ledger cancels it by re-allocating the victim as it was
            restore = {"t": "alloc", "task": victim, "parts": [p.to_json() for p in parts], "at": clock.placed_ms,
                       "runtime_s": clock.runtime_s, "class": clock.priority_class, "tenant": clock.tenant,
                       "spec": spec, "restore": True, **({"arrival": clock.arrival_ms} if clock.arrival_ms else {})}
            event["_undo"] = [restore, *([{"t": "run", "task": victim, "at": clock.started_ms}]
                                         if clock.started_ms else [])]
            if headroom is not None:
                for p in parts:
                    headroom[p.node] += part_power_w(self.state, _demand_of(p), p.node)[0]
            # (its cancellation: none — the victim's re-allocation takes it out of the queue; a drop would read as a
            # release to the gateway)
            # requeued at its first arrival's place in line, not behind the tasks that came after it (Slurm's and
            # Volcano's requeue keeps the job's place too); "at" stays now: its queue timeout and history
            requeues.append({"t": "defer", "task": victim, "spec": spec, "at": now, "arrival": clock.arrival,
                             "_undo": []})
        return requeues

    def _refuse(self, op: _Op, outcome: Outcome, reason: str, notes: list[str]) -> PlaceResult:
        if outcome is Outcome.NO_ROOM and op.allow_defer:
            assert op.spec is not None
            self._emit(op, {"t": "defer", "task": op.task_id, "spec": task_to_dict(op.spec), "at": _now_ms()})
            queued = (f"queued behind {len(self.queue) - 1} task(s) then; the queue is served in fair-share order, "
                      "not by position (hsched tenants)")
            return PlaceResult("deferred", reason=reason, notes=[*notes, queued])
        return PlaceResult(outcome.value, reason=reason, notes=notes)

    def _alloc(self, op: _Op, task_id: str, spec: TaskSpec, parts: tuple[Part, ...],
               headroom: np.ndarray | None, watts: tuple[float, ...] = (), preempting: bool = False) -> None:
        """Allocate for `task_id` — op's own task, or a queued one that op's release made room for — with the
        clock data its execution needs (hsched.state.ledger); `watts`: the parts' power as plan() priced it
        (Plan.part_power_w; else priced here); `preempting`: it evicts others to get the room, and starts after
        the executor's preemption overhead."""
        at = _now_ms()
        event = {"t": "alloc", "task": task_id, "parts": [p.to_json() for p in parts], "at": at,
                 "runtime_s": spec.runtime_s, "class": spec.effective_class, "tenant": spec.tenant}
        if preempting and self.executor is not None:
            event["delay_s"] = self.executor.preemption_overhead_s(task_id, at)
        if spec.effective_class != ONLINE:  # preemptible: a preemption requeues it with this spec
            event["spec"] = task_to_dict(spec)
            # and at its place in line: when it first joined the queue, if it is placed from there
            arrival = self.state.arrival_ms.get(task_id) or self.state.queued_ms.get(task_id, 0)
            if arrival and task_id in self.queue:
                event["arrival"] = arrival
        if tp := traceparent(op.trace_context):  # services that fold the ledger (thermal) join the call's trace
            event["tp"] = tp
        event["_parts"] = parts  # folded and checked as they are (not parsed back from "parts"); never stored
        self._emit(op, event)
        if headroom is not None:  # later decisions in this batch see the heat this one adds
            if len(watts) != len(parts):
                watts = tuple(part_power_w(self.state, _demand_of(p), p.node)[0] for p in parts)
            for p, w in zip(parts, watts, strict=True):
                headroom[p.node] -= w

    def _decide_cordon(self, op: _Op, headroom: np.ndarray | None, try_queue: bool) -> CordonResult:
        """A cordon event per node whose state changes (a retried call changes nothing); a drain's evictions; then
        the queue's turn (the evicted, or what an uncordoned node now lets in)."""
        change, state, now = op.change, self.state, _now_ms()
        assert change is not None
        result = CordonResult(False)
        nodes = {state.node_index(name): name for name in change.nodes}
        for node, name in nodes.items():
            was = state.cordoned.get(node)
            if change.schedulable:
                if was is None:
                    continue  # not cordoned: nothing to undo
            elif was is not None and (not change.reason or was["reason"] == change.reason):
                continue  # cordoned already (a retry): a new reason only is news
            event = {"t": "cordon", "task": "", "node": name, "on": not change.schedulable, "at": now}
            if not change.schedulable:
                event["reason"] = change.reason
            self._emit(op, event)
            # the node's state as it was: what _undo folds back, and what the ledger writes to cancel the event
            # when the append's outcome is unknown
            event["_undo"] = [{"t": "cordon", "task": "", "node": name, "on": was is not None,
                               **({"reason": was["reason"], "at": was["at"]} if was is not None else {})}]
            result.changed.append(name)
        if change.evict and not change.schedulable:
            victims = tuple(t for t, clock in state.clocks.items() if clock.priority_class != ONLINE
                            and t in state.specs and any(p.node in nodes for p in state.allocations[t]))
            if victims:
                reason = f"evicted: node drained by an operator ({change.reason or 'no reason given'})"
                for requeue in self._evict(op, "", Eviction(-1, victims, 0.0), headroom, now, reason):
                    self._emit(op, requeue)
                result.evicted = list(victims)
        if not change.schedulable:
            held = state.tasks_per_node()
            result.remaining = {name: int(held[node]) for node, name in nodes.items()}
        if try_queue and (result.evicted or (change.schedulable and result.changed)):
            self._drain_queue(op, headroom, result)
        return result

    def _decide_release(self, op: _Op, headroom: np.ndarray | None, try_queue: bool) -> ReleaseResult:
        parts = self.state.allocations.get(op.task_id)
        if parts is None:
            if op.task_id in self.queue:
                self._emit(op, {"t": "drop", "task": op.task_id})
                return ReleaseResult(True)
            return ReleaseResult(False)
        return self._free(op, {"t": "free", "task": op.task_id}, parts, headroom, try_queue)

    def _free(self, op: _Op, event: dict, parts: tuple[Part, ...], headroom: np.ndarray | None,
              try_queue: bool) -> ReleaseResult:
        """Emit `event` (one that frees op's task: free, done) and give the room to the deferred queue."""
        self._emit(op, event)
        event["_parts"] = parts  # for _undo only; stripped before the ledger write
        result = ReleaseResult(True, freed_total(parts))
        if headroom is not None:
            for p in parts:
                headroom[p.node] += part_power_w(self.state, _demand_of(p), p.node)[0]
        if try_queue:
            self._drain_queue(op, headroom, result)
        return result

    def _decide_report(self, op: _Op, headroom: np.ndarray | None, try_queue: bool) -> ReleaseResult:
        """Record what the executor (or the queue-timeout clock) reported, if the fold still agrees that it is
        news: the same placement (or queued entry), not recorded yet. `released` says whether it wrote."""
        r = op.report
        assert r is not None
        if op.kind == "expire":
            if op.task_id not in self.queue or self.state.queued_ms.get(op.task_id) != r.placed_ms:
                return ReleaseResult(False)  # placed, dropped or requeued since
            self._emit(op, {"t": "expire", "task": op.task_id, "at": r.at_ms})
            return ReleaseResult(True)
        clock = self.state.clocks.get(op.task_id)
        if clock is None or clock.placed_ms != r.placed_ms:
            return ReleaseResult(False)  # released, finished or placed anew since
        if op.kind == "run":
            if clock.started_ms:
                return ReleaseResult(False)
            self._emit(op, {"t": "run", "task": op.task_id, "at": r.at_ms})
            return ReleaseResult(True)
        if not clock.started_ms:  # the ledger says RUNNING before it says finished
            self._emit(op, {"t": "run", "task": op.task_id, "at": r.started_ms or r.at_ms})
        done = {"t": "done", "task": op.task_id, "ok": r.ok, "at": r.at_ms, "reason": r.reason}
        return self._free(op, done, self.state.allocations[op.task_id], headroom, try_queue)

    def _drain_queue(self, op: _Op, headroom: np.ndarray | None, result: ReleaseResult) -> None:
        """Freed resources go to waiting tasks in the fair order (hsched.policies.fairshare: online first, then
        the tenant furthest below its deserved share, then priority, then arrival); a waiting online task that
        still does not fit evicts offline tasks if that lets it in (`_evict_for_waiting`); those that still do not
        fit, or wait out a preemption overhead, keep waiting."""
        if not self.queue:
            return
        now = _now_ms()
        waiting = self._waiting(ready_by=now)
        planned: dict[str, Plan] = {}  # decisions the DAG policy's mask already made (same state: reused)
        pick = None
        if self.dag_policy is not None:
            running: Counter[str] = Counter()  # running tasks per DAG job, as of this drain
            for task in self.state.allocations:
                if (job := job_of_task(task)) is not None:
                    running[job[0]] += 1

            full: set[tuple[str, str]] = set()  # stages found not to fit: a drain only fills the DC, so still not

            def pick(band: list[Waiting]) -> Waiting:
                return self._pick_dag(band, headroom, planned, now, running, full)
        fair = FairQueue(waiting, self.state.tenant_usage, self._capacity, self.tenant_weights, pick)
        searches = _Searches(self.queue_eviction_searches)
        no_room: set[tuple] = set()  # (shape, class) that found no room in this pass
        tries = 0
        for w in itertools.islice(fair, MAX_QUEUE_SCAN_PER_RELEASE):
            spec = self.queue[w.task_id]
            shape = (spec.resources, spec.replicas, spec.gpu_models, w.priority_class)
            if shape in no_room and w.task_id not in planned:
                continue
            if tries == MAX_QUEUE_TRIES_PER_RELEASE:
                break
            tries += 1
            decision: Plan = planned.pop(w.task_id, None) or plan(self.state, spec, self.policy, headroom)
            if decision.outcome is Outcome.PLACED:
                self._alloc(op, w.task_id, spec, decision.parts, headroom, decision.part_power_w)
            elif not (decision.outcome is Outcome.NO_ROOM and w.priority_class == ONLINE
                      and self._evict_for_waiting(op, w.task_id, spec, headroom, result, fair, searches)):
                if decision.outcome is Outcome.NO_ROOM:
                    no_room.add(shape)
                continue
            result.placed_from_queue.append((w.task_id, self.state.allocations[w.task_id]))
            fair.placed(w)

    def _evict_for_waiting(self, op: _Op, task_id: str, spec: TaskSpec, headroom: np.ndarray | None,
                           result: ReleaseResult, fair: FairQueue, searches: _Searches) -> bool:
        """Whether the waiting online task `task_id`, which does not fit, was placed by evicting offline tasks
        (module docstring): searched only if something was freed since its last search that found nothing, not
        past the pass's budget, and not when a task of the same shape found nothing earlier in the pass."""
        if self._eviction_searched.get(task_id) == self._freed_count:
            return False
        if not self._eviction_could_help(spec):  # not a search; true whatever the headroom's precision
            op.searched[task_id] = self._freed_count
            return False
        shape = (spec.resources, spec.replicas, spec.gpu_models)
        if shape in searches.failed:
            op.searched[task_id] = self._freed_count
            return False
        if searches.left <= 0:
            op.searches_left_over = self.queue_eviction_searches > 0  # 0: waiting online tasks never evict
            return False
        if headroom is not None and not self._headroom_exact:
            result.thermal_limited = True  # a conservative bound could rule victims out: the batch is decided
            return False  # again on exact numbers (_decide_batch), and searched then
        searches.left -= 1
        self.queue_eviction_searches_total += 1
        first = len(op.events)
        if self._preempt_for(op, task_id, spec, headroom) is not None:
            for e in op.events[first:]:  # the victims' tenants hold less now
                if e["t"] == "preempt":
                    fair.evicted(e["_clock"].tenant, usage_vector(e["_parts"]))
            return True
        searches.failed.add(shape)
        op.searched[task_id] = self._freed_count
        return False

    def _pick_dag(self, band: list[Waiting], headroom: np.ndarray | None, planned: dict[str, Plan],
                  now_ms: int, running: Counter[str], full: set[tuple[str, str]]) -> Waiting:
        """The band's next task by the DAG policy (hsched.policies.dagqueue): among its DAG tasks' stages whose
        next task fits now (one plan each, kept in `planned` for the placement), the policy's stage, its
        earliest task. The arrival order when the head is not a DAG task or fewer than two stages compete."""
        planned.clear()  # a placement since the last pick changed the state: those plans are stale
        head = band[-1]
        if not self.queue[head.task_id].job_id:
            return head
        groups: dict[tuple[str, str], list[Waiting]] = {}
        for w in sorted(band, key=lambda w: w.arrival):
            spec = self.queue[w.task_id]
            if spec.job_id:
                groups.setdefault((spec.job_id, spec.stage), []).append(w)
        if len(groups) < 2:
            return head
        stages, first = [], {}
        queued_ms = self.state.queued_ms
        totals = self.state.free_totals()
        for key, ws in itertools.islice(groups.items(), MAX_BAND_STAGES):
            w0 = ws[0]
            spec = self.queue[w0.task_id]
            fits = False
            if key not in full:
                decision = plan(self.state, spec, self.policy, headroom)
                fits = decision.outcome is Outcome.PLACED
                if fits:
                    planned[w0.task_id] = decision
                else:
                    full.add(key)
            waited = max(0.0, (now_ms - queued_ms.get(w0.task_id, now_ms)) / 1000 * self.time_factor)
            fit_now = self.state.copies_within(totals, spec.resources) if fits else 0
            stages.append(QueuedStage(key[0], key[1], len(ws), spec.runtime_s, spec.stage_path_s, spec.job_work_s,
                                      w0.arrival, waited, fits, fit_now))
            first[key] = w0
        chosen = choose_stage(self.dag_policy, stages, running, sum(running.values()))
        if chosen is None:
            planned.clear()
            return head
        self.dag_decisions += 1
        w = first[(chosen.job_id, chosen.stage)]
        decision = planned.get(w.task_id)
        planned.clear()
        if decision is not None:
            planned[w.task_id] = decision
        return w

    # -- execution clock -------------------------------------------------------------------------------------

    @property
    def time_factor(self) -> float:
        """Task seconds per wall second (the executor's; 1 without one)."""
        return self.executor.time_factor if self.executor is not None else 1.0

    def _follow_events(self, events: list[dict]) -> None:
        """After an append: hand new allocations to the executor, stop freed tasks, time queued tasks out."""
        for e in events:
            kind, task = e["t"], e["task"]
            if kind == "alloc" or kind in UNQUEUING:
                self._eviction_searched.pop(task, None)
            if kind == "alloc":
                self._cancel_expiry(task)
                clock = self.state.clocks.get(task)
                if self.executor is not None and clock is not None and task in self.state.allocations \
                        and clock.placed_ms == e["at"]:  # not freed again later in the same append
                    self.executor.launch(task, self.state.allocations[task], clock)
            elif kind in FREEING:
                if self.executor is not None:
                    self.executor.stop(task)
                if kind == "preempt":
                    self.preemptions_total += 1
            elif kind == "defer":
                self._expire_later(task)
                self._drain_when_ready(task)
            elif kind in UNQUEUING:
                self._cancel_expiry(task)

    def _resume_clocks(self) -> None:
        """After folding the ledger under a new token: every task's clock goes on from what the ledger says."""
        self._stop_clocks()
        if self.executor is not None:
            for task, clock in self.state.clocks.items():
                self.executor.launch(task, self.state.allocations[task], clock)
        for task in self.queue:
            self._expire_later(task)
            self._drain_when_ready(task)

    def _stop_clocks(self) -> None:
        if self.executor is not None:
            self.executor.stop_all()
        for timer in (*self._expiries.values(), *self._ready_timers.values()):
            timer.cancel()
        self._expiries.clear()
        self._ready_timers.clear()

    def _drain_when_ready(self, task: str) -> None:
        """A requeued victim waits out the preemption overhead; then the queue is served again (a `drain` op)."""
        at_ms = self.state.ready_ms.get(task, 0)
        if at_ms <= _now_ms() or at_ms in self._ready_timers:
            return
        loop = asyncio.get_running_loop()

        def fire() -> None:
            # uvloop's timers may fire up to a millisecond early by the placer's clock: the drain would find the
            # task not ready yet and nothing re-arm it. One reading of the clock decides (two could straddle
            # at_ms, and the task then waited for an unrelated release).
            if (left_ms := at_ms - _now_ms()) > 0:
                self._ready_timers[at_ms] = loop.call_later(left_ms / 1000, fire)
                return
            self._ready_timers.pop(at_ms, None)
            self._on_report(Report("drain", "", 0, at_ms))

        self._ready_timers[at_ms] = loop.call_later((at_ms - _now_ms()) / 1000, fire)

    def _expire_later(self, task: str) -> None:
        spec, queued_ms = self.queue.get(task), self.state.queued_ms.get(task, 0)
        self._cancel_expiry(task)
        if spec is None or not spec.queue_timeout_s or not queued_ms:
            return
        # a requeued victim waits out its preemption overhead first: that is not time it could have run
        due_ms = max(queued_ms, self.state.ready_ms.get(task, 0)) + round(spec.queue_timeout_s * 1000 / self.time_factor)
        report = Report("expire", task, queued_ms, due_ms)
        self._expiries[task] = asyncio.get_running_loop().call_later(
            max(0.0, due_ms / 1000 - time.time()), self._on_report, report)

    def _cancel_expiry(self, task: str) -> None:
        timer = self._expiries.pop(task, None)
        if timer is not None:
            timer.cancel()

    def _on_report(self, report: Report) -> None:
        """(on the loop) A transition to record: queued as an op of the batch loop, written behind the fencing
        token like every decision, and tried again until written or moot (Redis away, a failed batch)."""
        if report.kind == "expire":
            self._expiries.pop(report.task_id, None)
        if not self.holding or self._closing:  # not ours to write: a take-over re-launches from the ledger
            return
        self._internal(_Op(report.kind, report.task_id, report=report),
                       lambda future: self._report_written(future, report))

    def _internal(self, op: _Op, done: Callable[[asyncio.Future], None] | None = None) -> None:
        """Queue an op of the engine's own (nobody awaits it): `done` sees its outcome."""
        op.future = asyncio.get_running_loop().create_future()
        op.future.add_done_callback(done or (lambda future: future.cancelled() or future.exception()))
        self._ops.put_nowait(op)

    def _report_written(self, future: asyncio.Future, report: Report) -> None:
        if future.cancelled():
            return
        exc = future.exception()  # also marks it retrieved: nobody awaits these futures
        if exc is None or isinstance(exc, Fenced) or not self.holding or self._closing:
            return
        log.warning("placer %s: recording %s of %s failed (%s); retrying", self.dc.name, report.kind,
                    report.task_id, exc)
        asyncio.get_running_loop().call_later(REPORT_RETRY_S, self._on_report, report)

    # -- background ------------------------------------------------------------------------------------------

    async def _retain(self) -> None:
        """Snapshot the fold and trim the ledger (hsched.state.ledger.Retention) between batches."""
        r = self.retention
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(r.snapshot_interval_s):
                    await self._snapshot_due.wait()
            self._snapshot_due.clear()
            if not (self._since_snapshot or self._held_back) or self.fenced:
                continue
            token = self.ledger.token
            try:
                async with self._writing:  # between batches: the fold is then the ledger's
                    if not self.holding or self.ledger.token != token:  # stepped down or re-folded meanwhile
                        continue
                    written = await snapshot_and_trim(self.ledger, self.state, self.queue, self.last_id,
                                                      r.trim_margin_s)
                    if written is None:  # events of unknown outcome are not in the fold yet: a later round
                        self._held_back = True
                        continue
                    trimmed, self._held_back = written
                    self._since_snapshot = 0
                log.info("placer %s: ledger snapshot at %s, %d entries trimmed", self.dc.name, self.last_id, trimmed)
            except Fenced as exc:
                log.error("%s", exc)
                self._lease_lost(token, str(exc))
            except Exception:
                log.warning("placer %s: ledger snapshot failed; retrying later", self.dc.name, exc_info=True)

    def summary(self) -> dict:
        t, s = self.state.table, self.state
        util = s.utilisation()
        largest = int(np.argmax(t.cpu_milli))
        on = s.schedulable() if s.cordoned else slice(None)
        idle_cards = ((s.gpu_free_core == t.gpu_core_percent) & (t.gpu_core_percent > 0))[on].sum(axis=1)
        th = self.last_thermal
        return {
            "datacenter": self.dc.name, "nodes": s.n,
            "capacity": [int(t.cpu_milli.sum()), int(t.memory_mib.sum()), int(t.disk_mib.sum()),
                         int(t.bandwidth_mbps.sum()), int(t.gpu_count.sum()), 0, 0],
            # what can be placed: a cordoned node's room is not
            "free": [int(s.free_cpu[on].sum()), int(s.free_memory[on].sum()), int(s.free_disk[on].sum()),
                     int(s.free_bandwidth[on].sum()), int(idle_cards.sum()), 0, 0],
            "cordoned_nodes": len(s.cordoned),
            # per resource, the most any one open node has free (CPU, memory, idle cards): with `free`, what the
            # selector's room-now estimate reads (DcSelector.room_now)
            "largest_free": [int(s.free_cpu[on].max(initial=0)), int(s.free_memory[on].max(initial=0)),
                             int(idle_cards.max(initial=0))],
            "largest_node": [int(t.cpu_milli.max()), int(t.memory_mib.max()), int(t.disk_mib.max()),
                             int(t.bandwidth_mbps.max()), int(t.gpu_count.max()), 100 if t.gpu_count.max() else 0,
                             int(t.gpu_memory_mib.max())],
            "largest_node_index": largest,
            "running_tasks": len(s.allocations), "deferred_tasks": len(self.queue),
            "cpu_utilisation": util["cpu"], "memory_utilisation": util["memory"],
            "gpu_core_utilisation": util["gpu_core"], "gpu_memory_utilisation": util["gpu_memory"],
            "pue": th.pue_after if th else 0.0, "max_inlet_c": th.max_inlet_after_c if th else 0.0,
            "ledger_id": self.last_id, "fencing_token": self.ledger.token or 0, "unix_ms": int(time.time() * 1000),
            "gpu_models": sorted({m for m in t.gpu_model if m}),
            # free resources by host kind: the selector's GPU-stranding term (hsched.costs.stranding)
            **({"gpu_hosts": free_of(s).as_dict()} if t.gpu_count.any() else {}),
            **({"slices": s.occupancy()} if isinstance(s, SlicedState) else {}),
        }

    def _waiting(self, ready_by: int | None = None) -> list[Waiting]:
        """The deferred queue as the fair order sees it; with `ready_by` (unix ms), only the tasks that may be placed
        by then (not a requeued victim still waiting out its preemption overhead)."""
        ready = self.state.ready_ms
        return [Waiting(t, s.tenant, s.effective_class, s.priority, i, demand_vector(s.resources, s.replicas))
                for i, (t, s) in enumerate(self.queue.items()) if ready_by is None or ready.get(t, 0) <= ready_by]

    def tenant_shares(self) -> list[dict]:
        """Per tenant holding or waiting for resources here, by name: its weight, what it holds (`allocated`),
        asks for (`requested`: that and its queued tasks' demand), deserves and its share, as the queue's next
        pass computes them (one FairQueue over the whole queue), and its running and queued task counts."""
        waiting = self._waiting()
        fair = FairQueue(waiting, self.state.tenant_usage, self._capacity, self.tenant_weights)
        running = Counter(c.tenant for c in self.state.clocks.values())
        queued = Counter(w.tenant for w in waiting)
        return [{"tenant": t, "weight": self.tenant_weights.of(t), "allocated": fair.held[t],
                 "requested": fair.requested[t], "deserved": fair.deserved[t],
                 "share": fair.share(t), "running_tasks": running[t], "queued_tasks": queued[t]}
                for t in sorted(fair.held)]

    async def _publish_summaries(self, period_s: float = 0.1, heartbeat_s: float = SUMMARY_HEARTBEAT_S) -> None:
        """Capacity summaries for the selector: at most every `period_s` when something changed, and a
        heartbeat every `heartbeat_s` so the selector can tell a quiet placer from a dead one; nothing while not
        serving (fenced or standby), so the selector drops the DC after a few missed heartbeats."""
        while True:
            try:  # not asyncio.wait_for: in 3.11 it swallows a cancel that lands as the event fires (stop() hangs)
                async with asyncio.timeout(heartbeat_s):
                    await self._dirty.wait()
            except TimeoutError:
                pass
            self._dirty.clear()
            if not self.holding:  # a fenced placer's or a standby's view is not the DC's: publish nothing
                continue
            try:
                await self.redis.xadd(self.keys.summary(self.dc.name), {"s": json.dumps(self.summary())},
                                      maxlen=100, approximate=True)
            except Exception:
                log.exception("placer %s: publishing the summary failed", self.dc.name)
                self._dirty.set()
            await asyncio.sleep(period_s)


class _Searches:
    """A queue pass's eviction searches for waiting online tasks: the budget left, the task shapes that found none."""

    __slots__ = ("failed", "left")

    def __init__(self, budget: int) -> None:
        self.left = budget
        self.failed: set[tuple[Resources, int, tuple[str, ...]]] = set()


def _smallest_part(spec: TaskSpec, dc: DataCenter) -> tuple[int, int, int, int]:
    """The least CPU, memory, disk and bandwidth any part of `spec` asks for."""
    demands = [d.demand for d in split_task(spec, dc)]
    return (min(d.cpu_milli for d in demands), min(d.memory_mib for d in demands),
            min(d.disk_mib for d in demands), min(d.bandwidth_mbps for d in demands))


def _one_node_could_let_in(state: ClusterState, held: np.ndarray, smallest: tuple[int, int, int, int],
                           parts: int) -> bool:
    """A cheap necessary condition for any one-node eviction to let a task of `parts` parts in (the searches for
    waiting online tasks mostly end here): counting, per node, how many of its smallest part its free room holds
    (CPU, memory, disk, bandwidth; GPU cards are left to the planner), now and with all the node's offline tasks
    (`held`: what they hold per node, none spanning nodes) gone, the nodes now plus the best node's gain must
    hold them all."""
    free = np.stack([state.free_cpu, state.free_memory, state.free_disk, state.free_bandwidth], axis=1).astype(np.int64)
    need = np.asarray(smallest, dtype=np.int64)
    dims = need > 0
    if not dims.any():
        return True

    def count(room: np.ndarray) -> np.ndarray:
        return np.minimum((np.maximum(room[:, dims], 0) // need[dims]).min(axis=1), parts)

    now = count(free)
    return int(now.sum() + (count(free + held) - now).max()) >= parts


def _room_for_some_part(state: ClusterState, freed: list[tuple[Part, ...]], smallest: tuple[int, int, int, int]) -> bool:
    """Whether a node the victims' parts free would hold the task's smallest part in CPU, memory, disk and
    bandwidth (GPU cards are left to the planner): the task fits nowhere now, so some part must go there."""
    room: dict[int, list[int]] = {}
    for parts in freed:
        for p in parts:
            r = room.setdefault(p.node, [int(state.free_cpu[p.node]), int(state.free_memory[p.node]),
                                         int(state.free_disk[p.node]), int(state.free_bandwidth[p.node])])
            r[0] += p.cpu_milli
            r[1] += p.memory_mib
            r[2] += p.disk_mib
            r[3] += p.bandwidth_mbps
    return any(all(have >= need for have, need in zip(r, smallest, strict=True)) for r in room.values())


def _fewest_victims(state: ClusterState, node: int, victims: list[tuple[Part, ...]],
                    smallest: tuple[int, int, int, int]) -> int:
    """A lower bound on how many of `victims` (the offline tasks on `node`) must go before the task's smallest
    part fits there, in CPU, memory, disk and bandwidth (largest first; more than there are: never); 1 when some
    victim also holds other nodes (it frees room elsewhere too). The task fits nowhere now, so with victims on
    this node only, some part must go here."""
    have = (int(state.free_cpu[node]), int(state.free_memory[node]), int(state.free_disk[node]),
            int(state.free_bandwidth[node]))
    deficit = [need - h for need, h in zip(smallest, have, strict=True)]
    if all(d <= 0 for d in deficit):
        return 1
    if any(p.node != node for parts in victims for p in parts):
        return 1
    sizes = [(sum(p.cpu_milli for p in parts), sum(p.memory_mib for p in parts), sum(p.disk_mib for p in parts),
              sum(p.bandwidth_mbps for p in parts)) for parts in victims]
    fewest = 1
    for k, d in enumerate(deficit):
        if d <= 0:
            continue
        freed = 0
        for count, size in enumerate(sorted((s[k] for s in sizes), reverse=True), start=1):
            freed += size
            if freed >= d:
                fewest = max(fewest, count)
                break
        else:
            return len(victims) + 1
    return fewest


def _demand_of(p: Part) -> Resources:
    gpus = len(p.gpus)
    return Resources(p.cpu_milli, p.memory_mib, p.disk_mib, p.bandwidth_mbps, gpus,
                     p.gpus[0].core_percent if gpus else 0, p.gpus[0].memory_mib if gpus else 0)
