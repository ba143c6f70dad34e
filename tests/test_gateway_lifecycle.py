"""The task lifecycle end to end through real processes (gateway, selector, one placer per DC of the small fleet)
on a real Redis, with a compressed execution clock: a task runs for its runtime and succeeds, its resources come
back, a Release of a running task frees it and of a finished one changes nothing, and a gateway SIGKILLed while
tasks run (and wait in a queue) misses and doubles no transition once restarted."""

from __future__ import annotations

import json
import time
from collections import Counter

import grpc
import pytest
import redis

from hsched import cli
from hsched.state.keys import Keys
from hsched.v1 import common_pb2 as pb
from hsched.v1 import gateway_pb2, gateway_pb2_grpc, placer_pb2, placer_pb2_grpc
from tests.conftest import small_fleet_stack

pytestmark = pytest.mark.slow
TIME_FACTOR = 60  # a minute of task time per wall second
FINAL = cli.FINAL


@pytest.fixture(scope="module")
def stack(redis_url):
    with small_fleet_stack(redis_url, "gwlife", thermal=False, extra_env={"HSCHED_TIME_FACTOR": str(TIME_FACTOR)}) as s:
        yield s


def stub(stack) -> gateway_pb2_grpc.GatewayStub:
    return gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(stack.gateway))


def task(cores: int, runtime_s: float) -> pb.TaskSpec:
    return pb.TaskSpec(resources=pb.Resources(cpu_milli=cores * 1000, memory_mib=4096), runtime_s=runtime_s)


