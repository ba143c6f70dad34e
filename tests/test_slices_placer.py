"""Slice types in the placer (hsched.engine.slices, issue 15 item 4): the slice-types file, its fit to the Alibaba
2018 trace with the simulator's own clustering and partition, and PlacerEngine on a real Redis with its nodes cut
into slices — smallest fitting type first, unschedulable parts named, restarts folding back the same occupancy,
preemption within slices, and random place/release/restart sequences that never share a slice.

The DC is the small test fleet's "cheap": 4 nodes × 24 cores × 96 GiB, FirstFit.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from collections import OrderedDict

import numpy as np
import pytest
import redis as sync_redis
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hsched.cli import main
from hsched.domain.errors import ValidationError
from hsched.domain.resources import Resources
from hsched.domain.task import TaskSpec
from hsched.engine.placer import PlacerEngine
from hsched.engine.slices import SliceCatalog, SlicedState, fit_catalog
from hsched.policies.heuristics import make_policy
from hsched.policies.slices import partition_node
from hsched.state.keys import Keys
from hsched.state.ledger import replay
from hsched.state.redis import connect
from hsched.v1 import placer_pb2
from tests.conftest import SMALL_FLEET
from tests.test_engine import cheap, running
from tests.test_leases import PlacerProcess, place, state_of, wait_for
from tests.test_policies import assert_books_balance

GIB = 1024
# A: 2 cores / 4 GiB, B: 4 cores / 16 GiB, equal shares of the slice capacity
TWO = SliceCatalog((2000, 4000), (4 * GIB, 16 * GIB), (1.0, 1.0))


def task(cores: float, mem_gib: float = 1, online: bool = False, runtime_s: float = 3600) -> TaskSpec:
    return TaskSpec(Resources(round(cores * 1000), round(mem_gib * GIB)), runtime_s=runtime_s,
                    priority_class="online" if online else "offline")


def engine(redis, prefix: str, catalog: SliceCatalog = TWO, owner: str = "p1") -> PlacerEngine:
    return PlacerEngine(cheap(), redis, Keys(prefix), make_policy("firstfit"), owner, slices=catalog)


async def folded(redis, prefix: str, catalog: SliceCatalog = TWO) -> SlicedState:
    """The ledger folded from scratch into a sliced state (apply refuses any over-allocation)."""
    state = SlicedState(cheap(), catalog)
    await replay(redis, Keys(prefix).ledger("cheap"), state, OrderedDict())
    return state


def slice_counts(state: SlicedState) -> np.ndarray:
    """Slices in use recounted from the allocations alone (not from the incremental `used`)."""
    counts = np.zeros_like(state.cut)
    for parts in state.allocations.values():
        for p in parts:
            k = state.slice_type(p)
            assert k is not None, f"part {p} holds no slice size"
            counts[p.node, k] += 1
    return counts


def assert_slices_sound(state: SlicedState) -> None:
    """Never two tasks in one slice, never past a node's capacity, the occupancy what the allocations say."""
    assert_books_balance(state)
    np.testing.assert_array_equal(state.used, slice_counts(state))
    assert (state.used <= state.cut).all() and (state.used >= 0).all()


@pytest.fixture
async def redis(redis_url):
    client = connect(redis_url)
    yield client
    await client.aclose()


# ------------------------------------------------------------------------------------------------------------
# the file


def test_a_file_round_trips_as_yaml_and_json(tmp_path) -> None:
    catalog = SliceCatalog((500, 1000), (1298, 2320), (0.25, 0.75), {"trace": "alibaba2018", "q": 2})
    for name in ("s.yaml", "s.json"):
        catalog.save(tmp_path / name)
        again = SliceCatalog.load(tmp_path / name)
        assert again == catalog and again.source == catalog.source
    assert json.loads((tmp_path / "s.json").read_text())["types"][1] == {"cpu_milli": 1000, "memory_mib": 2320,
                                                                       "share": 0.75}


