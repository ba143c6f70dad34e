"""The execution clock (issue 15 item 1, placer side) on a real Redis ledger: a placed task starts after its
overheads, completes after runtime_s / time factor and frees its room (a deferred task gets it); simulated
failures; queue timeouts; a placer killed (-9) mid-run and restarted completes every task exactly once at
the time the ledger says it should; a stalled placer that lost its lease writes nothing; the fold is the same
from a snapshot plus the tail as from the whole stream.

No timed assertions: time factors are large, events are waited for with generous deadlines, and the times
compared are the ledger's own (planned, deterministic) ones.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import OrderedDict

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hsched.domain.cluster import ClusterState, Part
from hsched.domain.resources import MILLI, Resources
from hsched.domain.task import TaskSpec, task_to_dict
from hsched.engine.executor import Overheads, SimulatedExecutor, Span
from hsched.engine.placer import PlacerEngine, _Op
from hsched.policies.heuristics import make_policy
from hsched.stack import Stack, StackConfig
from hsched.state.follow import LedgerFollower, stream_id_tuple
from hsched.state.keys import Keys
from hsched.state.ledger import Ledger, fold_event, load_snapshot, replay, snapshot_and_trim, snapshot_of
from hsched.state.redis import connect_sync
from hsched.v1 import common_pb2 as pb
from hsched.v1 import gateway_pb2, gateway_pb2_grpc, placer_pb2, placer_pb2_grpc
from tests.conftest import SMALL_FLEET
from tests.test_engine import cheap, ledger_events, running
from tests.test_leases import PlacerProcess, wait_for

GIB = 1024
TF = 60.0  # a task minute per wall second


@pytest.fixture
def placers(redis_url, prefix, tmp_path):
    """Start placer processes for the small fleet's "cheap" (lease 1 s); stopped at the end."""
    started: list[PlacerProcess] = []

    def start(name: str, *extra: str) -> PlacerProcess:
        started.append(PlacerProcess(redis_url, prefix, tmp_path, name, *extra))
        return started[-1]

    yield start
    for p in started:
        p.stop()


def executor(tf: float = TF, start_s: str = "0", delay_s: str = "0", fail: float = 0.0) -> SimulatedExecutor:
    return SimulatedExecutor(tf, Overheads(Span.parse(delay_s, "d"), Span.parse(start_s, "s")), fail, seed=7)


def engine(redis, prefix: str, ex: SimulatedExecutor | None, owner: str = "p1") -> PlacerEngine:
    return PlacerEngine(cheap(), redis, Keys(prefix), make_policy("firstfit"), owner, executor=ex)


def spec(cores: float, runtime_s: float = 0.0, queue_timeout_s: float = 0.0) -> TaskSpec:
    return TaskSpec(Resources(round(cores * MILLI), 2 * GIB), runtime_s=runtime_s, tenant="team-a",
                    queue_timeout_s=queue_timeout_s)


async def events_of(redis, prefix: str, task: str) -> list[tuple[str, dict]]:
    return [(i, e) for i, e in await ledger_events(redis, prefix) if e["task"] == task]


async def until(condition, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not (value := await condition()):
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}"
        await asyncio.sleep(0.05)
    return value


def kinds(events: list[tuple[str, dict]]) -> list[str]:
    return [e["t"] for _, e in events]


# ------------------------------------------------------------------------------------------------------------
# in-process engine on a real Redis


