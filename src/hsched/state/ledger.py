"""A data center's allocation ledger on a Redis stream, with a lease and a fencing token.

The placer is the single writer: it takes the lease (SET NX PX) and a fencing token (INCR) and every
append runs as one Lua script that first checks the token, so a placer that lost its lease — paused,
partitioned, or replaced by a second instance — can never write again. Appends happen before the
placer answers; its in-memory state is `fold` of the stream, so a restarted placer (or the thermal
service, or a simulator) rebuilds exactly the same state.

Events (field `e`, JSON; times are unix ms; keys absent in ledgers written before the execution clock are
read with the defaults shown):
  {"t": "alloc", "task": id, "parts": [Part.to_json(), ...],
   "at": ms placed, "runtime_s": s (0 = runs until released), "class": "online"|"offline", "tenant": str,
   "delay_s": extra task seconds before it starts (optional, 0: a preemption's context-switch overhead),
   "spec": task_to_dict(...) (offline tasks: what a preemption requeues),
   "arrival": ms it joined the deferred queue (optional: a task placed from the queue; where a preemption
              requeues it)}
                                                          (no "at": no execution clock, runs until released)
  {"t": "free",  "task": id}                               released by its client
  {"t": "defer", "task": id, "spec": task_to_dict(...), "at": ms queued (0)}   queued (paper 000's delay action)
                                                          "after": ms (a requeued victim, not placed before then)
                                                          "arrival": ms (a requeued victim: its first arrival; it
                                                          goes ahead of the queued tasks that arrived after that)
  {"t": "drop",  "task": id}                               a deferred task released before it ran
  {"t": "run",   "task": id, "at": ms}                     the executor started it (PLACED -> RUNNING)
  {"t": "done",  "task": id, "ok": bool, "at": ms, "reason": str}   finished (SUCCEEDED / FAILED); frees like free
  {"t": "expire", "task": id, "at": ms}                    deferred past its queue_timeout_s (EXPIRED); like drop
  {"t": "preempt", "task": id, "by": task id, "at": ms}    evicted for an online task (PREEMPTED); frees like free;
                                                          the same append requeues it (defer) and allocates "by"
  {"t": "cordon", "task": "", "node": name, "on": bool, "reason": str, "at": ms}   an operator took the node out
                                                          of scheduling (on) or back (the node by name, not index)
  a preempt may carry "reason" and an empty "by": evicted by an operator's drain (requeued like a preemption)
  an alloc with "restore": true (and the victim's original "at", then its run) cancels a preemption whose write
  had an unknown outcome; ignored when the task is still held (the preemption had not been written)
A run/done/expire "at" is when it happened (the executor's clock), which may be before the entry was written
(a placer that was down records a completion that fell due meanwhile). The placer writes them again until
they land; after an append whose outcome was unknown (connection lost mid-write, WAIT short) it folds the
ledger afresh before the retry, so a transition that did land is not written twice. (The fold would ignore a
repeat anyway: a done of a task not held, a run of a task already started.)

Retention: the placer periodically writes a snapshot of its fold (allocations and deferred queue, with the
ledger id it covers) to `{prefix}:dc:{dc}:snapshot` and trims the stream below it (XTRIM MINID), in one
fenced script, so the ledger stays bounded while the fold — every live task's state — is never lost.
`replay` starts from the snapshot; a reader whose cursor is older than the snapshot may have missed trimmed
entries and reloads (`trimmed_past`). Entries younger than a safety margin are never trimmed.

Node and card indices are positions in the DC's node table (its pools in fleet-file order, each node named by
its rack and slot). Every snapshot records that table (its `nodes` field, `node_layout`), and a placer snapshots
as it takes the lease, so the entries after a snapshot always refer to the snapshot's layout. When the fleet file changed, a
fold reads the ledger in the recorded layout and carries every live allocation over to the same positions of
the new one (`carry_over`), or raises LayoutConflict naming the tasks whose nodes no longer hold them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from hsched.domain.cluster import ClusterState, OverAllocation, Part, TaskClock
from hsched.domain.fleet import NodePool, NodeTable
from hsched.domain.task import TaskSpec, task_from_dict, task_to_dict
from hsched.state.keys import Keys
from hsched.state.redis import NotReplicated, run_replicated

log = logging.getLogger(__name__)

# ARGV: owner, lease ms, epoch ('' = unchecked): a Redis that lost hsched's state gets no lease or fence key either
_ACQUIRE = """
if ARGV[3] ~= '' and redis.call('GET', KEYS[3]) ~= ARGV[3] then return redis.error_reply('EPOCH') end
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return nil end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return redis.call('INCR', KEYS[2])
"""

# Renewal also checks the fencing token: a holder whose token was superseded (an operator bumped the fence, or
# a new instance with the same owner name acquired) learns it at its next renewal, not at its next write.
# 1 = renewed; the other answers say why not (RENEW_REFUSED).
RENEW_SCRIPT = """
local holder = redis.call('GET', KEYS[1])
if not holder then return -1 end
if holder ~= ARGV[1] then return -2 end
if redis.call('GET', KEYS[2]) ~= ARGV[3] then return -3 end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""
RENEW_REFUSED = {-1: "the lease had lapsed", -2: "another placer holds the lease",
                 -3: "a newer fencing token was issued", 0: "the lease had lapsed"}