@pytest.mark.parametrize(("data", "field"), [
    ({"types": []}, "types"),
    ({"types": [{"cpu_milli": 0, "memory_mib": 10}]}, "types[0].cpu_milli"),
    ({"types": [{"cpu_milli": 10, "memory_mib": 1.5}]}, "types[0].memory_mib"),
    ({"types": [{"cpu_milli": 10, "memory_mib": 10, "share": -1}]}, "types[0].share"),
    ({"types": [{"cpu_milli": 10, "memory_mib": 10, "share": 0}]}, "types[].share"),
    ({"types": [{"cpu_milli": 10, "memory_mib": 10}, {"cpu_milli": 10, "memory_mib": 10}]}, "types[1]"),
    ({"format": "other/9", "types": [{"cpu_milli": 10, "memory_mib": 10}]}, "format"),
    (["not", "a", "mapping"], "slice types"),
    ({"types": [{"cpu_milli": 10, "memory_mib": 10, "gpu": 1}]}, "types[0].gpu"),  # was ignored: a typo lost
    ({"typs": [{"cpu_milli": 10, "memory_mib": 10}]}, "typs"),
])
def test_a_bad_file_names_the_field(tmp_path, data, field) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValidationError) as err:
        SliceCatalog.load(path)
    assert err.value.field == f"{path}: {field}"


@settings(max_examples=100, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.floats() | st.text(max_size=3),
                    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(
                        st.sampled_from(["types", "cpu_milli", "memory_mib", "share", "format", "source"]), kids,
                        max_size=4), max_leaves=12))
def test_any_parsed_input_is_a_catalog_or_a_validation_error(data) -> None:
    try:
        catalog = SliceCatalog.from_dict(data)
    except ValidationError:
        return
    assert catalog.q >= 1 and min(catalog.cpu_milli) >= 1 and sum(catalog.shares) > 0


# ------------------------------------------------------------------------------------------------------------
# the fit: the simulator's clustering and partition, in the stack's units


@pytest.fixture(scope="module")
def fit6():
    return fit_catalog(6)


def test_fit_is_the_simulators_layout_in_the_stacks_units(fit6) -> None:
    from hsched.envs.colocation import ColocationConfig, slice_layout

    types, per_machine = slice_layout(ColocationConfig())  # hsched/Colocation-v0's Q = 6 slices
    c = fit6.catalog
    assert c.source["trace_sizes"] == types.sizes.tolist() and c.source["slices_per_trace_machine"] == list(per_machine)
    # (cores, memory % of a 384 GiB machine) -> (cpu_milli, MiB): (0.5, 0.33) is 500 m, 0.33 % × 393 216 MiB
    assert (c.cpu_milli[0], c.memory_mib[0]) == (500, round(0.0033 * 384 * 1024))
    assert list(c.cpu_milli) == [round(s * 1000) for s in types.sizes[:, 0]]
    # cut with the stack's sizes, a v2018 machine (96 cores, 384 GiB) gets the simulator's 127 slices
    assert c.cut(96_000, 384 * GIB) == per_machine
    assert c.source["q"] == 6 and c.source["q_choice"] == "given"


def test_fit_records_the_idle_curve_and_its_knee(fit6) -> None:
    curve, c = fit6.curve, fit6.catalog
    assert [row["q"] for row in c.source["idle_vs_q"]] == list(range(1, 13))
    idle = [row["constrained"] for row in c.source["idle_vs_q"]]
    assert idle == [round(v, 4) for v in curve.constrained] and idle[0] == c.source["idle_uniform"]
    assert curve.chosen_q == 7  # docs/results_colocation.md: one more type saves < 1 % from Q = 7 on
    assert idle[6] - idle[7] < 0.01 and all(idle[k] - idle[k + 1] >= 0.01 for k in range(6))


# ------------------------------------------------------------------------------------------------------------
# the partition and the planner


def test_one_type_cuts_a_node_by_its_scarcer_resource() -> None:
    state = SlicedState(cheap(), SliceCatalog((4000,), (10 * GIB,), (1.0,)))
    assert state.cut.tolist() == [[6]] * 4  # 24 / 4 cores = 6 (memory would allow 9)
    two = SlicedState(cheap(), TWO)
    assert two.cut.tolist() == [partition_node((24000, 96 * GIB), np.array([[2000, 4096], [4000, 16384]]),
                                               [1.0, 1.0])] * 4
    per_node = two.cut[0]
    assert per_node[0] * 2000 + per_node[1] * 4000 <= 24000 and per_node[0] * 4 + per_node[1] * 16 <= 96
    assert per_node.min() >= 1


