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

The same tracing also comes without grpc.aio's interceptor machinery, which costs an extra coroutine (server)
or task and call object (client) per RPC: ``instrumented(server)`` wraps each handler once, when a servicer is
registered on it, and ``traced_channel(channel)`` wraps the channel's unary-unary calls. With a tracer that
records nothing (exporter "none") both only carry the incoming ``traceparent`` on to the next hop.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, MutableMapping
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
_TRACE_HEADERS = frozenset({"traceparent", "tracestate", "baggage"})  # W3C trace context and baggage

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

    def _end(self, span: Span | None, name: str, context: Any, error: BaseException | None, t0: float) -> None:
        if span is None and self._metrics is None:
            return
        code, details, exc = _server_outcome(context, error)
        if span is not None:
            _finish(span, code, details, exc)
        if self._metrics is not None:
            self._metrics.observe(name, code, time.perf_counter() - t0)

    def _traced_unary(self, behavior: Callable[..., Awaitable[Any]], method: str) -> Callable[..., Any]:
        name, attributes = _method_info(method)
        # A tracer that records nothing gets no span: the caller's context (when it sent one) is only made
        # current, so the handler's own calls carry it on.
        recording = not isinstance(self._tracer, trace.NoOpTracer)

        async def traced(request: Any, context: grpc.aio.ServicerContext) -> Any:
            t0 = time.perf_counter()
            span, ctx = self._start(name, attributes, context) if recording else (None, _incoming(context))
            token = attach(ctx) if ctx is not None else None
            error: BaseException | None = None
            try:
                return await behavior(request, context)
            except BaseException as exc:
                error = exc
                raise
            finally:
                if token is not None:
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


def _incoming(context: grpc.aio.ServicerContext) -> Context | None:
    """The caller's trace context from the call's W3C headers, or None when it sent none."""
    carrier = {k: v for k, v in context.invocation_metadata() or () if k in _TRACE_HEADERS}
    return propagate.extract(carrier) if carrier else None


class _Instrumented:
    """What ``add_*Servicer_to_server(servicer, ...)`` sees instead of the server: each method handler is
    wrapped once, here; everything else goes to the server."""

    def __init__(self, server: grpc.aio.Server, interceptor: _ServerInterceptor) -> None:
        self._server = server
        self._interceptor = interceptor

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        wrap = self._interceptor._wrap
        self._server.add_registered_method_handlers(
            service, {m: wrap(h, f"/{service}/{m}") for m, h in handlers.items()})

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self._server.add_generic_rpc_handlers(tuple(WrappedGeneric(h, self._interceptor._wrap) for h in handlers))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


class WrappedGeneric(grpc.GenericRpcHandler):
    """A generic handler whose answers pass through `wrap(handler, method)` (consulted only for methods without
    a registered handler); each method's wrapped handler is cached while the inner one stays the same."""

    def __init__(self, inner: grpc.GenericRpcHandler, wrap: Callable[[Any, str], Any]) -> None:
        self._inner = inner
        self._wrap = wrap
        self._wrapped: dict[str, tuple[Any, Any]] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = self._inner.service(handler_call_details)
        if handler is None:
            return None
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        cached = self._wrapped.get(method)
        if cached is None or cached[0] is not handler:
            cached = self._wrapped[method] = (handler, self._wrap(handler, method))
        return cached[1]


class _TracedChannel:
    """A grpc.aio channel whose unary-unary calls make CLIENT spans and carry the trace context, as
    ``client_interceptors()`` does; other attributes are the channel's own."""

    def __init__(self, channel: grpc.aio.Channel, tracer: Tracer) -> None:
        self._channel = channel
        self._tracer = tracer

    def unary_unary(self, method: str, request_serializer: Any = None, response_deserializer: Any = None,
                    _registered_method: bool = False) -> _TracedUnaryUnary:
        inner = self._channel.unary_unary(method, request_serializer, response_deserializer, _registered_method)
        return _TracedUnaryUnary(inner, method, self._tracer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._channel, name)

    async def __aenter__(self) -> _TracedChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._channel.close()


