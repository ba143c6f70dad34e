"""The whole stack as real processes (gateway, selector, thermal, one placer per DC) on a real Redis,
driven over gRPC — the behaviours a job submitter relies on. Uses the small test fleet:
cheap (4 × 24 cores, vertex b), near (4 × 24 cores, vertex a), gpu (4 × 32 cores + 2 T4 each, vertex c)."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from hsched.state.lifecycle import ON_NODES
from hsched.v1 import common_pb2 as pb
from hsched.v1 import gateway_pb2, gateway_pb2_grpc, placer_pb2, placer_pb2_grpc
from tests.conftest import small_fleet_stack

pytestmark = pytest.mark.slow


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """A real OTLP/gRPC trace receiver: what the services export to when run with --traces otlp."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, bytes, str]] = []  # (service.name, trace id, span name)
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
                for ss in rs.scope_spans:
                    self.spans.extend((service, s.trace_id, s.name) for s in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture(scope="module")
def otlp():
    receiver = OtlpReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield receiver, port
    server.stop(0)


@pytest.fixture(scope="module")
def stack(redis_url, otlp):
    _, port = otlp
    with small_fleet_stack(redis_url, "stack", traces="otlp", log_level="INFO",
                     extra_env={"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
                                "OTEL_BSP_SCHEDULE_DELAY": "100", "HSCHED_METRICS_PER_CARD": "1"}) as s:
        yield s


@pytest.fixture(scope="module")
def gw(stack):
    with grpc.insecure_channel(stack.gateway) as ch:
        yield gateway_pb2_grpc.GatewayStub(ch)


def placer(stack, dc: str) -> placer_pb2_grpc.PlacerStub:
    return placer_pb2_grpc.PlacerStub(grpc.insecure_channel(stack.placer_target(dc)))


def task(cores: float = 2, mem_gib: float = 4, gpus: int = 0, gpu_pct: int = 0, gpu_mem_gib: float = 0,
         **kw) -> pb.TaskSpec:
    return pb.TaskSpec(resources=pb.Resources(cpu_milli=int(cores * 1000), memory_mib=int(mem_gib * 1024),
                                              gpu_count=gpus, gpu_core_percent=gpu_pct,
                                              gpu_memory_mib=int(gpu_mem_gib * 1024)),
                       runtime_s=kw.pop("runtime_s", 3600), **kw)


def submit(gw, spec: pb.TaskSpec, method: str = "") -> gateway_pb2.SubmitResponse:
    return gw.Submit(gateway_pb2.SubmitRequest(task=spec, selector_method=method), timeout=20)


def release(gw, task_id: str) -> pb.Task:
    return gw.Release(gateway_pb2.ReleaseRequest(task_id=task_id), timeout=20).task


def free_cores(stack, dc: str) -> int:
    state = placer(stack, dc).GetState(placer_pb2.PlacerStateRequest(include_nodes=True), timeout=10)
    return sum(n.free.cpu_milli for n in state.nodes)


# -- placement ----------------------------------------------------------------------------------------------


def test_feasible_task_is_placed_with_cost_breakdown_and_path(gw, stack):
    reply = submit(gw, task(cores=2, mem_gib=4, data_size_mb=1000))
    t = reply.task
    assert t.state == pb.TASK_STATE_PLACED and t.datacenter == "cheap"
    assert len(t.assignments) == 1 and t.assignments[0].node.startswith("cheap-")
    best = t.explanation.ranking[0]
    # eq.1: 2 cores × 0.03 + 4 GiB × 0.004 per hour, 1 h = 0.076; eq.2: 0.01 $/GB/ms × 1 GB × path latency
    assert best.datacenter == "cheap"
    assert best.resource_cost.cpu == pytest.approx(0.06) and best.resource_cost.memory == pytest.approx(0.016)
    assert best.resource_cost.total == pytest.approx(0.076)
    assert list(best.path.vertices) == ["s", "a", "b"] and best.path.finder == "dijkstra"
    assert best.path.latency_ms == pytest.approx(1.0)  # 100 km + 100 km at 5 µs/km
    assert best.network_cost == pytest.approx(0.01 * 1.0 * 1.0)
    assert best.total_cost == pytest.approx(0.086)
    assert [c.datacenter for c in t.explanation.ranking] == sorted(
        (c.datacenter for c in t.explanation.ranking), key=lambda d: {"cheap": 0, "gpu": 1, "near": 2}[d])
    assert t.explanation.placer_policy == "bestfit" and t.explanation.alternatives
    assert t.explanation.thermal.redline_c == 27.0
    assert t.explanation.thermal.max_inlet_after_c >= t.explanation.thermal.max_inlet_before_c
    assert gw.Get(gateway_pb2.GetRequest(task_id=t.task_id)).state in ON_NODES
    assert release(gw, t.task_id).state == pb.TASK_STATE_RELEASED


def test_gpu_slice_lands_on_one_card_of_the_gpu_dc(gw):
    t = submit(gw, task(cores=4, mem_gib=8, gpus=2, gpu_pct=50, gpu_mem_gib=4)).task
    assert t.state == pb.TASK_STATE_PLACED and t.datacenter == "gpu"
    (a,) = t.assignments
    assert len(a.gpus) == 2 and {g.card for g in a.gpus} == {0, 1}
    assert all(g.core_percent == 50 and g.memory_mib == 4096 and g.model == "T4" for g in a.gpus)
    release(gw, t.task_id)


def test_impossible_task_is_rejected_with_reasons(gw):
    t = submit(gw, task(cores=8, gpus=4, gpu_pct=100, gpu_mem_gib=8)).task  # no node has 4 GPUs
    assert t.state == pb.TASK_STATE_REJECTED
    assert "gpu: no node of gpu has 4 GPUs (max 2)" in t.reason
    assert {e.datacenter for e in t.explanation.excluded} == {"cheap", "near", "gpu"}
    too_big = submit(gw, task(cores=1, mem_gib=300)).task  # 300 GiB: more than any node has (256)
    assert too_big.state == pb.TASK_STATE_REJECTED and "memory_mib 307200 per node exceeds" in too_big.reason


def test_network_requirements_filter_data_centers(gw):
    # from s: cheap is 1.0 ms away (via a), near 0.5 ms, gpu 1.5 ms (s-a-b-c); allow 0.8 ms
    t = submit(gw, task(cores=1, network=pb.NetworkRequirements(max_latency_ms=0.8))).task
    assert t.state == pb.TASK_STATE_PLACED and t.datacenter == "near"
    reasons = {e.datacenter: e.reason for e in t.explanation.excluded}
    assert reasons["cheap"].startswith("path latency 1 ms > max_latency_ms 0.8")
    release(gw, t.task_id)


def test_task_larger_than_a_server_is_split_into_8_core_subtasks(gw):
    t = submit(gw, task(cores=40, mem_gib=40)).task  # > 24 cores: 8+8+8+8+8 (paper 003)
    assert t.state == pb.TASK_STATE_PLACED and t.datacenter == "cheap"
    assert [a.resources.cpu_milli for a in t.assignments] == [8000] * 5
    assert sum(a.resources.memory_mib for a in t.assignments) == 40 * 1024
    assert any("split into 5 parts" in n for n in t.explanation.notes)
    release(gw, t.task_id)


def test_replicas_are_placed_with_the_state_updated_between_them(gw, stack):
    t = submit(gw, task(cores=20, mem_gib=8, replicas=4)).task  # 4 × 20 cores: one per 24-core node
    assert t.state == pb.TASK_STATE_PLACED and t.datacenter == "cheap"
    assert sorted(a.replica for a in t.assignments) == [0, 1, 2, 3]
    assert len({a.node for a in t.assignments}) == 4  # two replicas never share a node's last 4 cores
    assert free_cores(stack, "cheap") == 4 * 4000
    release(gw, t.task_id)
    assert free_cores(stack, "cheap") == 4 * 24000


# -- validation and idempotency -----------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "field"), [
    (task(cores=-1), "resources.cpu_milli"),
    (task(cores=0, mem_gib=1), "resources.cpu_milli"),
    (task(gpus=1, gpu_pct=150), "resources.gpu_core_percent"),
    (task(runtime_s=-1), "runtime_s"),
    (task(tenant="Not A Label"), "tenant"),
    (task(replicas=10_000), "replicas"),
    (task(entry_vertex="atlantis"), "task.entry_vertex"),
    (task(network=pb.NetworkRequirements(max_loss_percent=120)), "network.max_loss_percent"),
    (task(request_id="bad id with spaces"), "request_id"),
])
def test_invalid_input_is_rejected_naming_the_field(gw, spec, field):
    before = len(gw.List(gateway_pb2.ListRequest(limit=1000)).tasks)
    with pytest.raises(grpc.RpcError) as err:
        submit(gw, spec)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}:")
    assert len(gw.List(gateway_pb2.ListRequest(limit=1000)).tasks) == before  # nothing half-written