# ARGV: token, epoch ('' = unchecked), events...; the epoch is checked first: a wiped Redis has no fence either
_APPEND = """
if ARGV[2] ~= '' and redis.call('GET', KEYS[3]) ~= ARGV[2] then return redis.error_reply('EPOCH') end
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return redis.error_reply('FENCED') end
local id
for i = 3, #ARGV do id = redis.call('XADD', KEYS[1], '*', 'e', ARGV[i]) end
return id
"""


# KEYS: stream, fence, snapshot, epoch; ARGV: token, snapshot id, snapshot JSON, trim id (entries below it go),
# epoch ('' = unchecked), node layout JSON (`node_layout`)
_SNAPSHOT = """
if ARGV[5] ~= '' and redis.call('GET', KEYS[4]) ~= ARGV[5] then return redis.error_reply('EPOCH') end
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return redis.error_reply('FENCED') end
redis.call('HSET', KEYS[3], 'id', ARGV[2], 's', ARGV[3], 'trim', ARGV[4], 'nodes', ARGV[6])
return redis.call('XTRIM', KEYS[1], 'MINID', ARGV[4])
"""


# json.dumps(e, separators=(",", ":")) without building an encoder per event (the same bytes)
_encode = json.JSONEncoder(separators=(",", ":")).encode


class Fenced(RuntimeError):
    """This writer's fencing token is no longer current: another placer owns the DC."""


class StateLost(Fenced):
    """Redis no longer holds the state this writer started on (hsched.state.epoch): it must not write again."""


class AppendNotReplicated(NotReplicated):
    """The append is on the master but not on enough replicas: not acknowledged (see `Ledger.append`)."""


# What cancels an event whose append had an unknown outcome (the fold ignores a free/drop of a task not held).
# An event may bring its own cancellations instead, under "_undo" (a preemption: re-allocating its victim);
# keys starting with "_" are the writer's bookkeeping and never stored.
# Lifecycle events (run, done, expire) need none: the placer writes them again until they land.
_UNDO = {"alloc": "free", "defer": "drop"}
# append failures after which the events may or may not be in the ledger
INDETERMINATE = (RedisConnectionError, RedisTimeoutError, NotReplicated)


class LeaseHeld(RuntimeError):
    """Another live placer holds the DC's lease."""


# events that return a task's resources (the thermal follower and the gateway treat them alike)
FREEING = frozenset({"free", "done", "preempt"})
# events that take a task out of the deferred queue without placing it
UNQUEUING = frozenset({"drop", "expire"})


def clock_of(event: dict) -> TaskClock | None:
    """The execution clock data an alloc event carries (None: written before the execution clock)."""
    if "at" not in event:
        return None
    return TaskClock(int(event["at"]), float(event.get("runtime_s", 0.0)), event.get("class") or "offline",
                     event.get("tenant", "default"), delay_s=float(event.get("delay_s", 0.0)),
                     arrival_ms=int(event.get("arrival", 0)))


def _stored(event: dict) -> dict:
    """The event as the ledger stores it: without the writer's "_" bookkeeping keys."""
    return {k: v for k, v in event.items() if not k.startswith("_")} if any(k[0] == "_" for k in event) else event