async def test_a_task_runs_for_its_runtime_then_frees_its_room_for_the_queue(redis, prefix) -> None:
    ex = executor(start_s="6", delay_s="3")  # 9 task seconds = 150 ms before it runs
    async with running(engine(redis, prefix, ex)) as e:
        for i in range(3):  # runtime 0: runs until released
            assert (await e.place(f"f{i}", spec(24))).outcome == "placed"
        short, queued = await asyncio.gather(e.place("short", spec(24, runtime_s=120)), e.place("q", spec(8)))
        assert (short.outcome, queued.outcome) == ("placed", "deferred")
        await until(lambda: _has(redis, prefix, "q", "alloc"), "q placed from the queue")
        ledger = await ledger_events(redis, prefix)
        (_, alloc), (_, run), (done_id, done) = await events_of(redis, prefix, "short")
        assert (alloc["t"], alloc["runtime_s"], alloc["class"], alloc["tenant"]) == ("alloc", 120, "offline", "team-a")
        assert run == {"t": "run", "task": "short", "at": alloc["at"] + 150}
        assert done == {"t": "done", "task": "short", "ok": True, "at": run["at"] + 2000, "reason": ""}
        q_alloc = next((i, ev) for i, ev in ledger if ev["task"] == "q" and ev["t"] == "alloc")
        assert stream_id_tuple(q_alloc[0]) > stream_id_tuple(done_id)
        assert q_alloc[1]["parts"][0][2] == alloc["parts"][0][2] == 3  # short's node, given away on completion
        assert "short" not in e.state.allocations and "q" in e.state.allocations and not e.queue
        # the long-running tasks never complete; q (runtime 0) started and runs on
        assert kinds(await events_of(redis, prefix, "f0")) == ["alloc", "run"]
        await until(lambda: _has(redis, prefix, "q", "run"), "q started")
        # a follower of the ledger (the thermal service's) holds exactly the engine's state
        follower = LedgerFollower(redis, Keys(prefix).ledger("cheap"), cheap())
        await follower.load()
        assert follower.last_id == e.last_id
        assert all(np.array_equal(a, b) for a, b in zip(follower.state.snapshot(), e.state.snapshot(), strict=True))
        assert follower.state.clocks == e.state.clocks and follower.state.allocations == e.state.allocations
        # releasing a finished task changes nothing; releasing a running one frees it
        assert not (await e.release("short")).released
        assert (await e.release("q")).released and "q" not in e.state.clocks


async def _has(redis, prefix: str, task: str, kind: str) -> bool:
    return kind in kinds(await events_of(redis, prefix, task))


async def test_a_release_stops_the_clock(redis, prefix) -> None:
    async with running(engine(redis, prefix, executor(tf=10))) as e:  # 2 wall seconds of runtime
        await e.place("t", spec(4, runtime_s=20))
        await until(lambda: _has(redis, prefix, "t", "run"), "t runs")
        assert (await e.release("t")).released
        other = await e.place("u", spec(4, runtime_s=30))  # completes after the time t would have
        await until(lambda: _has(redis, prefix, "u", "done"), "u done")
        assert kinds(await events_of(redis, prefix, "t")) == ["alloc", "run", "free"]
        assert other.outcome == "placed"


async def test_a_failure_is_recorded_and_frees_the_room(redis, prefix) -> None:
    async with running(engine(redis, prefix, executor(fail=1.0))) as e:
        await e.place("doomed", spec(24, runtime_s=60))
        await until(lambda: _has(redis, prefix, "doomed", "done"), "doomed done")
        (_, _alloc), (_, run), (_, done) = await events_of(redis, prefix, "doomed")
        assert done["ok"] is False and "simulated failure" in done["reason"]
        assert run["at"] <= done["at"] <= run["at"] + 1000  # partway through its runtime
        assert "doomed" not in e.state.allocations and e.state.free_cpu[0] == 24_000


async def test_a_deferred_task_expires_after_its_queue_timeout(redis, prefix) -> None:
    async with running(engine(redis, prefix, executor())) as e:
        for i in range(4):  # runtime 0: they hold their nodes until released
            assert (await e.place(f"f{i}", spec(24))).outcome == "placed"
        waiting = await e.place("w", spec(8, queue_timeout_s=30), allow_defer=True)
        assert waiting.outcome == "deferred"
        await until(lambda: _has(redis, prefix, "w", "expire"), "w expired", timeout_s=60)
        (_, defer), (_, expire) = await events_of(redis, prefix, "w")
        assert expire == {"t": "expire", "task": "w", "at": defer["at"] + 500}
        assert "w" not in e.queue and "w" not in e.state.queued_ms
        freed = await e.release("f0")
        assert freed.placed_from_queue == [] and "w" not in e.state.allocations  # w had expired: nobody waits