@pytest.mark.parametrize("token", ["garbage", "zzz", "t01", "j0000000000zz"])
def test_a_page_token_no_list_answered_is_invalid_not_a_silent_restart_or_end(gw, token):
    """("garbage" sorted before every task id: the listing restarted from the first task; "zzz" after them: an
    empty page, as if there were no more.)"""
    for call, request in ((gw.List, gateway_pb2.ListRequest), (gw.ListJobs, gateway_pb2.ListJobsRequest)):
        with pytest.raises(grpc.RpcError) as err:
            call(request(page_token=token), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("page_token:")
    first = gw.List(gateway_pb2.ListRequest(limit=1), timeout=10)
    if first.next_page_token:  # a token the gateway made is taken
        gw.List(gateway_pb2.ListRequest(limit=1, page_token=first.next_page_token), timeout=10)


def test_a_full_last_page_has_no_next_page_token(gw):
    """(A page of exactly `limit` items always carried a token, and the next page came back empty.)"""
    ids = sorted(submit(gw, task(cores=0.1, mem_gib=0.1, tenant="pages")).task.task_id for _ in range(3))
    try:
        whole = gw.List(gateway_pb2.ListRequest(tenant="pages", limit=3), timeout=10)
        assert [t.task_id for t in whole.tasks] == ids and not whole.next_page_token
        first = gw.List(gateway_pb2.ListRequest(tenant="pages", limit=2), timeout=10)
        assert [t.task_id for t in first.tasks] == ids[:2] and first.next_page_token == ids[1]
        last = gw.List(gateway_pb2.ListRequest(tenant="pages", limit=2, page_token=first.next_page_token), timeout=10)
        assert [t.task_id for t in last.tasks] == ids[2:] and not last.next_page_token
    finally:
        for task_id in ids:
            release(gw, task_id)


def test_unknown_selector_method_and_missing_task(gw):
    with pytest.raises(grpc.RpcError) as err:
        submit(gw, task(), method="cheapest")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("selector_method")
    with pytest.raises(grpc.RpcError) as err:
        gw.Get(gateway_pb2.GetRequest(task_id="t-nope"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_retried_request_id_returns_the_first_answer(gw, stack):
    spec = task(cores=3, request_id="job-42-attempt", tenant="team-a")
    first = submit(gw, spec)
    again = submit(gw, spec)
    assert not first.duplicate and again.duplicate
    assert again.task.task_id == first.task.task_id
    assert list(again.task.assignments) == list(first.task.assignments)
    held = [t for t in gw.List(gateway_pb2.ListRequest(tenant="team-a", limit=100)).tasks]
    assert [t.task_id for t in held] == [first.task.task_id]  # placed once
    # the same request id under another tenant is another request
    other = submit(gw, task(cores=3, request_id="job-42-attempt", tenant="team-b"))
    assert other.task.task_id != first.task.task_id and not other.duplicate
    # another task under the same id is a mistake the client hears of, not the first answer passed off as its own
    with pytest.raises(grpc.RpcError) as err:
        submit(gw, task(cores=4, runtime_s=60, request_id="job-42-attempt", tenant="team-a"))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS, err.value.details()
    assert err.value.details() == (f"request_id 'job-42-attempt' was used for another task ({first.task.task_id}: "
                                   "resources, runtime_s differ); a new task needs a new request_id")
    for t in (first.task, other.task):
        release(gw, t.task_id)
    assert release(gw, first.task.task_id).state == pb.TASK_STATE_RELEASED  # releasing twice is a no-op


# -- selector methods and WAN updates -----------------------------------------------------------------------


def test_selector_methods_rank_differently(gw):
    spec = task(cores=1, data_size_mb=50_000)  # 50 GB: the path matters
    by = {m: submit(gw, spec, m).task for m in ("min-cost", "spf")}
    assert by["spf"].explanation.ranking[0].datacenter == "near"  # nearest first
    assert by["spf"].explanation.selector_method == "spf"
    costs = {c.datacenter: c.total_cost for c in by["min-cost"].explanation.ranking}
    assert by["min-cost"].datacenter == min(costs, key=costs.get)
    for t in by.values():
        release(gw, t.task_id)


def test_link_update_on_the_stream_reroutes(gw, stack, redis_url):
    import json

    import redis as redis_sync

    before = submit(gw, task(cores=1)).task
    assert list(before.explanation.ranking[0].path.vertices) == ["s", "a", "b"]
    client = redis_sync.Redis.from_url(redis_url)
    client.xadd(f"{stack.config.prefix}:links", {"m": json.dumps({"a": "a", "b": "b", "latency_ms": 50.0})})
    deadline = time.time() + 10
    while time.time() < deadline:
        after = submit(gw, task(cores=1)).task
        release(gw, after.task_id)
        path = {c.datacenter: list(c.path.vertices) for c in after.explanation.ranking}
        if path["cheap"] == ["s", "c", "b"]:  # 500 km + 100 km = 3 ms now beats 0.5 + 50 ms
            break
        time.sleep(0.1)
    assert path["cheap"] == ["s", "c", "b"]
    client.xadd(f"{stack.config.prefix}:links", {"m": json.dumps({"a": "a", "b": "b", "latency_ms": 0.5})})
    release(gw, before.task_id)


# -- deferral, crash recovery, fallback -----------------------------------------------------------------------


def test_full_fleet_defers_and_places_after_a_release(gw, stack):
    held = []
    while True:  # fill every DC with whole-node tasks: cheap first, then the fallbacks
        t = submit(gw, task(cores=24, mem_gib=8)).task
        if t.state != pb.TASK_STATE_PLACED:
            break
        held.append(t)
    assert len(held) == 4 + 4 + 4  # cheap, near, gpu (32-core nodes hold one 24-core task each)
    assert t.state == pb.TASK_STATE_DEFERRED and t.datacenter == "cheap"
    assert any("no room now" in n for n in t.explanation.notes)
    another = submit(gw, task(cores=24, mem_gib=8)).task  # queued behind t, then released while waiting
    assert another.state == pb.TASK_STATE_DEFERRED and another.reason, another
    gone = release(gw, another.task_id)
    assert (gone.state, gone.reason) == (pb.TASK_STATE_RELEASED, "")  # not "no node has room now" for ever
    events = gw.Watch(gateway_pb2.WatchRequest(task_id=t.task_id, after_event_id="0"), timeout=20)
    victim = next(h for h in held if h.datacenter == "cheap")
    release(gw, victim.task_id)
    placed = gw.Get(gateway_pb2.GetRequest(task_id=t.task_id))
    assert placed.state == pb.TASK_STATE_PLACED and placed.assignments[0].node == victim.assignments[0].node
    kinds = []
    for ev in events:
        kinds.append(ev.kind)
        if ev.kind == "placed":
            break
    events.cancel()
    assert kinds == ["submitted", "dc_selected", "deferred", "placed"]
    for h in [*held, placed]:
        release(gw, h.task_id)


def test_a_task_only_a_stopped_placers_dc_can_hold_is_unavailable_and_a_retry_places_it_once(gw, stack):
    """Kubernetes leaves such a pod Pending; here nothing is kept and the client retries: a placer that is down
    (first its Place fails, then the selector leaves its DC out) is no verdict on the task."""
    spec = task(cores=1, gpus=1, gpu_pct=100, gpu_mem_gib=4, tenant="gpu-down", request_id="only-the-gpu-dc")
    held = placer(stack, "gpu").GetState(placer_pb2.PlacerStateRequest(), timeout=10).summary.running_tasks
    stack.stop_service("placer-gpu")

    def unavailable(spec: pb.TaskSpec) -> str:
        with pytest.raises(grpc.RpcError) as failed:
            submit(gw, spec)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
        return failed.value.details()

    try:
        first = unavailable(spec)
        assert first.startswith("no data center placed the task") and "gpu: its placer did not answer" in first, first
        assert "Redis" not in first, first  # it answers: only the placer is down
        # its retries wait for that attempt's unanswered Place to be released at gpu: UNAVAILABLE while gpu is down
        assert "previous attempt of request_id 'only-the-gpu-dc'" in unavailable(spec)
        probe = pb.TaskSpec()
        probe.CopyFrom(spec)
        probe.request_id = ""
        for _ in range(60):  # until the selector has left gpu out (three missed summaries)
            if "gpu could hold it once its placer serves again" in (detail := unavailable(probe)):
                break
            time.sleep(1)
        assert "gpu could hold it once its placer serves again" in detail, detail
        assert not gw.List(gateway_pb2.ListRequest(tenant="gpu-down"), timeout=10).tasks  # nothing kept
    finally:
        stack.restart("placer-gpu")
    for _ in range(60):  # as a client retries: gpu confirms the releases and the selector hears from it again
        try:
            reply = submit(gw, spec)
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc.details()
            time.sleep(1)
    assert reply.task.state == pb.TASK_STATE_PLACED and reply.task.datacenter == "gpu" and not reply.duplicate
    assert [t.task_id for t in gw.List(gateway_pb2.ListRequest(tenant="gpu-down"), timeout=10).tasks] == \
        [reply.task.task_id]
    gpu = placer(stack, "gpu").GetState(placer_pb2.PlacerStateRequest(), timeout=10).summary
    assert gpu.running_tasks == held + 1  # the failed attempts placed nothing there
    release(gw, reply.task.task_id)


def test_a_task_is_not_queued_at_a_full_dc_while_a_placer_that_might_take_it_is_down(gw, stack):
    """Queued, a task stays at that DC even once the stopped placer serves again with room: while any DC that
    could hold it is unanswered, a Submit that finds the others full gets UNAVAILABLE instead."""
    tenant = "queue-while-down"
    stack.stop_service("placer-cheap")
    try:
        filled = [submit(gw, task(cores=24, tenant=tenant)).task for _ in range(8)]  # near's 4 nodes, gpu's 4
        assert sorted((t.state, t.datacenter) for t in filled) == [(pb.TASK_STATE_PLACED, "gpu")] * 4 \
            + [(pb.TASK_STATE_PLACED, "near")] * 4
        with pytest.raises(grpc.RpcError) as failed:
            submit(gw, task(cores=24, tenant=tenant, request_id="after-the-fill"))
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE and "cheap" in failed.value.details()
        assert len(gw.List(gateway_pb2.ListRequest(tenant=tenant), timeout=10).tasks) == 8  # nothing queued
    finally:
        stack.restart("placer-cheap")
    for _ in range(60):  # the client's retry, once cheap serves again: placed there
        try:
            reply = submit(gw, task(cores=24, tenant=tenant, request_id="after-the-fill"))
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc.details()
            time.sleep(1)
    assert reply.task.state == pb.TASK_STATE_PLACED and reply.task.datacenter == "cheap"
    for t in gw.List(gateway_pb2.ListRequest(tenant=tenant), timeout=10).tasks:
        release(gw, t.task_id)


def test_a_replay_rides_out_a_placer_restart_and_submits_each_task_once(gw, stack):
    """`hsched replay` retries UNAVAILABLE as a client would, with a request_id per task: a placer that is down
    for a while costs retries, not errors or second tasks."""
    from hsched.domain.resources import Resources
    from hsched.domain.task import TaskSpec
    from hsched.replay import TraceTask, replay

    gpu_task = TaskSpec(Resources(1000, 1024, gpu_count=1, gpu_core_percent=50, gpu_memory_mib=1024),
                        runtime_s=3600, tenant="replay-gpu-down")
    tasks = [TraceTask(gpu_task, arrival_s=i * 0.1, runtime_s=3600) for i in range(4)]
    stack.stop_service("placer-gpu")
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(
        stats=asyncio.run(replay(stack.gateway, tasks, duration_s=0.3, concurrency=4, release=False))))
    try:
        thread.start()
        time.sleep(3)  # every Submit has failed at least once by now
    finally:
        stack.restart("placer-gpu")
    thread.join(120)
    stats = result["stats"]
    assert not stats.errors and stats.retried > 0 and stats.outcomes == {"placed": 4}, (stats.errors, stats.outcomes)
    listed = gw.List(gateway_pb2.ListRequest(tenant="replay-gpu-down"), timeout=10).tasks
    assert sorted(t.task_id for t in listed) == sorted(stats.final) and len(listed) == 4
    for t in listed:
        release(gw, t.task_id)


def test_killed_placer_rebuilds_the_same_ledger_and_places_nothing_twice(gw, stack):
    tasks = [submit(gw, task(cores=c, mem_gib=2)).task for c in (3, 5, 7)]
    assert {t.datacenter for t in tasks} == {"cheap"}, [list(t.explanation.notes) for t in tasks]
    before = placer(stack, "cheap").GetState(placer_pb2.PlacerStateRequest(include_nodes=True), timeout=10)
    stack.kill("placer-cheap")
    # while it is down, the gateway falls back to the next-ranked DC and says why
    t = submit(gw, task(cores=1)).task
    assert t.state == pb.TASK_STATE_PLACED and t.datacenter != "cheap"
    assert any(n.startswith("cheap: placer unavailable") for n in t.explanation.notes)
    release(gw, t.task_id)
    stack.restart("placer-cheap")  # a standby (NOT_SERVING) until the dead placer's lease lapses, then SERVING
    after = placer(stack, "cheap").GetState(placer_pb2.PlacerStateRequest(include_nodes=True), timeout=10)
    assert [n.free for n in after.nodes] == [n.free for n in before.nodes]
    assert after.summary.running_tasks == before.summary.running_tasks
    assert after.summary.fencing_token > before.summary.fencing_token
    # a retried Place for a task the ledger already holds returns that placement, allocating nothing
    again = placer(stack, "cheap").Place(placer_pb2.PlaceRequest(task_id=tasks[0].task_id, task=tasks[0].spec))
    assert again.outcome == placer_pb2.PLACE_OUTCOME_PLACED and list(again.assignments) == list(tasks[0].assignments)
    assert free_cores(stack, "cheap") == sum(n.free.cpu_milli for n in before.nodes)
    for t in tasks:
        release(gw, t.task_id)
    assert free_cores(stack, "cheap") == 4 * 24000


# -- observability ------------------------------------------------------------------------------------------


def test_one_submit_is_one_trace_across_all_four_services(gw, otlp):
    receiver, _ = otlp
    t = submit(gw, task(cores=1)).task
    deadline = time.time() + 15
    services: set[str] = set()
    while time.time() < deadline:
        with receiver.lock:
            submit_traces = {tid for svc, tid, name in receiver.spans
                             if svc == "gateway" and name == "hsched.v1.Gateway/Submit"}
            by_trace = {tid: {svc for svc, t2, _ in receiver.spans if t2 == tid} for tid in submit_traces}
        services = max(by_trace.values(), key=len, default=set())
        if {"gateway", "selector", "thermal"} <= services and any(s.startswith("placer-") for s in services):
            break
        time.sleep(0.2)
    assert {"gateway", "selector", "thermal"} <= services
    assert any(s.startswith("placer-") for s in services)
    release(gw, t.task_id)


def test_placer_can_ask_the_thermal_service_instead_of_its_own_room_model(redis_url):
    """--thermal-guard service: the batch check goes over gRPC to the thermal service (the default runs the same
    library in-process); the answer carries the same thermal effect."""
    import urllib.request

    with small_fleet_stack(redis_url, "stack-guard", extra_env={"HSCHED_THERMAL_GUARD": "service"}) as s, \
            grpc.insecure_channel(s.gateway) as ch:
        t = submit(gateway_pb2_grpc.GatewayStub(ch), task(cores=2)).task
        assert t.state == pb.TASK_STATE_PLACED
        assert t.explanation.thermal.redline_c == 27.0
        assert t.explanation.thermal.max_inlet_after_c >= t.explanation.thermal.max_inlet_before_c
        url = f"http://127.0.0.1:{s.services['thermal'].metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        assert 'method="hsched.v1.Thermal/Predict"' in text


def test_metrics_endpoints_expose_paper_002_names(stack, gw):
    """With --metrics-per-card (HSCHED_METRICS_PER_CARD): one series per card, in base units and as paper 002's
    GPUDevice* aliases, under the naming rules with node/card bounded by the fleet (4 nodes x 2 cards)."""
    import urllib.request

    from hsched.telemetry.naming import naming_problems

    t = submit(gw, task(cores=2, gpus=1, gpu_pct=30, gpu_mem_gib=2)).task
    time.sleep(0.2)
    text = urllib.request.urlopen(f"http://127.0.0.1:{stack.services['placer-gpu'].metrics_port}/metrics").read()
    text = text.decode()
    card = '{card="0",datacenter="gpu",model="T4",node="gpu-r00-s00"}'
    assert f"GPUDeviceCoreAllocated{card} 30.0" in text
    assert f"hsched_gpu_card_core_allocated_ratio{card} 0.3" in text
    assert f"GPUDeviceMemoryAllocated{card} 2048.0" in text
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert float(values[f"hsched_gpu_card_memory_allocated_bytes{card}"]) == 2 * 2**30
    assert float(values[f"hsched_gpu_card_memory_capacity_bytes{card}"]) == 16 * 2**30
    assert "ClusterGPUCorePercentage" in text and "deviceidx" not in text
    bounds = {"datacenter": 1, "node": 4, "card": 2, "model": 1, "method": 16, "code": 17, "le": 14,
              "policy": 1, "requested": 1}
    assert naming_problems(text, bounds) == []
    # the Place that came in a batch is counted as its own call, under its own method
    placed = re.search(r'hsched_rpc_server_requests_total\{code="OK",method="hsched.v1.Placer/Place"\} (\S+)', text)
    assert placed and float(placed.group(1)) >= 1
    sel = urllib.request.urlopen(f"http://127.0.0.1:{stack.services['selector'].metrics_port}/metrics").read()
    assert 'UserToClusterLatency{datacenter="near",entry_vertex="s"} 0.5' in sel.decode()
    assert 'hsched_user_to_dc_latency_seconds{datacenter="near",entry_vertex="s"} 0.0005' in sel.decode()
    release(gw, t.task_id)
    gateway = urllib.request.urlopen(f"http://127.0.0.1:{stack.services['gateway'].metrics_port}/metrics").read()
    sent = {line.rpartition(" ")[0]: float(line.rpartition(" ")[2]) for line in gateway.decode().splitlines()
            if line.startswith("hsched_gateway_batch")}
    for method, peer in (("Place", "gpu"), ("Release", "gpu"), ("SelectDataCenter", "selector")):
        calls = sent[f'hsched_gateway_batched_calls_total{{method="{method}",peer="{peer}"}}']
        assert calls >= 1 and 1 <= sent[f'hsched_gateway_batches_total{{method="{method}",peer="{peer}"}}'] <= calls


# -- invariants under random load -----------------------------------------------------------------------------


def _check_ledgers_match_tasks(gw, stack) -> None:
    """Every node and card: 0 <= free <= capacity, and capacity - free == what the placed tasks hold."""
    placed = [t for t in gw.List(gateway_pb2.ListRequest(state=pb.TASK_STATE_PLACED, limit=1000)).tasks]
    for dc in ("cheap", "near", "gpu"):
        state = placer(stack, dc).GetState(placer_pb2.PlacerStateRequest(include_nodes=True), timeout=10)
        held_cpu, held_mem, held_core, held_gmem = {}, {}, {}, {}
        for t in placed:
            if t.datacenter != dc:
                continue
            for a in t.assignments:
                held_cpu[a.node] = held_cpu.get(a.node, 0) + a.resources.cpu_milli
                held_mem[a.node] = held_mem.get(a.node, 0) + a.resources.memory_mib
                for g in a.gpus:
                    held_core[a.node, g.card] = held_core.get((a.node, g.card), 0) + g.core_percent
                    held_gmem[a.node, g.card] = held_gmem.get((a.node, g.card), 0) + g.memory_mib
        for n in state.nodes:
            assert 0 <= n.free.cpu_milli <= n.capacity.cpu_milli
            assert n.capacity.cpu_milli - n.free.cpu_milli == held_cpu.get(n.name, 0)
            assert n.capacity.memory_mib - n.free.memory_mib == held_mem.get(n.name, 0)
            for c in n.gpus:
                assert 0 <= c.core_percent_free <= 100 and 0 <= c.memory_mib_free <= c.memory_mib_capacity
                assert 100 - c.core_percent_free == held_core.get((n.name, c.card), 0)
                assert c.memory_mib_capacity - c.memory_mib_free == held_gmem.get((n.name, c.card), 0)


def test_random_submit_release_sequences_never_over_allocate(gw, stack):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    gpu_task = st.builds(lambda c, pct, mem, n: task(cores=c, mem_gib=4, gpus=n, gpu_pct=pct, gpu_mem_gib=mem),
                         st.integers(1, 16), st.integers(10, 100), st.sampled_from([1, 4, 8, 16]), st.integers(1, 2))
    cpu_task = st.builds(lambda c, m, r: task(cores=c, mem_gib=m, replicas=r),
                         st.integers(1, 40), st.integers(1, 64), st.integers(1, 3))
    ops = st.lists(st.one_of(gpu_task, cpu_task, st.integers(0, 50)), min_size=5, max_size=25)

    @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
    @given(ops)
    def run(sequence):
        held: list[str] = []
        try:
            for op in sequence:
                if isinstance(op, int):  # release one of the held tasks
                    if held:
                        release(gw, held.pop(op % len(held)))
                else:
                    t = submit(gw, op).task
                    if t.state in (pb.TASK_STATE_PLACED, pb.TASK_STATE_DEFERRED):
                        held.append(t.task_id)
                _check_ledgers_match_tasks(gw, stack)
        finally:
            for task_id in held:
                release(gw, task_id)
        for dc in ("cheap", "near", "gpu"):  # everything released: every core is free again
            state = placer(stack, dc).GetState(placer_pb2.PlacerStateRequest(include_nodes=True), timeout=10)
            assert all(n.free.cpu_milli == n.capacity.cpu_milli for n in state.nodes)
            assert not state.deferred_task_ids

    run()


def test_trace_replay_drives_real_tasks_and_summarises(stack, redis_url):
    import asyncio

    from hsched.replay import STATE_COLUMNS, dc_summaries, load_trace, replay, summary_rows, with_locations

    tasks = with_locations(load_trace("openb", 40), stack.fleet, seed=1)
    assert sum(t.spec.resources.gpu_count > 0 for t in tasks) > 20  # openb: mostly GPU pods
    stats = asyncio.run(replay(stack.gateway, tasks, duration_s=2.0, concurrency=8))
    assert stats.submitted == 40 and not stats.errors
    assert stats.outcomes["placed"] + stats.outcomes["deferred"] + stats.outcomes["rejected"] == 40
    assert stats.outcomes["placed"] > 0
    rows = summary_rows(stats, asyncio.run(dc_summaries(redis_url, stack.config.prefix, stack.fleet)))
    by_dc = {r["datacenter"]: r for r in rows}
    assert set(by_dc) >= {"cheap", "near", "gpu"}
    assert sum(r[k] for r in rows for k in STATE_COLUMNS if k != "rejected") == 40 - stats.outcomes["rejected"]
    assert by_dc["gpu"]["pue"] is not None
    for task_id, task in stats.final.items():  # leave the fleet empty for the tests after this one
        if task.state in (pb.TASK_STATE_PLACED, pb.TASK_STATE_RUNNING, pb.TASK_STATE_DEFERRED):
            with grpc.insecure_channel(stack.gateway) as ch:
                gateway_pb2_grpc.GatewayStub(ch).Release(gateway_pb2.ReleaseRequest(task_id=task_id))


def test_selector_outage_writes_nothing_and_a_retry_succeeds(gw, stack):
    spec = task(cores=1, request_id="retry-after-outage")
    before = len(gw.List(gateway_pb2.ListRequest(limit=1000)).tasks)
    stack.kill("selector")
    try:
        with pytest.raises(grpc.RpcError) as err:
            submit(gw, spec)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert len(gw.List(gateway_pb2.ListRequest(limit=1000)).tasks) == before  # nothing half-written
    finally:
        stack.restart("selector")
    deadline = time.time() + 10
    while True:  # the selector needs its first DC summaries (placers heartbeat every few seconds)
        reply = submit(gw, spec)
        if reply.task.state == pb.TASK_STATE_PLACED or time.time() > deadline:
            break
        time.sleep(0.5)
    assert reply.task.state == pb.TASK_STATE_PLACED and not reply.duplicate
    release(gw, reply.task.task_id)


def test_cli_task_commands_against_the_gateway(stack, capsys):
    from hsched import cli

    assert cli.main(["submit", "--gateway", stack.gateway, "--cpu", "2", "--memory-gib", "4",
                     "--request-id", "cli-1"]) == 0
    line = capsys.readouterr().out.strip()
    task_id, state = line.split()[:2]
    assert state == "PLACED" and " cheap " in f" {line} "
    assert cli.main(["get", "--gateway", stack.gateway, task_id, "--json"]) == 0
    assert '"state": "TASK_STATE_PLACED"' in capsys.readouterr().out
    assert cli.main(["list", "--gateway", stack.gateway, "--state", "placed"]) == 0
    assert task_id in capsys.readouterr().out
    assert cli.main(["release", "--gateway", stack.gateway, task_id]) == 0
    assert "RELEASED" in capsys.readouterr().out
    assert cli.main(["get", "--gateway", stack.gateway, "t-unknown"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err
