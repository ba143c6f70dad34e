"""Prometheus metrics for one hsched service: a private registry, scrape-time gauge families, HTTP exposition.

The metric names are shared constants (``MetricSpec``: name, help, label names) so every service spells
them the same way: ``hsched_*`` in Prometheus style (base units, ``_total`` counters, ``_ratio`` for 0-1),
with paper 002's table 1 names beside them as aliases (``PAPER_002_ALIASES``). docs/metrics.md lists them all.

Large per-object state (thousands of GPU cards) is exported with ``register_gauge_family``: the callback
is called at scrape time only, so the hot path never touches a gauge. It runs on the HTTP server's thread,
concurrently with the service's event loop: read an immutable snapshot, or copy (``list(d.items())``),
never iterate a structure the loop may be resizing.

Usage::

    metrics = MetricsServer(port=9464)
    metrics.register_gauge_family(*HSCHED_DC_PUE, callback=lambda: [(("dc-1",), room.pue)])
    metrics.register_counter_family(*HSCHED_PLACER_PREEMPTIONS, callback=lambda: [(("dc-1",), engine.preemptions)])
    restarts = metrics.counter(*HSCHED_SUPERVISOR_RESTARTS)
    restarts.labels("gateway").inc()
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple, Self

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_log = logging.getLogger(__name__)

LabelValues = tuple[str, ...]
GaugeCallback = Callable[[], Iterable[tuple[LabelValues, float]]]


class MetricSpec(NamedTuple):
    """A metric's name, HELP text and label names; unpack it into the helpers: ``counter(*SPEC)``."""

    name: str
    help: str
    labelnames: tuple[str, ...] = ()


# Conventions (docs/metrics.md, checked on a live stack by tests/test_metrics_naming.py): hsched_* names in
# base units (_seconds, _bytes, _celsius, _watts, _ratio for 0-1), counters end in _total, no label value is
# empty, and no default family has a per-card or per-task label (per-card families are opt-in: bounded by
# the fleet's card count). Paper 002's table 1 names (also HAMi's device names) are exported beside them as
# aliases in the paper's own units (percent, MiB, ms), named in PAPER_002_ALIASES.
_DC = ("datacenter",)
NO_DATACENTER = "none"  # the datacenter label of tasks and jobs no DC was chosen for (rejected, pending)

# --- placer: one data center's allocation, gauges read at scrape time --------------------------------------
HSCHED_DC_CPU_ALLOCATED_RATIO = MetricSpec(
    "hsched_dc_cpu_allocated_ratio", "CPU allocated in the data center, fraction of its capacity (0-1)", _DC)
HSCHED_DC_GPU_CORE_ALLOCATED_RATIO = MetricSpec(
    "hsched_dc_gpu_core_allocated_ratio", "GPU core allocated in the data center, fraction of its capacity (0-1)",
    _DC)
HSCHED_DC_GPU_MEMORY_ALLOCATED_RATIO = MetricSpec(
    "hsched_dc_gpu_memory_allocated_ratio",
    "GPU memory allocated in the data center, fraction of its capacity (0-1)", _DC)

# per GPU model of the DC (the default: a few series per DC, whatever its card count)
_MODEL = ("datacenter", "model")
HSCHED_GPU_CARDS = MetricSpec("hsched_gpu_cards", "GPU cards of this model in the data center", _MODEL)
HSCHED_GPU_CORE_ALLOCATED_RATIO = MetricSpec(
    "hsched_gpu_core_allocated_ratio", "GPU core allocated on the cards of this model, fraction (0-1)", _MODEL)
HSCHED_GPU_MEMORY_ALLOCATED_BYTES = MetricSpec(
    "hsched_gpu_memory_allocated_bytes", "GPU memory allocated on the cards of this model, bytes", _MODEL)
HSCHED_GPU_MEMORY_CAPACITY_BYTES = MetricSpec(
    "hsched_gpu_memory_capacity_bytes", "GPU memory of the cards of this model, bytes", _MODEL)
HSCHED_GPU_SLICES = MetricSpec(
    "hsched_gpu_slices", "vGPU slices (one task's share of one card) allocated on the cards of this model", _MODEL)

# per card: only with the placer's --metrics-per-card (one series per card and family)
_CARD = ("datacenter", "node", "card", "model")
HSCHED_GPU_CARD_CORE_ALLOCATED_RATIO = MetricSpec(
    "hsched_gpu_card_core_allocated_ratio", "GPU core allocated on the card (sum of its slices), fraction (0-1)",
    _CARD)
HSCHED_GPU_CARD_MEMORY_ALLOCATED_BYTES = MetricSpec(
    "hsched_gpu_card_memory_allocated_bytes", "GPU memory allocated on the card, bytes", _CARD)
