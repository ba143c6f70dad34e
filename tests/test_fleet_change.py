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


async def test_a_gateway_refuses_a_fleet_without_a_dc_that_live_tasks_are_in(redis, prefix, tmp_path) -> None:  # noqa: F811
    """A DC removed from the fleet file while a task ran there: the gateway served, the task showed RUNNING for
    ever and its release was NOT_FOUND. Now it refuses to start (exit 2, one line naming the DC and the task);
    once the task is released, the DC may go."""
    import subprocess
    import sys

    import yaml

    from hsched.domain.fleet import parse_fleet
    from hsched.state.tasks import TaskStore
    from hsched.v1 import common_pb2 as pb
    from services.gateway.server import removed_dcs_must_hold_nothing
    from tests.conftest import SMALL_FLEET
    from tests.test_domain import small_fleet_dict

    store = TaskStore(redis, Keys(prefix).tasks)
    running = pb.Task(task_id="t0001", datacenter="near", spec=pb.TaskSpec(tenant="a"))
    await store.record("placed", running)
    data = small_fleet_dict()
    data["datacenters"] = [d for d in data["datacenters"] if d["name"] != "near"]
    without_near = tmp_path / "fleet.yaml"
    without_near.write_text(yaml.safe_dump(data))
    removed_dcs_must_hold_nothing(store, parse_fleet(yaml.safe_load(open(SMALL_FLEET))))  # near is there: fine
    with pytest.raises(LayoutConflict, match=r"no data center that live tasks or jobs are in \(near: 1 live "
                                             r"\(t0001\)\)"):
        removed_dcs_must_hold_nothing(store, parse_fleet(data))
    url = redis.connection_pool.connection_kwargs
    done = subprocess.run([sys.executable, "-m", "services.gateway", "--fleet", str(without_near), "--redis-url",
                           f"redis://{url['host']}:{url['port']}/{url.get('db', 0)}", "--prefix", prefix,
                           "--listen", "127.0.0.1:0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "near: 1 live (t0001)" in done.stderr.strip().splitlines()[-1], done.stderr
    await store.record("released", running)
    removed_dcs_must_hold_nothing(store, parse_fleet(data))


def test_a_gateway_refuses_a_placers_list_missing_a_dc_of_the_fleet(redis_url) -> None:
    """(A hand-written --placers without gpu served, and every GPU task was REJECTED "no placer address".)"""
    import subprocess
    import sys

    from tests.conftest import SMALL_FLEET

    done = subprocess.run([sys.executable, "-m", "services.gateway", "--fleet", str(SMALL_FLEET), "--redis-url",
                           redis_url, "--placers", "cheap=127.0.0.1:1,near=127.0.0.1:2", "--listen", "127.0.0.1:0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and done.stderr.strip().splitlines()[-1] == \
        "--placers must name every data center of the fleet; missing: ['gpu']", done.stderr
