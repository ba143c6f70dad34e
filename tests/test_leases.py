"""Leases that heal, through real placer processes on a real Redis: a placer that loses its lease (paused,
Redis stalled, lease stolen) stops serving (health NOT_SERVING, Place UNAVAILABLE), folds the ledger afresh
and takes the lease back with a higher fencing token; a second placer for a held DC waits as a standby and
takes over when the holder dies; one that cannot take its lease back exits with one line. The selector keeps
only the summaries of a DC's current placer."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections import OrderedDict
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hsched.costs import WanGraph
from hsched.domain.cluster import ClusterState, Part
from hsched.domain.fleet import load_fleet
from hsched.domain.resources import Resources
from hsched.domain.task import TaskSpec
from hsched.engine.placer import PlacerEngine, PlaceResult
from hsched.engine.selector import DcSelector
from hsched.policies.heuristics import FirstFit
from hsched.stack import Stack, StackConfig
from hsched.state.keys import Keys
from hsched.state.ledger import Ledger, replay
from hsched.state.lifecycle import ON_NODES
from hsched.state.redis import connect, connect_sync, free_port
from hsched.v1 import common_pb2 as pb
from hsched.v1 import gateway_pb2, gateway_pb2_grpc, placer_pb2, placer_pb2_grpc
from tests.conftest import SMALL_FLEET, delete_prefix

PLACER = "hsched.v1.Placer"
LEASE_MS = 1000


def wait_for(condition, what: str, timeout_s: float = 60.0, every_s: float = 0.1):
    """Poll until `condition()` is truthy (returns it); generous deadlines, the machine is shared."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}"
        time.sleep(every_s)


def health(target: str, service: str = "") -> int | None:
    try:
        with grpc.insecure_channel(target) as ch:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                        timeout=2).status
    except grpc.RpcError:
        return None


def both_health(target: str) -> tuple[int | None, int | None]:
    return health(target), health(target, PLACER)


SERVING = (health_pb2.HealthCheckResponse.SERVING,) * 2
NOT_SERVING = (health_pb2.HealthCheckResponse.NOT_SERVING,) * 2


def task(cores: float = 2, mem_gib: float = 2) -> pb.TaskSpec:
    return pb.TaskSpec(resources=pb.Resources(cpu_milli=int(cores * 1000), memory_mib=int(mem_gib * 1024)),
                       runtime_s=3600)


def place(target: str, task_id: str, cores: float = 2) -> placer_pb2.PlaceResponse:
    with grpc.insecure_channel(target) as ch:
        return placer_pb2_grpc.PlacerStub(ch).Place(placer_pb2.PlaceRequest(task_id=task_id, task=task(cores)),
                                                    timeout=10)


