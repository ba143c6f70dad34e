"""Gateway service: the public endpoint. Validates, selects a DC, places with fallback, records the lifecycle."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import replace
from typing import Any, TypeVar

import grpc

from hsched import rpc
from hsched.batching import Coalescer
from hsched.cancel import cancel_and_wait
from hsched.convert import task_from_pb, task_to_pb
from hsched.costs.selection import METHODS, exclusion_summary
from hsched.domain.cluster import ClusterState
from hsched.domain.errors import ValidationError
from hsched.domain.fleet import Fleet, load_fleet
from hsched.domain.limits import LIST_DEFAULT, LIST_MAX
from hsched.domain.task import JOB_TASK_FIELDS, ONLINE, TaskSpec
from hsched.fleetview import datacenter_view, task_history
from hsched.jobs import JobOrchestrator, JobPorts, job_of, normalized
from hsched.retry import retry_with_backoff
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
from hsched.security.principals import GatewayAuth, Principal, may_see, submit_tenant, tenant_filter
from hsched.security.tls import CLIENT_AUTH
from hsched.security.tokens import TokensFile, TokensFileError
from hsched.state.feed import TaskFeed, parse_after
from hsched.state.follow import LedgerFollower, follow
from hsched.state.gateways import GatewayLease, owner_of, task_id_of
from hsched.state.keys import Keys
from hsched.state.ledger import LayoutConflict, replay
from hsched.state.lifecycle import LIVE, TaskLifecycle
from hsched.state.redis import NotReplicated, connect
from hsched.state.tasks import (
    ABANDONED,
    JOB_TERMINAL,
    TERMINAL,
    Conflict,
    Record,
    TaskStore,
    keep_pruned,
    now_ms,
    step,
)
from hsched.state.transitions import Transitions
from hsched.telemetry import MetricsServer
from hsched.telemetry import metrics as m
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


def _track(job: asyncio.Task, running: set[asyncio.Task]) -> asyncio.Task:
    """Keep a reference to `job` in `running` until it is done (the event loop holds only a weak one)."""
    running.add(job)
    job.add_done_callback(running.discard)
    return job


class PlacersUnavailable(Exception):
    """No DC placed or queued a task, and a placer that might have did not answer: `verdicts` says, per DC, why
    not (short, to group); the message holds every DC's note (the task's explanation)."""

    def __init__(self, verdicts: list[tuple[str, str]], reason: str) -> None:
        super().__init__(reason)
        self.verdicts = verdicts


# a List/ListJobs page token is the last id of the previous page: a task id (t<ms hex>..., a job's j<ms hex>.<stage>.
# <i>) or a job id; anything else would silently restart the listing or end it
_PAGE_TOKEN = re.compile(r"[tj][0-9a-f]{12}[0-9A-Za-z._-]{0,200}")


def check_page_token(token: str) -> None:
    if token and not _PAGE_TOKEN.fullmatch(token):
        raise ValidationError("page_token", "must be the next_page_token a List answered (a task or job id)", token)


# how often an open Watch checks its caller's credentials again (a revoked token's stream then ends)
WATCH_REAUTH_S = 1.0

def new_task_id(gateway_id: str = "000000") -> str:
    """Time-ordered (ms, hex), the gateway, then random: ids sort by submission time, which List pages rely on."""
    return task_id_of(gateway_id, now_ms())


def reused_request(kind: str, request_id: str, first_id: str, differ: list[str]) -> rpc.AlreadyExists:
    """A request_id answered before for another spec: a retry sends the same spec, so another one under the id is
    a mistake the client must hear of (as a create of an existing name, edited, is refused elsewhere)."""
    return rpc.AlreadyExists(f"request_id {request_id!r} was used for another {kind} ({first_id}: "
                             f"{', '.join(differ)} differ); a new {kind} needs a new request_id")


def same_request(spec: TaskSpec, first: pb.Task) -> pb.Task:
    """`first`, the answer to an earlier Submit of `spec`'s request_id, if that Submit asked for the same task."""
    before = task_from_pb(first.spec)
    if before != spec:
        raise reused_request("task", spec.request_id, first.task_id, [
            f.name for f in dataclasses.fields(spec) if getattr(spec, f.name) != getattr(before, f.name)])
    return first


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """The public endpoint.

    Tenants (`auth`, hsched.security.principals): with authentication on, every call's principal decides what
    it sees — a tenant submits as itself (the `tenant` field is replaced), and another tenant's task answers
    NOT_FOUND exactly like a missing one; an admin sees everything. Off: the `tenant` field is trusted.

    Idempotency: a Submit with a `request_id` is bound to it (per tenant: the authenticated one) once its records
    are durable; a retry then gets that record (`duplicate`). A Submit that ends without durable records — the task-stream write
    failed (the client got UNAVAILABLE) or the gateway crashed while scheduling it — binds nothing: whatever a
    placer holds for it is released (`_abandon`, or `reconcile` at the next start), an `abandoned` record
    drops any trace of it, and a retry with the same request_id is a fresh attempt (it first waits for the
    failed attempt's placement to be released, so the request never holds two allocations).

    Several gateways on one Redis (`lease`, hsched.state.gateways; docs/operations.md): a request_id is claimed
    in Redis before it is scheduled, so a retry on another gateway waits for the first attempt's record; each
    table follows the task stream (other gateways' records); writes are version-checked (`Conflict`: catch up,
    decide again); a placement without a record is released only when its gateway is gone."""

    def __init__(self, fleet: Fleet, store: TaskStore, selector: selector_pb2_grpc.SelectorStub,
                 placers: dict[str, placer_pb2_grpc.PlacerStub], select_timeout_s: float = 2.0,
                 place_timeout_s: float = 5.0, max_batch: int = 128, feed: TaskFeed | None = None,
                 auth: GatewayAuth | None = None, lease: GatewayLease | None = None) -> None:
        self.fleet = fleet
        self.lease = lease  # None: the only gateway of its prefix (no claims, no fences)
        self.placers = placers  # unary calls (GetState for the fleet views); Place/Release go through the coalescers
        self.keys = Keys()  # the deployment's key prefix: serve() sets it (leases for the fleet views)
        self.auth = auth or GatewayAuth()
        self.store = store
        self.feed = feed
        # every durable task transition, in stream order, for in-process consumers (the job orchestrator)
        self.transitions = store.transitions = store.transitions or Transitions()
        # placer-initiated transitions (placed from the queue, running, finished, expired, preempted), read from
        # the DC ledgers (`follow_ledgers`); a Submit's own records come first
        self.lifecycle = TaskLifecycle(store, busy=lambda task_id: task_id in self._scheduling,
                                       await_record=self._await_record if lease is not None else None)
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
        # the longest a Submit can take (select, a Place per DC, an online task's preempting Place per full DC,
        # the deferred Place, the write): how long a retry waits for another gateway's attempt before answering
        # UNAVAILABLE
        self.submit_bound_s = select_timeout_s + (2 * len(placers) + 1) * place_timeout_s + 5.0
        self._inflight: dict[tuple[str, str], asyncio.Future] = {}
        self._jobs: set[asyncio.Task] = set()  # Submits and Releases under way (_start)
        self._abandoned: set[asyncio.Task] = set()  # background releases and record writes (_abandon, _durably)
        self._releasing: dict[str, set[asyncio.Task]] = {}  # task id -> its background releases under way
        self._failed: dict[tuple[str, str], asyncio.Future] = {}  # request key -> release of its failed attempt
        self._scheduling: set[str] = set()  # task ids placed or being placed whose records are not durable yet
        self._settling: set[str] = set()  # task ids whose records reached the master only (`_settle`)
        self._job_tasks: dict[str, asyncio.Task] = {}  # task ids of DAG jobs being submitted (submit_job_task)
        self.jobs = JobOrchestrator(store, JobPorts(self._select, self.submit_job_task, self.release_job_task),
                                    owners=lease)
        # only a DAG job's tasks (ids `<job>.<stage>.<i>`, hsched.jobs.task_id_of) concern the orchestrator
        self.transitions.subscribe(self.jobs.transition_callback, wants=lambda task_id: job_of(task_id) is not None)
        self._following: asyncio.Task | None = None

    def coalescers(self) -> list[tuple[tuple[str, str], Coalescer]]:
        """Every coalescer with its (peer, method) labels."""
        return [(("selector", "SelectDataCenter"), self.select),
                *(((dc, "Place"), c) for dc, c in self.place.items()),
                *(((dc, "Release"), c) for dc, c in self.release.items())]

    # -- Submit ------------------------------------------------------------------------------------------------

    @rpc.grpc_errors
    async def Submit(self, request: gateway_pb2.SubmitRequest, context) -> gateway_pb2.SubmitResponse:
        principal = self.auth.authenticate(context)
        if not request.HasField("task"):
            raise ValidationError("task", "is required")
        spec = task_from_pb(request.task)
        for name in JOB_TASK_FIELDS:  # a forged job_id would join another job's events and bypass the GPU reserve
            if getattr(spec, name):
                raise ValidationError(f"task.{name}", "is set by the gateway for a job's tasks: submit a DAG job "
                                      "with SubmitJob", getattr(spec, name))
        spec = replace(spec, tenant=submit_tenant(principal, spec.tenant))  # a tenant's forged field is ignored
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
        key = (spec.tenant, spec.request_id)  # the authenticated tenant's: one tenant cannot reach another's
        while True:
            if key in self._inflight:  # a retry while the first call is still being scheduled: its final answer
                task, _ = await asyncio.shield(self._inflight[key])
                return gateway_pb2.SubmitResponse(task=same_request(spec, task), duplicate=True)
            known = await self._durable_answer(key)
            if known is not None:  # a retry: the first answer, as it stands now
                return gateway_pb2.SubmitResponse(task=same_request(spec, known), duplicate=True)
            failed = self._failed.get(key)
            if failed is None:
                break
            try:  # an earlier attempt failed after placing: its placement goes first, then this one starts
                await asyncio.wait_for(asyncio.shield(failed), self.place_timeout_s)
            except TimeoutError:
                raise rpc.Unavailable(f"the previous attempt of request_id {spec.request_id!r} still holds a "
                                      "placement that a placer has not yet confirmed releasing; retry later") from None
        job = self._inflight[key] = self._start(self._submit_claimed(spec, method, key))
        job.add_done_callback(lambda _: self._inflight.pop(key, None))
        task, duplicate = await asyncio.shield(job)
        return gateway_pb2.SubmitResponse(task=same_request(spec, task) if duplicate else task, duplicate=duplicate)

    async def _submit_claimed(self, spec, method: str, key: tuple[str, str]) -> tuple[pb.Task, bool]:
        """A Submit with a request_id when other gateways may share the prefix: claim the request in Redis, then
        schedule it as usual. A claim another attempt holds is waited on until its record shows (that is the
        answer) or its gateway is gone (the claim is taken over), at most `submit_bound_s`. Returns the answer and
        whether it is another attempt's (a duplicate). Without a lease (the prefix's only gateway): no claim."""
        if self.lease is None:
            return await self._submit(spec, method), False
        rkey = self.keys.request(*key)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.submit_bound_s
        while True:
            task_id = new_task_id(self.lease.id)
            holder = await self.lease.claim(rkey, task_id)
            if holder:
                owner = owner_of(holder)
                gone = owner is None or (owner == self.lease.id and key not in self._failed
                                         and holder not in self._scheduling) \
                    or owner not in await self.lease.alive({owner})
                if gone and await self.lease.take_over(rkey, holder, task_id):
                    # the attempt of a gateway that is gone may hold a placement without a record: released
                    # first, so the request never holds two (a release of what a placer does not hold is a no-op)
                    await self._release_everywhere(holder)
                    holder = None
            if holder is None:  # ours: whatever was recorded before it is in the table once refreshed
                try:
                    await self.store.refresh()
                except Exception as exc:
                    self._unclaim(rkey, task_id)
                    raise rpc.Unavailable(f"the task store cannot be read ({type(exc).__name__}: {exc}); nothing "
                                          "was placed: retry (with the same request_id)") from exc
                try:
                    known = await self._durable_answer(key)
                except BaseException:
                    self._unclaim(rkey, task_id)
                    raise
                if known is not None:
                    self._unclaim(rkey, task_id)
                    return known, True
                try:
                    return await self._submit(spec, method, task_id, claim=rkey), False
                except BaseException:
                    if key not in self._failed:  # else the claim goes once the failed attempt's release is done
                        self._unclaim(rkey, task_id)
                    raise
            if (known := await self._durable_answer(key)) is not None:
                return known, True
            if loop.time() > deadline:
                raise rpc.Unavailable(f"request_id {spec.request_id!r} is being scheduled by another gateway and "
                                      "has no answer yet; retry later (with the same request_id)")
            await asyncio.sleep(0.05)
            await self.store.refresh()

    async def _durable_answer(self, key: tuple[str, str]) -> pb.Task | None:
        """The table's answer to request `key`, once it is known to be durable: a record read back from the master
        whose write failed as NotReplicated is no answer until the replicas hold it, and none at all once a
        failover lost it (then the request starts afresh). UNAVAILABLE when that cannot be told now."""
        task_id = self.store.by_request.get(key)
        if task_id is None:
            return None
        await self.store.confirm(task_id)  # (NotReplicated, Redis away: UNAVAILABLE, rpc.status_of)
        return self.store.tasks.get(task_id)

    async def _durable_record(self, task: pb.Task) -> pb.Task:
        """`task` as the table holds it, once its record is known to be durable: a retried Release found the
        task released by a record read back from the master whose write failed as NotReplicated, and answered
        it, and a failover then lost that record (the task placed again in the stream). Such a record is no
        answer until the replicas hold it; once lost, the table takes what Redis holds now."""
        if await self.store.confirm(task.task_id):  # (NotReplicated, Redis away: UNAVAILABLE)
            return task
        reverted = self.store.copy(task.task_id)
        if reverted is None:
            raise LookupError(f"task {task.task_id} not found")
        return reverted

    async def _release_everywhere(self, task_id: str) -> None:
        """Release `task_id` at every DC unless the table shows it recorded (bounded: the sweep finishes it)."""
        await self.store.refresh()
        if task_id in self.store.tasks:
            return
        jobs = [self._abandon(task_id, dc) for dc in self.release]
        await asyncio.wait(jobs, timeout=self.place_timeout_s)

    def _unclaim(self, rkey: str, task_id: str) -> None:
        """Drop this attempt's claim of a request, in the background (a claim left behind only costs a retry
        a table refresh: it finds the record, or takes the claim over once this gateway is gone)."""
        assert self.lease is not None
        lease = self.lease

        async def drop() -> None:
            try:
                await lease.unclaim(rkey, task_id)
            except Exception as exc:  # noqa: BLE001
                log.warning("cannot drop the claim of %s (%s: %s)", rkey, type(exc).__name__, exc)

        _track(asyncio.create_task(drop(), name=f"unclaim {rkey}"), self._abandoned)

    def _start(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """A Submit's scheduling (or a Release) as a task of its own: once started it runs to its final record
        even if the client goes away (deadline, cancel), so the task table never disagrees with what the
        placers hold; the client finds the outcome with Get/List/Watch or by retrying (its request_id)."""
        job = _track(asyncio.ensure_future(work), self._jobs)
        job.add_done_callback(lambda j: j.cancelled() or j.exception())  # retrieved: its client may be gone
        return job

    async def _submit(self, spec, method: str, task_id: str = "", claim: str = "") -> pb.Task:
        """Select, place, then write the Submit's records in one unit (`_commit`): the table and every reader see
        the task only once its final record is durable. A crash before that leaves no record; the placement it
        may have made is released by the next gateway's `reconcile` (or another's, once this one's lease is
        gone). With a lease the records are written only while it (and the request's `claim`) still holds."""
        task = pb.Task(task_id=task_id or new_task_id(self.lease.id if self.lease else "000000"),
                       spec=task_to_pb(spec), created_unix_ms=now_ms())
        fences = (self.lease.fence,) if self.lease is not None else ()
        # Ask the selector before anything else: it has no side effects, so if it is down the client
        # gets UNAVAILABLE, nothing is recorded, and a retry with the same request_id starts afresh.
        selection = await self.select.call(selector_pb2.SelectRequest(task=task.spec, method=method),
                                           self.select_timeout_s)
        records = [step("submitted", task)]
        ex = task.explanation
        ex.selector_method = selection.method
        ex.ranking.extend(selection.candidates)
        ex.excluded.extend(selection.excluded)
        unserved = [e.datacenter for e in selection.excluded if e.unavailable]
        if not selection.candidates:
            task.reason = "no data center can hold this task: " + exclusion_summary(
                (e.datacenter, e.reason) for e in selection.excluded)
            if unserved:
                raise rpc.Unavailable(f"{task.reason}; {', '.join(unserved)} could hold it once its placer serves "
                                      f"again{await self._redis_silence()}: nothing was kept, retry (with the same "
                                      "request_id)")
            records.append(step("rejected", task, task.reason))
            await self._commit(task, records, fences, claim)
            return task
        best = selection.candidates[0]
        task.datacenter = best.datacenter
        records.append(step("dc_selected", task, f"{best.datacenter} at total cost {best.total_cost:.4f}"))
        self._scheduling.add(task.task_id)  # a late `reconcile` pass leaves what this gateway is placing alone
        try:
            try:
                await self._place(task, selection.candidates, records, unserved)
            except PlacersUnavailable as exc:
                self._give_up(task, claim, str(exc))
                raise rpc.Unavailable(f"no data center placed the task and a placer that might have did not answer "
                                      f"({exclusion_summary(exc.verdicts)}){await self._redis_silence()}; nothing "
                                      "was kept: retry (with the same request_id)") from None
            await self._commit(task, records, fences, claim)
        finally:
            self._scheduling.discard(task.task_id)
        return task

    async def _redis_silence(self, timeout_s: float = 0.5) -> str:
        """When placers did not answer: a note naming Redis if it does not answer the gateway either (a placer
        answers only once its ledger write is in Redis, so an outage looks like every placer failing)."""
        try:
            await asyncio.wait_for(self.store.redis.ping(), timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure to answer is the news
            return f"; Redis does not answer the gateway either ({str(exc) or f'no reply in {timeout_s:g} s'}): " \
                   "the placers cannot write their ledgers until it is back"
        return ""

    async def _commit(self, task: pb.Task, records: list[Record], fences=(), claim: str = "") -> None:
        """Make the Submit's records durable. If the task stream does not take them, nothing of the task is kept
        (`_give_up`) and the client gets UNAVAILABLE."""
        try:  # the request's claim: held while the records are written, dropped with them (no round trip)
            await self.store.write(*records, fences=fences, drop=((claim, task.task_id),) if claim else ())
        except NotReplicated as exc:  # on the master, not confirmed on its replicas: kept or lost, not failed
            self._settle(task, claim)
            raise rpc.Unavailable(f"the task was recorded on the Redis master but its replicas did not confirm it "
                                  f"in time ({exc}); retry with the same request_id: you get the task once they "
                                  "hold it, or a fresh attempt if a failover lost it") from exc
        except Exception as exc:
            reason = f"the task stream did not take its record ({type(exc).__name__}: {exc})"
            self._give_up(task, claim, reason)
            if isinstance(exc, Conflict):
                raise rpc.Unavailable(f"this gateway lost its lease or the claim of the request while scheduling "
                                      f"it ({exc}); nothing was kept and any placement is released: retry (with "
                                      "the same request_id)") from exc
            raise rpc.Unavailable(f"the task store could not record the task ({type(exc).__name__}: {exc}); nothing "
                                  "was kept and any placement is released: retry (with the same request_id)") from exc

    def _settle(self, task: pb.Task, claim: str) -> None:
        """A Submit whose records reached the master but not (yet) its replicas: kept once the replicas hold them
        (another gateway may already have answered a retry with them), given up (`_give_up`) if a failover lost
        them. Until then its placement is no orphan, and a retry of the request here waits for the outcome."""
        task_id = task.task_id
        self._settling.add(task_id)

        async def settle() -> None:
            try:
                stands = await retry_with_backoff(lambda: self.store.kept(task_id), Exception, lambda exc, delay: (
                    f"cannot yet tell whether the unreplicated records of {task_id} were kept ({type(exc).__name__}: "
                    f"{exc}); retrying in {delay:g} s"), max_delay_s=5.0)
            finally:
                self._settling.discard(task_id)
            if stands:
                log.warning("Submit of %s: its records reached the Redis replicas after all; kept", task_id)
            else:
                self.store.forget(task_id)
                self._give_up(task, claim, "its records were lost with a failed-over Redis master before its "
                                           "replicas had them")

        self._retries_wait_for(task, {_track(asyncio.create_task(settle(), name=f"settle {task_id}"), self._abandoned)})

    def _retries_wait_for(self, task: pb.Task, jobs: set[asyncio.Task]) -> asyncio.Future | None:
        """A retry of `task`'s request on this gateway waits until `jobs` are done (`Submit`); the waiter, or None
        for a task without a request_id."""
        if not task.spec.request_id:
            return None
        key = (task.spec.tenant, task.spec.request_id)
        waiter = self._failed[key] = asyncio.ensure_future(asyncio.wait(jobs))
        waiter.add_done_callback(lambda w: self._failed.pop(key, None) if self._failed.get(key) is w else None)
        return waiter

    def _give_up(self, task: pb.Task, claim: str, reason: str) -> None:
        """End a Submit without keeping anything of it: release what it holds at a placer, write `abandoned` for it
        in the background (a failed write may have reached Redis without its reply); a retry with the same
        request_id starts afresh once those releases are confirmed."""
        if task.state in (pb.TASK_STATE_PLACED, pb.TASK_STATE_DEFERRED):
            self._abandon(task.task_id, task.datacenter)
        releases = self._releasing.get(task.task_id)
        waiter = self._retries_wait_for(task, set(releases)) if releases else None
        if waiter is not None and claim:  # other gateways' retries wait until the placement is released
            waiter.add_done_callback(lambda _: self._unclaim(claim, task.task_id))
        abandoned = step(ABANDONED, task, reason)

        async def record() -> Record:
            return abandoned

        self._durably(record, f"abandoned record of {task.task_id}")
        log.warning("Submit of %s failed: %s; released wherever it was placed", task.task_id, reason)

    def _durably(self, make: Callable[[], Awaitable[Record | None]], what: str, first_retry_s: float = 0.5
                 ) -> asyncio.Task:
        """Write the record `make` returns (None: nothing to write any more) until the task stream takes it, in
        the background: for facts that already hold at a placer whatever the stream says."""
        async def write_once() -> None:
            if (record := await make()) is not None:
                await self.store.write(record)

        async def write() -> None:
            await retry_with_backoff(write_once, Exception, lambda exc, delay: (
                f"cannot yet write the {what} ({type(exc).__name__}: {exc}); retrying in {delay:g} s"), first_retry_s)

        return _track(asyncio.create_task(write(), name=what), self._abandoned)

    async def _place(self, task: pb.Task, candidates, writes: list[Record], unserved: list[str]) -> None:
        """Try the DCs in rank order; if all are full now, queue at the best one that could hold it. Queued or
        REJECTED only when every DC that could hold the task answered: if a placer that might have taken it did
        not answer, or is not serving (`unserved`, left out by the selector), raises `PlacersUnavailable` and
        records nothing."""
        notes = task.explanation.notes
        full: list[str] = []
        unanswered: list[str] = []
        never: list[str] = []
        # an online task evicts offline work only where no DC has room for it (Volcano's preempt action runs
        # after allocate): first every DC without preemption, then the full ones with it, in rank order
        online = task.spec.priority_class == ONLINE
        for candidate in candidates:
            dc = candidate.datacenter
            reply = await self._call_place(task, dc, allow_defer=False, notes=notes, no_preemption=online)
            if reply is None:
                unanswered.append(dc)
            elif reply.outcome == placer_pb2.PLACE_OUTCOME_PLACED:
                self._placed(task, dc, reply, writes)
                return
            elif reply.outcome == placer_pb2.PLACE_OUTCOME_NO_ROOM:
                full.append(dc)
                notes.append(f"{dc}: no room now ({reply.reason}); trying the next data center")
            else:
                never.append(dc)
                notes.append(f"{dc}: cannot ever hold it ({reply.reason})")
        for dc in full if online else ():
            reply = await self._call_place(task, dc, allow_defer=False, notes=notes)
            if reply is None:
                unanswered.append(dc)
            elif reply.outcome == placer_pb2.PLACE_OUTCOME_PLACED:
                self._placed(task, dc, reply, writes)
                return
            else:
                notes.append(f"{dc}: no offline task to preempt for it ({reply.reason})")
        # queue only when every DC that could hold it answered: queued, it stays at that DC even once a placer
        # that did not answer (and might have had room) serves again
        if full and not (unanswered or unserved):  # at the best one only: `submit_bound_s` counts the Places
            dc = full[0]
            reply = await self._call_place(task, dc, allow_defer=True, notes=notes)
            if reply is None:
                unanswered.append(dc)
            elif reply.outcome == placer_pb2.PLACE_OUTCOME_PLACED:
                self._placed(task, dc, reply, writes)
                return
            elif reply.outcome == placer_pb2.PLACE_OUTCOME_DEFERRED:
                task.datacenter, task.reason = dc, reply.reason
                self._explain(task, reply)
                writes.append(step("deferred", task, f"queued at {dc}: {reply.reason}"))
                return
        task.datacenter = ""
        task.reason = "no data center could place it: " + "; ".join(notes)
        if unanswered or unserved:  # a placer restarting or stalled is no verdict on the task: the client retries
            raise PlacersUnavailable([*((dc, "its placer did not answer") for dc in unanswered),
                                      *((dc, "its placer is not serving") for dc in unserved),
                                      *((dc, "no room now") for dc in full if dc not in unanswered),
                                      *((dc, "cannot ever hold it") for dc in never)], task.reason)
        writes.append(step("rejected", task, task.reason))

    async def _call_place(self, task: pb.Task, dc: str, allow_defer: bool, notes, no_preemption: bool = False
                          ) -> placer_pb2.PlaceResponse | None:
        placer = self.place.get(dc)
        if placer is None:  # this gateway's configuration, not a placer's state: a verdict like UNSCHEDULABLE
            return placer_pb2.PlaceResponse(outcome=placer_pb2.PLACE_OUTCOME_UNSCHEDULABLE,
                                            reason="no placer address configured at this gateway")
        try:
            return await placer.call(placer_pb2.PlaceRequest(task_id=task.task_id, task=task.spec,
                                                             allow_defer=allow_defer, no_preemption=no_preemption),
                                     self.place_timeout_s)
        except grpc.aio.AioRpcError as exc:
            notes.append(f"{dc}: placer unavailable ({exc.code().name}: {exc.details()})")
            self._abandon(task.task_id, dc)
            return None

    async def reconcile(self, redis, keys: Keys) -> tuple[int, int]:
        """At start, make the task table and the placers' ledgers agree. A Submit that a previous gateway left
        half-done (a record still `submitted`, written by a gateway that recorded steps one by one) is recorded
        `abandoned`: it leaves the table and its request_id is free, so the client's retry with the same
        request_id is a fresh attempt. Then `release_orphans`. Returns (Submits settled, releases started)."""
        interrupted = [self.store.copy(t.task_id) for t in list(self.store.tasks.values())
                       if t.state == pb.TASK_STATE_SUBMITTED]
        if interrupted:
            await self.store.write(*(step(ABANDONED, t, "the gateway stopped while scheduling it; released "
                                                        "wherever it had been placed") for t in interrupted if t))
        return len(interrupted), await self.release_orphans(redis, keys)

    async def release_orphans(self, redis, keys: Keys, followed: bool = False) -> int:
        """Release every task a DC's ledger holds (placed or queued) that the table does not show live (placed,
        running, deferred or preempted) at that DC and no gateway is placing now — a Submit that ended
        without a durable record, a Place whose answer was lost, a release not seen confirmed — there
        (`_abandon`). (Where a live task is — placed from the queue, requeued — the ledger follower records.)
        Another live gateway's placements are its own to settle (see hsched.state.gateways): only those of this
        gateway and of gateways that are gone are released, after the table caught up with the stream; those of
        DAG jobs' (ids naming no gateway) when their job's owner is this gateway or gone (with no owner known,
        a finished job's, only when no other gateway holds a lease). `followed`: read
        the ledgers' folds from the followers (the periodic sweep) instead of replaying them (at start).
        Returns the releases started."""
        candidates: list[tuple[str, str]] = []
        for dc in self.fleet.datacenters:
            if dc.name not in self.release:
                continue
            follower = self.lifecycle.followers.get(dc.name) if followed else None
            if follower is not None:
                state, queue = follower.state, follower.queue
            else:
                state, queue = ClusterState(dc), OrderedDict()
                await replay(redis, keys.ledger(dc.name), state, queue)
            candidates += [(task_id, dc.name) for task_id in [*state.allocations, *queue]
                           if self._orphan(task_id, dc.name)]
        if candidates and self.lease is not None:
            # whose each is: a Submit's gateway (named in its id), a DAG job task's job owner (none when unknown)
            jobs = sorted({j for t, _ in candidates if owner_of(t) is None and (j := job_of(t)) is not None})
            job_owners = dict(zip(jobs, [o.decode() if o else None for o in
                                         await redis.mget([keys.job_owner(j) for j in jobs])], strict=True)) \
                if jobs else {}
            owners = {t: owner_of(t) or job_owners.get(job_of(t) or "") for t, _ in candidates}
            alive = await self.lease.alive({o for o in owners.values() if o is not None})
            solo = None not in owners.values() or not [
                k async for k in redis.scan_iter(match=keys.gateway("*"), count=1000) if k.decode() != self.lease.key]
            await self.store.refresh()  # recorded by a gateway that is gone: in the table now
            candidates = [(t, dc) for t, dc in candidates if self._orphan(t, dc) and (
                owners[t] == self.lease.id or owners[t] not in alive if owners[t] is not None else solo)]
        for task_id, dc in candidates:
            self._abandon(task_id, dc)
        return len(candidates)

    def _orphan(self, task_id: str, dc: str) -> bool:
        """Whether the table has no live record of `task_id` at `dc` and this gateway is neither placing nor
        releasing it."""
        if task_id in self._scheduling or task_id in self._releasing or task_id in self._settling:
            return False
        task = self.store.tasks.get(task_id)
        return task is None or task.datacenter != dc or task.state not in LIVE

    async def _await_record(self, task_id: str, at_ms: int) -> None:
        """A DC ledger entry of `at_ms` (Redis time) names `task_id`, which the table does not hold: if another
        gateway may still be scheduling it (a Submit ends within `submit_bound_s` of its Place), wait until its
        record shows, that gateway is gone or that time is past, so its placer-initiated steps are recorded after
        it (by this follower or that gateway's: the versions decide who)."""
        try:
            await self._await_record_of(task_id, at_ms / 1000 + self.submit_bound_s)
        except Exception as exc:  # noqa: BLE001 - Redis away: the step is decided on the table as it is
            log.warning("cannot check whether %s is being recorded (%s: %s)", task_id, type(exc).__name__, exc)

    async def _await_record_of(self, task_id: str, until_unix_s: float) -> None:
        assert self.lease is not None
        owner = owner_of(task_id)
        if owner is None or owner == self.lease.id:
            return  # this gateway's own: `busy` waits for them
        loop = asyncio.get_running_loop()
        checked = 0.0
        await self.store.refresh()
        while task_id not in self.store.tasks and task_id not in self.store.abandoned:
            if time.time() > until_unix_s:
                return
            if loop.time() - checked > 0.5:
                if not await self.lease.alive({owner}):
                    await self.store.refresh()
                    return
                checked = loop.time()
            await asyncio.sleep(0.02)

    def _abandon(self, task_id: str, dc: str) -> asyncio.Task:
        """A Place at `dc` ended without an answer (or without a durable record), and the task may now go to
        another data center or be retried. The placer commits nothing for the call after its deadline, but it
        may have done so before and the answer been lost: release the task there, in the background until that
        placer confirms, so the task never holds resources in two data centers. (A release of a task the placer
        does not hold changes nothing.)"""
        job = _track(asyncio.create_task(self._release_abandoned(task_id, dc), name=f"release {task_id} at {dc}"),
                     self._abandoned)
        self._releasing.setdefault(task_id, set()).add(job)

        def done(_: asyncio.Task) -> None:
            jobs = self._releasing.get(task_id, set())
            jobs.discard(job)
            if not jobs:
                self._releasing.pop(task_id, None)

        job.add_done_callback(done)
        return job

    async def _release_abandoned(self, task_id: str, dc: str, first_retry_s: float = 0.5) -> None:
        reply = await retry_with_backoff(
            lambda: self.release[dc].call(placer_pb2.PlacerReleaseRequest(task_id=task_id), self.place_timeout_s),
            grpc.aio.AioRpcError, lambda exc, delay: (
                f"placer {dc}: cannot yet release the unanswered placement of {task_id} ({exc.code().name}); "
                f"retrying in {delay:g} s"), first_retry_s,
            # each call already waits up to place_timeout_s for the placer (wait_for_ready): retry soon after, so a
            # retry of the request waiting for this release goes on within seconds of the placer's return
            max_delay_s=2.0)
        if reply.released:
            log.warning("placer %s had placed %s before the gateway gave up on it; released there", dc, task_id)

    async def follow_ledgers(self, redis, keys: Keys) -> asyncio.Task:
        """Catch up with every DC ledger beyond what the task stream already reflects, then follow them all (in
        the background, on `redis`, a client of its own: the read blocks) until `close`."""
        followers = [LedgerFollower(redis, keys.ledger(dc.name), dc) for dc in self.fleet.datacenters
                     if dc.name in self.release]
        await self.lifecycle.start(redis, followers)
        self._following = asyncio.create_task(follow(redis, followers), name="ledger followers")
        return self._following

    async def close(self) -> None:
        """Let started Submits and Releases finish, stop the batch streams; say which unanswered placements are
        still to be released."""
        if self._jobs:
            await asyncio.wait(self._jobs, timeout=self.select_timeout_s + 2 * self.place_timeout_s)
        for job in self._abandoned:
            log.warning("gateway stopping before this was done: %s (the next gateway's reconcile finishes it)",
                        job.get_name())
        await cancel_and_wait(list(self._abandoned))
        for _, c in self.coalescers():
            await c.close()
        await cancel_and_wait([self._following])
        await self.transitions.close()

    def _explain(self, task: pb.Task, reply: placer_pb2.PlaceResponse) -> None:
        ex = task.explanation
        ex.placer_policy = reply.policy
        del ex.alternatives[:]
        ex.alternatives.extend(reply.alternatives)
        if reply.HasField("thermal"):
            ex.thermal.CopyFrom(reply.thermal)
        ex.notes.extend(reply.notes)

    def _placed(self, task: pb.Task, dc: str, reply: placer_pb2.PlaceResponse, writes: list[Record]) -> None:
        task.datacenter, task.reason = dc, ""
        del task.assignments[:]
        task.assignments.extend(reply.assignments)
        self._explain(task, reply)
        nodes = sorted({a.node for a in reply.assignments})
        writes.append(step("placed", task, f"{dc}: {', '.join(nodes[:4])}"
                           + (f" (+{len(nodes) - 4} more)" if len(nodes) > 4 else "")))

    # -- DAG jobs (the logic is hsched.jobs; these translate and check) --------------------------------------------

    async def _select(self, spec: pb.TaskSpec, method: str) -> selector_pb2.SelectResponse:
        return await self.select.call(selector_pb2.SelectRequest(task=spec, method=method, include_room=True),
                                      self.select_timeout_s)

    @rpc.grpc_errors
    async def SubmitJob(self, request: gateway_pb2.SubmitJobRequest, context) -> gateway_pb2.SubmitJobResponse:
        principal = self.auth.authenticate(context)
        if not request.HasField("job"):
            raise ValidationError("job", "is required")
        job = gateway_pb2.SubmitJobRequest().job
        job.CopyFrom(request.job)
        # the same tenant rules as Submit: a tenant's forged field is ignored, its request ids are its own
        job.tenant = submit_tenant(principal, job.tenant)
        entry = job.entry_vertex
        if entry and entry not in self.fleet.wan.entry_vertices:
            raise ValidationError("job.entry_vertex", "must be one of the fleet's entry vertices "
                                  f"({', '.join(self.fleet.wan.entry_vertices[:6])}, ...)", entry)
        if request.selector_method and request.selector_method not in METHODS:
            raise ValidationError("selector_method", f"must be one of {', '.join(METHODS)} or empty",
                                  request.selector_method)
        answer, duplicate = await self.jobs.submit(job, request.selector_method)
        if duplicate and (asked := normalized(job)) != answer.spec:
            raise reused_request("job", job.request_id, answer.job_id, [
                f.name for f in asked.DESCRIPTOR.fields if getattr(asked, f.name) != getattr(answer.spec, f.name)])
        return gateway_pb2.SubmitJobResponse(job=answer, duplicate=duplicate)

    async def _job(self, job_id: str, principal: Principal | None) -> pb.Job:
        """The job `principal` asked for; another tenant's gets the very answer of a job that does not exist.
        One this table does not hold may have just been recorded by another gateway: the table catches up first."""
        if not job_id:
            raise ValidationError("job_id", "is required")
        job = self.store.jobs.get(job_id)
        if job is None and self.lease is not None:
            await self.store.refresh()
            job = self.store.jobs.get(job_id)
        if job is None or not may_see(principal, job.spec.tenant):
            raise LookupError(f"job {job_id} not found")
        return self.jobs.get(job_id)

    @rpc.grpc_errors
    async def GetJob(self, request: gateway_pb2.GetJobRequest, context) -> pb.Job:
        return await self._job(request.job_id, self.auth.authenticate(context))

    @rpc.grpc_errors
    async def ListJobs(self, request: gateway_pb2.ListJobsRequest, context) -> gateway_pb2.ListJobsResponse:
        if request.limit > LIST_MAX:
            raise ValidationError("limit", f"must be <= {LIST_MAX}", request.limit)
        tenant = tenant_filter(self.auth.authenticate(context), request.tenant)
        limit = request.limit or LIST_DEFAULT
        check_page_token(request.page_token)
        out: list[pb.Job] = []
        for job_id in sorted(self.store.jobs):
            if request.page_token and job_id <= request.page_token:
                continue
            j = self.store.jobs[job_id]
            if (tenant and j.spec.tenant != tenant) or (request.state and j.state != request.state):
                continue
            if len(out) == limit:  # one more matches: there is a next page (a full last page has no token)
                return gateway_pb2.ListJobsResponse(jobs=out, next_page_token=out[-1].job_id)
            out.append(self.jobs.get(job_id))
        return gateway_pb2.ListJobsResponse(jobs=out)

    @rpc.grpc_errors
    async def CancelJob(self, request: gateway_pb2.CancelJobRequest, context) -> pb.Job:
        await self._job(request.job_id, self.auth.authenticate(context))
        return await asyncio.shield(self._start(self.jobs.cancel(request.job_id)))

    async def submit_job_task(self, task_id: str, spec: pb.TaskSpec, dc: str) -> pb.Task:
        """Submit one task of a DAG job to its job's DC, deduplicated by its (deterministic) task id: a task already
        recorded, or being submitted, is answered as it stands."""
        while True:
            known = self.store.tasks.get(task_id)
            if known is not None:
                return known
            if task_id not in self._job_tasks:
                break
            await asyncio.wait([self._job_tasks[task_id]])
        job = self._job_tasks[task_id] = self._start(self._submit_at(task_id, spec, dc))
        job.add_done_callback(lambda _: self._job_tasks.pop(task_id, None))
        return await asyncio.shield(job)

    async def _submit_at(self, task_id: str, spec: pb.TaskSpec, dc: str) -> pb.Task:
        """Place at `dc` (queueing if full) and record it. Unlike a Submit, nothing is given up: the job is durable
        and the task id fixed, so an unreachable placer or task stream is waited for (an unanswered Place is
        released first), and a gateway crash in between is settled by the next one's reconcile and a re-submit."""
        task = pb.Task(task_id=task_id, spec=spec, created_unix_ms=now_ms(), datacenter=dc)
        records = [step("submitted", task), step("dc_selected", task, f"{dc}: the data center of job {spec.job_id}")]
        placer = self.place.get(dc)
        self._scheduling.add(task_id)
        try:
            if placer is None:
                task.reason = f"{dc}: no placer address configured"
                records.append(step("rejected", task, task.reason))
            else:
                async def place() -> placer_pb2.PlaceResponse:
                    if releases := self._releasing.get(task_id):  # an earlier unanswered attempt's release first
                        await asyncio.wait(set(releases))
                    try:
                        return await placer.call(placer_pb2.PlaceRequest(task_id=task_id, task=spec, allow_defer=True),
                                                 self.place_timeout_s)
                    except grpc.aio.AioRpcError:
                        self._abandon(task_id, dc)
                        raise

                reply = await retry_with_backoff(place, grpc.aio.AioRpcError, lambda exc, delay: (
                    f"placer {dc}: cannot yet place {task_id} of a job ({exc.code().name}); retrying in {delay:g} s"))
                if reply.outcome == placer_pb2.PLACE_OUTCOME_PLACED:
                    self._placed(task, dc, reply, records)
                elif reply.outcome == placer_pb2.PLACE_OUTCOME_DEFERRED:
                    task.reason = reply.reason
                    self._explain(task, reply)
                    records.append(step("deferred", task, f"queued at {dc}: {reply.reason}"))
                elif reply.outcome == placer_pb2.PLACE_OUTCOME_FINISHED:  # placed and run by an attempt never
                    # recorded (its gateway stalled or died): how it ended, not a second run
                    task.finished_unix_ms = reply.finished_unix_ms
                    task.reason = "" if reply.finished_ok else reply.reason
                    records.append(step("succeeded" if reply.finished_ok else "failed", task,
                                        f"already ran to completion at {dc}: {reply.reason}",
                                        at_ms=reply.finished_unix_ms))
                else:
                    task.reason = f"{dc} cannot hold it: {reply.reason}"
                    records.append(step("rejected", task, task.reason))
            async def record() -> pb.Task | Conflict:
                try:
                    await self.store.write(*records, fences=self.jobs.fences(spec.job_id))
                    return task
                except Conflict as exc:  # recorded by a gateway that adopted the job meanwhile: its answer
                    await self.store.refresh()
                    return self.store.tasks.get(task_id) or exc

            outcome = await retry_with_backoff(record, Exception, lambda exc, delay: (
                f"cannot yet record {task_id} of a job ({type(exc).__name__}: {exc}); retrying in {delay:g} s"))
        finally:
            self._scheduling.discard(task_id)
        if isinstance(outcome, Conflict):
            # this gateway no longer owns the job (it stalled past its lease and another adopted it): what it
            # placed is the new owner's to record (its Place of the same task id gets the same placement)
            raise outcome
        return outcome

    async def release_job_task(self, task_id: str) -> pb.Task | None:
        """Release one task of a failed or cancelled job, if it still holds or waits for resources."""
        await self.store.settled(task_id)
        task = self.store.tasks.get(task_id)
        if task is None or task.state not in LIVE:
            return task
        return await asyncio.shield(self._start(self._release(task_id)))

    # -- Release -----------------------------------------------------------------------------------------------

    @rpc.grpc_errors
    async def Release(self, request: gateway_pb2.ReleaseRequest, context) -> gateway_pb2.ReleaseResponse:
        task = await self._task(request.task_id, self.auth.authenticate(context))
        if task.state in TERMINAL:
            task = await self._durable_record(task)
        if task.state in TERMINAL:
            return gateway_pb2.ReleaseResponse(task=task)  # nothing held (any more): a no-op, the task unchanged
        if task.state == pb.TASK_STATE_SUBMITTED:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"task {task.task_id} is still being scheduled; release it once Submit returned")
        # like a Submit: finished once started
        return gateway_pb2.ReleaseResponse(task=await asyncio.shield(self._start(self._release(task.task_id))))

    async def _release(self, task_id: str) -> pb.Task:
        """Release at the placer, then record it. If the record is not taken, the table still shows the task
        placed and the client gets UNAVAILABLE: its retry releases again (a no-op at the placer) and records it.
        A task the placer no longer held may have finished meanwhile: once the ledger follower has read what
        the placer wrote, a finished task is answered as it is. (Tasks the release let the placer place from its
        queue are recorded by the ledger follower, and waited for, so a Get after the Release shows them placed.)"""
        task = self.store.copy(task_id)
        if task is None:  # Release found it in the table; only an `abandoned` record removes a task
            raise LookupError(f"task {task_id} not found")
        dc = task.datacenter
        reply = await self.release[dc].call(placer_pb2.PlacerReleaseRequest(task_id=task.task_id),
                                            self.place_timeout_s)
        if not reply.released or reply.placed_from_queue:  # what the placer wrote shows once Release answers
            await self.lifecycle.settle(dc, self.place_timeout_s)
        for _ in range(10):  # another gateway may record a step of it first (Conflict): catch up, decide again
            await self.store.settled(task_id)
            task = self.store.copy(task_id) or task
            if task.state in TERMINAL:
                return task
            task.finished_unix_ms = now_ms()
            task.reason = ""  # why it waited ("no node has room now") no longer applies; the event says what it freed
            try:
                await self.store.record("released", task, f"freed {reply.freed.cpu_milli / 1000:g} cores, "
                                        f"{reply.freed.gpu_count} GPU slices at {dc}")
                return task
            except Conflict:
                await self.store.refresh()
            except Exception as exc:
                raise rpc.Unavailable(f"released at {dc}, but the task store could not record it "
                                      f"({type(exc).__name__}: {exc}); retry the Release") from exc
        raise rpc.Unavailable(f"released at {dc}, but other gateways kept recording steps of {task_id} first; "
                              "retry the Release")

    # -- reads -------------------------------------------------------------------------------------------------

    async def _task(self, task_id: str, principal: Principal | None) -> pb.Task:
        """The task `principal` asked for; another tenant's gets the very answer of a task that does not exist.
        One this table does not hold may have just been recorded by another gateway: the table catches up first."""
        if not task_id:
            raise ValidationError("task_id", "is required")
        task = self.store.tasks.get(task_id)
        if task is None and self.lease is not None:
            await self.store.refresh()
            task = self.store.tasks.get(task_id)
        if task is None or not may_see(principal, task.spec.tenant):
            raise LookupError(f"task {task_id} not found")
        return task

    @rpc.grpc_errors
    async def Get(self, request: gateway_pb2.GetRequest, context) -> pb.Task:
        return await self._task(request.task_id, self.auth.authenticate(context))

    @rpc.grpc_errors
    async def List(self, request: gateway_pb2.ListRequest, context) -> gateway_pb2.ListResponse:
        tenant = tenant_filter(self.auth.authenticate(context), request.tenant)
        if request.limit > LIST_MAX:
            raise ValidationError("limit", f"must be <= {LIST_MAX}", request.limit)
        limit = request.limit or LIST_DEFAULT
        check_page_token(request.page_token)
        out: list[pb.Task] = []
        for task_id in sorted(self.store.tasks):
            if request.page_token and task_id <= request.page_token:
                continue
            t = self.store.tasks[task_id]
            if ((tenant and t.spec.tenant != tenant) or (request.state and t.state != request.state)
                    or (request.datacenter and t.datacenter != request.datacenter)
                    or (request.job_id and t.spec.job_id != request.job_id)):
                continue
            if len(out) == limit:  # one more matches: there is a next page (a full last page has no token)
                return gateway_pb2.ListResponse(tasks=out, next_page_token=out[-1].task_id)
            out.append(t)
        return gateway_pb2.ListResponse(tasks=out)

    @rpc.grpc_stream_errors
    async def Watch(self, request: gateway_pb2.WatchRequest, context):
        principal = self.auth.authenticate(context)
        after = parse_after(request.after_event_id)
        if request.task_id:
            await self._task(request.task_id, principal)  # NOT_FOUND for a task this gateway does not know (or hides)
        if request.job_id:
            await self._job(request.job_id, principal)
        assert self.feed is not None, "serve() gives the servicer its feed"
        # a tenant's Watch counts against its own per-tenant cap, so the metric's tenant label stays bounded
        recheck_at = time.monotonic() + WATCH_REAUTH_S
        async for event in self.feed.watch(after, request.task_id, tenant_filter(principal, request.tenant),
                                           request.job_id):
            if self.auth.enabled and time.monotonic() >= recheck_at:
                # a token revoked (or expired) since the Watch began ends it (UNAUTHENTICATED) before its next event
                self.auth.authenticate(context)
                recheck_at = time.monotonic() + WATCH_REAUTH_S
            yield event


    # -- fleet views -------------------------------------------------------------------------------------------

    async def _view(self, dc, include_nodes: bool = False, gpu_model: str = "", include_tenants: bool = False):
        return await datacenter_view(dc, self.placers.get(dc.name), self.store.redis, self.keys,
                                     self.select_timeout_s, include_nodes, gpu_model, include_tenants)

    @rpc.grpc_errors
    async def ListDatacenters(self, request, context) -> gateway_pb2.ListDatacentersResponse:
        # any principal may see the fleet's capacity; the tenants' shares: a tenant sees its own only
        principal = self.auth.authenticate(context)
        views = await asyncio.gather(*(self._view(dc, include_tenants=request.include_tenants)
                                       for dc in self.fleet.datacenters))
        for view in views:
            if any(not may_see(principal, t.tenant) for t in view.tenants):
                mine = [t for t in view.tenants if may_see(principal, t.tenant)]
                del view.tenants[:]
                view.tenants.extend(mine)
        return gateway_pb2.ListDatacentersResponse(datacenters=views)

    @rpc.grpc_errors
    async def GetDatacenter(self, request, context) -> gateway_pb2.DatacenterView:
        self.auth.authenticate(context)
        names = [dc.name for dc in self.fleet.datacenters]
        if request.datacenter not in names:
            raise ValidationError("datacenter", f"must be one of the fleet's data centers ({', '.join(names)})",
                                  request.datacenter)
        dc = self.fleet.datacenter(request.datacenter)
        models = sorted({p.gpu_model for p in dc.pools if p.gpu_count})
        if request.gpu_model and request.gpu_model not in models:
            raise ValidationError("gpu_model", f"must be a GPU model of {dc.name} ({', '.join(models) or 'it has none'})",
                                  request.gpu_model)
        return await self._view(dc, include_nodes=True, gpu_model=request.gpu_model)

    @rpc.grpc_errors
    async def SetNodesSchedulable(self, request: gateway_pb2.SetNodesSchedulableRequest, context
                                  ) -> placer_pb2.SetSchedulableResponse:
        principal = self.auth.authenticate(context)
        if principal is not None and not principal.admin:
            raise rpc.PermissionDenied("cordoning or draining nodes is an admin's action (this caller is tenant "
                                       f"{principal.tenant!r})")
        if request.datacenter not in self.placers:
            raise ValidationError("datacenter", f"must be one of the fleet's data centers ({', '.join(self.placers)})",
                                  request.datacenter)
        # a restarting placer gets until the timeout to come back; the call is idempotent, so a client may retry
        return await self.placers[request.datacenter].SetSchedulable(placer_pb2.SetSchedulableRequest(
            nodes=request.nodes, schedulable=request.schedulable, reason=request.reason, evict=request.evict),
            timeout=2 * self.place_timeout_s, wait_for_ready=True)

    @rpc.grpc_errors
    async def DescribeTask(self, request: gateway_pb2.GetRequest, context) -> gateway_pb2.TaskDescription:
        task = await self._task(request.task_id, self.auth.authenticate(context))  # a tenant: its own tasks only
        events, truncated = await task_history(self.store.redis, self.store.stream, task)
        return gateway_pb2.TaskDescription(task=task, events=events, events_truncated=truncated)


def gateway_auth(args) -> GatewayAuth:
    """Tenant authentication from the flags: a tokens file, and/or verified client certificates when the gateway
    serves TLS requiring them (`--client-auth require`: grpc Python cannot ask for an optional client
    certificate, so under `optional` none ever arrives). Neither: off (local development; the `tenant` field is
    trusted)."""
    tokens = None
    if args.tokens_file:
        try:
            tokens = TokensFile(args.tokens_file)
        except TokensFileError as exc:
            raise SystemExit(f"--tokens-file: {exc}") from None
    certificates = bool(getattr(args, "tls_dir", None)) and getattr(args, "client_auth", None) == "require"
    auth = GatewayAuth(tokens, certificates)
    if auth.enabled:
        log.info("tenant authentication on: %s%s", f"{len(tokens.table().entries)} tokens in {args.tokens_file}"
                 if tokens else "no tokens file", "; tenant/admin client certificates accepted" if certificates else "")
    else:
        log.info("tenant authentication off (no --tokens-file, no client certificates): the `tenant` field of a "
                 "request is trusted; for local development only")
    return auth


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
    datacenters = [*(dc.name for dc in servicer.fleet.datacenters), m.NO_DATACENTER]

    def count_by_state(records, states):
        """Every (state, DC) pair, 0 included: a series that vanished at zero would read as "no data" (as
        kube-state-metrics exports every pod phase)."""
        names = {number: name.split("_STATE_", 1)[1].lower() for name, number in states if number}

        def collect():
            counts = dict.fromkeys(((name, dc) for name in names.values() for dc in datacenters), 0)
            for r in list(records.values()):  # scraped on the metrics thread: iterate a copy
                key = (names[r.state], r.datacenter or m.NO_DATACENTER)
                counts[key] = counts.get(key, 0) + 1
            return [(k, float(v)) for k, v in counts.items()]
        return collect

    metrics.register_gauge_family(*m.HSCHED_TASKS, count_by_state(store.tasks, pb.TaskState.items()))
    metrics.register_gauge_family(*m.HSCHED_JOBS, count_by_state(store.jobs, pb.JobState.items()))
    if servicer.feed is not None:
        feed = servicer.feed
        metrics.register_gauge_family(*m.HSCHED_GATEWAY_WATCHES, lambda: [
            ((t or m.ALL_TENANTS,), float(n)) for t, n in list(feed.open.items())])

    coalescers = servicer.coalescers()

    def sent(attr: str):
        return lambda: [(labels, float(getattr(c, attr))) for labels, c in coalescers]

    metrics.register_counter_family(*m.HSCHED_GATEWAY_BATCHED_CALLS, sent("calls"))
    metrics.register_counter_family(*m.HSCHED_GATEWAY_BATCHES, sent("batches"))


def removed_dcs_must_hold_nothing(store: TaskStore, fleet: Fleet) -> None:
    """A fleet file without a DC that live tasks or jobs are in: LayoutConflict (one line, exit 2, nothing
    written), as for removed nodes that hold tasks. Served, those tasks could never be released (NOT_FOUND) and
    would show RUNNING for ever."""
    names = {dc.name for dc in fleet.datacenters}
    held: dict[str, list[str]] = {}
    for t in store.tasks.values():
        if t.datacenter and t.datacenter not in names and t.state not in TERMINAL:
            held.setdefault(t.datacenter, []).append(t.task_id)
    for j in store.jobs.values():
        if j.datacenter and j.datacenter not in names and j.state not in JOB_TERMINAL:
            held.setdefault(j.datacenter, []).append(j.job_id)
    if held:
        what = "; ".join(f"{dc}: {len(ids)} live ({', '.join(sorted(ids)[:3])}{', …' if len(ids) > 3 else ''})"
                         for dc, ids in sorted(held.items()))
        raise LayoutConflict(f"the fleet file has no data center that live tasks or jobs are in ({what}); start with "
                             "the previous fleet file and release them or let them finish, then remove it (or "
                             "discard that state: `hsched up --fresh`, another --state-dir or --prefix)")


async def serve(args, stop: asyncio.Event, fleet: Fleet | None = None) -> None:
    fleet = fleet or load_fleet(args.fleet)
    targets = parse_placers(args.placers)
    unknown = set(targets) - {dc.name for dc in fleet.datacenters}
    if unknown:
        raise SystemExit(f"--placers names data centers not in the fleet: {sorted(unknown)}")
    if targets and (missing := [dc.name for dc in fleet.datacenters if dc.name not in targets]):
        # (a replica configured by hand, a DC added to the fleet and not here) its tasks would all be REJECTED
        raise SystemExit(f"--placers must name every data center of the fleet; missing: {missing}")
    auth = gateway_auth(args)
    redis = connect(args.redis_url)
    guard, epoch_watch = await guard_epoch(redis, Keys(args.prefix), args, stop)  # before the table is rebuilt
    store = TaskStore(redis, Keys(args.prefix).tasks, epoch_key=Keys(args.prefix).epoch, epoch=guard.epoch,
                      min_replicas=args.redis_min_replicas, wait_timeout_ms=args.redis_wait_ms)
    loaded = await store.load()
    removed_dcs_must_hold_nothing(store, fleet)
    # this gateway's lease (other gateways may share the prefix): held before anything is placed under it
    lease = GatewayLease(redis, Keys(args.prefix), int(args.gateway_lease_s * 1000))
    await lease.acquire()
    keeping = asyncio.create_task(lease.keep(), name="gateway lease")
    tls = tls_files(args, "gateway")
    channels = [rpc.channel(args.selector, tls, peer="selector"),
                *(rpc.channel(t, tls, peer="placer") for t in targets.values())]
    servicer = GatewayServicer(fleet, store, selector_pb2_grpc.SelectorStub(channels[0]),
                               {dc: placer_pb2_grpc.PlacerStub(ch) for dc, ch in zip(targets, channels[1:], strict=True)},
                               args.select_timeout_s, args.place_timeout_s, auth=auth, lease=lease)
    servicer.keys = Keys(args.prefix)
    settled, released = await servicer.reconcile(redis, Keys(args.prefix))
    ledger_redis = connect(args.redis_url)  # the followers' blocking read gets a client of its own
    following = await servicer.follow_ledgers(ledger_redis, Keys(args.prefix))
    resumed = servicer.jobs.recover()  # after reconcile: a job's unrecorded placements are released, then re-placed
    # Watches read through a client of their own (one reader + a few catch-up pages), never the shared pool
    feed_redis = connect(args.redis_url)
    # the one reader of the task stream: Watches, and the table's view of what other gateways record
    servicer.feed = TaskFeed(feed_redis, store.stream, store.last_id, args.max_watches, args.max_watches_per_tenant,
                             args.watch_buffer, observer=store.observe).start()

    async def sweep_orphans() -> None:
        """A Place a gateway sent just before it died can still be committed until its deadline, and another
        gateway may die at any time: look again, first once the previous gateway's last Place is past its
        deadline, then every --orphan-sweep-s."""
        await asyncio.sleep(args.place_timeout_s + 1.0)
        while True:
            try:
                if count := await servicer.release_orphans(redis, Keys(args.prefix), followed=True):
                    log.warning("released %d tasks placed by a gateway that is gone (or by this one's calls that "
                                "were not answered)", count)
            except Exception as exc:  # noqa: BLE001 - Redis away: next round
                log.warning("orphan sweep failed (%s: %s); next in %g s", type(exc).__name__, exc,
                            args.orphan_sweep_s)
            await asyncio.sleep(args.orphan_sweep_s)

    late = asyncio.create_task(sweep_orphans(), name="orphan sweep")
    # a DAG job whose gateway died is continued here (its owner's lease gone: adopted, hsched.jobs)
    adopting = asyncio.create_task(servicer.jobs.keep_adopting(args.gateway_lease_s), name="job adoption")
    pruning = asyncio.create_task(keep_pruned(store, args.task_retention_s, args.task_prune_interval_s),
                                  name="task retention")
    metrics = metrics_server(args)
    if metrics:
        register_metrics(metrics, store, servicer)
    server, port, _ = await rpc.start_server(
        lambda s: gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, s),
        [gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name], args.listen, metrics,
        tls=tls, client_auth=args.client_auth, reflection=reflection_on(args))
    log.info("gateway serving on port %d (%d task events replayed, %d tasks; %d interrupted Submits settled, %d "
             "tasks held by a placer without a record to match released; %d jobs resumed)", port, loaded,
             len(store.tasks), settled, released, resumed)
    await serve_until_stopped(stop, server, port, args, metrics=metrics,
                              tasks=[epoch_watch, late, adopting, pruning, following, keeping],
                              cleanup=[servicer.feed.close, servicer.jobs.close, servicer.close, lease.release,
                                       *(ch.close for ch in channels), feed_redis.aclose, ledger_redis.aclose,
                                       redis.aclose])
    exit_if_lost(guard)