def cancellations(events: list[dict]) -> list[dict]:
    """Events that cancel `events` whatever part of them was written, latest first (a preemption's victim is
    re-allocated only after the online task that took its room is freed)."""
    out: list[dict] = []
    for e in reversed(events):
        if "_undo" in e:
            out += e["_undo"]
        elif e["t"] in _UNDO:
            out.append({"t": _UNDO[e["t"]], "task": e["task"]})
    return out


def fold_event(event: dict, state: ClusterState, queue: OrderedDict[str, TaskSpec],
               parts: tuple[Part, ...] | None = None) -> None:
    """Fold one event; `parts`: an alloc's parts as Part objects when the caller has them (its writer: the same
    values as parsing event["parts"], without the parse)."""
    kind, task = event["t"], event["task"]
    if kind == "cordon":  # an operator's; by node name (positions are kept across fleet-file changes, names too)
        node = state.node_index(event["node"])
        if node is not None:  # (a node a later fleet file removed: nothing to keep out)
            if event.get("on"):
                state.cordon(node, event.get("reason") or "", int(event.get("at") or 0))
            else:
                state.uncordon(node)
        return
    if kind == "alloc" and event.get("restore") and task in state.allocations:
        return  # the cancellation of a preemption whose write did not land: the victim never left
    if kind == "alloc":
        state.finished.pop(task, None)
        _unqueue(task, state, queue)
        if parts is None:
            parts = tuple(Part.from_json(p) for p in event["parts"])
        state.apply(task, parts, clock_of(event), event.get("spec"))
    elif kind in FREEING:
        state.release(task)
        if kind == "done":
            state.note_finished(task, {"ok": bool(event.get("ok")), "at": int(event.get("at") or 0),
                                       "reason": event.get("reason") or ""})
    elif kind == "run":
        state.start(task, int(event["at"]))
    elif kind == "defer":
        queue[task] = task_from_dict(event["spec"])
        state.queued_ms[task] = int(event.get("at", 0))
        if event.get("after"):
            state.ready_ms[task] = int(event["after"])
        if event.get("arrival"):
            _in_line(task, int(event["arrival"]), state, queue)
    elif kind in UNQUEUING:
        _unqueue(task, state, queue)
    else:
        raise ValueError(f"ledger event type {kind!r} is unknown")


def _unqueue(task: str, state: ClusterState, queue: OrderedDict[str, TaskSpec]) -> None:
    queue.pop(task, None)
    state.queued_ms.pop(task, None)
    state.ready_ms.pop(task, None)
    state.arrival_ms.pop(task, None)


def _in_line(task: str, arrival: int, state: ClusterState, queue: OrderedDict[str, TaskSpec]) -> None:
    """Move `task` (just queued, last) ahead of the queued tasks that arrived at or after `arrival`: the queue is
    in arrival order (its position is the fair order's tie-break), and a requeued victim keeps its first one."""
    state.arrival_ms[task] = arrival
    queue.move_to_end(task)
    later = []
    for other in itertools.islice(reversed(queue), 1, None):
        if (state.arrival_ms.get(other) or state.queued_ms.get(other, 0)) < arrival:
            break
        later.append(other)
    for other in reversed(later):
        queue.move_to_end(other)