def place_error(target: str, task_id: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        place(target, task_id)
    return err.value


def state_of(target: str) -> placer_pb2.PlacerState:
    with grpc.insecure_channel(target) as ch:
        return placer_pb2_grpc.PlacerStub(ch).GetState(placer_pb2.PlacerStateRequest(include_nodes=True), timeout=10)


def metric(port: int, name: str, dc: str) -> float | None:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return None
    found = re.search(rf'^{name}{{datacenter="{dc}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else None


def fold(redis_url: str, prefix: str, dc_name: str) -> ClusterState:
    """The DC's ledger folded from scratch (ClusterState.apply refuses any over-allocation)."""
    return fold_with_queue(redis_url, prefix, dc_name)[0]


def fold_with_queue(redis_url: str, prefix: str, dc_name: str) -> tuple[ClusterState, OrderedDict]:
    """The DC's ledger folded from scratch: its state and its deferred queue."""
    dc = load_fleet(SMALL_FLEET).datacenter(dc_name)

    async def go() -> tuple[ClusterState, OrderedDict]:
        client = connect(redis_url)
        try:
            state, queue = ClusterState(dc), OrderedDict()
            await replay(client, Keys(prefix).ledger(dc_name), state, queue)
            return state, queue
        finally:
            await client.aclose()

    return asyncio.run(go())


class PlacerProcess:
    """`python -m services.placer` for one DC of the small fleet, without thermal guard."""

    def __init__(self, redis_url: str, prefix: str, run_dir: Path, name: str, *extra: str, dc: str = "cheap") -> None:
        self.dc = dc
        self.port_file = run_dir / f"{name}.port"
        self.log = run_dir / f"{name}.log"
        self.metrics_port = free_port()
        args = ["--fleet", SMALL_FLEET, "--redis-url", redis_url, "--prefix", prefix, "--datacenter", dc,
                "--listen", "127.0.0.1:0", "--port-file", str(self.port_file), "--lease-ms", str(LEASE_MS),
                "--metrics-port", str(self.metrics_port), "--log-level", "INFO", *extra]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "services.placer", *args], stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})

    @property
    def owner(self) -> str:
        """How its lease owner starts (a random suffix follows: services/placer/server.py lease_owner)."""
        return f"{os.uname().nodename}:{self.proc.pid}-"

    def wait_listening(self, timeout_s: float = 60.0) -> str:
        def ready():
            assert self.proc.poll() is None, f"placer exited {self.proc.returncode}: {self.output()[-2000:]}"
            return self.port_file.exists() and health(self.target) is not None

        wait_for(ready, f"{self.log.name} listening", timeout_s)
        return self.target

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port_file.read_text().strip()}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def placers(redis_url, prefix, tmp_path):
    started: list[PlacerProcess] = []

    def start(name: str, *extra: str) -> PlacerProcess:
        p = PlacerProcess(redis_url, prefix, tmp_path, name, *extra)
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


class Thief:
    """Another writer for the DC: deletes the placer's lease, takes it with a new token, and renews it until
    told to stop (then its lease lapses)."""

    def __init__(self, redis_url: str, prefix: str, dc: str = "cheap") -> None:
        self.url = redis_url
        self.redis = connect_sync(redis_url)
        self.keys = Keys(prefix)
        self.dc = dc
        self.token = 0

    def steal(self, lease_ms: int = 2000) -> int:
        lease, fence = self.keys.lease(self.dc), self.keys.fence(self.dc)
        self.redis.delete(lease)
        assert self.redis.set(lease, "thief", nx=True, px=lease_ms)
        self.token = self.redis.incr(fence)
        self.lease_ms = lease_ms
        return self.token

    def renew(self) -> None:
        assert self.redis.pexpire(self.keys.lease(self.dc), self.lease_ms)

    def append(self, event: dict) -> None:
        """Write to the ledger as the fenced writer the thief now is (the real fenced append)."""

        async def go() -> None:
            client = connect(self.url)
            try:
                ledger = Ledger(client, self.keys, self.dc, "thief")
                ledger.token = self.token
                await ledger.append([event])
            finally:
                await client.aclose()

        asyncio.run(go())


# ------------------------------------------------------------------------------------------------------------
# a single placer process: lease stolen, fenced-exit, --no-standby


