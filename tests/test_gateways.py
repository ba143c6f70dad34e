"""Two gateways on one Redis behind one address (gRPC round_robin over both): a request_id retried on either
gets one task, each sees what the other records (Get, List, Watch, Release), and a gateway SIGKILLed under load
loses nothing acknowledged while the other keeps serving and releases what the dead one left placed without a
record. Real services: the small fleet's placers and selector in-process, the gateways as processes (so one
can be killed), a real Redis under the test's own prefix; the placers' ledgers say what is held."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest

from hsched.lb import balanced
from hsched.state.keys import Keys
from hsched.state.lifecycle import LIVE, ON_NODES
from hsched.state.redis import connect
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
            client = connect(redis_url)
            try:  # each claim went with its records (the write deletes it)
                assert not await client.exists(*(Keys(prefix).request("t1", r) for r in rids))
            finally:
                await client.aclose()

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


@pytest.mark.parametrize("target, policy, authority", [
    ("127.0.0.1:1", None, None),
    ("ipv4:127.0.0.1:1,127.0.0.1:2", "round_robin", "127.0.0.1:1"),  # TLS verifies the first address' host
    ("ipv6:[::1]:1,[::1]:2", "round_robin", "[::1]:1"),
])
def test_several_addresses_are_balanced_round_robin(target, policy, authority):
    options = dict(balanced(target, [("grpc.keepalive_time_ms", 1)]))
    assert options.get("grpc.lb_policy_name") == policy and options["grpc.keepalive_time_ms"] == 1
    assert options.get("grpc.default_authority") == authority


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


def _stage(name: str, tasks: int, runtime_s: float, parents: tuple[str, ...] = ()) -> pb.StageSpec:
    return pb.StageSpec(name=name, tasks=tasks, runtime_s=runtime_s, parents=list(parents),
                        resources=pb.Resources(cpu_milli=1000, memory_mib=1024))


async def test_a_dag_job_continues_on_the_other_gateway_when_its_own_is_killed(redis_url, prefix, tmp_path,
                                                                             monkeypatch):
    """A 3-stage job submitted on A; A SIGKILLed once stage 1 is placed: B adopts the job (A's lease gone) and
    runs it to the end, no stage task is submitted or placed twice, and a Watch on B sees every job and task
    event, whichever gateway recorded it."""
    monkeypatch.setenv("HSCHED_TIME_FACTOR", "20")  # the in-process placers' clock: a 20 s stage runs ~1 s
    spec = pb.JobSpec(name="adopted", tenant="dag", stages=[
        _stage("one", 2, 20.0), _stage("two", 2, 20.0, ("one",)), _stage("three", 1, 20.0, ("two",))])
    async with backends(redis_url, prefix, tmp_path) as (argv, _), \
            gateway_processes(argv, tmp_path) as (procs, (a, b)):
        (ch_a, gw_a), (ch_b, gw_b) = stub(a), stub(b)
        try:
            watch = gw_b.Watch(gateway_pb2.WatchRequest(after_event_id="$"), timeout=180)
            await asyncio.sleep(0.5)  # subscribed
            job = (await gw_a.SubmitJob(gateway_pb2.SubmitJobRequest(job=spec), timeout=30)).job
            stage_one = {f"{job.job_id}.one.{i}" for i in range(2)}
            events: list[pb.TaskEvent] = []
            while {e.task_id for e in events if e.kind == "running"} < stage_one:
                events.append(await asyncio.wait_for(watch.read(), 60))
            procs[0].send_signal(signal.SIGKILL)  # stage 1 running (both gateways saw it); stage 2 not yet begun
            assert procs[0].wait(timeout=10) == -signal.SIGKILL

            async def finished() -> pb.Job | None:
                got = await gw_b.GetJob(gateway_pb2.GetJobRequest(job_id=job.job_id), timeout=5)
                return got if got.state in (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED) else None
            done = await until(finished, "the job finishes on B", timeout_s=120)
            assert done.state == pb.JOB_STATE_SUCCEEDED, done.reason
            everything = {f"{job.job_id}.{s.name}.{i}" for s in spec.stages for i in range(s.tasks)}
            assert {t for s in done.stages for t in s.task_ids} == everything

            while "job_succeeded" not in {e.kind for e in events}:  # B's Watch: every event, A's and B's
                events.append(await asyncio.wait_for(watch.read(), 30))
            watch.cancel()
            assert [e.kind for e in events if not e.task_id] == ["job_submitted", "job_running", "job_succeeded"]
            for task_id in everything:
                kinds = [e.kind for e in events if e.task_id == task_id]
                assert kinds.count("submitted") == 1 and kinds.count("succeeded") == 1, (task_id, kinds)

            # no stage task submitted twice: one `submitted` record each in the stream, one placement each
            client = connect(redis_url)
            try:
                stream = [pb.Task.FromString(f[b"t"]).task_id for _, f in await client.xrange(Keys(prefix).tasks)
                          if f[b"k"] == b"submitted"]
                placements = [json.loads(f[b"e"])["task"] for dc in ("cheap", "near", "gpu")
                              for _, f in await client.xrange(Keys(prefix).ledger(dc))
                              if json.loads(f[b"e"])["t"] == "alloc"]
            finally:
                await client.aclose()
            assert sorted(stream) == sorted(everything)
            assert sorted(p for p in placements if p in everything) == sorted(everything)
        finally:
            await ch_a.close()
            await ch_b.close()


async def test_a_job_task_placed_by_a_stalled_owner_is_not_run_again_by_the_gateway_that_adopts_the_job(
        redis_url, prefix, tmp_path, monkeypatch):
    """A is SIGSTOPped while its Places of a wide stage are on the way: they are placed and run, but A records
    none of them. B adopts the job (A's lease lapsed) and sends the stage's unrecorded tasks again: the placer
    used to run the ones that had finished a second time (seen under chaos: 64 tasks, and a child stage
    started while a parent task ran again). Now it answers how they ended, B records that, and every task of
    the job is placed once."""
    monkeypatch.setenv("HSCHED_TIME_FACTOR", "20")  # a 20 s task runs 1 s
    wide = pb.StageSpec(name="wide", tasks=400, runtime_s=20.0, parents=["one"],
                        resources=pb.Resources(cpu_milli=100, memory_mib=64))
    spec = pb.JobSpec(name="stalled", tenant="dag", stages=[_stage("one", 1, 20.0), wide,
                                                            _stage("last", 1, 20.0, ("wide",))])
    async with backends(redis_url, prefix, tmp_path) as (argv, _), \
            gateway_processes(argv, tmp_path) as (procs, (a, b)):
        (ch_a, gw_a), (ch_b, gw_b) = stub(a), stub(b)
        try:
            watch = gw_b.Watch(gateway_pb2.WatchRequest(after_event_id="$"), timeout=180)
            await asyncio.sleep(0.5)  # subscribed
            job = (await gw_a.SubmitJob(gateway_pb2.SubmitJobRequest(job=spec), timeout=30)).job
            while True:  # A has begun sending the wide stage
                event = await asyncio.wait_for(watch.read(), 60)
                if event.kind == "submitted" and ".wide." in event.task_id:
                    break
            procs[0].send_signal(signal.SIGSTOP)
            try:
                async def finished() -> pb.Job | None:
                    got = await gw_b.GetJob(gateway_pb2.GetJobRequest(job_id=job.job_id), timeout=5)
                    return got if got.state in (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED) else None
                done = await until(finished, "B runs the job to its end", timeout_s=150)
            finally:
                procs[0].send_signal(signal.SIGCONT)
            watch.cancel()
            assert done.state == pb.JOB_STATE_SUCCEEDED, done.reason
            await asyncio.sleep(3 * LEASE_S)  # A resumes what it was doing, then learns the job is B's
            client = connect(redis_url)
            try:
                events = [json.loads(f[b"e"]) for _, f in await client.xrange(Keys(prefix).ledger(done.datacenter))]
            finally:
                await client.aclose()
            allocs = Counter(e["task"] for e in events if e["t"] == "alloc" and e["task"].startswith(job.job_id))
            assert len(allocs) == 402 and set(allocs.values()) == {1}, allocs.most_common(3)
            assert done.stages[1].succeeded == 400
        finally:
            await ch_a.close()
            await ch_b.close()


async def test_a_cancel_on_another_gateway_than_the_jobs_owner_wins_over_its_steps(redis_url, prefix, tmp_path):
    """CancelJob on B of a job A owns: recorded once, A stops advancing it, and its live tasks are released."""
    spec = pb.JobSpec(name="cancelled", tenant="dag", stages=[
        _stage("one", 2, 600.0), _stage("two", 1, 600.0, ("one",))])
    async with backends(redis_url, prefix, tmp_path) as (argv, _), gateway_processes(argv, tmp_path) as (_, (a, b)):
        (ch_a, gw_a), (ch_b, gw_b) = stub(a), stub(b)
        try:
            job = (await gw_a.SubmitJob(gateway_pb2.SubmitJobRequest(job=spec), timeout=30)).job
            stage_one = {f"{job.job_id}.one.{i}" for i in range(2)}

            async def placed() -> bool:
                return set(await held(redis_url, prefix)) >= stage_one
            await until(placed, "stage 1 placed")
            cancelled = await gw_b.CancelJob(gateway_pb2.CancelJobRequest(job_id=job.job_id), timeout=30)
            assert cancelled.state == pb.JOB_STATE_CANCELLED

            async def released() -> bool:
                return not stage_one & set(await held(redis_url, prefix))
            await until(released, "stage 1 released")
            for gw in (gw_a, gw_b):
                got = await gw.GetJob(gateway_pb2.GetJobRequest(job_id=job.job_id), timeout=5)
                assert got.state == pb.JOB_STATE_CANCELLED
            client = connect(redis_url)
            try:
                kinds = [f[b"k"] for _, f in await client.xrange(Keys(prefix).tasks)]
            finally:
                await client.aclose()
            assert kinds.count(b"job_cancelled") == 1 and b"job_succeeded" not in kinds
        finally:
            await ch_a.close()
            await ch_b.close()


async def test_two_live_gateways_advance_a_job_once(redis_url, prefix, tmp_path, monkeypatch):
    """Both gateways hear every transition of a job's tasks; only its owner advances it: each job record once,
    each task submitted once (the other gateway never sends its own Place of a stage task). A SubmitJob sent to
    both at once with one request_id makes one job, the same answer on both."""
    monkeypatch.setenv("HSCHED_TIME_FACTOR", "20")
    spec = pb.JobSpec(name="once", tenant="dag", stages=[
        _stage("one", 3, 20.0), _stage("two", 3, 20.0, ("one",)), _stage("three", 2, 20.0, ("one", "two"))])
    async with backends(redis_url, prefix, tmp_path) as (argv, _), gateway_processes(argv, tmp_path) as (_, (a, b)):
        (ch_a, gw_a), (ch_b, gw_b) = stub(a), stub(b)
        try:
            def with_request(rid: str) -> gateway_pb2.SubmitJobRequest:
                job = pb.JobSpec()
                job.CopyFrom(spec)
                job.request_id = rid
                return gateway_pb2.SubmitJobRequest(job=job)
            pairs = await asyncio.gather(*(asyncio.gather(gw_a.SubmitJob(with_request(rid), timeout=30),
                                                          gw_b.SubmitJob(with_request(rid), timeout=30))
                                           for rid in ("first", "second")))
            for on_a, on_b in pairs:
                assert on_a.job.job_id == on_b.job.job_id
                assert sorted([on_a.duplicate, on_b.duplicate]) == [False, True]
            jobs = [on_a.job for on_a, _ in pairs]
            jobs.append((await gw_b.SubmitJob(gateway_pb2.SubmitJobRequest(job=spec), timeout=30)).job)

            async def finished() -> bool:
                got = [await gw_b.GetJob(gateway_pb2.GetJobRequest(job_id=j.job_id), timeout=5) for j in jobs]
                return all(g.state in (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED) for g in got)
            await until(finished, "every job finishes", timeout_s=120)
            client = connect(redis_url)
            try:
                records = [(f[b"k"].decode(), f[b"t"]) for _, f in await client.xrange(Keys(prefix).tasks)]
            finally:
                await client.aclose()
            for j in jobs:
                kinds = [k for k, t in records if k.startswith("job_") and pb.Job.FromString(t).job_id == j.job_id]
                assert kinds == ["job_submitted", "job_running", "job_succeeded"], kinds
            submitted = [pb.Task.FromString(t).task_id for k, t in records if k == "submitted"]
            assert len(submitted) == len(set(submitted)) == 3 * 8
        finally:
            await ch_a.close()
            await ch_b.close()


def test_a_stack_of_two_supervised_gateways_is_one_round_robin_target(redis_url):
    """`hsched up --gateways 2`: one target naming both, a replay through it reaches both (a task id names its
    gateway), and a killed gateway is restarted on its port like any other service."""
    import time

    from hsched.replay import load_trace, replay, with_locations
    from hsched.state.gateways import owner_of
    from tests.conftest import small_fleet_stack

    with small_fleet_stack(redis_url, "gateways", gateways=2, thermal=False, supervise=True) as stack:
        assert stack.gateway_names == ["gateway", "gateway-2"]
        targets = [stack.services[n].target for n in stack.gateway_names]
        assert stack.gateway == f"ipv4:{targets[0]},{targets[1]}"
        tasks = with_locations(load_trace("openb", 40), stack.fleet, seed=1)
        stats = asyncio.run(replay(stack.gateway, tasks, duration_s=2.0, concurrency=8))
        assert stats.submitted == 40 and not stats.errors
        assert stats.outcomes["placed"] + stats.outcomes["deferred"] + stats.outcomes["rejected"] == 40
        assert len({owner_of(task_id) for task_id in stats.final}) == 2  # both gateways took Submits

        svc = stack.services["gateway-2"]
        port, restarts = svc.port, svc.restarts
        stack.kill("gateway-2")
        deadline = time.monotonic() + 120
        while not (svc.alive and svc.restarts > restarts and svc.serving_since is not None):
            assert time.monotonic() < deadline, "gateway-2 not restarted within 120 s"
            time.sleep(0.2)
        assert svc.port == port
        again = asyncio.run(replay(stack.gateway, tasks[:8], duration_s=0.5, concurrency=4))
        assert again.submitted == 8 and not again.errors
