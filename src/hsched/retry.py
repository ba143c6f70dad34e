"""Retrying with exponential backoff: what must eventually happen (a release, a record, a settle), and a client's
gRPC call through a restarting peer (the replays)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

T = TypeVar("T")
log = logging.getLogger(__name__)

# A call that fails UNAVAILABLE or DEADLINE_EXCEEDED (a restarting gateway or placer) is sent again, as a client
# would, for up to this long: each Submit carries a request_id, so a retry gets the first answer, never a second task.
RETRY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
RETRY_BUDGET_S = 60.0


async def retry_with_backoff(attempt: Callable[[], Awaitable[T]], retry_on: type[BaseException] | tuple,
                             describe: Callable[[Any, float], str], first_retry_s: float = 0.5,
                             max_delay_s: float = 30.0) -> T:
    """`attempt()` until it returns, retrying on `retry_on` after 0.5 s, 1 s, 2 s ... (at most `max_delay_s`).
    Each failure is logged as `describe(exc, delay)`: the first one and the first at the longest delay (still
    failing) at WARNING, the others at DEBUG, so that one outage's thousands of retries (a release per unanswered
    placement) do not flood the log."""
    delay, loud = first_retry_s, True
    while True:
        try:
            return await attempt()
        except retry_on as exc:
            log.log(logging.WARNING if loud else logging.DEBUG, "%s", describe(exc, delay))
        loud = 2 * delay >= max_delay_s > delay  # the next failure is the first at the longest delay
        await asyncio.sleep(delay)
        delay = min(2 * delay, max_delay_s)


async def retrying(call: Callable[[], Awaitable[T]], stats) -> T:
    """`call()` sent again after UNAVAILABLE / DEADLINE_EXCEEDED for up to RETRY_BUDGET_S (backoff 0.2 s .. 2 s),
    counting each retry in `stats.retried`: for reads, and for writes that carry a request_id."""
    delay, deadline = 0.2, time.monotonic() + RETRY_BUDGET_S
    while True:
        try:
            return await call()
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in RETRY or time.monotonic() + delay > deadline:
                raise
        stats.retried += 1
        await asyncio.sleep(delay)
        delay = min(2 * delay, 2.0)
