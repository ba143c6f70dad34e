"""Several DCs' placers in one process (`hsched up --placer-processes`, services/placer/server.py `serve` with a
list of DCs), real processes on a real Redis: each DC keeps its own gRPC port, lease and ledger; tasks are placed
across the DCs of the one process; one DC fenced leaves the others serving (and the supervisor does not kill the
process for it); kill -9 of the process: the supervisor restarts it, every DC comes back on its port with a
higher fencing token, the tasks it held still held where they were, nothing allocated twice. No timing asserts:
every wait polls a condition under a generous deadline."""

from __future__ import annotations

import re
import urllib.request

import grpc
import pytest
import redis as redis_sync

from hsched.stack import Stack, StackConfig, _health
from hsched.state.keys import Keys
from hsched.state.lifecycle import ON_NODES
from hsched.telemetry.naming import naming_problems
from hsched.v1 import common_pb2 as pb
from hsched.v1 import gateway_pb2, gateway_pb2_grpc, placer_pb2, placer_pb2_grpc
from tests.conftest import SMALL_FLEET, small_fleet_stack
from tests.test_metrics_naming import label_bounds
from tests.test_supervisor import wait_for  # same 120 s deadline

pytestmark = pytest.mark.slow

DCS = ("cheap", "near", "gpu")
FULL_CPU = {"cheap": 4 * 24000, "near": 4 * 24000, "gpu": 4 * 32000}


@pytest.fixture(scope="module")
def stack(redis_url):
    with small_fleet_stack(redis_url, "groups", log_level="INFO", supervise=True, placer_processes=1,
                           unhealthy_restart_s=3.0, backoff_initial_s=0.2, backoff_max_s=2.0,
                           probe_interval_s=0.5) as s:
        yield s


@pytest.fixture(scope="module")
def gw(stack):
    with grpc.insecure_channel(stack.gateway) as ch:
        yield gateway_pb2_grpc.GatewayStub(ch)


def state(stack: Stack, dc: str) -> placer_pb2.PlacerState:
    with grpc.insecure_channel(stack.placer_target(dc)) as ch:
        return placer_pb2_grpc.PlacerStub(ch).GetState(placer_pb2.PlacerStateRequest(include_nodes=True), timeout=10)


def serving(stack: Stack, dc: str) -> bool:
    return _health(stack.placer_target(dc)) == "SERVING"


def cpu_task(cores: int = 2, **kw) -> pb.TaskSpec:
    return pb.TaskSpec(resources=pb.Resources(cpu_milli=cores * 1000, memory_mib=2048), runtime_s=3600, **kw)


def gpu_task() -> pb.TaskSpec:
    return pb.TaskSpec(resources=pb.Resources(cpu_milli=2000, memory_mib=4096, gpu_count=1, gpu_core_percent=50,
                                              gpu_memory_mib=4096), runtime_s=3600)


NEAR_ONLY = pb.NetworkRequirements(max_latency_ms=0.8)  # from s: near 0.5 ms, cheap 1.0, gpu 1.5 (small.yaml)


def submit(gw, spec: pb.TaskSpec) -> pb.Task:
    return gw.Submit(gateway_pb2.SubmitRequest(task=spec), timeout=20).task


def release(gw, task_id: str) -> None:
    gw.Release(gateway_pb2.ReleaseRequest(task_id=task_id), timeout=20)


def free_cpu(stack: Stack, dc: str) -> int:
    return sum(n.free.cpu_milli for n in state(stack, dc).nodes)


def test_one_process_hosts_every_dc_on_its_own_port_and_places_across_them(stack, gw):
    assert [n for n in stack.services if n.startswith("placer")] == ["placers-1"]
    svc = stack.services["placers-1"]
    assert list(svc.dc_ports) == list(DCS) and len(set(svc.dc_ports.values())) == 3
    assert {stack.placer_service(dc) for dc in DCS} == {"placers-1"}
    placed = {dc: submit(gw, spec) for dc, spec in
              (("cheap", cpu_task(3)), ("near", cpu_task(1, network=NEAR_ONLY)), ("gpu", gpu_task()))}
    try:
        for dc, t in placed.items():
            assert t.state == pb.TASK_STATE_PLACED and t.datacenter == dc, (dc, list(t.explanation.notes))
        # each DC's ledger holds its own task only: three engines, three ledgers, one process
        assert FULL_CPU["cheap"] - free_cpu(stack, "cheap") == 3000
        assert FULL_CPU["near"] - free_cpu(stack, "near") == 1000
        assert FULL_CPU["gpu"] - free_cpu(stack, "gpu") == 2000
        owners = {state(stack, dc).owner for dc in DCS}  # one process: one owner (host:pid-suffix) on all three
        assert len(owners) == 1 and f":{svc.proc.pid}-" in owners.pop()
        # one /metrics endpoint for the process, a series per DC
        text = urllib.request.urlopen(f"http://127.0.0.1:{svc.metrics_port}/metrics", timeout=10).read().decode()
        held = dict(re.findall(r'^hsched_placer_lease_held\{datacenter="(\w+)"\} (\S+)$', text, re.M))
        assert held == {"cheap": "1.0", "near": "1.0", "gpu": "1.0"}
        running = dict(re.findall(r'^hsched_running_tasks\{datacenter="(\w+)"\} (\S+)$', text, re.M))
        assert running == {"cheap": "1.0", "near": "1.0", "gpu": "1.0"}
        # and the families, merged over three DCs, keep docs/metrics.md's rules (one family, bounded labels)
        assert naming_problems(text, label_bounds(stack.fleet, len(stack.services))) == []
    finally:
        for t in placed.values():
            if t.state in ON_NODES:
                release(gw, t.task_id)


