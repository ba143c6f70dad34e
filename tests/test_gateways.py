"""Two gateways on one Redis behind one address (gRPC round_robin over both): a request_id retried on either
gets one task, each sees what the other records (Get, List, Watch, Release), and a gateway SIGKILLed under load
loses nothing acknowledged while the other keeps serving and releases what the dead one left placed without a
record. Real services: the small fleet's placers and selector in-process, the gateways as processes (so one
can be killed), a real Redis under the test's own prefix; the placers' ledgers say what is held."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest

from hsched.lb import balanced
from hsched.state.lifecycle import LIVE, ON_NODES
from hsched.v1 import common_pb2 as pb
from hsched.v1 import gateway_pb2, gateway_pb2_grpc
from tests.test_gateway_failures import backends, small_task
from tests.test_gateway_write_path import held, until, with_request_id

ROOT = Path(__file__).resolve().parents[1]
LEASE_S, SWEEP_S = 1.0, 1.0  # a dead gateway's orphans are released within ~2 s


@asynccontextmanager
async def gateway_processes(argv: list[str], tmp_path: Path, n: int = 2):
    """`n` gateway processes on the same prefix; yields their Popen objects and addresses."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    procs, targets = [], []
    try:
        for i in range(n):
            port_file = tmp_path / f"gateway-{i}.port"
            log = open(tmp_path / f"gateway-{i}.log", "wb")  # closed with the process
            procs.append((subprocess.Popen(
                [sys.executable, "-m", "services.gateway", *argv, "--port-file", str(port_file),
                 "--gateway-lease-s", str(LEASE_S), "--orphan-sweep-s", str(SWEEP_S)],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        for i, (proc, _) in enumerate(procs):
            port_file = tmp_path / f"gateway-{i}.port"
            for _ in range(600):
                if (port_file.exists() and port_file.read_text()) or proc.poll() is not None:
                    break
                await asyncio.sleep(0.05)
            assert port_file.exists(), (tmp_path / f"gateway-{i}.log").read_text()[-2000:]
            targets.append(f"127.0.0.1:{port_file.read_text()}")
        yield [p for p, _ in procs], targets
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, log in procs:  # waited for without blocking the loop: the in-process placers answer its goodbye
            for _ in range(600):
                if proc.poll() is not None:
                    break
                await asyncio.sleep(0.05)
            else:
                proc.kill()
                proc.wait(timeout=10)
            log.close()


def stub(target: str) -> tuple[grpc.aio.Channel, gateway_pb2_grpc.GatewayStub]:
    channel = grpc.aio.insecure_channel(target, options=balanced(target))
    return channel, gateway_pb2_grpc.GatewayStub(channel)


async def test_two_gateways_share_request_ids_tasks_watches_and_releases(redis_url, prefix, tmp_path):
    async with backends(redis_url, prefix, tmp_path) as (argv, _), gateway_processes(argv, tmp_path) as (_, (a, b)):
        (ch_a, gw_a), (ch_b, gw_b) = stub(a), stub(b)
        try:
            # a Watch on B from now on, opened before anything is submitted on A
            watch = gw_b.Watch(gateway_pb2.WatchRequest(after_event_id="$"), timeout=120)
            await asyncio.sleep(0.5)  # the Watch subscribed (its first event is what it proves)

            # the same request_id on both gateways at once: one task, the same answer on both
            rids = [f"both-{i}" for i in range(8)]
            pairs = await asyncio.gather(*(asyncio.gather(
                gw_a.Submit(gateway_pb2.SubmitRequest(task=with_request_id(r, "t1")), timeout=30),
                gw_b.Submit(gateway_pb2.SubmitRequest(task=with_request_id(r, "t1")), timeout=30)) for r in rids))
            for on_a, on_b in pairs:
                assert on_a.task.task_id == on_b.task.task_id
                assert on_a.task.datacenter == on_b.task.datacenter and on_a.task.state == on_b.task.state
                assert list(on_a.task.assignments) == list(on_b.task.assignments)
                assert sorted([on_a.duplicate, on_b.duplicate]) == [False, True]  # one scheduled, one waited
            ids = {on_a.task.task_id: on_a.task.datacenter for on_a, _ in pairs}
            assert len(ids) == len(rids)
            assert await held(redis_url, prefix) == {t: [dc] for t, dc in ids.items()}  # each placed once

            # a retry later, on the other gateway: still that answer
            again = await gw_b.Submit(gateway_pb2.SubmitRequest(task=with_request_id(rids[0], "t1")), timeout=30)
            assert again.duplicate and again.task.task_id == pairs[0][0].task.task_id
            # another tenant's same request_id is another request
            other = await gw_b.Submit(gateway_pb2.SubmitRequest(task=with_request_id(rids[0], "t2")), timeout=30)
            assert not other.duplicate and other.task.task_id not in ids

            # submitted on A, read on B at once (a table miss catches up with the stream)
            on_a = [(await gw_a.Submit(gateway_pb2.SubmitRequest(task=small_task()), timeout=30)).task
                    for _ in range(3)]
            for task in on_a:
                got = await gw_b.Get(gateway_pb2.GetRequest(task_id=task.task_id), timeout=5)
                assert got.state in ON_NODES and got.datacenter == task.datacenter
            everything = {*ids, other.task.task_id, *(t.task_id for t in on_a)}

            async def listed_on_both() -> bool:
                seen = [{t.task_id for t in (await gw.List(gateway_pb2.ListRequest(limit=100), timeout=5)).tasks}
                        for gw in (gw_a, gw_b)]
                return seen[0] == seen[1] == everything
            await until(listed_on_both, "both gateways list every task")

            # B's Watch saw every task placed, whichever gateway scheduled it
            placed: set[str] = set()
            while placed != everything:
                event = await asyncio.wait_for(watch.read(), 30)
                if event.kind == "placed":
                    placed.add(event.task_id)
            watch.cancel()

            # released on B, submitted on A; the record shows on A too
            released = (await gw_b.Release(gateway_pb2.ReleaseRequest(task_id=on_a[0].task_id), timeout=30)).task
            assert released.state == pb.TASK_STATE_RELEASED
            assert on_a[0].task_id not in await held(redis_url, prefix)

            async def released_on_a() -> bool:
                got = await gw_a.Get(gateway_pb2.GetRequest(task_id=on_a[0].task_id), timeout=5)
                return got.state == pb.TASK_STATE_RELEASED
            await until(released_on_a, "A shows the release B recorded")
            # both release the same task at once: one record, both answer it released
            both = await asyncio.gather(
                gw_a.Release(gateway_pb2.ReleaseRequest(task_id=on_a[1].task_id), timeout=30),
                gw_b.Release(gateway_pb2.ReleaseRequest(task_id=on_a[1].task_id), timeout=30))
            assert {r.task.state for r in both} == {pb.TASK_STATE_RELEASED}
            history = await gw_a.DescribeTask(gateway_pb2.GetRequest(task_id=on_a[1].task_id), timeout=5)
            assert [e.kind for e in history.events].count("released") == 1
        finally:
            await ch_a.close()
            await ch_b.close()


async def test_a_gateway_killed_under_load_loses_nothing_acknowledged_and_places_nothing_twice(
        redis_url, prefix, tmp_path):
    requests = [f"load-{i}" for i in range(48)]
    async with backends(redis_url, prefix, tmp_path) as (argv, _), \
            gateway_processes(argv, tmp_path) as (procs, targets):
        both = f"ipv4:{','.join(targets)}"  # one address for the client: round robin over the two
        channel, gw = stub(both)
        answers: dict[str, pb.Task] = {}
        failures = {"calls": 0}
        killed = asyncio.Event()

        async def client(rids: list[str]) -> None:
            for rid in rids:
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 120
                while True:  # a client retries with the same request_id until it gets an answer
                    try:
                        reply = await gw.Submit(gateway_pb2.SubmitRequest(task=with_request_id(rid, "load")),
                                                timeout=20)
                        answers[rid] = reply.task
                        break
                    except grpc.aio.AioRpcError as exc:
                        assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                              grpc.StatusCode.CANCELLED), exc.details()
                        failures["calls"] += 1
                        assert loop.time() < deadline, f"{rid}: no answer after 120 s ({exc.details()})"
                        await asyncio.sleep(0.2)
                if len(answers) == len(requests) // 3 and not killed.is_set():
                    killed.set()
                    procs[0].send_signal(signal.SIGKILL)  # mid-load: some of its Submits are under way

        try:
            await asyncio.gather(*(client(requests[i::8]) for i in range(8)))
            assert killed.is_set() and procs[0].wait(timeout=10) == -signal.SIGKILL
            assert set(answers) == set(requests)
            survivor = gateway_pb2_grpc.GatewayStub(grpc.aio.insecure_channel(targets[1]))
            for rid, task in answers.items():  # nothing acknowledged is lost; a retry answers the same task
                got = await survivor.Get(gateway_pb2.GetRequest(task_id=task.task_id), timeout=5)
                assert got.state in LIVE and got.datacenter == task.datacenter, (rid, got)
                retry = await survivor.Submit(gateway_pb2.SubmitRequest(task=with_request_id(rid, "load")),
                                              timeout=20)
                assert retry.duplicate and retry.task.task_id == task.task_id

            expected = {t.task_id: [t.datacenter] for t in answers.values()}

            async def exactly_the_answers() -> bool:  # the dead gateway's unrecorded placements released
                return await held(redis_url, prefix) == expected
            await until(exactly_the_answers, "the ledgers hold each answered task once and nothing else")
            listed = (await survivor.List(gateway_pb2.ListRequest(tenant="load", limit=1000), timeout=5)).tasks
            assert sorted(t.task_id for t in listed) == sorted(expected)  # one task per request
        finally:
            await channel.close()


@pytest.mark.parametrize("target, policy", [("127.0.0.1:1", None), ("ipv4:127.0.0.1:1,127.0.0.1:2", "round_robin")])
def test_several_addresses_are_balanced_round_robin(target, policy):
    options = dict(balanced(target, [("grpc.keepalive_time_ms", 1)]))
    assert options.get("grpc.lb_policy_name") == policy and options["grpc.keepalive_time_ms"] == 1


async def test_a_stale_writer_gets_conflict_and_writes_after_catching_up(redis, prefix):
    """Two tables of one stream (two gateways): a step taken from a record another writer has since replaced is
    refused whole (nothing appended), and taken again once the table caught up; fences guard a group."""
    from hsched.state.keys import Keys
    from hsched.state.tasks import Conflict, TaskStore, step

    keys = Keys(prefix)
    a, b = TaskStore(redis, keys.tasks), TaskStore(redis, keys.tasks)
    task = pb.Task(task_id="t1", spec=small_task())
    await a.write(step("submitted", task), step("placed", task))
    assert await b.refresh() == 2 and b.tasks["t1"].state == pb.TASK_STATE_PLACED
    running = a.copy("t1")
    await a.write(step("running", running))
    stale = b.copy("t1")  # B has not read A's `running` yet
    with pytest.raises(Conflict):
        await b.write(step("released", stale))
    assert [f[b"k"] for _, f in await redis.xrange(keys.tasks)] == [b"submitted", b"placed", b"running"]
    await b.refresh()
    assert b.tasks["t1"].state == pb.TASK_STATE_RUNNING
    await b.write(step("released", b.copy("t1")))  # decided again on the newest record: taken
    # a new task id that another writer recorded first is refused too (a DAG job's fixed task ids)
    with pytest.raises(Conflict):
        await a.write(step("submitted", pb.Task(task_id="t1")), step("placed", pb.Task(task_id="t1")))
    # A folds what B wrote (its reader or a refresh), by entry id: never an older record over a newer one
    await a.refresh()
    assert a.tasks["t1"].state == b.tasks["t1"].state == pb.TASK_STATE_RELEASED
    # a group is written only while each fence holds its value
    await redis.set(f"{prefix}:fence", "mine")
    await a.write(step("submitted", pb.Task(task_id="t2")), fences=((f"{prefix}:fence", "mine"),))
    with pytest.raises(Conflict):
        await a.write(step("submitted", pb.Task(task_id="t3")), fences=((f"{prefix}:fence", "lost"),))
    assert "t2" in a.tasks and "t3" not in a.tasks
    assert await redis.xlen(keys.tasks) == 5


async def test_placements_of_a_live_gateway_are_left_alone_and_a_gone_ones_released(redis_url, prefix, tmp_path):
    """Reconcile does not fight: a placement without a record whose task id names a gateway that holds its lease
    may still be recorded by it, so another gateway's sweep leaves it; once that lease is gone, it is released."""
    import redis as syncredis

    from hsched.state.gateways import task_id_of
    from hsched.state.keys import Keys
    from hsched.state.tasks import now_ms
    from hsched.v1 import placer_pb2, placer_pb2_grpc
    from tests.test_gateway_failures import gateway_at

    keys, sync = Keys(prefix), syncredis.Redis.from_url(redis_url)
    sync.set(keys.gateway("a1a1a1"), "token", px=60_000)  # a live gateway that is placing its Submits
    live, dead = task_id_of("a1a1a1", now_ms()), task_id_of("d0d0d0", now_ms())  # d0d0d0 holds no lease
    async with backends(redis_url, prefix, tmp_path) as (argv, placers), \
            gateway_at([*argv, "--orphan-sweep-s", "0.5"], tmp_path / "gateway.port"):
        async with grpc.aio.insecure_channel(placers["cheap"]) as channel:  # as those gateways' Places would
            placer = placer_pb2_grpc.PlacerStub(channel)
            for task_id in (live, dead):
                reply = await placer.Place(placer_pb2.PlaceRequest(task_id=task_id, task=small_task()), timeout=5)
                assert reply.outcome == placer_pb2.PLACE_OUTCOME_PLACED

        async def only_live() -> bool:
            return await held(redis_url, prefix) == {live: ["cheap"]}
        await until(only_live, "the gone gateway's placement released, the live one's kept")
        await asyncio.sleep(2.0)  # several sweeps later: still kept
        assert await held(redis_url, prefix) == {live: ["cheap"]}
        sync.delete(keys.gateway("a1a1a1"))  # that gateway is gone now

        async def none() -> bool:
            return not await held(redis_url, prefix)
        await until(none, "the placement of the gateway whose lease went is released")