@dataclass
class Ledger:
    redis: aioredis.Redis
    keys: Keys
    dc: str
    owner: str
    lease_ms: int = 3000
    token: int | None = None
    epoch: str | None = None  # checked by every append (hsched.state.epoch); None = unchecked
    min_replicas: int = 0  # replicas that must hold an append before it counts (Redis WAIT)
    wait_timeout_ms: int = 1000
    # Cancellations of events whose append failed with an unknown outcome, written first by the next append
    # (and by settle()), so the ledger agrees again with the caller, who undid them in memory.
    pending_undo: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = asyncio.Lock()  # append and settle: the undo must land before anything that reuses the room
        self._acquire = self.redis.register_script(_ACQUIRE)
        self._renew = self.redis.register_script(RENEW_SCRIPT)
        self._append = self.redis.register_script(_APPEND)

    @property
    def stream(self) -> str:
        return self.keys.ledger(self.dc)

    async def try_acquire(self) -> int | None:
        """Take the lease and a new fencing token if no other owner holds it (None if one does); StateLost if
        Redis no longer holds this deployment's epoch (nothing is written then)."""
        try:  # with replicas, a token only once they hold it: an unreplicated INCR a failover rolls back would
            # hand the same token to the next holder, and two placers would append under one token
            token = await run_replicated(self._acquire, [self.keys.lease(self.dc), self.keys.fence(self.dc),
                                                         self.keys.epoch], [self.owner, self.lease_ms, self.epoch or ""],
                                         self.redis, self.min_replicas, self.wait_timeout_ms,
                                         f"the lease of {self.dc}")
        except ResponseError as exc:
            if "EPOCH" in str(exc):
                raise StateLost(f"placer for {self.dc}: Redis no longer holds epoch {self.epoch} "
                                f"({self.keys.epoch}); not taking the lease") from None
            raise
        if token is None:
            return None
        self.token = int(token)
        return self.token

    async def holder(self) -> str | None:
        """The owner that holds the lease now (None: nobody)."""
        holder = await self.redis.get(self.keys.lease(self.dc))
        return holder.decode() if isinstance(holder, bytes) else holder

    async def acquire(self, wait_s: float = 0.0) -> int:
        """Take the lease and a new fencing token, waiting up to `wait_s` for a dead holder's lease to lapse."""
        deadline = asyncio.get_running_loop().time() + wait_s
        while True:
            token = await self.try_acquire()
            if token is not None:
                return token
            if asyncio.get_running_loop().time() >= deadline:
                raise LeaseHeld(f"data center {self.dc} is owned by placer {await self.holder()!r}; "
                                f"it lapses {self.lease_ms} ms after that placer stops")
            await asyncio.sleep(min(0.1, self.lease_ms / 10_000))

    def renew_args(self, token: int | None) -> tuple[list[str], list]:
        """KEYS and ARGV of RENEW_SCRIPT for this owner holding `token` (also run by the placer's renewal thread)."""
        return [self.keys.lease(self.dc), self.keys.fence(self.dc)], [self.owner, self.lease_ms, token or 0]

    async def renew(self) -> bool:
        """Extend the lease by `lease_ms`; False if this owner no longer holds it or its token is stale."""
        keys, args = self.renew_args(self.token)
        return await self._renew(keys=keys, args=args) == 1

    async def release_lease(self) -> None:
        await self.redis.eval("if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end"
                              " return 0", 1, self.keys.lease(self.dc), self.owner)

    async def append(self, events: Iterable[dict]) -> str:
        """Append events atomically behind the epoch and fencing checks; returns the last stream id. With
        `min_replicas`, the append counts only once that many replicas hold it (WAIT on the same connection),
        else AppendNotReplicated. When the outcome is unknown (connection lost mid-call, WAIT short) the caller
        treats the events as not written, so their cancellations are queued to be written first next time: a
        placement answered as failed never stays held in the ledger (the gateway places it elsewhere)."""
        events = list(events)
        if not events:
            raise ValueError("events: nothing to append")
        async with self._lock:
            return await self._append_now(events)

    async def settle(self) -> None:
        """Write the queued cancellations now (a placer calls this while idle)."""
        async with self._lock:
            if self.pending_undo:
                await self._append_now([])

    async def settle_forever(self, interval_s: float = 0.5) -> None:
        """Keep writing queued cancellations until they land (Redis back, a failover done); cancel to stop."""
        while True:
            await asyncio.sleep(interval_s)
            if self.pending_undo:
                try:
                    await self.settle()
                except (RedisError, Fenced) as exc:  # retried; a fenced or lost placer is handled elsewhere
                    log.debug("ledger %s: cancellations not written yet: %s", self.dc, exc)

    async def _append_now(self, events: list[dict]) -> str:
        if self.token is None:
            raise Fenced(f"placer for {self.dc} has no fencing token (acquire() first)")
        undo = list(self.pending_undo)
        payload = [_encode(_stored(e)) for e in (*undo, *events)]
        keys = [self.stream, self.keys.fence(self.dc), self.keys.epoch]
        args = [self.token, self.epoch or "", *payload]
        try:
            try:
                last = await run_replicated(self._append, keys, args, self.redis, self.min_replicas,
                                            self.wait_timeout_ms, f"the ledger append of {self.dc}")
            except NotReplicated as exc:
                raise AppendNotReplicated(str(exc)) from None
        except ResponseError as exc:  # the script refused: nothing was written
            if "EPOCH" in str(exc):
                raise StateLost(f"placer for {self.dc}: Redis no longer holds epoch {self.epoch} "
                                f"({self.keys.epoch}); its ledger cannot be trusted") from None
            if "FENCED" in str(exc):
                raise Fenced(f"placer for {self.dc} was fenced out (token {self.token} is stale)") from None
            raise
        except INDETERMINATE:
            self.pending_undo = [*undo, *cancellations(events)]
            raise
        self.pending_undo = []
        return last.decode() if isinstance(last, bytes) else last


