"""Observability shared by the four services: OpenTelemetry tracing over gRPC, Prometheus metrics.

A service wires it up in four lines::

    provider = setup_tracing("placer")  # exporter from HSCHED_TRACES: console | otlp | none
    metrics = MetricsServer(port=9464)  # GET /metrics, Prometheus text format
    server = grpc.aio.server(interceptors=[server_interceptor(metrics=metrics)])
    channel = grpc.aio.insecure_channel(target, interceptors=client_interceptors())
"""

from hsched.telemetry import metrics
from hsched.telemetry.interceptors import client_interceptors, server_interceptor
from hsched.telemetry.metrics import GaugeCallback, Metrics, MetricSpec, MetricsServer
from hsched.telemetry.tracing import EXPORTERS, TRACES_ENV, setup_tracing

__all__ = [
    "EXPORTERS",
    "TRACES_ENV",
    "GaugeCallback",
    "MetricSpec",
    "Metrics",
    "MetricsServer",
    "client_interceptors",
    "metrics",
    "server_interceptor",
    "setup_tracing",
]