async def test_a_task_takes_the_smallest_free_type_that_fits_then_a_larger_one(redis, prefix) -> None:
    async with running(engine(redis, prefix)) as e:
        cut = e.state.cut.sum(axis=0)
        for i in range(cut[0]):  # 1 core / 1 GiB: an A slice (2 cores, 4 GiB) while there is one
            r = await e.place(f"a{i}", task(1))
            assert r.outcome == "placed" and [(p.cpu_milli, p.memory_mib) for p in r.parts] == [(2000, 4096)]
        r = await e.place("b0", task(1))  # every A slice taken: a B slice holds it
        assert r.outcome == "placed" and (r.parts[0].cpu_milli, r.parts[0].memory_mib) == (4000, 16384)
        for i in range(1, cut[1]):
            assert (await e.place(f"b{i}", task(1, 8))).outcome == "placed"  # 8 GiB fits only B
        assert e.state.used.sum(axis=0).tolist() == cut.tolist()
        r = await e.place("late", task(1))
        assert r.outcome == "deferred"
        assert "no free slice of type 0 (2000m cpu, 4096 MiB), type 1 (4000m cpu, 16384 MiB)" in r.reason
        assert (await e.release("a0")).placed_from_queue[0][0] == "late"  # the freed A slice goes to it
        assert_slices_sound(e.state)
        summary = e.summary()["slices"]
        assert summary["cut"] == cut.tolist() and summary["used"] == cut.tolist()


async def test_a_part_no_type_fits_is_refused_with_the_types_never_queued(redis, prefix) -> None:
    async with running(engine(redis, prefix)) as e:
        r = await e.place("big", task(5), allow_defer=True)  # 5 cores: more than every type
        assert r.outcome == "unschedulable" and "big" not in e.queue
        assert r.reason == ("replica 0 part 0: 5000m cpu / 1024 MiB fits no slice type (types: 2000m/4096MiB, "
                            "4000m/16384MiB); slice types are fixed, so it is not queued")
        # a type that fits but no node is cut into: unschedulable too
        huge = SliceCatalog((2000, 30000), (4096, 4096), (1.0, 0.0))
    async with running(engine(redis, prefix, huge, owner="p2")) as e:
        r = await e.place("mid", task(3))
        assert r.outcome == "unschedulable" and "fits only slice types no node of cheap is cut into" in r.reason


async def test_a_restart_folds_the_same_slice_occupancy_and_allocates_nothing_twice(redis, prefix) -> None:
    first = engine(redis, prefix)
    async with running(first):
        for i, (cores, mem) in enumerate([(1, 1), (1, 6), (2, 4), (0.5, 12), (3, 2), (1, 1)]):
            assert (await first.place(f"t{i}", task(cores, mem))).outcome == "placed"
        await first.release("t2")
        before_used, before_allocs = first.state.used.copy(), dict(first.state.allocations)
    second = engine(redis, prefix, owner="p2")
    async with running(second):
        np.testing.assert_array_equal(second.state.used, before_used)
        assert second.state.allocations == before_allocs
        again = await second.place("t0", task(1, 1))  # retried: the ledger already holds it
        assert again.notes[0].startswith("already placed") and again.parts == before_allocs["t0"]
        assert_slices_sound(second.state)
    assert_slices_sound(await folded(redis, prefix))


async def test_an_online_task_preempts_an_offline_one_out_of_its_slice(redis, prefix) -> None:
    one = SliceCatalog((4000,), (16 * GIB,), (1.0,))  # 6 slices per node, 24 in the DC
    async with running(engine(redis, prefix, one)) as e:
        for i in range(24):
            assert (await e.place(f"off{i}", task(1))).outcome == "placed"
        r = await e.place("on", task(2, online=True))
        assert r.outcome == "placed" and "preempted 1 offline task(s)" in r.notes[-1]
        assert (r.parts[0].cpu_milli, r.parts[0].memory_mib) == (4000, 16 * GIB)
        assert len(e.queue) == 1 and e.state.used.sum() == 24
        assert_slices_sound(e.state)


# ------------------------------------------------------------------------------------------------------------
# random place / release / restart sequences on a real Redis

OP = st.one_of(
    st.tuples(st.just("place"), st.sampled_from([0.5, 1, 2, 3, 4, 5]), st.sampled_from([1, 4, 8, 16, 20]),
              st.booleans()),  # cores, GiB, allow_defer
    st.tuples(st.just("release"), st.integers(0, 100)),
    st.tuples(st.just("burst"), st.lists(st.sampled_from([0.5, 1, 2, 4]), min_size=2, max_size=5)),
    st.tuples(st.just("restart")),
)