def snapshot_key(stream: str) -> str:
    """The snapshot key of a ledger stream (Keys.snapshot of the same DC)."""
    return stream.removesuffix(":ledger") + ":snapshot"


class LayoutConflict(RuntimeError):
    """The fleet file changed the nodes that live allocations of the ledger are on."""


def node_layout(table: NodeTable) -> list[list]:
    """The nodes by position as runs of equal nodes, [count, cpu_milli, memory_mib, disk_mib, bandwidth_mbps,
    gpu_count, gpu_model, gpu_memory_mib per card]: what the ledger's node and card indices refer to."""
    n = len(table)
    if n == 0:
        return []
    card_mib = table.gpu_memory_mib.max(axis=1) if table.gpu_memory_mib.size else np.zeros(n, np.int64)
    cols = np.stack([table.cpu_milli, table.memory_mib, table.disk_mib, table.bandwidth_mbps, table.gpu_count,
                     card_mib], axis=1)
    models = np.array(table.gpu_model)
    starts = np.flatnonzero(np.r_[True, np.any(cols[1:] != cols[:-1], axis=1) | (models[1:] != models[:-1])])
    counts = np.diff(np.r_[starts, n])
    return [[int(c), *(int(v) for v in cols[i, :5]), str(models[i]), int(cols[i, 5])]
            for c, i in zip(counts, starts, strict=True)]


def _in_layout(state: ClusterState, recorded: list[list] | None) -> ClusterState:
    """`state` if the ledger's `recorded` layout is its own (or none was recorded: a ledger from before layouts
    were recorded is read in the current one), else an empty state of the recorded layout to fold into."""
    if recorded is None or recorded == node_layout(state.table):
        return state
    pools = tuple(NodePool(f"recorded-{i}", count, cpu, memory, disk, bandwidth, gpus, model, card_mib)
                  for i, (count, cpu, memory, disk, bandwidth, gpus, model, card_mib) in enumerate(recorded))
    return ClusterState(replace(state.dc, pools=pools))


def carry_over(old: ClusterState, new: ClusterState, where: str) -> None:
    """Put `old`'s allocations (and the clocks, specs and queue times) on the same node and card positions of
    `new`, a state of the changed fleet; LayoutConflict naming every task whose nodes no longer hold it (gone,
    smaller, or another GPU model under its cards)."""
    conflicts: list[str] = []
    for task, parts in old.allocations.items():
        try:
            if any(p.gpus and p.node < new.n and new.table.gpu_model[p.node] != old.table.gpu_model[p.node]
                   for p in parts):
                raise OverAllocation("its cards' GPU model changed")
            new.apply(task, parts, old.clocks.get(task), old.specs.get(task))
        except OverAllocation:
            nodes = sorted({p.node for p in parts})
            conflicts.append(f"{task} on {', '.join(old.table.names[i] for i in nodes)}")
    if conflicts:
        shown = "; ".join(conflicts[:5]) + (f"; and {len(conflicts) - 5} more" if len(conflicts) > 5 else "")
        raise LayoutConflict(
            f"{where}: the fleet file changed nodes that {len(conflicts)} live task(s) hold ({shown}). Nodes are "
            "known by position (their rack and slot), in node-pool order: add pools after the existing ones, or "
            "start with the previous fleet file and release or let finish those tasks before the change")
    new.queued_ms.update(old.queued_ms)
    new.ready_ms.update(old.ready_ms)
    new.arrival_ms.update(old.arrival_ms)
    new.finished.update(old.finished)
    for i, c in old.cordoned.items():  # by name: a node the changed fleet no longer has is no longer cordoned
        if (node := new.node_index(old.table.names[i])) is not None:
            new.cordon(node, c["reason"], c["at"])