HSCHED_GPU_CARD_MEMORY_CAPACITY_BYTES = MetricSpec(
    "hsched_gpu_card_memory_capacity_bytes", "GPU memory of the card, bytes", _CARD)
HSCHED_GPU_CARD_SLICES = MetricSpec("hsched_gpu_card_slices", "vGPU slices allocated on the card", _CARD)

HSCHED_RUNNING_TASKS = MetricSpec("hsched_running_tasks", "Tasks holding resources in the data center", _DC)
HSCHED_STARTED_TASKS = MetricSpec(
    "hsched_started_tasks", "Tasks holding resources that the executor started (RUNNING; the others wait for "
    "their container)", _DC)
HSCHED_DEFERRED_TASKS = MetricSpec("hsched_deferred_tasks", "Tasks waiting in the deferred queue", _DC)
HSCHED_CORDONED_NODES = MetricSpec("hsched_cordoned_nodes", "Nodes an operator took out of scheduling (cordon, "
                                   "drain)", _DC)
HSCHED_DEFERRED_OLDEST_AGE = MetricSpec(
    "hsched_deferred_oldest_age_seconds", "Time the longest-waiting task of the deferred queue has waited, "
    "seconds (0: the queue is empty)", _DC)
HSCHED_PLACER_LEASE_HELD = MetricSpec(
    "hsched_placer_lease_held", "1 while this placer holds the DC's lease and serves, 0 while fenced or standby",
    _DC)
HSCHED_PLACER_FENCING_TOKEN = MetricSpec(
    "hsched_placer_fencing_token", "Fencing token of the lease this placer holds or last held (0: never held)", _DC)
HSCHED_PLACER_PREEMPTIONS = MetricSpec(
    "hsched_placer_preemptions", "Offline tasks this placer evicted for online ones (preempt ledger events it "
    "wrote since it started)", _DC)  # a callback counter: exposed as hsched_placer_preemptions_total
HSCHED_PLACER_POLICY_INFO = MetricSpec(
    "hsched_placer_policy_info", "1 for the node policy this placer serves (policy) and the one it was asked "
    "for (requested; they differ when a learned policy fell back to its heuristic)",
    ("datacenter", "policy", "requested"))
FALLBACK_REASONS = ("model_missing", "model_mismatch")  # the bounded `reason` label values
HSCHED_PLACER_POLICY_FALLBACKS = MetricSpec(
    "hsched_placer_policy_fallbacks", "Node decisions a heuristic made in place of the learned policy asked "
    "for, by reason (model_missing, model_mismatch)", ("datacenter", "policy", "reason"))  # callback counter

# --- gateway -------------------------------------------------------------------------------------------------
HSCHED_TASKS = MetricSpec(
    "hsched_tasks", f"Tasks by state and data center (datacenter=\"{NO_DATACENTER}\": no DC chosen, e.g. "
    "rejected)", ("state", "datacenter"))
HSCHED_JOBS = MetricSpec(
    "hsched_jobs", f"DAG jobs by state and data center (datacenter=\"{NO_DATACENTER}\": no DC chosen)",
    ("state", "datacenter"))
ALL_TENANTS = "*"  # the tenant label of Watch streams that follow every tenant (an admin's)
HSCHED_GATEWAY_WATCHES = MetricSpec(
    "hsched_gateway_watches", f"Watch streams open, by the tenant watched (\"{ALL_TENANTS}\": every tenant)",
    ("tenant",))
_BATCH = ("peer", "method")
HSCHED_GATEWAY_BATCHED_CALLS = MetricSpec(
    "hsched_gateway_batched_calls", "Calls sent inside batches, by peer and method", _BATCH)  # callback counter
HSCHED_GATEWAY_BATCHES = MetricSpec(
    "hsched_gateway_batches", "Batches sent (batched calls / batches = the mean batch size)", _BATCH)

# --- selector: user entry vertex -> data center along the current shortest path, and the learned path finder --
_USER = ("entry_vertex", "datacenter")
HSCHED_USER_TO_DC_LATENCY = MetricSpec(
    "hsched_user_to_dc_latency_seconds", "Path latency entry vertex -> DC, seconds", _USER)
HSCHED_USER_TO_DC_JITTER = MetricSpec(
    "hsched_user_to_dc_jitter_seconds", "Path jitter entry vertex -> DC, seconds", _USER)
HSCHED_USER_TO_DC_PACKET_LOSS = MetricSpec(
    "hsched_user_to_dc_packet_loss_ratio", "Path packet loss entry vertex -> DC, fraction (0-1)", _USER)
HSCHED_USER_TO_DC_BANDWIDTH = MetricSpec(
    "hsched_user_to_dc_bandwidth_bytes_per_second",
    "Path bottleneck bandwidth entry vertex -> DC, bytes/s (no sample: unknown)", _USER)
