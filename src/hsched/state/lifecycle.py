"""The gateway's view of what the placers do on their own: each DC ledger's placer-initiated events become task
events on the task stream.

A placer alone decides that a queued task is placed (a release made room), that a task started (`run`),
finished (`done`), waited too long (`expire`) or was evicted for an online task (`preempt`, then `defer`
to requeue it). The gateway follows every DC ledger (hsched.state.follow) and records each such event as
the task's next step (`transition`): kinds placed / running / succeeded / failed / expired / preempted /
deferred. Events the gateway itself caused (a Submit's alloc or defer, a Release's free or drop) are already
recorded by that call and change nothing here: a step is taken only when the task's recorded state is the
one the event moves it from. (A `defer` of a task recorded on nodes is the placer's own: the requeue after a
preemption, or the undo — free + defer — of a placement from the queue whose append had an unknown outcome.)

Idempotent across restarts: every such record carries the ledger entry it reflects (`ledger_ref`), the store
keeps the newest per DC (`TaskStore.ledger_cursor`), and a restarted gateway reads each ledger on from
there. A ledger trimmed past that point (the gateway was away longer than the placer's trim margin) is
re-derived from the DC's snapshot: the table is compared with the allocations and queue it holds, then the
entries after it are read as usual.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from hsched.convert import parts_to_pb
from hsched.domain.cluster import ClusterState, Part
from hsched.domain.task import TaskSpec
from hsched.state.follow import LedgerFollower, stream_id_tuple
from hsched.state.ledger import StateLost, load_snapshot, recorded_layout_of, snapshot_key, trimmed_past
from hsched.state.tasks import Conflict, Record, TaskStore, ledger_ref, now_ms, step
from hsched.v1 import common_pb2 as pb

log = logging.getLogger(__name__)

ON_NODES = (pb.TASK_STATE_PLACED, pb.TASK_STATE_RUNNING)  # on its nodes: placed, then started by the executor
_QUEUED = (pb.TASK_STATE_DEFERRED, pb.TASK_STATE_PREEMPTED)
LIVE = (*ON_NODES, *_QUEUED)  # states in which a DC's ledger holds the task (placed or queued)


def transition(task: pb.Task | None, event: dict, dc: str, ref: str, table) -> Record | None:
    """The step ledger `event` of `dc` (entry `ref`) makes `task` (a copy of its record, changed in place) take,
    or None when it takes none (an event the gateway caused and recorded itself, a task it does not know, or
    one already past it). `table`: the DC's node table (for a placement's assignments)."""
    if task is None or task.datacenter != dc:
        return None
    kind, at = event["t"], int(event.get("at") or 0)
    if kind == "alloc" and task.state in _QUEUED:
        del task.assignments[:]
        task.assignments.extend(parts_to_pb(tuple(Part.from_json(p) for p in event["parts"]), table))
        task.reason = ""
        task.explanation.notes.append("placed from the deferred queue")
        nodes = sorted({a.node for a in task.assignments})
        return step("placed", task, f"{dc}: from the deferred queue on {', '.join(nodes[:4])}", ref, at)
    if kind == "run" and task.state == pb.TASK_STATE_PLACED:
        task.started_unix_ms = at
        return step("running", task, f"started at {dc}", ref, at)
    if kind == "done" and task.state in ON_NODES:
        task.finished_unix_ms = at
        if event.get("ok"):
            return step("succeeded", task, f"finished at {dc}", ref, at)
        task.reason = event.get("reason") or "the executor reported a failure"
        return step("failed", task, task.reason, ref, at)
    if kind == "expire" and task.state in _QUEUED:
        task.finished_unix_ms = at
        task.reason = f"queued longer than its queue_timeout_s ({task.spec.queue_timeout_s:g} s)"
        return step("expired", task, task.reason, ref, at)
    if kind == "preempt" and task.state in ON_NODES:
        task.preemptions += 1
        del task.assignments[:]
        task.reason = event.get("reason") or f"preempted by online task {event.get('by', '?')}"
        return step("preempted", task, task.reason, ref, at)
    if kind == "defer" and task.state == pb.TASK_STATE_PREEMPTED:
        task.reason = f"requeued at {dc} after preemption"
        return step("deferred", task, task.reason, ref, at)
    if kind == "defer" and task.state in ON_NODES:  # a placement from the queue the placer undid (free + defer)
        del task.assignments[:]
        task.reason = f"back in the queue at {dc}: its placement from the queue was not confirmed"
        return step("deferred", task, task.reason, ref, at)
    return None


def _one_step(event: dict, dc: str, ref: str, table) -> Callable[[pb.Task], list[Record]]:
    def steps(task: pb.Task) -> list[Record]:
        record = transition(task, event, dc, ref, table)
        return [record] if record else []
    return steps


def rederive(task: pb.Task, dc: str, state: ClusterState, queue: OrderedDict[str, TaskSpec], ref: str
             ) -> list[Record]:
    """The steps that bring `task` (live at `dc` in the table) in line with the DC's fold `state`/`queue` when
    the ledger entries in between are gone (trimmed): placed (and running, if its clock says it started) when
    the fold holds it on nodes, requeued when queued, and when the fold no longer holds it, failed — it ended
    while the gateway was away and how is no longer known."""
    held, queued = state.allocations.get(task.task_id), task.task_id in queue
    if held is not None:
        records = []
        if task.state in _QUEUED:
            records.append(transition(task, {"t": "alloc", "parts": [p.to_json() for p in held]}, dc, ref,
                                      state.table))
        clock = state.clocks.get(task.task_id)
        if clock is not None and clock.started_ms:
            records.append(transition(task, {"t": "run", "at": clock.started_ms}, dc, ref, state.table))
        return [r for r in records if r is not None]
    if queued and task.state in ON_NODES:
        return [step("preempted", _preempted(task), "evicted while the gateway was away", ref),
                step("deferred", task, f"requeued at {dc}", ref)]
    if not queued:
        task.finished_unix_ms = task.finished_unix_ms or now_ms()
        task.reason = (f"it ended at {dc} while the gateway was not following that ledger, and the entries that "
                       "said how were trimmed: outcome unknown")
        return [step("failed", task, task.reason, ref)]
    return []


def _preempted(task: pb.Task) -> pb.Task:
    task.preemptions += 1
    del task.assignments[:]
    return task


class TaskLifecycle:
    """The observer of every DC ledger follower of a gateway: writes each transition before reading on (so the
    task stream has them in ledger order), retrying a failed write until the task stream takes it.
    `busy(task_id)`: a call of this gateway is still writing that task's own records (a Submit being
    scheduled) — its transitions wait for them. `await_record(task_id, at_ms)`: with several gateways, wait while
    another gateway may still be recording a task this table does not hold (named by a ledger entry at `at_ms`). Every gateway follows every ledger; the
    task's version decides which one's step is written (the others get `Conflict`, catch up, and find the step
    taken, so it is written once)."""

    def __init__(self, store: TaskStore, busy: Callable[[str], bool] = lambda _: False,
                 retry_s: float = 0.5, await_record: Callable[[str, int], Awaitable[None]] | None = None) -> None:
        self.store = store
        self.busy = busy
        self.await_record = await_record
        self.retry_s = retry_s
        self.done: dict[str, str] = {}  # DC -> the last ledger entry handled (recorded or found to change nothing)
        self.followers: dict[str, LedgerFollower] = {}

    async def start(self, redis: aioredis.Redis, followers: list[LedgerFollower]) -> None:
        """Load every follower and catch up with what its ledger holds beyond the store's cursor for that DC."""
        for f in followers:
            self.followers[f.state.dc.name] = f
            f.observer = self
            await f.load()
            cursor = self.store.ledger_cursor.get(f.state.dc.name)
            after = f"{cursor[0]}-{cursor[1]}" if cursor else "0-0"
            if await trimmed_past(redis, f.stream, after):
                await self.reloaded(f)
            else:
                await self._read(redis, f, after)

    async def reloaded(self, follower: LedgerFollower) -> None:
        """The follower reloaded from its DC's snapshot (entries this gateway had not handled are gone): bring
        every live task of that DC in line with the snapshot, then handle the entries after it (retried while
        Redis is away: the follower reads on only after this)."""
        delay = self.retry_s
        while True:
            try:
                return await self._rederive(follower)
            except (aioredis.ConnectionError, aioredis.TimeoutError) as exc:
                log.warning("cannot yet re-derive %s (%s); retrying in %g s", follower.stream, exc, delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, 30.0)

    async def _rederive(self, follower: LedgerFollower) -> None:
        dc = follower.state.dc
        snap_id, snap, nodes = await follower.redis.hmget(snapshot_key(follower.stream), "id", "s", "nodes")
        state, queue = ClusterState(dc, follower.state.table), OrderedDict()
        if snap_id is None:  # no snapshot: nothing was trimmed after all
            await self._read(follower.redis, follower, "0-0")
            return
        load_snapshot(snap, state, queue, recorded_layout_of(nodes))
        snap_id = snap_id.decode()
        live = [t.task_id for t in list(self.store.tasks.values()) if t.datacenter == dc.name and t.state in LIVE]
        # routine for a quiet DC after a gateway restart (its placer snapshots and trims as it takes the lease)
        log.log(logging.WARNING if live else logging.INFO, "ledger %s was trimmed past what this gateway had "
                "handled; re-deriving its %d live task(s) from the snapshot at %s", follower.stream, len(live), snap_id)
        for task_id in live:
            await self._write(task_id, lambda task: rederive(task, dc.name, state, queue,
                                                             ledger_ref(dc.name, snap_id))
                              if task.state in LIVE else [])
        await self._read(follower.redis, follower, snap_id)

    async def _read(self, redis: aioredis.Redis, follower: LedgerFollower, after: str) -> None:
        """Handle the follower's ledger entries after `after` up to where its fold is."""
        until = follower.last_id
        while stream_id_tuple(after) < stream_id_tuple(until):
            entries = await redis.xrange(follower.stream, min=f"({after}", max=until, count=1000)
            if not entries:
                break
            await self.entries(follower, [(e.decode(), json.loads(fields[b"e"])) for e, fields in entries])
            after = entries[-1][0].decode()
        self._handled(follower.state.dc.name, until)

    async def entries(self, follower: LedgerFollower, entries: list[tuple[str, dict]]) -> None:
        """Record the transitions of newly folded ledger entries (the follower awaits this per batch)."""
        dc = follower.state.dc.name
        for entry_id, event in entries:
            if stream_id_tuple(entry_id) <= self.store.ledger_cursor.get(dc, (0, 0)):
                continue  # recorded before (this gateway or the one before it)
            await self._write(event["task"], _one_step(event, dc, ledger_ref(dc, entry_id), follower.state.table),
                              stream_id_tuple(entry_id)[0])
            self._handled(dc, entry_id)

    def _handled(self, dc: str, entry_id: str) -> None:
        if stream_id_tuple(entry_id) > stream_id_tuple(self.done.get(dc, "0-0")):
            self.done[dc] = entry_id

    async def settle(self, dc: str, timeout_s: float) -> bool:
        """Wait until every entry `dc`'s ledger holds now is handled (read-your-writes after a placer call);
        False after `timeout_s` or when this DC is not followed."""
        follower = self.followers.get(dc)
        if follower is None:
            return False
        newest = await follower.redis.xrevrange(follower.stream, count=1)
        return not newest or await self.caught_up(dc, newest[0][0].decode(), timeout_s)

    async def caught_up(self, dc: str, entry_id: str, timeout_s: float) -> bool:
        """Wait until the entries of `dc`'s ledger up to `entry_id` are handled; False after `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while stream_id_tuple(self.done.get(dc, "0-0")) < stream_id_tuple(entry_id):
            if loop.time() > deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    async def _write(self, task_id: str, steps: Callable[[pb.Task], list[Record]], at_ms: int = 0) -> None:
        """Record `steps` of `task_id` (a ledger entry of Redis time `at_ms`, 0: none to wait for)."""
        delay = self.retry_s
        while True:
            while self.busy(task_id):  # its Submit's own records come first
                await asyncio.sleep(0.01)
            await self.store.settled(task_id)
            task = self.store.copy(task_id)
            if task is None and self.await_record is not None and at_ms:
                await self.await_record(task_id, at_ms)
                task = self.store.copy(task_id)
            records = steps(task) if task is not None else []
            if not records:
                return
            try:
                await self.store.write(*records)
                return
            except StateLost:
                raise
            except Conflict:  # another gateway recorded a step of it first: decide again on its record
                try:
                    await self.store.refresh()
                    continue
                except Exception as exc:  # noqa: BLE001 - Redis away: as below
                    log.warning("cannot yet catch up with the task stream (%s: %s); retrying in %g s",
                                type(exc).__name__, exc, delay)
            except Exception as exc:  # noqa: BLE001 - the placer did it whatever the stream says: retried
                log.warning("cannot yet record %s of %s (%s: %s); retrying in %g s", records[-1].kind, task_id,
                            type(exc).__name__, exc, delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, 30.0)