def test_one_fenced_dc_leaves_the_others_of_its_process_serving(stack, gw, redis_url):
    svc = stack.services["placers-1"]
    pid, restarts = svc.proc.pid, svc.restarts
    token = state(stack, "cheap").summary.fencing_token
    # another owner takes cheap's lease (what a paused holder finds when it wakes): cheap's engine is fenced.
    # cheap is the process' first port, the one a supervisor probing a single address would judge it by
    r = redis_sync.Redis.from_url(redis_url)
    try:
        r.set(Keys(stack.config.prefix).lease("cheap"), "intruder:1", px=6000)
    finally:
        r.close()
    wait_for(lambda: not serving(stack, "cheap"), "cheap NOT_SERVING once its lease is taken")
    # the other DCs of the same process keep placing meanwhile
    assert serving(stack, "near") and serving(stack, "gpu")
    for spec, dc in ((cpu_task(1, network=NEAR_ONLY), "near"), (gpu_task(), "gpu")):
        t = submit(gw, spec)
        assert t.state == pb.TASK_STATE_PLACED and t.datacenter == dc, list(t.explanation.notes)
        release(gw, t.task_id)
    # a task for cheap goes elsewhere meanwhile
    t = submit(gw, cpu_task(1))
    assert t.state == pb.TASK_STATE_PLACED and t.datacenter != "cheap"
    release(gw, t.task_id)
    # the intruder's lease lapses: cheap takes it back with a higher token, in the same process
    wait_for(lambda: serving(stack, "cheap"), "cheap SERVING again after the intruder's lease lapsed")
    assert state(stack, "cheap").summary.fencing_token > token
    # fenced for longer than unhealthy_restart_s (3 s), yet the process was never killed: its other DCs served
    assert (svc.proc.pid, svc.restarts) == (pid, restarts)


def test_kill_9_of_the_group_process_restarts_every_dc_and_loses_nothing(stack, gw):
    svc = stack.services["placers-1"]
    old_pid, ports = svc.proc.pid, dict(svc.dc_ports)
    held = [submit(gw, cpu_task(c)) for c in (3, 5)] + [submit(gw, gpu_task())]
    assert [t.datacenter for t in held] == ["cheap", "cheap", "gpu"], [list(t.explanation.notes) for t in held]
    before = {dc: state(stack, dc) for dc in DCS}
    stack.kill("placers-1")  # a crash of all three DCs at once: nobody calls restart()
    wait_for(lambda: svc.proc.pid != old_pid and svc.alive and all(serving(stack, dc) for dc in DCS),
             "placers-1 restarted by the supervisor, every DC SERVING")
    assert svc.dc_ports == ports  # the same ports: the gateway was given them
    for dc in DCS:
        after = state(stack, dc)
        assert [n.free for n in after.nodes] == [n.free for n in before[dc].nodes], dc
        assert after.summary.fencing_token > before[dc].summary.fencing_token
    # acknowledged tasks are still held where they were; a retried Place allocates nothing twice
    for t in held:
        again = wait_for(lambda t=t: gw.Get(gateway_pb2.GetRequest(task_id=t.task_id), timeout=10), t.task_id)
        assert again.state in ON_NODES and list(again.assignments) == list(t.assignments)
        with grpc.insecure_channel(stack.placer_target(t.datacenter)) as ch:
            retry = placer_pb2_grpc.PlacerStub(ch).Place(placer_pb2.PlaceRequest(task_id=t.task_id, task=t.spec),
                                                        timeout=10)
        assert retry.outcome == placer_pb2.PLACE_OUTCOME_PLACED and list(retry.assignments) == list(t.assignments)
    assert FULL_CPU["cheap"] - free_cpu(stack, "cheap") == 8000
    assert FULL_CPU["gpu"] - free_cpu(stack, "gpu") == 2000
    # and the restarted process places in every DC again
    t = submit(gw, cpu_task(1, network=NEAR_ONLY))
    assert t.state == pb.TASK_STATE_PLACED and t.datacenter == "near"
    for x in [*held, t]:
        release(gw, x.task_id)
    assert {dc: free_cpu(stack, dc) for dc in DCS} == FULL_CPU
    assert re.search(r"placers-1: restarted by the supervisor as pid \d+", (stack.log_dir / "supervisor.log").read_text())


@pytest.mark.parametrize(("k", "gpu_policy", "groups"), [
    (0, None, {"placer-cheap": ["cheap"], "placer-near": ["near"], "placer-gpu": ["gpu"]}),
    (1, None, {"placers-1": ["cheap", "near", "gpu"]}),
    (2, None, {"placers-1": ["cheap", "near"], "placer-gpu": ["gpu"]}),
    (3, None, {"placer-cheap": ["cheap"], "placer-near": ["near"], "placer-gpu": ["gpu"]}),
    # one --policy per process: the GPU DC's own policy keeps it out of the CPU DCs' process
    (1, "fgd", {"placers-1": ["cheap", "near"], "placer-gpu": ["gpu"]}),
])
def test_groups_follow_the_fleet_order_and_never_mix_policies(k, gpu_policy, groups):
    stack = Stack(StackConfig(fleet_path=SMALL_FLEET, placer_processes=k, gpu_policy=gpu_policy))
    try:
        assert {name: [dc.name for dc in dcs] for name, dcs in stack.placer_groups().items()} == groups
    finally:
        stack.stop()


def test_default_fleet_in_three_groups():
    stack = Stack(StackConfig(placer_processes=3))
    try:
        sizes = [len(dcs) for dcs in stack.placer_groups().values()]
        names = [dc.name for dcs in stack.placer_groups().values() for dc in dcs]
    finally:
        stack.stop()
    assert sizes == [4, 4, 3] and names == [dc.name for dc in stack.fleet.datacenters]