def test_a_fenced_placer_reports_not_serving_and_takes_its_lease_back(placers, redis_url, prefix):
    a = placers("a")
    target = a.wait_listening()
    wait_for(lambda: both_health(target) == SERVING, "a serves")
    assert place(target, "t1").outcome == placer_pb2.PLACE_OUTCOME_PLACED
    token = state_of(target).summary.fencing_token
    wait_for(lambda: metric(a.metrics_port, "hsched_placer_lease_held", "cheap") == 1.0, "lease gauge 1")
    assert metric(a.metrics_port, "hsched_placer_fencing_token", "cheap") == token

    thief = Thief(redis_url, prefix)
    stolen = thief.steal()
    # the placer notices at its next renewal (not its next write): NOT_SERVING, refuses calls, gauge 0
    wait_for(lambda: (thief.renew() or True) and both_health(target) == NOT_SERVING, "a reports NOT_SERVING")
    err = place_error(target, "t2")
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert "standby for cheap, holder is thief" in err.details(), err.details()
    with pytest.raises(grpc.RpcError) as not_now:
        state_of(target)
    assert not_now.value.code() == grpc.StatusCode.UNAVAILABLE
    assert metric(a.metrics_port, "hsched_placer_lease_held", "cheap") == 0.0
    summaries = connect_sync(redis_url)
    published = summaries.xlen(Keys(prefix).summary("cheap"))
    time.sleep(1.5)  # what a fenced placer publishes meanwhile: nothing
    thief.renew()
    assert summaries.xlen(Keys(prefix).summary("cheap")) == published
    # the thief writes to the ledger with its token, then goes away: its lease lapses and a takes it back
    thief.append({"t": "alloc", "task": "by-thief", "parts": [Part(0, 0, 3, 4000, 1024, 0, 0).to_json()]})
    wait_for(lambda: both_health(target) == SERVING, "a serves again after the thief's lease lapsed")
    after = state_of(target)
    assert after.summary.fencing_token > stolen > token
    ledger = fold(redis_url, prefix, "cheap")
    assert set(ledger.allocations) == {"t1", "by-thief"}  # a re-folded what the thief wrote meanwhile
    assert after.summary.running_tasks == 2
    assert [n.free.cpu_milli for n in after.nodes] == ledger.free_cpu.tolist()
    assert place(target, "t2").outcome == placer_pb2.PLACE_OUTCOME_PLACED
    assert metric(a.metrics_port, "hsched_placer_lease_held", "cheap") == 1.0
    assert metric(a.metrics_port, "hsched_placer_fencing_token", "cheap") == after.summary.fencing_token
    wait_for(lambda: summaries.xlen(Keys(prefix).summary("cheap")) > published, "summaries resume")
    latest = json.loads(summaries.xrevrange(Keys(prefix).summary("cheap"), count=1)[0][1][b"s"])
    assert latest["fencing_token"] == after.summary.fencing_token
    assert "Traceback" not in a.output()


def test_a_placer_that_cannot_take_its_lease_back_exits_with_one_line(placers, redis_url, prefix):
    a = placers("a", "--fenced-exit-s", "2")
    target = a.wait_listening()
    wait_for(lambda: both_health(target) == SERVING, "a serves")
    thief = Thief(redis_url, prefix)
    thief.steal()
    wait_for(lambda: (thief.renew() or True) and a.proc.poll() is not None, "a exits", timeout_s=60)
    assert a.proc.returncode != 0
    out = a.output()
    assert "Traceback" not in out, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith("placer cheap: could not take its lease back for 2 s"), last
    assert "holder is thief" in last


def test_a_second_placer_with_no_standby_exits_with_one_line(placers):
    a = placers("a")
    wait_for(lambda: both_health(a.wait_listening()) == SERVING, "a serves")
    b = placers("b", "--no-standby")
    assert b.proc.wait(60) != 0
    out = b.output()
    assert "Traceback" not in out, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith("placer cheap: data center cheap is owned by placer"), last
    assert a.owner in last and "--no-standby" in last


# ------------------------------------------------------------------------------------------------------------
# standby


