"""Cordon, drain and uncordon (an operator's maintenance of nodes) in the placer engine, in-process on a real Redis
ledger: a cordoned node takes nothing new while its tasks stay; a drain also evicts its offline tasks, which are
requeued and placed on other nodes; the change is a ledger event, so a placer that folds the ledger (a restart, a
takeover, a snapshot) has the same nodes cordoned; a write of unknown outcome is cancelled like any other. The
gateway and CLI path, with real processes, is in tests/test_cordon_stack.py.

The small fleet's DC "cheap": 4 nodes of 24 cores (cheap-r00-s00, -s01, cheap-r01-s00, -s01), first fit.
"""

from __future__ import annotations

import json
from collections import OrderedDict

import pytest

from hsched.domain.cluster import ClusterState
from hsched.domain.errors import ValidationError
from hsched.engine.placer import NodeChange, PlacerEngine
from hsched.policies.heuristics import make_policy
from hsched.state.keys import Keys
from hsched.state.ledger import cancellations, load_snapshot, snapshot_of
from tests.test_engine import cheap, fold_ledger, ledger_events, running
from tests.test_preemption import executor, started, task

NODES = ["cheap-r00-s00", "cheap-r00-s01", "cheap-r01-s00", "cheap-r01-s01"]


def engine(redis, prefix: str, owner: str = "p1", ex=None) -> PlacerEngine:
    return PlacerEngine(cheap(), redis, Keys(prefix), make_policy("firstfit"), owner, executor=ex)


def cordon(*nodes: str, reason: str = "", evict: bool = False) -> NodeChange:
    return NodeChange(nodes, False, reason, evict)


def uncordon(*nodes: str) -> NodeChange:
    return NodeChange(nodes, True)


def nodes_of(result) -> set[int]:
    return {p.node for p in result.parts}


async def test_a_cordoned_node_takes_nothing_new_and_an_uncordon_places_what_waited(redis, prefix) -> None:
    async with running(engine(redis, prefix)) as e:
        assert (await e.place("before", task(8))).parts[0].node == 0  # first fit: node 0
        r = await e.set_schedulable(cordon(NODES[0], reason="fan replacement"))
        assert (r.changed, r.evicted, r.remaining) == ([NODES[0]], [], {NODES[0]: 1})
        assert e.state.cordoned[0]["reason"] == "fan replacement"
        assert "before" in e.state.allocations  # what runs there stays
        # nodes 1-3 take 24-core tasks; node 0 (16 cores free) takes no 8-core task: it is deferred, not refused
        for name in ("a", "b", "c"):
            assert nodes_of(await e.place(name, task(24))) != {0}
        waiting = await e.place("waits", task(8))
        assert waiting.outcome == "deferred" and f"only cordoned nodes have room now ({NODES[0]}" in waiting.reason
        # the summary the selector reads counts what can be placed: node 0's 16 free cores are not
        summary = e.summary()
        assert (summary["free"][0], summary["largest_free"][0], summary["cordoned_nodes"]) == (0, 0, 1)
        # a retry changes nothing and writes nothing
        events_before = len(await ledger_events(redis, prefix))
        assert (await e.set_schedulable(cordon(NODES[0], reason="fan replacement"))).changed == []
        assert len(await ledger_events(redis, prefix)) == events_before
        r = await e.set_schedulable(uncordon(NODES[0]))
        assert r.changed == [NODES[0]] and [t for t, _ in r.placed_from_queue] == ["waits"]
        assert e.summary()["largest_free"][0] == 8000  # node 0 again: 24 cores less "before" and "waits"
        assert nodes_of(await e.place("after", task(8))) == {0} and not e.state.cordoned
        # the ledger's fold is the engine's state
        state, queue = await fold_ledger(redis, prefix, cheap())
        assert state.allocations == e.state.allocations and state.cordoned == {} and not queue


async def test_an_uncordon_lets_a_waiting_online_task_evict_there(redis, prefix) -> None:
    """Node 0 (cordoned) holds an offline task, nodes 1-3 online ones: a waiting online task can evict nothing.
    The uncordon is room for it (by eviction) at once; it waited for the next unrelated release, because an
    eviction search is repeated only after something was freed."""
    async with running(engine(redis, prefix)) as e:
        assert (await e.place("off", task(24))).outcome == "placed"  # first fit: node 0
        for i in range(3):
            assert (await e.place(f"on{i}", task(24, "online"))).outcome == "placed"
        await e.set_schedulable(cordon(NODES[0], reason="firmware"))
        assert (await e.place("waits", task(24, "online"))).outcome == "deferred"
        r = await e.set_schedulable(uncordon(NODES[0]))
        assert [t for t, _ in r.placed_from_queue] == ["waits"] and "off" in e.queue  # evicted, requeued