def wait_for(predicate, what: str, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            pytest.fail(f"not after {timeout_s:.0f} s: {what}")
        time.sleep(0.1)
    return value


def free_cores(stack, dc: str) -> int:
    with grpc.insecure_channel(stack.placer_target(dc)) as ch:
        state = placer_pb2_grpc.PlacerStub(ch).GetState(placer_pb2.PlacerStateRequest(), timeout=10)
    return state.summary.free.cpu_milli


def kinds_per_task(stack) -> dict[str, list[str]]:
    """Task id -> the kinds of its records on the task stream, in order (every record the gateways wrote)."""
    client = redis.Redis.from_url(stack.config.redis_url)
    out: dict[str, list[str]] = {}
    for _, fields in client.xrange(Keys(stack.config.prefix).tasks):
        out.setdefault(pb.Task.FromString(fields[b"t"]).task_id, []).append(fields[b"k"].decode())
    return out


def test_a_task_runs_for_its_runtime_succeeds_and_frees_its_resources(stack):
    gw = stub(stack)
    idle = free_cores(stack, "cheap")
    placed = gw.Submit(gateway_pb2.SubmitRequest(task=task(cores=4, runtime_s=120)), timeout=30).task
    assert placed.state == pb.TASK_STATE_PLACED and placed.datacenter == "cheap"
    events = []
    for ev in gw.Watch(gateway_pb2.WatchRequest(task_id=placed.task_id, after_event_id="0"), timeout=120):
        events.append((ev.kind, ev.state))
        if ev.state in FINAL:
            break
    assert events == [("submitted", pb.TASK_STATE_SUBMITTED), ("dc_selected", pb.TASK_STATE_SUBMITTED),
                      ("placed", pb.TASK_STATE_PLACED), ("running", pb.TASK_STATE_RUNNING),
                      ("succeeded", pb.TASK_STATE_SUCCEEDED)]
    done = gw.Get(gateway_pb2.GetRequest(task_id=placed.task_id), timeout=10)
    assert done.state == pb.TASK_STATE_SUCCEEDED
    assert placed.created_unix_ms <= done.started_unix_ms < done.finished_unix_ms
    wait_for(lambda: free_cores(stack, "cheap") == idle, "cheap's cores back after the task finished")
    listed = gw.List(gateway_pb2.ListRequest(state=pb.TASK_STATE_SUCCEEDED), timeout=10).tasks
    assert placed.task_id in [t.task_id for t in listed]
    # a finished task: a Release changes nothing
    assert gw.Release(gateway_pb2.ReleaseRequest(task_id=placed.task_id), timeout=30).task == done


def test_a_release_of_a_running_task_frees_it(stack):
    gw = stub(stack)
    idle = free_cores(stack, "cheap")
    service = gw.Submit(gateway_pb2.SubmitRequest(task=task(cores=2, runtime_s=36_000)), timeout=30).task  # 10 min
    running = wait_for(lambda: (t := gw.Get(gateway_pb2.GetRequest(task_id=service.task_id), timeout=10)).state ==
                       pb.TASK_STATE_RUNNING and t, "the long-running task started")
    released = gw.Release(gateway_pb2.ReleaseRequest(task_id=service.task_id), timeout=30).task
    assert released.state == pb.TASK_STATE_RELEASED and released.started_unix_ms == running.started_unix_ms
    assert released.finished_unix_ms >= running.started_unix_ms
    assert free_cores(stack, "cheap") == idle
    assert kinds_per_task(stack)[service.task_id] == ["submitted", "dc_selected", "placed", "running", "released"]


def test_a_gateway_killed_while_tasks_run_and_wait_loses_and_doubles_no_transition(stack):
    gw = stub(stack)
    # whole-node tasks: the fleet holds 12 (4 per DC), the last two wait in cheap's queue until room is freed
    submitted = [gw.Submit(gateway_pb2.SubmitRequest(task=task(cores=24, runtime_s=240)), timeout=30).task
                 for _ in range(14)]
    deferred = {t.task_id for t in submitted if t.state == pb.TASK_STATE_DEFERRED}
    assert len(deferred) == 2 and all(t.state == pb.TASK_STATE_PLACED for t in submitted if t.task_id not in deferred)
    wait_for(lambda: any(t.state == pb.TASK_STATE_RUNNING for t in gw.List(gateway_pb2.ListRequest(), timeout=10)
                         .tasks), "a task running")
    stack.kill("gateway")  # SIGKILL while tasks run and wait
    # the placers go on: the queued tasks are placed as the first ones finish, while no gateway follows
    wait_for(lambda: _queue_empty(stack), "cheap placed its queue")
    stack.restart("gateway")
    gw = stub(stack)
    ids = [t.task_id for t in submitted]
    wait_for(lambda: all(gw.Get(gateway_pb2.GetRequest(task_id=i), timeout=10).state == pb.TASK_STATE_SUCCEEDED
                         for i in ids), "every task succeeded", timeout_s=240)
    kinds = kinds_per_task(stack)
    for task_id in ids:
        first = ["submitted", "dc_selected", "deferred" if task_id in deferred else "placed"]
        assert kinds[task_id] == [*first, *(["placed"] if task_id in deferred else []), "running", "succeeded"], \
            (task_id, kinds[task_id])
    assert Counter(k for i in ids for k in kinds[i])["succeeded"] == 14
    for dc in ("cheap", "near", "gpu"):  # every core is back
        with grpc.insecure_channel(stack.placer_target(dc)) as ch:
            summary = placer_pb2_grpc.PlacerStub(ch).GetState(placer_pb2.PlacerStateRequest(), timeout=10).summary
        assert summary.free.cpu_milli == summary.capacity.cpu_milli, dc


def _queue_empty(stack) -> bool:
    with grpc.insecure_channel(stack.placer_target("cheap")) as ch:
        state = placer_pb2_grpc.PlacerStub(ch).GetState(placer_pb2.PlacerStateRequest(), timeout=10)
    return not state.deferred_task_ids


def test_cli_watch_of_one_task_ends_with_its_final_state(stack, capsys):
    gw = stub(stack)
    placed = gw.Submit(gateway_pb2.SubmitRequest(task=task(cores=2, runtime_s=60)), timeout=30).task
    assert cli.main(["watch", placed.task_id, "--gateway", stack.gateway]) == 0  # returns once it finished
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[2] for line in lines] == ["submitted", "dc_selected", "placed", "running", "succeeded"]
    assert cli.main(["watch", placed.task_id, "--gateway", stack.gateway]) == 0  # finished already: at once
    assert capsys.readouterr().out.split()[:2] == [placed.task_id, "SUCCEEDED"]
    assert cli.main(["list", "--state", "succeeded", "--gateway", stack.gateway]) == 0
    assert placed.task_id in capsys.readouterr().out


