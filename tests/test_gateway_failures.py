"""Partial failures around a Submit: a placer that answers too late (the gateway places the task in the next
data center, and the slow placer must not hold it too) and a client that leaves before the answer (the
Submit still ends in its final record). The real services in-process (gateway, selector, the small fleet's
three placers) on a real Redis; the placer of "cheap" (the selector's first choice for these tasks) is held
up on purpose, before its decision or after it."""

from __future__ import annotations

import asyncio
import json
from contextlib import AsyncExitStack, asynccontextmanager

import grpc
import pytest

from hsched.engine.placer import PlacerEngine
from hsched.state.keys import Keys
from hsched.state.lifecycle import ON_NODES
from hsched.state.redis import connect
from hsched.state.tasks import TaskStore
from hsched.v1 import common_pb2 as pb
from hsched.v1 import gateway_pb2, gateway_pb2_grpc, placer_pb2, placer_pb2_grpc
from services.placer.server import PlacerServicer
from tests import inprocess
from tests.conftest import SMALL_FLEET

PLACE_TIMEOUT_S = 1.0
HOLD_S = 2.0  # how long "cheap" is held up: past the gateway's Place deadline


@asynccontextmanager
async def backends(redis_url: str, prefix: str, tmp_path):
    """The small fleet's placers and the selector; yields (a gateway's argv, {dc: placer address})."""
    from services.placer import server as placer_server
    from services.selector import server as selector_server

    common = ["--fleet", SMALL_FLEET, "--redis-url", redis_url, "--prefix", prefix]
    async with AsyncExitStack() as stack:
        placers = {dc: await stack.enter_async_context(inprocess.service(
            placer_server, [*common, "--datacenter", dc], tmp_path / f"placer-{dc}.port"))
            for dc in ("cheap", "near", "gpu")}
        selector = await stack.enter_async_context(inprocess.service(selector_server, common,
                                                                     tmp_path / "selector.port"))
        argv = [*common, "--selector", selector, "--place-timeout-s", str(PLACE_TIMEOUT_S),
                "--placers", ",".join(f"{dc}={t}" for dc, t in placers.items())]
        yield argv, placers


@asynccontextmanager
async def gateway_at(argv: list[str], port_file):
    """A gateway with `argv`; yields its stub. (Several may share a prefix: tests/test_gateways.py.)"""
    from services.gateway import server as gateway_server

    async with inprocess.service(gateway_server, argv, port_file) as target, \
            grpc.aio.insecure_channel(target) as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


@asynccontextmanager
async def gateway(redis_url: str, prefix: str, tmp_path):
    async with backends(redis_url, prefix, tmp_path) as (argv, placers), \
            gateway_at(argv, tmp_path / "gateway.port") as gw:
        yield gw, argv, placers


def small_task(cores: int = 2) -> pb.TaskSpec:
    return pb.TaskSpec(resources=pb.Resources(cpu_milli=cores * 1000, memory_mib=2048), runtime_s=60)


async def cheap_ledger(redis_url: str, prefix: str) -> list[dict]:
    redis = connect(redis_url)
    try:
        # placement decisions only: the execution clock's run events come and go with the container-start
        # overhead (tests/test_lifecycle.py covers them); these tasks' runtimes outlast the tests
        events = [json.loads(f[b"e"]) for _, f in await redis.xrange(Keys(prefix).ledger("cheap"))]
        return [e for e in events if e["t"] != "run"]
    finally:
        await redis.aclose()


async def submit_while_cheap_is_held(gw) -> pb.Task:
    task = (await gw.Submit(gateway_pb2.SubmitRequest(task=small_task()), timeout=20)).task
    assert task.state == pb.TASK_STATE_PLACED and task.datacenter != "cheap", list(task.explanation.notes)
    assert any(n.startswith("cheap: placer unavailable (DEADLINE_EXCEEDED") for n in task.explanation.notes)
    return task


async def test_a_place_decided_after_its_deadline_is_not_committed(redis_url, prefix, tmp_path, monkeypatch):
    held = {"on": False}
    process = PlacerEngine._process

    async def overloaded(self, batch):  # cheap's engine gets to the batch only after the caller gave up
        if self.dc.name == "cheap" and held["on"]:
            await asyncio.sleep(HOLD_S)
        return await process(self, batch)

    monkeypatch.setattr(PlacerEngine, "_process", overloaded)
    async with gateway(redis_url, prefix, tmp_path) as (gw, _, _):
        first = (await gw.Submit(gateway_pb2.SubmitRequest(task=small_task()), timeout=20)).task
        assert first.datacenter == "cheap"  # the selector's first choice, while cheap answers in time
        held["on"] = True
        task = await submit_while_cheap_is_held(gw)
        await asyncio.sleep(HOLD_S + 0.5)  # cheap has decided the late call (and the gateway's release) by now
        events = await cheap_ledger(redis_url, prefix)
        assert [e["task"] for e in events] == [first.task_id]  # the late call placed and queued nothing
        got = await gw.Get(gateway_pb2.GetRequest(task_id=task.task_id), timeout=5)
        assert got.state in ON_NODES and got.datacenter == task.datacenter


async def test_a_place_committed_whose_answer_came_too_late_is_released(redis_url, prefix, tmp_path, monkeypatch):
    held = {"on": False}
    place = PlacerServicer._place

    async def late_answer(self, request):  # committed at once, answered after the caller gave up
        reply = await place(self, request)
        if self.engine.dc.name == "cheap" and held["on"]:
            await asyncio.sleep(HOLD_S)
        return reply

    monkeypatch.setattr(PlacerServicer, "_place", late_answer)
    async with gateway(redis_url, prefix, tmp_path) as (gw, _, _):
        held["on"] = True
        task = await submit_while_cheap_is_held(gw)
        for _ in range(100):  # the gateway releases it at cheap in the background
            events = await cheap_ledger(redis_url, prefix)
            if [e["t"] for e in events if e["task"] == task.task_id] == ["alloc", "free"]:
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail(f"cheap still holds {task.task_id}: {events}")
        got = await gw.Get(gateway_pb2.GetRequest(task_id=task.task_id), timeout=5)
        assert got.state in ON_NODES and got.datacenter == task.datacenter


