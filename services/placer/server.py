"""Placer service for one data center: gRPC over hsched.engine.placer.PlacerEngine."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable

import grpc
import numpy as np
from redis.exceptions import RedisError

from hsched import rpc
from hsched.batching import serve_batch
from hsched.cancel import cancel_and_wait
from hsched.convert import parts_to_pb, resources_to_pb, task_from_pb
from hsched.costs.stranding import DEFAULT_RESERVE, GpuReservePolicy, parse_reserve
from hsched.domain.errors import ValidationError, shown
from hsched.domain.fleet import load_fleet
from hsched.engine.executor import (
    PAPER_CONTAINER_START,
    PAPER_PREEMPTION_OVERHEAD,
    PAPER_SCHEDULING_DELAY,
    Overheads,
    SimulatedExecutor,
    Span,
)
from hsched.engine.placer import LoadDelta, NodeChange, PlacerEngine, PlaceResult, ThermalCheck
from hsched.engine.slices import SliceCatalog
from hsched.policies.base import NodesToScore
from hsched.policies.dagqueue import DAG_POLICIES, load_dag_queue_policy
from hsched.policies.fairshare import DIMENSIONS, TenantWeights
from hsched.policies.heuristics import LEARNED_POLICIES, POLICY_NAMES, make_policy
from hsched.runtime import (
    common_args,
    exit_if_lost,
    guard_epoch,
    metrics_server,
    reflection_on,
    run,
    serve_until_stopped,
    tls_files,
)
from hsched.security.tls import TlsFiles
from hsched.state.keys import Keys
from hsched.state.ledger import Fenced, LeaseHeld, Retention
from hsched.state.redis import connect, connect_sync
from hsched.state.tasks import now_ms
from hsched.telemetry import BatchedCalls, MetricsServer
from hsched.telemetry import metrics as m
from hsched.thermal.datacenter import room_for
from hsched.thermal.guard import RoomGuard
from hsched.thermal.published import ModelFollower, Published
from hsched.thermal.room import RoomModel
from hsched.v1 import common_pb2, placer_pb2, placer_pb2_grpc, thermal_pb2, thermal_pb2_grpc

log = logging.getLogger("hsched.placer")

OUTCOMES = {"placed": placer_pb2.PLACE_OUTCOME_PLACED, "deferred": placer_pb2.PLACE_OUTCOME_DEFERRED,
            "no_room": placer_pb2.PLACE_OUTCOME_NO_ROOM, "unschedulable": placer_pb2.PLACE_OUTCOME_UNSCHEDULABLE,
            "finished": placer_pb2.PLACE_OUTCOME_FINISHED}


class ThermalClient:
    """The engine's ThermalGuard, answered by the thermal service."""

    def __init__(self, target: str, datacenter: str, timeout_s: float = 2.0, tls: TlsFiles | None = None) -> None:
        self.channel = rpc.channel(target, tls, peer="thermal")
        self.stub = thermal_pb2_grpc.ThermalStub(self.channel)
        self.dc = datacenter
        self.timeout_s = timeout_s

    async def headroom(self, min_ledger_id: str) -> np.ndarray:
        reply = await self.stub.Predict(thermal_pb2.PredictRequest(
            datacenter=self.dc, min_ledger_id=min_ledger_id, want_headroom=True), timeout=self.timeout_s)
        return np.array(reply.headroom_w, dtype=np.float64)

    async def now(self, min_ledger_id: str) -> ThermalCheck:
        reply = await self.stub.Predict(thermal_pb2.PredictRequest(datacenter=self.dc, min_ledger_id=min_ledger_id),
                                        timeout=self.timeout_s)
        return ThermalCheck(True, reply.max_inlet_after_c, reply.max_inlet_after_c, reply.pue_after, reply.pue_after,
                            reply.t_supply_c, reply.redline_c, model_version=reply.model_version)

    async def check(self, deltas: list[LoadDelta], min_ledger_id: str) -> ThermalCheck:
        reply = await self.stub.Predict(thermal_pb2.PredictRequest(
            datacenter=self.dc, min_ledger_id=min_ledger_id, want_headroom=True,
            deltas=[thermal_pb2.LoadDelta(node_index=d.node, cpu_milli=d.cpu_milli, gpu_busy=d.gpu_busy)
                    for d in deltas]), timeout=self.timeout_s)
        return ThermalCheck(not reply.nodes_over_redline, reply.max_inlet_before_c, reply.max_inlet_after_c,
                            reply.pue_before, reply.pue_after, reply.t_supply_c, reply.redline_c,
                            tuple(reply.nodes_over_redline), np.array(reply.headroom_w, dtype=np.float64),
                            model_version=reply.model_version)


STATUS_METADATA = "hsched-placer-status"  # on GetState's UNAVAILABLE: standby | fenced


def thermal_to_pb(c: ThermalCheck | None) -> common_pb2.ThermalEffect | None:
    if c is None:
        return None
    return common_pb2.ThermalEffect(max_inlet_before_c=c.max_inlet_before_c, max_inlet_after_c=c.max_inlet_after_c,
                                    pue_before=c.pue_before, pue_after=c.pue_after, t_supply_c=c.t_supply_c,
                                    redline_c=c.redline_c, model_version=c.model_version)