def test_a_standby_placer_takes_over_with_the_holders_allocations(placers, redis_url, prefix):
    a = placers("a")
    a_target = a.wait_listening()
    wait_for(lambda: both_health(a_target) == SERVING, "a serves")
    for i, cores in enumerate((3, 5, 7)):
        assert place(a_target, f"t{i}", cores).outcome == placer_pb2.PLACE_OUTCOME_PLACED
    before = state_of(a_target)

    b = placers("b")
    b_target = b.wait_listening()
    assert both_health(b_target) == NOT_SERVING
    err = place_error(b_target, "t9")
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert f"standby for cheap, holder is {a.owner}" in err.details(), err.details()
    time.sleep(3 * LEASE_MS / 1000)  # the holder keeps renewing: b stays a standby
    assert both_health(b_target) == NOT_SERVING and both_health(a_target) == SERVING
    assert metric(a.metrics_port, "hsched_placer_lease_held", "cheap") == 1.0
    assert metric(b.metrics_port, "hsched_placer_lease_held", "cheap") == 0.0
    assert metric(b.metrics_port, "hsched_placer_fencing_token", "cheap") == 0.0  # never held

    a.kill()
    wait_for(lambda: both_health(b_target) == SERVING, "b takes over")
    after = state_of(b_target)
    assert after.summary.fencing_token > before.summary.fencing_token
    assert after.summary.running_tasks == 3
    assert [n.free for n in after.nodes] == [n.free for n in before.nodes]
    assert metric(b.metrics_port, "hsched_placer_lease_held", "cheap") == 1.0
    assert metric(b.metrics_port, "hsched_placer_fencing_token", "cheap") == after.summary.fencing_token
    again = place(b_target, "t0", 3)  # a retried Place: the ledger already holds it, nothing is added
    assert again.outcome == placer_pb2.PLACE_OUTCOME_PLACED and again.notes[0].startswith("already placed")
    assert place(b_target, "t9").outcome == placer_pb2.PLACE_OUTCOME_PLACED
    assert set(fold(redis_url, prefix, "cheap").allocations) == {"t0", "t1", "t2", "t9"}
    assert "Traceback" not in b.output()


class SpinningFirstFit(FirstFit):
    """FirstFit that burns `seconds` of CPU per decision, holding the GIL as a Python policy does."""

    name = "spinning-firstfit"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def scores(self, state, demand, mask):
        end = time.perf_counter() + self.seconds
        while time.perf_counter() < end:
            pass
        return super().scores(state, demand, mask)


def test_a_burst_for_a_slow_policy_never_costs_the_placer_its_lease(placers, redis_url, prefix):
    """300 Places at 20 ms of CPU each (one batch of 256 would hold the loop for 5 s, past the loop watchdog of
    1.5 s, and the standby would take the DC over and fence the batch): batches bounded by time keep the lease,
    answer every call once, in order, and allocate nothing twice; 50 Releases then serve the queue in order."""
    dc = load_fleet(SMALL_FLEET).datacenter("cheap")  # 4 nodes × 24 cores × 96 GiB: 192 tasks of 0.5 core, 2 GiB
    n, freed = 300, 50

    def place_spec():
        return TaskSpec(Resources(500, 2048), runtime_s=3600)

    async def burst():
        client = connect(redis_url)
        engine = PlacerEngine(dc, client, Keys(prefix), SpinningFirstFit(0.02), "slow", lease_ms=LEASE_MS,
                              max_loop_stall_s=1.5)
        await engine.start()
        try:
            token = engine.ledger.token
            standby = placers("standby")  # takes the DC over if this placer's lease lapses
            standby_target = await asyncio.to_thread(standby.wait_listening)  # (the loop must keep running)
            assert await asyncio.to_thread(both_health, standby_target) == NOT_SERVING
            placed = await asyncio.gather(*(engine.place(f"t{i}", place_spec()) for i in range(n)),
                                          return_exceptions=True)
            released = await asyncio.gather(*(engine.release(f"t{i}") for i in range(freed)),
                                            return_exceptions=True)
            assert engine.holding and not engine.lost_reason, engine.lost_reason
            assert int(await client.get(Keys(prefix).fence("cheap"))) == token == engine.ledger.token
            assert await asyncio.to_thread(both_health, standby_target) == NOT_SERVING
            return placed, released, standby
        finally:
            await engine.stop()
            await client.aclose()

    placed, released, standby = asyncio.run(burst())
    fits = 192
    outcomes = [r.outcome if isinstance(r, PlaceResult) else repr(r) for r in placed]
    assert outcomes == ["placed"] * fits + ["deferred"] * (n - fits), sorted(set(outcomes))
    assert all(r.released for r in released)
    assert [t for r in released for t, _ in r.placed_from_queue] == [f"t{i}" for i in range(fits, fits + freed)]

    events = [json.loads(f[b"e"]) for _, f in connect_sync(redis_url).xrange(Keys(prefix).ledger("cheap"))]
    allocs = [e["task"] for e in events if e["t"] == "alloc"]
    assert allocs == [f"t{i}" for i in range(fits + freed)]  # each once, in arrival order
    state, queue = fold_with_queue(redis_url, prefix, "cheap")
    assert set(state.allocations) == {f"t{i}" for i in range(freed, fits + freed)}
    assert list(queue) == [f"t{i}" for i in range(fits + freed, n)]
    assert "Traceback" not in standby.output()


