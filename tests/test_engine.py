"""hsched.engine.placer.PlacerEngine in-process on a real Redis: place / defer / release / queue drain, retries,
restart by replay, lease hand-over and fencing, and the thermal guard over the REAL room model.

The DC is the small test fleet's "cheap": 4 nodes × 24 cores × 96 GiB on 2 racks of 2, FirstFit unless stated.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hsched.domain.cluster import ClusterState, Part
from hsched.domain.fleet import DataCenter, parse_fleet
from hsched.domain.resources import MILLI, Resources
from hsched.domain.task import TaskSpec, task_to_dict
from hsched.engine.placer import LoadDelta, PlacerEngine, PlaceResult, ThermalCheck
from hsched.policies.heuristics import HEURISTICS, make_policy
from hsched.state.follow import stream_id_tuple
from hsched.state.keys import Keys
from hsched.state.ledger import Fenced, LeaseHeld, replay
from hsched.state.redis import connect
from hsched.thermal.datacenter import load_arrays, room_for
from tests.test_policies import assert_books_balance

SMALL_FLEET = Path(__file__).resolve().parent / "fleets" / "small.yaml"
GIB = 1024


def cheap(redline_c: float | None = None) -> DataCenter:
    data = yaml.safe_load(SMALL_FLEET.read_text())
    if redline_c is not None:  # cheap's room: fixed 20 °C supply; idle inlets 20.09 / 21.24 °C, all busy 23.72 °C
        data["datacenters"][0]["thermal"] = {"supply_mode": "fixed", "t_supply_c": 20.0, "redline_c": redline_c}
    return parse_fleet(data).datacenter("cheap")


def spec(cores: float, replicas: int = 1, gpus: int = 0) -> TaskSpec:
    cpu = round(cores * MILLI)
    return TaskSpec(Resources(cpu, 2 * GIB, 0, 0, gpus, 100 if gpus else 0), runtime_s=60.0, replicas=replicas)


class LibraryThermalGuard:
    """The engine's ThermalGuard computed in-process by the real room model (hsched.thermal.datacenter.room_for)
    over a ClusterState folded from the same Redis ledger — what the thermal service does, minus gRPC."""

    def __init__(self, dc: DataCenter, redis, keys: Keys) -> None:
        self.room = room_for(dc)
        self.redis = redis
        self.stream = keys.ledger(dc.name)
        self.state = ClusterState(dc)
        self.queue: OrderedDict = OrderedDict()
        self.last_id = "0-0"
        self.calls: list[tuple[str, str]] = []  # (method, min_ledger_id)

    async def _load(self, min_ledger_id: str) -> tuple[np.ndarray, np.ndarray]:
        self.last_id = await replay(self.redis, self.stream, self.state, self.queue, after=self.last_id)
        assert stream_id_tuple(self.last_id) >= stream_id_tuple(min_ledger_id)  # read-your-writes
        return load_arrays(self.state)

    async def headroom(self, min_ledger_id: str) -> np.ndarray:
        self.calls.append(("headroom", min_ledger_id))
        return self.room.headroom_w(*await self._load(min_ledger_id))

    async def check(self, deltas: list[LoadDelta], min_ledger_id: str) -> ThermalCheck:
        self.calls.append(("check", min_ledger_id))
        busy, gpu = await self._load(min_ledger_id)
        d_cores, d_gpu = np.zeros(self.room.n), np.zeros(self.room.n)
        for d in deltas:
            d_cores[d.node] += d.cpu_milli / MILLI
            d_gpu[d.node] += d.gpu_busy
        before = self.room.evaluate(busy, gpu)
        after = self.room.predict(busy, d_cores, gpu, d_gpu)
        rise_before, rise_after = before.inlet_c - before.t_supply_c, after.inlet_c - after.t_supply_c
        worse = tuple(int(i) for i in after.hot_servers if rise_after[i] > rise_before[i] + 1e-9)
        return ThermalCheck(not worse, before.max_inlet_c, after.max_inlet_c, before.pue, after.pue,
                            after.t_supply_c, self.room.params.redline_c, worse,
                            self.room.headroom_w(busy + d_cores, gpu + d_gpu))


class OptimisticHeadroomGuard(LibraryThermalGuard):
    """Headroom that says yes to everything (a stale cache, say): only the batch check stands in the way."""

    async def headroom(self, min_ledger_id: str) -> np.ndarray:
        self.calls.append(("headroom", min_ledger_id))
        return np.full(self.room.n, np.inf)


@pytest.fixture
async def redis(redis_url):
    client = connect(redis_url)
    yield client
    await client.aclose()


def new_engine(dc: DataCenter, redis, prefix: str, owner: str = "p1", policy: str = "firstfit",
               thermal=None, lease_ms: int = 3000) -> PlacerEngine:
    return PlacerEngine(dc, redis, Keys(prefix), make_policy(policy), owner, thermal=thermal, lease_ms=lease_ms)


@asynccontextmanager
async def running(engine: PlacerEngine, wait_s: float = 5.0) -> AsyncIterator[PlacerEngine]:
    await engine.start(wait_for_lease_s=wait_s)
    try:
        yield engine
    finally:
        await engine.stop()


async def ledger_events(redis, prefix: str, dc: str = "cheap") -> list[tuple[str, dict]]:
    return [(i.decode(), json.loads(f[b"e"])) for i, f in await redis.xrange(Keys(prefix).ledger(dc))]


async def fold_ledger(redis, prefix: str, dc: DataCenter) -> tuple[ClusterState, OrderedDict]:
    state, queue = ClusterState(dc), OrderedDict()
    await replay(redis, Keys(prefix).ledger(dc.name), state, queue)
    return state, queue


def same_state(a: ClusterState, b: ClusterState) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a.snapshot(), b.snapshot(), strict=True)) \
        and a.allocations == b.allocations


async def fill(engine: PlacerEngine, n: int = 4) -> None:
    """Fill n of cheap's 24-core nodes (FirstFit: task f<i> on node i)."""
    for i in range(n):
        assert (await engine.place(f"f{i}", spec(24))).outcome == "placed"


