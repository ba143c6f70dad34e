"""Prometheus metrics for one hsched service: a private registry, scrape-time gauge families, HTTP exposition.

The metric names are shared constants (``MetricSpec``: name, help, label names) so every service spells
them the same way. Paper 002's table 1 names are used verbatim where they apply; the rest are
``hsched_*`` in Prometheus style (base units, ``_total`` counters).

Large per-object state (thousands of GPU cards) is exported with ``register_gauge_family``: the callback
is called at scrape time only, so the hot path never touches a gauge. It runs on the HTTP server's thread,
concurrently with the service's event loop: read an immutable snapshot, or copy (``list(d.items())``),
never iterate a structure the loop may be resizing.

Usage::

    metrics = MetricsServer(port=9464)
    metrics.register_gauge_family(*GPU_DEVICE_CORE_ALLOCATED, callback=lambda: placer.card_core_rows())
    fallbacks = metrics.counter(*HSCHED_PATH_FALLBACKS)
    fallbacks.labels("invalid").inc()
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple, Self

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_log = logging.getLogger(__name__)

LabelValues = tuple[str, ...]
GaugeCallback = Callable[[], Iterable[tuple[LabelValues, float]]]


class MetricSpec(NamedTuple):
    """A metric's name, HELP text and label names; unpack it into the helpers: ``counter(*SPEC)``."""

    name: str
    help: str
    labelnames: tuple[str, ...] = ()


# --- paper 002, table 1: cluster (= data center) level, gauges ------------------------------------------
_DC = ("datacenter",)
CLUSTER_GPU_MEMORY_PERCENTAGE = MetricSpec(
    "ClusterGPUMemoryPercentage", "GPU memory allocated in the data center, percent of its capacity", _DC
)
CLUSTER_GPU_CORE_PERCENTAGE = MetricSpec(
    "ClusterGPUCorePercentage", "GPU core allocated in the data center, percent of its capacity", _DC
)

# --- device (one GPU card) level; labels as in the paper's exposition plus the card model ----------------
_DEVICE = ("datacenter", "node", "deviceidx", "model")
GPU_DEVICE_CORE_ALLOCATED = MetricSpec(
    "GPUDeviceCoreAllocated", "GPU core percent allocated on the card (sum of its slices)", _DEVICE
)
GPU_DEVICE_CORE_LIMIT = MetricSpec("GPUDeviceCoreLimit", "GPU core percent of the card (100)", _DEVICE)
GPU_DEVICE_MEMORY_ALLOCATED = MetricSpec(
    "GPUDeviceMemoryAllocated", "GPU memory allocated on the card, MiB", _DEVICE
)
GPU_DEVICE_MEMORY_LIMIT = MetricSpec("GPUDeviceMemoryLimit", "GPU memory of the card, MiB", _DEVICE)
GPU_DEVICE_SHARED_NUM = MetricSpec("GPUDeviceSharedNum", "vGPU slices allocated on the card", _DEVICE)

# --- vGPU (one task's slice of a card) level --------------------------------------------------------------
_VGPU = ("datacenter", "node", "deviceidx", "task_id")
VGPU_CORE_PERCENTAGE = MetricSpec("vGPUCorePercentage", "GPU core of the slice, percent of the card", _VGPU)
VGPU_MEMORY_PERCENTAGE = MetricSpec(
    "vGPUMemoryPercentage", "GPU memory of the slice, percent of the card", _VGPU
)
VGPU_PODS_DEVICE_ALLOCATED = MetricSpec("vGPUPodsDeviceAllocated", "GPU memory of the slice, MiB", _VGPU)