def test_a_negative_batch_budget_is_a_usage_error(capsys):
    from services.placer.server import main

    with pytest.raises(SystemExit) as exit_:
        main(["--datacenter", "cheap", "--batch-budget-ms", "-5"])
    assert exit_.value.code == 2
    assert "--batch-budget-ms must be >= 0 (0 = a tenth of --lease-ms), got -5.0" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------------
# the whole stack: a paused placer and a stalled Redis heal without a human


def submit(gw, cores: float = 1) -> pb.Task:
    return gw.Submit(gateway_pb2.SubmitRequest(task=task(cores)), timeout=30).task


def assert_ledgers_agree_with_the_gateway(stack: Stack, gw, prefix: str, placed: list[pb.Task]) -> None:
    """Folded from scratch, no DC is over-allocated (replay refuses it), no task is held in two DCs, and every
    task the gateway says is PLACED is held where it says."""
    held: dict[str, str] = {}
    for dc in stack.fleet.datacenters:
        for task_id in fold(stack.redis_url, prefix, dc.name).allocations:
            assert task_id not in held, f"{task_id} held in {held[task_id]} and {dc.name}"
            held[task_id] = dc.name
    for t in placed:
        now = gw.Get(gateway_pb2.GetRequest(task_id=t.task_id), timeout=10)
        if now.state in ON_NODES:
            assert held.get(t.task_id) == now.datacenter, (t.task_id, now.datacenter, held.get(t.task_id))


def tokens(stack: Stack) -> dict[str, int]:
    return {dc.name: state_of(stack.placer_target(dc.name)).summary.fencing_token for dc in stack.fleet.datacenters}


def serving_again(stack: Stack, old: dict[str, int]) -> dict[str, int] | None:
    try:
        now = tokens(stack)
    except grpc.RpcError:
        return None
    return now if all(now[dc] > old[dc] for dc in now) else None


@pytest.mark.slow
def test_a_paused_placer_takes_its_lease_back_and_places_again(redis_url):
    prefix = f"test-leases-{int(time.time() * 1000)}"
    config = StackConfig(fleet_path=SMALL_FLEET, redis_url=redis_url, prefix=prefix, gateway_port=0, thermal=False,
                         log_level="INFO", extra_env={"HSCHED_LEASE_MS": str(LEASE_MS)})
    try:
        with Stack(config) as stack, grpc.insecure_channel(stack.gateway) as ch:
            gw = gateway_pb2_grpc.GatewayStub(ch)
            placed = [submit(gw, c) for c in (3, 5)]
            assert {t.datacenter for t in placed} == {"cheap"}
            target = stack.placer_target("cheap")
            token = state_of(target).summary.fencing_token
            pid = stack.services["placer-cheap"].proc.pid
            os.kill(pid, signal.SIGSTOP)  # three lease periods without a renewal
            try:
                time.sleep(3 * LEASE_MS / 1000)
            finally:
                os.kill(pid, signal.SIGCONT)
            wait_for(lambda: state_of(target).summary.fencing_token > token if both_health(target) == SERVING else None,
                     "cheap takes its lease back with a higher token")
            t = wait_for(lambda: (s := submit(gw, 2)).datacenter == "cheap" and s, "a Submit placed at cheap")
            assert t.state == pb.TASK_STATE_PLACED
            assert "lost its lease (renewal refused: the lease had lapsed)" in \
                stack.log_dir.joinpath("placer-cheap.log").read_text()
            assert_ledgers_agree_with_the_gateway(stack, gw, prefix, [*placed, t])
    finally:
        delete_prefix(redis_url, prefix)


