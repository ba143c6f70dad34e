"""The task lifecycle stream: every step of every task, written by the gateway, folded into a task table.

Each entry carries the step (`k`) and the task's whole record after it (`t`, a serialized
hsched.v1.Task), so the fold is "last record per task id" and a restarted gateway rebuilds exactly
the table it had, request-id index included. Writes are group-committed: concurrent requests'
events go to Redis in one pipelined round trip, and each caller awaits its own entry id before it
answers — nothing acknowledged is lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from hsched.v1 import common_pb2 as pb

log = logging.getLogger(__name__)

STATE_OF_KIND = {"submitted": pb.TASK_STATE_SUBMITTED, "dc_selected": pb.TASK_STATE_SUBMITTED,
                 "placed": pb.TASK_STATE_PLACED, "deferred": pb.TASK_STATE_DEFERRED,
                 "rejected": pb.TASK_STATE_REJECTED, "released": pb.TASK_STATE_RELEASED}


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class _Pending:
    fields: dict[bytes, bytes]
    future: asyncio.Future


@dataclass
class TaskStore:
    redis: aioredis.Redis
    stream: str
    tasks: dict[str, pb.Task] = field(default_factory=dict)
    by_request: dict[tuple[str, str], str] = field(default_factory=dict)  # (tenant, request_id) -> task id
    last_id: str = "0-0"
    _pending: list[_Pending] = field(default_factory=list)
    _flusher: asyncio.Task | None = None
    _kept: dict[str, tuple[int, int]] = field(default_factory=dict)  # task id -> its record `prune` re-appended

    async def load(self, batch: int = 5000) -> int:
        """Rebuild the table from the stream; returns the number of entries read."""
        count, start = 0, "-"
        while True:
            entries = await self.redis.xrange(self.stream, min=start, max="+", count=batch)
            for entry_id, fields in entries:
                self._fold(pb.Task.FromString(fields[b"t"]))
                self.last_id = entry_id.decode()
            count += len(entries)
            if len(entries) < batch:
                return count
            start = f"({self.last_id}"

    def _fold(self, task: pb.Task) -> None:
        self.tasks[task.task_id] = task
        if task.spec.request_id:
            self.by_request[(task.spec.tenant, task.spec.request_id)] = task.task_id

    def record(self, kind: str, task: pb.Task, detail: str = "") -> asyncio.Future[str]:
        """Apply a lifecycle step to `task` and queue it for the stream, serialized now (so the caller may
        go on changing `task`); await the returned future for durability (the entry id)."""
        task.state = STATE_OF_KIND[kind]
        task.updated_unix_ms = now_ms()
        data = task.SerializeToString()  # the stream entry is this moment's record, whatever comes next
        self._fold(task)  # the table holds the live record: the single event loop sees it between steps
        fields = {b"k": kind.encode(), b"t": data, b"d": detail.encode()}
        pending = _Pending(fields, asyncio.get_running_loop().create_future())
        self._pending.append(pending)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return pending.future

    async def _flush(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for p in batch:
                        pipe.xadd(self.stream, p.fields)
                    ids = await pipe.execute()
            except Exception as exc:  # noqa: BLE001 - every waiting caller hears about it
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(exc)
                continue
            for p, entry_id in zip(batch, ids, strict=True):
                self.last_id = entry_id.decode()
                if not p.future.done():
                    p.future.set_result(self.last_id)

    async def events(self, after: str, block_ms: int = 1000) -> AsyncIterator[pb.TaskEvent]:
        """Stream events after entry id `after` ("$" = only new ones, "0" = from the start), forever."""
        cursor = after
        if not after or after == "$":  # resolve "now" to a concrete id so no event slips between reads
            latest = await self.redis.xrevrange(self.stream, count=1)
            cursor = latest[0][0].decode() if latest else "0-0"
        while True:
            reply = await self.redis.xread({self.stream: cursor}, count=500, block=block_ms)
            if not reply:
                continue
            for entry_id, fields in reply[0][1]:
                cursor = entry_id.decode()
                yield event_of(cursor, fields)


TERMINAL = (pb.TASK_STATE_REJECTED, pb.TASK_STATE_RELEASED)
KIND_OF_STATE = {pb.TASK_STATE_SUBMITTED: "submitted", pb.TASK_STATE_PLACED: "placed",
                 pb.TASK_STATE_DEFERRED: "deferred", pb.TASK_STATE_REJECTED: "rejected",
                 pb.TASK_STATE_RELEASED: "released"}


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
        key = (task.spec.tenant, task.spec.request_id)
        if store.by_request.get(key) == task.task_id:
            del store.by_request[key]
    # `updated_unix_ms` is the gateway's clock, entry ids Redis's: `margin_ms` covers the difference
    old = [t for t in store.tasks.values() if max(t.updated_unix_ms, store._kept.get(t.task_id, (0, 0))[0])
           < cutoff + margin_ms]
    if old:
        async with store.redis.pipeline(transaction=False) as pipe:
            for task in old:
                pipe.xadd(store.stream, {b"k": KIND_OF_STATE.get(task.state, "submitted").encode(),
                                         b"t": task.SerializeToString(), b"d": b"kept by compaction"})
            kept = await pipe.execute()
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
                        unix_ms=task.updated_unix_ms, tenant=task.spec.tenant)
