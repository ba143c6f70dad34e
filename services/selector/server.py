"""Selector service (stage 1): rank data centers by eq.1 resource cost + eq.2 network path cost."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time

from hsched import rpc
from hsched.batching import serve_batch
from hsched.convert import task_from_pb
from hsched.costs import WanGraph
from hsched.costs.selection import Candidate
from hsched.costs.stranding import DEFAULT_RESERVE, parse_reserve
from hsched.domain.errors import ValidationError
from hsched.domain.fleet import Fleet, load_fleet
from hsched.engine.selector import DcSelector
from hsched.rl.path_serving import DEFAULT_MODEL, PATH_FINDERS, register_path_metrics, selector_path_finder
from hsched.runtime import common_args, metrics_server, reflection_on, run, serve_until_stopped, tls_files
from hsched.state.keys import Keys
from hsched.state.redis import ReadTrouble, connect
from hsched.telemetry import BatchedCalls, MetricsServer
from hsched.telemetry import metrics as m
from hsched.v1 import common_pb2, selector_pb2, selector_pb2_grpc

log = logging.getLogger("hsched.selector")


def candidate_to_pb(c: Candidate, room: tuple[bool, int] = (False, 0)) -> common_pb2.DcCandidate:
    r, p = c.resource, c.path
    return common_pb2.DcCandidate(
        room_now=room[0], queued_tasks=room[1],
        datacenter=c.datacenter, vertex=c.vertex,
        resource_cost=common_pb2.ResourceCost(cpu=r.cpu, memory=r.memory, disk=r.disk, bandwidth=r.bandwidth,
                                              gpu=r.gpu, total=r.total),
        network_cost=c.network_cost, total_cost=c.total,
        path=common_pb2.PathInfo(vertices=list(p.vertices), latency_ms=p.latency_ms, jitter_ms=p.jitter_ms,
                                 loss_percent=p.loss_percent, bottleneck_bandwidth_mbps=p.bottleneck_bandwidth_mbps,
                                 finder=c.path_source))


class SelectorServicer(selector_pb2_grpc.SelectorServicer):
    def __init__(self, selector: DcSelector, metrics: MetricsServer | None = None) -> None:
        self.selector = selector
        self._batched_select = BatchedCalls("hsched.v1.Selector/SelectDataCenter", metrics=metrics)

    @rpc.grpc_errors
    async def SelectDataCenter(self, request: selector_pb2.SelectRequest, context) -> selector_pb2.SelectResponse:
        return await self._select(request)

    async def SelectDataCenters(self, batches, context):
        async for batch in batches:
            yield selector_pb2.SelectBatchResponse(results=await serve_batch(
                batch.calls, self._select, self._batched_select, selector_pb2.SelectBatchItem))

    async def _select(self, request: selector_pb2.SelectRequest) -> selector_pb2.SelectResponse:
        task = task_from_pb(request.task)
        task.validate()
        ranked, excluded, unserved = self.selector.select(task, request.method)
        return selector_pb2.SelectResponse(
            method=request.method or "min-cost",
            candidates=[candidate_to_pb(c, self.selector.room_now(task, c.datacenter) if request.include_room
                                        else (False, 0)) for c in ranked],
            excluded=[common_pb2.Exclusion(datacenter=d, reason=r, unavailable=d in unserved) for d, r in excluded])


async def load_summaries(redis, keys: Keys, selector: DcSelector) -> dict[str, str]:
    """Apply every DC's latest capacity summary; returns the stream cursors `follow_summaries` tails from.
    Awaited before the server starts, so a (re)started selector never answers from an empty view."""
    streams = {keys.summary(dc.name): "0-0" for dc in selector.fleet.datacenters}
    for stream in streams:  # each DC's latest summary, as old as its placer stamped it
        latest = await redis.xrevrange(stream, count=1)
        if latest:
            summary = json.loads(latest[0][1][b"s"])
            age_s = max(0.0, time.time() - summary["unix_ms"] / 1000) if "unix_ms" in summary else 0.0
            selector.update_summary(summary, age_s=age_s)
            streams[stream] = latest[0][0].decode()
    return streams


async def follow_summaries(redis, keys: Keys, selector: DcSelector, streams: dict[str, str] | None = None,
                           retry_s: float = 1.0) -> None:
    """Keep the latest capacity summary of every DC (written by its placer), from `load_summaries`' cursors;
    `update_summary` drops those of a superseded placer (lower fencing token)."""
    streams = dict(streams) if streams is not None else await load_summaries(redis, keys, selector)
    trouble = ReadTrouble("reading DC summaries", retry_s, log)
    while True:
        try:
            reply = await redis.xread(streams, count=100, block=1000)
        except Exception as exc:  # noqa: BLE001 - the follower must outlive anything a read raises
            trouble.failed(exc)
            await asyncio.sleep(retry_s)
            continue
        trouble.succeeded()
        for stream, entries in reply or []:
            for entry_id, fields in entries:
                selector.update_summary(json.loads(fields[b"s"]))
                streams[stream.decode()] = entry_id.decode()


def _apply_links(selector: DcSelector, entries) -> str | None:
    """Apply link-metric entries in order; returns the last entry id (None if there were none)."""
    cursor = None
    for entry_id, fields in entries:
        cursor = entry_id.decode()
        try:
            update = json.loads(fields[b"m"])
            selector.graph.update_link(update.pop("a"), update.pop("b"), **update)
        except Exception as exc:  # noqa: BLE001 - a bad probe record must not stop the follower
            log.warning("ignoring link update %s: %s", cursor, exc)
    return cursor


async def load_links(redis, keys: Keys, selector: DcSelector) -> str:
    """Replay the whole links stream as it stands (so every selector, and a restarted one, agrees on the
    WAN weights before it serves); returns the cursor `follow_links` tails from."""
    cursor = "0-0"
    while True:
        entries = await redis.xrange(keys.links, min=f"({cursor}" if cursor != "0-0" else "-", count=500)
        last = _apply_links(selector, entries)
        if last is None:
            return cursor
        cursor = last


async def follow_links(redis, keys: Keys, selector: DcSelector, cursor: str = "0-0", retry_s: float = 1.0) -> None:
    """Apply WAN link metric updates (latency/jitter/loss/bandwidth, paper 002) from the links stream.

    Entries: {"a": vertex, "b": vertex, "latency_ms": .., "jitter_ms": .., "loss_percent": .., "bandwidth_mbps": ..}
    (any subset of the metrics), after `cursor` ("0-0": the whole history).
    """
    trouble = ReadTrouble("reading link metrics", retry_s, log)
    while True:
        try:
            reply = await redis.xread({keys.links: cursor}, count=500, block=1000)
        except Exception as exc:  # noqa: BLE001 - the follower must outlive anything a read raises
            trouble.failed(exc)
            await asyncio.sleep(retry_s)
            continue
        trouble.succeeded()
        for _, entries in reply or []:
            cursor = _apply_links(selector, entries) or cursor


def register_metrics(metrics: MetricsServer, selector: DcSelector) -> None:
    """Entry vertex -> DC network state along the current shortest paths, in base units and as paper 002's
    UserToCluster* aliases (ms, percent, Mbit/s)."""
    fleet, graph = selector.fleet, selector.graph

    def per_pair(attr: str, scale: float = 1.0, known_only: bool = False):
        def collect():
            out = []
            for entry in fleet.wan.entry_vertices:
                paths = graph.dijkstra.paths_from(entry)
                for dc in fleet.datacenters:
                    if dc.vertex in paths:
                        value = float(getattr(graph.path_metrics(paths[dc.vertex]), attr))
                        if value or not known_only:
                            out.append(((entry, dc.name), value * scale))
            return out
        return collect

    metrics.register_gauge_family(*m.HSCHED_USER_TO_DC_LATENCY, per_pair("latency_ms", 1e-3))
    metrics.register_gauge_family(*m.HSCHED_USER_TO_DC_JITTER, per_pair("jitter_ms", 1e-3))
    metrics.register_gauge_family(*m.HSCHED_USER_TO_DC_PACKET_LOSS, per_pair("loss_percent", 1e-2))
    metrics.register_gauge_family(*m.HSCHED_USER_TO_DC_BANDWIDTH,  # 0 Mbit/s = unknown: no sample
                                  per_pair("bottleneck_bandwidth_mbps", m.MBIT_PER_S, known_only=True))
    metrics.register_gauge_family(*m.USER_TO_CLUSTER_LATENCY, per_pair("latency_ms"))
    metrics.register_gauge_family(*m.USER_TO_CLUSTER_JITTER, per_pair("jitter_ms"))
    metrics.register_gauge_family(*m.USER_TO_CLUSTER_PACKET_LOSS, per_pair("loss_percent"))
    metrics.register_gauge_family(*m.USER_TO_CLUSTER_BANDWIDTH, per_pair("bottleneck_bandwidth_mbps"))


async def serve(args, stop: asyncio.Event, fleet: Fleet | None = None) -> None:
    fleet = fleet or load_fleet(args.fleet)
    keys = Keys(args.prefix)
    try:
        stranding = parse_reserve(getattr(args, "gpu_reserve", DEFAULT_RESERVE),
                                  float(getattr(args, "stranding_weight", 1.0)))
    except ValidationError as exc:  # (a traceback before)
        print(f"{exc} [$HSCHED_GPU_RESERVE]", file=sys.stderr)
        raise SystemExit(2) from None
    # before the followers start: a failure after them left their blocked reads uncancellable, and the process
    # hung for good, deaf to SIGTERM
    metrics = metrics_server(args)
    redis = connect(args.redis_url)
    graph = WanGraph(fleet.wan)
    selector = DcSelector(fleet, graph=graph, path_finder=selector_path_finder(
        getattr(args, "path_finder", "dijkstra"), getattr(args, "path_model", DEFAULT_MODEL), graph),
        stranding=stranding)
    # state first, then serve: a restarted selector ranks with every link update and summary at once
    summaries, links = await load_summaries(redis, keys, selector), await load_links(redis, keys, selector)
    tasks = [asyncio.create_task(follow_summaries(redis, keys, selector, summaries)),
             asyncio.create_task(follow_links(redis, keys, selector, links))]
    if metrics:
        register_metrics(metrics, selector)
        register_path_metrics(metrics, selector, getattr(args, "path_finder", "dijkstra"))
    server, port, _ = await rpc.start_server(
        lambda s: selector_pb2_grpc.add_SelectorServicer_to_server(SelectorServicer(selector, metrics), s),
        [selector_pb2.DESCRIPTOR.services_by_name["Selector"].full_name], args.listen, metrics,
        tls=tls_files(args, "selector"), reflection=reflection_on(args))
    log.info("selector serving %d DCs on port %d", len(fleet.datacenters), port)
    await serve_until_stopped(stop, server, port, args, tasks=tasks, metrics=metrics, cleanup=[redis.aclose])


def parser():
    p = common_args("hsched selector: data-center choice by resource + network cost")
    p.add_argument("--path-finder", choices=PATH_FINDERS, default="dijkstra",
                   help="min-cost/spf routes: dijkstra, or the PER-DQN agent (each path checked against dijkstra)")
    p.add_argument("--path-model", default=DEFAULT_MODEL,
                   help="the per-dqn model: a shipped name under models/ or a .pt path")
    p.add_argument("--gpu-reserve", default=os.environ.get("HSCHED_GPU_RESERVE", DEFAULT_RESERVE),
                   help="share (0..1) of a GPU host's per-GPU CPU and memory kept per idle GPU: what a CPU-only task "
                        "takes of it strands GPUs, priced in its total (docs/gpu_stranding.md; 0 = no stranding "
                        "term) [$HSCHED_GPU_RESERVE]")
    p.add_argument("--stranding-weight", type=float, default=os.environ.get("HSCHED_STRANDING_WEIGHT", "1"),
                   help="weight of the stranding term: priced GPUs a CPU-only task would strand, added to eq.3's "
                        "total (0 = off) [$HSCHED_STRANDING_WEIGHT]")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    run("selector", args, lambda stop: serve(args, stop))
