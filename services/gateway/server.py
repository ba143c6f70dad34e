"""Gateway service: the public endpoint. Validates, selects a DC, places with fallback, records the lifecycle."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from collections import OrderedDict
from collections.abc import Coroutine
from typing import Any, TypeVar

import grpc

from hsched import rpc
from hsched.batching import Coalescer
from hsched.convert import parts_to_pb, task_from_pb, task_to_pb
from hsched.costs.selection import METHODS
from hsched.domain.cluster import ClusterState
from hsched.domain.errors import ValidationError
from hsched.domain.fleet import Fleet, load_fleet
from hsched.runtime import common_args, exit_if_lost, guard_epoch, metrics_server, run, serve_until_stopped
from hsched.state.keys import Keys
from hsched.state.ledger import replay
from hsched.state.redis import connect
from hsched.state.tasks import TaskStore, now_ms
from hsched.telemetry import MetricsServer
from hsched.v1 import common_pb2 as pb
from hsched.v1 import (
    gateway_pb2,
    gateway_pb2_grpc,
    placer_pb2,
    placer_pb2_grpc,
    selector_pb2,
    selector_pb2_grpc,
)

log = logging.getLogger("hsched.gateway")
T = TypeVar("T")
LIST_DEFAULT, LIST_MAX = 100, 1000


def _track(job: asyncio.Task, running: set[asyncio.Task]) -> asyncio.Task:
    """Keep a reference to `job` in `running` until it is done (the event loop holds only a weak one)."""
    running.add(job)
    job.add_done_callback(running.discard)
    return job


def new_task_id() -> str:
    """Time-ordered (ms, hex) then random: ids sort by submission time, which List pages rely on."""
    return f"t{now_ms():012x}{secrets.token_hex(4)}"


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, fleet: Fleet, store: TaskStore, selector: selector_pb2_grpc.SelectorStub,
                 placers: dict[str, placer_pb2_grpc.PlacerStub], select_timeout_s: float = 2.0,
                 place_timeout_s: float = 5.0, max_batch: int = 128) -> None:
        self.fleet = fleet
        self.store = store
        # Concurrent Submits' selector and placer calls travel in batches, on one long-lived stream per peer
        # and method (hsched.batching: the per-call gRPC cost, not the decision, is what limits throughput).
        # wait_for_ready: ride out a selector restart.
        self.select = Coalescer(selector.SelectDataCenters, selector_pb2.SelectBatchRequest,
                                "hsched.v1.Selector/SelectDataCenter", max_batch, wait_for_ready=True)
        # Each Place carries its deadline: a placer commits nothing for it later (see _abandon).
        self.place = {dc: Coalescer(stub.PlaceBatch, placer_pb2.PlaceBatchRequest, "hsched.v1.Placer/Place",
                                    max_batch, deadline_field="not_after_unix_ms") for dc, stub in placers.items()}
        # wait_for_ready: a placer that is restarting gets until the deadline to come back
        self.release = {dc: Coalescer(stub.ReleaseBatch, placer_pb2.PlacerReleaseBatchRequest,
                                      "hsched.v1.Placer/Release", max_batch, wait_for_ready=True)
                        for dc, stub in placers.items()}
        self.select_timeout_s = select_timeout_s
        self.place_timeout_s = place_timeout_s
        self._inflight: dict[tuple[str, str], asyncio.Future] = {}
        self._jobs: set[asyncio.Task] = set()  # Submits and Releases under way (_start)
        self._abandoned: set[asyncio.Task] = set()  # background releases of unanswered Places (_abandon)

    def coalescers(self) -> list[tuple[tuple[str, str], Coalescer]]:
        """Every coalescer with its (peer, method) labels."""
        return [(("selector", "SelectDataCenter"), self.select),
                *(((dc, "Place"), c) for dc, c in self.place.items()),
                *(((dc, "Release"), c) for dc, c in self.release.items())]

    # -- Submit ------------------------------------------------------------------------------------------------

    @rpc.grpc_errors
    async def Submit(self, request: gateway_pb2.SubmitRequest, context) -> gateway_pb2.SubmitResponse:
        if not request.HasField("task"):
            raise ValidationError("task", "is required")
        spec = task_from_pb(request.task)
        spec.validate()
        if spec.entry_vertex and spec.entry_vertex not in self.fleet.wan.entry_vertices:
            raise ValidationError("task.entry_vertex", "must be one of the fleet's entry vertices "
                                  f"({', '.join(self.fleet.wan.entry_vertices[:6])}, ...)", spec.entry_vertex)
        if request.selector_method and request.selector_method not in METHODS:
            raise ValidationError("selector_method", f"must be one of {', '.join(METHODS)} or empty",
                                  request.selector_method)
        method = request.selector_method
        if not spec.request_id:
            return gateway_pb2.SubmitResponse(task=await asyncio.shield(self._start(self._submit(spec, method))))
        key = (spec.tenant, spec.request_id)
        if key in self._inflight:  # a retry while the first call is still being scheduled: its final answer
            return gateway_pb2.SubmitResponse(task=await asyncio.shield(self._inflight[key]), duplicate=True)
        known = self.store.by_request.get(key)
        if known is not None:  # a retry: the first answer, as it stands now
            return gateway_pb2.SubmitResponse(task=self.store.tasks[known], duplicate=True)
        job = self._inflight[key] = self._start(self._submit(spec, method))
        job.add_done_callback(lambda _: self._inflight.pop(key, None))
        return gateway_pb2.SubmitResponse(task=await asyncio.shield(job))

    def _start(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """A Submit's scheduling (or a Release) as a task of its own: once started it runs to its final record
        even if the client goes away (deadline, cancel), so the task table never disagrees with what the
        placers hold; the client finds the outcome with Get/List/Watch or by retrying (its request_id)."""
        job = _track(asyncio.ensure_future(work), self._jobs)
        job.add_done_callback(lambda j: j.cancelled() or j.exception())  # retrieved: its client may be gone
        return job

    async def _submit(self, spec, method: str) -> pb.Task:
        task = pb.Task(task_id=new_task_id(), spec=task_to_pb(spec), created_unix_ms=now_ms())
        # Ask the selector before writing anything: it has no side effects, so if it is down the client
        # gets UNAVAILABLE, nothing is recorded, and a retry with the same request_id starts afresh.
        selection = await self.select.call(selector_pb2.SelectRequest(task=task.spec, method=method),
                                           self.select_timeout_s)
        writes = [self.store.record("submitted", task)]  # durable before any placer is asked; awaited below
        ex = task.explanation
        ex.selector_method = selection.method
        ex.ranking.extend(selection.candidates)
        ex.excluded.extend(selection.excluded)
        if not selection.candidates:
            task.reason = "no data center can hold this task: " + "; ".join(
                f"{e.datacenter}: {e.reason}" for e in selection.excluded)
            writes.append(self.store.record("rejected", task, task.reason))
            await asyncio.gather(*writes)
            return task
        best = selection.candidates[0]
        task.datacenter = best.datacenter
        writes.append(self.store.record("dc_selected", task, f"{best.datacenter} at total cost {best.total_cost:.4f}"))
        await self._place(task, selection.candidates, writes)
        await asyncio.gather(*writes)
        return task

    async def _place(self, task: pb.Task, candidates, writes: list) -> None:
        """Try the DCs in rank order; if all are full now, queue at the best one that could hold it."""
        notes = task.explanation.notes
        full: list[str] = []
        for candidate in candidates:
            dc = candidate.datacenter
            reply = await self._call_place(task, dc, allow_defer=False, notes=notes)
            if reply is None:
                continue
            if reply.outcome == placer_pb2.PLACE_OUTCOME_PLACED:
                self._placed(task, dc, reply, writes)
                return
            if reply.outcome == placer_pb2.PLACE_OUTCOME_NO_ROOM:
                full.append(dc)
                notes.append(f"{dc}: no room now ({reply.reason}); trying the next data center")
            else:
                notes.append(f"{dc}: cannot ever hold it ({reply.reason})")
        if full:
            dc = full[0]
            reply = await self._call_place(task, dc, allow_defer=True, notes=notes)
            if reply is not None and reply.outcome == placer_pb2.PLACE_OUTCOME_PLACED:
                self._placed(task, dc, reply, writes)
                return
            if reply is not None and reply.outcome == placer_pb2.PLACE_OUTCOME_DEFERRED:
                task.datacenter, task.reason = dc, reply.reason
                self._explain(task, reply)
                writes.append(self.store.record("deferred", task, f"queued at {dc}: {reply.reason}"))
                return
        task.datacenter = ""
        task.reason = "no data center could place it: " + "; ".join(notes)
        writes.append(self.store.record("rejected", task, task.reason))

    async def _call_place(self, task: pb.Task, dc: str, allow_defer: bool, notes) -> placer_pb2.PlaceResponse | None:
        placer = self.place.get(dc)
        if placer is None:
            notes.append(f"{dc}: no placer address configured")
            return None
        try:
            return await placer.call(placer_pb2.PlaceRequest(task_id=task.task_id, task=task.spec,
                                                             allow_defer=allow_defer), self.place_timeout_s)
        except grpc.aio.AioRpcError as exc:
            notes.append(f"{dc}: placer unavailable ({exc.code().name}: {exc.details()})")
            self._abandon(task.task_id, dc)
            return None

    async def reconcile(self, redis, keys: Keys) -> tuple[int, int]:
        """At start, make the task table and the placers' ledgers agree. Submits that a previous gateway left
        half-done (recorded as submitted, never answered) are recorded as rejected, with the reason; then every
        task a DC's ledger holds (placed or queued) that the table does not show as placed or deferred at that
        DC — a half-done Submit, a Place whose answer was lost, a release the previous gateway did not see
        confirmed — is released there (`_abandon`), and a deferred task the ledger shows placed from the
        queue is recorded as placed. Returns (Submits settled, releases started)."""
        interrupted = [t for t in self.store.tasks.values() if t.state == pb.TASK_STATE_SUBMITTED]
        for task in interrupted:
            task.reason = ("the gateway stopped while scheduling it; released wherever it had been placed: "
                           "submit it again (with a new request_id)")
            task.datacenter = ""
        await asyncio.gather(*(self.store.record("rejected", t, t.reason) for t in interrupted))
        releases, writes = 0, []
        for dc in self.fleet.datacenters:
            if dc.name not in self.release:
                continue
            state, queue = ClusterState(dc), OrderedDict()
            await replay(redis, keys.ledger(dc.name), state, queue)
            for task_id, parts in [*state.allocations.items(), *((t, None) for t in queue)]:
                task = self.store.tasks.get(task_id)
                if task is None or task.datacenter != dc.name or task.state not in (pb.TASK_STATE_PLACED,
                                                                                  pb.TASK_STATE_DEFERRED):
                    self._abandon(task_id, dc.name)
                    releases += 1
                elif task.state == pb.TASK_STATE_DEFERRED and parts is not None:  # placed from the queue, unseen
                    del task.assignments[:]
                    task.assignments.extend(parts_to_pb(parts, state.table))
                    task.reason = ""
                    writes.append(self.store.record("placed", task, f"{dc.name}: from the deferred queue (found in "
                                                                    "the ledger at start)"))
        await asyncio.gather(*writes)
        return len(interrupted), releases

    def _abandon(self, task_id: str, dc: str) -> None:
        """A Place at `dc` ended without an answer, and the task may now go to another data center. The placer
        commits nothing for the call after its deadline, but it may have done so before and the answer been
        lost: release the task there, in the background until that placer confirms, so the task never holds
        resources in two data centers. (A release of a task the placer does not hold changes nothing.)"""
        _track(asyncio.create_task(self._release_abandoned(task_id, dc), name=f"release {task_id} at {dc}"),
               self._abandoned)

    async def _release_abandoned(self, task_id: str, dc: str, first_retry_s: float = 0.5) -> None:
        delay = first_retry_s
        while True:
            try:
                reply = await self.release[dc].call(placer_pb2.PlacerReleaseRequest(task_id=task_id),
                                                    self.place_timeout_s)
                break
            except grpc.aio.AioRpcError as exc:
                log.warning("placer %s: cannot yet release the unanswered placement of %s (%s); retrying in %g s",
                            dc, task_id, exc.code().name, delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, 30.0)
        if reply.released:
            log.warning("placer %s had placed %s before the gateway gave up on it; released there", dc, task_id)
        await asyncio.gather(*self._placed_from_queue(dc, task_id, reply))

    def _placed_from_queue(self, dc: str, released: str, reply: placer_pb2.PlacerReleaseResponse) -> list:
        """Record the deferred tasks that a release at `dc` placed; the writes to await."""
        writes = []
        for queued in reply.placed_from_queue:
            waiting = self.store.tasks.get(queued.task_id)
            if waiting is None:  # queued by a gateway whose history this one lacks; the ledger still holds it
                log.warning("placer %s placed unknown queued task %s", dc, queued.task_id)
                continue
            del waiting.assignments[:]
            waiting.assignments.extend(queued.assignments)
            waiting.reason = ""
            waiting.explanation.notes.append(f"placed from the deferred queue when {released} was released")
            writes.append(self.store.record("placed", waiting, f"{dc}: from the deferred queue"))
        return writes

    async def close(self) -> None:
        """Let started Submits and Releases finish, stop the batch streams; say which unanswered placements are
        still to be released."""
        if self._jobs:
            await asyncio.wait(self._jobs, timeout=self.select_timeout_s + 2 * self.place_timeout_s)
        for job in self._abandoned:
            log.warning("gateway stopping before a placer confirmed releasing an unanswered placement (%s)",
                        job.get_name())
            job.cancel()
        await asyncio.gather(*self._abandoned, return_exceptions=True)
        for _, c in self.coalescers():
            await c.close()

    def _explain(self, task: pb.Task, reply: placer_pb2.PlaceResponse) -> None:
        ex = task.explanation
        ex.placer_policy = reply.policy
        del ex.alternatives[:]
        ex.alternatives.extend(reply.alternatives)
        if reply.HasField("thermal"):
            ex.thermal.CopyFrom(reply.thermal)
        ex.notes.extend(reply.notes)

    def _placed(self, task: pb.Task, dc: str, reply: placer_pb2.PlaceResponse, writes: list) -> None:
        task.datacenter, task.reason = dc, ""
        del task.assignments[:]
        task.assignments.extend(reply.assignments)
        self._explain(task, reply)
        nodes = sorted({a.node for a in reply.assignments})
        writes.append(self.store.record("placed", task, f"{dc}: {', '.join(nodes[:4])}"
                                        + (f" (+{len(nodes) - 4} more)" if len(nodes) > 4 else "")))

    # -- Release -----------------------------------------------------------------------------------------------

    @rpc.grpc_errors
    async def Release(self, request: gateway_pb2.ReleaseRequest, context) -> gateway_pb2.ReleaseResponse:
        task = self._task(request.task_id)
        if task.state in (pb.TASK_STATE_RELEASED, pb.TASK_STATE_REJECTED):
            return gateway_pb2.ReleaseResponse(task=task)  # nothing held: releasing again is a no-op
        if task.state == pb.TASK_STATE_SUBMITTED:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"task {task.task_id} is still being scheduled; release it once Submit returned")
        await asyncio.shield(self._start(self._release(task)))  # like a Submit: finished once started
        return gateway_pb2.ReleaseResponse(task=task)

    async def _release(self, task: pb.Task) -> None:
        reply = await self.release[task.datacenter].call(placer_pb2.PlacerReleaseRequest(task_id=task.task_id),
                                                         self.place_timeout_s)
        writes = [self.store.record("released", task, f"freed {reply.freed.cpu_milli / 1000:g} cores, "
                                    f"{reply.freed.gpu_count} GPU slices at {task.datacenter}"),
                  *self._placed_from_queue(task.datacenter, task.task_id, reply)]
        await asyncio.gather(*writes)

    # -- reads -------------------------------------------------------------------------------------------------

    def _task(self, task_id: str) -> pb.Task:
        if not task_id:
            raise ValidationError("task_id", "is required")
        task = self.store.tasks.get(task_id)
        if task is None:
            raise LookupError(f"task {task_id} not found")
        return task

    @rpc.grpc_errors
    async def Get(self, request: gateway_pb2.GetRequest, context) -> pb.Task:
        return self._task(request.task_id)

    @rpc.grpc_errors
    async def List(self, request: gateway_pb2.ListRequest, context) -> gateway_pb2.ListResponse:
        if request.limit > LIST_MAX:
            raise ValidationError("limit", f"must be <= {LIST_MAX}", request.limit)
        limit = request.limit or LIST_DEFAULT
        out: list[pb.Task] = []
        for task_id in sorted(self.store.tasks):
            if request.page_token and task_id <= request.page_token:
                continue
            t = self.store.tasks[task_id]
            if ((request.tenant and t.spec.tenant != request.tenant) or (request.state and t.state != request.state)
                    or (request.datacenter and t.datacenter != request.datacenter)):
                continue
            out.append(t)
            if len(out) == limit:
                break
        next_token = out[-1].task_id if len(out) == limit else ""
        return gateway_pb2.ListResponse(tasks=out, next_page_token=next_token)

    async def Watch(self, request: gateway_pb2.WatchRequest, context):
        if request.task_id and request.task_id not in self.store.tasks:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"task {request.task_id} not found")
        async for event in self.store.events(request.after_event_id):
            if request.task_id and event.task_id != request.task_id:
                continue
            if request.tenant and event.tenant != request.tenant:
                continue
            yield event


def parse_placers(spec: str) -> dict[str, str]:
    """"dc=host:port,dc2=host:port" → {dc: target}."""
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, sep, target = item.partition("=")
        if not sep or not name or not target:
            raise SystemExit(f"--placers: expected dc=host:port, got {item!r}")
        out[name] = target
    return out


def register_metrics(metrics: MetricsServer, store: TaskStore, servicer: GatewayServicer) -> None:
    def by_state():
        counts: dict[tuple[str, str], int] = {}
        for t in list(store.tasks.values()):  # scraped on the metrics thread: iterate a copy
            key = (pb.TaskState.Name(t.state).removeprefix("TASK_STATE_").lower(), t.datacenter)
            counts[key] = counts.get(key, 0) + 1
        return [(k, float(v)) for k, v in counts.items()]

    metrics.register_gauge_family("hsched_tasks", "Tasks by state and data center", ["state", "datacenter"], by_state)

    coalescers = servicer.coalescers()

    def sent(attr: str):
        return lambda: [(labels, float(getattr(c, attr))) for labels, c in coalescers]

    labels = ["peer", "method"]
    metrics.register_gauge_family("hsched_gateway_batched_calls", "Calls sent inside batches since start, by peer "
                                  "and method", labels, sent("calls"))
    metrics.register_gauge_family("hsched_gateway_batches", "Batches sent since start (calls / batches = the "
                                  "mean batch size)", labels, sent("batches"))


async def serve(args, stop: asyncio.Event, fleet: Fleet | None = None) -> None:
    fleet = fleet or load_fleet(args.fleet)
    targets = parse_placers(args.placers)
    unknown = set(targets) - {dc.name for dc in fleet.datacenters}
    if unknown:
        raise SystemExit(f"--placers names data centers not in the fleet: {sorted(unknown)}")
    redis = connect(args.redis_url)
    guard, epoch_watch = await guard_epoch(redis, Keys(args.prefix), args, stop)  # before the table is rebuilt
    store = TaskStore(redis, Keys(args.prefix).tasks, epoch_key=Keys(args.prefix).epoch, epoch=guard.epoch,
                      min_replicas=args.redis_min_replicas, wait_timeout_ms=args.redis_wait_ms)
    loaded = await store.load()
    channels = [rpc.channel(args.selector), *(rpc.channel(t) for t in targets.values())]
    servicer = GatewayServicer(fleet, store, selector_pb2_grpc.SelectorStub(channels[0]),
                               {dc: placer_pb2_grpc.PlacerStub(ch) for dc, ch in zip(targets, channels[1:], strict=True)},
                               args.select_timeout_s, args.place_timeout_s)
    settled, released = await servicer.reconcile(redis, Keys(args.prefix))
    metrics = metrics_server(args)
    if metrics:
        register_metrics(metrics, store, servicer)
    server, port, _ = await rpc.start_server(
        lambda s: gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, s),
        [gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name], args.listen, metrics)
    log.info("gateway serving on port %d (%d task events replayed, %d tasks; %d interrupted Submits settled, %d "
             "tasks held by a placer without a record to match released)", port, loaded, len(store.tasks), settled,
             released)
    await serve_until_stopped(stop, server, port, args, tasks=[epoch_watch], metrics=metrics,
                              cleanup=[servicer.close, *(ch.close for ch in channels),
                                       redis.aclose])
    exit_if_lost(guard)


def parser():
    p = common_args("hsched gateway: the public task endpoint")
    p.add_argument("--selector", default=os.environ.get("HSCHED_SELECTOR", "127.0.0.1:50052"))
    p.add_argument("--placers", default=os.environ.get("HSCHED_PLACERS", ""),
                   help="dc=host:port,... for every data center's placer")
    p.add_argument("--select-timeout-s", type=float, default=2.0)
    p.add_argument("--place-timeout-s", type=float, default=5.0)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    run("gateway", args, lambda stop: serve(args, stop))
