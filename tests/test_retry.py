"""hsched.retry: what a retry under a long outage logs (one outage used to log 63,000 warnings in 6 minutes)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from hsched import retry


async def test_the_first_failure_and_the_first_at_the_longest_delay_warn_the_rest_is_debug(monkeypatch, caplog):
    real_sleep, slept, calls = asyncio.sleep, [], []

    async def no_wait(delay):
        slept.append(delay)
        await real_sleep(0)

    async def attempt():
        calls.append(1)
        if len(calls) < 9:
            raise ConnectionError("placer away")
        return "done"

    monkeypatch.setattr(asyncio, "sleep", no_wait)
    with caplog.at_level(logging.DEBUG, logger=retry.__name__):
        assert await retry.retry_with_backoff(attempt, ConnectionError, lambda exc, delay: f"{exc}; in {delay:g} s",
                                              first_retry_s=0.5, max_delay_s=4.0) == "done"
    assert slept == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0, 4.0]
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.levelno >= logging.WARNING] == [
        ("WARNING", "placer away; in 0.5 s"), ("WARNING", "placer away; in 4 s")]
    assert len(caplog.records) == 8


async def test_what_is_not_retried_is_raised_at_once():
    async def attempt():
        raise ValueError("a bug")

    with pytest.raises(ValueError):
        await retry.retry_with_backoff(attempt, ConnectionError, lambda exc, delay: "")