# ------------------------------------------------------------------------------------------------------------
# place / defer / release / drain


async def test_place_is_in_the_ledger_before_the_answer(redis, prefix) -> None:
    async with running(new_engine(cheap(), redis, prefix)) as e:
        before = int(time.time() * 1000)
        r = await e.place("t1", spec(8))
        after = int(time.time() * 1000)
        assert r.outcome == "placed"
        assert r.parts == (Part(0, 0, 0, 8000, 2048, 0, 0),)  # FirstFit: node 0
        events = await ledger_events(redis, prefix)
        at = events[0][1]["at"]  # when it was placed: the execution clock starts there
        assert before <= at <= after
        assert events == [(r.ledger_id, {"t": "alloc", "task": "t1", "parts": [[0, 0, 0, 8000, 2048, 0, 0, []]],
                                         "at": at, "runtime_s": 60.0, "class": "offline", "tenant": "default",
                                         "spec": task_to_dict(spec(8))})]  # offline: what a preemption requeues
        assert e.state.free_cpu[0] == 16_000  # 24 000 - 8 000
        assert e.last_id == r.ledger_id


async def test_split_task_is_booked_as_one_alloc(redis, prefix) -> None:
    async with running(new_engine(cheap(), redis, prefix)) as e:
        r = await e.place("big", spec(30))
        # ceil(30/8) = 4 parts of 8, 8, 8, 6 cores; memory 2048 × 8/30 = 546 (×3) + 410; FirstFit packs node 0 then 1
        assert [(p.node, p.cpu_milli, p.memory_mib) for p in r.parts] == [
            (0, 8000, 546), (0, 8000, 546), (0, 8000, 546), (1, 6000, 410)]
        assert r.notes[0] == "split into 4 parts of <= 8 cores (paper 003)"
        assert len(await ledger_events(redis, prefix)) == 1