async def test_calls_whose_client_left_still_end_in_their_final_record(redis_url, prefix, tmp_path, monkeypatch):
    def slow_answer(call):  # decided at once, answered 0.5 s later: within the gateway's deadline
        async def slow(self, request):
            reply = await call(self, request)
            await asyncio.sleep(0.5)
            return reply
        return slow

    monkeypatch.setattr(PlacerServicer, "_place", slow_answer(PlacerServicer._place))
    monkeypatch.setattr(PlacerServicer, "_release", slow_answer(PlacerServicer._release))
    async with gateway(redis_url, prefix, tmp_path) as (gw, _, _):
        spec = small_task()
        spec.request_id = "client-left-early"
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            await gw.Submit(gateway_pb2.SubmitRequest(task=spec), timeout=0.2)
        assert gone.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        again = await gw.Submit(gateway_pb2.SubmitRequest(task=spec), timeout=5)  # the retry waits for the first
        assert again.duplicate and again.task.state in ON_NODES and again.task.datacenter == "cheap"
        assert [e["task"] for e in await cheap_ledger(redis_url, prefix)] == [again.task.task_id]
        later = await gw.Submit(gateway_pb2.SubmitRequest(task=spec), timeout=5)  # and after it: the same record
        assert later.duplicate and later.task == again.task
        with pytest.raises(grpc.aio.AioRpcError) as gone:  # a Release whose client leaves is finished too
            await gw.Release(gateway_pb2.ReleaseRequest(task_id=again.task.task_id), timeout=0.2)
        assert gone.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        for _ in range(50):
            got = await gw.Get(gateway_pb2.GetRequest(task_id=again.task.task_id), timeout=5)
            if got.state == pb.TASK_STATE_RELEASED:
                break
            await asyncio.sleep(0.1)
        assert got.state == pb.TASK_STATE_RELEASED
        assert [e["t"] for e in await cheap_ledger(redis_url, prefix)] == ["alloc", "free"]


async def test_a_restarted_gateway_reconciles_its_task_table_with_the_ledgers(redis_url, prefix, tmp_path):
    async with backends(redis_url, prefix, tmp_path) as (argv, placers):
        async with gateway_at(argv, tmp_path / "gateway.port") as gw:
            kept = (await gw.Submit(gateway_pb2.SubmitRequest(task=small_task()), timeout=20)).task  # at cheap
        # what a gateway that died in the middle of a Submit leaves: the task recorded as submitted and held by
        # cheap; and a task cheap holds that no record mentions (its Place went out before any record was durable)
        # and a task recorded as deferred at cheap that cheap placed from its queue, unseen by the gateway
        interrupted = pb.Task(task_id="t-interrupted", spec=small_task(), datacenter="cheap")
        interrupted.spec.request_id = "interrupted-by-a-crash"
        queued = pb.Task(task_id="t-queued", spec=small_task(), datacenter="cheap")
        redis = connect(redis_url)
        store = TaskStore(redis, Keys(prefix).tasks)
        await asyncio.gather(store.record("dc_selected", interrupted), store.record("deferred", queued))
        await redis.aclose()
        async with grpc.aio.insecure_channel(placers["cheap"]) as channel:
            for task_id in ("t-interrupted", "t-orphan", "t-queued"):
                held = await placer_pb2_grpc.PlacerStub(channel).Place(
                    placer_pb2.PlaceRequest(task_id=task_id, task=small_task()), timeout=5)
                assert held.outcome == placer_pb2.PLACE_OUTCOME_PLACED
        # a new gateway starts on that history
        async with gateway_at(argv, tmp_path / "gateway2.port") as gw2:
            with pytest.raises(grpc.aio.AioRpcError) as gone:  # abandoned: no trace left, its request_id is free
                await gw2.Get(gateway_pb2.GetRequest(task_id="t-interrupted"), timeout=5)
            assert gone.value.code() == grpc.StatusCode.NOT_FOUND
            retry = await gw2.Submit(gateway_pb2.SubmitRequest(task=interrupted.spec), timeout=20)
            assert not retry.duplicate and retry.task.state == pb.TASK_STATE_PLACED
            kept2 = retry.task
            placed = await gw2.Get(gateway_pb2.GetRequest(task_id="t-queued"), timeout=5)
            assert placed.state == pb.TASK_STATE_PLACED and placed.datacenter == "cheap"
            assert sum(a.resources.cpu_milli for a in placed.assignments) == 2000
            expected = {kept.task_id: ["alloc"], "t-interrupted": ["alloc", "free"], "t-orphan": ["alloc", "free"],
                        "t-queued": ["alloc"]}
            if kept2.datacenter == "cheap":
                expected[kept2.task_id] = ["alloc"]
            for _ in range(50):  # released at cheap in the background; the task the table shows placed is kept
                events: dict[str, list[str]] = {}
                for e in await cheap_ledger(redis_url, prefix):
                    events.setdefault(e["task"], []).append(e["t"])
                if events == expected:
                    break
                await asyncio.sleep(0.1)
            assert events == expected
            assert (await gw2.Get(gateway_pb2.GetRequest(task_id=kept.task_id), timeout=5)).state == \
                pb.TASK_STATE_PLACED