async def test_a_task_that_ran_to_completion_is_not_run_again_and_one_released_may_be_placed_again(
        redis, prefix) -> None:
    """A Place of a task id whose done the ledger holds is answered with how it ended (a gateway that never
    recorded the first Place sends it again), here, in a placer that folds the ledger afresh and in one that
    folds a snapshot of it; a task released before it ended may be placed again (the re-submit after a
    gateway's reconcile released it)."""
    async with running(engine(redis, prefix, executor(tf=10))) as e:
        assert (await e.place("ok", spec(4, runtime_s=5))).outcome == "placed"
        assert (await e.place("freed", spec(4, runtime_s=3600))).outcome == "placed"
        await until(lambda: _has(redis, prefix, "ok", "done"), "ok finishes")
        await e.release("freed")
        again = await e.place("ok", spec(4, runtime_s=5))
        assert (again.outcome, again.finished["ok"]) == ("finished", True) and "ok" not in e.state.allocations
        assert again.finished["at"] == [ev for _, ev in await events_of(redis, prefix, "ok")][-1]["at"]
        assert (await e.place("freed", spec(4, runtime_s=3600))).outcome == "placed"
    later = engine(redis, prefix, executor(tf=10), owner="p2")  # a new holder folds the ledger
    async with running(later) as e2:
        assert (await e2.place("ok", spec(4))).outcome == "finished"
        assert kinds(await events_of(redis, prefix, "ok")) == ["alloc", "run", "done"]
        await snapshot_and_trim(e2.ledger, e2.state, e2.queue, e2.last_id, margin_s=0, now_s=time.time() + 60)
    assert "ok" not in {e["task"] for _, e in await ledger_events(redis, prefix)}  # trimmed: only the snapshot
    async with running(engine(redis, prefix, executor(tf=10), owner="p3")) as e3:  # folds the snapshot
        assert (await e3.place("ok", spec(4))).outcome == "finished"


async def test_a_completion_whose_append_had_an_unknown_outcome_is_not_written_twice(redis, prefix) -> None:
    """The done (with the queued task it gives the room to) lands on the master but WAIT finds no replica
    (AppendNotReplicated: outcome unknown to the placer, which cancels the queued task's alloc). Before its
    retry the placer folds the ledger afresh: the done is there, so it writes no other, and the queued task,
    put back in the queue by the cancellation, gets the room."""
    async with running(engine(redis, prefix, executor(tf=10))) as e:
        for i in range(3):
            await e.place(f"f{i}", spec(24))
        await e.place("t", spec(24, runtime_s=10))  # 1 wall second
        assert (await e.place("q", spec(8))).outcome == "deferred"
        await until(lambda: _has(redis, prefix, "t", "run"), "t runs")
        e.ledger.min_replicas, e.ledger.wait_timeout_ms = 1, 50  # this Redis has no replica: never acknowledged
        await until(lambda: _has(redis, prefix, "t", "done"), "t's done lands on the master")
        await until(lambda: _in_doubt(e), "the placer learns the outcome is unknown")
        e.ledger.min_replicas = 0
        await until(lambda: _holds(e, "q"), "q placed after the refold", timeout_s=30)
        await e.place("later", spec(1))  # a later write: anything the retries would add comes before it
        assert kinds(await events_of(redis, prefix, "t")) == ["alloc", "run", "done"]
        q_allocs = [ev for _, ev in await events_of(redis, prefix, "q") if ev["t"] == "alloc"]
        assert len(q_allocs) == 2  # the one in doubt (cancelled) and the one after the refold
        state, queue = ClusterState(cheap()), OrderedDict()
        await replay(redis, Keys(prefix).ledger("cheap"), state, queue)
        assert_same_fold((state, queue), (e.state, e.queue))


async def _in_doubt(e: PlacerEngine) -> bool:
    return bool(e.ledger.pending_undo) or e._refold_due


async def _holds(e: PlacerEngine, task: str) -> bool:
    return task in e.state.allocations


