"""Retention on a real Redis: ledger snapshot + trim (fenced, never losing the fold), followers that lag
behind a trim, and the task stream's pruning and compaction."""

from __future__ import annotations

import asyncio
from collections import OrderedDict

import pytest

from hsched.domain.cluster import ClusterState
from hsched.state.follow import LedgerFollower, follow
from hsched.state.keys import Keys
from hsched.state.ledger import AppendNotReplicated, Fenced, replay, snapshot_and_trim, trimmed_past
from hsched.state.tasks import TaskStore, now_ms, prune
from hsched.v1 import common_pb2 as pb
from tests.test_ledger import (  # noqa: F401 - fixtures below
    HISTORY,
    alloc,
    cheap,
    ledger,
    redis,
    same_state,
)

FIRST, REST = HISTORY[:5], HISTORY[5:]  # the trim falls mid-history: q1 waits in the queue, b runs


async def _fold(redis_client, stream: str) -> tuple[ClusterState, OrderedDict, str]:
    state, queue = ClusterState(cheap()), OrderedDict()
    last = await replay(redis_client, stream, state, queue)
    return state, queue, last


async def test_no_snapshot_is_written_while_appends_of_unknown_outcome_are_owed_their_cancellations(
        redis, prefix) -> None:  # noqa: F811
    """The fold then lacks those events: nothing is written, and the caller hears so (None), not "0 trimmed"
    (a placer logged a snapshot every minute that was never written)."""
    a = ledger(redis, prefix, "a")
    await a.acquire()
    mid = await a.append(FIRST)
    a.min_replicas, a.wait_timeout_ms = 1, 50  # this Redis has no replica: the append's outcome is unknown
    with pytest.raises(AppendNotReplicated):
        await a.append(REST[:1])
    assert a.pending_undo
    state, queue, _ = await _fold(redis, a.stream)
    assert await snapshot_and_trim(a, state, queue, mid, margin_s=0) is None
    assert not await redis.exists(Keys(prefix).snapshot("a")) and await redis.xlen(a.stream) == len(FIRST) + 1


async def test_replay_after_snapshot_and_trim_is_the_untrimmed_fold(redis, prefix) -> None:  # noqa: F811
    a = ledger(redis, prefix, "a")
    await a.acquire()
    mid = await a.append(FIRST)
    state, queue, last = await _fold(redis, a.stream)
    assert last == mid
    trimmed, held_back = await snapshot_and_trim(a, state, queue, mid, margin_s=0)
    assert trimmed == len(FIRST) - 1 and not held_back  # MINID keeps the entry at the snapshot id itself
    assert await redis.xlen(a.stream) == 1
    end = await a.append(REST)
    got_state, got_queue, got_last = await _fold(redis, a.stream)
    # the same history into a ledger of its own, never trimmed
    b = ledger(redis, prefix + "-untrimmed", "b")
    await b.acquire()
    await b.append(HISTORY)
    want_state, want_queue, _ = await _fold(redis, b.stream)
    assert got_last == end
    assert same_state(got_state, want_state) and got_queue == want_queue
    assert sorted(got_state.allocations) == ["b", "q1"] and list(got_queue) == ["q3"]
    await redis.delete(b.stream, Keys(prefix + "-untrimmed").fence("cheap"), Keys(prefix + "-untrimmed").lease("cheap"))


async def test_the_margin_keeps_young_entries(redis, prefix) -> None:  # noqa: F811
    a = ledger(redis, prefix, "a")
    await a.acquire()
    last = await a.append(HISTORY)
    state, queue, _ = await _fold(redis, a.stream)
    trimmed, held_back = await snapshot_and_trim(a, state, queue, last, margin_s=300)
    assert trimmed == 0 and held_back
    assert await redis.xlen(a.stream) == len(HISTORY)
    got_state, got_queue, got_last = await _fold(redis, a.stream)  # snapshot + nothing after it
    assert got_last == last and same_state(got_state, state) and got_queue == queue


async def test_a_fenced_writer_cannot_snapshot_or_trim(redis, prefix) -> None:  # noqa: F811
    a = ledger(redis, prefix, "a", lease_ms=200)
    await a.acquire()
    last = await a.append(HISTORY)
    state, queue, _ = await _fold(redis, a.stream)
    b = ledger(redis, prefix, "b")
    await b.acquire(wait_s=5)  # a's lease lapsed: b's token fences a out
    with pytest.raises(Fenced):
        await snapshot_and_trim(a, ClusterState(cheap()), OrderedDict(), last, margin_s=0)
    assert await redis.xlen(a.stream) == len(HISTORY)
    assert not await redis.exists(Keys(prefix).snapshot("cheap"))
    got_state, got_queue, _ = await _fold(redis, a.stream)
    assert same_state(got_state, state) and got_queue == queue


