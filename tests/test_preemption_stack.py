"""Online/offline co-location end to end through real processes (gateway, selector, a placer per DC of the small
fleet) on a real Redis with a compressed execution clock: an online task preempts an offline one when and only
when it could not otherwise be placed, the victim is requeued and later succeeds, and each preemption is in the
ledger, on the task stream and in the victim's record exactly once. GPU tasks: only the `gpu` DC (4 nodes × 2 T4)
holds them, so its 8 whole-card slots are the whole fleet's."""

from __future__ import annotations

import json
import time
import urllib.request

import grpc
import pytest
import redis

from hsched.state.keys import Keys
from hsched.v1 import common_pb2 as pb
from hsched.v1 import gateway_pb2, gateway_pb2_grpc
from tests.conftest import small_fleet_stack

pytestmark = pytest.mark.slow
TIME_FACTOR = 120  # two minutes of task time per wall second


@pytest.fixture(scope="module")
def stack(redis_url):
    with small_fleet_stack(redis_url, "preempt", thermal=False, extra_env={"HSCHED_TIME_FACTOR": str(TIME_FACTOR)}) as s:
        yield s


def gpu_task(runtime_s: float, priority_class: str = "") -> pb.TaskSpec:
    return pb.TaskSpec(resources=pb.Resources(cpu_milli=2000, memory_mib=4096, gpu_count=1, gpu_core_percent=100,
                                              gpu_memory_mib=8192), runtime_s=runtime_s, priority_class=priority_class)


def wait_for(predicate, what: str, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            pytest.fail(f"not after {timeout_s:.0f} s: {what}")
        time.sleep(0.1)
    return value


def ledger(stack, dc: str = "gpu") -> list[dict]:
    client = redis.Redis.from_url(stack.config.redis_url)
    return [json.loads(f[b"e"]) for _, f in client.xrange(Keys(stack.config.prefix).ledger(dc))]


def stream_kinds(stack, task_id: str) -> list[str]:
    client = redis.Redis.from_url(stack.config.redis_url)
    return [f[b"k"].decode() for _, f in client.xrange(Keys(stack.config.prefix).tasks)
            if pb.Task.FromString(f[b"t"]).task_id == task_id]


def test_an_online_task_preempts_only_when_it_cannot_be_placed_and_the_victim_succeeds_later(stack):
    gw = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(stack.gateway))

    def get(task_id: str) -> pb.Task:
        return gw.Get(gateway_pb2.GetRequest(task_id=task_id), timeout=10)

    # 7 offline tasks (10 s of wall time each) take 7 of the 8 slots
    offline = [gw.Submit(gateway_pb2.SubmitRequest(task=gpu_task(1200)), timeout=30).task for _ in range(7)]
    assert {(t.state, t.datacenter) for t in offline} == {(pb.TASK_STATE_PLACED, "gpu")}
    wait_for(lambda: all(get(t.task_id).state == pb.TASK_STATE_RUNNING for t in offline), "the offline tasks run")
    # an online task that fits as is takes the free slot and preempts nothing
    fits = gw.Submit(gateway_pb2.SubmitRequest(task=gpu_task(600, "online")), timeout=30).task
    assert fits.state == pb.TASK_STATE_PLACED
    assert not [e for e in ledger(stack) if e["t"] == "preempt"]
    # the fleet is full: the next online task evicts one offline task, the one that has run the shortest
    urgent = gw.Submit(gateway_pb2.SubmitRequest(task=gpu_task(600, "online")), timeout=30).task
    assert urgent.state == pb.TASK_STATE_PLACED and urgent.datacenter == "gpu"
    events = ledger(stack)
    preempts = [e for e in events if e["t"] == "preempt"]
    assert len(preempts) == 1 and preempts[0]["by"] == urgent.task_id
    victim = preempts[0]["task"]
    assert victim in {t.task_id for t in offline}  # never the online task already placed
    started = {e["task"]: e["at"] for e in events if e["t"] == "run" and e["task"] in {t.task_id for t in offline}}
    assert started[victim] == max(started.values())  # least lost work: all hold the same, it ran the shortest
    i = next(k for k, e in enumerate(events) if e["t"] == "preempt")
    assert [(e["t"], e["task"]) for e in events[i:i + 3]] == [("preempt", victim), ("alloc", urgent.task_id),
                                                              ("defer", victim)]
    # the victim is requeued, placed again when room comes back (the online tasks finish), and succeeds
    done = wait_for(lambda: (t := get(victim)).state == pb.TASK_STATE_SUCCEEDED and t, "the victim succeeded")
    assert done.preemptions == 1
    kinds = stream_kinds(stack, victim)
    assert kinds.count("preempted") == 1
    after = kinds[kinds.index("preempted"):]
    assert after[:2] == ["preempted", "deferred"] and after[-3:] == ["placed", "running", "succeeded"]
    wait_for(lambda: all(get(t.task_id).state == pb.TASK_STATE_SUCCEEDED for t in [*offline, fits, urgent]),
             "every task succeeded")
    # each preemption exactly once in the ledger; the placer counted it
    assert [e["task"] for e in ledger(stack) if e["t"] == "preempt"] == [victim]
    assert [e["t"] for e in ledger(stack) if e["task"] == victim].count("alloc") == 2
    metrics = urllib.request.urlopen(
        f"http://127.0.0.1:{stack.services['placer-gpu'].metrics_port}/metrics", timeout=10).read().decode()
    assert 'hsched_placer_preemptions_total{datacenter="gpu"} 1.0' in metrics


