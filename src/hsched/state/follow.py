"""Follow a DC ledger stream from another process (the thermal service) and keep the same fold."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict

import redis.asyncio as aioredis

from hsched.domain.cluster import ClusterState
from hsched.domain.fleet import DataCenter
from hsched.domain.task import TaskSpec
from hsched.state.ledger import fold_event, replay

log = logging.getLogger(__name__)


def stream_id_tuple(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms or 0), int(seq or 0)


class LedgerFollower:
    """Folds a ledger into a ClusterState as entries arrive; `wait_for(id)` gives read-your-writes."""

    def __init__(self, redis: aioredis.Redis, stream: str, dc: DataCenter) -> None:
        self.redis = redis
        self.stream = stream
        self.state = ClusterState(dc)
        self.queue: OrderedDict[str, TaskSpec] = OrderedDict()
        self.last_id = "0-0"
        self.version = 0  # bumps on every folded batch (cache key for derived values)
        self._advanced = asyncio.Condition()

    async def start(self) -> asyncio.Task:
        self.last_id = await replay(self.redis, self.stream, self.state, self.queue)
        return asyncio.create_task(self._follow(), name=f"follow-{self.stream}")

    async def _follow(self) -> None:
        while True:
            try:
                reply = await self.redis.xread({self.stream: self.last_id}, count=1000, block=1000)
            except (aioredis.ConnectionError, aioredis.TimeoutError):
                log.warning("lost Redis while following %s; retrying", self.stream)
                await asyncio.sleep(0.5)
                continue
            if not reply:
                continue
            try:
                for entry_id, fields in reply[0][1]:
                    fold_event(json.loads(fields[b"e"]), self.state, self.queue)
                    self.last_id = entry_id.decode()
            except Exception:
                log.exception("folding %s failed at %s; rebuilding from the start", self.stream, self.last_id)
                self.state = ClusterState(self.state.dc, self.state.table)
                self.queue.clear()
                self.last_id = await replay(self.redis, self.stream, self.state, self.queue)
            self.version += 1
            async with self._advanced:
                self._advanced.notify_all()

    async def wait_for(self, entry_id: str, timeout_s: float = 2.0) -> None:
        """Return once the fold includes `entry_id` (raise TimeoutError after `timeout_s`)."""
        if not entry_id or stream_id_tuple(self.last_id) >= stream_id_tuple(entry_id):
            return
        target = stream_id_tuple(entry_id)
        async with self._advanced:
            await asyncio.wait_for(self._advanced.wait_for(lambda: stream_id_tuple(self.last_id) >= target), timeout_s)
