"""The gateway's side of the task lifecycle (issue 15): transitions hook, the DC ledger follower that turns
placer-initiated ledger events into task events (idempotently, resuming after a restart), Release semantics.
Real Redis, real Ledger writer, real gateway services."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from contextlib import asynccontextmanager

from hsched.domain.cluster import ClusterState, Part
from hsched.domain.fleet import load_fleet
from hsched.domain.resources import Resources
from hsched.domain.task import TaskSpec, task_to_dict
from hsched.state.follow import LedgerFollower, follow
from hsched.state.keys import Keys
from hsched.state.ledger import Ledger, replay, snapshot_and_trim
from hsched.state.lifecycle import TaskLifecycle
from hsched.state.redis import connect
from hsched.state.tasks import TaskStore, ledger_ref, now_ms, prune, step
from hsched.state.transitions import Transitions
from hsched.v1 import common_pb2 as pb
from tests.conftest import SMALL_FLEET


async def test_transitions_see_every_durable_record_in_order_and_not_the_replayed_ones(redis_url, prefix):
    client = connect(redis_url)
    try:
        seen: list[tuple[str, str, int]] = []

        async def callback(task: pb.Task, kind: str) -> None:
            await asyncio.sleep(0)  # a subscriber that awaits does not reorder what follows
            seen.append((task.task_id, kind, task.state))

        store = TaskStore(client, Keys(prefix).tasks, transitions=Transitions())
        store.transitions.subscribe(callback)
        a, b = pb.Task(task_id="a"), pb.Task(task_id="b")
        await store.write(step("submitted", a), step("placed", a))
        await store.write(step("submitted", b), step("deferred", b))
        await store.transitions.drained()
        assert seen == [("a", "submitted", pb.TASK_STATE_SUBMITTED), ("a", "placed", pb.TASK_STATE_PLACED),
                        ("b", "submitted", pb.TASK_STATE_SUBMITTED), ("b", "deferred", pb.TASK_STATE_DEFERRED)]
        again = TaskStore(client, Keys(prefix).tasks, transitions=Transitions())
        again.transitions.subscribe(callback)
        assert await again.load() == 4
        await again.transitions.drained()
        assert len(seen) == 4  # a restart rebuilds its table silently
    finally:
        await client.aclose()


# -- the ledger follower, driven by a real Ledger writer (what a placer appends) --------------------------------

CHEAP = next(dc for dc in load_fleet(SMALL_FLEET).datacenters if dc.name == "cheap")
CHEAP_TABLE = ClusterState(CHEAP).table


def alloc(task: str, at: int = 1, node: int = 1) -> dict:
    return {"t": "alloc", "task": task, "parts": [Part(0, 0, node, 2000, 2048, 0, 0).to_json()], "at": at,
            "runtime_s": 10.0, "class": "offline", "tenant": ""}


def defer(task: str, at: int = 1) -> dict:
    return {"t": "defer", "task": task, "spec": task_to_dict(TaskSpec(runtime_s=10.0, resources=Resources(cpu_milli=2000,
                                                                                          memory_mib=2048))),
            "at": at}


@asynccontextmanager
async def following(redis_url: str, prefix: str):
    """A gateway's task store and ledger follower of the small fleet's "cheap" DC (as `serve` wires them)."""
    client, reader = connect(redis_url), connect(redis_url)
    store = TaskStore(client, Keys(prefix).tasks)
    await store.load()
    lifecycle = TaskLifecycle(store)
    followers = [LedgerFollower(reader, Keys(prefix).ledger("cheap"), CHEAP)]
    await lifecycle.start(reader, followers)
    job = asyncio.create_task(follow(reader, followers, trim_check_s=0.05))
    try:
        yield store, lifecycle
    finally:
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)
        await client.aclose()
        await reader.aclose()


async def seed(store: TaskStore, task_id: str, kind: str) -> None:
    """A task as a Submit leaves it at "cheap": placed or deferred (its records, without a ledger entry)."""
    task = pb.Task(task_id=task_id, datacenter="cheap", spec=pb.TaskSpec(queue_timeout_s=5))
    await store.write(step("submitted", task), step(kind, task))


async def kinds(redis_url: str, prefix: str) -> dict[str, list[str]]:
    """Task id -> the kinds of its task-stream records that reflect a ledger entry, in stream order."""
    client = connect(redis_url)
    try:
        out: dict[str, list[str]] = {}
        for _, fields in await client.xrange(Keys(prefix).tasks):
            if fields.get(b"l") and fields[b"d"] != b"kept by compaction":
                out.setdefault(pb.Task.FromString(fields[b"t"]).task_id, []).append(fields[b"k"].decode())
        return out
    finally:
        await client.aclose()


async def appended(ledger: Ledger, lifecycle: TaskLifecycle, *batches: list[dict]) -> None:
    for batch in batches:
        await ledger.append(batch)
    assert await lifecycle.settle("cheap", 30), "the follower did not catch up"


EXPECTED = {"p": ["running", "succeeded"],
            "q": ["placed", "running", "preempted", "deferred", "placed", "deferred", "placed", "running", "failed"],
            "e": ["expired"]}


async def test_placer_events_become_task_events_once_each_across_restarts(redis_url, prefix):
    writer = connect(redis_url)
    ledger = Ledger(writer, Keys(prefix), "cheap", owner="test-placer")
    await ledger.acquire()
    try:
        async with following(redis_url, prefix) as (store, lifecycle):
            for task_id, kind in (("p", "placed"), ("q", "deferred"), ("e", "deferred"), ("r", "placed")):
                await seed(store, task_id, kind)
            # what the Submits caused (recorded by them) changes nothing; then the placer's own steps
            await appended(ledger, lifecycle, [alloc("p", 100), defer("q", 100), defer("e", 100), alloc("r", 100)],
                           [{"t": "run", "task": "p", "at": 200}], [{"t": "done", "task": "p", "ok": True, "at": 300}],
                           [alloc("q", 310)], [{"t": "run", "task": "q", "at": 320}])
            got = store.tasks
            assert (got["p"].state, got["p"].started_unix_ms, got["p"].finished_unix_ms) == \
                (pb.TASK_STATE_SUCCEEDED, 200, 300)
            assert got["q"].state == pb.TASK_STATE_RUNNING and [a.node for a in got["q"].assignments] == \
                [CHEAP_TABLE.names[1]]
            assert got["r"].state == pb.TASK_STATE_PLACED
        # the gateway is gone while the placer goes on: preempted + requeued in one append, placed again, failed
        await ledger.append([{"t": "preempt", "task": "q", "by": "o", "at": 400}, defer("q", 400)])
        # ... and a placement from the queue whose append had an unknown outcome is undone (free + defer)
        await ledger.append([alloc("q", 500, node=2)])
        await ledger.append([{"t": "free", "task": "q"}, defer("q", 501)])
        async with following(redis_url, prefix) as (store, lifecycle):  # a restarted gateway catches up
            assert store.tasks["q"].state == pb.TASK_STATE_DEFERRED and store.tasks["q"].preemptions == 1
            await appended(ledger, lifecycle, [alloc("q", 507, node=2)], [{"t": "run", "task": "q", "at": 510}],
                           [{"t": "done", "task": "q", "ok": False, "at": 600, "reason": "exit 3"}],
                           [{"t": "expire", "task": "e", "at": 700}], [{"t": "free", "task": "r"}])
            q = store.tasks["q"]
            assert (q.state, q.reason, q.started_unix_ms, q.finished_unix_ms, q.preemptions) == \
                (pb.TASK_STATE_FAILED, "exit 3", 510, 600, 1)
            assert store.tasks["e"].state == pb.TASK_STATE_EXPIRED and store.tasks["e"].finished_unix_ms == 700
            assert store.tasks["r"].state == pb.TASK_STATE_PLACED  # a free is a Release's: it records that itself
        async with following(redis_url, prefix) as (store, lifecycle):  # and again: nothing new to record
            assert await lifecycle.settle("cheap", 30)
        assert await kinds(redis_url, prefix) == EXPECTED
    finally:
        await writer.aclose()


async def test_a_ledger_trimmed_past_the_gateway_is_re_derived_from_its_snapshot(redis_url, prefix):
    writer = connect(redis_url)
    ledger = Ledger(writer, Keys(prefix), "cheap", owner="test-placer")
    await ledger.acquire()
    try:
        async with following(redis_url, prefix) as (store, lifecycle):
            for task_id, kind in (("a", "placed"), ("b", "deferred"), ("c", "placed"), ("d", "placed")):
                await seed(store, task_id, kind)
            await appended(ledger, lifecycle, [alloc("a", 10), defer("b", 10), alloc("c", 10, node=2),
                                               alloc("d", 10, node=3)])
        # while no gateway follows: a finishes, b is placed and starts, c is preempted and requeued, d runs
        await ledger.append([{"t": "done", "task": "a", "ok": True, "at": 20}])
        await ledger.append([alloc("b", 30), {"t": "run", "task": "b", "at": 31}])
        await ledger.append([{"t": "preempt", "task": "c", "by": "o", "at": 40}, defer("c", 40)])
        last = await ledger.append([{"t": "run", "task": "d", "at": 50}])
        state, queue = ClusterState(CHEAP), OrderedDict()
        assert await replay(writer, Keys(prefix).ledger("cheap"), state, queue) == last
        await snapshot_and_trim(ledger, state, queue, last, margin_s=0, now_s=time.time() + 60)
        left = await writer.xrange(Keys(prefix).ledger("cheap"))
        assert [e.decode() for e, _ in left] == [last]  # what the gateway missed is gone but the newest entry
        await ledger.append([{"t": "run", "task": "c", "at": 60}])  # after the snapshot: read as usual (no-op)
        async with following(redis_url, prefix) as (store, lifecycle):
            assert await lifecycle.settle("cheap", 30)
            got = {t: store.tasks[t] for t in "abcd"}
        assert got["a"].state == pb.TASK_STATE_FAILED and "outcome unknown" in got["a"].reason  # how it ended: trimmed
        assert (got["b"].state, got["b"].started_unix_ms) == (pb.TASK_STATE_RUNNING, 31)
        assert (got["c"].state, got["c"].preemptions) == (pb.TASK_STATE_DEFERRED, 1)
        assert (got["d"].state, got["d"].started_unix_ms) == (pb.TASK_STATE_RUNNING, 50)
        assert await kinds(redis_url, prefix) == {"a": ["failed"], "b": ["placed", "running"],
                                                  "c": ["preempted", "deferred"], "d": ["running"]}
    finally:
        await writer.aclose()


async def test_retention_forgets_finished_tasks_and_compaction_keeps_the_ledger_cursor(redis_url, prefix):
    client = connect(redis_url)
    try:
        store = TaskStore(client, Keys(prefix).tasks)
        old = 1_000  # unix ms: long before the retention cut
        records = []
        for task_id, kind, entry in (("ok", "succeeded", "5-0"), ("bad", "failed", "6-0"), ("late", "expired", "8-0"),
                                     ("live", "running", "7-0"), ("queued", "deferred", "")):
            task = pb.Task(task_id=task_id, datacenter="cheap")
            records.append(step(kind, task, ledger=ledger_ref("cheap", entry) if entry else "", at_ms=old))
        await store.write(*records)
        assert store.ledger_cursor == {"cheap": (8, 0)}
        gone, trimmed = await prune(store, retention_ms=60_000, now=now_ms() + 3_600_000)
        assert (gone, trimmed) == (3, 5)  # the three finished tasks; every old entry once the live ones are re-kept
        again = TaskStore(client, Keys(prefix).tasks)
        await again.load()
        assert sorted(again.tasks) == ["live", "queued"]
        assert again.tasks["live"].state == pb.TASK_STATE_RUNNING
        assert again.ledger_cursor == {"cheap": (7, 0)}  # the live task's entry: what it reflects is not read twice
    finally:
        await client.aclose()