def recorded_layout_of(recorded: bytes | None) -> list[list] | None:
    """A snapshot's `nodes` field as `node_layout` wrote it (None: a snapshot from before layouts were recorded)."""
    return json.loads(recorded) if recorded else None


async def recorded_layout(redis: aioredis.Redis, stream: str) -> list[list] | None:
    """The node layout the ledger's latest snapshot records (None: no snapshot, or one from before layouts)."""
    return recorded_layout_of(await redis.hget(snapshot_key(stream), "nodes"))


# the finished tasks a snapshot carries (ClusterState.finished): those of the last 10 minutes, at most 10,000
SNAPSHOT_FINISHED, SNAPSHOT_FINISHED_S = 10_000, 600

def snapshot_of(state: ClusterState, queue: OrderedDict[str, TaskSpec]) -> str:
    """The fold as JSON: allocations, the running tasks' clocks, the deferred queue in its order (with when
    each was queued, may be placed and, for a requeued victim, first arrived), the cordoned nodes (by name) and
    the tasks that finished in the last SNAPSHOT_FINISHED_S (at most SNAPSHOT_FINISHED, the newest), so a placer
    that folds it still answers a Place of one with how it ended. (The node layout its indices refer to goes beside it: `snapshot_and_trim`.)"""
    since = int(time.time() * 1000) - SNAPSHOT_FINISHED_S * 1000
    newest = itertools.islice(reversed(state.finished.items()), SNAPSHOT_FINISHED)  # not a copy of all 100,000
    recent = [[t, d["ok"], d["at"], d["reason"]] for t, d in newest if d["at"] >= since][::-1]
    return json.dumps({"alloc": {t: [p.to_json() for p in parts] for t, parts in state.allocations.items()},
                       "clocks": {t: c.to_json() for t, c in state.clocks.items()},
                       "specs": state.specs,
                       "queue": [[t, task_to_dict(spec), state.queued_ms.get(t, 0), state.ready_ms.get(t, 0),
                                  *([state.arrival_ms[t]] if t in state.arrival_ms else [])]
                                 for t, spec in queue.items()],
                       "finished": recent,
                       "cordoned": [[state.table.names[i], c["reason"], c["at"]] for i, c in state.cordoned.items()]},
                      separators=(",", ":"))


def load_snapshot(data: bytes | str, state: ClusterState, queue: OrderedDict[str, TaskSpec],
                  nodes: list[list] | None = None) -> None:
    """Fold a `snapshot_of` into an empty state/queue (one written before the execution clock has no clocks); one
    written for another node layout (`nodes`, as recorded beside it) onto the same positions (`carry_over`)."""
    target = _in_layout(state, nodes)
    if target is not state:
        load_snapshot(data, target, queue)
        carry_over(target, state, f"ledger snapshot of {state.dc.name}")
        return
    snap = json.loads(data)
    clocks, specs = snap.get("clocks", {}), snap.get("specs", {})
    for task, parts in snap["alloc"].items():
        clock, spec = clocks.get(task), specs.get(task)
        state.apply(task, tuple(Part.from_json(p) for p in parts), TaskClock.from_json(clock) if clock else None,
                    spec or None)
    for task, spec, *queued in snap["queue"]:
        queue[task] = task_from_dict(spec)
        state.queued_ms[task] = int(queued[0]) if queued else 0
        if len(queued) > 1 and queued[1]:
            state.ready_ms[task] = int(queued[1])
        if len(queued) > 2:
            state.arrival_ms[task] = int(queued[2])
    for task, ok, at, reason in snap.get("finished", []):  # (none in a snapshot from before they were kept)
        state.note_finished(task, {"ok": bool(ok), "at": int(at), "reason": reason})
    for name, reason, at in snap.get("cordoned", []):
        fold_event({"t": "cordon", "task": "", "node": name, "on": True, "reason": reason, "at": at}, state, queue)


def _id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms or 0), int(seq or 0)


async def snapshot_id(redis: aioredis.Redis, stream: str) -> str | None:
    """The ledger id the stream's snapshot covers, or None when it has none."""
    got = await redis.hget(snapshot_key(stream), "id")
    return got.decode() if isinstance(got, bytes) else got