async def test_deferred_task_runs_when_a_release_frees_room_under_its_own_id(redis, prefix) -> None:
    async with running(new_engine(cheap(), redis, prefix)) as e:
        await fill(e)
        waiting = await e.place("q", spec(8))
        assert waiting.outcome == "deferred"
        assert waiting.reason == "no node has room for replica 0 part 0 now"
        assert waiting.notes[-1].startswith("queued behind 0 task(s) then; the queue is served in fair-share order")
        assert list(e.queue) == ["q"]

        freed = await e.release("f2")
        assert freed.released
        assert freed.freed == Resources(24_000, 2048)
        assert freed.placed_from_queue == [("q", (Part(0, 0, 2, 8000, 2048, 0, 0),))]  # node 2 is the free one
        events = [ev for _, ev in await ledger_events(redis, prefix)]
        assert events[-2:] == [{"t": "free", "task": "f2"},
                               {"t": "alloc", "task": "q", "parts": [[0, 0, 2, 8000, 2048, 0, 0, []]],
                                "at": events[-1]["at"], "runtime_s": 60.0, "class": "offline", "tenant": "default",
                                "spec": task_to_dict(spec(8)), "arrival": events[-3]["at"]}]  # its defer's
        assert sorted(e.state.allocations) == ["f0", "f1", "f3", "q"] and not e.queue

        # the queued task's cores are booked under "q", so releasing q frees them
        again = await e.release("q")
        assert again.released and again.freed.cpu_milli == 8000
        assert e.state.free_cpu[2] == 24_000


async def test_queue_drains_in_arrival_order_and_keeps_what_does_not_fit(redis, prefix) -> None:
    async with running(new_engine(cheap(), redis, prefix)) as e:
        await fill(e)
        for name, cores in (("q1", 20), ("q2", 10), ("q3", 4)):
            assert (await e.place(name, spec(cores))).outcome == "deferred"
        r = await e.release("f0")  # 24 cores free on node 0: q1 (20) first, q2 (10) no longer fits, q3 (4) does
        assert [t for t, _ in r.placed_from_queue] == ["q1", "q3"]
        assert list(e.queue) == ["q2"]


async def test_retried_place_of_a_held_task_allocates_nothing(redis, prefix) -> None:
    async with running(new_engine(cheap(), redis, prefix)) as e:
        first = await e.place("t1", spec(8))
        before, n_events = e.state.snapshot(), len(await ledger_events(redis, prefix))
        again = await e.place("t1", spec(8))
        assert again.outcome == "placed" and again.parts == first.parts
        assert "already placed" in again.notes[0]
        assert all(np.array_equal(a, b) for a, b in zip(e.state.snapshot(), before, strict=True))
        assert len(await ledger_events(redis, prefix)) == n_events


async def test_retried_place_of_a_queued_task_queues_nothing_more(redis, prefix) -> None:
    async with running(new_engine(cheap(), redis, prefix)) as e:
        await fill(e)
        await e.place("q", spec(8))
        n_events = len(await ledger_events(redis, prefix))
        again = await e.place("q", spec(8))
        assert again.outcome == "deferred" and again.reason == "already waiting in the deferred queue"
        assert list(e.queue) == ["q"] and len(await ledger_events(redis, prefix)) == n_events


async def test_place_after_the_callers_deadline_commits_nothing(redis, prefix) -> None:
    async with running(new_engine(cheap(), redis, prefix)) as e:
        late = await e.place("late", spec(8), not_after=time.time() - 0.001)
        assert late.outcome == "expired" and "deadline passed" in late.reason and late.parts == ()
        await fill(e)  # no room now: a late call with allow_defer queues nothing either
        assert (await e.place("late-q", spec(8), allow_defer=True, not_after=time.time() - 0.001)).outcome == "expired"
        assert "late" not in e.state.allocations and not e.queue
        assert [ev["task"] for _, ev in await ledger_events(redis, prefix)] == ["f0", "f1", "f2", "f3"]
        # in time: committed as usual; a retry after the deadline of a task already held gets that placement
        await e.release("f0")
        on_time = await e.place("t", spec(8), not_after=time.time() + 10)
        assert on_time.outcome == "placed"
        again = await e.place("t", spec(8), not_after=time.time() - 1)
        assert again.outcome == "placed" and again.parts == on_time.parts


async def test_release_of_an_unknown_task(redis, prefix) -> None:
    async with running(new_engine(cheap(), redis, prefix)) as e:
        await e.place("t1", spec(8))
        r = await e.release("nope")
        assert not r.released and r.freed == Resources()
        assert len(await ledger_events(redis, prefix)) == 1