@pytest.mark.slow
def test_every_placer_comes_back_after_a_redis_stall():
    config = StackConfig(fleet_path=SMALL_FLEET, redis_url=None, gateway_port=0, thermal=False, log_level="INFO",
                         extra_env={"HSCHED_LEASE_MS": str(LEASE_MS)})
    with Stack(config) as stack, grpc.insecure_channel(stack.gateway) as ch:  # its own embedded redis-server
        gw = gateway_pb2_grpc.GatewayStub(ch)
        placed = [submit(gw, c) for c in (3, 5)]
        before = tokens(stack)
        redis_pid = stack.redis.proc.pid
        os.kill(redis_pid, signal.SIGSTOP)
        try:
            time.sleep(5)
            # while it stalls, a Submit fails naming Redis, not only the placers that cannot write their ledgers
            with pytest.raises(grpc.RpcError) as failed:
                gw.Submit(gateway_pb2.SubmitRequest(task=task(2)), timeout=60)
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
            assert "Redis does not answer the gateway either" in failed.value.details(), failed.value.details()
        finally:
            os.kill(redis_pid, signal.SIGCONT)
        wait_for(lambda: serving_again(stack, before), "every placer serves again with a higher token")
        for dc in stack.fleet.datacenters:
            assert both_health(stack.placer_target(dc.name)) == SERVING
        t = wait_for(lambda: (s := submit(gw, 2)).state == pb.TASK_STATE_PLACED and s, "a Submit is placed")
        assert_ledgers_agree_with_the_gateway(stack, gw, "hsched", [*placed, t])


# ------------------------------------------------------------------------------------------------------------
# readers: the selector keeps only the current placer's summaries


def summary(dc: str, token: int, free_cpu: int = 1) -> dict:
    return {"datacenter": dc, "fencing_token": token, "free": [free_cpu, 0, 0, 0, 0, 0, 0]}


@pytest.fixture(scope="module")
def fleet():
    return load_fleet(SMALL_FLEET)


def test_the_selector_ignores_a_summary_from_a_lower_fencing_token(fleet):
    sel = DcSelector(fleet, graph=WanGraph(fleet.wan))
    assert sel.update_summary(summary("cheap", 5, free_cpu=1))
    assert not sel.update_summary(summary("cheap", 4, free_cpu=999))  # a fenced placer's late write
    assert sel.summaries["cheap"]["free"][0] == 1 and sel.superseded == 1
    assert sel.update_summary(summary("cheap", 5, free_cpu=2))  # the same placer again
    assert sel.update_summary(summary("cheap", 7, free_cpu=3))  # a re-acquired lease
    assert sel.update_summary(summary("near", 1))  # per DC
    assert sel.fencing_tokens == {"cheap": 7, "near": 1}


