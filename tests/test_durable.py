"""Durability of the source of truth, through real processes on real redis-servers started here: the stack's
embedded Redis persists (AOF) across a SIGKILL, a Redis that lost its data is refused by every writer (the
epoch marker), and with a replica + Sentinel the master's death loses no acknowledged task."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
import uuid
from collections import OrderedDict

import grpc
import pytest

from hsched.domain.cluster import ClusterState
from hsched.stack import Stack, StackConfig
from hsched.state.epoch import EXIT_STATE_LOST
from hsched.state.keys import Keys
from hsched.state.ledger import replay
from hsched.state.lifecycle import ON_NODES
from hsched.state.redis import connect, connect_sync
from hsched.v1 import common_pb2 as pb
from hsched.v1 import gateway_pb2, gateway_pb2_grpc
from tests.conftest import ROOT, SMALL_FLEET

pytestmark = pytest.mark.slow

LOST = "has lost hsched's state"


def small_task(request_id: str, cores: int = 1) -> pb.TaskSpec:
    return pb.TaskSpec(resources=pb.Resources(cpu_milli=cores * 1000, memory_mib=1024), runtime_s=3600,
                       request_id=request_id)


def config(tmp_path, **kw) -> StackConfig:
    # tasks are placed, never started, here (a day of container start): a ledger's length counts placement
    # decisions only, not the execution clock's run events (tests/test_lifecycle.py covers those)
    return StackConfig(fleet_path=SMALL_FLEET, gateway_port=0, thermal=False, metrics=False,
                       state_dir=str(tmp_path / "state"), log_level="INFO",
                       extra_env={"HSCHED_CONTAINER_START_S": "86400"}, **kw)


def submit(gw, request_id: str, timeout: float = 10) -> pb.Task:
    return gw.Submit(gateway_pb2.SubmitRequest(task=small_task(request_id)), timeout=timeout).task


def submit_until_placed(gw, deadline_s: float = 60) -> pb.Task:
    """A Submit that is acknowledged PLACED, retried (same request id) while the stack recovers."""
    request_id, deadline = uuid.uuid4().hex, time.monotonic() + deadline_s
    while True:
        try:
            t = submit(gw, request_id)
            if t.state == pb.TASK_STATE_PLACED:
                return t
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"no Submit placed within {deadline_s} s")
        time.sleep(0.2)


def fold_ledgers(stack: Stack, settle_s: float = 30) -> dict[str, ClusterState]:
    """Every DC's ledger folded from Redis: ClusterState.apply raises OverAllocation if any node or card
    would go over capacity, so a fold that returns is the proof of no double allocation. A task held by two
    DCs is allowed only while a placer has not yet written the cancellation of an append whose outcome it
    did not know (Ledger.pending_undo, retried every 0.5 s): it must be gone within `settle_s`."""

    async def fold() -> dict[str, ClusterState]:
        redis = connect(stack.redis_url)
        try:
            out = {}
            for dc in stack.fleet.datacenters:
                out[dc.name] = ClusterState(dc)
                await replay(redis, Keys(stack.config.prefix).ledger(dc.name), out[dc.name], OrderedDict())
            return out
        finally:
            await redis.aclose()

    deadline = time.monotonic() + settle_s
    while True:
        states = asyncio.run(fold())
        holders: dict[str, list[str]] = {}
        for dc, state in states.items():
            for task_id in state.allocations:
                holders.setdefault(task_id, []).append(dc)
        twice = {t: dcs for t, dcs in holders.items() if len(dcs) > 1}
        if not twice:
            return states
        assert time.monotonic() < deadline, f"tasks held by two data centers: {twice}"
        time.sleep(0.5)


def assert_same(gw, placed: list[pb.Task], states: dict[str, ClusterState]) -> None:
    for t in placed:
        now = gw.Get(gateway_pb2.GetRequest(task_id=t.task_id), timeout=10)
        assert (now.state, now.datacenter, list(now.assignments)) == (t.state, t.datacenter, list(t.assignments))
        assert t.task_id in states[t.datacenter].allocations, f"{t.task_id} missing from {t.datacenter}'s ledger"


def wait_exit(stack: Stack, name: str, timeout_s: float = 60) -> int:
    return stack.services[name].proc.wait(timeout_s)


def test_redis_sigkill_and_restart_keeps_ledgers_and_tasks(tmp_path):
    with Stack(config(tmp_path)) as stack, grpc.insecure_channel(stack.gateway) as ch:
        gw = gateway_pb2_grpc.GatewayStub(ch)
        placed = [submit_until_placed(gw) for _ in range(12)]
        lengths = {dc.name: connect_sync(stack.redis_url).xlen(Keys(stack.config.prefix).ledger(dc.name))
                   for dc in stack.fleet.datacenters}
        assert sum(lengths.values()) >= 12
        stack.redis.kill()
        stack.redis.start()  # same port, same data dir: the AOF is replayed
        states = fold_ledgers(stack)
        stack.kill("gateway")  # its table rebuilt from the restarted Redis' task stream
        stack.restart("gateway")
        assert {dc: connect_sync(stack.redis_url).xlen(Keys(stack.config.prefix).ledger(dc)) for dc in lengths} \
            == lengths
        assert_same(gw, placed, states)
        # the placers go on from the ledger they had: new Submits are placed, never onto taken capacity
        more = [submit_until_placed(gw) for _ in range(12)]
        states = fold_ledgers(stack)
        assert_same(gw, placed + more, states)
        for name, svc in stack.services.items():
            assert svc.proc.poll() is None, f"{name} died"


def test_a_supervised_stack_says_when_redis_lost_the_state(tmp_path):
    """The supervisor restarts no writer that found the state gone, and says so: `hsched up` then stops the rest
    (exit 3) instead of running on with only the selector."""
    with Stack(config(tmp_path, supervise=True)) as stack:
        connect_sync(stack.redis_url).delete(Keys(stack.config.prefix).epoch)  # as a wiped Redis looks
        deadline = time.monotonic() + 120
        while not stack.state_lost:
            assert time.monotonic() < deadline, "no service reported the lost state"
            time.sleep(0.2)
        assert stack.state_lost.endswith("exited because Redis lost hsched's state, which no restart brings back")


def test_lost_redis_state_is_refused_until_fresh(tmp_path):
    cfg = config(tmp_path)
    with Stack(cfg) as stack, grpc.insecure_channel(stack.gateway) as ch:
        gw = gateway_pb2_grpc.GatewayStub(ch)
        submit_until_placed(gw)
        epoch = stack.epoch
        assert (tmp_path / "state" / "epoch").read_text().strip() == epoch
        stack.redis.kill()
        for f in stack.redis.dir.iterdir():  # the data dir is lost; an empty Redis comes up on the same port
            f.unlink()
        stack.redis.start()
        writers = ["gateway", *(f"placer-{dc.name}" for dc in stack.fleet.datacenters)]
        for name in writers:  # running writers notice the marker is gone and stop, non-zero, with one line
            assert wait_exit(stack, name) == EXIT_STATE_LOST, name
            log = (stack.log_dir / f"{name}.log").read_text()
            assert LOST in log and Keys(cfg.prefix).epoch in log and epoch in log and "hsched up --fresh" in log
            assert "Traceback" not in log, log
        assert not any(k.startswith(b"hsched:dc:") for k in connect_sync(stack.redis_url).keys("*")), \
            "a writer wrote into the wiped Redis"
        with pytest.raises(RuntimeError, match=f"exited with {EXIT_STATE_LOST}"):  # a restarted placer refuses too
            stack.restart(f"placer-{stack.fleet.datacenters[0].name}", timeout_s=60)
        assert LOST in (stack.log_dir / f"placer-{stack.fleet.datacenters[0].name}.log").read_text()

    # `hsched up` on that state dir: its Redis (data dir wiped) lacks the recorded epoch -> exit 1, the message
    up = subprocess.run([sys.executable, "-m", "hsched.cli", "up", "--fleet", SMALL_FLEET, "--port", "0",
                         "--no-thermal", "--state-dir", str(tmp_path / "state")],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert up.returncode == 1, up.stdout + up.stderr
    assert LOST in up.stderr and "Traceback" not in up.stderr + up.stdout

    # --fresh: a new deployment on the same state dir serves again
    with Stack(config(tmp_path, fresh=True)) as stack, grpc.insecure_channel(stack.gateway) as ch:
        assert stack.epoch != epoch
        assert submit_until_placed(gateway_pb2_grpc.GatewayStub(ch)).state == pb.TASK_STATE_PLACED


def test_replicated_master_killed_under_load_loses_nothing_acknowledged(tmp_path):
    with Stack(config(tmp_path, redis_replicas=1)) as stack, grpc.insecure_channel(stack.gateway) as ch:
        gw = gateway_pb2_grpc.GatewayStub(ch)
        assert stack.redis_url.startswith("redis+sentinel://")
        acked: list[pb.Task] = []
        stop, failed = threading.Event(), [0]

        def load() -> None:
            while not stop.is_set():
                try:
                    t = submit(gw, uuid.uuid4().hex, timeout=5)
                    if t.state == pb.TASK_STATE_PLACED:
                        acked.append(t)
                except grpc.RpcError:
                    failed[0] += 1
                    time.sleep(0.05)

        threads = [threading.Thread(target=load) for _ in range(3)]
        for t in threads:
            t.start()
        try:
            deadline = time.monotonic() + 60
            while len(acked) < 15:
                assert time.monotonic() < deadline, "no load before the fault"
                time.sleep(0.1)
            old = stack.redis.kill_master(wait_failover_s=60)  # Sentinel promotes the replica; old rejoins
            assert stack.redis.master().port != old.port
            before = len(acked)
            deadline = time.monotonic() + 90
            while len(acked) < before + 15:  # Submits succeed again after the failover
                assert time.monotonic() < deadline, f"Submits did not recover ({failed[0]} failed)"
                time.sleep(0.2)
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        states = fold_ledgers(stack)
        stack.kill("gateway")  # its table rebuilt from the promoted replica's task stream
        stack.restart("gateway")
        assert_same(gw, acked, states)  # every acknowledged task: same record, in its DC's ledger


def test_supervisor_brings_a_dead_replica_back_so_writes_that_wait_for_it_succeed(tmp_path):
    """Every write WAITs for the replica: while it is dead they answer UNAVAILABLE; the supervisor restarts it
    as a replica of the master and Submits are placed again, the earlier task still there."""
    with Stack(config(tmp_path, redis_replicas=1, supervise=True, backoff_initial_s=0.2)) as stack, \
            grpc.insecure_channel(stack.gateway) as ch:
        gw = gateway_pb2_grpc.GatewayStub(ch)
        first = submit_until_placed(gw)
        master = stack.redis.master()
        replica = next(n for n in stack.redis.nodes if n is not master)
        dead_pid = replica.proc.pid
        replica.kill()
        deadline = time.monotonic() + 60
        while not (replica.running and replica.proc.pid != dead_pid):
            assert time.monotonic() < deadline, "the supervisor did not restart the replica"
            time.sleep(0.2)
        deadline = time.monotonic() + 30  # the supervisor logs the restart once the node's start() returned,
        while "restarted by the supervisor as a replica" not in (stack.log_dir / "supervisor.log").read_text():
            assert time.monotonic() < deadline, "the restart is not in supervisor.log"
            time.sleep(0.2)
        # ... i.e. once it answers (a running process may not listen yet)
        assert connect_sync(replica.url).info("replication")["role"] == "slave"
        assert submit_until_placed(gw).state == pb.TASK_STATE_PLACED
        assert gw.Get(gateway_pb2.GetRequest(task_id=first.task_id), timeout=10).state in ON_NODES


def test_supervisor_brings_a_dead_sentinel_back_and_the_next_master_death_fails_over(tmp_path):
    """A kill -9 of the Sentinel was never repaired: clients could no longer find the master by name, and the
    next master death left the stack UNAVAILABLE for good with a healthy replica idle."""
    with Stack(config(tmp_path, redis_replicas=1, supervise=True, backoff_initial_s=0.2)) as stack, \
            grpc.insecure_channel(stack.gateway) as ch:
        gw = gateway_pb2_grpc.GatewayStub(ch)
        first = submit_until_placed(gw)
        sentinel = stack.redis.sentinel
        sentinel.kill()
        deadline = time.monotonic() + 60
        while stack.redis.sentinel is sentinel or stack.redis.sentinel.poll() is not None \
                or "sentinel restarted by the supervisor" not in (stack.log_dir / "supervisor.log").read_text():
            assert time.monotonic() < deadline, "the supervisor did not restart the Sentinel"
            time.sleep(0.2)
        old = stack.redis.kill_master(wait_failover_s=60, rejoin=False)  # the restarted Sentinel fails over
        assert stack.redis.master() is not old
        assert submit_until_placed(gw).state == pb.TASK_STATE_PLACED
        assert gw.Get(gateway_pb2.GetRequest(task_id=first.task_id), timeout=10).state in ON_NODES