def summary_to_pb(s: dict) -> common_pb2.DcSummary:
    # (slice occupancy, with --slice-types, the GPU-host split and the largest free room of a node are in the
    # Redis summary only: no field for them)
    fields = {k: v for k, v in s.items() if k not in ("capacity", "free", "largest_node", "largest_node_index",
                                                      "slices", "gpu_hosts", "largest_free")}
    return common_pb2.DcSummary(capacity=resources_to_pb(s["capacity"]), free=resources_to_pb(s["free"]),
                                largest_node=resources_to_pb(s["largest_node"]), **fields)


class PlacerServicer(placer_pb2_grpc.PlacerServicer):
    def __init__(self, engine: PlacerEngine, metrics: MetricsServer | None = None) -> None:
        self.engine = engine
        self.table = engine.state.table
        self._batched_place = BatchedCalls("hsched.v1.Placer/Place", metrics=metrics)
        self._batched_release = BatchedCalls("hsched.v1.Placer/Release", metrics=metrics)

    def _place_reply(self, r: PlaceResult) -> placer_pb2.PlaceResponse:
        return placer_pb2.PlaceResponse(
            outcome=OUTCOMES[r.outcome], assignments=parts_to_pb(r.parts, self.table), policy=self.engine.policy.name,
            alternatives=[common_pb2.Alternative(node=self.table.names[n], node_index=n, score=s)
                          for n, s in r.alternatives],
            thermal=thermal_to_pb(r.thermal), reason=r.reason, ledger_id=r.ledger_id, notes=r.notes,
            finished_ok=bool(r.finished and r.finished["ok"]), finished_unix_ms=r.finished["at"] if r.finished else 0)

    @rpc.grpc_errors
    async def Place(self, request: placer_pb2.PlaceRequest, context) -> placer_pb2.PlaceResponse:
        remaining = context.time_remaining()
        if not request.not_after_unix_ms and remaining is not None:
            request.not_after_unix_ms = int((time.time() + remaining) * 1000)
        return await self._place(request)

    async def PlaceBatch(self, batches, context):
        async for batch in batches:
            # all calls reach the engine's queue before it wakes: they are decided as one batch, one ledger append
            yield placer_pb2.PlaceBatchResponse(results=await serve_batch(
                batch.calls, self._place, self._batched_place, placer_pb2.PlaceBatchItem))

    async def _place(self, request: placer_pb2.PlaceRequest) -> placer_pb2.PlaceResponse:
        if not request.task_id:
            raise rpc.ValidationError("task_id", "is required")
        spec = task_from_pb(request.task)
        spec.validate()
        not_after = request.not_after_unix_ms / 1000 if request.not_after_unix_ms else None
        result = await self._engine_call(self.engine.place(request.task_id, spec, request.allow_defer, not_after,
                                                           preempt=not request.no_preemption))
        if result.outcome == "expired":
            raise rpc.DeadlinePassed(result.reason)
        return self._place_reply(result)

    @rpc.grpc_errors
    async def Release(self, request: placer_pb2.PlacerReleaseRequest, context) -> placer_pb2.PlacerReleaseResponse:
        return await self._release(request)

    async def ReleaseBatch(self, batches, context):
        async for batch in batches:
            yield placer_pb2.PlacerReleaseBatchResponse(results=await serve_batch(
                batch.calls, self._release, self._batched_release, placer_pb2.PlacerReleaseBatchItem))

    async def _release(self, request: placer_pb2.PlacerReleaseRequest) -> placer_pb2.PlacerReleaseResponse:
        if not request.task_id:
            raise rpc.ValidationError("task_id", "is required")
        r = await self._engine_call(self.engine.release(request.task_id))
        return placer_pb2.PlacerReleaseResponse(
            released=r.released, freed=resources_to_pb(r.freed),
            placed_from_queue=[placer_pb2.QueuedPlacement(task_id=t, assignments=parts_to_pb(p, self.table))
                               for t, p in r.placed_from_queue])

    async def _engine_call(self, call):
        try:
            return await call
        except Fenced as exc:
            raise rpc.Unavailable(str(exc)) from None

    @rpc.grpc_errors
    async def SetSchedulable(self, request: placer_pb2.SetSchedulableRequest, context
                             ) -> placer_pb2.SetSchedulableResponse:
        if not request.nodes:
            raise rpc.ValidationError("nodes", "name at least one node")
        if request.schedulable and request.evict:
            raise rpc.ValidationError("evict", "applies to a cordon (schedulable false) only")
        change = NodeChange(tuple(request.nodes), request.schedulable, request.reason, request.evict)
        r = await self._engine_call(self.engine.set_schedulable(change))
        return placer_pb2.SetSchedulableResponse(
            changed=r.changed, evicted_task_ids=r.evicted,
            remaining=[placer_pb2.NodeTaskCount(node=n, tasks=c) for n, c in r.remaining.items()],
            placed_from_queue=[placer_pb2.QueuedPlacement(task_id=t, assignments=parts_to_pb(p, self.table))
                               for t, p in r.placed_from_queue])

    @rpc.grpc_errors
    async def GetState(self, request: placer_pb2.PlacerStateRequest, context) -> placer_pb2.PlacerState:
        e, t = self.engine, self.table
        if e.fenced:  # a standby's or a fenced placer's memory is not the DC's ledger
            status = "standby" if e.holder and e.holder != e.ledger.owner else "fenced"
            await context.abort(grpc.StatusCode.UNAVAILABLE, e.unavailable_reason(),
                                trailing_metadata=((STATUS_METADATA, status),))
        out = placer_pb2.PlacerState(summary=summary_to_pb(e.summary()), deferred_task_ids=list(e.queue),
                                     policy=e.policy.name, owner=e.ledger.owner)
        if e.thermal:
            try:  # the room now; a thermal service that does not answer leaves it out, the rest is still shown
                out.thermal.CopyFrom(thermal_to_pb(await e.thermal.now(e.last_id)))
            except grpc.aio.AioRpcError as exc:
                log.warning("placer %s: GetState without the room's state (%s)", e.dc.name, exc.code().name)
        if request.include_tenants:
            def vector(v: np.ndarray) -> placer_pb2.ShareVector:
                return placer_pb2.ShareVector(**{d: float(x) for d, x in zip(DIMENSIONS, v, strict=True)})
            out.tenants.extend(placer_pb2.TenantShare(
                tenant=t["tenant"], weight=t["weight"], share=t["share"], running_tasks=t["running_tasks"],
                queued_tasks=t["queued_tasks"], allocated=vector(t["allocated"]), requested=vector(t["requested"]),
                deserved=vector(t["deserved"])) for t in e.tenant_shares())
        if request.include_nodes:
            s = e.state
            tasks = s.tasks_per_node()
            for i in range(s.n):
                cordon = s.cordoned.get(i)
                out.nodes.append(placer_pb2.NodeState(
                    name=t.names[i], index=i, rack=int(t.rack[i]),
                    capacity=common_pb2.Resources(cpu_milli=int(t.cpu_milli[i]), memory_mib=int(t.memory_mib[i]),
                                                  disk_mib=int(t.disk_mib[i]), bandwidth_mbps=int(t.bandwidth_mbps[i]),
                                                  gpu_count=int(t.gpu_count[i])),
                    free=common_pb2.Resources(cpu_milli=int(s.free_cpu[i]), memory_mib=int(s.free_memory[i]),
                                              disk_mib=int(s.free_disk[i]), bandwidth_mbps=int(s.free_bandwidth[i])),
                    gpus=[placer_pb2.GpuCardState(card=c, model=t.gpu_model[i],
                                                  core_percent_free=int(s.gpu_free_core[i, c]),
                                                  memory_mib_free=int(s.gpu_free_memory[i, c]),
                                                  memory_mib_capacity=int(t.gpu_memory_mib[i, c]))
                          for c in range(int(t.gpu_count[i]))],
                    cordoned=cordon is not None, cordon_reason=cordon["reason"] if cordon else "",
                    cordoned_unix_ms=cordon["at"] if cordon else 0, tasks=int(tasks[i])))
        return out