async def trimmed_past(redis: aioredis.Redis, stream: str, cursor: str) -> bool:
    """True when entries after `cursor` that it has not read may have been trimmed (the trim point is newer
    than it): a reader at `cursor` must reload (`replay`, from the snapshot) instead of reading on."""
    trim = await redis.hget(snapshot_key(stream), "trim")
    return trim is not None and _id(cursor) < _id(trim.decode() if isinstance(trim, bytes) else trim)


@dataclass(frozen=True)
class Retention:
    """When a placer snapshots its ledger and trims it: after `snapshot_entries` new entries, or
    `snapshot_interval_s` after the last snapshot when there is anything new (or held back by the margin);
    entries younger than `trim_margin_s` stay (a reader lagging less than that never needs the snapshot)."""

    snapshot_entries: int = 10_000
    snapshot_interval_s: float = 60.0
    trim_margin_s: float = 300.0


async def snapshot_and_trim(ledger: Ledger, state: ClusterState, queue: OrderedDict[str, TaskSpec],
                            last_id: str, margin_s: float, now_s: float | None = None) -> tuple[int, bool] | None:
    """Write the fold (`state`/`queue`, which must be exactly the ledger up to `last_id`) as the DC's snapshot
    and trim the stream below it — but never entries younger than `margin_s` — behind the fencing check, in
    one script. Returns (entries trimmed, whether the margin held some of the snapshot's entries back), or None
    when nothing was written (appends of unknown outcome are owed their cancellations first); raises Fenced
    when this writer is no longer current."""
    if ledger.token is None:
        raise Fenced(f"placer for {ledger.dc} has no fencing token (acquire() first)")
    floor_ms = int(((time.time() if now_s is None else now_s) - margin_s) * 1000)
    trim = min(_id(last_id), (max(floor_ms, 0), 0))
    async with ledger._lock:  # no append in between (the fold must be the ledger's up to last_id)
        if ledger.pending_undo:  # the fold lacks events whose write is in doubt: snapshot once they are settled
            return None
        try:
            trimmed = await ledger.redis.eval(
                _SNAPSHOT, 4, ledger.stream, ledger.keys.fence(ledger.dc), ledger.keys.snapshot(ledger.dc),
                ledger.keys.epoch, ledger.token, last_id, snapshot_of(state, queue), f"{trim[0]}-{trim[1]}",
                ledger.epoch or "", json.dumps(node_layout(state.table)))
        except ResponseError as exc:
            if "EPOCH" in str(exc):
                raise StateLost(f"placer for {ledger.dc}: Redis no longer holds epoch {ledger.epoch}") from None
            if "FENCED" in str(exc):
                raise Fenced(f"placer for {ledger.dc} was fenced out (token {ledger.token} is stale)") from None
            raise
    return int(trimmed), trim < _id(last_id)


async def replay(redis: aioredis.Redis, stream: str, state: ClusterState, queue: OrderedDict[str, TaskSpec],
                 after: str = "-", batch: int = 2000) -> str:
    """Fold every event after `after` into state/queue; returns the last id folded ("0-0" if none). From the
    start ("-"), the fold begins at the stream's snapshot when it has one (read with the first entries in
    one transaction, so no trim falls between them)."""
    last = "0-0" if after == "-" else after
    start = after if after == "-" else f"({after}"
    entries = None
    fold = state  # the entries after a snapshot are in its node layout: folded there, then carried over
    if after == "-":
        async with redis.pipeline(transaction=True) as pipe:
            pipe.hmget(snapshot_key(stream), "id", "s", "nodes")
            pipe.xrange(stream, min="-", max="+", count=batch)
            (snap_id, snap, nodes), entries = await pipe.execute()
        if snap_id is not None:
            fold = _in_layout(state, recorded_layout_of(nodes))
            load_snapshot(snap, fold, queue)
            last = snap_id.decode()
    covered = _id(last)  # entries up to here are in the snapshot (the trim keeps a margin of them)
    while True:
        if entries is None:
            entries = await redis.xrange(stream, min=start, max="+", count=batch)
        for entry_id, fields in entries:
            entry = entry_id.decode()
            if _id(entry) <= covered:
                continue
            fold_event(json.loads(fields[b"e"]), fold, queue)
            last = entry
        if len(entries) < batch:
            if fold is not state:
                carry_over(fold, state, f"ledger {stream}")
            return last
        start = f"({entries[-1][0].decode()}"
        entries = None