async def test_a_new_holder_resumes_the_clocks_from_a_snapshot(redis, prefix) -> None:
    """A placer that takes over folds the snapshot (the stream below it trimmed) and completes the running task
    at the time the first placer would have, once."""
    first = engine(redis, prefix, executor(tf=10), owner="p1")
    async with running(first) as e:
        await e.place("t", spec(4, runtime_s=30))  # 3 wall seconds
        await e.place("other", spec(4, runtime_s=0))
        await until(lambda: _has(redis, prefix, "t", "run"), "t runs")
        await until(lambda: _has(redis, prefix, "other", "run"), "other runs")
        started = e.state.clocks["t"].started_ms
        async with e._writing:  # between batches, as the engine's own retention does
            await snapshot_and_trim(e.ledger, e.state, e.queue, e.last_id, margin_s=0)
        assert "alloc" not in kinds(await events_of(redis, prefix, "t"))  # only the snapshot has t's clock now
        e.executor.stop_all()  # hand over mid-run: the next holder must finish t
    second = engine(redis, prefix, executor(tf=10), owner="p2")
    async with running(second, wait_s=30) as e2:
        assert e2.state.clocks["t"].started_ms > 0
        await until(lambda: _has(redis, prefix, "t", "done"), "t done under the new holder")
        done = [ev for _, ev in await events_of(redis, prefix, "t") if ev["t"] == "done"]
        assert len(done) == 1 and done[0]["at"] == started + 3000


# ------------------------------------------------------------------------------------------------------------
# real placer processes: kill -9 and restart, a stall past the lease


def place(target: str, task_id: str, runtime_s: float, cores: int = 2) -> placer_pb2.PlaceResponse:
    spec = pb.TaskSpec(resources=pb.Resources(cpu_milli=cores * 1000, memory_mib=1024), runtime_s=runtime_s)
    with grpc.insecure_channel(target) as ch:
        return placer_pb2_grpc.PlacerStub(ch).Place(placer_pb2.PlaceRequest(task_id=task_id, task=spec), timeout=10)


def ledger(redis_url: str, prefix: str) -> list[tuple[str, dict]]:
    return [(i.decode(), json.loads(f[b"e"])) for i, f in connect_sync(redis_url).xrange(Keys(prefix).ledger("cheap"))]


def of(entries: list[tuple[str, dict]], task: str, kind: str) -> list[tuple[str, dict]]:
    return [(i, e) for i, e in entries if e["task"] == task and e["t"] == kind]


def ms(entry_id: str) -> int:
    return int(entry_id.partition("-")[0])


RUNTIMES = (("quick", 10), ("due", 200), ("long", 400))  # task seconds; / 20 in wall time
CLOCK = ("--time-factor", "20", "--container-start-s", "0", "--scheduling-delay-s", "0")


def test_a_placer_killed_mid_run_completes_every_task_once_at_its_time(placers, redis_url, prefix) -> None:
    p1 = placers("p1", *CLOCK)
    target = p1.wait_listening()
    # wall runtimes: quick 0.5 s (done before the kill), due 10 s (due while the placer is down), long 20 s
    for task, runtime in RUNTIMES:
        assert place(target, task, runtime).outcome == placer_pb2.PLACE_OUTCOME_PLACED
    wait_for(lambda: of(ledger(redis_url, prefix), "quick", "done"), "quick done before the kill")
    wait_for(lambda: all(of(ledger(redis_url, prefix), t, "run") for t in ("due", "long")), "both run")
    p1.kill()
    killed_ms = int(time.time() * 1000)
    due_at = of(ledger(redis_url, prefix), "due", "run")[0][1]["at"] + 10_000
    assert killed_ms < due_at, "the machine was too slow to kill the placer before 'due' finished"
    wait_for(lambda: time.time() * 1000 > due_at + 500, "'due' passes its completion time while down")
    assert not of(ledger(redis_url, prefix), "due", "done")  # nobody wrote it: the placer is dead
    p2 = placers("p2", *CLOCK)
    p2.wait_listening()
    wait_for(lambda: of(ledger(redis_url, prefix), "due", "done"), "'due' completes right after the restart")
    wait_for(lambda: of(ledger(redis_url, prefix), "long", "done"), "'long' completes", timeout_s=120)
    entries = ledger(redis_url, prefix)
    for task, runtime in RUNTIMES:
        runs, dones = of(entries, task, "run"), of(entries, task, "done")
        assert len(runs) == 1 and len(dones) == 1, f"{task}: {runs} {dones}"
        assert dones[0][1]["at"] == runs[0][1]["at"] + runtime * 1000 // 20 and dones[0][1]["ok"]
    restarted_ms = ms(of(entries, "due", "done")[0][0])
    assert restarted_ms > due_at  # written late, recorded at the time it completed
    assert ms(of(entries, "long", "done")[0][0]) >= of(entries, "long", "done")[0][1]["at"]  # not early


