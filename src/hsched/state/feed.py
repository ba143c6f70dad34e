"""Watch fan-out: one reader per gateway tails the task stream and hands every event to the Watch streams (and
to the gateway's task table, which so sees what other gateways write).

Each Watch used to run its own blocking XREAD on a pooled connection, so ~100 idle Watches took the whole
pool and every Submit failed. Here one reader (on a client of its own, never the gateway's shared pool)
blocks on the stream and copies each event into the bounded queue of every subscriber it matches, so the
Redis connections a gateway holds do not grow with its Watches.

A Watch that starts in the past (`after_event_id` older than the reader's position) first catches up with
XRANGE pages up to where the reader is, then joins the live feed in the same step of the event loop — no
event is skipped or sent twice. A subscriber that falls more than `buffer` events behind is ended with
RESOURCE_EXHAUSTED (it can resume from the last event id it got) instead of buffering without bound.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from hsched.cancel import cancel_and_wait
from hsched.domain.errors import ResourceExhausted, ValidationError
from hsched.state.tasks import event_of
from hsched.v1 import common_pb2 as pb

log = logging.getLogger(__name__)

StreamId = tuple[int, int]
_ID = re.compile(r"([0-9]{1,20})(?:-([0-9]{1,20}))?")
_U64 = 2**64


def parse_after(value: str) -> StreamId | None:
    """A Watch's `after_event_id`: None for "" or "$" (only new events), (0, 0) for "0" (from the start), else
    the stream id "<ms>-<seq>" ("<ms>" alone means "<ms>-0")."""
    if value in ("", "$"):
        return None
    m = _ID.fullmatch(value)
    if m is None or int(m[1]) >= _U64 or int(m[2] or 0) >= _U64:
        raise ValidationError("after_event_id", 'must be a task event id ("<ms>-<seq>" as Watch sent it), "", "$" '
                              'or "0"', value if len(value) <= 48 else None)
    return int(m[1]), int(m[2] or 0)


def format_id(sid: StreamId) -> str:
    return f"{sid[0]}-{sid[1]}"


def _parse_id(raw: bytes | str) -> StreamId:
    ms, _, seq = (raw.decode() if isinstance(raw, bytes) else raw).partition("-")
    return int(ms), int(seq or 0)


def matches(event: pb.TaskEvent, task_id: str, tenant: str, job_id: str) -> bool:
    """Whether a Watch for `task_id`, `tenant` and `job_id` ("" = any) gets `event`."""
    return (not task_id or event.task_id == task_id) and (not tenant or event.tenant == tenant) and \
        (not job_id or event.job_id == job_id)


@dataclass(eq=False)
class _Subscriber:
    task_id: str
    tenant: str
    after: StreamId
    buffer: int
    job_id: str = ""
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # events, then None if it overflowed
    overflowed: bool = False

    def offer(self, sid: StreamId, event: pb.TaskEvent) -> bool:
        """Queue `event` if it is for this Watch; False once the subscriber fell too far behind."""
        if sid <= self.after or not matches(event, self.task_id, self.tenant, self.job_id):
            return True
        if self.queue.qsize() >= self.buffer:
            self.overflowed = True
            self.queue.put_nowait(None)
            return False
        self.queue.put_nowait(event)
        return True


class TaskFeed:
    """The one reader of the task stream behind every Watch of a gateway, with caps on open Watches."""

    def __init__(self, redis: aioredis.Redis, stream: str, after: str, max_watches: int = 1000,
                 max_per_tenant: int = 200, buffer: int = 1000, catch_up_readers: int = 4,
                 block_ms: int = 1000, observer: Callable[[bytes, dict], object] | None = None) -> None:
        self.redis = redis  # a client of its own: one connection for the reader, a few for catch-up pages
        self.stream = stream
        self.cursor: StreamId = _parse_id(after)  # the last entry handed to subscribers
        self.max_watches = max_watches
        self.max_per_tenant = max_per_tenant
        self.buffer = buffer
        self.block_ms = block_ms
        self._catch_up = asyncio.Semaphore(catch_up_readers)
        self._subscribers: set[_Subscriber] = set()
        self.open: dict[str, int] = {}  # open Watches by the tenant they watch ("" = every tenant)
        self._reader: asyncio.Task | None = None
        # told of every entry read, before any Watch (the gateway's task table folds other gateways' records)
        self.observer = observer

    @property
    def watching(self) -> int:
        return sum(self.open.values())

    def start(self) -> TaskFeed:
        self._reader = asyncio.create_task(self._read(), name="task feed")
        return self

    async def close(self) -> None:
        if self._reader is not None:
            await cancel_and_wait([self._reader])
        for sub in self._subscribers:
            sub.queue.put_nowait(None)

    async def _read(self) -> None:
        delay = 0.1
        while True:
            try:
                reply = await self.redis.xread({self.stream: format_id(self.cursor)}, count=500, block=self.block_ms)
                delay = 0.1
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - Redis away or the key broken: Watches wait, the reader retries
                log.warning("task feed: cannot read %s (%s: %s); retrying in %.1f s", self.stream,
                            type(exc).__name__, exc, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 5.0)
                continue
            for entry_id, fields in reply[0][1] if reply else ():
                if self.observer is not None:
                    try:
                        self.observer(entry_id, fields)
                    except Exception:  # one bad entry must not stop every Watch (nor the table)
                        log.exception("task feed: cannot fold entry %s", entry_id)
                self.cursor = sid = _parse_id(entry_id)
                if not self._subscribers:  # no Watch open: no event to build (the Submit path's cost)
                    continue
                event = event_of(format_id(sid), fields)
                for sub in [s for s in self._subscribers if not s.offer(sid, event)]:
                    self._subscribers.discard(sub)

    def _admit(self, tenant: str) -> None:
        if self.watching >= self.max_watches:
            raise ResourceExhausted(f"this gateway has {self.watching} Watch streams open, its limit "
                                    f"(--max-watches); close one or retry later")
        if self.open.get(tenant, 0) >= self.max_per_tenant:
            who = f"tenant {tenant!r}" if tenant else "Watches of every tenant (no tenant given)"
            raise ResourceExhausted(f"{who} already has {self.open[tenant]} Watch streams open, the limit per "
                                    f"tenant (--max-watches-per-tenant); close one or retry later")
        self.open[tenant] = self.open.get(tenant, 0) + 1

    async def watch(self, after: StreamId | None, task_id: str = "", tenant: str = "", job_id: str = ""
                    ) -> AsyncIterator[pb.TaskEvent]:
        """The events after `after` (None: from now on) for `task_id`, `tenant` and `job_id` ("" = all), forever."""
        self._admit(tenant)
        sub = None
        try:
            cursor = self.cursor if after is None else after
            while cursor < self.cursor:  # catch up to the reader, a page at a time
                upto = self.cursor
                async with self._catch_up:
                    entries = await self.redis.xrange(self.stream, min=format_id((cursor[0], cursor[1] + 1)),
                                                      max=format_id(upto), count=500)
                if not entries:  # nothing left up to the reader (trimmed, or `after` between entries)
                    cursor = upto
                for entry_id, fields in entries:
                    cursor = _parse_id(entry_id)
                    event = event_of(format_id(cursor), fields)
                    if matches(event, task_id, tenant, job_id):
                        yield event
            # caught up: subscribe in this same step of the event loop, so the reader's next entry is ours
            sub = _Subscriber(task_id, tenant, cursor, self.buffer, job_id)
            self._subscribers.add(sub)
            while (event := await sub.queue.get()) is not None:
                yield event
            if sub.overflowed:
                raise ResourceExhausted(f"this Watch fell more than {self.buffer} events behind the task stream "
                                        "and was ended; watch again with after_event_id set to the last event_id "
                                        "received")
            # else the gateway is stopping: the server ends the call
        finally:
            if sub is not None:
                self._subscribers.discard(sub)
            self.open[tenant] -= 1
            if not self.open[tenant]:
                del self.open[tenant]