def register_metrics(metrics: MetricsServer, engine: PlacerEngine, requested_policy: str,
                     per_card: bool = False) -> None:
    """The DC's allocation, queue, lease and policy at scrape time (no per-operation updates on the hot path).
    GPU cards are aggregated per model; `per_card` adds one series per card and family (docs/metrics.md)."""
    dc, t = engine.dc.name, engine.state.table
    cards = [(i, c) for i in range(len(t)) for c in range(int(t.gpu_count[i]))]
    by_model: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # model -> (node indices, card indices)
    for model in sorted({t.gpu_model[i] for i, _ in cards}):
        nodes, slots = zip(*((i, c) for i, c in cards if t.gpu_model[i] == model), strict=True)
        by_model[model] = (np.array(nodes), np.array(slots))

    # engine.state is looked up at each scrape: a re-acquired lease replaces it with a fresh fold of the ledger
    def per_dc(value: Callable[[], float]):
        return lambda: [((dc,), float(value()))]

    def allocated(key: str, scale: float = 1.0):  # fraction of the DC's capacity (x 100: paper 002's percent)
        return per_dc(lambda: engine.state.utilisation()[key] * scale)

    def core_used():
        return t.gpu_core_percent - engine.state.gpu_free_core

    def core_ratio():
        return core_used() / np.maximum(t.gpu_core_percent, 1)

    def memory_used():
        return t.gpu_memory_mib - engine.state.gpu_free_memory

    def slices():
        counts = np.zeros_like(t.gpu_core_percent)
        for parts in list(engine.state.allocations.values()):  # scraped on the metrics thread: iterate a copy
            for p in parts:
                for g in p.gpus:
                    counts[p.node, g.card] += 1
        return counts

    def per_model(values: Callable[[], np.ndarray], total: Callable[[np.ndarray], float] = np.sum):
        def collect():
            v = values()
            return [((dc, model), float(total(v[rows, cols]))) for model, (rows, cols) in by_model.items()]
        return collect

    metrics.register_gauge_family(*m.HSCHED_DC_CPU_ALLOCATED_RATIO, allocated("cpu"))
    metrics.register_gauge_family(*m.HSCHED_DC_GPU_CORE_ALLOCATED_RATIO, allocated("gpu_core"))
    metrics.register_gauge_family(*m.HSCHED_DC_GPU_MEMORY_ALLOCATED_RATIO, allocated("gpu_memory"))
    metrics.register_gauge_family(*m.CLUSTER_GPU_CORE_PERCENTAGE, allocated("gpu_core", 100.0))
    metrics.register_gauge_family(*m.CLUSTER_GPU_MEMORY_PERCENTAGE, allocated("gpu_memory", 100.0))
    metrics.register_gauge_family(*m.HSCHED_GPU_CARDS, per_model(lambda: t.gpu_core_percent, np.size))
    metrics.register_gauge_family(*m.HSCHED_GPU_CORE_ALLOCATED_RATIO,
                                  per_model(core_ratio, np.mean))  # cards of a model have equal cores
    metrics.register_gauge_family(*m.HSCHED_GPU_MEMORY_ALLOCATED_BYTES, per_model(lambda: memory_used() * m.MIB))
    metrics.register_gauge_family(*m.HSCHED_GPU_MEMORY_CAPACITY_BYTES, per_model(lambda: t.gpu_memory_mib * m.MIB))
    metrics.register_gauge_family(*m.HSCHED_GPU_SLICES, per_model(slices))
    if per_card:
        def card(values: Callable[[], np.ndarray], scale: float = 1.0):
            def collect():
                v = values()
                return [((dc, t.names[i], str(c), t.gpu_model[i]), float(v[i, c]) * scale) for i, c in cards]
            return collect

        metrics.register_gauge_family(*m.HSCHED_GPU_CARD_CORE_ALLOCATED_RATIO, card(core_ratio))
        metrics.register_gauge_family(*m.HSCHED_GPU_CARD_MEMORY_ALLOCATED_BYTES, card(memory_used, m.MIB))
        metrics.register_gauge_family(*m.HSCHED_GPU_CARD_MEMORY_CAPACITY_BYTES, card(lambda: t.gpu_memory_mib, m.MIB))
        metrics.register_gauge_family(*m.HSCHED_GPU_CARD_SLICES, card(slices))
        metrics.register_gauge_family(*m.GPU_DEVICE_CORE_ALLOCATED, card(core_used))
        metrics.register_gauge_family(*m.GPU_DEVICE_CORE_LIMIT, card(lambda: t.gpu_core_percent))
        metrics.register_gauge_family(*m.GPU_DEVICE_MEMORY_ALLOCATED, card(memory_used))
        metrics.register_gauge_family(*m.GPU_DEVICE_MEMORY_LIMIT, card(lambda: t.gpu_memory_mib))
        metrics.register_gauge_family(*m.GPU_DEVICE_SHARED_NUM, card(slices))

    def oldest_wait_s() -> float:
        queued = engine.state.queued_ms
        since = [queued.get(task, 0) for task in list(engine.queue)]  # a copy: the loop may be resizing it
        since = [ms for ms in since if ms > 0]
        return max(0.0, (now_ms() - min(since)) / 1000) if since else 0.0

    metrics.register_gauge_family(*m.HSCHED_DEFERRED_TASKS, per_dc(lambda: len(engine.queue)))
    metrics.register_gauge_family(*m.HSCHED_DEFERRED_OLDEST_AGE, per_dc(oldest_wait_s))
    metrics.register_gauge_family(*m.HSCHED_RUNNING_TASKS, per_dc(lambda: len(engine.state.allocations)))
    metrics.register_gauge_family(*m.HSCHED_STARTED_TASKS, per_dc(
        lambda: sum(1 for c in list(engine.state.clocks.values()) if c.started_ms)))
    metrics.register_gauge_family(*m.HSCHED_CORDONED_NODES, per_dc(lambda: len(engine.state.cordoned)))
    metrics.register_gauge_family(*m.HSCHED_PLACER_LEASE_HELD, per_dc(lambda: engine.holding))
    metrics.register_gauge_family(*m.HSCHED_PLACER_FENCING_TOKEN, per_dc(lambda: engine.ledger.token or 0))
    if isinstance(engine.thermal, RoomGuard):
        metrics.register_gauge_family(*m.HSCHED_PLACER_THERMAL_MODEL_VERSION, per_dc(lambda: engine.thermal.version))
    metrics.register_counter_family(*m.HSCHED_PLACER_PREEMPTIONS, per_dc(lambda: engine.preemptions_total))
    policy = engine.policy
    fallback = policy if hasattr(policy, "learned") else None  # hsched.policies.learned.Fallback (imports torch)
    served = fallback.policy.name if fallback else policy.name
    metrics.register_gauge_family(*m.HSCHED_PLACER_POLICY_INFO, lambda: [((dc, served, requested_policy), 1.0)])
    if requested_policy in LEARNED_POLICIES:  # a sample only while a heuristic stands in for the learned policy
        metrics.register_counter_family(*m.HSCHED_PLACER_POLICY_FALLBACKS, lambda: [
            ((dc, requested_policy, fallback.kind), float(fallback.decisions))] if fallback else [])