async def test_release_of_a_queued_task_drops_it(redis, prefix) -> None:
    async with running(new_engine(cheap(), redis, prefix)) as e:
        await fill(e)
        await e.place("q", spec(8))
        r = await e.release("q")
        assert r.released and r.freed == Resources() and not r.placed_from_queue
        assert not e.queue
        assert (await ledger_events(redis, prefix))[-1][1] == {"t": "drop", "task": "q"}
        assert not (await e.release("f0")).placed_from_queue  # q does not come back


async def test_no_room_without_defer_and_unschedulable_are_not_queued(redis, prefix) -> None:
    async with running(new_engine(cheap(), redis, prefix)) as e:
        await fill(e)
        r = await e.place("n", spec(8), allow_defer=False)
        assert r.outcome == "no_room" and r.reason == "no node has room for replica 0 part 0 now"
        u = await e.place("g", spec(1, gpus=1))  # deferring cannot help: cheap has no GPUs
        assert u.outcome == "unschedulable" and u.reason == "no node of cheap has 1 GPUs (max 0)"
        assert not e.queue and len(await ledger_events(redis, prefix)) == 4


# ------------------------------------------------------------------------------------------------------------
# restart, lease and fencing


async def test_stop_returns_right_after_a_placement(redis, prefix) -> None:
    # A placement wakes the summary publisher (an XADD); stop() right then must still end it. A single cancel
    # can be swallowed — by Python 3.11's asyncio.wait_for as the awaited event fires, or inside redis-py while
    # the XADD is in flight — and stop() used to cancel once and wait forever (about 1 run in 4).
    for i in range(20):
        engine = new_engine(cheap(), redis, f"{prefix}:{i}")
        await engine.start()
        await engine.place("t", spec(1))
        stopping = asyncio.ensure_future(engine.stop())
        done, _ = await asyncio.wait({stopping}, timeout=2.0)
        if not done:
            for t in engine._tasks:  # do not leak the stuck publisher into the next test
                t.cancel()
        assert done, f"stop() hung on run {i}: {[t.get_name() for t in engine._tasks if not t.done()]}"


async def test_restarted_engine_rebuilds_identical_state_and_queue(redis, prefix) -> None:
    dc = cheap()
    first = new_engine(dc, redis, prefix, owner="p1", policy="bestfit")
    async with running(first):
        await fill(first, 3)
        await first.place("s", spec(30))  # split over node 3 and what is left
        await first.place("q1", spec(16))
        await first.place("q2", spec(2))
        await first.release("f1")
        await first.place("q3", spec(20, replicas=2))
        assert first.queue  # something is still waiting
        token, last_id = first.ledger.token, first.last_id
    second = new_engine(dc, redis, prefix, owner="p2", policy="bestfit")
    async with running(second, wait_s=0.0):  # p1 released its lease on stop: no wait
        assert same_state(second.state, first.state)
        assert second.queue == first.queue  # same tasks, specs and order
        assert second.last_id == last_id
        assert second.ledger.token == token + 1
        # and it carries on from there
        r = await second.release("s")
        assert r.released


async def test_second_engine_gets_the_lease_only_after_the_first_stops(redis, prefix) -> None:
    dc = cheap()
    first, second = new_engine(dc, redis, prefix, "p1"), new_engine(dc, redis, prefix, "p2")
    await first.start()
    try:
        with pytest.raises(LeaseHeld):
            await second.start(wait_for_lease_s=0.0)
        await first.place("t1", spec(4))
    finally:
        await first.stop()
    async with running(second, wait_s=0.0):
        assert second.ledger.token == first.ledger.token + 1
        assert list(second.state.allocations) == ["t1"]


async def wait_until(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.02)


