"""The gateway's write path and Watch fan-out under real faults: a task stream that refuses the write (a
wrong-type key in a real Redis), a Redis that is gone, a gateway SIGKILLed while a Submit is in flight, and
500 open Watches. Real services (in-process, or as processes through hsched.stack), real Redis."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import urllib.request
from collections import OrderedDict

import grpc
import pytest
import redis

from hsched.domain.cluster import ClusterState
from hsched.domain.fleet import load_fleet
from hsched.stack import Stack, StackConfig
from hsched.state.keys import Keys
from hsched.state.ledger import replay
from hsched.state.lifecycle import ON_NODES
from hsched.state.redis import EmbeddedRedis, connect
from hsched.v1 import common_pb2 as pb
from hsched.v1 import gateway_pb2, gateway_pb2_grpc, placer_pb2, placer_pb2_grpc
from tests.conftest import SMALL_FLEET, delete_prefix
from tests.test_gateway_failures import backends, gateway, gateway_at, small_task


async def held(redis_url: str, prefix: str) -> dict[str, list[str]]:
    """Task id -> the DCs whose ledger (folded as a placer folds it) holds it, placed or queued."""
    client = connect(redis_url)
    out: dict[str, list[str]] = {}
    try:
        for dc in load_fleet(SMALL_FLEET).datacenters:
            state, queue = ClusterState(dc), OrderedDict()
            await replay(client, Keys(prefix).ledger(dc.name), state, queue)
            for task_id in [*state.allocations, *queue]:
                out.setdefault(task_id, []).append(dc.name)
    finally:
        await client.aclose()
    return out


async def until(predicate, what: str, timeout_s: float = 60.0):
    """Poll the async `predicate` until it returns a truthy value (generous deadline: a noisy machine)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not (value := await predicate()):
        if loop.time() > deadline:
            pytest.fail(f"not after {timeout_s:.0f} s: {what}")
        await asyncio.sleep(0.1)
    return value


def with_request_id(request_id: str, tenant: str = "") -> pb.TaskSpec:
    spec = small_task()
    spec.request_id, spec.tenant = request_id, tenant
    return spec


async def test_a_refused_task_stream_write_leaves_no_trace_and_the_retry_places_once(redis_url, prefix, tmp_path):
    async with gateway(redis_url, prefix, tmp_path) as (gw, _, _):
        sync = redis.Redis.from_url(redis_url)
        sync.set(Keys(prefix).tasks, "not a stream")  # every XADD to the task stream now fails: WRONGTYPE
        spec = with_request_id("write-fails-once")
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await gw.Submit(gateway_pb2.SubmitRequest(task=spec), timeout=20)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
        assert "same request_id" in failed.value.details()
        assert not (await gw.List(gateway_pb2.ListRequest(), timeout=5)).tasks  # nothing visible to reads
        # the placement made before the failed write is released: no ledger holds anything
        await until(lambda: _empty(held(redis_url, prefix)), "the failed attempt's placement released")
        sync.delete(Keys(prefix).tasks)  # Redis fixed
        retry = await gw.Submit(gateway_pb2.SubmitRequest(task=spec), timeout=20)
        assert not retry.duplicate and retry.task.state == pb.TASK_STATE_PLACED
        again = await gw.Submit(gateway_pb2.SubmitRequest(task=spec), timeout=20)
        assert again.duplicate and again.task.task_id == retry.task.task_id
        listed = (await gw.List(gateway_pb2.ListRequest(), timeout=5)).tasks
        assert [t.task_id for t in listed] == [retry.task.task_id]
        assert await held(redis_url, prefix) == {retry.task.task_id: [retry.task.datacenter]}
        got = await gw.Get(gateway_pb2.GetRequest(task_id=retry.task.task_id), timeout=5)
        assert got.state in ON_NODES


async def _empty(held_now) -> bool:
    return not await held_now