class MetricFamilies:
    """register_metrics' target when one process hosts several DCs: each family is registered once on the
    process' endpoint, its rows every DC's (the `datacenter` label tells them apart)."""

    def __init__(self) -> None:
        self.families: dict[tuple[str, str], tuple[str, tuple[str, ...], list[Callable]]] = {}

    def register_gauge_family(self, name: str, help: str, labelnames, callback: Callable) -> None:
        self.families.setdefault(("gauge", name), (help, tuple(labelnames), []))[2].append(callback)

    def register_counter_family(self, name: str, help: str, labelnames, callback: Callable) -> None:
        self.families.setdefault(("counter", name), (help, tuple(labelnames), []))[2].append(callback)

    def register_on(self, metrics: MetricsServer) -> None:
        for (kind, name), (help, labels, callbacks) in self.families.items():
            def rows(cbs=callbacks):
                return [row for cb in cbs for row in cb()]

            getattr(metrics, f"register_{kind}_family")(name, help, labels, rows)


def datacenters_of(args, fleet) -> list:
    """--datacenter's DCs (a comma-separated list hosts several in one process), checked against the fleet."""
    names = [n.strip() for n in str(args.datacenter).split(",") if n.strip()]
    if not names or len(set(names)) != len(names):
        raise SystemExit(f"--datacenter {args.datacenter!r}: one data center, or a comma-separated list without "
                         "repeats")
    out = []
    for name in names:
        try:
            out.append(fleet.datacenter(name))
        except KeyError:
            raise SystemExit(f"--datacenter {name!r} is not in the fleet "
                             f"({', '.join(d.name for d in fleet.datacenters)})") from None
    return out


