"""Batch streams (hsched.batching): concurrent calls coalesced into batches on one stream per peer, each
answered as if sent alone — its own result, its own error, its own deadline, its own trace. Against the real
placer service (in-process, real Redis) and, where a batch must be held up on purpose or the peer must go
away, a real gRPC server that is slow."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from hsched.batching import Coalescer, serve_batch
from hsched.state.redis import free_port
from hsched.telemetry import BatchedCalls
from hsched.v1 import common_pb2, placer_pb2, placer_pb2_grpc
from tests import inprocess
from tests.conftest import SMALL_FLEET

PLACE = "hsched.v1.Placer/Place"


def place_request(task_id: str, cores: int) -> placer_pb2.PlaceRequest:
    return placer_pb2.PlaceRequest(task_id=task_id, task=common_pb2.TaskSpec(
        resources=common_pb2.Resources(cpu_milli=cores * 1000, memory_mib=1024), runtime_s=60, data_size_mb=10))


@asynccontextmanager
async def placer_service(redis_url: str, prefix: str, tmp_path, datacenter: str = "cheap"):
    """The placer service in-process (services/placer/server.serve) for one DC of the small fleet."""
    from services.placer import server

    argv = ["--fleet", SMALL_FLEET, "--redis-url", redis_url, "--prefix", prefix, "--datacenter", datacenter]
    async with inprocess.service(server, argv, tmp_path / f"placer-{datacenter}.port") as target, \
            grpc.aio.insecure_channel(target) as channel:
        yield placer_pb2_grpc.PlacerStub(channel)


def coalescer(stub: placer_pb2_grpc.PlacerStub, **kwargs) -> Coalescer:
    return Coalescer(stub.PlaceBatch, placer_pb2.PlaceBatchRequest, PLACE, **kwargs)


async def test_concurrent_calls_share_batch_rpcs_and_each_gets_its_own_answer(redis_url, prefix, tmp_path):
    async with placer_service(redis_url, prefix, tmp_path) as stub:
        places = coalescer(stub)
        cores = [1 + i % 4 for i in range(40)]  # 100 of the DC's 96 free cores: some cannot be placed
        replies = await asyncio.gather(*(places.call(place_request(f"t{i}", c), 10) for i, c in enumerate(cores)))
        assert places.calls == 40
        assert places.batches < 40  # calls that arrived while a batch was on the way went out together
        placed = 0
        for c, reply in zip(cores, replies, strict=True):
            if reply.outcome == placer_pb2.PLACE_OUTCOME_PLACED:
                placed += c
                assert sum(a.resources.cpu_milli for a in reply.assignments) == c * 1000  # its own answer
            else:
                assert reply.outcome == placer_pb2.PLACE_OUTCOME_NO_ROOM and not reply.assignments
        state = await stub.GetState(placer_pb2.PlacerStateRequest(), timeout=5)
        assert placed * 1000 == state.summary.capacity.cpu_milli - state.summary.free.cpu_milli
        assert state.summary.running_tasks == sum(r.outcome == placer_pb2.PLACE_OUTCOME_PLACED for r in replies)


async def test_an_invalid_call_fails_alone_naming_the_field(redis_url, prefix, tmp_path):
    async with placer_service(redis_url, prefix, tmp_path) as stub:
        stream = stub.PlaceBatch(timeout=10)
        await stream.write(placer_pb2.PlaceBatchRequest(calls=[
            place_request("a", 1), place_request("", 1), place_request("c", 2)]))
        reply = await stream.read()
        await stream.done_writing()
        assert await stream.read() == grpc.aio.EOF and await stream.code() == grpc.StatusCode.OK
        kinds = [r.WhichOneof("result") for r in reply.results]
        assert kinds == ["response", "error", "response"]
        assert reply.results[1].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "task_id" in reply.results[1].error.message
        assert [r.response.outcome for r in (reply.results[0], reply.results[2])] == [placer_pb2.PLACE_OUTCOME_PLACED] * 2

        places = coalescer(stub)  # through the coalescer: the status a unary Place would have raised
        ok, bad = await asyncio.gather(places.call(place_request("d", 1), 10), places.call(place_request("", 1), 10),
                                       return_exceptions=True)
        assert ok.outcome == placer_pb2.PLACE_OUTCOME_PLACED
        assert isinstance(bad, grpc.aio.AioRpcError) and bad.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "task_id" in bad.details()
        state = await stub.GetState(placer_pb2.PlacerStateRequest(), timeout=5)
        assert state.summary.running_tasks == 3  # a, c and d: nothing of the invalid calls was written


async def test_a_batch_that_cannot_be_sent_fails_every_call_with_its_status():
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{free_port()}")  # nothing listens there
    places = coalescer(placer_pb2_grpc.PlacerStub(channel))
    results = await asyncio.gather(*(places.call(place_request(f"t{i}", 1), 2) for i in range(5)),
                                   return_exceptions=True)
    assert all(isinstance(r, grpc.aio.AioRpcError) and r.code() == grpc.StatusCode.UNAVAILABLE for r in results)
    await channel.close()


class SlowPlacer(placer_pb2_grpc.PlacerServicer):
    """A real gRPC server whose PlaceBatch takes `delay_s` per batch: it answers each call with its task id as
    the ledger id, in the call's trace (serve_batch), and records the batches and the streams it got."""

    def __init__(self, delay_s: float, tracer_provider: TracerProvider | None = None) -> None:
        self.delay_s = delay_s
        self.batches: list[list[str]] = []
        self.streams = 0
        self.tracing = BatchedCalls(PLACE, tracer_provider)

    async def PlaceBatch(self, batches, context):
        self.streams += 1

        async def place(call):
            return placer_pb2.PlaceResponse(outcome=placer_pb2.PLACE_OUTCOME_PLACED, ledger_id=call.task_id)

        async for batch in batches:
            self.batches.append([c.task_id for c in batch.calls])
            await asyncio.sleep(self.delay_s)
            yield placer_pb2.PlaceBatchResponse(results=await serve_batch(batch.calls, place, self.tracing,
                                                                          placer_pb2.PlaceBatchItem))


