"""Observability shared by the four services: OpenTelemetry tracing over gRPC, Prometheus metrics.

A service wires it up in four lines::

    provider = setup_tracing("placer")  # exporter from HSCHED_TRACES: console | otlp | none
    metrics = MetricsServer(port=9464)  # GET /metrics, Prometheus text format
    server = grpc.aio.server(interceptors=[server_interceptor(metrics=metrics)])
    channel = grpc.aio.insecure_channel(target, interceptors=client_interceptors())

or, cheaper per call (what hsched.rpc does), without grpc.aio interceptors::

    add_PlacerServicer_to_server(servicer, instrumented(server, metrics=metrics))
    channel = traced_channel(grpc.aio.insecure_channel(target))
"""

from hsched.telemetry import metrics
from hsched.telemetry.interceptors import (
    BatchedCalls,
    client_interceptors,
    instrumented,
    server_interceptor,
    traced_channel,
)
from hsched.telemetry.metrics import GaugeCallback, Metrics, MetricSpec, MetricsServer
from hsched.telemetry.tracing import EXPORTERS, TRACES_ENV, setup_tracing

__all__ = [
    "EXPORTERS",
    "TRACES_ENV",
    "BatchedCalls",
    "GaugeCallback",
    "MetricSpec",
    "Metrics",
    "MetricsServer",
    "client_interceptors",
    "instrumented",
    "metrics",
    "server_interceptor",
    "setup_tracing",
    "traced_channel",
]
