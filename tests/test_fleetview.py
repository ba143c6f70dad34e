"""The pieces of the fleet views without a stack: the tables' columns read back as written (hypothesis), the GPU
totals per model (hypothesis), and DescribeTask's history read from a real Redis stream (paging, order, the
creation-time start, truncation)."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from hsched import fleetview, views
from hsched.state.tasks import now_ms, step
from hsched.v1 import common_pb2 as pb
from hsched.v1 import placer_pb2

WORD = st.text(alphabet="abcXYZ019/%.:-_()", min_size=1, max_size=12)
CELL = st.lists(WORD, min_size=1, max_size=3).map(" ".join)  # single spaces inside a cell, as the views print


@given(st.integers(1, 6).flatmap(lambda n: st.tuples(st.lists(WORD, min_size=n, max_size=n),
                                                     st.lists(st.lists(CELL, min_size=n, max_size=n), max_size=8))))
def test_a_table_reads_back_as_its_cells(shape):
    headers, rows = shape
    lines = views.table(headers, rows).splitlines()
    assert [re.split(r"\s{2,}", line.strip()) for line in lines] == [headers, *rows]
    assert all(not line.endswith(" ") for line in lines)


CARD = st.tuples(st.sampled_from(["T4", "P100", "V100M16"]), st.integers(0, 100), st.integers(0, 16384))


@given(st.lists(st.lists(CARD, max_size=8), max_size=12))
def test_gpu_totals_per_model_add_up(nodes):
    msgs = [placer_pb2.NodeState(gpus=[placer_pb2.GpuCardState(card=i, model=m, core_percent_free=c,
                                                               memory_mib_free=f, memory_mib_capacity=16384)
                                       for i, (m, c, f) in enumerate(cards)]) for cards in nodes]
    totals = fleetview.gpu_models(msgs)
    cards = [card for node in nodes for card in node]
    assert [t.model for t in totals] == sorted({m for m, _, _ in cards})
    for t in totals:
        mine = [(c, f) for m, c, f in cards if m == t.model]
        assert t.cards == len(mine) and t.memory_mib_capacity == 16384 * len(mine)
        assert t.core_percent_free == sum(c for c, _ in mine) and t.memory_mib_free == sum(f for _, f in mine)
        assert t.cards_idle == sum(c == 100 and f == 16384 for c, f in mine)


async def test_the_history_is_the_tasks_events_in_stream_order_from_its_creation(redis, prefix, monkeypatch):
    stream = f"{prefix}:tasks"
    mine = pb.Task(task_id="tmine", created_unix_ms=now_ms())
    other = pb.Task(task_id="tother", created_unix_ms=now_ms())
    # an entry of the same task id long before its creation (an id reused after retention): not its history
    old = step("submitted", pb.Task(task_id="tmine"))
    await redis.xadd(stream, old.fields, id="1-0")
    kinds = ["submitted", "dc_selected", "placed", "running", "succeeded"]
    for i in range(2500):  # three pages of other tasks' entries, with the task's five steps spread among them
        if i % 600 == 0 and kinds:
            await redis.xadd(stream, step(kinds.pop(0), mine, f"step at {i}").fields)
        await redis.xadd(stream, step("submitted", other).fields)
    events, truncated = await fleetview.task_history(redis, stream, mine)
    assert [e.kind for e in events] == ["submitted", "dc_selected", "placed", "running", "succeeded"]
    assert [e.detail for e in events] == [f"step at {i}" for i in (0, 600, 1200, 1800, 2400)] and not truncated
    assert all(e.task_id == "tmine" for e in events) and events == sorted(events, key=lambda e: e.event_id)
    # 650 entries forward from the creation, 650 back from the end (a large job's task among its siblings')
    monkeypatch.setattr(fleetview, "HISTORY_SCAN", 1300)
    events, truncated = await fleetview.task_history(redis, stream, mine)
    assert [e.kind for e in events] == ["submitted", "dc_selected", "succeeded"] and truncated
    monkeypatch.setattr(fleetview, "HISTORY_SCAN", 3000)  # the two scans meet: everything, nothing missed
    events, truncated = await fleetview.task_history(redis, stream, mine)
    assert [e.detail for e in events] == [f"step at {i}" for i in (0, 600, 1200, 1800, 2400)] and not truncated
    # the window ends at the task's last update (+1 s); past it, entries are read only to find the entry of the
    # task's record (its final event, written late), at most HISTORY_LAG_SCAN: then the history says it is cut
    ended = pb.Task(task_id="tmine", created_unix_ms=mine.created_unix_ms, updated_unix_ms=1)
    monkeypatch.setattr(fleetview, "HISTORY_LAG_SCAN", 500)
    events, truncated = await fleetview.task_history(redis, stream, ended)
    assert [e.kind for e in events] == ["submitted"] and truncated
    monkeypatch.setattr(fleetview, "HISTORY_EVENTS", 2)
    events, truncated = await fleetview.task_history(redis, stream, mine)
    assert [e.kind for e in events] == ["submitted", "dc_selected"] and truncated


async def test_a_final_event_written_seconds_after_its_time_is_in_the_history(redis, prefix, monkeypatch):
    """After a placer outage the gateway learns of a completion from the ledger and records it with the ledger's
    time: its stream entry id is seconds after the task's updated_unix_ms, past the window's 1 s margin."""
    stream = f"{prefix}:tasks"
    t0 = now_ms()
    mine, other = pb.Task(task_id="tlate", created_unix_ms=t0), pb.Task(task_id="tother", created_unix_ms=t0)
    for i, kind in enumerate(["submitted", "placed", "running"]):
        await redis.xadd(stream, step(kind, mine, at_ms=t0 + 10 * i).fields, id=f"{t0 + 10 * i}-0")
    for i in range(2000):  # other tasks' entries over the next 4 s, in and past the window
        await redis.xadd(stream, step("submitted", other, at_ms=t0 + 40 + 2 * i).fields, id=f"{t0 + 40 + 2 * i}-0")
    # it finished at t0 + 30 (the ledger's time), recorded 5 s later
    await redis.xadd(stream, step("succeeded", mine, "finished at cheap", at_ms=t0 + 30).fields, id=f"{t0 + 5030}-0")
    await redis.xadd(stream, step("submitted", other).fields)  # and others after it
    assert mine.updated_unix_ms == t0 + 30 and mine.state == pb.TASK_STATE_SUCCEEDED
    events, truncated = await fleetview.task_history(redis, stream, mine)
    assert [e.kind for e in events] == ["submitted", "placed", "running", "succeeded"] and not truncated
    assert events[-1].event_id == f"{t0 + 5030}-0" and events[-1].unix_ms == t0 + 30
    # a window over the scan budget (its first and last events, truncated) still ends with the final event
    monkeypatch.setattr(fleetview, "HISTORY_SCAN", 200)
    events, truncated = await fleetview.task_history(redis, stream, mine)
    assert [e.kind for e in events] == ["submitted", "placed", "running", "succeeded"] and truncated
    # past the lag budget (some 1,500 entries lie between the window and the final event): truncated, honestly
    monkeypatch.setattr(fleetview, "HISTORY_SCAN", 20_000)
    monkeypatch.setattr(fleetview, "HISTORY_LAG_SCAN", 500)
    events, truncated = await fleetview.task_history(redis, stream, mine)
    assert [e.kind for e in events] == ["submitted", "placed", "running"] and truncated


async def test_a_placer_that_has_not_learnt_it_lost_its_lease_is_shown_fenced_not_serving(redis_url, prefix,
                                                                                         tmp_path):
    """Right after another placer took the DC over, the old one still answers GetState until its next renewal:
    `hsched dcs` showed it serving, with its stale memory as the DC's state."""
    import grpc

    from hsched.domain.fleet import load_fleet
    from hsched.state.keys import Keys
    from hsched.state.redis import connect
    from hsched.v1 import placer_pb2_grpc
    from services.placer import server as placer_server
    from tests import inprocess
    from tests.conftest import SMALL_FLEET

    dc, keys = load_fleet(SMALL_FLEET).datacenter("cheap"), Keys(prefix)
    argv = ["--fleet", SMALL_FLEET, "--redis-url", redis_url, "--prefix", prefix, "--datacenter", "cheap",
            "--lease-ms", "60000"]  # renewed every 20 s: it learns nothing during this test
    redis = connect(redis_url)
    try:
        async with inprocess.service(placer_server, argv, tmp_path / "placer.port") as target, \
                grpc.aio.insecure_channel(target) as channel:
            stub = placer_pb2_grpc.PlacerStub(channel)
            view = await fleetview.datacenter_view(dc, stub, redis, keys, 10)
            assert (view.status, view.lease.fencing_token, view.summary.fencing_token) == ("serving", 1, 1)
            await redis.incr(keys.fence("cheap"))  # another placer takes the DC over: token 2
            await redis.set(keys.lease("cheap"), "standby-1", px=60000)
            view = await fleetview.datacenter_view(dc, stub, redis, keys, 10)
            assert view.status == "fenced"
            assert view.reason == "it serves with fencing token 1, the DC's lease is at 2 (held by standby-1)"
            assert view.summary.capacity.cpu_milli == dc.capacity_total().cpu_milli  # the fleet's, not its memory
    finally:
        await redis.aclose()
