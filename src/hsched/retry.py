"""Retrying what must eventually happen (a release, a record, a settle) with exponential backoff."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


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
