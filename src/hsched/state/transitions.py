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
        self._queue: asyncio.Queue[tuple[pb.Task, str]] = asyncio.Queue()
        self._dispatcher: asyncio.Task | None = None

    def subscribe(self, callback: Callback) -> None:
        self._callbacks.append(callback)

    @property
    def active(self) -> bool:
        """Whether anyone subscribed (the store skips building copies otherwise)."""
        return bool(self._callbacks)

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
            for callback in list(self._callbacks):
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