# --- network: user entry vertex -> data center, and data center -> data center ---------------------------
_USER = ("entry_vertex", "datacenter")
USER_TO_CLUSTER_LATENCY = MetricSpec("UserToClusterLatency", "User-to-DC network latency, ms", _USER)
USER_TO_CLUSTER_JITTER = MetricSpec("UserToClusterJitter", "User-to-DC network jitter, ms", _USER)
USER_TO_CLUSTER_PACKET_LOSS = MetricSpec("UserToClusterPacketLoss", "User-to-DC packet loss, percent", _USER)
USER_TO_CLUSTER_BANDWIDTH = MetricSpec(
    "UserToClusterBandwidth", "User-to-DC bottleneck bandwidth, Mbit/s", _USER
)
_C2C = ("src_datacenter", "dst_datacenter")
CLUSTER_TO_CLUSTER_LATENCY = MetricSpec("ClusterToClusterLatency", "DC-to-DC network latency, ms", _C2C)
CLUSTER_TO_CLUSTER_JITTER = MetricSpec("ClusterToClusterJitter", "DC-to-DC network jitter, ms", _C2C)
CLUSTER_TO_CLUSTER_PACKET_LOSS = MetricSpec(
    "ClusterToClusterPacketLoss", "DC-to-DC packet loss, percent", _C2C
)
CLUSTER_TO_CLUSTER_BANDWIDTH = MetricSpec(
    "ClusterToClusterBandwidth", "DC-to-DC bottleneck bandwidth, Mbit/s", _C2C
)

# --- hsched_*: requests, decisions and per-DC state ----------------------------------------------------
RPC_DURATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
HSCHED_RPC_SERVER_REQUESTS = MetricSpec(
    "hsched_rpc_server_requests_total",
    "RPCs handled, by full method and final gRPC status",
    ("method", "code"),
)
HSCHED_RPC_SERVER_DURATION = MetricSpec(
    "hsched_rpc_server_duration_seconds", "Time spent handling one RPC, seconds", ("method",)
)
HSCHED_DECISION_DURATION = MetricSpec(
    "hsched_decision_duration_seconds", "Time one policy takes to decide, seconds", ("stage", "policy")
)
HSCHED_PATH_FALLBACKS = MetricSpec(
    "hsched_path_fallbacks_total", "Agent paths replaced by Dijkstra (invalid or worse)", ("reason",)
)
HSCHED_TASKS = MetricSpec("hsched_tasks", "Tasks by state and data center", ("state", "datacenter"))
HSCHED_RUNNING_TASKS = MetricSpec("hsched_running_tasks", "Tasks holding resources", _DC)
HSCHED_DEFERRED_TASKS = MetricSpec("hsched_deferred_tasks", "Tasks waiting in the deferred queue", _DC)
HSCHED_CLUSTER_CPU_PERCENTAGE = MetricSpec(
    "hsched_cluster_cpu_percentage", "CPU allocated in the DC, percent", _DC
)
HSCHED_DC_PUE = MetricSpec("hsched_dc_pue", "Power usage effectiveness of the room", _DC)
HSCHED_DC_MAX_INLET_CELSIUS = MetricSpec("hsched_dc_max_inlet_celsius", "Hottest server inlet, Celsius", _DC)
HSCHED_DC_SUPPLY_CELSIUS = MetricSpec("hsched_dc_supply_celsius", "CRAC supply air temperature, Celsius", _DC)
HSCHED_DC_IT_POWER_WATTS = MetricSpec("hsched_dc_it_power_watts", "IT power of the room, W", _DC)
HSCHED_DC_COOLING_POWER_WATTS = MetricSpec("hsched_dc_cooling_power_watts", "CRAC power of the room, W", _DC)

# --- the `hsched up` supervisor (src/hsched/stack.py), one series per service of the local stack -------
_SERVICE = ("service",)
HSCHED_SUPERVISOR_RESTARTS = MetricSpec(
    "hsched_supervisor_restarts_total", "Restarts of a stack service (by the supervisor or Stack.restart)", _SERVICE
)
HSCHED_SUPERVISOR_SERVICE_UP = MetricSpec(
    "hsched_supervisor_service_up", "1 when the process runs and its last health probe said SERVING, else 0", _SERVICE
)
HSCHED_SUPERVISOR_LAST_EXIT_CODE = MetricSpec(
    "hsched_supervisor_last_exit_code", "Exit code of the service's last death (negative: killed by that signal)",
    _SERVICE,
)

