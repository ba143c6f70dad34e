"""Follow a DC ledger stream from another process (the thermal service) and keep the same fold."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import OrderedDict
from typing import Protocol

import redis.asyncio as aioredis
from opentelemetry import propagate, trace

from hsched.cancel import stop_if_cancelled
from hsched.domain.cluster import ClusterState
from hsched.domain.fleet import DataCenter
from hsched.domain.task import TaskSpec
from hsched.state.ledger import fold_event, replay, trimmed_past
from hsched.state.redis import ReadTrouble

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)


def stream_id_tuple(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms or 0), int(seq or 0)


class LedgerObserver(Protocol):
    """Told of every ledger entry a follower folds (the gateway records placer-initiated task transitions)."""

    async def entries(self, follower: LedgerFollower, entries: list[tuple[str, dict]]) -> None:
        """Newly folded entries (id, event), in ledger order; the follower reads on once this returns."""

    async def reloaded(self, follower: LedgerFollower) -> None:
        """The follower rebuilt its fold from the snapshot: entries it had not passed on may be gone."""


class LedgerFollower:
    """Folds one DC's ledger into a ClusterState as entries arrive (see `follow`); `wait_for(id)` gives
    read-your-writes. An `observer` is handed every entry once folded."""

    def __init__(self, redis: aioredis.Redis, stream: str, dc: DataCenter) -> None:
        self.redis = redis
        self.stream = stream
        self.state = ClusterState(dc)
        self.queue: OrderedDict[str, TaskSpec] = OrderedDict()
        self.last_id = "0-0"
        self.version = 0  # bumps on every folded batch (cache key for derived values)
        self._advanced = asyncio.Condition()
        self._wake = asyncio.Event()  # set by wait_for: `follow` reads at once instead of batching
        self.observer: LedgerObserver | None = None

    async def load(self) -> None:
        """Fold the ledger as it stands (before `follow` tails it)."""
        self.last_id = await replay(self.redis, self.stream, self.state, self.queue)

    async def resync_if_trimmed(self) -> bool:
        """Reload from the snapshot when the placer trimmed entries this follower had not read (it lagged
        behind the trim margin, e.g. while Redis was away); True when it did."""
        if not await trimmed_past(self.redis, self.stream, self.last_id):
            return False
        log.warning("%s was trimmed past this reader's position %s; reloading from its snapshot", self.stream,
                    self.last_id)
        await self._reload()
        return True

    async def _reload(self) -> None:
        self.state = ClusterState(self.state.dc, self.state.table)
        self.queue.clear()
        await self.load()
        if self.observer is not None:
            await self.observer.reloaded(self)
        self.version += 1
        async with self._advanced:
            self._advanced.notify_all()

    async def _fold(self, entries: list) -> None:
        folded: list[tuple[str, dict]] = []
        try:
            for entry_id, fields in entries:
                event = json.loads(fields[b"e"])
                if "tp" in event:  # the placing call's trace: this fold is its last step
                    self._traced_fold(event, entry_id.decode())
                else:
                    fold_event(event, self.state, self.queue)
                self.last_id = entry_id.decode()
                folded.append((self.last_id, event))
        except Exception:
            log.exception("folding %s failed at %s; rebuilding from the start", self.stream, self.last_id)
            await self._reload()
            return
        if self.observer is not None:
            await self.observer.entries(self, folded)
        self.version += 1
        async with self._advanced:
            self._advanced.notify_all()

    def _traced_fold(self, event: dict, entry_id: str) -> None:
        parent = propagate.extract({"traceparent": event["tp"]})
        with tracer.start_as_current_span(f"fold {event['t']}", parent, trace.SpanKind.CONSUMER, attributes={
                "hsched.ledger.stream": self.stream, "hsched.ledger.entry_id": entry_id,
                "hsched.task_id": event["task"]}):
            fold_event(event, self.state, self.queue)

    async def wait_for(self, entry_id: str, timeout_s: float = 2.0) -> None:
        """Return once the fold includes `entry_id` (raise TimeoutError after `timeout_s`)."""
        if not entry_id or stream_id_tuple(self.last_id) >= stream_id_tuple(entry_id):
            return
        target = stream_id_tuple(entry_id)
        self._wake.set()
        async with self._advanced:
            await asyncio.wait_for(self._advanced.wait_for(lambda: stream_id_tuple(self.last_id) >= target), timeout_s)


async def follow(redis: aioredis.Redis, followers: list[LedgerFollower], batch_s: float = 0.05,
                 trim_check_s: float = 1.0) -> None:
    """Tail every follower's ledger with one blocking XREAD for all streams, then gather entries for up to
    `batch_s` before the next read (at once when a `wait_for` is pending): a reader off the placement path
    pays one Redis round trip per batch of writes, not one per placer write. Runs until cancelled."""
    if not followers:  # a gateway given no placers: nothing to read (XREAD of no stream is an error)
        await asyncio.Event().wait()
    by_stream = {f.stream: f for f in followers}
    wake = asyncio.Event()
    for f in followers:
        f._wake = wake
    checked = float("-inf")
    loop = asyncio.get_running_loop()
    trouble = ReadTrouble(f"following {len(followers)} ledgers", 0.5, log)  # a Redis restart: one line, not 2/s
    while True:
        stop_if_cancelled()  # a cancel that a read swallowed still stops the loop
        try:
            if loop.time() - checked >= trim_check_s:  # a trim past a cursor is rare: looked for now and then
                checked = loop.time()
                for f in followers:
                    await f.resync_if_trimmed()
            reply = await redis.xread({f.stream: f.last_id for f in followers}, count=1000, block=1000)
        except (aioredis.ConnectionError, aioredis.TimeoutError) as exc:
            trouble.failed(exc)
            await asyncio.sleep(trouble.retry_s)
            continue
        trouble.succeeded()
        for stream, entries in reply or []:
            await by_stream[stream.decode()]._fold(entries)
        if reply and not wake.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(batch_s):
                    await wake.wait()
        wake.clear()