async def run_sequence(redis_url: str, prefix: str, ops: list[tuple]) -> None:
    redis = connect(redis_url)
    e = engine(redis, prefix, owner="prop0")
    await e.start(wait_for_lease_s=0.0)
    tasks: list[str] = []
    try:
        for n, op in enumerate(ops):
            if op[0] == "place":
                tasks.append(f"t{len(tasks)}")
                r = await e.place(tasks[-1], task(op[1], op[2]), allow_defer=op[3])
                assert r.outcome in ("placed", "deferred", "no_room", "unschedulable")
                if r.outcome == "unschedulable":  # only what no type covers (4 cores / 16 GiB at most)
                    assert op[1] > 4 or op[2] > 16
            elif op[0] == "release" and tasks:
                await e.release(tasks[op[1] % len(tasks)])
            elif op[0] == "burst":
                ids = [f"t{len(tasks) + i}" for i in range(len(op[1]))]
                tasks += ids
                await asyncio.gather(*(e.place(t, task(c)) for t, c in zip(ids, op[1], strict=True)))
            elif op[0] == "restart":  # a new placer folds the ledger; the old one's lease is released
                used, allocs, queue = e.state.used.copy(), dict(e.state.allocations), list(e.queue)
                await e.stop()
                e = engine(redis, prefix, owner=f"prop{n + 1}")
                await e.start(wait_for_lease_s=5.0)
                np.testing.assert_array_equal(e.state.used, used)
                assert e.state.allocations == allocs and list(e.queue) == queue
            assert_slices_sound(e.state)
            ledger = await folded(redis, prefix)
            assert_slices_sound(ledger)
            np.testing.assert_array_equal(ledger.used, e.state.used)
    finally:
        await e.stop()
        await redis.aclose()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OP, min_size=1, max_size=14))
def test_random_sequences_never_share_a_slice_nor_exceed_a_node(redis_url: str, prefix: str, ops: list[tuple]) -> None:
    asyncio.run(run_sequence(redis_url, f"{prefix}:{uuid.uuid4().hex[:8]}", ops))


# ------------------------------------------------------------------------------------------------------------
# a real placer process over gRPC: kill -9 and restart


def latest_summary(redis_url: str, prefix: str) -> dict | None:
    client = sync_redis.Redis.from_url(redis_url)
    try:
        entries = client.xrevrange(Keys(prefix).summary("cheap"), count=1)
    finally:
        client.close()
    return json.loads(entries[0][1][b"s"]) if entries else None


def test_a_placer_process_places_into_slices_and_a_kill_9_restart_keeps_the_occupancy(
        redis_url, prefix, tmp_path) -> None:
    path = tmp_path / "slices.yaml"
    TWO.save(path)
    cut = SlicedState(cheap(), TWO).cut.sum(axis=0)
    first = PlacerProcess(redis_url, prefix, tmp_path, "a", "--slice-types", str(path))
    second = None
    try:
        target = first.wait_listening()
        placed = 0
        for i in range(cut[0] + 2):  # every A slice, then two B slices
            r = place(target, f"t{i}", cores=1)
            assert r.outcome == placer_pb2.PLACE_OUTCOME_PLACED, r.reason
            placed += 1
        assert [a.resources.cpu_milli for a in place(target, "t0", cores=1).assignments] == [2000]  # a retry: same slice
        before = wait_for(lambda: (s := latest_summary(redis_url, prefix)) and s["running_tasks"] == placed and s,
                          "the summary shows every placement")
        assert before["slices"]["used"] == [int(cut[0]), 2]
        tasks_before = state_of(target).summary.running_tasks

        first.kill()  # SIGKILL: no lease release, nothing flushed
        second = PlacerProcess(redis_url, prefix, tmp_path, "b", "--slice-types", str(path))
        target = second.wait_listening()
        after = wait_for(lambda: (s := latest_summary(redis_url, prefix))
                         and s["fencing_token"] > before["fencing_token"] and s, "the restarted placer serves")
        assert after["slices"] == before["slices"] and state_of(target).summary.running_tasks == tasks_before
        # fill what is left: exactly the free B slices are placed, then the DC is full
        for i in range(cut[1] - 2):
            assert place(target, f"u{i}", cores=1).outcome == placer_pb2.PLACE_OUTCOME_PLACED
        full = place(target, "over", cores=1)
        assert full.outcome == placer_pb2.PLACE_OUTCOME_NO_ROOM and "no free slice of type 0" in full.reason
        ledger = asyncio.run(_fold(redis_url, prefix))
        assert_slices_sound(ledger)
        assert ledger.used.sum(axis=0).tolist() == cut.tolist() and len(ledger.allocations) == cut.sum()
        assert "Traceback" not in first.output() + second.output()
    finally:
        first.stop()
        if second is not None:
            second.stop()