def test_a_stalled_placer_never_writes_a_completion_after_losing_its_lease(placers, redis_url, prefix) -> None:
    p1 = placers("p1", *CLOCK)
    target = p1.wait_listening()
    standby = placers("p2", *CLOCK)
    standby.wait_listening()
    assert place(target, "t", 40).outcome == placer_pb2.PLACE_OUTCOME_PLACED  # 2 wall seconds
    wait_for(lambda: of(ledger(redis_url, prefix), "t", "run"), "t runs")
    done_at = of(ledger(redis_url, prefix), "t", "run")[0][1]["at"] + 2000
    os.killpg(p1.proc.pid, signal.SIGSTOP)  # its completion timer is due while it is stopped
    try:
        wait_for(lambda: of(ledger(redis_url, prefix), "t", "done"), "the standby takes over and completes t")
        wait_for(lambda: time.time() * 1000 > done_at + 1000, "p1's own timer is overdue")
    finally:
        os.killpg(p1.proc.pid, signal.SIGCONT)
    wait_for(lambda: "lost its lease" in p1.output() or "fenced out" in p1.output(), "p1 learns it lost the lease")
    time.sleep(1.0)  # p1's overdue report has reached its batch loop by now (it runs right after SIGCONT)
    place_after = place(standby.target, "after", 1)  # a write through the holder orders after p1's attempt
    assert place_after.outcome == placer_pb2.PLACE_OUTCOME_PLACED
    dones = of(ledger(redis_url, prefix), "t", "done")
    assert len(dones) == 1 and dones[0][1]["at"] == done_at


# ------------------------------------------------------------------------------------------------------------
# the fold: snapshot + tail == the whole stream


TASKS = [f"t{i}" for i in range(6)]


@st.composite
def histories(draw) -> list[dict]:
    """Random ledger histories a placer could write (allocs that fit, lifecycle events in any order a
    placer may emit them, and strays the fold must ignore: a done for a task not held, a run twice)."""
    events, held, queued, clock = [], {}, [], 1_000
    for _ in range(draw(st.integers(0, 40))):
        task = draw(st.sampled_from(TASKS))
        clock += draw(st.integers(0, 5000))
        kind = draw(st.sampled_from(["alloc", "run", "done", "free", "preempt", "defer", "drop", "expire"]))
        if kind == "alloc":
            if task in held:
                continue
            cores = draw(st.integers(1, 6))
            node = draw(st.integers(0, 3))
            if sum(c for n, c in held.values() if n == node) + cores > 24:
                continue
            held[task] = (node, cores)
            event = {"t": "alloc", "task": task, "parts": [Part(0, 0, node, cores * 1000, 512, 0, 0).to_json()]}
            if draw(st.booleans()):  # written with the execution clock (else: an old ledger's alloc)
                event.update(at=clock, runtime_s=draw(st.sampled_from([0, 30, 3600])),
                             **{"class": draw(st.sampled_from(["online", "offline"]))}, tenant="t")
                if draw(st.booleans()):
                    event["delay_s"] = 7.5
            if task in queued:
                queued.remove(task)
        elif kind in ("done", "free", "preempt"):
            held.pop(task, None)
            event = {"t": kind, "task": task}
            if kind == "done":
                event.update(ok=draw(st.booleans()), at=clock, reason="")
            elif kind == "preempt":
                event.update(by="x", at=clock)
        elif kind == "run":
            event = {"t": "run", "task": task, "at": clock}
        elif kind == "defer":
            if task in held:
                continue
            queued.append(task)
            spec = TaskSpec(Resources(1000, 512), runtime_s=60, queue_timeout_s=draw(st.sampled_from([0, 5])))
            event = {"t": "defer", "task": task, "spec": task_to_dict(spec)}
            if draw(st.booleans()):
                event["at"] = clock
        else:
            if task in queued:
                queued.remove(task)
            event = {"t": kind, "task": task, **({"at": clock} if kind == "expire" else {})}
        events.append(event)
    return events