def test_an_unknown_priority_class_is_refused_naming_the_field(stack):
    gw = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(stack.gateway))
    with pytest.raises(grpc.RpcError) as exc:
        gw.Submit(gateway_pb2.SubmitRequest(task=gpu_task(60, "urgent")), timeout=30)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "priority_class" in exc.value.details()


def test_a_waiting_online_task_preempts_once_the_state_lets_it_exactly_once_across_placer_kills(stack):
    """Eight online 1-card services (run until released) fill the `gpu` DC; a 2-card online task waits (nothing
    offline to evict), then an offline 1-card task. A service's release frees one card: the online task still does
    not fit, the offline task takes the card. The other service on that node goes: now evicting the offline task
    lets the online one in — it does so from the queue. The placer is SIGKILLed before and after that; the
    preemption is written exactly once and the victim, requeued, later succeeds."""
    gw = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(stack.gateway))

    def submit(spec: pb.TaskSpec) -> pb.Task:
        return gw.Submit(gateway_pb2.SubmitRequest(task=spec), timeout=30).task

    def get(task_id: str) -> pb.Task:
        return gw.Get(gateway_pb2.GetRequest(task_id=task_id), timeout=10)

    def release(task_id: str) -> None:
        gw.Release(gateway_pb2.ReleaseRequest(task_id=task_id), timeout=30)

    def preempted() -> list[tuple[str, str]]:
        return [(e["task"], e["by"]) for e in ledger(stack) if e["t"] == "preempt"]

    before = preempted()
    services = [submit(gpu_task(0, "online")) for _ in range(8)]
    assert {(t.state, t.datacenter) for t in services} == {(pb.TASK_STATE_PLACED, "gpu")}
    nodes: dict[int, list[str]] = {}
    for e in ledger(stack):
        if e["t"] == "alloc" and e["task"] in {t.task_id for t in services}:
            nodes.setdefault(e["parts"][0][2], []).append(e["task"])
    node, (first, second) = min(nodes.items())
    two_cards = gpu_task(600, "online")
    two_cards.resources.gpu_count = 2
    urgent = submit(two_cards)
    batch = submit(gpu_task(1200))
    assert (urgent.state, batch.state) == (pb.TASK_STATE_DEFERRED, pb.TASK_STATE_DEFERRED)
    release(first)
    wait_for(lambda: get(batch.task_id).state == pb.TASK_STATE_RUNNING, "the offline task took the freed card")
    assert get(urgent.task_id).state == pb.TASK_STATE_DEFERRED and preempted() == before
    stack.kill("placer-gpu")  # the restarted placer serves its queue once: evicting batch is still not enough
    stack.restart("placer-gpu")
    release(second)
    wait_for(lambda: get(urgent.task_id).state in (pb.TASK_STATE_PLACED, pb.TASK_STATE_RUNNING),
             "the waiting online task placed by evicting the offline one")
    assert preempted() == [*before, (batch.task_id, urgent.task_id)]
    assert [e["parts"][0][2] for e in ledger(stack) if e["t"] == "alloc" and e["task"] == urgent.task_id] == [node]
    stack.kill("placer-gpu")
    stack.restart("placer-gpu")
    release(services[-1].task_id if services[-1].task_id not in (first, second) else services[0].task_id)
    done = wait_for(lambda: (t := get(batch.task_id)).state == pb.TASK_STATE_SUCCEEDED and t,
                    "the requeued victim succeeded")
    assert done.preemptions == 1
    kinds = stream_kinds(stack, batch.task_id)
    assert kinds.count("preempted") == 1
    assert kinds[kinds.index("preempted"):][:2] == ["preempted", "deferred"]
    assert kinds[-3:] == ["placed", "running", "succeeded"]
    for t in services:
        release(t.task_id)
    wait_for(lambda: get(urgent.task_id).state == pb.TASK_STATE_SUCCEEDED, "the online task succeeded")
    assert preempted() == [*before, (batch.task_id, urgent.task_id)]  # exactly once, kills and all