async def test_a_follower_lagging_behind_a_trim_recovers_the_same_fold(redis, prefix) -> None:  # noqa: F811
    a = ledger(redis, prefix, "a")
    await a.acquire()
    await a.append(HISTORY[:2])
    follower = LedgerFollower(redis, a.stream, cheap())
    await follower.load()
    lagging_at = follower.last_id
    # while the follower is away: more entries, then a snapshot that trims the ones it has not read
    mid = await a.append(HISTORY[2:6])
    state, queue, _ = await _fold(redis, a.stream)
    await snapshot_and_trim(a, state, queue, mid, margin_s=0)
    assert await trimmed_past(redis, a.stream, lagging_at)
    end = await a.append(HISTORY[6:])
    tail = asyncio.create_task(follow(redis, [follower]))
    try:
        await follower.wait_for(end, timeout_s=30)
    finally:
        while not tail.done():  # cancel again until done: redis-py / 3.11 timeouts can swallow a cancel
            tail.cancel()
            await asyncio.wait({tail}, timeout=0.5)
    want_state, want_queue, _ = await _fold(redis, a.stream)
    assert same_state(follower.state, want_state) and follower.queue == want_queue
    assert sorted(follower.state.allocations) == ["b", "q1"] and list(follower.queue) == ["q3"]


async def test_a_follower_ahead_of_the_trim_does_not_reload(redis, prefix) -> None:  # noqa: F811
    a = ledger(redis, prefix, "a")
    await a.acquire()
    last = await a.append(HISTORY)
    follower = LedgerFollower(redis, a.stream, cheap())
    await follower.load()
    await snapshot_and_trim(a, follower.state, follower.queue, last, margin_s=0)
    assert not await follower.resync_if_trimmed()


def _task(task_id: str, state: int, updated_ms: int, request_id: str = "") -> pb.Task:
    return pb.Task(task_id=task_id, state=state, updated_unix_ms=updated_ms,
                   spec=pb.TaskSpec(tenant="team-a", request_id=request_id))


async def test_prune_forgets_old_finished_tasks_and_keeps_live_ones_across_a_reload(redis, prefix) -> None:  # noqa: F811
    store = TaskStore(redis, Keys(prefix).tasks)
    kinds = {"released": "released", "rejected": "rejected", "placed": "placed", "deferred": "deferred"}
    for task_id, kind in kinds.items():
        await store.record("submitted", _task(task_id, 0, 0, request_id=f"r-{task_id}"))
        await store.record(kind, store.tasks[task_id])
    assert await prune(store, retention_ms=3_600_000) == (0, 0)  # all younger than the retention: kept
    assert sorted(store.tasks) == sorted(kinds) and await redis.xlen(store.stream) == 8
    later = now_ms() + 2 * 3_600_000  # two hours on: everything written so far is older than the retention
    gone, trimmed = await prune(store, retention_ms=3_600_000, now=later)
    assert (gone, trimmed) == (2, 8)  # the live tasks' records were written again before the trim
    assert sorted(store.tasks) == ["deferred", "placed"]
    assert ("team-a", "r-released") not in store.by_request and ("team-a", "r-placed") in store.by_request
    reloaded = TaskStore(redis, store.stream)
    await reloaded.load()
    assert {t: reloaded.tasks[t].state for t in reloaded.tasks} == {
        "placed": pb.TASK_STATE_PLACED, "deferred": pb.TASK_STATE_DEFERRED}
    assert reloaded.tasks["placed"] == store.tasks["placed"]
    # another round as old: the kept records are written again and the previous ones trimmed — bounded, not lost
    assert await prune(store, retention_ms=3_600_000, now=later) == (0, 2)
    assert await redis.xlen(store.stream) == 2
    again = TaskStore(redis, store.stream)
    await again.load()
    assert sorted(again.tasks) == ["deferred", "placed"]


async def test_placer_engine_snapshots_and_trims_and_a_restart_rebuilds_the_same_state(redis, prefix) -> None:  # noqa: F811
    from hsched.engine.placer import PlacerEngine
    from hsched.policies.heuristics import make_policy
    from hsched.state.ledger import Retention, snapshot_id
    from tests.test_engine import spec

    dc = cheap()
    retention = Retention(snapshot_entries=3, snapshot_interval_s=0.2, trim_margin_s=0)
    first = PlacerEngine(dc, redis, Keys(prefix), make_policy("bestfit"), "p1", retention=retention)
    await first.start()
    try:
        for i in range(4):
            assert (await first.place(f"f{i}", spec(20))).outcome == "placed"
        assert (await first.place("q", spec(20))).outcome == "deferred"
        await first.release("f0")  # q runs from the queue
        await first.place("q2", spec(20))  # waits
        stream = Keys(prefix).ledger("cheap")
        for _ in range(300):  # the engine snapshots between batches, in the background
            if await snapshot_id(redis, stream) == first.last_id and await redis.xlen(stream) <= 1:
                break
            await asyncio.sleep(0.1)
        assert await snapshot_id(redis, stream) == first.last_id and await redis.xlen(stream) <= 1
        want_state, want_queue, last = first.state, OrderedDict(first.queue), first.last_id
    finally:
        await first.stop()
    second = PlacerEngine(dc, redis, Keys(prefix), make_policy("bestfit"), "p2", retention=retention)
    await second.start(wait_for_lease_s=0)
    try:
        assert same_state(second.state, want_state) and second.queue == want_queue and second.last_id == last
        assert sorted(second.state.allocations) == ["f1", "f2", "f3", "q"] and list(second.queue) == ["q2"]
    finally:
        await second.stop()
