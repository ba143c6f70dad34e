"""In-process hook on every durable task transition (the job orchestrator's view of the task lifecycle).

The task store calls `Transitions.notify(task, kind)` once per record that Redis accepted, in the order of the
task stream (never for records replayed at start: a restarted gateway rebuilds its own state from the
stream, and transitions it missed while down are written afresh by the ledger follower, so they reach
subscribers then). Subscribers are awaited one at a time in that order by one dispatcher task, so a callback
never sees a later transition of a task before an earlier one; a callback that raises is logged and the
others still run.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from hsched.cancel import cancel_and_wait
from hsched.v1 import common_pb2 as pb

log = logging.getLogger(__name__)

Callback = Callable[[pb.Task, str], Awaitable[None]]


class Transitions:
    """`subscribe(async callback(task, kind))`: `task` is a copy of the task's record after the step, `kind` the
    task event kind (submitted, dc_selected, placed, deferred, rejected, released, running, succeeded, failed,
    preempted, expired, abandoned)."""

    def __init__(self) -> None:
        self._callbacks: list[Callback] = []
        self._filters: list[Callable[[str], bool]] = []  # per subscriber: the task ids it wants (by id alone)
        self._queue: asyncio.Queue[tuple[pb.Task, str]] = asyncio.Queue()
        self._dispatcher: asyncio.Task | None = None

    def subscribe(self, callback: Callback, wants: Callable[[str], bool] = lambda _: True) -> None:
        """`wants(task_id)`: whether `callback` is told of that task's transitions at all (decided on the id
        alone, so the store builds no copy of a record nobody wants: the Submit path's cost)."""
        self._callbacks.append(callback)
        self._filters.append(wants)

    @property
    def active(self) -> bool:
        """Whether anyone subscribed (the store skips building copies otherwise)."""
        return bool(self._callbacks)

    def wants(self, task_id: str) -> bool:
        """Whether any subscriber wants transitions of `task_id`."""
        return any(f(task_id) for f in self._filters)

    def notify(self, task: pb.Task, kind: str) -> None:
        """Hand a durable transition to the subscribers (returns at once; they run on the dispatcher task)."""
        if not self._callbacks:
            return
        copy = pb.Task()
        copy.CopyFrom(task)
        self._queue.put_nowait((copy, kind))
        if self._dispatcher is None or self._dispatcher.done():
            self._dispatcher = asyncio.create_task(self._dispatch(), name="task transitions")

    async def _dispatch(self) -> None:
        while not self._queue.empty():
            task, kind = self._queue.get_nowait()
            for callback, wants in list(zip(self._callbacks, self._filters, strict=True)):
                if not wants(task.task_id):
                    continue
                try:
                    await callback(task, kind)
                except Exception:
                    log.exception("a transitions subscriber failed on %s of %s", kind, task.task_id)
            self._queue.task_done()

    async def drained(self) -> None:
        """Wait until every transition notified so far has been handed to every subscriber."""
        await self._queue.join()

    async def close(self) -> None:
        if self._dispatcher is not None:
            await cancel_and_wait([self._dispatcher])
