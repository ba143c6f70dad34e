"""Tracer provider set-up for one hsched service.

``HSCHED_TRACES`` picks the exporter when the caller does not: ``console`` (spans printed as JSON),
``otlp`` (OTLP/gRPC to ``OTEL_EXPORTER_OTLP_ENDPOINT``, e.g. ``http://otel-collector:4317``) or ``none``
(the default: this service makes no spans at all and the incoming trace context flows through it unchanged
to the next hop, so a trace stays whole across a service that does not export). The standard ``OTEL_*``
variables (sampler, resource attributes, batch sizes) keep working because the SDK reads them itself.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)

TRACES_ENV = "HSCHED_TRACES"
OTLP_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
EXPORTERS = ("console", "otlp", "none")


def setup_tracing(
    service_name: str,
    exporter: str | None = None,
    endpoint: str = "",
    *,
    extra_exporter: SpanExporter | None = None,
    set_global: bool = True,
) -> TracerProvider:
    """Build the service's TracerProvider (resource ``service.name``) and, by default, install it globally.

    exporter: "console" | "otlp" | "none"; None reads ``HSCHED_TRACES`` (default "none").
    endpoint: OTLP/gRPC endpoint; "" reads ``OTEL_EXPORTER_OTLP_ENDPOINT`` (the exporter's own default
        is localhost:4317). Use an ``http://`` endpoint for a plaintext collector.
    extra_exporter: also export every span synchronously to this exporter (tests: InMemorySpanExporter).
    set_global: install as the global provider (OpenTelemetry allows that once per process; tests that
        build several providers pass False and hand the provider to the interceptors).
    """
    kind = (exporter if exporter is not None else os.environ.get(TRACES_ENV, "none")).strip().lower()
    if kind not in EXPORTERS:
        raise ValueError(f"exporter must be one of {', '.join(EXPORTERS)} (or ${TRACES_ENV}), got {kind!r}")
    resource = Resource.create({SERVICE_NAME: service_name})
    provider = (
        _PassThroughTracerProvider(resource=resource)
        if kind == "none" and extra_exporter is None
        else TracerProvider(resource=resource)
    )
    if kind == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter(out=sys.stdout)))  # today's stdout
    elif kind == "otlp":
        # Imported lazily: the OTLP exporter pulls in protobuf/grpc machinery a "none" service never needs.
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        target = endpoint or os.environ.get(OTLP_ENDPOINT_ENV) or None
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=target)))
    if extra_exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(extra_exporter))
    if set_global:
        trace.set_tracer_provider(provider)
    return provider


def traceparent(context: Context | None = None) -> str:
    """The W3C ``traceparent`` of the span in `context` (default: the current one), "" when there is none.

    For trace context carried in data rather than gRPC metadata: a placer stamps it on the ledger events of
    a call, so the services that fold the ledger (thermal) can record their part in the same trace.
    """
    if not trace.get_current_span(context).get_span_context().is_valid:
        return ""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return carrier.get("traceparent", "")


class _PassThroughTracerProvider(TracerProvider):
    """Exporter "none": tracers that record nothing and hand the current (incoming) span context on.

    Building SDK spans nobody exports would cost ~15-20 µs each on the RPC hot path; the API's NoOpTracer
    returns the parent's context instead, which is exactly what propagation needs.
    """

    def get_tracer(self, *args: Any, **kwargs: Any) -> trace.Tracer:
        return trace.NoOpTracer()