async def test_paused_engine_is_fenced_its_failed_batch_changes_nothing_and_it_takes_the_lease_back(
        redis, prefix) -> None:
    dc = cheap()
    first = new_engine(dc, redis, prefix, "p1", lease_ms=300)
    second = new_engine(dc, redis, prefix, "p2", lease_ms=300)
    serving: list[bool] = []

    async def watch(up: bool) -> None:
        serving.append(up)

    first.add_serving_watcher(watch)
    await first.start()
    try:
        await fill(first)
        await first.place("q", spec(8))  # waits for room
        with pytest.raises(LeaseHeld):
            await second.start(wait_for_lease_s=0.0)  # first renews every 100 ms
        # first is "paused": its renewals stop (the process is otherwise alive and has not noticed yet)
        first._keeper.drop()
        await second.start(wait_for_lease_s=5.0)  # the 300 ms lease lapses; second takes token 2
        assert first.holding and second.ledger.token == first.ledger.token + 1
        before, allocs, queue = first.state.snapshot(), dict(first.state.allocations), OrderedDict(first.queue)
        n_events = len(await ledger_events(redis, prefix))

        # one batch for first: a release that would let q run, and a place (decided, folded, then fenced)
        results = await asyncio.gather(first.release("f0"), first.place("t", spec(4)), return_exceptions=True)
        assert all(isinstance(r, Fenced) for r in results), results
        assert all(np.array_equal(a, b) for a, b in zip(first.state.snapshot(), before, strict=True))
        assert first.state.allocations == allocs and first.queue == queue
        assert len(await ledger_events(redis, prefix)) == n_events
        assert first.fenced
        await wait_until(lambda: first.holder == "p2", "first sees the new holder")
        with pytest.raises(Fenced, match="standby for cheap, holder is p2"):
            await first.place("later", spec(1))
        assert same_state(second.state, first.state) and second.queue == first.queue
        assert (await second.release("f0")).placed_from_queue[0][0] == "q"  # the owner carries on
        await second.place("by-second", spec(2))
    finally:
        await second.stop()  # releases its lease: first takes it back with a new token and second's writes
    try:
        await wait_until(lambda: first.holding, "first serves again")
        assert first.ledger.token == second.ledger.token + 1
        state, queue = await fold_ledger(redis, prefix, dc)
        assert same_state(first.state, state) and first.queue == queue
        assert {"q", "by-second"} <= set(first.state.allocations) and "f0" not in first.state.allocations
        assert (await first.place("after", spec(1))).outcome == "placed"
        assert serving == [False, True]  # health: NOT_SERVING when fenced, SERVING again after the take-back
    finally:
        await first.stop()


async def test_standby_engine_takes_over_when_the_holder_stops_renewing(redis, prefix) -> None:
    dc = cheap()
    holder = new_engine(dc, redis, prefix, "p1", lease_ms=300)
    standby = new_engine(dc, redis, prefix, "p2", lease_ms=300)
    await holder.start()
    try:
        await holder.place("a", spec(4))
        await standby.start(standby=True)
        assert standby.fenced and standby.holder == "p1"
        with pytest.raises(Fenced, match="standby for cheap, holder is p1"):
            await standby.place("b", spec(1))
        await asyncio.sleep(1.0)  # three lease periods: the holder renews, the standby stays one
        assert standby.fenced and holder.holding
        holder._keeper.drop()  # the holder dies (its lease is not released, it lapses)
        await wait_until(lambda: standby.holding, "the standby takes over")
        assert standby.ledger.token == holder.ledger.token + 1
        assert list(standby.state.allocations) == ["a"]
        assert (await standby.place("b", spec(1))).outcome == "placed"
        with pytest.raises(Fenced):  # the old holder's next write is fenced out
            await holder.place("c", spec(1))
    finally:
        await holder.stop()
        await standby.stop()


class SlowPolicy:
    """FirstFit that burns `seconds` of CPU per decision on the event loop (a plan of one huge task)."""

    def __init__(self, seconds: float) -> None:
        self.inner, self.seconds, self.name = make_policy("firstfit"), seconds, "slow-firstfit"

    def scores(self, state, demand, mask):
        end = time.perf_counter() + self.seconds
        while time.perf_counter() < end:  # holds the GIL and the loop (CPython still switches threads)
            pass
        return self.inner.scores(state, demand, mask)

    def placed(self, node: int) -> None:
        self.inner.placed(node)