def parser():
    p = common_args("hsched gateway: the public task endpoint")
    p.add_argument("--selector", default=os.environ.get("HSCHED_SELECTOR", "127.0.0.1:50052"))
    p.add_argument("--placers", default=os.environ.get("HSCHED_PLACERS", ""),
                   help="dc=host:port,... for every data center's placer")
    p.add_argument("--client-auth", default=os.environ.get("HSCHED_CLIENT_AUTH", "optional"), choices=CLIENT_AUTH,
                   help="with --tls-dir: require a CA client certificate (require), or not (optional, none: "
                        "grpc Python cannot request one without requiring it, see hsched.security.tls)")
    p.add_argument("--tokens-file", default=os.environ.get("HSCHED_TOKENS_FILE", ""),
                   help="YAML file of hashed bearer tokens (hsched tokens create): turns on tenant authentication; "
                        "re-read when it changes. Default (env HSCHED_TOKENS_FILE): off, for local development")
    p.add_argument("--select-timeout-s", type=float, default=2.0)
    p.add_argument("--place-timeout-s", type=float, default=5.0)
    p.add_argument("--gateway-lease-s", type=float, default=float(os.environ.get("HSCHED_GATEWAY_LEASE_S", 5)),
                   help="this gateway's lease in Redis: after it lapses (the gateway died or stalled), another "
                        "gateway of the prefix releases the placements it left without a record")
    p.add_argument("--orphan-sweep-s", type=float, default=float(os.environ.get("HSCHED_ORPHAN_SWEEP_S", 10)),
                   help="how often placements without a record (of gateways that are gone) are looked for")
    p.add_argument("--task-retention-s", type=float, default=float(os.environ.get("HSCHED_TASK_RETENTION_S", 86400)),
                   help="forget finished tasks (succeeded, failed, expired, released, rejected) this long after "
                   "their last change (docs/operations.md)")
    p.add_argument("--task-prune-interval-s", type=float,
                   default=float(os.environ.get("HSCHED_TASK_PRUNE_INTERVAL_S", 300)),
                   help="how often finished tasks are forgotten and the task stream compacted")
    p.add_argument("--max-watches", type=int, default=int(os.environ.get("HSCHED_MAX_WATCHES", "1000")),
                   help="Watch streams open at once on this gateway; more answer RESOURCE_EXHAUSTED")
    p.add_argument("--max-watches-per-tenant", type=int,
                   default=int(os.environ.get("HSCHED_MAX_WATCHES_PER_TENANT", "200")),
                   help="Watch streams open at once per tenant watched (a Watch of every tenant counts as tenant '')")
    p.add_argument("--watch-buffer", type=int, default=1000,
                   help="events a Watch may fall behind before it is ended with RESOURCE_EXHAUSTED")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    run("gateway", args, lambda stop: serve(args, stop))