def folded(events: list[dict], state: ClusterState | None = None, queue: OrderedDict | None = None):
    state = state if state is not None else ClusterState(cheap())
    queue = queue if queue is not None else OrderedDict()
    for e in events:
        fold_event(json.loads(json.dumps(e)), state, queue)  # as read back from the stream
    return state, queue


def assert_same_fold(a: tuple[ClusterState, OrderedDict], b: tuple[ClusterState, OrderedDict]) -> None:
    (sa, qa), (sb, qb) = a, b
    assert all(np.array_equal(x, y) for x, y in zip(sa.snapshot(), sb.snapshot(), strict=True))
    assert sa.allocations == sb.allocations and sa.clocks == sb.clocks and sa.queued_ms == sb.queued_ms
    assert list(qa.items()) == list(qb.items())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history=histories(), data=st.data())
def test_the_fold_from_a_snapshot_and_the_tail_is_the_fold_of_the_whole_stream(history, data) -> None:
    cut = data.draw(st.integers(0, len(history)))
    whole = folded(history)
    state, queue = ClusterState(cheap()), OrderedDict()
    load_snapshot(snapshot_of(*folded(history[:cut])), state, queue)
    assert_same_fold(folded(history[cut:], state, queue), whole)


async def test_replay_after_a_snapshot_and_trim_equals_the_full_fold(redis, prefix) -> None:
    """Through Redis: the snapshot script and `replay` (which reads the snapshot) agree with folding every
    event, running clocks and queue times included."""
    history = [{"t": "alloc", "task": "a", "parts": [Part(0, 0, 1, 4000, 512, 0, 0).to_json()], "at": 10,
                "runtime_s": 30, "class": "online", "tenant": "x"},
               {"t": "run", "task": "a", "at": 20},
               {"t": "defer", "task": "q", "spec": task_to_dict(spec(2, 60, queue_timeout_s=9)), "at": 30},
               {"t": "alloc", "task": "b", "parts": [Part(0, 0, 2, 4000, 512, 0, 0).to_json()], "at": 40,
                "runtime_s": 60, "class": "offline", "tenant": "y"},
               {"t": "done", "task": "b", "ok": True, "at": 50, "reason": ""}]
    w = Ledger(redis, Keys(prefix), "cheap", "me")
    await w.acquire()
    last = await w.append(history[:3])
    state, queue = folded(history[:3])
    await snapshot_and_trim(w, state, queue, last, margin_s=0)
    await w.append(history[3:])
    got_state, got_queue = ClusterState(cheap()), OrderedDict()
    await replay(redis, w.stream, got_state, got_queue)
    assert_same_fold((got_state, got_queue), folded(history))
    assert got_state.clocks["a"].started_ms == 20 and got_state.queued_ms == {"q": 30}


@pytest.mark.parametrize("text,span", [("2", Span(2, 2)), ("1-10", Span(1, 10)), ("0.4-1.0", Span(0.4, 1.0))])
def test_overhead_spans_parse(text, span) -> None:
    assert Span.parse(text, "f") == span


@pytest.mark.parametrize("text", ["-1", "5-1", "x", "1-", "nan", "inf"])
def test_bad_overhead_spans_name_the_field(text) -> None:
    with pytest.raises(ValueError, match="--container-start-s"):
        Span.parse(text, "--container-start-s")