class _TracedUnaryUnary:
    def __init__(self, inner: Any, method: str, tracer: Tracer) -> None:
        self._inner = inner
        self._name, self._attributes = _method_info(method)
        self._tracer = tracer
        self._recording = not isinstance(tracer, trace.NoOpTracer)

    def __call__(self, request: Any, *, metadata: Any = None, **kwargs: Any) -> Any:
        if not self._recording:  # no span: the current (incoming) context, if any, goes on as it is
            return self._inner(request, metadata=_with_context(metadata, trace.get_current_span()), **kwargs)
        return self._traced(request, metadata, kwargs)

    async def _traced(self, request: Any, metadata: Any, kwargs: dict[str, Any]) -> Any:
        span = self._tracer.start_span(self._name, kind=SpanKind.CLIENT, attributes=self._attributes)
        try:
            response = await self._inner(request, metadata=_with_context(metadata, span), **kwargs)
        except BaseException as exc:
            _finish(span, *_client_outcome(exc))
            raise
        _finish(span, _OK, None, None)
        return response


class BatchedCalls:
    """Tracing of calls that travel inside batches (`hsched.batching`) as if each were its own unary RPC:
    a CLIENT span per call at the caller and a SERVER span per call at the server, both named after the
    call's method, joined by the W3C context each request carries in its `trace_context` field (the batch
    stream's own metadata belongs to no single caller). With a tracer that records nothing, only the caller's
    context is carried on, as for unary calls. With `metrics`, the server side also counts and times each
    call as the server interceptor does a unary one (hsched_rpc_server_*, under the call's method)."""

    def __init__(self, method: str, tracer_provider: TracerProvider | None = None,
                 metrics: Metrics | None = None) -> None:
        self.name, self._attributes = _method_info("/" + method.lstrip("/"))
        self._tracer = _tracer(tracer_provider)
        self._recording = not isinstance(self._tracer, trace.NoOpTracer)
        self._metrics = _RpcMetrics(metrics) if metrics is not None else None

    @contextlib.contextmanager
    def client(self, carrier: MutableMapping[str, str]) -> Iterator[None]:
        """Around one call, from queueing to its answer; writes the context to send into `carrier`."""
        if not self._recording:
            _inject(carrier, trace.get_current_span())
            yield
            return
        span = self._tracer.start_span(self.name, kind=SpanKind.CLIENT, attributes=self._attributes)
        _inject(carrier, span)
        try:
            yield
        except BaseException as exc:
            _finish(span, *_client_outcome(exc))
            raise
        _finish(span, _OK, None, None)

    @contextlib.contextmanager
    def server(self, carrier: Mapping[str, str]) -> Iterator[list]:
        """Around handling one call of a batch; the caller's context (from `carrier`) is current inside.
        Yields a [code, details] list the handler sets when the call fails."""
        parent = propagate.extract(dict(carrier)) if carrier else None
        span = self._tracer.start_span(self.name, parent, SpanKind.SERVER, self._attributes) \
            if self._recording else None
        ctx = trace.set_span_in_context(span, parent) if span is not None else parent
        token = attach(ctx) if ctx is not None else None
        status: list = [_OK, None]
        t0 = time.perf_counter()
        try:
            yield status
        finally:
            if token is not None:
                detach(token)
            if span is not None:
                _finish(span, status[0], status[1], None)
            if self._metrics is not None:
                self._metrics.observe(self.name, status[0], time.perf_counter() - t0)


def _inject(carrier: MutableMapping[str, str], span: Span) -> None:
    """The W3C headers of `span`'s context into `carrier` (nothing for an invalid span: no trace to continue)."""
    if span.get_span_context().is_valid:
        propagate.inject(carrier, context=trace.set_span_in_context(span))


def _with_context(metadata: Any, span: Span) -> Any:
    """`metadata` plus the W3C headers of `span`'s context (a new tuple: the caller's object is left alone)."""
    carrier: dict[str, str] = {}
    _inject(carrier, span)
    return (*tuple(metadata or ()), *carrier.items()) if carrier else metadata


def instrumented(
    server: grpc.aio.Server, tracer_provider: TracerProvider | None = None, metrics: Metrics | None = None
) -> Any:
    """Register servicers on the returned object instead of on `server` (``add_*Servicer_to_server(s,
    instrumented(server))``) to trace them and time them like ``server_interceptor`` does, wrapped once at
    registration instead of intercepted on every call."""
    return _Instrumented(server, _ServerInterceptor(_tracer(tracer_provider), metrics))


def traced_channel(channel: grpc.aio.Channel, tracer_provider: TracerProvider | None = None) -> Any:
    """`channel` with unary-unary calls traced like ``client_interceptors()`` does, without an interceptor.
    The calls' results are awaitables (the call object itself when nothing is recorded)."""
    return _TracedChannel(channel, _tracer(tracer_provider))


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
