"""The task lifecycle stream: every step of every task, written by the gateway, folded into a task table.

Each entry carries the step (`k`) and the task's whole record after it (`t`, a serialized
hsched.v1.Task), so the fold is "last record per task id" and a restarted gateway rebuilds exactly
the table it had, request-id index included. Writes are group-committed: concurrent requests'
events go to Redis in one pipelined round trip, and each caller awaits its own entry id before it
answers — nothing acknowledged is lost.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from hsched.state.ledger import StateLost
from hsched.state.redis import check_replicated
from hsched.v1 import common_pb2 as pb

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
    epoch_key: str = ""  # with `epoch`: every flush first checks that Redis still holds it (hsched.state.epoch)
    epoch: str | None = None
    min_replicas: int = 0  # replicas that must hold a flush before its callers hear it is durable (WAIT)
    wait_timeout_ms: int = 1000

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
        # One pipeline, one connection: [GET epoch,] XADD..., [WAIT n]. Redis runs a connection's commands in
        # order, so the epoch read is of the same dataset the XADDs land in, and WAIT counts exactly these writes.
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    if self.epoch:
                        pipe.get(self.epoch_key)
                    for p in batch:
                        pipe.xadd(self.stream, p.fields)
                    if self.min_replicas:
                        pipe.execute_command("WAIT", self.min_replicas, self.wait_timeout_ms)
                    replies = await pipe.execute()
                if self.epoch:
                    found, replies = replies[0], replies[1:]
                    if (found.decode() if isinstance(found, bytes) else found) != self.epoch:
                        raise StateLost(f"Redis no longer holds epoch {self.epoch} ({self.epoch_key}); the task "
                                        "stream cannot be trusted")
                if self.min_replicas:
                    replies, acked = replies[:-1], replies[-1]
                    check_replicated(acked, self.min_replicas, "the task stream write")
            except Exception as exc:  # noqa: BLE001 - every waiting caller hears about it
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(exc)
                continue
            for p, entry_id in zip(batch, replies, strict=True):
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


def event_of(entry_id: str, fields: dict[bytes, bytes]) -> pb.TaskEvent:
    task = pb.Task.FromString(fields[b"t"])
    return pb.TaskEvent(event_id=entry_id, task_id=task.task_id, kind=fields[b"k"].decode(), state=task.state,
                        datacenter=task.datacenter, detail=fields.get(b"d", b"").decode(),
                        unix_ms=task.updated_unix_ms, tenant=task.spec.tenant)