async def test_bad_after_event_id_is_invalid_argument_and_redis_down_is_unavailable(tmp_path):
    own = EmbeddedRedis(data_dir=tmp_path / "redis").start()  # a Redis of this test's own, to take away
    try:
        async with gateway(own.url, "down", tmp_path) as (gw, _, _):
            for bad in ("abc", "1-2-3", "-1", "99999999999999999999999-0", "$0", "x" * 500):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await gw.Watch(gateway_pb2.WatchRequest(after_event_id=bad), timeout=5).read()
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "after_event_id" in \
                    err.value.details(), (bad, err.value.details())
                assert "x" * 100 not in err.value.details()  # a long value is not echoed
            placed = (await gw.Submit(gateway_pb2.SubmitRequest(task=small_task()), timeout=20)).task
            watch = gw.Watch(gateway_pb2.WatchRequest(after_event_id="0"), timeout=20)
            assert (await watch.read()).kind == "submitted"  # a valid id from the past: caught up
            watch.cancel()
            own.stop()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await gw.Submit(gateway_pb2.SubmitRequest(task=with_request_id("while-down")), timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await gw.Release(gateway_pb2.ReleaseRequest(task_id=placed.task_id), timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as err:  # catching up reads Redis
                await gw.Watch(gateway_pb2.WatchRequest(after_event_id="0"), timeout=30).read()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
            got = await gw.Get(gateway_pb2.GetRequest(task_id=placed.task_id), timeout=5)  # reads need no Redis
            assert got.state in ON_NODES
            # back with its data (its AOF, in a kept dir), so the placers stop cleanly: back empty, their epoch
            # guard would rightly refuse it (exit 3) if it looked before they stopped
            own.start()
    finally:
        own.stop()


def connected_clients(url: str) -> int:
    return int(redis.Redis.from_url(url).info("clients")["connected_clients"]) - 1  # not this one


@pytest.mark.slow
async def test_500_open_watches_share_one_reader_while_submits_succeed_and_caps_answer_exhausted():
    config = StackConfig(fleet_path=SMALL_FLEET, gateway_port=0, thermal=False,
                         extra_env={"HSCHED_MAX_WATCHES": "500", "HSCHED_MAX_WATCHES_PER_TENANT": "200"})
    with Stack(config) as stack:  # its own embedded Redis: its client count is this stack's alone
        async with grpc.aio.insecure_channel(stack.gateway) as channel:
            gw = gateway_pb2_grpc.GatewayStub(channel)
            for i in range(10):
                await gw.Submit(gateway_pb2.SubmitRequest(task=with_request_id(f"warm-{i}", "a")), timeout=30)
            history = gw.Watch(gateway_pb2.WatchRequest(after_event_id="0"))
            last = [await asyncio.wait_for(history.read(), 60) for _ in range(30)][-1]  # 3 records per Submit
            history.cancel()
            before = connected_clients(stack.redis_url)
            tenants = ["a"] * 200 + ["b"] * 200 + [""] * 100
            # from the last event on, so none misses what follows however late its call reaches the gateway
            watches = [gw.Watch(gateway_pb2.WatchRequest(tenant=t, after_event_id=last.event_id)) for t in tenants]
            firsts = {t: (await gw.Submit(gateway_pb2.SubmitRequest(task=with_request_id("first-" + t, t)),
                                          timeout=30)).task for t in ("a", "b")}
            # every Watch is open and fed: each sees the first event of its tenant's task (all tenants for "")
            for tenant, call in zip(tenants, watches, strict=True):
                event = await asyncio.wait_for(call.read(), 60)
                assert event.kind == "submitted" and (not tenant or event.task_id == firsts[tenant].task_id)
            text = urllib.request.urlopen(f"http://127.0.0.1:{stack.services['gateway'].metrics_port}/metrics",
                                          timeout=10).read().decode()
            assert 'hsched_gateway_watches{tenant="a"} 200.0' in text and 'hsched_gateway_watches{tenant="*"} 100.0' \
                in text
            for request in (gateway_pb2.WatchRequest(tenant="a"), gateway_pb2.WatchRequest(tenant="c")):
                with pytest.raises(grpc.aio.AioRpcError) as err:  # 200 of "a" open; 500 in all
                    await gw.Watch(request, timeout=10).read()
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
                assert "--max-watches" in err.value.details()
            placed = [(await gw.Submit(gateway_pb2.SubmitRequest(task=with_request_id(f"busy-{i}", "a")),
                                       timeout=30)).task for i in range(20)]
            assert all(t.state == pb.TASK_STATE_PLACED for t in placed)
            for t in placed:
                await gw.Release(gateway_pb2.ReleaseRequest(task_id=t.task_id), timeout=30)
            after = connected_clients(stack.redis_url)
            print(f"Redis clients: {before} before the Watches, {after} with 500 open")
            assert after <= before + 6  # not one per Watch: the feed's reader and at most 4 catch-up readers
            for call in watches[:300]:  # closing Watches frees room under the caps
                call.cancel()

            async def admitted() -> bool:
                try:
                    return bool(await gw.Watch(gateway_pb2.WatchRequest(tenant="a", after_event_id="0"),
                                               timeout=10).read())
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    return False
            await until(admitted, "a Watch admitted after others closed")
            for call in watches[300:]:
                call.cancel()


def gateway_place_calls(stack: Stack, dc: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{stack.services['gateway'].metrics_port}/metrics",
                                  timeout=10).read().decode()
    found = re.search(rf'hsched_gateway_batched_calls_total\{{method="Place",peer="{dc}"\}} (\S+)', text)
    return float(found.group(1)) if found else 0.0


@pytest.mark.slow
async def test_a_gateway_killed_mid_submit_lets_the_retry_place_it_once(redis_url):
    prefix = f"test-crash-{os.getpid()}-{id(object())}"
    config = StackConfig(fleet_path=SMALL_FLEET, redis_url=redis_url, prefix=prefix, gateway_port=0, thermal=False)
    try:
        with Stack(config) as stack:
            cheap, gateway = stack.services["placer-cheap"].proc, stack.services["gateway"].proc
            spec = with_request_id("crash-mid-submit")
            with grpc.insecure_channel(stack.gateway) as channel:  # the gateway's stream to cheap is up
                warm = gateway_pb2_grpc.GatewayStub(channel).Submit(gateway_pb2.SubmitRequest(task=small_task()),
                                                                    timeout=30).task
                assert warm.datacenter == "cheap"
                gateway_pb2_grpc.GatewayStub(channel).Release(gateway_pb2.ReleaseRequest(task_id=warm.task_id),
                                                              timeout=30)
            os.kill(cheap.pid, signal.SIGSTOP)  # cheap (the first choice) holds the Place unanswered
            try:
                async with grpc.aio.insecure_channel(stack.gateway) as channel:
                    call = asyncio.ensure_future(gateway_pb2_grpc.GatewayStub(channel).Submit(
                        gateway_pb2.SubmitRequest(task=spec), timeout=60))
                    await until(lambda: asyncio.to_thread(lambda: gateway_place_calls(stack, "cheap") >= 2),
                                "the gateway sent its Place to cheap")
                    os.kill(gateway.pid, signal.SIGSTOP)  # the gateway will not get to record cheap's answer
                    os.kill(cheap.pid, signal.SIGCONT)  # cheap commits the Place and answers
                    orphan = await until(lambda: held(redis_url, prefix), "cheap committed the Place")
                    assert list(orphan.values()) == [["cheap"]]
                    stack.kill("gateway")  # SIGKILL: the Submit dies between the placement and its record
                    with pytest.raises(grpc.aio.AioRpcError):
                        await call
            finally:
                os.kill(cheap.pid, signal.SIGCONT)
            stack.restart("gateway")
            async with grpc.aio.insecure_channel(stack.gateway) as channel:
                gw = gateway_pb2_grpc.GatewayStub(channel)
                retry = await gw.Submit(gateway_pb2.SubmitRequest(task=spec), timeout=30)
                assert not retry.duplicate and retry.task.state == pb.TASK_STATE_PLACED
                assert (await gw.Submit(gateway_pb2.SubmitRequest(task=spec), timeout=30)).task == retry.task

                async def settled() -> bool:  # the interrupted attempt is released; the retry is held once
                    return await held(redis_url, prefix) == {retry.task.task_id: [retry.task.datacenter]}
                await until(settled, "the ledgers hold the retry once and nothing else")
    finally:
        delete_prefix(redis_url, prefix)


async def test_a_place_the_previous_gateway_sent_that_commits_after_the_restart_is_released(redis_url, prefix,
                                                                                            tmp_path):
    async with backends(redis_url, prefix, tmp_path) as (argv, placers):
        argv = [*argv, "--place-timeout-s", "6"]  # a later flag wins: its late orphan check runs at +7 s
        async with gateway_at(argv, tmp_path / "gateway.port") as gw:
            # what a dead gateway's last Place does: committed at cheap after this gateway's start-up reconcile
            async with grpc.aio.insecure_channel(placers["cheap"]) as placer_channel:
                late = await placer_pb2_grpc.PlacerStub(placer_channel).Place(
                    placer_pb2.PlaceRequest(task_id="t-late", task=small_task()), timeout=5)
            assert late.outcome == placer_pb2.PLACE_OUTCOME_PLACED
            mine = (await gw.Submit(gateway_pb2.SubmitRequest(task=small_task()), timeout=20)).task

            async def only_mine() -> bool:
                return await held(redis_url, prefix) == {mine.task_id: [mine.datacenter]}
            await until(only_mine, "t-late released by the late orphan check, this gateway's task kept")