def test_a_task_with_runtime_0_runs_until_released_even_across_a_placer_restart(stack):
    gw = stub(stack)
    idle = free_cores(stack, "cheap")
    service = gw.Submit(gateway_pb2.SubmitRequest(task=task(cores=2, runtime_s=0)), timeout=30).task
    assert service.state == pb.TASK_STATE_PLACED and service.datacenter == "cheap"

    def get() -> pb.Task:
        return gw.Get(gateway_pb2.GetRequest(task_id=service.task_id), timeout=10)

    running = wait_for(lambda: (t := get()).state == pb.TASK_STATE_RUNNING and t, "the task started")
    stack.kill("placer-cheap")  # SIGKILL while it runs; the restarted placer resumes its clock from the ledger
    stack.restart("placer-cheap")
    time.sleep(3)  # three task minutes: a task with any runtime up to that would have finished
    still = get()
    assert (still.state, still.started_unix_ms, still.finished_unix_ms) == (pb.TASK_STATE_RUNNING,
                                                                           running.started_unix_ms, 0)
    assert free_cores(stack, "cheap") == idle - 2000
    released = gw.Release(gateway_pb2.ReleaseRequest(task_id=service.task_id), timeout=30).task
    assert released.state == pb.TASK_STATE_RELEASED and released.started_unix_ms == running.started_unix_ms
    assert free_cores(stack, "cheap") == idle
    assert kinds_per_task(stack)[service.task_id] == ["submitted", "dc_selected", "placed", "running", "released"]


def test_the_trace_replay_summary_counts_running_and_succeeded_tasks(stack, redis_url):
    """Three one-minute tasks (a wall second each) arrive first, a ten-hour one with them and a run-until-released
    one last, three wall seconds later: at the end the gateway has the three SUCCEEDED, the other two RUNNING (the
    last one may still be PLACED)."""
    import asyncio

    from hsched.domain.resources import Resources
    from hsched.domain.task import TaskSpec
    from hsched.replay import STATE_COLUMNS, TraceTask, dc_summaries, replay, summary_document, summary_rows

    def trace_task(arrival_s: float, runtime_s: float) -> TraceTask:
        return TraceTask(TaskSpec(Resources(2000, 4096), runtime_s=runtime_s), arrival_s, runtime_s)

    tasks = [*(trace_task(0, 60) for _ in range(3)), trace_task(0, 36_000), trace_task(100, 0)]
    stats = asyncio.run(replay(stack.gateway, tasks, duration_s=3.0, concurrency=8, release=False))
    assert stats.submitted == 5 and not stats.errors
    rows = summary_rows(stats, asyncio.run(dc_summaries(redis_url, stack.config.prefix, stack.fleet)))
    total = {k: sum(r[k] for r in rows) for k in (*STATE_COLUMNS, "preempted")}
    # the last one is read right after its Submit: RUNNING, or still PLACED if its start overhead has not passed
    last = 1 if stats.final[max(stats.final, key=lambda i: stats.final[i].created_unix_ms)].state == \
        pb.TASK_STATE_PLACED else 0
    assert total == {**dict.fromkeys((*STATE_COLUMNS, "preempted"), 0), "succeeded": 3, "running": 2 - last,
                     "placed": last}
    doc = summary_document("hand-made", stats, rows)
    assert sum(r["succeeded"] for r in doc["datacenters"]) == 3 and doc["first_answers"] == {"placed": 5}
    gw = stub(stack)
    for task_id, task in stats.final.items():  # leave the fleet idle for the tests after this one
        if task.state in (pb.TASK_STATE_RUNNING, pb.TASK_STATE_PLACED):
            gw.Release(gateway_pb2.ReleaseRequest(task_id=task_id), timeout=30)


def test_hsched_replay_json_has_the_lifecycle_columns(stack, redis_url, monkeypatch, capsys):
    monkeypatch.setenv("REDIS_URL", redis_url)
    code = cli.main(["replay", "openb", "--limit", "6", "--duration", "1", "--gateway", stack.gateway,
                     "--prefix", stack.config.prefix, "--json"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)  # stdout is the JSON alone (progress: stderr)
    assert doc["trace"] == "openb" and doc["submitted"] == 6
    rows = doc["datacenters"]
    assert {"running", "succeeded", "failed", "preempted", "expired"} <= set(rows[0])
    counted = sum(r[k] for r in rows for k in ("placed", "deferred", "running", "succeeded", "failed", "released",
                                               "expired", "rejected"))
    assert counted == 6 - doc["first_answers"].get("error", 0)
    gw = stub(stack)
    for t in gw.List(gateway_pb2.ListRequest(limit=1000), timeout=10).tasks:  # the fleet idle again
        if t.state not in FINAL:
            gw.Release(gateway_pb2.ReleaseRequest(task_id=t.task_id), timeout=30)
