"""Replay a slice of a real trace through the gateway over gRPC, time-compressed, then summarise.

Each trace row becomes a Submit at its (scaled) arrival time and a Release when its (scaled) runtime
is over. The traces carry no user location or data size, so each task gets an entry vertex drawn
uniformly (seeded) from the fleet's entry vertices and a data size equal to its memory request.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import random
import secrets
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace

import grpc

from hsched.convert import task_to_pb
from hsched.domain.fleet import Fleet
from hsched.domain.task import TaskSpec
from hsched.retry import retrying
from hsched.rpc import CHANNEL_OPTIONS
from hsched.security.client import ClientCredentials
from hsched.traces import data_dir
from hsched.traces.catalog import TRACES  # hsched up --replay NAME: the catalogue
from hsched.v1 import common_pb2 as pb
from hsched.v1 import gateway_pb2, gateway_pb2_grpc

# Where a default replay starts: openb's first pods arrive almost all at once (870 of the first 1000
# within 1/30 of their span); from pod 3000 on, 1000 pods cover 87 h of steady arrivals.
DEFAULT_SKIP = {"openb": 3000, "openb-gpuspec33": 3000}


@dataclass(frozen=True)
class TraceTask:
    spec: TaskSpec
    arrival_s: float
    runtime_s: float


def load_trace(name: str, limit: int, skip: int | None = None) -> list[TraceTask]:
    if name not in TRACES:
        raise ValueError(f"trace: unknown trace {name!r}; choose one of {', '.join(TRACES)}")
    if skip is None:
        skip = DEFAULT_SKIP.get(name, 0)
    path = data_dir() / TRACES[name]
    if name.startswith("openb"):
        from hsched.traces.openb import load_openb_pods, openb_pod_to_task, pod_runtime_s

        pods = load_openb_pods(path, limit=skip + limit)[skip:]
        return [TraceTask(openb_pod_to_task(p), float(p.creation_s), pod_runtime_s(p)) for p in pods]
    from hsched.traces.swf import load_swf, swf_job_to_task

    return [TraceTask(swf_job_to_task(j), j.submit_s, max(j.runtime_s, 1.0)) for j in load_swf(path, limit, skip)]


def with_locations(tasks: list[TraceTask], fleet: Fleet, seed: int = 0) -> list[TraceTask]:
    rng = random.Random(seed)
    entries = list(fleet.wan.entry_vertices)
    return [replace(t, spec=replace(t.spec, entry_vertex=rng.choice(entries),
                                    data_size_mb=float(t.spec.resources.memory_mib)))
            for t in tasks]


@dataclass
class ReplayStats:
    submitted: int = 0
    outcomes: Counter = field(default_factory=Counter)  # first answer: placed / deferred / rejected / error
    retried: int = 0  # calls sent again after UNAVAILABLE / DEADLINE_EXCEEDED
    released: int = 0
    latencies_s: list[float] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)
    elapsed_s: float = 0.0
    final: dict[str, pb.Task] = field(default_factory=dict)


async def replay(gateway: str, tasks: list[TraceTask], duration_s: float = 30.0, concurrency: int = 64,
                 progress=None, release: bool = True, credentials: ClientCredentials | None = None) -> ReplayStats:
    """Drive the trace through the gateway; `progress(done, total)` is called as submits complete. `credentials`:
    the token and TLS settings to call it with (none: plaintext, no token)."""
    credentials = credentials or ClientCredentials()
    md = credentials.metadata
    stats = ReplayStats()
    if not tasks:
        return stats
    t0 = min(t.arrival_s for t in tasks)
    span = max(t.arrival_s for t in tasks) - t0
    scale = duration_s / span if span > 0 else 0.0
    events: list[tuple[float, int, str, int]] = [((t.arrival_s - t0) * scale, i, "submit", i) for i, t in enumerate(tasks)]
    heapq.heapify(events)
    task_ids: dict[int, str] = {}
    gate = asyncio.Semaphore(concurrency)
    run = secrets.token_hex(4)  # this replay's request ids: another run against the same stack submits anew
    async with credentials.aio_channel(gateway, options=CHANNEL_OPTIONS) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)

        async def submit(i: int) -> None:
            async with gate:
                start = time.perf_counter()
                spec = task_to_pb(tasks[i].spec)
                spec.request_id = f"replay-{run}-{i}"
                try:
                    reply = await retrying(lambda: stub.Submit(gateway_pb2.SubmitRequest(task=spec), timeout=30,
                                                               metadata=md), stats)
                except grpc.aio.AioRpcError as exc:
                    stats.errors[exc.code().name] += 1
                    stats.outcomes["error"] += 1
                    return
                finally:
                    stats.submitted += 1
                    if progress:
                        progress(stats.submitted, len(tasks))
                stats.latencies_s.append(time.perf_counter() - start)
                state = pb.TaskState.Name(reply.task.state).removeprefix("TASK_STATE_").lower()
                stats.outcomes[state] += 1
                task_ids[i] = reply.task.task_id
                due = (tasks[i].arrival_s - t0 + tasks[i].runtime_s) * scale
                # still running when the replay window closes: it stays placed (shows in the summary)
                if release and due <= duration_s and reply.task.state in (pb.TASK_STATE_PLACED,
                                                                             pb.TASK_STATE_DEFERRED):
                    heapq.heappush(events, (due, i, "release", i))

        async def release_one(i: int) -> None:
            async with gate:
                try:
                    await retrying(lambda: stub.Release(gateway_pb2.ReleaseRequest(task_id=task_ids[i]), timeout=30,
                                                        metadata=md), stats)
                    stats.released += 1
                except grpc.aio.AioRpcError as exc:
                    stats.errors[f"release {exc.code().name}"] += 1

        start = time.monotonic()
        running: set[asyncio.Task] = set()
        while events or running:
            running = {t for t in running if not t.done()}
            now = time.monotonic() - start
            if events and events[0][0] <= now:
                _, _, kind, i = heapq.heappop(events)
                running.add(asyncio.create_task(submit(i) if kind == "submit" else release_one(i)))
                continue
            # submits that complete push their releases onto the heap, so poll rather than sleep to the head
            wait = min(events[0][0] - now, 0.01) if events else 0.05
            if running:
                await asyncio.wait(running, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
            else:
                await asyncio.sleep(wait)
        stats.elapsed_s = time.monotonic() - start
        for task_id in task_ids.values():
            stats.final[task_id] = await stub.Get(gateway_pb2.GetRequest(task_id=task_id), timeout=10, metadata=md)
    return stats


async def dc_summaries(redis_url: str, prefix: str, fleet: Fleet) -> dict[str, dict]:
    """Latest placer summary and thermal telemetry per DC, from Redis."""
    from hsched.state.keys import Keys
    from hsched.state.redis import connect

    keys, redis, out = Keys(prefix), connect(redis_url), {}
    try:
        for dc in fleet.datacenters:
            summary = await redis.xrevrange(keys.summary(dc.name), count=1)
            thermal = await redis.xrevrange(keys.thermal(dc.name), count=1)
            out[dc.name] = {**(json.loads(summary[0][1][b"s"]) if summary else {}),
                            "thermal": json.loads(thermal[0][1][b"s"]) if thermal else {}}
    finally:
        await redis.aclose()
    return out


# the summary's task states, in lifecycle order (a task caught PREEMPTED is already requeued: deferred)
STATE_COLUMNS = ("placed", "deferred", "running", "succeeded", "failed", "released", "expired", "rejected")


def summary_rows(stats: ReplayStats, summaries: dict[str, dict]) -> list[dict]:
    """One row per DC: its tasks by final state (as the gateway answered Get at the end: STATE_COLUMNS), the
    preemptions they went through, the mean total cost of the tasks it got, utilisation and PUE."""
    by_dc: dict[str, Counter] = defaultdict(Counter)
    costs: dict[str, list[float]] = defaultdict(list)
    for task in stats.final.values():
        state = "deferred" if task.state == pb.TASK_STATE_PREEMPTED else \
            pb.TaskState.Name(task.state).removeprefix("TASK_STATE_").lower()
        by_dc[task.datacenter or "-"][state] += 1
        by_dc[task.datacenter or "-"]["preempted"] += task.preemptions
        for c in task.explanation.ranking:
            if c.datacenter == task.datacenter:
                costs[task.datacenter].append(c.total_cost)
    rows = []
    for dc in [*summaries, "-"]:
        s = summaries.get(dc, {})
        if dc == "-" and not by_dc.get("-"):
            continue
        cost = costs.get(dc)
        rows.append({"datacenter": dc, **{k: by_dc[dc][k] for k in (*STATE_COLUMNS, "preempted")},
                     "mean_total_cost": sum(cost) / len(cost) if cost else None,
                     "cpu_util": s.get("cpu_utilisation"), "gpu_util": s.get("gpu_core_utilisation"),
                     "pue": s.get("thermal", {}).get("pue"), "max_inlet_c": s.get("thermal", {}).get("max_inlet_c")})
    return rows


def summary_document(trace: str, stats: ReplayStats, rows: list[dict]) -> dict:
    """The summary as JSON (`hsched replay --json`): the Submit outcomes and the per-DC rows of `summary_rows`."""
    lat = sorted(stats.latencies_s)
    return {"trace": trace, "submitted": stats.submitted, "first_answers": dict(stats.outcomes),
            "released_by_replay": stats.released, "retried": stats.retried, "errors": dict(stats.errors), "elapsed_s": stats.elapsed_s,
            "submit_latency_p50_ms": lat[len(lat) // 2] * 1000 if lat else None, "datacenters": rows}
