"""hsched.state.ledger on a real Redis: lease, fencing tokens, fenced appends, and replay as an exact fold."""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import yaml

from hsched.domain.cluster import ClusterState, OverAllocation, Part
from hsched.domain.fleet import DataCenter, parse_fleet
from hsched.domain.resources import Resources
from hsched.domain.task import TaskSpec, task_to_dict
from hsched.state.keys import Keys
from hsched.state.ledger import Fenced, LeaseHeld, Ledger, fold_event, replay
from hsched.state.redis import connect

SMALL_FLEET = Path(__file__).resolve().parent / "fleets" / "small.yaml"
DC = "cheap"


def cheap() -> DataCenter:
    return parse_fleet(yaml.safe_load(SMALL_FLEET.read_text())).datacenter(DC)  # 4 nodes × 24 cores


@pytest.fixture
async def redis(redis_url):
    client = connect(redis_url)
    yield client
    await client.aclose()


def ledger(redis, prefix: str, owner: str, lease_ms: int = 3000) -> Ledger:
    return Ledger(redis, Keys(prefix), DC, owner, lease_ms=lease_ms)


def alloc(task: str, *parts: Part) -> dict:
    return {"t": "alloc", "task": task, "parts": [p.to_json() for p in parts]}


def spec(cpu: int) -> TaskSpec:
    return TaskSpec(Resources(cpu, 512), runtime_s=30.0, tenant="team-a", request_id=f"r{cpu}")


def same_state(a: ClusterState, b: ClusterState) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a.snapshot(), b.snapshot(), strict=True)) \
        and a.allocations == b.allocations


# The history used by the replay tests: every event type, a task that waits then runs, one that is dropped.
P_A = (Part(0, 0, 0, 8000, 1024, 10, 100), Part(0, 1, 1, 8000, 1024, 10, 100))
P_B = (Part(0, 0, 2, 24_000, 4096, 0, 0),)
P_Q1 = (Part(0, 0, 0, 2000, 512, 0, 0),)
SPECS = {"q1": spec(2000), "q2": spec(30_000), "q3": spec(4000)}
HISTORY = [
    alloc("a", *P_A),
    alloc("b", *P_B),
    {"t": "defer", "task": "q1", "spec": task_to_dict(SPECS["q1"])},
    {"t": "defer", "task": "q2", "spec": task_to_dict(SPECS["q2"])},
    {"t": "free", "task": "a"},
    alloc("q1", *P_Q1),  # the queued q1 runs after a's release: it leaves the queue
    {"t": "drop", "task": "q2"},
    {"t": "defer", "task": "q3", "spec": task_to_dict(SPECS["q3"])},
]


def expected_fold(dc: DataCenter, events: list[dict]) -> tuple[ClusterState, OrderedDict]:
    """The same history applied by hand, without fold_event."""
    state, queue = ClusterState(dc), OrderedDict()
    for e in events:
        if e["t"] == "alloc":
            queue.pop(e["task"], None)
            state.apply(e["task"], tuple(Part.from_json(p) for p in e["parts"]))
        elif e["t"] == "free":
            state.release(e["task"])
        elif e["t"] == "defer":
            queue[e["task"]] = SPECS[e["task"]]
        else:
            queue.pop(e["task"])
    return state, queue


# ------------------------------------------------------------------------------------------------------------
# lease and fencing


async def test_acquire_gives_increasing_fencing_tokens(redis, prefix) -> None:
    a = ledger(redis, prefix, "a")
    t1 = await a.acquire()
    t2 = await a.acquire()  # the holder may take the lease again: a new, larger token
    await a.release_lease()
    b = ledger(redis, prefix, "b")
    t3 = await b.acquire()
    assert (t1, t2, t3) == (1, 2, 3)  # INCR on a fresh fence key
    assert b.token == 3


async def test_second_owner_cannot_acquire_while_the_lease_is_held(redis, prefix) -> None:
    a, b = ledger(redis, prefix, "a"), ledger(redis, prefix, "b")
    await a.acquire()
    with pytest.raises(LeaseHeld, match="is owned by placer"):
        await b.acquire()
    assert b.token is None


async def test_second_owner_acquires_after_the_lease_lapses(redis, prefix) -> None:
    a, b = ledger(redis, prefix, "a", lease_ms=200), ledger(redis, prefix, "b", lease_ms=200)
    await a.acquire()
    loop = asyncio.get_running_loop()
    start = loop.time()
    token = await b.acquire(wait_s=3.0)  # polls until a's 200 ms lease lapses
    waited = loop.time() - start
    assert token == 2
    assert 0.1 < waited < 2.0


async def test_renew_keeps_the_lease_only_for_its_holder(redis, prefix) -> None:
    a, b = ledger(redis, prefix, "a", lease_ms=300), ledger(redis, prefix, "b")
    await a.acquire()
    for _ in range(3):  # 3 × 150 ms = 450 ms > 300 ms: only renewals keep it
        await asyncio.sleep(0.15)
        assert await a.renew()
    with pytest.raises(LeaseHeld):
        await b.acquire()
    assert not await b.renew()


async def test_release_lease_lets_the_next_owner_in_at_once(redis, prefix) -> None:
    a, b = ledger(redis, prefix, "a"), ledger(redis, prefix, "b")
    await a.acquire()
    await b.release_lease()  # not the holder: a no-op
    with pytest.raises(LeaseHeld):
        await b.acquire()
    await a.release_lease()
    assert await b.acquire() == 2