async def test_a_plan_that_blocks_the_loop_for_several_leases_keeps_the_lease(redis, prefix) -> None:
    dc = cheap()
    e = PlacerEngine(dc, redis, Keys(prefix), SlowPolicy(1.5), "p1", lease_ms=300)  # 5 lease periods per plan
    async with running(e):
        token = e.ledger.token
        assert (await e.place("big", spec(4))).outcome == "placed"
        assert (await e.place("big2", spec(4))).outcome == "placed"
        assert e.holding and e.ledger.token == token  # renewed from its own thread all along: never lost
        assert await redis.get(Keys(prefix).lease(dc.name)) == b"p1"


async def test_a_loop_stalled_past_the_bound_lets_the_lease_go_and_takes_it_back(redis, prefix) -> None:
    """The renewal thread keeps the lease only while the loop runs: a loop stuck past `max_loop_stall_s` (wedged)
    gives the DC up; once it runs again the engine takes the lease back with a new token."""
    dc = cheap()
    e = PlacerEngine(dc, redis, Keys(prefix), SlowPolicy(1.5), "p1", lease_ms=300, max_loop_stall_s=0.5)
    async with running(e):
        token = e.ledger.token
        assert (await e.place("big", spec(4))).outcome == "placed"  # nobody took the DC: the append went through
        await wait_until(lambda: e.holding and e.ledger.token > token, "the lease taken back")
        assert "event loop has not run" in e.lost_reason
        assert list(e.state.allocations) == ["big"]


async def test_a_bumped_fence_is_seen_at_the_next_renewal(redis, prefix) -> None:
    """An operator (or a thief) moves the fencing token on: the holder stops serving without waiting for a
    write, and takes the lease back with a newer token (nobody else holds the lease)."""
    dc = cheap()
    e = new_engine(dc, redis, prefix, "p1", lease_ms=300)
    async with running(e):
        await e.place("a", spec(4))
        token = e.ledger.token
        stolen = await redis.incr(Keys(prefix).fence(dc.name))
        await wait_until(lambda: e.ledger.token > stolen and e.holding, "a new token after the bump")
        assert e.ledger.token > token
        assert list(e.state.allocations) == ["a"]
        assert (await e.place("b", spec(1))).outcome == "placed"


# ------------------------------------------------------------------------------------------------------------
# thermal guard over the real room model


async def test_tiny_redline_defers_with_a_redline_reason(redis, prefix) -> None:
    dc = cheap(redline_c=21.0)  # the idle room already has inlets at 21.24 °C: every headroom is negative
    guard = LibraryThermalGuard(dc, redis, Keys(prefix))
    assert (guard.room.headroom_w(*load_arrays(ClusterState(dc))) < 0).all()
    async with running(new_engine(dc, redis, prefix, thermal=guard)) as e:
        r = await e.place("hot", spec(2))
        assert r.outcome == "deferred" and r.thermal_limited
        assert "redline" in r.reason
        assert list(e.queue) == ["hot"] and not e.state.allocations
        refused = await e.place("hot2", spec(2), allow_defer=False)
        assert refused.outcome == "no_room" and refused.thermal_limited and "redline" in refused.reason
        assert [kind for kind, _ in guard.calls][:1] == ["headroom"]


async def test_batch_check_vetoes_what_an_optimistic_headroom_lets_through(redis, prefix) -> None:
    dc = cheap(redline_c=21.0)
    guard = OptimisticHeadroomGuard(dc, redis, Keys(prefix))
    async with running(new_engine(dc, redis, prefix, thermal=guard)) as e:
        r = await e.place("hot", spec(2), allow_defer=False)
        assert r.outcome == "no_room"
        assert "past the 21.0 °C redline" in r.reason
        assert r.thermal is not None and not r.thermal.ok and r.thermal.nodes_over_redline
        assert not e.state.allocations and not await ledger_events(redis, prefix)


