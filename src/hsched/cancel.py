"""Stopping background tasks for sure.

A single `task.cancel()` can be absorbed: Python 3.11's asyncio.wait_for/timeout when the cancel races a
deadline, or a library that catches it mid-command. Seen here: a gateway's task-feed reader whose redis-py
XREAD took the cancel and whose retry loop then read on for ever, so the gateway never stopped. So shutdown
cancels again until every task has finished."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

__all__ = ["cancel_and_wait", "stop_if_cancelled"]


async def cancel_and_wait(tasks: Iterable[asyncio.Future | None], retry_s: float = 0.5) -> None:
    """Cancel every task (None and finished ones are skipped) and return once all have finished, cancelling
    again every `retry_s` the ones that are still running. Their results and exceptions are dropped."""
    pending = {t for t in tasks if t is not None and not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=retry_s)


def stop_if_cancelled() -> None:
    """Raise CancelledError when the current task has a cancel pending: a loop around a Redis read calls it each
    turn, since the read itself can swallow the cancel (the module docstring) and the loop would read on."""
    me = asyncio.current_task()
    if me is not None and me.cancelling():
        raise asyncio.CancelledError
