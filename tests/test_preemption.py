"""Priorities, preemption and the fair-share queue in the placer engine (issue 15 item 3), in-process on a real
Redis ledger with the simulated executor: an online task evicts offline ones when and only when it could not be
placed otherwise, never online ones, the victims losing the least work, in one append with its own alloc; the
victim is requeued, waits out the preemption overhead and later succeeds; the thermal guard still holds; the
deferred queue is served online first, then by tenant fair share, priority and arrival.

No timed assertions: time factors are large and the times compared are the ledger's own.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import uuid
from collections import OrderedDict
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hsched.domain.cluster import ClusterState, Part, usage_vector
from hsched.domain.errors import ValidationError
from hsched.domain.resources import MILLI, Resources
from hsched.domain.task import TaskSpec, task_to_dict
from hsched.engine.executor import Overheads, Report, SimulatedExecutor, Span
from hsched.engine.placer import PlacerEngine
from hsched.policies.fairshare import TenantWeights
from hsched.policies.heuristics import make_policy
from hsched.policies.placement import Outcome, plan
from hsched.state.keys import Keys
from hsched.state.ledger import AppendNotReplicated, fold_event, load_snapshot, replay, snapshot_of
from hsched.state.redis import EmbeddedRedis, connect
from hsched.thermal.datacenter import room_for
from tests.test_engine import cheap, ledger_events, running
from tests.test_lifecycle import events_of, kinds, until

GIB = 1024
TF = 60.0  # a task minute per wall second


def executor(preempt_s: str = "0", tf: float = TF) -> SimulatedExecutor:
    return SimulatedExecutor(tf, Overheads(Span(0, 0), Span(0, 0), Span.parse(preempt_s, "p")), 0.0, seed=3)


def engine(redis, prefix: str, ex: SimulatedExecutor | None, weights: TenantWeights | None = None,
           thermal=None) -> PlacerEngine:
    return PlacerEngine(cheap(), redis, Keys(prefix), make_policy("firstfit"), "p1", thermal=thermal, executor=ex,
                        tenant_weights=weights)


def task(cores: float, cls: str = "", runtime_s: float = 0.0, tenant: str = "team-a", priority: int = 0) -> TaskSpec:
    return TaskSpec(Resources(round(cores * MILLI), 2 * GIB), runtime_s=runtime_s, tenant=tenant,
                    priority_class=cls, priority=priority)


async def started(redis, prefix: str, name: str) -> None:
    await until(lambda: _has(redis, prefix, name, "run"), f"{name} runs")


async def _has(redis, prefix: str, name: str, kind: str) -> bool:
    return kind in kinds(await events_of(redis, prefix, name))


async def fill(e: PlacerEngine, redis, prefix: str, names: list[str], cores: float = 24, cls: str = "",
               runtime_s: float = 0.0) -> None:
    """Place one task per name, each started before the next is placed (so each has run longer than the next)."""
    for name in names:
        assert (await e.place(name, task(cores, cls, runtime_s))).outcome == "placed"
        await started(redis, prefix, name)
        await asyncio.sleep(0.02)


def preempts(ledger: list[tuple[str, dict]]) -> list[dict]:
    return [e for _, e in ledger if e["t"] == "preempt"]


async def test_online_preempts_the_offline_task_that_lost_least_only_when_needed(redis, prefix) -> None:
    async with running(engine(redis, prefix, executor())) as e:
        await fill(e, redis, prefix, ["off0", "off1", "off2"])  # nodes 0-2 full, node 3 empty
        assert (await e.place("half", task(12))).outcome == "placed"  # node 3: 12 cores left
        await started(redis, prefix, "half")
        # an online task that fits as is preempts nothing
        r = await e.place("on1", task(12, "online"))
        assert (r.outcome, r.parts[0].node) == ("placed", 3)
        assert not preempts(await ledger_events(redis, prefix))
        # now nothing is free: the next online task evicts — on ONE node, the least lost work: "half" (12 cores,
        # started last) loses less than any 24-core task, but is not enough on node 3 alone (on1 is online and
        # stays); off2 (started after off0, off1) is the cheapest set that lets it in
        r = await e.place("on2", task(24, "online"))
        assert r.outcome == "placed" and r.parts[0].node == 2
        assert any("preempted 1 offline task(s) on node" in n and "off2" in n for n in r.notes)
        ledger = await ledger_events(redis, prefix)
        entries = [e for _, e in ledger]
        i = next(k for k, ev in enumerate(entries) if ev["t"] == "preempt")
        # one append, in this order: the preemption, the online task's alloc, the victim's requeue with its spec
        assert [ev["t"] for ev in entries[i:i + 3]] == ["preempt", "alloc", "defer"]
        pre, alloc, requeue = entries[i:i + 3]
        assert (pre["task"], pre["by"], requeue["task"], alloc["task"]) == ("off2", "on2", "off2", "on2")
        assert requeue["spec"]["resources"][0] == 24 * MILLI and requeue["spec"]["priority_class"] == ""
        assert alloc["class"] == "online" and "spec" not in alloc  # online tasks are never requeued
        assert preempts(ledger) == [pre]
        assert e.preemptions_total == 1 and list(e.queue) == ["off2"]
        # the ledger's fold is the engine's state
        state, queue = ClusterState(cheap()), OrderedDict()
        await replay(redis, Keys(prefix).ledger("cheap"), state, queue)
        assert state.allocations == e.state.allocations and list(queue) == ["off2"]
        assert state.clocks == e.state.clocks and set(state.specs) == set(e.state.specs)


async def test_a_task_that_runs_until_released_loses_the_time_it_has_run(redis, prefix) -> None:
    """svc (runtime 0) started before batch (runtime 10 h): batch has run less and is evicted first, whatever its
    runtime; then svc, losing its elapsed run time × its dominant share (24 of cheap's 96 cores: 0.25)."""
    async with running(engine(redis, prefix, executor())) as e:
        await fill(e, redis, prefix, ["a", "b"], cls="online")
        await fill(e, redis, prefix, ["svc"], runtime_s=0)
        await fill(e, redis, prefix, ["batch"], runtime_s=36_000)
        assert "batch" in (await e.place("on1", task(24, "online"))).notes[-1]
        r = await e.place("on2", task(24, "online"))
        assert r.outcome == "placed" and r.parts[0].node == 2
        (_, run), = [(i, ev) for i, ev in await events_of(redis, prefix, "svc") if ev["t"] == "run"]
        pre = next(ev for ev in preempts(await ledger_events(redis, prefix)) if ev["task"] == "svc")
        lost = (pre["at"] - run["at"]) / 1000 * TF * 0.25
        assert f"svc (lost work {lost:.4g} DC-seconds)" in r.notes[-1]


async def test_online_tasks_are_never_evicted(redis, prefix) -> None:
    async with running(engine(redis, prefix, executor())) as e:
        await fill(e, redis, prefix, ["on0", "on1", "on2", "on3"], cls="online")
        r = await e.place("on4", task(8, "online"), allow_defer=True)
        assert r.outcome == "deferred"
        assert (await e.place("on5", task(8, "online"), allow_defer=False)).outcome == "no_room"
        assert not preempts(await ledger_events(redis, prefix)) and e.preemptions_total == 0


async def test_offline_tasks_never_preempt(redis, prefix) -> None:
    async with running(engine(redis, prefix, executor())) as e:
        await fill(e, redis, prefix, ["off0", "off1", "off2", "off3"])
        assert (await e.place("off4", task(8), allow_defer=True)).outcome == "deferred"
        assert not preempts(await ledger_events(redis, prefix))


async def test_a_placed_not_started_task_is_the_cheapest_victim(redis, prefix) -> None:
    slow = SimulatedExecutor(TF, Overheads(Span(0, 0), Span(0, 0), Span(0, 0)), 0.0, seed=3)
    async with running(engine(redis, prefix, slow)) as e:
        await fill(e, redis, prefix, ["off0", "off1", "off2", "off3"])
        # off1 is released and placed anew as "fresh" under a slow start: PLACED, not running (lost work 0)
        assert (await e.release("off1")).released
        slow.overheads = Overheads(Span(0, 0), Span(3600, 3600), Span(0, 0))  # an hour of container start
        assert (await e.place("fresh", task(24))).outcome == "placed"
        r = await e.place("on", task(24, "online"))
        assert r.outcome == "placed" and r.parts[0].node == 1
        assert [p["task"] for p in preempts(await ledger_events(redis, prefix))] == ["fresh"]


async def test_the_victim_waits_out_the_overhead_then_runs_again_and_succeeds(redis, prefix) -> None:
    # preemption overhead 120 task s = 2 wall s: the online task starts after it, the victim is not placed again
    # before it; the online task runs 6 task s (0.1 wall s) and frees the node
    async with running(engine(redis, prefix, executor(preempt_s="120"))) as e:
        await fill(e, redis, prefix, ["a", "b", "c"])
        assert (await e.place("victim", task(24, runtime_s=60))).outcome == "placed"
        await started(redis, prefix, "victim")
        r = await e.place("on", task(24, "online", runtime_s=6))
        assert r.outcome == "placed"
        await until(lambda: _has(redis, prefix, "victim", "done"), "the victim runs again and completes")
        history = await events_of(redis, prefix, "victim")
        assert kinds(history) == ["alloc", "run", "preempt", "defer", "alloc", "run", "done"]
        defer, again, done = history[3][1], history[4][1], history[6][1]
        (_, on_alloc), (_, on_run), (_, on_done) = await events_of(redis, prefix, "on")
        assert on_alloc["delay_s"] == 120 and on_run["at"] == on_alloc["at"] + 2000  # 120 task s at 60 per wall s
        assert defer["after"] == on_alloc["at"] + 2000 <= again["at"]
        assert on_done["t"] == "done" and done["ok"] is True and again["spec"]["runtime_s"] == 60
        assert len(preempts(await ledger_events(redis, prefix))) == 1


async def test_the_victim_runs_at_its_ready_time_even_when_the_timer_fires_early(redis, prefix, monkeypatch) -> None:
    """uvloop's timers may fire up to a millisecond before the wall clock reaches their time; here the placer's
    clock lags the loop's by 50 ms. The online task is released before the victim is ready: the victim must
    still be placed at its ready time, not left waiting for an unrelated release."""
    from hsched.engine import placer as placer_module

    real = placer_module._now_ms
    monkeypatch.setattr(placer_module, "_now_ms", lambda: real() - 50)
    async with running(engine(redis, prefix, executor(preempt_s="60"))) as e:  # ready a wall second later
        await fill(e, redis, prefix, ["a", "b", "c", "victim"])
        assert (await e.place("on", task(24, "online"))).outcome == "placed"
        assert (await e.release("on")).released  # before the victim is ready: nothing placed from the queue yet
        assert "victim" in e.queue
        await until(lambda: _placed_again(redis, prefix), "the victim is placed again at its ready time")
        history = await events_of(redis, prefix, "victim")
        assert kinds(history)[2:5] == ["preempt", "defer", "alloc"] and history[4][1]["at"] >= history[3][1]["after"]


async def _placed_again(redis, prefix: str) -> bool:
    return kinds(await events_of(redis, prefix, "victim")).count("alloc") == 2


async def test_a_requeued_victims_queue_timeout_counts_from_when_it_may_run_again(redis, prefix) -> None:
    """The preemption overhead (2 wall s) is longer than the victim's queue_timeout_s (1 wall s): it expires a
    queue timeout after it could run again, not before it ever could."""
    async with running(engine(redis, prefix, executor(preempt_s="120"))) as e:
        await fill(e, redis, prefix, ["a", "b", "c"])
        victim = replace(task(24), queue_timeout_s=60.0)  # task s: 1 wall s
        assert (await e.place("victim", victim)).outcome == "placed"
        await started(redis, prefix, "victim")
        assert (await e.place("on", task(24, "online"))).outcome == "placed"  # holds the node until released
        await until(lambda: _has(redis, prefix, "victim", "expire"), "the victim expires")
        history = await events_of(redis, prefix, "victim")
        assert kinds(history) == ["alloc", "run", "preempt", "defer", "expire"]
        defer, expire = history[3][1], history[4][1]
        assert expire["at"] >= defer["after"] + 1000 > defer["at"] + 1000


async def test_a_restarted_placer_keeps_the_requeued_victim_waiting(redis, prefix) -> None:
    ex = executor(preempt_s="600")  # 10 wall s: longer than this test waits
    async with running(engine(redis, prefix, ex)) as e:
        await fill(e, redis, prefix, ["a", "b", "c", "v"])
        assert (await e.place("on", task(24, "online", runtime_s=6))).outcome == "placed"
    async with running(engine(redis, prefix, executor(preempt_s="600"))) as e2:
        assert list(e2.queue) == ["v"] and e2.state.ready_ms["v"] > 0
        r = await e2.release("a")  # room, but v is not ready: nothing is placed from the queue
        assert r.released and not r.placed_from_queue and "v" in e2.queue


@pytest.mark.parametrize("restart", [False, True])
async def test_a_requeued_victim_keeps_its_place_in_line(redis, prefix, monkeypatch, restart) -> None:
    """A job's tasks fill the DC, four later tasks queue, an online task evicts a job task: the victim is requeued
    ahead of the four (its arrival, as Slurm and Volcano requeue), not behind them, and the room the online task
    frees goes to it — from the engine's memory, and from the ledger's fold after a placer restart."""
    from hsched.engine import placer as placer_module
    clock = itertools.count(placer_module._now_ms())  # every decision a distinct ms: no arrival ties
    monkeypatch.setattr(placer_module, "_now_ms", lambda: next(clock))
    later = [f"later{i}" for i in range(4)]
    async with running(engine(redis, prefix, None)) as e:  # no executor: tasks hold until released
        for i in range(4):
            assert (await e.place(f"job{i}", task(24))).outcome == "placed"
        for name in later:
            assert (await e.place(name, task(24))).outcome == "deferred"
        assert (await e.place("on", task(24, "online"))).outcome == "placed"
        (victim,) = [p["task"] for p in preempts(await ledger_events(redis, prefix))]
        assert list(e.queue) == [victim, *later]
        if not restart:
            assert [t for t, _ in (await e.release("on")).placed_from_queue] == [victim]
    state, queue = ClusterState(cheap()), OrderedDict()
    await replay(redis, Keys(prefix).ledger("cheap"), state, queue)
    assert list(queue) == (later if not restart else [victim, *later])
    if restart:
        async with running(engine(redis, prefix, None)) as e2:
            assert list(e2.queue) == [victim, *later]
            assert [t for t, _ in (await e2.release("on")).placed_from_queue] == [victim]


async def test_a_placement_from_the_queue_of_unknown_outcome_goes_back_to_its_place_in_line(redis, prefix,
                                                                                          monkeypatch) -> None:
    """A release that placed later0 from the queue is written, but its answer is lost with the connection: the
    ledger's cancellation puts later0 back in the queue where it was, ahead of later1 (its arrival), as memory
    does — not behind it, which a restarted placer's fold made of it."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from hsched.engine import placer as placer_module
    from hsched.state import ledger as ledger_module
    clock = itertools.count(placer_module._now_ms())  # every decision a distinct ms: no arrival ties
    monkeypatch.setattr(placer_module, "_now_ms", lambda: next(clock))
    real = ledger_module.run_replicated

    async def written_but_lost(*args, **kwargs):
        await real(*args, **kwargs)
        raise RedisConnectionError("connection lost after the write")

    async with running(engine(redis, prefix, None)) as e:
        for i in range(4):
            assert (await e.place(f"job{i}", task(24))).outcome == "placed"
        for name in ("later0", "later1"):
            assert (await e.place(name, task(24))).outcome == "deferred"
        monkeypatch.setattr(ledger_module, "run_replicated", written_but_lost)
        with pytest.raises(RedisConnectionError):
            await e.release("job0")
        monkeypatch.setattr(ledger_module, "run_replicated", real)
        assert list(e.queue) == ["later0", "later1"]  # memory: as before
        await e.ledger.settle()  # the cancellations (the release itself stands or not: its client retries it)
    state, queue = ClusterState(cheap()), OrderedDict()
    await replay(redis, Keys(prefix).ledger("cheap"), state, queue)
    assert list(queue) == ["later0", "later1"] and "later0" not in state.allocations


async def test_a_release_reaches_a_waiting_task_behind_many_that_cannot_use_the_room(redis, prefix) -> None:
    """70 waiting 24-core tasks, then a 12-core one; a 12-core task is released: the room goes to the 12-core one.
    A pass tried only the first 64 waiting tasks, so it waited while the room sat idle (a freed A100 behind 64
    T4-only tasks); now a shape that found no room is passed over for the rest of the pass."""
    async with running(engine(redis, prefix, None)) as e:
        for name in ("a", "b"):  # node 0: two 12-core tasks; nodes 1-3: one 24-core each
            assert (await e.place(name, task(12))).outcome == "placed"
        for i in range(3):
            assert (await e.place(f"full{i}", task(24))).outcome == "placed"
        for i in range(70):
            assert (await e.place(f"wide{i}", task(24))).outcome == "deferred"
        assert (await e.place("narrow", task(12))).outcome == "deferred"
        released = await e.release("a")
        assert [t for t, _ in released.placed_from_queue] == ["narrow"]
        assert len(e.queue) == 70


async def all_online_but_one_offline(e: PlacerEngine, redis, prefix: str) -> None:
    """Eight 12-core online tasks (two per node, firstfit: on0 and on1 on node 0), run until released; a 24-core
    online task "u" waits (nothing to evict), then an offline "x" (12 cores, two task minutes) waits; on0 is released:
    "u" still does not fit (12 cores free on node 0, nothing offline to evict there) and "x" takes the room."""
    await fill(e, redis, prefix, [f"on{i}" for i in range(8)], cores=12, cls="online")
    r = await e.place("u", task(24, "online"))
    assert r.outcome == "deferred" and not preempts(await ledger_events(redis, prefix))
    assert (await e.place("x", task(12, runtime_s=120))).outcome == "deferred"
    released = await e.release("on0")
    assert [t for t, _ in released.placed_from_queue] == ["x"] and list(e.queue) == ["u"]
    await started(redis, prefix, "x")


@pytest.mark.parametrize(("searches", "thermal"), [(4, False), (0, False), (4, True)])
async def test_a_waiting_online_task_preempts_once_freed_room_makes_an_eviction_possible(redis, prefix, searches,
                                                                                         thermal) -> None:
    """With `searches` 0 (waiting online tasks never evict, the rule before) "u" waits for "x" to finish. With the
    thermal guard (cheap's room, far from its redline) the pass after a release runs on a conservative headroom:
    the search waits for the batch to be decided again on exact numbers, with the same outcome."""
    room = room_for(cheap()) if thermal else None
    async with running(engine(redis, prefix, executor(preempt_s="60"), thermal=room)) as e:
        e.queue_eviction_searches = searches
        await all_online_but_one_offline(e, redis, prefix)
        # on1 (node 0) goes: node 0 holds x and 12 free cores; u fits there only by evicting x
        released = await e.release("on1")
        if not searches:
            assert not released.placed_from_queue and list(e.queue) == ["u"]
            assert not preempts(await ledger_events(redis, prefix)) and "x" in e.state.allocations
            return
        assert [(t, parts[0].node) for t, parts in released.placed_from_queue] == [("u", 0)]
        entries = [ev for _, ev in await ledger_events(redis, prefix)]
        i = next(k for k, ev in enumerate(entries) if ev["t"] == "free" and ev["task"] == "on1")
        # one append with the release: the preemption, u's alloc (after the overhead), x's requeue until then
        assert [(ev["t"], ev["task"]) for ev in entries[i:i + 4]] == [("free", "on1"), ("preempt", "x"),
                                                                    ("alloc", "u"), ("defer", "x")]
        pre, alloc, requeue = entries[i + 1:i + 4]
        assert pre["by"] == "u" and alloc["delay_s"] == 60 and requeue["after"] == alloc["at"] + 1000
        assert e.preemptions_total == 1 and list(e.queue) == ["x"]
        # x is placed again when room comes back (not before its overhead) and succeeds
        assert (await e.release("on2")).released
        await until(lambda: _has(redis, prefix, "x", "done"), "the victim runs again and completes")
        history = await events_of(redis, prefix, "x")
        assert kinds(history) == ["defer", "alloc", "run", "preempt", "defer", "alloc", "run", "done"]
        assert history[5][1]["at"] >= requeue["after"] and history[7][1]["ok"] is True
        assert len(preempts(await ledger_events(redis, prefix))) == 1


async def test_a_placer_that_takes_over_serves_a_waiting_online_task_its_predecessor_had_not(redis, prefix) -> None:
    """The predecessor never searched for u (as if killed before its queue pass): the new holder's first pass
    preempts x, once; a third holder finds nothing left to do."""
    async with running(engine(redis, prefix, executor())) as e:
        e.queue_eviction_searches = 0
        await all_online_but_one_offline(e, redis, prefix)
        assert not (await e.release("on1")).placed_from_queue
    async with running(engine(redis, prefix, executor())) as e2:
        await until(lambda: _has(redis, prefix, "u", "alloc"), "the new holder places u by evicting x")
        assert [(p["task"], p["by"]) for p in preempts(await ledger_events(redis, prefix))] == [("x", "u")]
        assert e2.state.allocations["u"][0].node == 0 and list(e2.queue) == ["x"]
    async with running(engine(redis, prefix, executor())) as e3:
        await asyncio.sleep(0.3)
        assert len(preempts(await ledger_events(redis, prefix))) == 1 and "u" in e3.state.allocations


@pytest.mark.parametrize("searches", [1, 4])
async def test_waiting_online_tasks_are_searched_within_a_budget_per_pass_the_rest_by_the_next(redis, prefix,
                                                                                             searches) -> None:
    """"pair" (online, two 12-core replicas) holds half of nodes 0 and 1; u1 (24 cores, priority 5) and u2 (20
    cores) wait with nothing offline to evict; x1 then x2 (offline, 12 cores) take the other halves as on0 and on1
    leave. Nobody was searched for so far (no one-node eviction could let u1 or u2 in: a cheap count, not a
    search). pair's release frees half of both nodes: u1 evicts x2 (it has run less than x1), u2 then x1. With one
    search per pass, the release's pass places u1 and the pass right after it u2; with four, the same pass both."""
    async with running(engine(redis, prefix, executor())) as e:
        e.queue_eviction_searches = searches
        await fill(e, redis, prefix, ["on0"], cores=12, cls="online")
        assert (await e.place("pair", TaskSpec(Resources(12 * MILLI, 2 * GIB), runtime_s=0, priority_class="online",
                                               replicas=2))).outcome == "placed"
        assert sorted(p.node for p in e.state.allocations["pair"]) == [0, 1]
        await fill(e, redis, prefix, [f"on{i}" for i in range(1, 6)], cores=12, cls="online")
        assert (await e.place("u1", task(24, "online", priority=5))).outcome == "deferred"
        assert (await e.place("u2", task(20, "online"))).outcome == "deferred"
        for name in ("x1", "x2"):
            assert (await e.place(name, task(12, runtime_s=600))).outcome == "deferred"
        for freed, taker in (("on0", "x1"), ("on1", "x2")):
            assert [t for t, _ in (await e.release(freed)).placed_from_queue] == [taker]
            await started(redis, prefix, taker)
            await asyncio.sleep(0.05)
        assert e.queue_eviction_searches_total == 0 and list(e.queue) == ["u1", "u2"]
        placed = [t for t, _ in (await e.release("pair")).placed_from_queue]
        assert placed == (["u1"] if searches == 1 else ["u1", "u2"])
        await until(lambda: _has(redis, prefix, "u2", "alloc"), "u2 placed by evicting x1")
        assert e.queue_eviction_searches_total == 2
        entries = [ev for _, ev in await ledger_events(redis, prefix)]
        i = next(k for k, ev in enumerate(entries) if ev["t"] == "free" and ev["task"] == "pair")
        assert [(ev["t"], ev["task"]) for ev in entries[i:] if ev["t"] != "run"] == [
            ("free", "pair"), ("preempt", "x2"), ("alloc", "u1"), ("defer", "x2"),
            ("preempt", "x1"), ("alloc", "u2"), ("defer", "x1")]
        assert (e.state.allocations["u1"][0].node, e.state.allocations["u2"][0].node) == (1, 0)


async def test_a_waiting_online_task_is_searched_again_only_after_something_was_freed(redis, prefix) -> None:
    """"wide" (offline, 32 cores: 24 on node 0, 8 on node 1) spans nodes, so the cheap count does not rule
    evictions out and "big" (two 24-core replicas) is searched for in earnest; evicting wide empties node 0 only,
    never two nodes: each search fails. A pass with nothing freed since its last search searches nobody; a pass
    after a release searches it once."""
    async with running(engine(redis, prefix, executor())) as e:
        await fill(e, redis, prefix, ["wide"], cores=32)
        await fill(e, redis, prefix, ["on-b"], cores=16, cls="online")
        await fill(e, redis, prefix, [f"on{i}" for i in range(4)], cores=12, cls="online")
        assert {p.node for p in e.state.allocations["wide"]} == {0, 1}
        big = TaskSpec(Resources(24 * MILLI, 2 * GIB), runtime_s=0, priority_class="online", replicas=2)
        assert (await e.place("big", big)).outcome == "deferred"  # searched at arrival, in vain
        # on0 and on2 leave nodes 2 and 3 half full: still no two empty nodes
        for total, freeing in ((0, None), (1, "on0"), (1, None), (2, "on2"), (2, None)):
            if freeing:
                assert not (await e.release(freeing)).placed_from_queue
            else:
                e._on_report(Report("drain", "", 0, 0))
                await asyncio.sleep(0.2)
            assert e.queue_eviction_searches_total == total, (total, freeing)
        assert "big" in e.queue and not preempts(await ledger_events(redis, prefix))


async def test_the_queue_serves_online_then_fair_share_then_priority_then_arrival(redis, prefix) -> None:
    async with running(engine(redis, prefix, None)) as e:  # no executor: tasks hold until released
        for i in range(4):  # team-a holds the whole DC with online tasks (never evicted)
            assert (await e.place(f"a{i}", task(24, "online", tenant="team-a"))).outcome == "placed"
        for name, t in (("qa", task(24, tenant="team-a", priority=9)), ("qb-low", task(24, tenant="team-b")),
                        ("qb-high", task(24, tenant="team-b", priority=1)), ("qon", task(24, "online", tenant="team-a"))):
            assert (await e.place(name, t)).outcome in ("deferred", "placed")
        # qon (online) found no offline task to evict: deferred too
        assert list(e.queue) == ["qa", "qb-low", "qb-high", "qon"]
        order = []
        for i in range(4):
            order += [t for t, _ in (await e.release(f"a{i}")).placed_from_queue]
        # online first; then team-b (holding nothing, under its share) by priority — team-b then holds 24 of its
        # deserved 48 cores, team-a 72 of 48 —; team-a's qa last despite its priority 9 and arriving first
        assert order == ["qon", "qb-high", "qb-low", "qa"]


async def test_tenant_weights_shift_the_order(redis, prefix) -> None:
    # team-a holds 48 cores (2 nodes), team-b 24 (1 node); both wait for more. Equal weights: b's share is lower
    # and b goes first; with team-a weighing 4, a deserves far more and goes first.
    for weights, first in ((None, "qb"), (TenantWeights({"team-a": 4.0}), "qa")):
        p = f"{prefix}:{first}"  # under the test's prefix: deleted with it
        async with running(engine(redis, p, None, weights)) as e:
            for name, tenant in (("a0", "team-a"), ("a1", "team-a"), ("b0", "team-b"), ("x", "team-c")):
                assert (await e.place(name, task(24, tenant=tenant))).outcome == "placed"
            assert set(e.state.tenant_usage) == {"team-a", "team-b", "team-c"}
            await e.place("qa", task(24, tenant="team-a"))
            await e.place("qb", task(24, tenant="team-b"))
            placed = (await e.release("x")).placed_from_queue
            assert [t for t, _ in placed] == [first]


@pytest.mark.parametrize("big_class", ["", "online"])
async def test_a_preemption_that_would_pass_the_redline_is_not_done(redis, prefix, big_class) -> None:
    """cheap's room (20 °C supply): loads [24, 20, 20, 20] cores give a max inlet of 23.415 °C; an online 24-core
    task after evicting a 20-core task of node 1, 2 or 3 gives 23.565 / 23.480 / 23.523 °C; after evicting the
    24-core task of node 0, 23.415 °C again. With the redline at 23.45 °C only the big task's eviction is allowed,
    although it loses the most work (it runs longest and is largest); when the big task is online, no eviction is
    allowed and nothing is preempted."""
    dc = cheap(redline_c=23.45)
    async with running(PlacerEngine(dc, redis, Keys(prefix), make_policy("firstfit"), "p1", thermal=room_for(dc),
                                    executor=executor())) as e:
        assert (await e.place("big", task(24, big_class))).outcome == "placed"
        await started(redis, prefix, "big")
        for i in range(3):
            r = await e.place(f"s{i}", task(20))
            assert (r.outcome, r.parts[0].node) == ("placed", i + 1)
        r = await e.place("on", task(24, "online"))
        victims = [p["task"] for p in preempts(await ledger_events(redis, prefix))]
        if big_class == "":
            assert (r.outcome, r.parts[0].node, victims) == ("placed", 0, ["big"])
            assert r.thermal is not None and r.thermal.max_inlet_after_c < 23.45
        else:
            assert (r.outcome, victims) == ("deferred", [])
            assert "redline" in r.reason or "no node has room" in r.reason


def test_an_unknown_priority_class_is_refused_naming_the_field() -> None:
    with pytest.raises(ValidationError) as exc:
        task(1, "urgent", runtime_s=1).validate()
    assert exc.value.field == "priority_class"
    assert "online" in exc.value.rule
    for cls in ("", "online", "offline"):
        task(1, cls, runtime_s=1).validate()


def test_capacity_of_cheap_is_what_shares_are_measured_on() -> None:
    from hsched.policies.fairshare import capacity_vector
    assert np.array_equal(capacity_vector(cheap().node_table()), [96 * MILLI, 4 * 96 * GIB, 0])


# ------------------------------------------------------------------------------------------------------------
# the fold keeps what preemption and fair share need, from a snapshot as from the whole stream

@st.composite
def preemption_histories(draw) -> list[dict]:
    """Ledgers a placer could write: allocs of online/offline tasks of two tenants (offline ones with their spec),
    runs, completions, offline tasks queued, and preemptions written as the placer does (preempt + requeue with
    "after" and its first arrival + the online task's alloc), queued tasks placed (with their arrival)."""
    events, held, queued, arrivals, clock = [], {}, {}, {}, 1_000
    for i in range(draw(st.integers(0, 30))):
        clock += draw(st.integers(0, 5000))
        kind = draw(st.sampled_from(["alloc", "run", "done", "preempt", "requeued", "queue"]))
        if kind in ("alloc", "queue"):
            task_id, cls, tenant = f"t{i}", draw(st.sampled_from(["online", "offline"])), draw(st.sampled_from("ab"))
            cores, node = draw(st.integers(1, 12)), draw(st.integers(0, 3))
            if kind == "queue":
                spec = TaskSpec(Resources(cores * MILLI, 512), runtime_s=60, tenant=f"team-{tenant}")
                events.append({"t": "defer", "task": task_id, "spec": task_to_dict(spec), "at": clock})
                queued[task_id], arrivals[task_id] = (node, cores, spec), clock
                continue
            if sum(c for n, c, _ in held.values() if n == node) + cores > 24:
                continue
            spec = TaskSpec(Resources(cores * MILLI, 512), runtime_s=60, tenant=f"team-{tenant}", priority_class=cls)
            events.append(_alloc(task_id, node, spec, clock))
            held[task_id], arrivals[task_id] = (node, cores, spec), clock
        elif kind in ("run", "done") and held:
            task_id = draw(st.sampled_from(sorted(held)))
            events.append({"t": kind, "task": task_id, "at": clock, **({"ok": True, "reason": ""} if kind == "done"
                                                                        else {})})
            if kind == "done":
                held.pop(task_id)
        elif kind == "preempt":
            offline = sorted(t for t, (_, _, s) in held.items() if s.priority_class == "offline")
            if not offline:
                continue
            victim = draw(st.sampled_from(offline))
            node, cores, spec = held.pop(victim)
            after = clock + draw(st.sampled_from([0, 500, 20_000]))
            events += [{"t": "preempt", "task": victim, "by": f"on{i}", "at": clock},
                       {"t": "defer", "task": victim, "spec": task_to_dict(spec), "at": clock,
                        "arrival": arrivals[victim], **({"after": after} if after > clock else {})}]
            online = TaskSpec(Resources(cores * MILLI, 512), runtime_s=60, tenant="team-a", priority_class="online")
            events.append(_alloc(f"on{i}", node, online, clock))
            held[f"on{i}"] = (node, cores, online)
            queued[victim] = (node, cores, spec)
        elif kind == "requeued" and queued:
            victim = draw(st.sampled_from(sorted(queued)))
            node, cores, spec = queued[victim]
            if sum(c for n, c, _ in held.values() if n == node) + cores > 24:
                continue
            events.append(_alloc(victim, node, spec, clock, arrivals[victim]))
            held[victim] = queued.pop(victim)
    return events


def _alloc(task_id: str, node: int, spec: TaskSpec, at: int, arrival: int = 0) -> dict:
    event = {"t": "alloc", "task": task_id, "parts": [Part(0, 0, node, spec.resources.cpu_milli, 512, 0, 0).to_json()],
             "at": at, "runtime_s": spec.runtime_s, "class": spec.effective_class, "tenant": spec.tenant,
             **({"arrival": arrival} if arrival else {})}
    if spec.effective_class == "offline":
        event["spec"] = task_to_dict(spec)
    return event


def _fold(events: list[dict], state: ClusterState | None = None, queue: OrderedDict | None = None):
    state = state if state is not None else ClusterState(cheap())
    queue = queue if queue is not None else OrderedDict()
    for e in events:
        fold_event(json.loads(json.dumps(e)), state, queue)  # as read back from the stream
    return state, queue


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(preemption_histories(), st.data())
def test_the_fold_keeps_specs_ready_times_and_tenant_usage_from_a_snapshot_too(history, data) -> None:
    cut = data.draw(st.integers(0, len(history)))
    whole_state, whole_queue = _fold(history)
    head_state, head_queue = _fold(history[:cut])
    state, queue = ClusterState(cheap()), OrderedDict()
    load_snapshot(snapshot_of(head_state, head_queue), state, queue)
    state, queue = _fold(history[cut:], state, queue)
    assert state.allocations == whole_state.allocations and list(queue) == list(whole_queue)
    assert state.specs == whole_state.specs and state.ready_ms == whole_state.ready_ms
    assert state.clocks == whole_state.clocks and state.arrival_ms == whole_state.arrival_ms
    # the queue is in arrival order, a requeued victim at its first arrival (ahead of equal ones)
    arrival = [whole_state.arrival_ms.get(t) or whole_state.queued_ms[t] for t in whole_queue]
    assert arrival == sorted(arrival)
    assert state.tenant_usage.keys() == whole_state.tenant_usage.keys()
    for tenant, used in whole_state.tenant_usage.items():
        assert np.array_equal(state.tenant_usage[tenant], used)
    # what each tenant uses is exactly the sum of its allocations; every held offline task can be requeued
    expected: dict[str, np.ndarray] = {}
    for task_id, parts in whole_state.allocations.items():
        tenant = whole_state.clocks[task_id].tenant
        expected[tenant] = expected.get(tenant, 0) + usage_vector(parts)
    assert {t: list(v) for t, v in expected.items()} == {t: list(v) for t, v in whole_state.tenant_usage.items()}
    assert set(whole_state.specs) == {t for t, c in whole_state.clocks.items() if c.priority_class == "offline"}
    assert set(whole_state.ready_ms) <= set(whole_queue)


async def test_a_preemption_whose_write_is_in_doubt_is_cancelled_and_the_victim_keeps_running(prefix) -> None:
    """The append lands on the master but no replica confirms it: not acknowledged, so the engine undoes the
    preemption in memory and the ledger's next write cancels it — the online task freed, the victim re-allocated
    as it was (same placement, same start), its requeue gone — and the fold is the engine's state again."""
    server = EmbeddedRedis().start()  # a master without replicas: WAIT 1 answers 0
    client = connect(server.url)
    try:
        async with running(engine(client, prefix, executor())) as e:
            await fill(e, client, prefix, ["a", "b", "c", "v"])
            before = e.state.clocks["v"]
            e.ledger.min_replicas, e.ledger.wait_timeout_ms = 1, 50
            with pytest.raises(AppendNotReplicated):
                await e.place("on", task(24, "online"))
            assert e.state.clocks["v"] == before and "on" not in e.state.allocations and not e.queue
            e.ledger.min_replicas = 0
            await e.ledger.settle()
            state, queue = ClusterState(cheap()), OrderedDict()
            await replay(client, Keys(prefix).ledger("cheap"), state, queue)
            assert state.allocations == e.state.allocations and state.clocks == e.state.clocks and not queue
            assert state.specs.keys() == e.state.specs.keys() and state.clocks["v"] == before
            assert kinds(await events_of(client, prefix, "v")) == ["alloc", "run", "preempt", "defer", "alloc", "run"]
            assert kinds(await events_of(client, prefix, "on")) == ["alloc", "free"]
            assert e.preemptions_total == 0  # nothing acknowledged
            # and the engine goes on: the next online task preempts for real
            assert (await e.place("on2", task(24, "online"))).outcome == "placed" and e.preemptions_total == 1
    finally:
        await client.aclose()
        server.stop()


def test_the_cancellation_of_a_preemption_that_was_not_written_changes_nothing() -> None:
    """The same cancellation when the preemption's write never landed: the victim is still held, so its
    re-allocation and its run are no-ops for the fold, and the free and the drop of tasks not held too."""
    spec_v = task(24, runtime_s=60)
    alloc_v = _alloc("v", 3, spec_v, 1_000)
    state, queue = _fold([alloc_v, {"t": "run", "task": "v", "at": 1_500}])
    held, clocks = dict(state.allocations), dict(state.clocks)
    _fold([{"t": "free", "task": "on"}, {**alloc_v, "restore": True}, {"t": "run", "task": "v", "at": 1_500}],
          state, queue)
    assert state.allocations == held and state.clocks == clocks and not queue


# ------------------------------------------------------------------------------------------------------------
# online tasks evict only when they could not be placed otherwise: at arrival and from the queue alike

@st.composite
def place_and_release_runs(draw) -> list[tuple]:
    """Places (online/offline, 6-24 cores, 1-2 replicas, may wait in the queue) and releases of earlier tasks,
    often after online tasks took much of the DC (online tasks then wait with nothing to evict)."""
    ops = [("place", f"t{i}", 12, "online", 1) for i in range(draw(st.sampled_from([0, 6, 7, 8])))]
    for i in range(len(ops), len(ops) + draw(st.integers(4, 40))):
        if i > 4 and draw(st.booleans()):
            ops.append(("release", f"t{draw(st.integers(0, min(i, 8) - 1 if draw(st.booleans()) else i - 1))}"))
        else:
            ops.append(("place", f"t{i}", draw(st.sampled_from([12, 12, 24, 6, 18])),
                        draw(st.sampled_from(["online", ""])), draw(st.integers(1, 2))))
    return ops


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(place_and_release_runs())
def test_an_online_task_evicts_only_offline_tasks_and_only_when_it_did_not_fit(redis_url, prefix, ops) -> None:
    """Whatever the order of arrivals and releases: every preemption is by an online task that the ledger's fold
    just before it shows could not be placed, evicts offline tasks only, and comes as preempts, the online task's
    alloc, then each victim's requeue; and the engine's state is the ledger's fold."""
    p = f"{prefix}:{uuid.uuid4().hex[:8]}"  # each example its own ledger, deleted with the test's prefix

    async def run() -> list[dict]:
        client = connect(redis_url)
        try:
            async with running(engine(client, p, None)) as e:  # no executor: tasks hold until released
                for op in ops:
                    if op[0] == "place":
                        _, name, cores, cls, replicas = op
                        spec = TaskSpec(Resources(cores * MILLI, 2 * GIB), runtime_s=0, priority_class=cls,
                                        replicas=replicas)
                        await e.place(name, spec)
                    else:
                        await e.release(op[1])
                await asyncio.sleep(0.05)  # a queue pass the budget left for later
                await e.release("none")  # after every queued op
                entries = [ev for _, ev in await ledger_events(client, p)]
                state, queue = _fold(entries)
                assert state.allocations == e.state.allocations and list(queue) == list(e.queue)
                return entries
        finally:
            await client.aclose()

    entries = asyncio.run(run())
    queued = {e["task"] for e in entries if e["t"] == "defer"}
    event("preempted from the queue" if any(e["t"] == "preempt" and e["by"] in queued
                                            for e in entries) else
          "preempted at arrival" if preempts([(0, e) for e in entries]) else "no preemption")
    specs = {op[1]: TaskSpec(Resources(op[2] * MILLI, 2 * GIB), runtime_s=0, priority_class=op[3], replicas=op[4])
             for op in ops if op[0] == "place"}
    i = 0
    while i < len(entries):
        if entries[i]["t"] != "preempt":
            i += 1
            continue
        by = entries[i]["by"]
        before, _ = _fold(entries[:i])
        assert specs[by].effective_class == "online"
        assert plan(before, specs[by], make_policy("firstfit"), None).outcome is not Outcome.PLACED
        victims = []
        while entries[i]["t"] == "preempt":
            assert entries[i]["by"] == by and specs[entries[i]["task"]].effective_class == "offline"
            victims.append(entries[i]["task"])
            i += 1
        assert (entries[i]["t"], entries[i]["task"]) == ("alloc", by)
        assert [(ev["t"], ev["task"]) for ev in entries[i + 1:i + 1 + len(victims)]] == [("defer", v) for v in victims]
        i += 1 + len(victims)


async def test_tenant_shares_are_the_queues_numbers_hand_computed(redis, prefix) -> None:
    """cheap: 96 cores, 384 GiB. alice (weight 1) and bob (weight 3) hold 2 tasks of 24 cores / 2 GiB each and
    wait for one more each. CPU: requested 72 each; water-filling gives bob 96·3/4 = 72 (met) and alice what is
    left, 24. Memory: both met at 6 GiB. alice's share = max(48/24, 4/6) = 2, bob's = max(48/72, 4/6) = 2/3."""
    async with running(engine(redis, prefix, None, TenantWeights({"bob": 3.0}))) as e:
        for i, who in enumerate(["alice", "alice", "bob", "bob"]):
            assert (await e.place(f"{who}{i}", task(24, tenant=who))).outcome == "placed"
        for who in ("alice", "bob"):
            assert (await e.place(f"{who}-waits", task(24, tenant=who))).outcome == "deferred"
        shares = {s["tenant"]: s for s in e.tenant_shares()}
        assert list(shares) == ["alice", "bob"]
        a, b = shares["alice"], shares["bob"]
        assert (a["weight"], b["weight"]) == (1.0, 3.0)
        assert a["allocated"].tolist() == b["allocated"].tolist() == [48_000, 4 * GIB, 0]
        assert a["requested"].tolist() == b["requested"].tolist() == [72_000, 6 * GIB, 0]
        assert a["deserved"] == pytest.approx([24_000, 6 * GIB, 0]) and b["deserved"] == pytest.approx(
            [72_000, 6 * GIB, 0])
        assert (a["share"], b["share"]) == (pytest.approx(2.0), pytest.approx(2 / 3))
        assert (a["running_tasks"], a["queued_tasks"], b["running_tasks"], b["queued_tasks"]) == (2, 1, 2, 1)