def test_the_simulated_plan_is_the_same_in_every_process() -> None:
    """Overheads and failures are drawn per placement from a seeded generator: a take-over computes the same
    start and end."""
    from hsched.domain.cluster import TaskClock
    a = SimulatedExecutor(30, Overheads(), 0.5, seed=3)
    b = SimulatedExecutor(30, Overheads(), 0.5, seed=3)
    clocks = [TaskClock(1_000_000 + i, 600.0) for i in range(50)]
    plans = [a.plan(f"t{i}", c) for i, c in enumerate(clocks)]
    assert plans == [b.plan(f"t{i}", c) for i, c in enumerate(clocks)]
    for c, p in zip(clocks, plans, strict=True):  # paper 001: 1.4-11 task seconds before it runs
        assert c.placed_ms + 1400 / 30 - 1 <= p.start_ms <= c.placed_ms + 11_000 / 30 + 1
        assert p.end_ms is not None and p.start_ms <= p.end_ms <= p.start_ms + 20_000
    assert 0 < sum(not p.ok for p in plans) < 50
    assert len({p.start_ms - c.placed_ms for c, p in zip(clocks, plans, strict=True)}) > 1  # drawn, not fixed


# ------------------------------------------------------------------------------------------------------------
# the stack: `hsched up --time-factor F`


def test_the_stack_runs_a_submitted_task_for_its_runtime_and_returns_its_room(redis_url, prefix) -> None:
    config = StackConfig(fleet_path=SMALL_FLEET, redis_url=redis_url, prefix=prefix, gateway_port=0,
                         thermal=False, metrics=False, time_factor=600)  # a task minute = 0.1 s
    with Stack(config) as stack, grpc.insecure_channel(stack.gateway) as ch:
        spec = pb.TaskSpec(resources=pb.Resources(cpu_milli=2000, memory_mib=1024), runtime_s=60)
        task = gateway_pb2_grpc.GatewayStub(ch).Submit(gateway_pb2.SubmitRequest(task=spec), timeout=30).task
        assert task.state == pb.TASK_STATE_PLACED
        stream = Keys(prefix).ledger(task.datacenter)
        client = connect_sync(redis_url)

        def events() -> list[dict]:
            return [e for _, f in client.xrange(stream) if (e := json.loads(f[b"e"]))["task"] == task.task_id]

        wait_for(lambda: any(e["t"] == "done" for e in events()), "the task completes")
        alloc, run, done = events()
        assert [alloc["t"], run["t"], done["t"]] == ["alloc", "run", "done"] and done["ok"]
        assert done["at"] - run["at"] == 100  # 60 task seconds at 600x
        assert 1400 / 600 - 1 <= run["at"] - alloc["at"] <= 11_000 / 600 + 1  # paper 001's default overheads
        with grpc.insecure_channel(stack.placer_target(task.datacenter)) as pch:
            state = placer_pb2_grpc.PlacerStub(pch).GetState(placer_pb2.PlacerStateRequest(), timeout=10)
        assert state.summary.running_tasks == 0 and state.summary.free.cpu_milli == state.summary.capacity.cpu_milli


async def test_a_preempting_placement_records_its_overhead_and_starts_after_it(redis, prefix) -> None:
    """The hook the preemption path uses: the alloc carries the drawn overhead (delay_s), and the start waits
    for it on top of the other overheads — the same after a restart, since the ledger holds it."""
    ex = SimulatedExecutor(TF, Overheads(Span(0, 0), Span(0, 0), Span(12, 12)), seed=1)  # 12 s = 200 ms
    async with running(engine(redis, prefix, ex)) as e:
        op = _Op("place", "online", spec(2, runtime_s=60))
        e._alloc(op, "online", op.spec, (Part(0, 0, 0, 2000, 512, 0, 0),), None, preempting=True)
        events = [{k: v for k, v in ev.items() if not k.startswith("_")} for ev in op.events]
        e.last_id = await e.ledger.append(events)
        e._follow_events(events)
        await until(lambda: _has(redis, prefix, "online", "run"), "online runs")
        (_, alloc), (_, run) = await events_of(redis, prefix, "online")
        assert alloc["delay_s"] == 12 and run["at"] == alloc["at"] + 200
        assert e.state.clocks["online"].delay_s == 12