PAPER_002_METRICS = (
    CLUSTER_GPU_MEMORY_PERCENTAGE, CLUSTER_GPU_CORE_PERCENTAGE,
    GPU_DEVICE_CORE_ALLOCATED, GPU_DEVICE_CORE_LIMIT, GPU_DEVICE_MEMORY_ALLOCATED, GPU_DEVICE_MEMORY_LIMIT,
    GPU_DEVICE_SHARED_NUM, VGPU_CORE_PERCENTAGE, VGPU_MEMORY_PERCENTAGE, VGPU_PODS_DEVICE_ALLOCATED,
    USER_TO_CLUSTER_LATENCY, USER_TO_CLUSTER_JITTER, USER_TO_CLUSTER_PACKET_LOSS, USER_TO_CLUSTER_BANDWIDTH,
    CLUSTER_TO_CLUSTER_LATENCY, CLUSTER_TO_CLUSTER_JITTER, CLUSTER_TO_CLUSTER_PACKET_LOSS,
    CLUSTER_TO_CLUSTER_BANDWIDTH,
)  # fmt: skip


class _CallbackGaugeFamily(Collector):
    """A gauge family whose samples come from a callback, evaluated at every scrape."""

    def __init__(self, name: str, help: str, labelnames: Sequence[str], callback: GaugeCallback) -> None:
        self._name, self._help, self._labelnames, self._callback = name, help, tuple(labelnames), callback

    def describe(self) -> Iterator[Metric]:  # lets the registry reject a duplicate name at registration
        yield GaugeMetricFamily(self._name, self._help, labels=self._labelnames)

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self._name, self._help, labels=self._labelnames)
        try:
            for labels, value in self._callback():
                family.add_metric([str(v) for v in labels], value)
        except Exception:  # noqa: BLE001 - one broken callback must not break the scrape
            _log.exception("metrics callback for %s failed; family exported without samples", self._name)
            family = GaugeMetricFamily(self._name, self._help, labels=self._labelnames)
        yield family


class Metrics:
    """One service's metrics: a private CollectorRegistry and helpers that create series on it."""

    def __init__(self, registry: CollectorRegistry | None = None, *, process_metrics: bool = True) -> None:
        prometheus_client.disable_created_metrics()  # no *_created twin for every counter/histogram series
        self.registry = registry if registry is not None else CollectorRegistry()
        self._metrics: dict[str, Any] = {}
        self._lock = threading.Lock()
        if process_metrics:
            ProcessCollector(
                registry=self.registry
            )  # process_cpu_seconds_total, process_resident_memory_bytes

    def register_gauge_family(
        self, name: str, help: str, labelnames: Sequence[str], callback: GaugeCallback
    ) -> None:
        """Export gauge ``name`` with one sample per ``(label values, value)`` the callback yields at scrape."""
        self.registry.register(_CallbackGaugeFamily(name, help, labelnames, callback))

    def counter(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Counter:
        """The counter ``name`` on this registry, created on first use (a second call returns the same one)."""
        return self._get(Counter, name, help, labelnames)

    def histogram(
        self,
        name: str,
        help: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = RPC_DURATION_BUCKETS,
    ) -> Histogram:
        """The histogram ``name`` on this registry, created on first use."""
        return self._get(Histogram, name, help, labelnames, buckets=tuple(buckets))

    def render(self) -> str:
        """The current Prometheus text exposition (what GET /metrics returns)."""
        return prometheus_client.generate_latest(self.registry).decode()

    def _get(self, kind: type, name: str, help: str, labelnames: Sequence[str], **kwargs: Any) -> Any:
        with self._lock:
            metric = self._metrics.get(name)
            if metric is None:
                metric = self._metrics[name] = kind(
                    name, help, tuple(labelnames), registry=self.registry, **kwargs
                )
            elif not isinstance(metric, kind) or metric._labelnames != tuple(labelnames):
                raise ValueError(f"metric {name!r} already exists with another type or label names")
            return metric


class MetricsServer(Metrics):
    """``Metrics`` served over HTTP: GET /metrics on ``host:port`` (port 0 = a free port, see ``.port``)."""

    def __init__(
        self,
        port: int,
        host: str = "127.0.0.1",
        registry: CollectorRegistry | None = None,
        *,
        process_metrics: bool = True,
    ) -> None:
        super().__init__(registry, process_metrics=process_metrics)
        self._httpd, self._thread = prometheus_client.start_http_server(
            port, addr=host, registry=self.registry
        )
        self.host = host
        self.port: int = self._httpd.server_port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port (idempotent)."""
        if self._thread.is_alive():
            self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