def test_room_now_reads_the_free_totals_and_the_queue_of_the_latest_summary(fleet):
    sel = DcSelector(fleet, graph=WanGraph(fleet.wan))
    gib = 1024
    two_cores = TaskSpec(resources=Resources(cpu_milli=2000, memory_mib=4 * gib), runtime_s=60)
    assert sel.room_now(two_cores, "cheap") == (False, 0)  # nothing heard from its placer yet
    sel.update_summary({"datacenter": "cheap", "fencing_token": 1})
    assert sel.room_now(two_cores, "cheap") == (False, 0)  # a summary that says nothing of its room
    sel.update_summary({"datacenter": "cheap", "fencing_token": 1, "free": [2000, 4 * gib, 0, 0, 0, 0, 0],
                        "deferred_tasks": 0})
    assert sel.room_now(two_cores, "cheap") == (True, 0)  # exactly enough
    three = TaskSpec(resources=Resources(cpu_milli=1000, memory_mib=2 * gib), runtime_s=60, replicas=3)  # 3 cores
    assert sel.room_now(three, "cheap") == (False, 0)
    sel.update_summary({"datacenter": "cheap", "fencing_token": 1, "free": [64000, 64 * gib, 0, 0, 0, 0, 0],
                        "deferred_tasks": 2})
    assert sel.room_now(two_cores, "cheap") == (False, 2)  # room, but others wait ahead
    # 8 cores free in all, but split 1 + 1 + ... over the nodes: no node has a 2-core task's room
    sel.update_summary({"datacenter": "cheap", "fencing_token": 1, "free": [8000, 64 * gib, 0, 0, 0, 0, 0],
                        "largest_free": [1000, 16 * gib, 0], "deferred_tasks": 0})
    assert sel.room_now(two_cores, "cheap") == (False, 0)
    assert sel.room_now(TaskSpec(resources=Resources(cpu_milli=1000, memory_mib=gib), runtime_s=60), "cheap") == \
        (True, 0)
    sel.update_summary({"datacenter": "gpu", "fencing_token": 1, "free": [64000, 64 * gib, 0, 0, 1, 0, 0],
                        "deferred_tasks": 0})

    def gpus(n: int, pct: int) -> TaskSpec:
        return TaskSpec(resources=Resources(cpu_milli=1000, memory_mib=gib, gpu_count=n, gpu_core_percent=pct,
                                            gpu_memory_mib=gib), runtime_s=60)
    assert sel.room_now(gpus(1, 100), "gpu") == (True, 0) and sel.room_now(gpus(2, 100), "gpu") == (False, 0)
    assert sel.room_now(gpus(2, 50), "gpu") == (True, 0)  # a shared card need not be idle: not judged here


def test_a_lower_token_is_taken_once_the_higher_ones_placer_has_gone_silent(fleet):
    sel = DcSelector(fleet, graph=WanGraph(fleet.wan), stale_after_s=0.2)
    sel.update_summary(summary("cheap", 9))
    assert not sel.update_summary(summary("cheap", 1))
    time.sleep(0.3)  # the token-9 placer is gone and the fence counter started again (Redis lost its data)
    assert sel.update_summary(summary("cheap", 1)) and sel.fencing_tokens["cheap"] == 1


def test_a_dc_whose_summaries_stopped_is_excluded_with_a_reason(fleet):
    from hsched.domain.resources import Resources
    from hsched.domain.task import TaskSpec

    sel = DcSelector(fleet, graph=WanGraph(fleet.wan), stale_after_s=0.5)
    for dc in fleet.datacenters:
        sel.update_summary(summary(dc.name, 1))
    sel.update_summary(summary("cheap", 1), age_s=10.0)  # the last one cheap's placer published, 10 s ago
    ranked, excluded, unserved = sel.select(TaskSpec(Resources(1000, 512), runtime_s=60))
    assert "cheap" not in {c.datacenter for c in ranked} and {"near", "gpu"} <= {c.datacenter for c in ranked}
    reason = dict(excluded)["cheap"]
    assert reason.startswith("its placer's last summary is 10 s old") and "fenced" in reason
    assert unserved == {"cheap"}  # not a verdict on the task: the gateway answers UNAVAILABLE if nothing else can
    # a task cheap could never hold is excluded for that, whatever its placer does
    gpu_task = TaskSpec(Resources(1000, 512, gpu_count=1, gpu_core_percent=100, gpu_memory_mib=1024), runtime_s=60)
    ranked, excluded, unserved = sel.select(gpu_task)
    assert [c.datacenter for c in ranked] == ["gpu"] and unserved == set()
    assert "its placer" not in dict(excluded)["cheap"]