def listen_of(listen: str, dcs: list[str]) -> dict[str, str]:
    """{dc: address}: --listen is one address (several DCs: its port must be 0, each takes a free one) or
    dc=host:port,... naming every DC (a supervisor restarting the process keeps each DC's port)."""
    if "=" not in listen:
        if len(dcs) > 1 and not listen.endswith(":0"):
            raise SystemExit(f"--listen {listen!r}: several data centers need port 0 or dc=host:port,... for each")
        return dict.fromkeys(dcs, listen)
    items = [item.strip().split("=", 1) for item in listen.split(",") if item.strip()]
    out = {dc.strip(): address.strip() for dc, address in (i for i in items if len(i) == 2)}
    if len(items) != len(out) or set(out) != set(dcs):
        raise SystemExit(f"--listen {listen!r}: must name every --datacenter exactly ({', '.join(dcs)})")
    return out


class DcUnit:
    """One data center's placer inside a placer process: its engine (ledger, lease, fencing), gRPC server
    (own port, own health) and ledger settling. A process holds one (the default) or several."""

    def __init__(self, dc, engine: PlacerEngine, server, port: int, settle: asyncio.Task,
                 models: asyncio.Task | None = None) -> None:
        self.dc, self.engine, self.server, self.port, self.settle = dc, engine, server, port, settle
        self.models = models  # follows the thermal service's published room models (in-process guard)

    @property
    def tasks(self) -> list[asyncio.Task]:
        return [self.settle, *([self.models] if self.models else [])]


async def start_unit(args, dc, redis, tls, owner: str, guard, metrics: MetricsServer | None, listen: str,
                     fenced_exit_s: float) -> DcUnit:
    thermal = None  # the pre-commit redline guard
    if args.thermal:
        thermal = room_for(dc) if args.thermal_guard == "local" else ThermalClient(args.thermal, dc.name, tls=tls)
    slices = slice_types_of(args)
    policy = make_policy(args.policy, args.seed, dc, args.nodes_to_score)
    reserve = parse_reserve(args.gpu_reserve)
    if reserve.on and any(p.gpu_count for p in dc.pools):  # keep GPU hosts' CPU/memory for GPU tasks
        policy = GpuReservePolicy(policy, reserve)
    engine = PlacerEngine(dc, redis, Keys(args.prefix), policy, owner, thermal,
                          lease_ms=args.lease_ms, fenced_exit_s=fenced_exit_s,
                          batch_budget_s=args.batch_budget_ms / 1000 or None,
                          lease_client=connect_sync(args.redis_url),
                          retention=Retention(args.ledger_snapshot_entries, args.ledger_snapshot_interval_s,
                                              args.ledger_trim_margin_s),
                          executor=executor_of(args), tenant_weights=args.tenant_weights,
                          dag_policy=load_dag_queue_policy(args.dag_policy), slices=slices)
    engine.ledger.epoch = guard.epoch  # every append re-checks it, atomically with the fencing token
    models = None
    if isinstance(thermal, RoomModel):  # the in-process guard checks the thermal service's latest published model
        models = await room_models(redis, Keys(args.prefix), dc, engine)
    engine.ledger.min_replicas, engine.ledger.wait_timeout_ms = args.redis_min_replicas, args.redis_wait_ms
    try:
        await engine.start(wait_for_lease_s=args.lease_wait_s, standby=args.standby)
    except LeaseHeld as exc:
        raise SystemExit(f"placer {dc.name}: {exc} (--no-standby: exiting)") from None
    names = [placer_pb2.DESCRIPTOR.services_by_name["Placer"].full_name]
    health = None

    async def mirror_health(serving: bool) -> None:  # fenced or standby → NOT_SERVING: orchestrators see it
        if health is not None:
            await rpc.set_health(health, names, serving)

    engine.add_serving_watcher(mirror_health)
    try:
        server, port, health = await rpc.start_server(
            lambda s: placer_pb2_grpc.add_PlacerServicer_to_server(PlacerServicer(engine, metrics), s),
            names, listen, metrics, serving=engine.holding, tls=tls, reflection=reflection_on(args))
    except BaseException:
        await engine.stop()
        raise
    await rpc.set_health(health, names, engine.holding)  # it may have changed while the server started
    if slices is not None:
        occupancy = engine.summary()["slices"]
        log.info("placer %s: nodes cut into slices of %d types (%s): %s slices per type, %s in use", dc.name,
                 slices.q, slices.listing(), occupancy["cut"], occupancy["used"])
    if engine.holding:
        log.info("placer %s (policy %s, token %s) serving on port %d", dc.name, args.policy, engine.ledger.token, port)
    else:
        log.warning("placer %s on port %d: %s", dc.name, port, engine.unavailable_reason())
    return DcUnit(dc, engine, server, port, asyncio.create_task(engine.ledger.settle_forever(),
                                                                name=f"ledger-settle-{dc.name}"),
                  models and asyncio.create_task(models.run(), name=f"thermal-models-{dc.name}"))


