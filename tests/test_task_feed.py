"""The Watch fan-out (hsched.state.feed) on a real Redis: catch-up joins the live feed without gaps or
duplicates, a subscriber that falls behind is ended with RESOURCE_EXHAUSTED, caps hold, and after_event_id
is validated."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hsched.domain.errors import ResourceExhausted, ValidationError
from hsched.state.feed import TaskFeed, format_id, parse_after
from hsched.state.keys import Keys
from hsched.state.redis import connect
from hsched.state.tasks import TaskStore
from hsched.v1 import common_pb2 as pb


def task(i: int, tenant: str = "") -> pb.Task:
    return pb.Task(task_id=f"t{i:04d}", spec=pb.TaskSpec(tenant=tenant))


async def test_catch_up_then_live_has_no_gap_and_no_duplicate(redis_url, prefix):
    redis, feed_redis = connect(redis_url), connect(redis_url)
    store = TaskStore(redis, Keys(prefix).tasks)
    await asyncio.gather(*(store.record("submitted", task(i)) for i in range(30)))
    feed = TaskFeed(feed_redis, store.stream, "0-0", block_ms=100).start()  # the reader starts behind
    try:
        got: list[str] = []

        async def consume() -> None:
            async for event in feed.watch(parse_after("0")):
                got.append(event.task_id)
                if len(got) == 30:  # writes land while this Watch is between catch-up and live
                    await asyncio.gather(*(store.record("submitted", task(i)) for i in range(30, 60)))
                if len(got) == 60:
                    return

        await asyncio.wait_for(consume(), 60)
        assert got == [f"t{i:04d}" for i in range(60)]
        assert feed.watching == 0  # the finished Watch gave its place back
    finally:
        await feed.close()
        await redis.aclose()
        await feed_redis.aclose()


async def test_a_watch_that_falls_behind_is_ended_and_caps_hold(redis_url, prefix):
    redis, feed_redis = connect(redis_url), connect(redis_url)
    store = TaskStore(redis, Keys(prefix).tasks)
    feed = TaskFeed(feed_redis, store.stream, "0-0", max_watches=3, max_per_tenant=2, buffer=5, block_ms=100).start()
    try:
        slow = feed.watch(None, tenant="a")
        first = asyncio.ensure_future(slow.__anext__())  # subscribed, then reads nothing more
        await asyncio.gather(*(store.record("submitted", task(i, "a")) for i in range(20)))
        assert (await asyncio.wait_for(first, 30)).task_id == "t0000"
        seen = 1
        with pytest.raises(ResourceExhausted, match="fell more than 5 events behind"):
            async for _ in slow:
                seen += 1
        assert seen <= 1 + 5  # the buffer, not all 20
        other = feed.watch(None, tenant="a")
        also = feed.watch(None, tenant="a")
        pending = [asyncio.ensure_future(other.__anext__()), asyncio.ensure_future(also.__anext__())]
        await asyncio.sleep(0.1)
        with pytest.raises(ResourceExhausted, match="max-watches-per-tenant"):
            await feed.watch(None, tenant="a").__anext__()
        third = asyncio.ensure_future(feed.watch(None, tenant="b").__anext__())
        await asyncio.sleep(0.1)
        with pytest.raises(ResourceExhausted, match="max-watches"):
            await feed.watch(None, tenant="c").__anext__()
        for p in [*pending, third]:
            p.cancel()
        await asyncio.gather(*pending, third, return_exceptions=True)
    finally:
        await feed.close()
        await redis.aclose()
        await feed_redis.aclose()


@given(st.one_of(st.text(max_size=60), st.from_regex(r"\A[0-9]{1,21}(-[0-9٣]{1,21})?\Z")))
def test_after_event_id_is_an_id_or_a_clear_invalid_argument(value):
    try:
        parsed = parse_after(value)
    except ValidationError as exc:
        assert exc.field == "after_event_id"
        return
    if value in ("", "$"):
        assert parsed is None
    else:  # ASCII digits "<ms>" or "<ms>-<seq>", each below 2**64
        ms, _, seq = value.partition("-")
        assert parsed == (int(ms), int(seq or 0)) and set(value) <= set("0123456789-") and format_id(parsed)


@given(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1))
def test_every_stream_id_is_accepted(ms, seq):
    assert parse_after(f"{ms}-{seq}") == (ms, seq)


async def test_the_cli_resumes_a_watch_the_gateway_ended_for_falling_behind(redis_url, prefix, tmp_path):
    """A burst faster than the client reads (a 1,000-task job's stage finishing) ended `hsched job watch` with
    RESOURCE_EXHAUSTED "fell more than N events behind"; the CLI resumes after the last event it printed, as the
    message says to, and gets every event once, in order."""
    import grpc

    from hsched import cli
    from hsched.v1 import gateway_pb2, gateway_pb2_grpc
    from services.gateway import server as gateway_server
    from tests import inprocess
    from tests.conftest import SMALL_FLEET

    redis = connect(redis_url)
    store = TaskStore(redis, Keys(prefix).tasks)
    args = ["--fleet", SMALL_FLEET, "--redis-url", redis_url, "--prefix", prefix, "--watch-buffer", "5"]
    n = 2000  # well past the buffer plus what HTTP/2's flow-control window holds in flight (~64 KiB)
    try:
        async with inprocess.service(gateway_server, args, tmp_path / "gateway.port") as gw:
            with grpc.insecure_channel(gw) as channel:
                events = cli._watch(gateway_pb2_grpc.GatewayStub(channel),
                                    gateway_pb2.WatchRequest(tenant="burst", after_event_id="0"), sleep=lambda _: None)
                await store.record("submitted", task(0, "burst"))
                first = await asyncio.to_thread(next, events)  # subscribed; then it reads nothing during the burst
                for i in range(1, n, 100):
                    await asyncio.gather(*(store.record("submitted", task(j, "burst")) for j in range(i, i + 100)))
                rest = await asyncio.to_thread(lambda: [next(events) for _ in range(n - 1)])
        assert [e.task_id for e in [first, *rest]] == [f"t{i:04d}" for i in range(n)]
    finally:
        await redis.aclose()