async def _fold(redis_url: str, prefix: str) -> SlicedState:
    client = connect(redis_url)
    try:
        return await folded(client, prefix)
    finally:
        await client.aclose()


def test_a_placer_with_a_bad_slice_types_file_exits_2_with_one_line(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("types:\n- {cpu_milli: 500, memory_mib: -1}\n")
    run = subprocess.run([sys.executable, "-m", "services.placer", "--fleet", str(SMALL_FLEET), "--datacenter", "cheap",
                          "--slice-types", str(bad)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1].endswith(
        f"{bad}: types[0].memory_mib: must be an integer >= 1 (got -1)")


# ------------------------------------------------------------------------------------------------------------
# the CLI


def test_slices_fit_prints_the_curve_and_writes_the_file_the_placers_load(tmp_path, capsys, fit6) -> None:
    out_file = tmp_path / "slices.yaml"
    assert main(["slices", "fit", "--trace", "alibaba2018", "--q", "6", "-o", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "   7                    0.1426              0.1356  <- knee" in out
    assert "knee (one more type saves < 0.01): Q = 7; using Q = 6 (given)" in out
    assert "a node of 96 cores / 384 GiB is cut into 127 slices: [7, 23, 55, 39, 1, 2]" in out
    assert SliceCatalog.load(out_file) == fit6.catalog
    assert main(["slices", "show", str(out_file)]) == 0
    # up to a --q-max below the knee every step saves more: the cap, not called a knee (0.4296 at Q = 3)
    assert main(["slices", "fit", "--trace", "alibaba2018", "--q-max", "3", "-o", str(tmp_path / "s3.yaml")]) == 0
    out = capsys.readouterr().out
    assert "<- knee" not in out and "<- cap (--q-max)" in out and "no knee up to --q-max 3" in out


def test_bad_slice_flags_are_usage_errors(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["slices", "fit", "--q", "0", "-o", str(tmp_path / "x.yaml")])
    assert exit_.value.code == 2 and "--q: must be auto or a whole number in 1.." in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"types": [{"cpu_milli": 1000, "memory_mib": 10}, {"cpu_milli": 1000, "memory_mib": 10}]}')
    assert main(["up", "--slice-types", str(bad)]) == 2  # before anything starts
    assert capsys.readouterr().err.strip() == (f"hsched: {bad}: types[1]: has the same cpu_milli and memory_mib as "
                                               "types[0] (got [1000, 10])")
    assert not (tmp_path / "x.yaml").exists()


def test_hsched_up_slice_types_reach_every_placer(redis_url, tmp_path) -> None:
    import grpc

    from hsched.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
    from tests.conftest import small_fleet_stack

    path = tmp_path / "slices.yaml"
    TWO.save(path)
    with small_fleet_stack(redis_url, "slices", thermal=False, slice_types=str(path)) as stack, \
            grpc.insecure_channel(stack.gateway) as channel:
        gw = gateway_pb2_grpc.GatewayStub(channel)
        spec = common_pb2.TaskSpec(resources=common_pb2.Resources(cpu_milli=1000, memory_mib=2048), runtime_s=3600)
        placed = gw.Submit(gateway_pb2.SubmitRequest(task=spec), timeout=30).task
        assert placed.state == common_pb2.TASK_STATE_PLACED, placed.reason
        assert [(a.resources.cpu_milli, a.resources.memory_mib) for a in placed.assignments] == [(2000, 4096)]
        big = common_pb2.TaskSpec(resources=common_pb2.Resources(cpu_milli=5000, memory_mib=2048), runtime_s=3600)
        refused = gw.Submit(gateway_pb2.SubmitRequest(task=big), timeout=30).task
        assert refused.state != common_pb2.TASK_STATE_PLACED and "fits no slice type" in refused.reason, refused