async def room_models(redis, keys: Keys, dc, engine: PlacerEngine) -> ModelFollower:
    """The latest published room model, read now (version 0, the default, when none); the follower's `run`
    then hands every newer one to the engine, which swaps it into its guard between batches
    (hsched.thermal.published.ModelFollower)."""

    def adopt(p: Published) -> None:
        engine.set_room_model(room_for(dc, p.model), p.version, "published by the thermal service")

    follower = ModelFollower(redis, keys, dc.name, engine.state.n, adopt)
    try:
        await follower.load()
    except (RedisError, OSError) as exc:  # the follower's loop retries; until then the default model
        log.warning("placer %s: published thermal models unreadable (%s): version 0 until they are", dc.name, exc)
    if follower.version == 0:
        log.info("placer %s: thermal model version 0 (the default model: the thermal service has published none)",
                 dc.name)
    return follower


def lease_owner() -> str:
    """This process' name on its DCs' leases: host:pid and a random suffix. The lease script takes a lease held
    under its own name as its own, and host:pid alone is not unique: every container's main process is pid 1,
    and Kubernetes cuts a pod's hostname to 63 characters, so two replicas of a long DC name's placer had one
    name and re-acquired the lease from each other every second."""
    return f"{socket.gethostname()}:{os.getpid()}-{secrets.token_hex(3)}"


async def serve(args, stop: asyncio.Event) -> None:
    """Serve the DC of --datacenter, or each DC of a comma-separated list in this one process (`hsched up
    --placer-processes`: a local stack that fits a small machine). Each DC keeps its own engine, ledger, lease
    and gRPC port; they share the interpreter, the Redis connection and one /metrics endpoint. Alone, a DC
    that cannot take its lease back for --fenced-exit-s exits the process; in a group one fenced DC keeps
    trying and never stops the others: the process exits only when none of its DCs has served for that long."""
    fleet = load_fleet(args.fleet)
    dcs = datacenters_of(args, fleet)
    listen = listen_of(args.listen, [dc.name for dc in dcs])
    for address in set(listen.values()):  # before any lease is taken and ledger folded for nothing
        if problem := rpc.listen_problem(address):
            raise SystemExit(f"--listen {address}: cannot listen there: {problem}")
    group = len(dcs) > 1
    redis = connect(args.redis_url)
    tls = tls_files(args, "placer")
    guard, epoch_watch = await guard_epoch(redis, Keys(args.prefix), args, stop)  # before the ledger is folded
    owner = lease_owner()
    metrics = metrics_server(args)
    units: list[DcUnit] = []
    try:
        for dc in dcs:
            units.append(await start_unit(args, dc, redis, tls, owner, guard, metrics, listen[dc.name],
                                          0.0 if group else args.fenced_exit_s))
    except BaseException:
        for u in units:
            await u.server.stop(grace=0)
            await cancel_and_wait(u.tasks)
            await u.engine.stop()
        await cancel_and_wait([epoch_watch])
        await redis.aclose()
        if metrics:
            metrics.close()
        raise
    if metrics:
        families = MetricFamilies()
        for u in units:
            register_metrics(families, u.engine, args.policy, args.metrics_per_card)
        families.register_on(metrics)
    gave_up = asyncio.Event()

    async def exit_when_given_up() -> None:
        if not group:
            await units[0].engine.gave_up.wait()
        else:  # every DC without its lease for --fenced-exit-s (a lone fenced DC is the others' neighbour only)
            while not (args.fenced_exit_s and all(
                    not u.engine.holding and u.engine.lost_at is not None
                    and time.monotonic() - u.engine.lost_at > args.fenced_exit_s for u in units)):
                await asyncio.sleep(1.0)
        gave_up.set()
        stop.set()

    ports = units[0].port if not group else ",".join(f"{u.dc.name}={u.port}" for u in units)
    cleanup = [u.engine.stop for u in units]
    await serve_until_stopped(stop, [u.server for u in units], ports, args,
                              tasks=[epoch_watch, *(t for u in units for t in u.tasks),
                                     asyncio.create_task(exit_when_given_up())],
                              metrics=metrics, cleanup=[*cleanup, redis.aclose])
    exit_if_lost(guard)
    if gave_up.is_set():
        which = ", ".join(u.dc.name for u in units)
        raise SystemExit(f"placer {which}: could not take its lease back for {args.fenced_exit_s:g} s "
                         f"({'; '.join(u.engine.unavailable_reason() for u in units)}); exiting so that a "
                         "supervisor restarts it")