async def test_in_process_guard_defers_at_the_redline_and_reports_the_effect(redis, prefix) -> None:
    """The placer's own RoomGuard (thermal=room model): same answers as the ledger-folded model above."""
    async with running(new_engine(cheap(redline_c=21.0), redis, prefix, thermal=room_for(cheap(21.0)))) as e:
        r = await e.place("hot", spec(2))
        assert r.outcome == "deferred" and r.thermal_limited and "redline" in r.reason
    dc = cheap(redline_c=27.0)
    async with running(new_engine(dc, redis, f"{prefix}:b", thermal=room_for(dc))) as e:
        first, r = await e.place("a", spec(12)), await e.place("b", spec(12))
        assert first.outcome == r.outcome == "placed"
        assert r.thermal is not None and r.thermal.ok and r.thermal.max_inlet_after_c > r.thermal.max_inlet_before_c
        folded, _ = await fold_ledger(redis, f"{prefix}:b", dc)
        assert room_for(dc).evaluate(*load_arrays(folded)).max_inlet_c == pytest.approx(r.thermal.max_inlet_after_c)


async def test_batches_cut_by_the_time_budget_decide_exactly_as_whole_batches(redis, prefix) -> None:
    """A budget too small for a second decision cuts every batch to one call: the same answers, parts and queue as
    batches of up to 256 calls, every call answered once (with the room model's guard, near its redline)."""
    dc = cheap(redline_c=23.0)  # all busy: 23.72 °C, so some placements are refused for heat
    sizes = [1, 3, 6, 12, 2, 0.5]
    outcomes = []
    for budget, stream in ((1e-9, "cut"), (None, "whole")):
        e = PlacerEngine(dc, redis, Keys(f"{prefix}:{stream}"), make_policy("bestfit"), "p1", thermal=room_for(dc),
                         batch_budget_s=budget)
        async with running(e):
            placed = await asyncio.gather(*(e.place(f"t{i}", spec(sizes[i % len(sizes)])) for i in range(60)))
            released = await asyncio.gather(*(e.release(f"t{i}") for i in range(0, 60, 4)))
            batches = e.batches_total
        folded, queue = await fold_ledger(redis, f"{prefix}:{stream}", dc)
        outcomes.append(([(r.outcome, r.thermal_limited, r.parts) for r in placed],
                         [(r.released, r.placed_from_queue) for r in released],
                         dict(folded.allocations), list(queue)))
        if budget:
            assert batches >= 60 + 15  # one call per batch
    cut, whole = outcomes
    assert cut == whole
    assert {(o, hot) for o, hot, _ in cut[0]} == {("placed", False), ("deferred", True)}  # heat decided some


async def test_normal_redline_places_and_reports_the_thermal_effect(redis, prefix) -> None:
    dc = cheap(redline_c=27.0)
    guard = LibraryThermalGuard(dc, redis, Keys(prefix))
    async with running(new_engine(dc, redis, prefix, thermal=guard)) as e:
        first = await e.place("a", spec(12))
        r = await e.place("b", spec(12))
        assert first.outcome == r.outcome == "placed"
        assert r.thermal is not None and r.thermal.ok and r.thermal.redline_c == 27.0
        assert r.thermal.max_inlet_after_c > r.thermal.max_inlet_before_c
        assert guard.calls[-1] == ("check", first.ledger_id)  # checked against the ledger up to a's alloc
        # the reported "after" is what the room model says about the state the ledger now folds to
        folded, _ = await fold_ledger(redis, prefix, dc)
        assert room_for(dc).evaluate(*load_arrays(folded)).max_inlet_c == pytest.approx(r.thermal.max_inlet_after_c)


# ------------------------------------------------------------------------------------------------------------
# property: random place / release / retry / burst sequences through the engine with the thermal guard


OP = st.one_of(
    st.tuples(st.just("place"), st.integers(1, 40), st.integers(1, 2), st.booleans()),  # cores, replicas, defer
    st.tuples(st.just("release"), st.integers(0, 100)),
    st.tuples(st.just("retry"), st.integers(0, 100)),
    st.tuples(st.just("burst"), st.lists(st.integers(1, 24), min_size=2, max_size=4)),  # one batch of places
)