HSCHED_SELECTOR_PATH_FINDER_INFO = MetricSpec(
    "hsched_selector_path_finder_info", "1 for the path finder the selector serves (finder) and the one it was "
    "asked for (requested; dijkstra when the learned model is missing or does not fit)", ("finder", "requested"))
HSCHED_SELECTOR_PATH_AGREEMENT = MetricSpec(
    "hsched_selector_path_agreement_ratio",
    "Share of checked agent paths used (valid, not longer than Dijkstra), 0-1", ("finder",))
HSCHED_SELECTOR_PATH_CHECKS = MetricSpec(
    "hsched_selector_path_checks", "Agent paths checked against Dijkstra, by outcome (replaced: the learned "
    "path finder's fallbacks to Dijkstra)", ("finder", "outcome"))  # callback counter

# --- thermal: one series per DC ------------------------------------------------------------------------------
HSCHED_DC_PUE = MetricSpec("hsched_dc_pue", "Power usage effectiveness of the room", _DC)
HSCHED_DC_MAX_INLET_CELSIUS = MetricSpec("hsched_dc_max_inlet_celsius", "Hottest server inlet, Celsius", _DC)
HSCHED_DC_SUPPLY_CELSIUS = MetricSpec("hsched_dc_supply_celsius", "CRAC supply air temperature, Celsius", _DC)
HSCHED_DC_IT_POWER_WATTS = MetricSpec("hsched_dc_it_power_watts", "IT power of the room, W", _DC)
HSCHED_DC_COOLING_POWER_WATTS = MetricSpec("hsched_dc_cooling_power_watts", "CRAC power of the room, W", _DC)
HSCHED_DC_REDLINE_CELSIUS = MetricSpec(
    "hsched_dc_redline_celsius", "Inlet redline of the room, Celsius: alert on hsched_dc_max_inlet_celsius above it",
    _DC)
HSCHED_THERMAL_MODEL_VERSION = MetricSpec(
    "hsched_thermal_model_version", "Published room model version served (0 = the fleet's default model)", _DC)
HSCHED_PLACER_THERMAL_MODEL_VERSION = MetricSpec(
    "hsched_placer_thermal_model_version", "Room model version the placer's in-process thermal guard checks "
    "placements with (0 = the fleet's default model; no sample without that guard)", _DC)
HSCHED_THERMAL_REFITS = MetricSpec(
    "hsched_thermal_refits", "Refits of the room model by result: published, ill_conditioned, not_better, "
    "too_few_scans, conflict", ("datacenter", "result"))
HSCHED_THERMAL_READINGS = MetricSpec(
    "hsched_thermal_readings", "Sensor readings consumed by result: accepted, invalid", ("datacenter", "result"))
HSCHED_THERMAL_SCANS = MetricSpec(
    "hsched_thermal_scans", "Sensor scans by result: applied, duplicate (a replay), dropped (incomplete)",
    ("datacenter", "result"))

# --- every service: RPCs -------------------------------------------------------------------------------------
RPC_DURATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
HSCHED_RPC_SERVER_REQUESTS = MetricSpec(
    "hsched_rpc_server_requests_total",
    "RPCs handled, by full method and final gRPC status",
    ("method", "code"),
)
HSCHED_RPC_SERVER_DURATION = MetricSpec(
    "hsched_rpc_server_duration_seconds", "Time spent handling one RPC, seconds", ("method",)
)

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

# --- paper 002, table 1 (and HAMi's device names): aliases in the paper's units ----------------------------
CLUSTER_GPU_MEMORY_PERCENTAGE = MetricSpec(
    "ClusterGPUMemoryPercentage", "GPU memory allocated in the data center, percent of its capacity (paper 002 "
    "alias of hsched_dc_gpu_memory_allocated_ratio x 100)", _DC)
CLUSTER_GPU_CORE_PERCENTAGE = MetricSpec(
    "ClusterGPUCorePercentage", "GPU core allocated in the data center, percent of its capacity (paper 002 alias "
    "of hsched_dc_gpu_core_allocated_ratio x 100)", _DC)
GPU_DEVICE_CORE_ALLOCATED = MetricSpec(
    "GPUDeviceCoreAllocated", "GPU core percent allocated on the card (paper 002/HAMi alias of "
    "hsched_gpu_card_core_allocated_ratio x 100)", _CARD)
GPU_DEVICE_CORE_LIMIT = MetricSpec("GPUDeviceCoreLimit", "GPU core percent of the card (100; paper 002/HAMi)", _CARD)
GPU_DEVICE_MEMORY_ALLOCATED = MetricSpec(
    "GPUDeviceMemoryAllocated", "GPU memory allocated on the card, MiB (paper 002/HAMi alias of "
    "hsched_gpu_card_memory_allocated_bytes)", _CARD)