def executor_of(args) -> SimulatedExecutor:
    """The simulated executor the flags describe (hsched.engine.executor); ValidationError names a bad flag."""
    spans = [Span.parse(getattr(args, name), "--" + name.replace("_", "-"))
             for name in ("scheduling_delay_s", "container_start_s", "preemption_overhead_s")]
    return SimulatedExecutor(args.time_factor, Overheads(*spans), args.fail_probability, args.seed)


def parser():
    p = common_args("hsched placer: node and GPU-slice placement for one data center")
    p.add_argument("--datacenter", required=True,
                   help="the data center to place for; a comma-separated list hosts several in this one process, "
                        "each with its own engine, ledger, lease and gRPC port (--listen: port 0, or "
                        "dc=host:port,...; the --port-file then holds dc=port,...)")
    p.add_argument("--policy", default="bestfit", choices=POLICY_NAMES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gpu-reserve", default=os.environ.get("HSCHED_GPU_RESERVE", DEFAULT_RESERVE),
                   help="share (0..1) of a GPU host's per-GPU CPU and memory kept per idle GPU for GPU tasks: "
                        "CPU-only parts may not use it (docs/gpu_stranding.md; 0 = off) [$HSCHED_GPU_RESERVE]")
    p.add_argument("--metrics-per-card", action="store_true",
                   default=os.environ.get("HSCHED_METRICS_PER_CARD", "") not in ("", "0"),
                   help="also export one series per GPU card and family (GPUDevice*, hsched_gpu_card_*; "
                        "default: per GPU model only, a few series per DC) [$HSCHED_METRICS_PER_CARD]")
    p.add_argument("--thermal", default=os.environ.get("HSCHED_THERMAL", ""),
                   help="thermal service address (empty = no thermal guard)")
    p.add_argument("--thermal-guard", default=os.environ.get("HSCHED_THERMAL_GUARD", "local"),
                   choices=["local", "service"],
                   help="check a batch against the redline with the room model in-process, on the placer's own "
                        "state (local), or by asking the thermal service (service: one more hop per batch)")
    p.add_argument("--lease-ms", type=int, default=os.environ.get("HSCHED_LEASE_MS", "3000"),
                   help="lease period: another placer may take the DC over this long after this one stops renewing")
    p.add_argument("--nodes-to-score", default=os.environ.get("HSCHED_NODES_TO_SCORE", "all"),
                   help="feasible nodes one decision scores (kube-scheduler's percentageOfNodesToScore): all "
                        "(default), a count (256) or a percentage of the feasible nodes, at least 100 (10%%); "
                        "more feasible nodes than that: a seeded uniform sample of them (docs/scale.md). Learned "
                        "policies score at most their training fleet's size whatever this says")
    p.add_argument("--batch-budget-ms", type=float, default=os.environ.get("HSCHED_BATCH_BUDGET_MS", "0"),
                   help="a batch of calls takes no more once its decisions have used this much time; the rest go to "
                        "the next batch, after the event loop has run (health, summaries, the lease watchdog), so a "
                        "slow policy cannot stall the placer (0 = a tenth of --lease-ms, at most 3 s)")
    p.add_argument("--standby", action=argparse.BooleanOptionalAction, default=True,
                   help="if another placer holds the DC's lease, run as a NOT_SERVING standby and take over when "
                        "its lease lapses (--no-standby: exit with an error after --lease-wait-s instead)")
    p.add_argument("--lease-wait-s", type=float, default=0.0,
                   help="with --no-standby: how long to wait for the holder's lease to lapse before exiting")
    p.add_argument("--fenced-exit-s", type=float, default=os.environ.get("HSCHED_FENCED_EXIT_S", "120"),
                   help="exit (non-zero) after losing the lease and failing to take it back for this long, so a "
                        "restart policy acts (0 = never)")
    env = os.environ.get
    p.add_argument("--ledger-snapshot-entries", type=int, default=int(env("HSCHED_LEDGER_SNAPSHOT_ENTRIES", 10_000)),
                   help="snapshot the ledger's fold and trim the stream after this many new entries")
    p.add_argument("--ledger-snapshot-interval-s", type=float,
                   default=float(env("HSCHED_LEDGER_SNAPSHOT_INTERVAL_S", 60)),
                   help="... or this long after the last snapshot, when there is anything new")
    p.add_argument("--ledger-trim-margin-s", type=float, default=float(env("HSCHED_LEDGER_TRIM_MARGIN_S", 300)),
                   help="never trim ledger entries younger than this (readers lagging less never reload)")
    p.add_argument("--time-factor", type=float, default=env("HSCHED_TIME_FACTOR", "1"),
                   help="task seconds per wall second of the simulated executor: a task runs runtime_s / F seconds "
                        "(1 = real time; 60 = a minute of runtime per second); overheads and queue timeouts too")
    p.add_argument("--scheduling-delay-s", default=env("HSCHED_SCHEDULING_DELAY_S", str(PAPER_SCHEDULING_DELAY)),
                   help="task seconds between placement and the container start, fixed or uniform LO-HI "
                        "(default: paper 001's 0.4-1.0)")
    p.add_argument("--container-start-s", default=env("HSCHED_CONTAINER_START_S", str(PAPER_CONTAINER_START)),
                   help="container initialisation before a task runs, fixed or LO-HI (default: paper 001's 1-10)")
    p.add_argument("--preemption-overhead-s",
                   default=env("HSCHED_PREEMPTION_OVERHEAD_S", str(PAPER_PREEMPTION_OVERHEAD)),
                   help="context save and disk remount when a task is preempted, fixed or LO-HI "
                        "(default: paper 001's 5-25)")
    p.add_argument("--fail-probability", type=float, default=env("HSCHED_FAIL_PROBABILITY", "0"),
                   help="chance that a simulated task fails partway (seeded by --seed; default 0)")
    p.add_argument("--tenant-weights", default=env("HSCHED_TENANT_WEIGHTS", ""),
                   help="the tenants' weights in the deferred queue's fair share (Volcano proportion): "
                        "tenant=weight,... or a YAML/JSON file {tenants: {tenant: weight}, default: w} "
                        "(default: every tenant weight 1)")
    p.add_argument("--dag-policy", default=env("HSCHED_DAG_POLICY", "fifo"), choices=list(DAG_POLICIES),
                   help="which DAG job's stage the deferred queue serves first among the offline DAG tasks of one "
                        "class/tenant/priority band (hsched.policies.dagqueue): fifo = arrival order (default, "
                        "as without it), sjf-cp = least remaining job work then longest critical path, tetris = "
                        "Tetris* (packing + shortest remaining work), ba3c = the shipped action-branching A3C "
                        "(models/ba3c_dag.pt, one torch thread)")
    p.add_argument("--slice-types", default=env("HSCHED_SLICE_TYPES", ""),
                   help="pre-partition every node into container slices of the types in this YAML/JSON file "
                        "(`hsched slices fit`, paper 001) and place each task part in a free slice of the smallest "
                        "type that fits; parts no type fits are refused as unschedulable (default: no slices)")
    return p