async def test_drain_evicts_the_offline_tasks_which_run_elsewhere_while_online_ones_stay(redis, prefix) -> None:
    async with running(engine(redis, prefix, ex=executor())) as e:
        for name, cls in (("off1", ""), ("on1", "online"), ("off2", "")):
            assert nodes_of(await e.place(name, task(6, cls, runtime_s=3600))) == {0}
            await started(redis, prefix, name)
        r = await e.set_schedulable(cordon(NODES[0], reason="kernel upgrade", evict=True))
        assert sorted(r.evicted) == ["off1", "off2"] and r.remaining == {NODES[0]: 1}
        assert sorted(t for t, _ in r.placed_from_queue) == ["off1", "off2"]
        for victim in ("off1", "off2"):
            assert 0 not in {p.node for p in e.state.allocations[victim]}
        assert {p.node for p in e.state.allocations["on1"]} == {0}
        entries = [ev for _, ev in await ledger_events(redis, prefix)]
        evictions = [ev for ev in entries if ev["t"] == "preempt"]
        assert {ev["task"] for ev in evictions} == {"off1", "off2"}
        assert all(ev["by"] == "" and "kernel upgrade" in ev["reason"] for ev in evictions)
        # a second drain finds nothing left to evict
        again = await e.set_schedulable(cordon(NODES[0], reason="kernel upgrade", evict=True))
        assert (again.changed, again.evicted) == ([], [])
        state, queue = await fold_ledger(redis, prefix, cheap())
        assert state.allocations == e.state.allocations and list(state.cordoned) == [0] and not queue


async def test_unknown_nodes_are_refused_by_name_before_anything_is_written(redis, prefix) -> None:
    async with running(engine(redis, prefix)) as e:
        with pytest.raises(ValidationError) as err:
            await e.set_schedulable(cordon(NODES[1], "cheap-r09-s00"))
        assert err.value.field == "nodes[1]" and "cheap-r09-s00" in str(err.value)
        assert not e.state.cordoned and not await ledger_events(redis, prefix)


async def test_a_placer_that_folds_the_ledger_or_its_snapshot_has_the_same_nodes_cordoned(redis, prefix) -> None:
    async with running(engine(redis, prefix)) as e:
        await e.set_schedulable(cordon(NODES[1], NODES[3], reason="rack 1 PDU"))
        await e.set_schedulable(uncordon(NODES[3]))
    async with running(engine(redis, prefix, owner="p2")) as e2:  # takes the DC over from the ledger
        assert e2.state.cordoned == {1: {"reason": "rack 1 PDU", "at": e2.state.cordoned[1]["at"]}}
        assert nodes_of(await e2.place("x", task(24))) == {0}
        assert nodes_of(await e2.place("y", task(24))) == {2}  # node 1 skipped
        snap = snapshot_of(e2.state, e2.queue)
    state = ClusterState(cheap())
    load_snapshot(snap, state, OrderedDict())
    assert state.cordoned == e2.state.cordoned and not state.feasible(task(1).resources)[1]
    assert json.loads(snap)["cordoned"] == [[NODES[1], "rack 1 PDU", state.cordoned[1]["at"]]]


def test_a_cordon_of_unknown_outcome_is_cancelled_by_writing_the_nodes_state_as_it_was() -> None:
    """The ledger writes `cancellations` of an append whose outcome is unknown before anything else: a cordon's
    is the node's previous state (uncordoned; or cordoned with the old reason), so memory (undone) and the ledger
    agree whichever way the write went."""
    events = [{"t": "cordon", "task": "", "node": NODES[0], "on": True, "reason": "r",
               "_undo": [{"t": "cordon", "task": "", "node": NODES[0], "on": False}]}]
    assert cancellations(events) == [{"t": "cordon", "task": "", "node": NODES[0], "on": False}]


async def test_an_append_that_fails_leaves_memory_as_the_ledger_says(redis, prefix, monkeypatch) -> None:
    async with running(engine(redis, prefix)) as e:
        await e.set_schedulable(cordon(NODES[2], reason="old"))

        async def lost(events):
            from redis.exceptions import ConnectionError as RedisConnectionError
            raise RedisConnectionError("connection lost mid-append")
        monkeypatch.setattr(e.ledger, "_append_now", lost)
        with pytest.raises(Exception, match="connection lost"):
            await e.set_schedulable(cordon(NODES[2], NODES[0], reason="new"))
        assert e.state.cordoned == {2: {"reason": "old", "at": e.state.cordoned[2]["at"]}}
        assert e.state.feasible(task(1).resources).tolist() == [True, True, False, True]
