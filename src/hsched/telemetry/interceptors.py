"""Hand-written grpc.aio interceptors: one span per RPC, W3C trace context carried in gRPC metadata.

The client side injects ``traceparent`` (through the global propagator) into the outgoing metadata of a
CLIENT span that is a child of the caller's current span; the server side extracts it and runs the
handler inside a SERVER span, so the handler's own outgoing calls continue the same trace. Spans are named
after the full method (``hsched.v1.Gateway/Submit``) and carry ``rpc.system``, ``rpc.service``,
``rpc.method`` and ``rpc.grpc.status_code``; any non-OK status sets the span status to ERROR with the code
and details, and an unexpected handler exception is also recorded as a span event.

Covered: unary-unary and unary-stream RPCs with ``async`` handlers (what hsched's four services use).
Sync handlers, client-streaming methods and ``grpc.*`` services (health, reflection) are passed through
untraced.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
from opentelemetry import propagate, trace
from opentelemetry.context import Context, attach, detach
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, TracerProvider

from hsched.telemetry.metrics import HSCHED_RPC_SERVER_DURATION, HSCHED_RPC_SERVER_REQUESTS, Metrics

_TRACER_NAME = "hsched.telemetry"
_STATUS_ATTR = "rpc.grpc.status_code"
_OK = grpc.StatusCode.OK
_UNTRACED_PREFIX = "/grpc."  # health checks and server reflection: probes, not requests

# method path ("/hsched.v1.Gateway/Submit", str on servers, bytes on aio clients) -> (span name, attributes)
_methods: dict[str | bytes, tuple[str, dict[str, str]]] = {}


def _method_info(method: str | bytes) -> tuple[str, dict[str, str]]:
    info = _methods.get(method)
    if info is None:
        name = (method.decode() if isinstance(method, bytes) else method).lstrip("/")
        service, _, rpc = name.partition("/")
        info = _methods[method] = (name, {"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc})
    return info


def _tracer(tracer_provider: TracerProvider | None) -> Tracer:
    return trace.get_tracer(_TRACER_NAME, tracer_provider=tracer_provider)


def _finish(span: Span, code: grpc.StatusCode, details: str | None, error: BaseException | None) -> None:
    """Record the final status on ``span`` and end it (once: later calls are no-ops)."""
    if not span.is_recording():
        return
    span.set_attribute(_STATUS_ATTR, code.value[0])
    if code is not _OK:
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details}" if details else code.name))
    if error is not None:
        span.record_exception(error)
    span.end()


def _client_outcome(error: BaseException | None) -> tuple[grpc.StatusCode, str | None, BaseException | None]:
    """(code, details, exception worth recording) of a finished client call."""
    if error is None:
        return _OK, None, None
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code(), error.details(), None
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        return grpc.StatusCode.CANCELLED, "cancelled by the caller", None
    return grpc.StatusCode.UNKNOWN, repr(error), error


def _server_outcome(
    context: grpc.aio.ServicerContext, error: BaseException | None
) -> tuple[grpc.StatusCode, str | None, BaseException | None]:
    """(code, details, exception worth recording) of a finished handler, as grpc will report it."""
    if error is None or isinstance(error, grpc.aio.AbortError):  # abort() already set code and details
        return context.code() or _OK, context.details(), None
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        return grpc.StatusCode.CANCELLED, "cancelled (client gone or deadline passed)", None
    return grpc.StatusCode.UNKNOWN, repr(error), error  # grpc answers UNKNOWN to any other exception


class _RpcMetrics:
    """hsched_rpc_server_* series for one server, with the label children cached off the hot path."""

    def __init__(self, metrics: Metrics) -> None:
        self._requests = metrics.counter(*HSCHED_RPC_SERVER_REQUESTS)
        self._duration = metrics.histogram(*HSCHED_RPC_SERVER_DURATION)
        self._children: dict[tuple[str, str], tuple[Any, Any]] = {}

    def observe(self, name: str, code: grpc.StatusCode, seconds: float) -> None:
        key = (name, code.name)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = (
                self._requests.labels(name, code.name),
                self._duration.labels(name),
            )
        children[0].inc()
        children[1].observe(seconds)


class _ServerInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, tracer: Tracer, metrics: Metrics | None) -> None:
        self._tracer = tracer
        self._metrics = _RpcMetrics(metrics) if metrics is not None else None
        # method -> (handler as returned by grpc, traced handler): the lookup returns the same handler
        # object every time for generated services, so each one is wrapped once.
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        cached = self._wrapped.get(method)
        if cached is None or cached[0] is not handler:
            cached = self._wrapped[method] = (handler, self._wrap(handler, method))
        return cached[1]

    def _wrap(self, handler: Any, method: str) -> Any:
        if handler.request_streaming or method.startswith(_UNTRACED_PREFIX):
            return handler
        if handler.response_streaming:
            behavior = handler.unary_stream
            if inspect.isasyncgenfunction(behavior):
                return handler._replace(unary_stream=self._traced_stream(behavior, method))
            if inspect.iscoroutinefunction(behavior):  # handler writes with `await context.write(...)`
                return handler._replace(unary_stream=self._traced_unary(behavior, method))
            return handler
        if inspect.iscoroutinefunction(handler.unary_unary):
            return handler._replace(unary_unary=self._traced_unary(handler.unary_unary, method))
        return handler

    def _start(self, name: str, attributes: dict[str, str], context: Any) -> tuple[Span, Context]:
        parent = propagate.extract(dict(context.invocation_metadata() or ()))
        span = self._tracer.start_span(name, parent, SpanKind.SERVER, attributes)
        return span, trace.set_span_in_context(span, parent)

    def _end(self, span: Span, name: str, context: Any, error: BaseException | None, t0: float) -> None:
        code, details, exc = _server_outcome(context, error)
        _finish(span, code, details, exc)
        if self._metrics is not None:
            self._metrics.observe(name, code, time.perf_counter() - t0)

    def _traced_unary(self, behavior: Callable[..., Awaitable[Any]], method: str) -> Callable[..., Any]:
        name, attributes = _method_info(method)

        async def traced(request: Any, context: grpc.aio.ServicerContext) -> Any:
            t0 = time.perf_counter()
            span, ctx = self._start(name, attributes, context)
            token = attach(ctx)
            error: BaseException | None = None
            try:
                return await behavior(request, context)
            except BaseException as exc:
                error = exc
                raise
            finally:
                detach(token)
                self._end(span, name, context, error, t0)

        return traced

    def _traced_stream(self, behavior: Callable[..., AsyncIterator[Any]], method: str) -> Callable[..., Any]:
        name, attributes = _method_info(method)

        async def traced(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            t0 = time.perf_counter()
            span, ctx = self._start(name, attributes, context)
            messages = behavior(request, context)
            error: BaseException | None = None
            try:
                while True:
                    # The span is current only while the handler runs, never across our own yield.
                    token = attach(ctx)
                    try:
                        message = await anext(messages)
                    except StopAsyncIteration:
                        break
                    finally:
                        detach(token)
                    yield message
            except BaseException as exc:
                error = exc
                raise
            finally:
                await messages.aclose()  # type: ignore[attr-defined]
                self._end(span, name, context, error, t0)

        return traced


class _ClientTracing:
    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer

    def _start(self, details: grpc.aio.ClientCallDetails) -> tuple[Span, grpc.aio.ClientCallDetails]:
        name, attributes = _method_info(details.method)
        span = self._tracer.start_span(name, kind=SpanKind.CLIENT, attributes=attributes)
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        if not carrier:  # no trace to continue (exporter "none" and no incoming context)
            return span, details
        # A fresh Metadata: never mutate the caller's object (it may be reused for a retry).
        metadata = grpc.aio.Metadata.from_tuple(tuple(details.metadata or ()))
        for key, value in carrier.items():
            metadata[key] = value
        return span, details._replace(metadata=metadata)  # type: ignore[attr-defined]


class _UnaryUnaryClientInterceptor(_ClientTracing, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], client_call_details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        span, details = self._start(client_call_details)
        try:
            call = await continuation(details, request)
            await call  # raises AioRpcError on a non-OK status
        except BaseException as exc:
            _finish(span, *_client_outcome(exc))
            raise
        _finish(span, _OK, None, None)
        return call


class _UnaryStreamClientInterceptor(_ClientTracing, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self, continuation: Callable[..., Any], client_call_details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        span, details = self._start(client_call_details)
        try:
            call = await continuation(details, request)
        except BaseException as exc:
            _finish(span, *_client_outcome(exc))
            raise

        def on_done(done: grpc.aio.Call) -> None:  # a cancelled stream may never be read to its end
            if done.cancelled():
                _finish(span, *_client_outcome(asyncio.CancelledError()))

        call.add_done_callback(on_done)
        return _iterate(call, span)


async def _iterate(call: grpc.aio.UnaryStreamCall, span: Span) -> AsyncIterator[Any]:
    error: BaseException | None = None
    try:
        async for message in call:
            yield message
    except BaseException as exc:
        error = exc
        raise
    finally:
        _finish(span, *_client_outcome(error))


def server_interceptor(
    tracer_provider: TracerProvider | None = None, metrics: Metrics | None = None
) -> grpc.aio.ServerInterceptor:
    """Trace every unary-unary / unary-stream RPC this server handles (``grpc.aio.server(interceptors=[...])``).

    tracer_provider: defaults to the global one (installed by ``setup_tracing``).
    metrics: when given, also count requests and time them on its registry
        (``hsched_rpc_server_requests_total{method,code}``, ``hsched_rpc_server_duration_seconds{method}``).
    """
    return _ServerInterceptor(_tracer(tracer_provider), metrics)


def client_interceptors(tracer_provider: TracerProvider | None = None) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for ``grpc.aio.insecure_channel(target, interceptors=client_interceptors())``."""
    tracer = _tracer(tracer_provider)
    return [_UnaryUnaryClientInterceptor(tracer), _UnaryStreamClientInterceptor(tracer)]
