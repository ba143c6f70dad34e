"""The task lifecycle stream: every step of every task, written by the gateway, folded into a task table.

Each entry carries the step (`k`) and the task's whole record after it (`t`, a serialized
hsched.v1.Task), so the fold is "last record per task id" and a restarted gateway rebuilds exactly
the table it had, request-id index included. Writes are group-committed: concurrent requests'
records go to Redis in one atomic Lua script (after an epoch check) per round trip, and each caller awaits its own entry ids before it
answers — nothing acknowledged is lost.

The table only ever shows what is durable: a write's records are folded in once Redis has accepted them,
and a write that fails leaves the table as it was (its caller answers UNAVAILABLE). The records one caller
writes together (a Submit's submitted, dc_selected and placed) are durable together or not at all.

A write whose reply was lost may still have reached Redis. The gateway then writes an `abandoned` record for
that task (`ABANDONED`): the task is dropped from the table and its request id is free again, and whatever
the stream holds for that task id, before or after, is ignored — so a later replay never resurrects a task
the client was told had failed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from hsched.state.ledger import StateLost
from hsched.state.redis import check_replicated
from hsched.state.transitions import Transitions
from hsched.v1 import common_pb2 as pb

log = logging.getLogger(__name__)
ABANDONED = "abandoned"  # an attempt that never reached a final answer: not in the table, its request id free
STATE_OF_KIND = {"submitted": pb.TASK_STATE_SUBMITTED, "dc_selected": pb.TASK_STATE_SUBMITTED,
                 "placed": pb.TASK_STATE_PLACED, "deferred": pb.TASK_STATE_DEFERRED,
                 "rejected": pb.TASK_STATE_REJECTED, "released": pb.TASK_STATE_RELEASED,
                 "running": pb.TASK_STATE_RUNNING, "succeeded": pb.TASK_STATE_SUCCEEDED,
                 "failed": pb.TASK_STATE_FAILED, "preempted": pb.TASK_STATE_PREEMPTED, "expired": pb.TASK_STATE_EXPIRED,
                 ABANDONED: pb.TASK_STATE_REJECTED}


_RECORD_FIELDS = (b"k", b"t", b"d", b"l")
# KEYS: stream, epoch key; ARGV: epoch ('' = unchecked), then k, t, d, l of each record (field l only when not
# empty). Returns the entry ids.
_APPEND = """
if ARGV[1] ~= '' and redis.call('GET', KEYS[2]) ~= ARGV[1] then return redis.error_reply('EPOCH') end
local ids = {}
for i = 2, #ARGV, 4 do
  if ARGV[i + 3] == '' then
    ids[#ids + 1] = redis.call('XADD', KEYS[1], '*', 'k', ARGV[i], 't', ARGV[i + 1], 'd', ARGV[i + 2])
  else
    ids[#ids + 1] = redis.call('XADD', KEYS[1], '*', 'k', ARGV[i], 't', ARGV[i + 1], 'd', ARGV[i + 2],
                               'l', ARGV[i + 3])
  end
end
return ids
"""


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class Record:
    """One lifecycle step, serialized when it was taken (the caller may go on changing its task)."""

    kind: str
    task_id: str
    fields: dict[bytes, bytes]


def ledger_ref(dc: str, entry_id: str) -> str:
    """The `l` field of a record that reflects DC ledger entry `entry_id` ("<dc> <entry id>")."""
    return f"{dc} {entry_id}"


def parse_ledger_ref(ref: bytes | str) -> tuple[str, tuple[int, int]]:
    dc, _, entry_id = (ref.decode() if isinstance(ref, bytes) else ref).rpartition(" ")
    return dc, _entry_id(entry_id.encode())


def step(kind: str, task: pb.Task, detail: str = "", ledger: str = "", at_ms: int = 0) -> Record:
    """Apply lifecycle step `kind` to `task` (state, time) and take the record of this moment. `ledger`: the
    `ledger_ref` of the DC ledger entry this step reflects (a placer-initiated transition); `at_ms`: when the
    step happened if not now (a placer's time)."""
    task.state = STATE_OF_KIND[kind]
    task.updated_unix_ms = at_ms or now_ms()
    return Record(kind, task.task_id, {b"k": kind.encode(), b"t": task.SerializeToString(), b"d": detail.encode(),
                                       b"l": ledger.encode()})


@dataclass
class _Pending:
    records: tuple[Record, ...]
    future: asyncio.Future


@dataclass
class TaskStore:
    redis: aioredis.Redis
    stream: str
    tasks: dict[str, pb.Task] = field(default_factory=dict)
    by_request: dict[tuple[str, str], str] = field(default_factory=dict)  # (tenant, request_id) -> task id
    last_id: str = "0-0"
    abandoned: set[str] = field(default_factory=set)  # task ids whose records are all ignored (ABANDONED)
    _pending: list[_Pending] = field(default_factory=list)
    _flusher: asyncio.Task | None = None
    _kept: dict[str, tuple[int, int]] = field(default_factory=dict)  # task id -> its record `prune` re-appended
    epoch_key: str = ""  # with `epoch`: every flush first checks that Redis still holds it (hsched.state.epoch)
    epoch: str | None = None
    min_replicas: int = 0  # replicas that must hold a flush before its callers hear it is durable (WAIT)
    wait_timeout_ms: int = 1000
    _writing: dict[str, asyncio.Future] = field(default_factory=dict)  # task id -> its latest write in flight
    # DC -> the newest ledger entry id a record reflects (where that DC's ledger follower resumes)
    ledger_cursor: dict[str, tuple[int, int]] = field(default_factory=dict)
    ledger_refs: dict[str, bytes] = field(default_factory=dict)  # task id -> the `l` of its newest such record
    transitions: Transitions | None = None  # told of every record once durable (not of those `load` replays)

    def __post_init__(self) -> None:
        self._append = self.redis.register_script(_APPEND)

    async def load(self, batch: int = 5000) -> int:
        """Rebuild the table from the stream; returns the number of entries read."""
        count, start = 0, "-"
        while True:
            entries = await self.redis.xrange(self.stream, min=start, max="+", count=batch)
            for entry_id, fields in entries:
                task = pb.Task.FromString(fields[b"t"])
                self._fold(fields[b"k"].decode(), task)
                self._ledger_seen(task.task_id, fields.get(b"l"))
                self.last_id = entry_id.decode()
            count += len(entries)
            if len(entries) < batch:
                return count
            start = f"({self.last_id}"

    def _fold(self, kind: str, task: pb.Task) -> None:
        if task.task_id in self.abandoned:
            return
        if kind == ABANDONED:
            self.abandoned.add(task.task_id)
            gone = self.tasks.pop(task.task_id, None)
            if gone is not None and gone.spec.request_id:
                key = (gone.spec.tenant, gone.spec.request_id)
                if self.by_request.get(key) == task.task_id:
                    del self.by_request[key]
            return
        self.tasks[task.task_id] = task
        if task.spec.request_id:
            self.by_request[(task.spec.tenant, task.spec.request_id)] = task.task_id

    def _ledger_seen(self, task_id: str, ref: bytes | None) -> None:
        if not ref:
            return
        dc, entry = parse_ledger_ref(ref)
        if entry > self.ledger_cursor.get(dc, (0, 0)):
            self.ledger_cursor[dc] = entry
        self.ledger_refs[task_id] = ref

    def copy(self, task_id: str) -> pb.Task | None:
        """A copy of the table's record to take the next step on: the table changes only once that is durable."""
        known = self.tasks.get(task_id)
        if known is None:
            return None
        mine = pb.Task()
        mine.CopyFrom(known)
        return mine

    async def settled(self, task_id: str) -> None:
        """Wait until no write of `task_id` is in flight (whatever its outcome), so the table shows its last word."""
        while (writing := self._writing.get(task_id)) is not None:
            await asyncio.wait([writing])

    def write(self, *records: Record) -> asyncio.Future[list[str]]:
        """Queue `records` as one unit: durable together or not at all. Await the returned future for their entry
        ids; the table shows them only once it is resolved, and never if it fails."""
        pending = _Pending(records, asyncio.get_running_loop().create_future())
        pending.future.add_done_callback(lambda f: f.cancelled() or f.exception())  # a caller may be gone
        for r in records:
            self._writing[r.task_id] = pending.future
        pending.future.add_done_callback(lambda f: self._written(records, f))
        self._pending.append(pending)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return pending.future

    def _written(self, records: tuple[Record, ...], future: asyncio.Future) -> None:
        for r in records:
            if self._writing.get(r.task_id) is future:
                del self._writing[r.task_id]

    def record(self, kind: str, task: pb.Task, detail: str = "") -> asyncio.Future[list[str]]:
        """`step` then `write` one record."""
        return self.write(step(kind, task, detail))

    async def _flush(self) -> None:
        # One pipeline, one connection: EVAL (epoch check + every XADD, atomic: a batch lands whole or not at
        # all, and never in a Redis that lost the epoch), then WAIT n. Redis runs a connection's commands in
        # order, so WAIT counts exactly these writes (inside MULTI it would return at once).
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                args = [self.epoch or "", *(r.fields.get(f, b"") for p in batch for r in p.records for f in _RECORD_FIELDS)]
                async with self.redis.pipeline(transaction=False) as pipe:
                    await self._append(keys=[self.stream, self.epoch_key or self.stream], args=args, client=pipe)
                    if self.min_replicas:
                        pipe.execute_command("WAIT", self.min_replicas, self.wait_timeout_ms)
                    replies = await pipe.execute()
                ids = replies[0]
                if self.min_replicas:
                    check_replicated(replies[1], self.min_replicas, "the task stream write")
            except ResponseError as exc:
                if "EPOCH" not in str(exc):
                    _fail_batch(batch, exc)
                    continue
                _fail_batch(batch, StateLost(f"Redis no longer holds epoch {self.epoch} ({self.epoch_key}); the "
                                            "task stream cannot be trusted"))
                continue
            except Exception as exc:  # noqa: BLE001 - every waiting caller hears about it
                _fail_batch(batch, exc)
                continue
            done = iter(ids)
            for p in batch:
                entry_ids = [next(done).decode() for _ in p.records]
                last: dict[str, Record] = {r.task_id: r for r in p.records}  # the fold keeps the last per task
                for r in p.records:
                    if r.kind == ABANDONED or last[r.task_id] is r:
                        self._fold(r.kind, pb.Task.FromString(r.fields[b"t"]))
                    self._ledger_seen(r.task_id, r.fields.get(b"l"))
                if self.transitions is not None and self.transitions.active:
                    for r in p.records:
                        self.transitions.notify(pb.Task.FromString(r.fields[b"t"]), r.kind)
                if entry_ids:
                    self.last_id = entry_ids[-1]
                if not p.future.done():
                    p.future.set_result(entry_ids)


def _fail_batch(batch: list[_Pending], exc: BaseException) -> None:
    for p in batch:
        if not p.future.done():
            p.future.set_exception(exc)


# states a task never leaves (retention forgets them); FINISHED: ran (or waited) to an end the placer reported
FINISHED = (pb.TASK_STATE_SUCCEEDED, pb.TASK_STATE_FAILED, pb.TASK_STATE_EXPIRED)
TERMINAL = (pb.TASK_STATE_REJECTED, pb.TASK_STATE_RELEASED, *FINISHED)
KIND_OF_STATE = {pb.TASK_STATE_SUBMITTED: "submitted", pb.TASK_STATE_PLACED: "placed",
                 pb.TASK_STATE_DEFERRED: "deferred", pb.TASK_STATE_REJECTED: "rejected",
                 pb.TASK_STATE_RELEASED: "released", pb.TASK_STATE_RUNNING: "running",
                 pb.TASK_STATE_SUCCEEDED: "succeeded", pb.TASK_STATE_FAILED: "failed",
                 pb.TASK_STATE_PREEMPTED: "preempted", pb.TASK_STATE_EXPIRED: "expired"}


def _entry_id(entry_id: bytes) -> tuple[int, int]:
    ms, _, seq = entry_id.decode().partition("-")
    return int(ms), int(seq or 0)


async def prune(store: TaskStore, retention_ms: int, margin_ms: int = 60_000, now: int | None = None
                ) -> tuple[int, int]:
    """Retention of the task stream (docs/operations.md): forget terminal tasks (released, rejected) last
    changed more than `retention_ms` ago, and compact the stream so it stays bounded — re-append the current
    record of every task still in the table whose last entry may be older than the trim point (so a restarted
    gateway rebuilds the same table), then trim everything older (XTRIM MINID). A live task is never lost:
    its record is written again before any entry of it goes. Returns (tasks forgotten, entries trimmed)."""
    now = now_ms() if now is None else now
    cutoff = now - retention_ms
    gone = [t for t in store.tasks.values() if t.state in TERMINAL and t.updated_unix_ms < cutoff]
    for task in gone:
        del store.tasks[task.task_id]
        store._kept.pop(task.task_id, None)
        store.ledger_refs.pop(task.task_id, None)
        key = (task.spec.tenant, task.spec.request_id)
        if store.by_request.get(key) == task.task_id:
            del store.by_request[key]
    # `updated_unix_ms` is the gateway's clock, entry ids Redis's: `margin_ms` covers the difference
    old = [t for t in store.tasks.values() if max(t.updated_unix_ms, store._kept.get(t.task_id, (0, 0))[0])
           < cutoff + margin_ms]
    if old:
        # through the store's own append script: the same epoch check as every task-stream write
        args = [store.epoch or ""]
        for task in old:
            # with the ledger entry its state reflects: a restarted gateway's ledger followers resume from there
            args += [KIND_OF_STATE.get(task.state, "submitted"), task.SerializeToString(), "kept by compaction",
                     store.ledger_refs.get(task.task_id, b"")]
        kept = await store._append(keys=[store.stream, store.epoch_key or store.stream], args=args)
        for task, entry_id in zip(old, kept, strict=True):
            store._kept[task.task_id] = _entry_id(entry_id)
    # never trim a record written again that is still its task's latest, whatever the clocks say
    trim_at = min([(cutoff, 0), *(k for t, k in store._kept.items() if store.tasks[t].updated_unix_ms <= k[0])])
    trimmed = await store.redis.xtrim(store.stream, minid=f"{trim_at[0]}-{trim_at[1]}", approximate=False) \
        if cutoff > 0 else 0
    return len(gone), int(trimmed)


async def keep_pruned(store: TaskStore, retention_s: float, interval_s: float) -> None:
    """`prune` every `interval_s` (the gateway runs it); a failed round is logged and tried again."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            gone, trimmed = await prune(store, int(retention_s * 1000))
            if gone or trimmed:
                log.info("task retention: %d finished tasks forgotten, %d stream entries trimmed", gone, trimmed)
        except Exception:
            log.warning("task retention round failed; retrying in %g s", interval_s, exc_info=True)


def event_of(entry_id: str, fields: dict[bytes, bytes]) -> pb.TaskEvent:
    task = pb.Task.FromString(fields[b"t"])
    return pb.TaskEvent(event_id=entry_id, task_id=task.task_id, kind=fields[b"k"].decode(), state=task.state,
                        datacenter=task.datacenter, detail=fields.get(b"d", b"").decode(),
                        unix_ms=task.updated_unix_ms, tenant=task.spec.tenant, job_id=task.spec.job_id)