class Model:
    """What the answers said: live and queued tasks, and every acknowledged placement."""

    def __init__(self) -> None:
        self.specs: dict[str, TaskSpec] = {}
        self.live: dict[str, tuple[Part, ...]] = {}
        self.queued: set[str] = set()
        self.acked: list[tuple[str, tuple[Part, ...]]] = []

    def placed(self, task_id: str, r: PlaceResult) -> None:
        event(f"place: {r.outcome}{' (thermal)' if r.thermal_limited or (r.thermal and not r.thermal.ok) else ''}")
        if task_id in self.live:  # a retry: the same answer as before
            assert r.outcome == "placed" and r.parts == self.live[task_id]
        elif r.outcome == "placed":
            self.live[task_id] = r.parts
            self.acked.append((task_id, r.parts))
        elif r.outcome == "deferred":
            self.queued.add(task_id)

    def released(self, task_id: str, r) -> None:
        assert r.released == (task_id in self.live or task_id in self.queued)
        if task_id in self.live:
            assert r.freed.cpu_milli == sum(p.cpu_milli for p in self.live.pop(task_id))
        self.queued.discard(task_id)
        if r.placed_from_queue:
            event("release drained the queue")
        for q, parts in r.placed_from_queue:
            self.queued.remove(q)
            self.live[q] = parts
            self.acked.append((q, parts))


async def check_everything(engine: PlacerEngine, model: Model, redis, prefix: str, dc: DataCenter) -> None:
    assert_books_balance(engine.state)
    assert engine.state.allocations == model.live and set(engine.queue) == model.queued
    folded, queue = await fold_ledger(redis, prefix, dc)
    assert same_state(folded, engine.state) and queue == engine.queue
    assert_books_balance(folded)
    room = room_for(dc)  # never past the redline (fixed supply: the idle room starts below it)
    assert room.evaluate(*load_arrays(folded)).max_inlet_c <= room.params.redline_c + 1e-9


async def run_sequence(redis_url: str, prefix: str, ops: list[tuple], policy: str, redline_c: float,
                       guard: str = "in-process") -> None:
    dc = cheap(redline_c)
    redis = connect(redis_url)
    keys = Keys(prefix)
    # in-process: the placer's own RoomGuard over its state (what it runs); ledger: a model folded from Redis
    thermal = room_for(dc) if guard == "in-process" else LibraryThermalGuard(dc, redis, keys)
    engine = PlacerEngine(dc, redis, keys, make_policy(policy, seed=3), "prop", thermal=thermal)
    model = Model()
    await engine.start(wait_for_lease_s=0.0)
    try:
        for op in ops:
            if op[0] == "place":
                tid = f"t{len(model.specs)}"
                model.specs[tid] = spec(op[1], replicas=op[2])
                model.placed(tid, await engine.place(tid, model.specs[tid], allow_defer=op[3]))
            elif op[0] in ("release", "retry"):
                tid = sorted(model.specs)[op[1] % len(model.specs)] if model.specs else "nobody"
                if op[0] == "release":
                    model.released(tid, await engine.release(tid))
                elif tid in model.specs:
                    model.placed(tid, await engine.place(tid, model.specs[tid]))
            else:
                tids = [f"t{len(model.specs) + i}" for i in range(len(op[1]))]
                for tid, cores in zip(tids, op[1], strict=True):
                    model.specs[tid] = spec(cores)
                results = await asyncio.gather(*(engine.place(t, model.specs[t]) for t in tids))
                for tid, r in zip(tids, results, strict=True):
                    model.placed(tid, r)
            await check_everything(engine, model, redis, prefix, dc)
        allocs = [(ev["task"], ev["parts"]) for _, ev in await ledger_events(redis, prefix) if ev["t"] == "alloc"]
        for task_id, parts in model.acked:  # every acknowledged placement was written before it was answered
            assert (task_id, [p.to_json() for p in parts]) in allocs
    finally:
        await engine.stop()
        await redis.aclose()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OP, min_size=1, max_size=12), policy=st.sampled_from(sorted(HEURISTICS)),
       redline_c=st.sampled_from([22.0, 22.5, 27.0]), guard=st.sampled_from(["in-process", "ledger"]))
def test_random_sequences_never_over_allocate_and_every_ack_is_in_the_ledger(
        redis_url: str, prefix: str, ops: list[tuple], policy: str, redline_c: float, guard: str) -> None:
    asyncio.run(run_sequence(redis_url, f"{prefix}:{uuid.uuid4().hex[:8]}", ops, policy, redline_c, guard))