async def test_follow_summaries_keeps_the_current_placers_summaries(redis_url, prefix, fleet):
    from services.selector.server import follow_summaries

    client = connect(redis_url)
    keys = Keys(prefix)
    sel = DcSelector(fleet, graph=WanGraph(fleet.wan))

    async def publish(s: dict) -> None:
        await client.xadd(keys.summary(s["datacenter"]), {"s": json.dumps({**s, "unix_ms": int(time.time() * 1000)})})

    async def until(condition) -> None:
        async with asyncio.timeout(30):
            while not condition():
                await asyncio.sleep(0.02)

    await publish(summary("cheap", 3, free_cpu=30))
    follower = asyncio.create_task(follow_summaries(client, keys, sel))
    try:
        await until(lambda: "cheap" in sel.summaries)  # the latest one, read at start
        await publish(summary("cheap", 2, free_cpu=20))  # the fenced placer's late summary
        await publish(summary("cheap", 4, free_cpu=40))  # the new holder's
        await until(lambda: sel.fencing_tokens.get("cheap") == 4)
        assert sel.superseded == 1 and sel.summaries["cheap"]["free"][0] == 40
    finally:
        while not follower.done():  # cancel again until done: redis-py can swallow a cancel mid-command
            follower.cancel()
            await asyncio.wait({follower}, timeout=0.5)
        await client.aclose()


async def test_a_selector_started_after_a_placer_died_leaves_its_dc_out_at_once(redis_url, prefix, fleet):
    from hsched.domain.resources import Resources
    from hsched.domain.task import TaskSpec
    from services.selector.server import follow_summaries

    client = connect(redis_url)
    keys = Keys(prefix)
    now_ms = int(time.time() * 1000)
    for dc, published_ms in (("cheap", now_ms), ("near", now_ms - 60_000), ("gpu", now_ms)):
        await client.xadd(keys.summary(dc), {"s": json.dumps({**summary(dc, 1), "unix_ms": published_ms})})
    sel = DcSelector(fleet, graph=WanGraph(fleet.wan))
    follower = asyncio.create_task(follow_summaries(client, keys, sel))
    try:
        async with asyncio.timeout(30):
            while len(sel.summaries) < 3:
                await asyncio.sleep(0.02)
        ranked, excluded, _ = sel.select(TaskSpec(Resources(1000, 512), runtime_s=60))
        assert {c.datacenter for c in ranked} == {"cheap", "gpu"}
        assert dict(excluded)["near"].startswith("its placer's last summary is 60 s old")
    finally:
        while not follower.done():
            follower.cancel()
            await asyncio.wait({follower}, timeout=0.5)
        await client.aclose()


async def test_a_lease_lost_while_taking_over_is_not_served_on(redis_url, prefix, monkeypatch):
    """The lease keeper can lose the lease while the engine still folds the ledger before serving (a Redis
    failover or stall). That report found nothing held to stop and was dropped, and the engine then served with
    nothing renewing its lease, refusing every call for good: seen after a Redis master stall with replicas.
    Now the takeover is given up and the lease taken again."""
    from hsched.engine import placer as placer_module

    dc = load_fleet(SMALL_FLEET).datacenter("cheap")
    real, lost = placer_module.recorded_layout, []

    async def lost_meanwhile(redis, stream):  # an await of the takeover between the token and serving
        layout = await real(redis, stream)
        if not lost:
            lost.append(engine._keeper.token)
            engine._keeper._lost(engine._keeper.token, "the lease lapsed while folding")  # the keeper's own path
        return layout

    monkeypatch.setattr(placer_module, "recorded_layout", lost_meanwhile)
    client = connect(redis_url)
    engine = PlacerEngine(dc, client, Keys(prefix), FirstFit(), "p1", lease_ms=LEASE_MS)
    await engine.start()
    try:
        assert lost and engine.holding
        assert engine._keeper.token == engine.ledger.token > lost[0]  # served under a token that is renewed
        assert (await engine.place("t", TaskSpec(Resources(1000, 1024), runtime_s=3600))).outcome == "placed"
    finally:
        await engine.stop()
        await client.aclose()


def test_two_placer_processes_never_share_a_lease_owner_name():
    """The lease script takes a lease held under its own owner name as its own: two replicas named alike (pid 1
    in every container, pod hostnames cut to 63 characters) re-acquired it from each other every second."""
    import socket

    from services.placer.server import lease_owner

    first, second = lease_owner(), lease_owner()
    assert first != second and first.startswith(f"{socket.gethostname()}:{os.getpid()}-")
