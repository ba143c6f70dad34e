"""A fleet file changed under a deployment, on a real Redis: the ledger's node indices are positions in the DC's
node table, so a restarted placer carries every live task over to the same positions of the new table, or
refuses to start (writing nothing) when the change moved nodes that live tasks hold."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

import pytest

from hsched.domain.cluster import ClusterState
from hsched.domain.fleet import DataCenter
from hsched.engine.placer import PlacerEngine
from hsched.policies.heuristics import make_policy
from hsched.state.keys import Keys
from hsched.state.ledger import LayoutConflict, node_layout, recorded_layout, replay
from tests.test_engine import spec
from tests.test_ledger import cheap, redis  # noqa: F401 - the fixture


def grown(dc: DataCenter) -> DataCenter:
    """Two 48-core nodes added after the existing pool: every existing position keeps its node."""
    return replace(dc, pools=(*dc.pools, replace(dc.pools[0], name="big", count=2, cpu_milli=48_000)))


def small_first(dc: DataCenter) -> DataCenter:
    """Two 4-core nodes added BEFORE the existing pool: positions 0 and 1 become 4-core nodes."""
    return replace(dc, pools=(replace(dc.pools[0], name="small", count=2, cpu_milli=4_000), *dc.pools))


async def started(dc: DataCenter, redis, prefix: str, owner: str) -> PlacerEngine:  # noqa: F811
    engine = PlacerEngine(dc, redis, Keys(prefix), make_policy("bestfit"), owner)
    await engine.start(wait_for_lease_s=0)
    return engine


async def test_a_pool_added_after_the_others_keeps_every_task_on_its_node(redis, prefix) -> None:  # noqa: F811
    first = await started(cheap(), redis, prefix, "p1")
    for i in range(4):  # 20 of 24 cores: one task per node
        assert (await first.place(f"t{i}", spec(20))).outcome == "placed"
    await first.release("t1")  # history on a node that stays: folded in the old layout, then gone
    held = dict(first.state.allocations)
    await first.stop()

    second = await started(grown(cheap()), redis, prefix, "p2")
    try:
        assert second.state.n == 6 and second.state.allocations == held
        used = {p.node for parts in held.values() for p in parts}
        assert [int(c) for c in second.state.free_cpu] == [4_000 if i in used else 24_000 for i in range(4)] \
            + [48_000, 48_000]
        stream = Keys(prefix).ledger("cheap")
        # recorded before its first append: the ledger's next entries are read in the new layout
        assert await recorded_layout(redis, stream) == node_layout(second.state.table)
        big = await second.place("big", spec(40))  # only an added node holds 40 cores
        assert big.outcome == "placed" and {p.node for p in second.state.allocations["big"]} <= {4, 5}
        want = second.state
    finally:
        await second.stop()
    # every reader with the new fleet folds the same state
    state, queue = ClusterState(grown(cheap())), OrderedDict()
    await replay(redis, Keys(prefix).ledger("cheap"), state, queue)
    assert state.allocations == want.allocations and list(state.free_cpu) == list(want.free_cpu)
    # and the previous fleet file no longer fits: the 40-core task is on a node it does not have
    with pytest.raises(LayoutConflict, match=r"1 live task\(s\) hold \(big on cheap-r0"):
        await replay(redis, Keys(prefix).ledger("cheap"), ClusterState(cheap()), OrderedDict())


async def test_a_change_under_live_tasks_is_refused_naming_them_until_they_are_released(redis, prefix) -> None:  # noqa: F811
    stream = Keys(prefix).ledger("cheap")
    first = await started(cheap(), redis, prefix, "p1")
    for i in range(4):
        assert (await first.place(f"t{i}", spec(20))).outcome == "placed"
    on_first_two = sorted(t for t, parts in first.state.allocations.items() if parts[0].node in (0, 1))
    await first.stop()
    entries, layout = await redis.xlen(stream), await recorded_layout(redis, stream)

    with pytest.raises(LayoutConflict) as refused:
        await started(small_first(cheap()), redis, prefix, "p2")
    message = str(refused.value)
    assert "2 live task(s)" in message and all(t in message for t in on_first_two), message
    assert "cheap-r00-s00" in message and "add pools after the existing ones" in message
    assert await redis.xlen(stream) == entries and await recorded_layout(redis, stream) == layout  # nothing written

    # as the message says: with the previous fleet file, release them; then the change applies
    again = await started(cheap(), redis, prefix, "p3")
    for task in on_first_two:
        await again.release(task)
    await again.stop()
    changed = await started(small_first(cheap()), redis, prefix, "p4")
    try:
        kept = sorted(t for t in changed.state.allocations)
        assert kept == sorted({"t0", "t1", "t2", "t3"} - set(on_first_two))
        assert [int(c) for c in changed.state.free_cpu[:2]] == [4_000, 4_000]  # the new small nodes, empty
        assert all(p.node in (2, 3) for parts in changed.state.allocations.values() for p in parts)
    finally:
        await changed.stop()
