"""The task lifecycle stream: every step of every task, written by the gateway, folded into a task table.

Each entry carries the step (`k`) and the task's whole record after it (`t`, a serialized
hsched.v1.Task), so the fold is "last record per task id" and a restarted gateway rebuilds exactly
the table it had, request-id index included. Writes are group-committed: concurrent requests'
records go to Redis in one atomic Lua script (after an epoch check) per round trip, and each caller awaits its own entry ids before it
answers — nothing acknowledged is lost.

The table only ever shows what is durable: a write's records are folded in once Redis has accepted them,
and a write that fails leaves the table as it was (its caller answers UNAVAILABLE). The records one caller
writes together (a Submit's submitted, dc_selected and placed) are durable together or not at all.

Several gateways may share one stream (docs/operations.md, "Several gateways"). Every write is then checked
against the task's version — the entry id of its newest record, kept by the append script in a hash next to
the stream — so a writer whose table is behind gets `Conflict` (it catches up with `refresh` and decides again)
instead of appending a step taken from a stale record; a group may also carry fences (keys that must still
hold a value: the writer's gateway lease, a request's claim) so nothing lands for a writer that lost them.
Each table follows the stream (`observe`, fed by the gateway's one stream reader) and folds by entry id: the
records of other writers show up, and a record never overwrites a newer one of the same task.

A write whose reply was lost may still have reached Redis. The gateway then writes an `abandoned` record for
that task (`ABANDONED`): the task is dropped from the table and its request id is free again, and whatever
the stream holds for that task id, before or after, is ignored — so a later replay never resurrects a task
the client was told had failed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from hsched.state.ledger import StateLost
from hsched.state.redis import run_replicated
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
# A DAG job's own records (hsched.jobs) share the stream: `t` holds a serialized hsched.v1.Job instead of a Task.
JOB_STATE_OF_KIND = {"job_submitted": pb.JOB_STATE_PENDING, "job_running": pb.JOB_STATE_RUNNING,
                     "job_succeeded": pb.JOB_STATE_SUCCEEDED, "job_failed": pb.JOB_STATE_FAILED,
                     "job_cancelled": pb.JOB_STATE_CANCELLED}
JOB_KINDS = frozenset(k.encode() for k in JOB_STATE_OF_KIND)
JOB_TERMINAL = (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED)


_RECORD_FIELDS = (b"k", b"t", b"d", b"l")
ANY = "*"  # a record's expected version: written whatever the task's version is
# KEYS: stream, epoch key, versions hash (task or job id -> the entry id of its newest record). ARGV: epoch
# ('' = unchecked), then per group of records written together: n records, f fences, d (the last d fences are
# deleted once the group is written: a request's claim, so dropping it costs no round trip of its own), the
# fences (key, value: the key must hold that value), then per record k, t, d, l, id, expected version ('' = none
# yet, ANY = unchecked; a version the hash does not hold, written before versions were kept or pruned, is not
# checked). Returns per group its entry ids, or 0 when a fence or a version did not hold (nothing of it written).
_APPEND = """
if ARGV[1] ~= '' and redis.call('GET', KEYS[2]) ~= ARGV[1] then return redis.error_reply('EPOCH') end
local out = {}
local i = 2
while i <= #ARGV do
  local n, f, d = tonumber(ARGV[i]), tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  local r0 = i + 3 + 2 * f
  local ok = true
  for j = 0, f - 1 do
    if redis.call('GET', ARGV[i + 3 + 2 * j]) ~= ARGV[i + 4 + 2 * j] then ok = false end
  end
  for j = 0, n - 1 do
    local b = r0 + 6 * j
    if ok and ARGV[b + 5] ~= '*' then
      local have = redis.call('HGET', KEYS[3], ARGV[b + 4])
      if (have and have ~= ARGV[b + 5]) then ok = false end
    end
  end
  if ok then
    local ids = {}
    local newest = {}
    for j = 0, n - 1 do
      local b = r0 + 6 * j
      local id
      if ARGV[b + 3] == '' then
        id = redis.call('XADD', KEYS[1], '*', 'k', ARGV[b], 't', ARGV[b + 1], 'd', ARGV[b + 2])
      else
        id = redis.call('XADD', KEYS[1], '*', 'k', ARGV[b], 't', ARGV[b + 1], 'd', ARGV[b + 2], 'l', ARGV[b + 3])
      end
      newest[ARGV[b + 4]] = id
      ids[#ids + 1] = id
    end
    local hset = {}
    for key, id in pairs(newest) do
      hset[#hset + 1] = key
      hset[#hset + 1] = id
    end
    if #hset > 0 then redis.call('HSET', KEYS[3], unpack(hset)) end
    for j = f - d, f - 1 do redis.call('DEL', ARGV[i + 3 + 2 * j]) end
    out[#out + 1] = ids
  else
    out[#out + 1] = 0
  end
  i = r0 + 6 * n
end
return out
"""


class Conflict(Exception):
    """A write whose fence or expected version did not hold: another writer went first (or this one lost its
    lease or claim); nothing of it was written."""


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class Record:
    """One lifecycle step, serialized when it was taken (the caller may go on changing its task)."""

    kind: str
    task_id: str
    fields: dict[bytes, bytes]
    expect: str | None = None  # the version the write expects (None: what the table shows when written)


def ledger_ref(dc: str, entry_id: str) -> str:
    """The `l` field of a record that reflects DC ledger entry `entry_id` ("<dc> <entry id>")."""
    return f"{dc} {entry_id}"


def parse_ledger_ref(ref: bytes | str) -> tuple[str, tuple[int, int]]:
    dc, _, entry_id = (ref.decode() if isinstance(ref, bytes) else ref).rpartition(" ")
    return dc, _entry_id(entry_id.encode())


OWN_PRUNE_MIN = 10_000  # own entry ids kept unread before the first prune


def step(kind: str, task: pb.Task, detail: str = "", ledger: str = "", at_ms: int = 0) -> Record:
    """Apply lifecycle step `kind` to `task` (state, time) and take the record of this moment. `ledger`: the
    `ledger_ref` of the DC ledger entry this step reflects (a placer-initiated transition); `at_ms`: when the
    step happened if not now (a placer's time)."""
    task.state = STATE_OF_KIND[kind]
    task.updated_unix_ms = at_ms or now_ms()
    return Record(kind, task.task_id, {b"k": kind.encode(), b"t": task.SerializeToString(), b"d": detail.encode(),
                                       b"l": ledger.encode()})


def job_step(kind: str, job: pb.Job, detail: str = "") -> Record:
    """Apply job step `kind` to `job` (state, time) and take the record of this moment."""
    job.state = JOB_STATE_OF_KIND[kind]
    job.updated_unix_ms = now_ms()
    return Record(kind, job.job_id, {b"k": kind.encode(), b"t": job.SerializeToString(), b"d": detail.encode(),
                                     b"l": b""})


@dataclass
class _Pending:
    records: tuple[Record, ...]
    future: asyncio.Future
    fences: tuple[tuple[str, str], ...] = ()
    expects: tuple[str, ...] = ()
    drop: int = 0  # the last `drop` fences are deleted once the records are written


@dataclass
class TaskStore:
    redis: aioredis.Redis
    stream: str
    tasks: dict[str, pb.Task] = field(default_factory=dict)
    # (tenant, request_id) -> task id. The tenant is the record's spec.tenant, which the gateway sets to the
    # caller's authenticated tenant before the first record: a restart rebuilds the same per-tenant keys.
    by_request: dict[tuple[str, str], str] = field(default_factory=dict)
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
    jobs: dict[str, pb.Job] = field(default_factory=dict)  # DAG jobs (hsched.jobs), last record per job id
    jobs_by_request: dict[tuple[str, str], str] = field(default_factory=dict)  # (tenant, request_id) -> job id
    # DC -> the newest ledger entry id a record reflects (where that DC's ledger follower resumes)
    ledger_cursor: dict[str, tuple[int, int]] = field(default_factory=dict)
    ledger_refs: dict[str, bytes] = field(default_factory=dict)  # task id -> the `l` of its newest such record
    transitions: Transitions | None = None  # told of every record once durable (not of those `load` replays)
    job_observed: Callable[[str], None] | None = None  # told the job id of another gateway's job record
    # task or job id -> the entry id of the newest record the table holds for it (folds go by it: see `observe`)
    versions: dict[str, tuple[int, int]] = field(default_factory=dict)
    tail: tuple[int, int] = (0, 0)  # every entry up to here is folded (`load`, `observe`, `refresh`)
    versions_key: str = ""  # the append script's hash of versions; default: "<stream>:versions"
    # entry ids of this table's own writes not yet seen by `observe` (which then skips them without parsing)
    _own: set[tuple[int, int]] = field(default_factory=set)
    _own_prune_at: int = OWN_PRUNE_MIN  # `_own`'s size that triggers the next prune

    def __post_init__(self) -> None:
        self._append = self.redis.register_script(_APPEND)
        self._barrier = self.redis.register_script("return redis.call('SET', KEYS[1], ARGV[1])")  # `replicated`
        self.versions_key = self.versions_key or f"{self.stream}:versions"

    def _keys(self) -> list[str]:
        return [self.stream, self.epoch_key or self.stream, self.versions_key]

    async def load(self, batch: int = 5000) -> int:
        """Rebuild the table from the stream; returns the number of entries read."""
        count, start = 0, "-"
        while True:
            entries = await self.redis.xrange(self.stream, min=start, max="+", count=batch)
            for entry_id, fields in entries:
                self.observe(entry_id, fields, notify=False)
                self.last_id = entry_id.decode()
            count += len(entries)
            if len(entries) < batch:
                return count
            start = f"({self.last_id}"

    def observe(self, entry_id: bytes | str, fields: dict[bytes, bytes], notify: bool = True) -> bool:
        """Fold task-stream entry `entry_id` unless the table already holds its record or a newer one of that
        task (job): entries arrive here from `load`, the gateway's stream reader and `refresh`, in stream order
        each but overlapping, and this gateway's own writes are folded when written. A task record folded here
        was another gateway's: `transitions` hears of it too (`notify`; not of what `load` replays). True if
        folded."""
        sid = _entry_id(entry_id if isinstance(entry_id, bytes) else entry_id.encode())
        if sid > self.tail:
            self.tail = sid
        if sid in self._own:  # this table's own write, folded when written: not parsed again
            self._own.discard(sid)
            return False
        kind = fields[b"k"].decode()
        if kind in JOB_STATE_OF_KIND:
            key = pb.Job.FromString(fields[b"t"]).job_id
        else:
            key = pb.Task.FromString(fields[b"t"]).task_id
        if sid <= self.versions.get(key, (0, 0)):
            return False
        self.versions[key] = sid
        self._fold_entry(kind, fields[b"t"])
        if kind not in JOB_STATE_OF_KIND:
            self._ledger_seen(key, fields.get(b"l"))
            if notify and self.transitions is not None and self.transitions.wants(key):
                self.transitions.notify(pb.Task.FromString(fields[b"t"]), kind)
        elif notify and self.job_observed is not None:
            self.job_observed(key)
        return True

    async def refresh(self, batch: int = 1000) -> int:
        """Fold every entry of the stream beyond `tail` (another gateway's records): once this returns, the
        table holds everything written before it was called. Returns the entries read."""
        count = 0
        while True:
            entries = await self.redis.xrange(self.stream, min=f"({self.tail[0]}-{self.tail[1]}", max="+",
                                              count=batch)
            for entry_id, fields in entries:
                self.observe(entry_id, fields)
            count += len(entries)
            if len(entries) < batch:
                return count

    async def replicated(self, task_id: str) -> bool:
        """Whether the table's record of `task_id` is on the replicas every write must reach (`min_replicas`). A
        record read back from the master may be one whose write failed as NotReplicated, which a failover loses:
        a barrier write confirmed on them covers every entry before it (replication is in order), then the entry
        must still be there (not lost to a failover meanwhile). Raises NotReplicated or a Redis error when that
        cannot be told now."""
        if not self.min_replicas:
            return True
        await run_replicated(self._barrier, [f"{self.stream}:barrier"], [task_id], self.redis, self.min_replicas,
                             self.wait_timeout_ms, "the task stream's replication barrier")
        entry = self.version(task_id)
        return bool(entry) and bool(await self.redis.xrange(self.stream, min=entry, max=entry, count=1))

    async def confirm(self, key: str) -> bool:
        """Whether the table's record of task (or job) `key` is durable (`replicated`). When a failover lost it,
        the table takes the record Redis holds now instead (`revert`; none: the key is forgotten, its request id
        free again) and the answer is False. Raises NotReplicated or a Redis error when that cannot be told now."""
        if await self.replicated(key):
            return True
        log.warning("the newest record of %s is no longer in Redis (lost with a failed-over master before it was "
                    "replicated): the table takes the one Redis holds now", key)
        await self.revert(key)
        return False

    async def kept(self, key: str) -> bool:
        """After a write of `key` failed as NotReplicated (on the master, maybe not on its replicas): True once
        the replicas hold its record, False once a failover lost it; raises while that cannot be told."""
        await self.refresh()  # the record, as the master has it (none: lost)
        return (key in self.tasks or key in self.jobs) and await self.replicated(key)

    async def revert(self, key: str) -> None:
        """The table's newest record of task `key` is not in Redis any more (`replicated` said so: a failover lost
        it): take the record Redis holds now instead (the one its versions hash names), or forget the task."""
        entry = await self.redis.hget(self.versions_key, key)
        found = await self.redis.xrange(self.stream, min=entry, max=entry, count=1) if entry else []
        if not found:
            self.forget(key)
            return
        [(entry_id, fields)] = found
        self.versions[key] = _entry_id(entry_id)
        self._fold_entry(fields[b"k"].decode(), fields[b"t"])

    def forget(self, key: str) -> None:
        """Drop task (or job) `key` from the table (not from the stream): its record is not in Redis any more
        (`replicated` said so), its request id free again."""
        job = self.jobs.pop(key, None)
        if job is not None:
            self.versions.pop(key, None)
            if self.jobs_by_request.get(request := (job.spec.tenant, job.spec.request_id)) == key:
                del self.jobs_by_request[request]
        elif (task := self.tasks.get(key)) is not None:
            self._fold(ABANDONED, task)

    def version(self, key: str) -> str:
        """The expected version of a write of task (job) `key`: the entry id of the record the table holds."""
        v = self.versions.get(key)
        return f"{v[0]}-{v[1]}" if v else ""

    def _fold_entry(self, kind: str, record: bytes) -> None:
        if kind in JOB_STATE_OF_KIND:
            job = pb.Job.FromString(record)
            self.jobs[job.job_id] = job
            if job.spec.request_id:
                self.jobs_by_request[(job.spec.tenant, job.spec.request_id)] = job.job_id
        else:
            self._fold(kind, pb.Task.FromString(record))

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

    def write(self, *records: Record, fences: tuple[tuple[str, str], ...] = (),
              drop: tuple[tuple[str, str], ...] = ()) -> asyncio.Future[list[str]]:
        """Queue `records` as one unit: durable together or not at all. Await the returned future for their entry
        ids; the table shows them only once it is resolved, and never if it fails. A task's (and a job's) records
        expect the version the table shows now (`Conflict` if another writer went first: for a job, a CancelJob
        and its owner's step never overwrite one another), an `abandoned` record none; every (key, value) of
        `fences` and `drop` must hold in Redis when they are written, and the keys of `drop` are deleted with
        them (a request's claim, once its records answer retries)."""
        expects = tuple(r.expect if r.expect is not None else ANY if r.kind == ABANDONED else self.version(r.task_id)
                        for r in records)
        pending = _Pending(records, asyncio.get_running_loop().create_future(), (*fences, *drop), expects,
                           len(drop))
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

    def _forget_own_below_tail(self) -> None:
        """Entry ids `observe` will never see (the table's tail passed them without a read: `load`): dropped.
        The next prune waits until the set has doubled, so a table whose tail does not move (no reader, or one
        that lags) prunes in amortised O(1) per write instead of scanning the whole set on every flush."""
        if len(self._own) > self._own_prune_at:
            self._own = {sid for sid in self._own if sid > self.tail}
            self._own_prune_at = max(OWN_PRUNE_MIN, 2 * len(self._own))

    async def _flush(self) -> None:
        # One EVAL (epoch check + every XADD, atomic: a batch lands whole or not at all, and never in a Redis
        # that lost the epoch), then WAIT n with min_replicas (run_replicated)
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                args: list = [self.epoch or ""]
                for p in batch:
                    args += [len(p.records), len(p.fences), p.drop, *(x for fence in p.fences for x in fence)]
                    for r, expect in zip(p.records, p.expects, strict=True):
                        args += [*(r.fields.get(f, b"") for f in _RECORD_FIELDS), r.task_id, expect]
                ids = await run_replicated(self._append, self._keys(), args, self.redis, self.min_replicas,
                                           self.wait_timeout_ms, "the task stream write")
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
            for p, group in zip(batch, ids, strict=True):
                if not isinstance(group, list):
                    if not p.future.done():
                        p.future.set_exception(Conflict(
                            f"{p.records[0].task_id}: another writer changed it first, or this writer no longer "
                            "holds its lease or claim"))
                    continue
                entry_ids = [i.decode() for i in group]
                last: dict[str, Record] = {r.task_id: r for r in p.records}  # the fold keeps the last per task
                for r, entry_id in zip(p.records, entry_ids, strict=True):
                    sid = _entry_id(entry_id.encode())
                    if sid > self.tail:
                        self._own.add(sid)  # not yet read back by `observe`
                    if sid <= self.versions.get(r.task_id, (0, 0)):
                        continue  # the stream reader folded a newer record of it already (an unchecked write)
                    if r.kind == ABANDONED or last[r.task_id] is r:
                        self._fold_entry(r.kind, r.fields[b"t"])
                    if last[r.task_id] is r:
                        self.versions[r.task_id] = sid
                    self._ledger_seen(r.task_id, r.fields.get(b"l"))
                if self.transitions is not None and self.transitions.active:
                    for r in p.records:
                        if r.kind not in JOB_STATE_OF_KIND and self.transitions.wants(r.task_id):
                            self.transitions.notify(pb.Task.FromString(r.fields[b"t"]), r.kind)
                if entry_ids:
                    self.last_id = entry_ids[-1]
                self._forget_own_below_tail()
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


KIND_OF_JOB_STATE = {state: kind for kind, state in JOB_STATE_OF_KIND.items()}


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
    # a job is forgotten with its tasks once finished; a live job's finished tasks are its progress: kept
    gone_jobs = [j for j in store.jobs.values() if j.state in JOB_TERMINAL and j.updated_unix_ms < cutoff]
    for job in gone_jobs:
        del store.jobs[job.job_id]
        store._kept.pop(job.job_id, None)
        store.versions.pop(job.job_id, None)
        key = (job.spec.tenant, job.spec.request_id)
        if store.jobs_by_request.get(key) == job.job_id:
            del store.jobs_by_request[key]
    gone = [t for t in store.tasks.values() if t.state in TERMINAL and t.updated_unix_ms < cutoff
            and (not t.spec.job_id or t.spec.job_id not in store.jobs)]
    for task in gone:
        del store.tasks[task.task_id]
        store._kept.pop(task.task_id, None)
        store.ledger_refs.pop(task.task_id, None)
        store.versions.pop(task.task_id, None)
        key = (task.spec.tenant, task.spec.request_id)
        if store.by_request.get(key) == task.task_id:
            del store.by_request[key]
    # `updated_unix_ms` is the gateway's clock, entry ids Redis's: `margin_ms` covers the difference
    old = [t for t in store.tasks.values() if max(t.updated_unix_ms, store._kept.get(t.task_id, (0, 0))[0])
           < cutoff + margin_ms]
    old_jobs = [j for j in store.jobs.values() if max(j.updated_unix_ms, store._kept.get(j.job_id, (0, 0))[0])
                < cutoff + margin_ms]
    if gone or gone_jobs:
        await store.redis.hdel(store.versions_key, *(t.task_id for t in gone), *(j.job_id for j in gone_jobs))
    if old or old_jobs:
        # through the store's own append script: the same epoch check as every task-stream write, and each record
        # only if it is still its task's newest (another gateway may have written a step since: then that stays)
        args = [store.epoch or ""]
        for task in old:
            # with the ledger entry its state reflects: a restarted gateway's ledger followers resume from there
            args += [1, 0, 0, KIND_OF_STATE.get(task.state, "submitted"), task.SerializeToString(), "kept by compaction",
                     store.ledger_refs.get(task.task_id, b""), task.task_id, store.version(task.task_id)]
        for job in old_jobs:
            args += [1, 0, 0, KIND_OF_JOB_STATE[job.state], job.SerializeToString(), "kept by compaction", b"",
                     job.job_id, store.version(job.job_id)]
        kept = await store._append(keys=store._keys(), args=args)
        for key, group in zip([*(t.task_id for t in old), *(j.job_id for j in old_jobs)], kept, strict=True):
            if isinstance(group, list):
                store._kept[key] = store.versions[key] = _entry_id(group[0])
    # never trim a record written again that is still its task's (job's) latest, whatever the clocks say
    latest = {**{t: r.updated_unix_ms for t, r in store.tasks.items()},
              **{j: r.updated_unix_ms for j, r in store.jobs.items()}}
    trim_at = min([(cutoff, 0), *(k for t, k in store._kept.items() if latest[t] <= k[0])])
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
    kind = fields[b"k"].decode()
    if kind in JOB_STATE_OF_KIND:  # a job's own event: task_id "" (TaskEvent.job_id says which job)
        job = pb.Job.FromString(fields[b"t"])
        return pb.TaskEvent(event_id=entry_id, kind=kind, datacenter=job.datacenter, job_id=job.job_id,
                            detail=fields.get(b"d", b"").decode(), unix_ms=job.updated_unix_ms, tenant=job.spec.tenant)
    task = pb.Task.FromString(fields[b"t"])
    return pb.TaskEvent(event_id=entry_id, task_id=task.task_id, kind=kind, state=task.state,
                        datacenter=task.datacenter, detail=fields.get(b"d", b"").decode(),
                        unix_ms=task.updated_unix_ms, tenant=task.spec.tenant, job_id=task.spec.job_id)