GPU_DEVICE_MEMORY_LIMIT = MetricSpec(
    "GPUDeviceMemoryLimit", "GPU memory of the card, MiB (paper 002/HAMi alias of "
    "hsched_gpu_card_memory_capacity_bytes)", _CARD)
GPU_DEVICE_SHARED_NUM = MetricSpec(
    "GPUDeviceSharedNum", "vGPU slices allocated on the card (paper 002/HAMi alias of hsched_gpu_card_slices)", _CARD)
USER_TO_CLUSTER_LATENCY = MetricSpec(
    "UserToClusterLatency", "User-to-DC network latency, ms (paper 002 alias of hsched_user_to_dc_latency_seconds)",
    _USER)
USER_TO_CLUSTER_JITTER = MetricSpec(
    "UserToClusterJitter", "User-to-DC network jitter, ms (paper 002 alias of hsched_user_to_dc_jitter_seconds)",
    _USER)
USER_TO_CLUSTER_PACKET_LOSS = MetricSpec(
    "UserToClusterPacketLoss", "User-to-DC packet loss, percent (paper 002 alias of "
    "hsched_user_to_dc_packet_loss_ratio x 100)", _USER)
USER_TO_CLUSTER_BANDWIDTH = MetricSpec(
    "UserToClusterBandwidth", "User-to-DC bottleneck bandwidth, Mbit/s, 0 = unknown (paper 002 alias of "
    "hsched_user_to_dc_bandwidth_bytes_per_second)", _USER)

# alias name -> the hsched_* family it restates (docs/metrics.md says why the vGPU* and ClusterToCluster*
# names of table 1 are not exported)
PAPER_002_ALIASES: dict[str, str | None] = {
    CLUSTER_GPU_MEMORY_PERCENTAGE.name: HSCHED_DC_GPU_MEMORY_ALLOCATED_RATIO.name,
    CLUSTER_GPU_CORE_PERCENTAGE.name: HSCHED_DC_GPU_CORE_ALLOCATED_RATIO.name,
    GPU_DEVICE_CORE_ALLOCATED.name: HSCHED_GPU_CARD_CORE_ALLOCATED_RATIO.name,
    GPU_DEVICE_CORE_LIMIT.name: None,  # always 100: a card's whole core is its ratio 1
    GPU_DEVICE_MEMORY_ALLOCATED.name: HSCHED_GPU_CARD_MEMORY_ALLOCATED_BYTES.name,
    GPU_DEVICE_MEMORY_LIMIT.name: HSCHED_GPU_CARD_MEMORY_CAPACITY_BYTES.name,
    GPU_DEVICE_SHARED_NUM.name: HSCHED_GPU_CARD_SLICES.name,
    USER_TO_CLUSTER_LATENCY.name: HSCHED_USER_TO_DC_LATENCY.name,
    USER_TO_CLUSTER_JITTER.name: HSCHED_USER_TO_DC_JITTER.name,
    USER_TO_CLUSTER_PACKET_LOSS.name: HSCHED_USER_TO_DC_PACKET_LOSS.name,
    USER_TO_CLUSTER_BANDWIDTH.name: HSCHED_USER_TO_DC_BANDWIDTH.name,
}
MIB = 1 << 20  # bytes
MBIT_PER_S = 125_000  # bytes/s


class _CallbackFamily(Collector):
    """A gauge or counter family whose samples come from a callback, evaluated at every scrape."""

    def __init__(self, kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str, help: str,
                 labelnames: Sequence[str], callback: GaugeCallback) -> None:
        self._kind, self._name, self._help, self._labelnames, self._callback = (
            kind, name, help, tuple(labelnames), callback)

    def _family(self) -> Metric:
        return self._kind(self._name, self._help, labels=self._labelnames)

    def describe(self) -> Iterator[Metric]:  # lets the registry reject a duplicate name at registration
        yield self._family()

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        try:
            for labels, value in self._callback():
                family.add_metric([str(v) for v in labels], value)
        except Exception:  # noqa: BLE001 - one broken callback must not break the scrape
            _log.exception("metrics callback for %s failed; family exported without samples", self._name)
            family = self._family()
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
        self.registry.register(_CallbackFamily(GaugeMetricFamily, name, help, labelnames, callback))

    def register_counter_family(
        self, name: str, help: str, labelnames: Sequence[str], callback: GaugeCallback
    ) -> None:
        """Export counter ``name`` (exposed as ``name_total``) from a callback yielding monotonic totals, for
        counts a service keeps anyway (an engine attribute): nothing to update on the hot path."""
        self.registry.register(_CallbackFamily(CounterMetricFamily, name, help, labelnames, callback))

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