async def start_server(servicer: SlowPlacer, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    placer_pb2_grpc.add_PlacerServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


@asynccontextmanager
async def slow_placer(servicer: SlowPlacer):
    server, port = await start_server(servicer)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield placer_pb2_grpc.PlacerStub(channel)
    finally:
        await channel.close()
        await server.stop(None)


async def test_batches_travel_on_one_stream_and_a_broken_stream_is_replaced():
    servicer = SlowPlacer(delay_s=0.0)
    server, port = await start_server(servicer)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    places = coalescer(placer_pb2_grpc.PlacerStub(channel), wait_for_ready=True)
    try:
        for i in range(5):  # one after the other: five batches of one call
            assert (await places.call(place_request(f"t{i}", 1), 5)).ledger_id == f"t{i}"
        assert (places.batches, servicer.streams) == (5, 1)  # all on the stream the first call opened

        await server.stop(None)  # the peer goes away: the stream ends while idle
        with pytest.raises(grpc.aio.AioRpcError) as err:  # wait_for_ready: the call waits, until its deadline
            await places.call(place_request("lost", 1), 0.5)
        assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

        again = SlowPlacer(delay_s=0.0)
        server, _ = await start_server(again, port)  # back on the same address
        assert (await places.call(place_request("back", 1), 10)).ledger_id == "back"
        assert again.streams == 1 and again.batches == [["back"]]

        await server.stop(None)  # and once more, now with a call sent only after the peer is back
        await asyncio.sleep(0.2)
        again = SlowPlacer(delay_s=0.0)
        server, _ = await start_server(again, port)
        assert (await places.call(place_request("later", 1), 10)).ledger_id == "later"  # not the dead stream's error
    finally:
        await places.close()
        await channel.close()
        await server.stop(None)


async def test_deadlines_and_cancellations_apply_to_each_call_alone():
    servicer = SlowPlacer(delay_s=0.4)
    async with slow_placer(servicer) as stub:
        places = coalescer(stub)
        first = asyncio.create_task(places.call(place_request("first", 1), 5))
        await asyncio.sleep(0.1)  # "first" is on the way; the next calls queue behind it
        late = asyncio.create_task(places.call(place_request("late", 1), 0.1))
        gone = asyncio.create_task(places.call(place_request("gone", 1), 5))
        kept = asyncio.create_task(places.call(place_request("kept", 1), 5))
        await asyncio.sleep(0.05)
        gone.cancel()
        assert (await first).ledger_id == "first"
        assert (await kept).ledger_id == "kept"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await late
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert servicer.batches == [["first"], ["kept"]]  # expired and cancelled calls were never sent


async def test_each_batched_call_keeps_its_callers_trace():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    servicer = SlowPlacer(delay_s=0.05, tracer_provider=provider)
    async with slow_placer(servicer) as stub:
        places = coalescer(stub, tracer_provider=provider)

        async def caller(name: str):
            with tracer.start_as_current_span(f"submit {name}"):
                return await places.call(place_request(name, 1), 5)

        await asyncio.gather(*(caller(f"t{i}") for i in range(6)))
    assert places.batches < 6
    spans = exporter.get_finished_spans()
    roots = {s.name.split()[1]: s for s in spans if s.name.startswith("submit ")}
    clients = [s for s in spans if s.name == PLACE and s.kind == SpanKind.CLIENT]
    servers = [s for s in spans if s.name == PLACE and s.kind == SpanKind.SERVER]
    assert len(roots) == len(clients) == len(servers) == 6
    client_by_id = {s.context.span_id: s for s in clients}
    for server_span in servers:  # each call's server span is the child of that call's client span
        client_span = client_by_id[server_span.parent.span_id]
        assert server_span.context.trace_id == client_span.context.trace_id
    assert len({s.context.trace_id for s in servers}) == 6  # six callers, six traces
    assert {c.parent.span_id for c in clients} == {r.context.span_id for r in roots.values()}
