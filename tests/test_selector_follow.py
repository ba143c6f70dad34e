"""The selector's Redis follow loops through a Redis outage (a restart is expected): one WARNING line naming the
error when reads start failing, no traceback and no line per retry, one INFO line when reading works again —
with a real client on a port where Redis is down, then up."""

from __future__ import annotations

import asyncio
import logging

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from hsched.costs import WanGraph
from hsched.domain.fleet import load_fleet
from hsched.engine.selector import DcSelector
from hsched.state.keys import Keys
from hsched.state.redis import EmbeddedRedis, ReadTrouble, connect, free_port
from services.selector.server import follow_links, follow_summaries
from tests.conftest import SMALL_FLEET


class CountingReads:
    """The client as the follow loops use it (XREAD only), counting the reads tried."""

    def __init__(self, client) -> None:
        self.client, self.reads = client, 0

    async def xread(self, *args, **kwargs):
        self.reads += 1
        return await self.client.xread(*args, **kwargs)


async def until(condition) -> None:
    async with asyncio.timeout(60):
        while not condition():
            await asyncio.sleep(0.02)


@pytest.mark.parametrize("follower", ["links", "summaries"])
async def test_a_redis_outage_is_one_warning_line_and_its_end_one_info_line(prefix, caplog, follower) -> None:
    caplog.set_level(logging.INFO, logger="hsched.selector")
    port = free_port()
    client = connect(f"redis://127.0.0.1:{port}/0")  # nothing listens there yet: Redis is down
    reads, keys = CountingReads(client), Keys(prefix)
    fleet = load_fleet(SMALL_FLEET)
    selector = DcSelector(fleet, graph=WanGraph(fleet.wan))
    loop = (follow_links(reads, keys, selector, retry_s=0.01) if follower == "links" else
            follow_summaries(reads, keys, selector, {keys.summary("cheap"): "0-0"}, retry_s=0.01))
    task = asyncio.create_task(loop)
    server = None
    try:
        await until(lambda: reads.reads >= 20)  # twenty failed reads
        server = EmbeddedRedis(port=port).start()  # Redis is back
        await until(lambda: any(r.levelno == logging.INFO for r in caplog.records))
    finally:
        while not task.done():  # cancel again until done: redis-py can swallow a cancel mid-command
            task.cancel()
            await asyncio.wait({task}, timeout=0.5)
        await client.aclose()
        if server is not None:
            server.stop()
    records = [r for r in caplog.records if r.name == "hsched.selector"]
    assert [r.levelname for r in records] == ["WARNING", "INFO"], [r.getMessage() for r in records]
    warning, info = records
    what = "reading link metrics" if follower == "links" else "reading DC summaries"
    assert warning.getMessage().startswith(f"{what} failed (ConnectionError: ")
    assert str(port) in warning.getMessage() and "\n" not in warning.getMessage()
    assert warning.exc_info is None and "Traceback" not in caplog.text
    assert info.getMessage().startswith(f"{what} works again after ")


def test_a_lasting_outage_is_repeated_at_most_every_repeat_s_and_a_bug_keeps_its_traceback(caplog) -> None:
    caplog.set_level(logging.INFO, logger="hsched.selector")
    now = [0.0]
    trouble = ReadTrouble("reading link metrics", 1.0, logging.getLogger("hsched.selector"), repeat_s=60.0,
                          clock=lambda: now[0])
    for now[0] in range(131):  # a read a second for 130 s: said at 0, 60 and 120 s
        trouble.failed(RedisConnectionError("Connection closed by server."))
    trouble.succeeded()
    trouble.failed(ValueError("a bug"))  # not Redis going away: its traceback, once
    trouble.failed(ValueError("a bug"))
    lines = [(r.levelname, r.getMessage(), r.exc_info is not None) for r in caplog.records]
    assert lines == [
        ("WARNING", "reading link metrics failed (ConnectionError: Connection closed by server.); retrying every 1 s",
         False),
        ("WARNING", "reading link metrics still failing after 60 s, 61 attempts (ConnectionError: Connection closed "
                    "by server.); retrying", False),
        ("WARNING", "reading link metrics still failing after 120 s, 121 attempts (ConnectionError: Connection "
                    "closed by server.); retrying", False),
        ("INFO", "reading link metrics works again after 130 s, 131 failed attempts", False),
        ("WARNING", "reading link metrics failed (ValueError: a bug); retrying every 1 s", True)]