async def test_fenced_owner_writes_nothing(redis, prefix) -> None:
    a, b = ledger(redis, prefix, "a", lease_ms=200), ledger(redis, prefix, "b")
    await a.acquire()
    await a.append([alloc("x", Part(0, 0, 0, 1000, 0, 0, 0))])
    assert await redis.xlen(a.stream) == 1
    await b.acquire(wait_s=3.0)  # a's lease lapsed (a paused): b owns the DC with token 2
    with pytest.raises(Fenced, match="token 1 is stale"):
        await a.append([{"t": "free", "task": "x"}, alloc("y", Part(0, 0, 1, 1000, 0, 0, 0))])
    assert await redis.xlen(a.stream) == 1  # neither event of the batch was written
    await b.append([{"t": "free", "task": "x"}])
    assert await redis.xlen(a.stream) == 2


async def test_append_needs_a_token_and_events(redis, prefix) -> None:
    a = ledger(redis, prefix, "a")
    with pytest.raises(Fenced, match="acquire"):
        await a.append([{"t": "free", "task": "x"}])
    await a.acquire()
    with pytest.raises(ValueError, match="nothing to append"):
        await a.append([])
    assert await redis.xlen(a.stream) == 0


async def test_append_is_one_batch_and_returns_the_last_id(redis, prefix) -> None:
    a = ledger(redis, prefix, "a")
    await a.acquire()
    last = await a.append(HISTORY[:3])
    entries = await redis.xrange(a.stream)
    assert [json.loads(f[b"e"]) for _, f in entries] == HISTORY[:3]
    assert entries[-1][0].decode() == last


# ------------------------------------------------------------------------------------------------------------
# replay / fold


async def test_replay_folds_to_the_state_and_queue_that_wrote_it(redis, prefix) -> None:
    dc = cheap()
    a = ledger(redis, prefix, "a")
    await a.acquire()
    last = await a.append(HISTORY)
    state, queue = ClusterState(dc), OrderedDict()
    assert await replay(redis, a.stream, state, queue) == last
    want_state, want_queue = expected_fold(dc, HISTORY)
    assert same_state(state, want_state)
    assert queue == want_queue
    # by hand: b (node 2, 24 cores) and q1 (node 0, 2 cores) run; a was freed; q3 waits, q2 was dropped
    assert sorted(state.allocations) == ["b", "q1"]
    np.testing.assert_array_equal(state.free_cpu, [22_000, 24_000, 0, 24_000])
    assert list(queue) == ["q3"] and queue["q3"] == spec(4000)


async def test_replay_after_an_id_folds_only_the_rest(redis, prefix) -> None:
    dc = cheap()
    a = ledger(redis, prefix, "a")
    await a.acquire()
    mid = await a.append(HISTORY[:2])  # ends with alloc b: folding it twice would raise
    last = await a.append(HISTORY[2:])
    state, queue = ClusterState(dc), OrderedDict()
    assert await replay(redis, a.stream, state, queue, after="-") == last  # reference: everything
    part_state, part_queue = ClusterState(dc), OrderedDict()
    assert await replay(redis, a.stream, part_state, part_queue, after="0-0") == last  # "0-0" excludes nothing
    assert same_state(part_state, state)
    # fold the first half by hand, then replay strictly after `mid`
    half_state, half_queue = expected_fold(dc, HISTORY[:2])
    assert await replay(redis, a.stream, half_state, half_queue, after=mid) == last
    assert same_state(half_state, state) and half_queue == queue
    # nothing after the last id: unchanged, and the same id back
    assert await replay(redis, a.stream, half_state, half_queue, after=last) == last
    assert same_state(half_state, state)


async def test_replay_pages_through_long_ledgers(redis, prefix) -> None:
    dc = cheap()
    a = ledger(redis, prefix, "a")
    await a.acquire()
    last = await a.append(HISTORY)
    state, queue = ClusterState(dc), OrderedDict()
    assert await replay(redis, a.stream, state, queue, batch=3) == last  # 8 events in pages of 3, 3, 2
    want_state, want_queue = expected_fold(dc, HISTORY)
    assert same_state(state, want_state) and queue == want_queue


async def test_replay_of_an_empty_stream(redis, prefix) -> None:
    state, queue = ClusterState(cheap()), OrderedDict()
    assert await replay(redis, Keys(prefix).ledger(DC), state, queue) == "0-0"
    assert state.allocations == {} and not queue


def test_fold_of_an_unknown_event_type_raises() -> None:
    state, queue = ClusterState(cheap()), OrderedDict()
    with pytest.raises(ValueError, match="ledger event type 'grow' is unknown"):
        fold_event({"t": "grow", "task": "x"}, state, queue)


def test_fold_of_an_alloc_that_does_not_fit_raises() -> None:
    state, queue = ClusterState(cheap()), OrderedDict()
    fold_event(alloc("x", Part(0, 0, 0, 20_000, 0, 0, 0)), state, queue)
    with pytest.raises(OverAllocation):
        fold_event(alloc("y", Part(0, 0, 0, 5_000, 0, 0, 0)), state, queue)  # 20 + 5 > 24 cores
    assert list(state.allocations) == ["x"]