def slice_types_of(args) -> SliceCatalog | None:
    """The --slice-types file's catalog (None: no slices); ValidationError names the file and the field."""
    return SliceCatalog.load(args.slice_types) if args.slice_types else None


def check_slice_types(p: argparse.ArgumentParser, args) -> None:
    """A bad --slice-types file is a usage error naming the file and the field, before anything starts."""
    try:
        slice_types_of(args)
    except ValidationError as exc:
        p.error(str(exc))


def check_tenant_weights(p: argparse.ArgumentParser, args) -> None:
    try:
        args.tenant_weights = TenantWeights.parse(args.tenant_weights)
    except ValidationError as exc:
        p.error(str(exc))


def check_executor_args(p: argparse.ArgumentParser, args) -> None:
    """Exit with the flag's name and rule when the executor's flags are bad."""
    try:
        executor_of(args)
    except ValidationError as exc:
        field = exc.field if exc.field.startswith("--") else "--" + exc.field.replace("_", "-")
        p.error(f"{field} {exc.rule} (got {shown(exc.value)})")


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    if args.lease_ms < 100:
        p.error(f"--lease-ms must be at least 100 (renewals run every third of it), got {args.lease_ms}")
    if not args.batch_budget_ms >= 0:
        p.error(f"--batch-budget-ms must be >= 0 (0 = a tenth of --lease-ms), got {args.batch_budget_ms}")
    if args.fenced_exit_s < 0 or args.lease_wait_s < 0:
        p.error("--fenced-exit-s and --lease-wait-s must be >= 0")
    try:
        NodesToScore.parse(args.nodes_to_score)
    except ValueError as exc:
        p.error(f"--{exc}".replace("--nodes_to_score", "--nodes-to-score"))
    try:  # a group's --listen: a usage error before anything starts
        listen_of(args.listen, [n.strip() for n in args.datacenter.split(",") if n.strip()])
    except SystemExit as exc:
        p.error(str(exc))
    check_executor_args(p, args)
    check_tenant_weights(p, args)
    check_slice_types(p, args)
    run(f"placer-{args.datacenter}", args, lambda stop: serve(args, stop))
