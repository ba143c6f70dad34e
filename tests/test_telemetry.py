"""hsched.telemetry: trace context across real grpc.aio hops, span status, Prometheus exposition."""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request
from collections.abc import AsyncIterator, Callable
from typing import Any, NamedTuple

import grpc
import grpc.aio
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from hsched.telemetry import (
    Metrics,
    MetricsServer,
    client_interceptors,
    instrumented,
    metrics,
    server_interceptor,
    setup_tracing,
    traced_channel,
)
from hsched.telemetry.naming import naming_problems
from hsched.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    selector_pb2,
    selector_pb2_grpc,
    thermal_pb2,
    thermal_pb2_grpc,
)

SELECT = "hsched.v1.Selector/SelectDataCenter"
GET_STATE = "hsched.v1.Thermal/GetState"
WATCH = "hsched.v1.Gateway/Watch"


@pytest.fixture
def spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()


def provider(service: str, exporter: InMemorySpanExporter) -> TracerProvider:
    """One provider per in-process 'service' (its own service.name), all exporting to the same memory."""
    return setup_tracing(service, "none", extra_exporter=exporter, set_global=False)


async def serve(add: Callable[[grpc.aio.Server], None], *interceptors: Any) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(interceptors=interceptors)
    add(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


WIRINGS = ["interceptors", "wrapped"]  # grpc.aio interceptors, or instrumented() + traced_channel() (hsched.rpc)


async def serve_wired(add: Callable[[grpc.aio.Server], None], wiring: str, tracer_provider: TracerProvider,
                      metrics: Metrics | None = None) -> tuple[grpc.aio.Server, str]:
    if wiring == "interceptors":
        return await serve(add, server_interceptor(tracer_provider, metrics=metrics))
    server = grpc.aio.server()
    add(instrumented(server, tracer_provider, metrics))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def channel_wired(addr: str, wiring: str, tracer_provider: TracerProvider) -> Any:
    if wiring == "interceptors":
        return grpc.aio.insecure_channel(addr, interceptors=client_interceptors(tracer_provider))
    return traced_channel(grpc.aio.insecure_channel(addr), tracer_provider)


def by_name_and_kind(finished: tuple[ReadableSpan, ...]) -> dict[tuple[str, SpanKind], ReadableSpan]:
    index = {(s.name, s.kind): s for s in finished}
    assert len(index) == len(finished), [s.name for s in finished]
    return index


def assert_child(child: ReadableSpan, parent: ReadableSpan) -> None:
    assert child.parent is not None and child.parent.span_id == parent.context.span_id


class Thermal(thermal_pb2_grpc.ThermalServicer):
    async def GetState(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if request.datacenter == "bad":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "datacenter 'bad' is not in the fleet")
        if request.datacenter == "crash":
            raise RuntimeError("surrogate diverged")
        return thermal_pb2.RoomState(datacenter=request.datacenter, pue=1.3)


class Selector(selector_pb2_grpc.SelectorServicer):
    """Asks thermal about the task's DC, as a real hop would, and forwards its failure."""

    def __init__(self, thermal: thermal_pb2_grpc.ThermalStub) -> None:
        self.thermal = thermal
        self.seen_metadata: dict[str, str] = {}

    async def SelectDataCenter(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.seen_metadata = {k: v for k, v in context.invocation_metadata()}
        try:
            room = await self.thermal.GetState(thermal_pb2.ThermalStateRequest(datacenter=request.task.name))
        except grpc.aio.AioRpcError as err:
            await context.abort(err.code(), err.details())
        return selector_pb2.SelectResponse(method=f"pue={room.pue}")


class Chain(NamedTuple):
    stub: selector_pb2_grpc.SelectorStub
    selector: Selector
    thermal_metrics: Metrics
    tracer: trace.Tracer  # the 'client' service's, for the root span

    async def select(self, dc: str) -> ReadableSpan:
        """One SelectDataCenter inside a root span; returns the (finished) root."""
        with self.tracer.start_as_current_span("submit") as root:
            request = selector_pb2.SelectRequest(task=common_pb2.TaskSpec(name=dc))
            await self.stub.SelectDataCenter(request, metadata=(("x-request-id", "r-1"),), timeout=5)
        return root  # type: ignore[return-value]


@contextlib.asynccontextmanager
async def start_chain(spans: InMemorySpanExporter, selector_tp: TracerProvider,
                      wiring: str = "interceptors") -> AsyncIterator[Chain]:
    """client -> selector -> thermal, each with its own tracer provider (service.name)."""
    thermal_metrics = Metrics(process_metrics=False)
    thermal_server, thermal_addr = await serve_wired(
        lambda s: thermal_pb2_grpc.add_ThermalServicer_to_server(Thermal(), s), wiring,
        provider("thermal", spans), thermal_metrics)
    to_thermal = channel_wired(thermal_addr, wiring, selector_tp)
    selector = Selector(thermal_pb2_grpc.ThermalStub(to_thermal))
    selector_server, selector_addr = await serve_wired(
        lambda s: selector_pb2_grpc.add_SelectorServicer_to_server(selector, s), wiring, selector_tp)
    client_tp = provider("client", spans)
    client = channel_wired(selector_addr, wiring, client_tp)
    try:
        yield Chain(
            selector_pb2_grpc.SelectorStub(client), selector, thermal_metrics, client_tp.get_tracer("test")
        )
    finally:
        await client.close()
        await to_thermal.close()
        await selector_server.stop(None)
        await thermal_server.stop(None)


@pytest.fixture(params=WIRINGS)
async def chain(request: pytest.FixtureRequest, spans: InMemorySpanExporter) -> AsyncIterator[Chain]:
    async with start_chain(spans, provider("selector", spans), request.param) as c:
        yield c


async def test_one_trace_across_two_hops(chain: Chain, spans: InMemorySpanExporter) -> None:
    root = await chain.select("dc-1")

    finished = spans.get_finished_spans()
    assert len(finished) == 5
    assert {s.context.trace_id for s in finished} == {root.context.trace_id}
    index = by_name_and_kind(finished)
    sel_client, sel_server = index[SELECT, SpanKind.CLIENT], index[SELECT, SpanKind.SERVER]
    th_client, th_server = index[GET_STATE, SpanKind.CLIENT], index[GET_STATE, SpanKind.SERVER]
    assert_child(sel_client, root)
    assert_child(sel_server, sel_client)
    assert_child(th_client, sel_server)  # the handler's outgoing call continues the server span
    assert_child(th_server, th_client)
    services = [s.resource.attributes["service.name"] for s in (sel_client, sel_server, th_client, th_server)]
    assert services == ["client", "selector", "selector", "thermal"]
    for span in (sel_client, sel_server):
        assert dict(span.attributes or {}) == {
            "rpc.system": "grpc",
            "rpc.service": "hsched.v1.Selector",
            "rpc.method": "SelectDataCenter",
            "rpc.grpc.status_code": 0,
        }
        assert span.status.status_code is StatusCode.UNSET
    # the caller's own metadata arrives next to the injected W3C header
    assert chain.selector.seen_metadata["x-request-id"] == "r-1"
    ctx = sel_client.context
    traceparent = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
    assert chain.selector.seen_metadata["traceparent"] == traceparent


@pytest.mark.parametrize("wiring", WIRINGS)
async def test_a_hop_without_exporter_passes_the_trace_through(spans: InMemorySpanExporter, wiring: str) -> None:
    async with start_chain(spans, setup_tracing("selector", "none", set_global=False), wiring) as chain:
        root = await chain.select("dc-1")

    index = by_name_and_kind(spans.get_finished_spans())
    assert set(index) == {
        ("submit", SpanKind.INTERNAL),
        (SELECT, SpanKind.CLIENT),
        (GET_STATE, SpanKind.SERVER),
    }
    assert {s.context.trace_id for s in index.values()} == {root.context.trace_id}
    assert_child(index[GET_STATE, SpanKind.SERVER], index[SELECT, SpanKind.CLIENT])  # selector made no span


async def test_abort_status_is_recorded_on_every_span_of_the_trace(
    chain: Chain, spans: InMemorySpanExporter
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await chain.select("bad")
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT

    finished = spans.get_finished_spans()
    assert len(finished) == 5 and len({s.context.trace_id for s in finished}) == 1
    index = by_name_and_kind(finished)
    for key in [(SELECT, SpanKind.CLIENT), (SELECT, SpanKind.SERVER), (GET_STATE, SpanKind.CLIENT)]:
        assert index[key].attributes["rpc.grpc.status_code"] == 3, key
        assert index[key].status.status_code is StatusCode.ERROR, key
    th_server = index[GET_STATE, SpanKind.SERVER]
    assert th_server.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert th_server.status.status_code is StatusCode.ERROR
    assert th_server.status.description == "INVALID_ARGUMENT: datacenter 'bad' is not in the fleet"
    assert not th_server.events  # an abort is a status, not an exception

    rendered = chain.thermal_metrics.render()
    assert f'hsched_rpc_server_requests_total{{code="INVALID_ARGUMENT",method="{GET_STATE}"}} 1.0' in rendered
    assert f'hsched_rpc_server_duration_seconds_count{{method="{GET_STATE}"}} 1.0' in rendered


async def test_unexpected_exception_is_recorded_as_unknown(chain: Chain, spans: InMemorySpanExporter) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await chain.select("crash")
    assert caught.value.code() is grpc.StatusCode.UNKNOWN

    th_server = by_name_and_kind(spans.get_finished_spans())[GET_STATE, SpanKind.SERVER]
    assert th_server.attributes["rpc.grpc.status_code"] == grpc.StatusCode.UNKNOWN.value[0]
    assert th_server.status.status_code is StatusCode.ERROR
    [event] = th_server.events
    assert event.name == "exception"
    assert event.attributes["exception.type"] == "RuntimeError"
    assert event.attributes["exception.message"] == "surrogate diverged"


class Gateway(gateway_pb2_grpc.GatewayServicer):
    """Watch in both server-streaming styles; records which span was current inside the handler."""

    def __init__(self) -> None:
        self.current_span_ids: list[int] = []

    def _event(self, request: Any, n: int) -> Any:
        self.current_span_ids.append(trace.get_current_span().get_span_context().span_id)
        return common_pb2.TaskEvent(event_id=f"{n}-0", task_id=request.task_id, kind="placed")

    async def Watch(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        for n in (1, 2):
            yield self._event(request, n)
        if request.tenant == "fail":
            await context.abort(grpc.StatusCode.NOT_FOUND, "stream ended")


class WritingGateway(Gateway):
    async def Watch(self, request: Any, context: grpc.aio.ServicerContext) -> None:  # type: ignore[override]
        for n in (1, 2):
            await context.write(self._event(request, n))
        if request.tenant == "fail":
            await context.abort(grpc.StatusCode.NOT_FOUND, "stream ended")


@pytest.mark.parametrize("servicer", [Gateway, WritingGateway], ids=["async-generator", "context-write"])
@pytest.mark.parametrize("tenant", ["", "fail"])
async def test_server_streaming_keeps_the_trace(
    servicer: type[Gateway], tenant: str, spans: InMemorySpanExporter
) -> None:
    gateway = servicer()
    server, addr = await serve(
        lambda s: gateway_pb2_grpc.add_GatewayServicer_to_server(gateway, s),
        server_interceptor(provider("gateway", spans)),
    )
    client_tp = provider("client", spans)
    try:
        async with grpc.aio.insecure_channel(addr, interceptors=client_interceptors(client_tp)) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            received: list[str] = []
            with client_tp.get_tracer("test").start_as_current_span("watch") as root:
                call = stub.Watch(gateway_pb2.WatchRequest(task_id="t-1", tenant=tenant))
                try:
                    async for event in call:
                        received.append(event.event_id)
                except grpc.aio.AioRpcError as err:
                    assert err.code() is grpc.StatusCode.NOT_FOUND
                assert await call.code() is (grpc.StatusCode.NOT_FOUND if tenant else grpc.StatusCode.OK)
    finally:
        await server.stop(None)

    assert received == ["1-0", "2-0"]
    finished = spans.get_finished_spans()
    assert len(finished) == 3 and {s.context.trace_id for s in finished} == {root.get_span_context().trace_id}
    index = by_name_and_kind(finished)
    client_span, server_span = index[WATCH, SpanKind.CLIENT], index[WATCH, SpanKind.SERVER]
    assert_child(client_span, index["watch", SpanKind.INTERNAL])
    assert_child(server_span, client_span)
    assert gateway.current_span_ids == [server_span.context.span_id] * 2
    expected = grpc.StatusCode.NOT_FOUND if tenant else grpc.StatusCode.OK
    for span in (client_span, server_span):
        assert span.attributes["rpc.grpc.status_code"] == expected.value[0]
        assert span.status.status_code is (StatusCode.ERROR if tenant else StatusCode.UNSET)


async def test_cancelled_stream_is_recorded_on_both_sides(spans: InMemorySpanExporter) -> None:
    class Endless(gateway_pb2_grpc.GatewayServicer):
        async def Watch(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            while True:
                yield common_pb2.TaskEvent(kind="placed")
                await asyncio.sleep(0.01)

    server, addr = await serve(
        lambda s: gateway_pb2_grpc.add_GatewayServicer_to_server(Endless(), s),
        server_interceptor(provider("gateway", spans)),
    )
    try:
        async with grpc.aio.insecure_channel(
            addr, interceptors=client_interceptors(provider("cli", spans))
        ) as ch:
            call = gateway_pb2_grpc.GatewayStub(ch).Watch(gateway_pb2.WatchRequest())
            assert (await call.read()).kind == "placed"
            call.cancel()
            for _ in range(200):  # the server learns of the cancellation asynchronously
                if len(spans.get_finished_spans()) == 2:
                    break
                await asyncio.sleep(0.01)
    finally:
        await server.stop(None)

    index = by_name_and_kind(spans.get_finished_spans())
    for kind in (SpanKind.CLIENT, SpanKind.SERVER):
        assert index[WATCH, kind].attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
        assert index[WATCH, kind].status.description.startswith("CANCELLED")


def test_setup_tracing_rejects_unknown_exporter(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="exporter"):
        setup_tracing("x", "jaeger", set_global=False)
    monkeypatch.setenv("HSCHED_TRACES", "zipkin")
    with pytest.raises(ValueError, match=r"exporter.*'zipkin'"):
        setup_tracing("x", set_global=False)


def test_console_exporter_from_env_prints_spans(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    monkeypatch.setenv("HSCHED_TRACES", "console")
    tp = setup_tracing("placer", set_global=False)
    tp.get_tracer("test").start_span("hsched.v1.Placer/Place").end()
    tp.force_flush()
    out = capsys.readouterr().out
    assert '"name": "hsched.v1.Placer/Place"' in out and '"service.name": "placer"' in out
    tp.shutdown()


def test_otlp_exporter_builds_without_a_collector() -> None:
    tp = setup_tracing("gateway", "otlp", "http://127.0.0.1:4317", set_global=False)
    tp.shutdown()  # nothing was recorded, so nothing is sent


def fetch(url: str) -> list[str]:
    with urllib.request.urlopen(url, timeout=5) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        return response.read().decode().splitlines()


def test_metrics_server_exposes_callback_gauges_and_counters() -> None:
    cards = {("dc-1", "node-0", 0, "A100"): 30.0, ("dc-1", "node-0", 1, "A100"): 0.0}
    preemptions = {"dc-1": 0}
    with MetricsServer(port=0, process_metrics=False) as server:
        assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}/metrics"
        server.register_gauge_family(*metrics.GPU_DEVICE_CORE_ALLOCATED, callback=lambda: list(cards.items()))
        server.register_counter_family(*metrics.HSCHED_PLACER_PREEMPTIONS,
                                       callback=lambda: [((dc,), n) for dc, n in preemptions.items()])
        restarts = server.counter(*metrics.HSCHED_SUPERVISOR_RESTARTS)
        restarts.labels("gateway").inc(2)
        assert server.counter(*metrics.HSCHED_SUPERVISOR_RESTARTS) is restarts  # shared, not duplicated

        lines = fetch(server.url)
        assert lines[1:4] == [
            "# TYPE GPUDeviceCoreAllocated gauge",
            'GPUDeviceCoreAllocated{card="0",datacenter="dc-1",model="A100",node="node-0"} 30.0',
            'GPUDeviceCoreAllocated{card="1",datacenter="dc-1",model="A100",node="node-0"} 0.0',
        ]
        assert lines[5:] == [
            "# TYPE hsched_placer_preemptions_total counter",
            'hsched_placer_preemptions_total{datacenter="dc-1"} 0.0',
            "# HELP hsched_supervisor_restarts_total Restarts of a stack service (by the supervisor or Stack.restart)",
            "# TYPE hsched_supervisor_restarts_total counter",
            'hsched_supervisor_restarts_total{service="gateway"} 2.0',
        ]

        cards[("dc-1", "node-0", 1, "A100")] = 55.0  # evaluated at scrape time: no gauge was touched
        preemptions["dc-1"] = 3
        text = fetch(server.url)
        assert 'GPUDeviceCoreAllocated{card="1",datacenter="dc-1",model="A100",node="node-0"} 55.0' in text
        assert 'hsched_placer_preemptions_total{datacenter="dc-1"} 3.0' in text


def test_naming_rules_name_each_broken_rule() -> None:
    bad = "\n".join([
        "# TYPE hsched_batches_total gauge", "hsched_batches_total 3",
        "# TYPE hsched_cpu_percentage gauge", 'hsched_cpu_percentage{datacenter="a"} 0.5',
        "# TYPE hsched_busy_ratio gauge", "hsched_busy_ratio 1.5",
        "# TYPE hsched_link_latency_ms gauge", "hsched_link_latency_ms 3",
        "# TYPE hsched_free_memory gauge", "hsched_free_memory 3",
        "# TYPE hsched_tasks gauge", 'hsched_tasks{datacenter=""} 1', 'hsched_tasks{datacenter="a"} 1',
        'hsched_tasks{datacenter="b"} 1',
        "# TYPE hsched_slices gauge", 'hsched_slices{task_id="t1"} 1',
        "# TYPE hsched_fine_seconds gauge", 'hsched_fine_seconds{datacenter="a"} 1',
        "# TYPE other_percentage gauge", "other_percentage 50",  # not ours: not checked
    ]) + "\n"
    assert naming_problems(bad, {"datacenter": 2}) == [
        "hsched_batches_total: a gauge must not end in _total (counters do)",
        "hsched_cpu_percentage: no percent in a name (a 0-1 value is a _ratio)",
        "hsched_busy_ratio{}: ratio 1.5 outside [0, 1]",
        "hsched_link_latency_ms: must end in _seconds (its base unit)",
        "hsched_free_memory: must end in _bytes or _ratio (its base unit)",
        "hsched_tasks: empty value of label 'datacenter'",
        "hsched_tasks: label 'datacenter' has 3 values, more than its bound 2",
        "hsched_slices: label 'task_id' has no cardinality bound",
    ]


def test_metrics_helpers_guard_names_and_survive_a_broken_callback() -> None:
    m = Metrics(process_metrics=False)
    m.counter("hsched_x_total", "x", ("a",))
    with pytest.raises(ValueError, match="hsched_x_total"):
        m.counter("hsched_x_total", "x", ("b",))
    with pytest.raises(ValueError, match="Duplicated"):
        m.register_gauge_family("hsched_x_total", "again", (), lambda: [])

    hist = m.histogram("hsched_wait_seconds", "wait", (), buckets=(0.1, 1.0))
    hist.observe(0.5)

    def broken() -> list[tuple[tuple[str, ...], float]]:
        raise RuntimeError("state being rebuilt")

    m.register_gauge_family(*metrics.HSCHED_DC_PUE, callback=broken)
    text = m.render()
    assert text.endswith(
        "# HELP hsched_dc_pue Power usage effectiveness of the room\n# TYPE hsched_dc_pue gauge\n"
    )
    assert 'hsched_wait_seconds_bucket{le="0.1"} 0.0\nhsched_wait_seconds_bucket{le="1.0"} 1.0' in text
    assert "hsched_wait_seconds_created" not in text


def test_paper_002_aliases_restate_hsched_families() -> None:
    specs = {v.name: v for v in vars(metrics).values() if isinstance(v, metrics.MetricSpec)}
    assert {"ClusterGPUMemoryPercentage", "GPUDeviceSharedNum", "UserToClusterPacketLoss"} <= set(
        metrics.PAPER_002_ALIASES)
    for alias, canonical in metrics.PAPER_002_ALIASES.items():
        assert alias in specs and (canonical is None or canonical in specs), alias
        assert canonical is None or specs[alias].labelnames == specs[canonical].labelnames, alias