def cpu_task(priority_class: str = "") -> pb.TaskSpec:
    """A whole node of cheap or near (24 cores), held until released."""
    return pb.TaskSpec(resources=pb.Resources(cpu_milli=24_000, memory_mib=4096), runtime_s=0,
                       priority_class=priority_class, tenant="colo-room")


def test_an_online_task_goes_where_there_is_room_and_preempts_only_when_no_dc_has_any(stack):
    gw = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(stack.gateway))

    def submit(spec: pb.TaskSpec) -> pb.Task:
        return gw.Submit(gateway_pb2.SubmitRequest(task=spec), timeout=30).task

    dcs = ("cheap", "near", "gpu")
    seen = {dc: len(ledger(stack, dc)) for dc in dcs}  # the module's earlier tests preempted in gpu

    def preempts() -> list[tuple[str, str]]:
        return [(dc, e["by"]) for dc in dcs for e in ledger(stack, dc)[seen[dc]:] if e["t"] == "preempt"]

    try:
        filled = [submit(cpu_task()) for _ in range(4)]
        best = filled[0].datacenter  # the first-ranked DC for these tasks, now full
        assert {(t.state, t.datacenter) for t in filled} == {(pb.TASK_STATE_PLACED, best)}
        online = submit(cpu_task("online"))
        assert online.state == pb.TASK_STATE_PLACED and online.datacenter != best
        assert not preempts()  # the room elsewhere first
        for _ in range(20):  # offline tasks until no DC has room for one
            if submit(cpu_task()).state == pb.TASK_STATE_DEFERRED:
                break
        else:
            pytest.fail("the fleet never filled up")
        # now no DC has room: the next online task preempts, at the first-ranked DC
        urgent = submit(cpu_task("online"))
        assert urgent.state == pb.TASK_STATE_PLACED and urgent.datacenter == best, list(urgent.explanation.notes)
        assert preempts() == [(best, urgent.task_id)]
    finally:
        for t in gw.List(gateway_pb2.ListRequest(tenant="colo-room"), timeout=10).tasks:
            gw.Release(gateway_pb2.ReleaseRequest(task_id=t.task_id), timeout=30)
