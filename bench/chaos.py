"""A chaos bench anyone can rerun: faults under a steady Submit+Release load, then an audit of every
acknowledged outcome against the gateway, the task stream and the data centers' ledgers.

It starts the stack as local processes (`hsched.stack.Stack`: an embedded redis-server, thermal, selector,
one placer per data center, gateway) and drives open-loop Submits (Poisson, `--rate`/s) of real Alibaba
openb tasks (`hsched.replay.load_trace`), each with a unique request_id and retried with that same id on
UNAVAILABLE / DEADLINE_EXCEEDED, as a real client would (bounded: `--budget-s` per call sequence). Each
PLACED or DEFERRED task is released after a random hold of 0.5-3 s, except the first `--keepers` placed
tasks of every phase: those are held until the end of the run, so every later fault (a Redis restart above
all) is tried against tasks acknowledged before it.

One phase per fault: `--pre-s` seconds of load, the fault, `--post-s` seconds of load, the load drained,
a health check (every service alive, every DC's lease held; what is not is reported and repaired, and
the repaired stack is loaded for `--after-repair-s` more, so what the repair leads to — placers rebuilt from a
wiped ledger handing out held resources again — is charged to this fault), then the audit. "First good
Submit" is the first PLACED/DEFERRED answer to a Submit sent after the fault and before any such repair. The faults, in this order:

  kill-gateway, kill-selector, kill-thermal, kill-placer   SIGKILL; restarted by the stack's supervisor if it
                                                           has one (`StackConfig.supervise`), else by the bench
                                                           (`Stack.restart`) after `--restart-after` s
  stop-placer        SIGSTOP the busiest placer for 5 s, then SIGCONT
  drain-node         `hsched drain` the node with most tasks of the busiest DC (its offline tasks evicted,
                     requeued, placed elsewhere); uncordoned 5 s later
  stall-redis        SIGSTOP the redis-server for 5 s, then SIGCONT
  restart-redis      SIGKILL the redis-server and start it again on the same port and data directory
  kill-redis-master  with `--redis-replicas 1`: SIGKILL the master, the Sentinel promotes the replica

The audit (`audit`) checks, for every acknowledged Submit (a task came back: PLACED, DEFERRED or REJECTED)
and every acknowledged Release:
  - lost: the gateway's Get answers NOT_FOUND or a state that the acknowledged one cannot legitimately
    become (PLACED -> PLACED or, once released, RELEASED; DEFERRED -> also PLACED; a released task stays
    RELEASED; REJECTED stays REJECTED); the same against the task stream in Redis (what a restarted gateway
    would rebuild); and an acknowledged-placed task not released by the client that its DC's ledger does not
    hold (a deferred one: neither holds nor queues);
  - double-allocated: each DC's ledger is folded event by event into `hsched.domain.cluster.ClusterState`
    (whose `apply` refuses an allocation that over-allocates or a task held twice: each refusal is a
    finding), and, independently, the resources of every live allocation in the ledger plus those of every
    acknowledged-placed task the ledger lost are summed per node and per GPU card and compared with
    capacity; a task live in two DCs' ledgers is a finding too, and so is a placement on a node cordoned then
    (the fold follows the cordon events).
Each phase's row counts the findings that are new since the previous audit (the fault that caused them).

    python bench/chaos.py [--quick] [--fleet PATH] [--faults kill-gateway,stall-redis,...] [--seed 0]
                          [--rate 30] [--redis-replicas 1] [--log-dir DIR]

It prints a markdown table (one row per fault, and a total) and exits 1 if anything acknowledged was lost
or double-allocated. Traffic stays on 127.0.0.1; everything started here is stopped at the end.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import secrets
import signal
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np

from hsched.convert import parts_from_pb, task_to_pb
from hsched.domain.cluster import ClusterState, OverAllocation, Part
from hsched.domain.fleet import DataCenter
from hsched.replay import load_trace, with_locations
from hsched.rpc import CHANNEL_OPTIONS
from hsched.stack import Stack, StackConfig
from hsched.stack import _serving as serving
from hsched.state.keys import Keys
from hsched.state.ledger import FREEING, fold_event
from hsched.state.lifecycle import ON_NODES  # placed, or started by its DC's executor: on its nodes
from hsched.state.redis import connect, connect_sync, free_port
from hsched.state.tasks import FINISHED, TaskStore  # FINISHED: ran to an end; its DC's ledger freed it
from hsched.v1 import common_pb2 as pb
from hsched.v1 import gateway_pb2, gateway_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
SMALL_FLEET = ROOT / "tests" / "fleets" / "small.yaml"
FAULTS = ("kill-gateway", "kill-selector", "kill-thermal", "kill-placer", "stop-placer", "drain-node", "stall-redis",
          "restart-redis", "kill-redis-master")
PAUSE_S = 5.0  # SIGSTOP of a placer / of Redis
RETRY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
HOLDING = (*ON_NODES, pb.TASK_STATE_DEFERRED)
PREFIX = "chaos"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def state_name(state: int) -> str:
    return pb.TaskState.Name(state).removeprefix("TASK_STATE_")


# -- the client --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Record:
    """One Submit as the client saw it, and the Release that followed."""

    request_id: str
    phase: str
    t_start: float
    t_end: float = 0.0
    task_id: str = ""  # set once acknowledged
    state: int = 0  # the acknowledged state
    datacenter: str = ""
    assignments: list = dataclasses.field(default_factory=list)
    error: str = ""  # the final status code of a Submit that was never acknowledged
    attempts: int = 0
    keeper: bool = False
    release_attempted: bool = False
    release_acked: bool = False
    release_state: int = 0  # what the acknowledged Release answered: RELEASED, or the final state it had reached
    release_phase: str = ""
    release_error: str = ""


class Client:
    """Open-loop Submit+Release load through the gateway, recording every outcome."""

    def __init__(self, target: str, specs: list, opts: argparse.Namespace) -> None:
        self.target, self.specs, self.opts = target, specs, opts
        self.rng = random.Random(opts.seed)
        self.run_id = secrets.token_hex(3)
        self.records: list[Record] = []
        self.channel: grpc.aio.Channel | None = None
        self.stub: gateway_pb2_grpc.GatewayStub | None = None

    async def __aenter__(self) -> Client:
        self.channel = grpc.aio.insecure_channel(self.target, options=CHANNEL_OPTIONS)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        return self

    async def __aexit__(self, *exc) -> None:
        if self.channel is not None:
            await self.channel.close()

    async def _call(self, method: Callable, request, what: list) -> object:
        """Call with the client's retry policy: the same request again on UNAVAILABLE / DEADLINE_EXCEEDED, with
        back-off, within `--budget-s`; other codes end it. `what` gets [attempts] as a side channel."""
        deadline = time.monotonic() + self.opts.budget_s
        delay = 0.1
        while True:
            what[0] += 1
            timeout = max(0.5, min(self.opts.call_timeout_s, deadline - time.monotonic()))
            try:
                return await method(request, timeout=timeout)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in RETRY or time.monotonic() + delay >= deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(1.0, 2 * delay)

    async def submit(self, i: int, phase: str, keeper: Callable[[], bool]) -> None:
        spec = task_to_pb(self.specs[i % len(self.specs)])
        spec.request_id, spec.tenant = f"chaos-{self.run_id}-{i}", "chaos"
        rec = Record(spec.request_id, phase, time.monotonic())
        self.records.append(rec)
        attempts = [0]
        try:
            reply = await self._call(self.stub.Submit, gateway_pb2.SubmitRequest(task=spec), attempts)
            # a duplicate still being scheduled by a gateway that went away: ask again (same request_id)
            while reply.task.state == pb.TASK_STATE_SUBMITTED and time.monotonic() - rec.t_start < self.opts.budget_s:
                await asyncio.sleep(0.5)
                reply = await self._call(self.stub.Submit, gateway_pb2.SubmitRequest(task=spec), attempts)
        except grpc.aio.AioRpcError as exc:
            rec.error, rec.t_end, rec.attempts = exc.code().name, time.monotonic(), attempts[0]
            return
        task = reply.task
        rec.t_end, rec.attempts = time.monotonic(), attempts[0]
        if task.state == pb.TASK_STATE_SUBMITTED:
            rec.error = "STILL_SUBMITTED"
            return
        rec.task_id, rec.state, rec.datacenter = task.task_id, task.state, task.datacenter
        rec.assignments = list(task.assignments)
        if task.state in HOLDING:
            if task.state == pb.TASK_STATE_PLACED and keeper():
                rec.keeper = True
                return
            await asyncio.sleep(self.rng.uniform(0.5, 3.0))
            await self.release(rec, phase)

    async def release(self, rec: Record, phase: str) -> None:
        rec.release_attempted = True
        try:
            reply = await self._call(self.stub.Release, gateway_pb2.ReleaseRequest(task_id=rec.task_id), [0])
        except grpc.aio.AioRpcError as exc:
            rec.release_error = exc.code().name
            return
        rec.release_acked, rec.release_phase, rec.release_state = True, phase, reply.task.state

    async def run(self, phase: str, stop: asyncio.Event) -> None:
        """Poisson arrivals at `--rate`/s until `stop`, then wait for every Submit and its Release (bounded)."""
        running: set[asyncio.Task] = set()
        kept = [0]

        def keeper() -> bool:
            kept[0] += 1
            return kept[0] <= self.opts.keepers

        while not stop.is_set():
            if len(running) < self.opts.max_inflight:
                job = asyncio.create_task(self.submit(len(self.records), phase, keeper))
                running.add(job)
                job.add_done_callback(running.discard)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.rng.expovariate(self.opts.rate))
        if running:
            _, late = await asyncio.wait(running, timeout=2 * self.opts.budget_s + 10)
            for job in late:  # bounded: a call the retry budget did not end is given up here
                job.cancel()
            await asyncio.gather(*late, return_exceptions=True)


# -- faults ------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Injected:
    t_fault: float  # monotonic time the fault began
    target: str
    recovered_by: str = "-"
    notes: list[str] = dataclasses.field(default_factory=list)


def supervised(stack: Stack) -> bool:
    return bool(getattr(stack.config, "supervise", False))


def replicated(stack: Stack) -> bool:
    return bool(getattr(stack.config, "redis_replicas", 0)) and hasattr(stack.redis, "kill_master")


def redis_node(stack: Stack):
    """The redis-server to stall or restart: the master of a replica set, else the embedded one."""
    return stack.redis.master() if hasattr(stack.redis, "master") else stack.redis


def _alive(stack: Stack, name: str) -> bool:
    svc = stack.services.get(name)
    return bool(svc and svc.proc and svc.proc.poll() is None)


def kill_service(stack: Stack, name: str, opts) -> Injected:
    """SIGKILL `name`; wait for the supervisor (if any) to bring it back, else restart it after a few seconds."""
    old_pid = stack.services[name].proc.pid
    out = Injected(time.monotonic(), name)
    if supervised(stack):  # a crash as the supervisor sees one (Stack.kill may be taken as a deliberate stop)
        os.killpg(old_pid, signal.SIGKILL)
    else:
        stack.kill(name)
    wait = max(opts.restart_after, 15.0) if supervised(stack) else opts.restart_after
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        svc = stack.services[name]
        if svc.proc and svc.proc.pid != old_pid and svc.proc.poll() is None and svc.port and serving(svc.target):
            out.recovered_by = f"supervisor ({time.monotonic() - out.t_fault:.1f} s)"
            return out
        time.sleep(0.1)
    stack.restart(name)
    out.recovered_by = f"bench: Stack.restart ({time.monotonic() - out.t_fault:.1f} s)"
    return out


def busiest_dc(stack: Stack, client: Client) -> str:
    held: dict[str, int] = {dc.name: 0 for dc in stack.fleet.datacenters}
    for r in client.records:
        if r.state == pb.TASK_STATE_PLACED and not r.release_acked and r.datacenter in held:
            held[r.datacenter] += 1
    return max(held, key=lambda dc: held[dc])


def busiest_placer(stack: Stack, client: Client) -> str:
    return stack.placer_service(busiest_dc(stack, client))  # its process (a group: all its DCs)


def drain_node(stack: Stack, client: Client) -> Injected:
    """`hsched drain` of the node holding most tasks of the busiest DC (its offline tasks evicted and requeued),
    kept cordoned for PAUSE_S under the load, then uncordoned: the audit checks nothing was placed on it meanwhile."""
    dc = busiest_dc(stack, client)

    def call(method, request):  # an operator retries what answered UNAVAILABLE (the call is idempotent)
        deadline = time.monotonic() + 30
        while True:
            try:
                return method(request, timeout=10)
            except grpc.RpcError as exc:
                if exc.code() not in RETRY or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    with grpc.insecure_channel(stack.gateway) as channel:
        gw = gateway_pb2_grpc.GatewayStub(channel)
        nodes = call(gw.GetDatacenter, gateway_pb2.GetDatacenterRequest(datacenter=dc)).nodes
        node = max(nodes, key=lambda n: n.tasks).name
        out = Injected(time.monotonic(), f"{dc} node {node} (drain)")
        reply = call(gw.SetNodesSchedulable, gateway_pb2.SetNodesSchedulableRequest(
            datacenter=dc, nodes=[node], evict=True, reason="chaos bench"))
        out.notes.append(f"drain of {dc}/{node}: {len(reply.evicted_task_ids)} offline task(s) evicted, "
                         f"{len(reply.placed_from_queue)} placed from the queue at once")
        time.sleep(PAUSE_S)
        call(gw.SetNodesSchedulable, gateway_pb2.SetNodesSchedulableRequest(datacenter=dc, nodes=[node],
                                                                            schedulable=True))
        out.recovered_by = f"bench: uncordoned after {PAUSE_S:g} s"
    return out


def pause_process(pid: int, seconds: float) -> None:
    """SIGSTOP, wait, SIGCONT (also when interrupted: nothing is left stopped)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)


# Faults and repairs restart processes, which hsched.children ties to the thread that spawned them: one thread,
# kept until after stack.stop() (asyncio.to_thread's would end with the event loop, taking its children along)
FAULT_THREAD = ThreadPoolExecutor(1, thread_name_prefix="chaos-faults")


async def in_fault_thread(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(FAULT_THREAD, fn, *args)


def inject(fault: str, stack: Stack, client: Client, opts) -> Injected:
    if fault in ("kill-gateway", "kill-selector", "kill-thermal"):
        return kill_service(stack, fault.removeprefix("kill-"), opts)
    if fault == "kill-placer":
        return kill_service(stack, busiest_placer(stack, client), opts)
    if fault == "drain-node":
        return drain_node(stack, client)
    if fault == "stop-placer":
        name = busiest_placer(stack, client)
        out = Injected(time.monotonic(), name, "itself (SIGCONT)")
        pause_process(stack.services[name].proc.pid, PAUSE_S)
        return out
    node = redis_node(stack)
    if fault == "stall-redis":
        out = Injected(time.monotonic(), f"redis :{node.port}", "itself (SIGCONT)")
        if hasattr(node, "pause"):
            node.pause(PAUSE_S)
        else:
            pause_process(node.proc.pid, PAUSE_S)
        return out
    if fault == "restart-redis" and hasattr(stack.redis, "kill_master"):
        # a replica set: the master's redis-server restarts; meanwhile the Sentinel promotes a replica, and the
        # restarted node rejoins as a replica of it (started in place with its old role, it would fight it)
        out = Injected(time.monotonic(), f"redis master :{node.port}")
        stack.redis.kill_master(wait_failover_s=30.0, rejoin=True)
        out.recovered_by = f"Sentinel failover, node restarted as a replica ({time.monotonic() - out.t_fault:.1f} s)"
        return out
    if fault == "restart-redis":
        out = Injected(time.monotonic(), f"redis :{node.port}")
        if hasattr(node, "kill"):
            node.kill()
        else:  # today's EmbeddedRedis: no kill(); start() again runs redis-server on the same port and directory
            node.proc.kill()
            node.proc.wait(10)
        node.start()
        out.recovered_by = f"bench: started again ({time.monotonic() - out.t_fault:.1f} s)"
        persist = "AOF" if hasattr(node, "appendfsync") else "none (no AOF, no RDB)"
        out.notes.append(f"persistence of the restarted redis-server: {persist}")
        return out
    if fault == "kill-redis-master":
        out = Injected(time.monotonic(), f"redis master :{node.port}")
        # rejoin: the old master comes back as a replica of the new one, so writes can WAIT for a replica again
        old = stack.redis.kill_master(wait_failover_s=30.0, rejoin=True)
        out.recovered_by = f"Sentinel failover ({time.monotonic() - out.t_fault:.1f} s)"
        out.notes.append(f"old master :{old.port} started again as a replica")
        return out
    raise ValueError(f"fault: unknown fault {fault!r}")


def fenced_dcs(stack: Stack) -> list[str]:
    """Data centers whose lease nobody holds: their placer lost it (fenced) and does not write any more."""
    keys, r = Keys(stack.config.prefix), connect_sync(stack.redis_url)
    try:
        return [dc.name for dc in stack.fleet.datacenters if not r.exists(keys.lease(dc.name))]
    finally:
        r.close()


def check_and_repair(stack: Stack) -> list[str]:
    """Say what did not heal after a phase (dead services, DCs whose lease nobody holds), and repair it so the
    next phase starts from a healthy stack."""
    problems = []
    dead = [name for name in stack.services if not _alive(stack, name)]
    for name in dead:
        stack.restart(name)
    if dead:
        problems.append(f"dead: {', '.join(dead)}")
    fenced = fenced_dcs(stack)
    for name in dict.fromkeys(stack.placer_service(dc) for dc in fenced):
        stack.kill(name)
        stack.restart(name)
    if fenced:
        which = f"all {len(fenced)}" if len(fenced) == len(stack.fleet.datacenters) else ", ".join(fenced)
        problems.append(f"placers fenced for good (no lease holder): {which}")
    return problems


# -- the audit ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class LedgerView:
    state: ClusterState  # the fold, as a placer rebuilds it (refused allocations left out)
    queue: OrderedDict
    live: dict[str, tuple[Part, ...]]  # every allocation not freed, refused by the fold or not
    refused: list[str]  # fold refusals: over-allocation, a task allocated twice
    finished: set[str] = dataclasses.field(default_factory=set)  # ran to an end (done) after its last alloc


async def fold_ledger(redis, stream: str, dc: DataCenter, batch: int = 2000) -> LedgerView:
    """Fold a DC's ledger event by event (`hsched.state.ledger.replay` stops at the first over-allocation; the
    audit wants all of them)."""
    view = LedgerView(ClusterState(dc), OrderedDict(), {}, [])
    start = "-"
    while True:
        entries = await redis.xrange(stream, min=start, max="+", count=batch)
        for entry_id, fields in entries:
            event = json.loads(fields[b"e"])
            if event["t"] == "alloc" and not event.get("restore"):  # (a restore puts a victim back where it was)
                cordoned = sorted({p[2] for p in event["parts"]} & set(view.state.cordoned))
                if cordoned:
                    view.refused.append(f"{dc.name}: ledger entry {entry_id.decode()} places {event['task']} on "
                                        f"cordoned node(s) {cordoned}")
            if event["t"] == "alloc":
                view.live[event["task"]] = tuple(Part.from_json(p) for p in event["parts"])
                view.finished.discard(event["task"])
            elif event["t"] in FREEING:  # free, and since tasks run: done, preempt
                view.live.pop(event["task"], None)
                if event["t"] == "done":
                    view.finished.add(event["task"])
            try:
                fold_event(event, view.state, view.queue)
            except OverAllocation as exc:
                view.refused.append(f"{dc.name}: ledger entry {entry_id.decode()} refused by the fold: {exc}")
        if len(entries) < batch:
            return view
        start = f"({entries[-1][0].decode()}"


def over_capacity(dc: DataCenter, table, allocations: dict[str, tuple[Part, ...]]) -> list[str]:
    """Every node resource and GPU card whose allocations sum above its capacity (checked here, not trusted to
    ClusterState's own bounds)."""
    n, cards = len(table), table.gpu_core_percent.shape[1]
    used = {k: np.zeros(n, dtype=np.int64) for k in ("cpu_milli", "memory_mib", "disk_mib", "bandwidth_mbps")}
    gpu_core, gpu_mem = np.zeros((n, cards), dtype=np.int64), np.zeros((n, cards), dtype=np.int64)
    out = []
    for task, parts in allocations.items():
        for p in parts:
            if not 0 <= p.node < n or any(not 0 <= g.card < cards for g in p.gpus):
                out.append(f"{dc.name}: task {task} names node {p.node} / a card that does not exist")
                continue
            for k in used:
                used[k][p.node] += getattr(p, k)
            for g in p.gpus:
                gpu_core[p.node, g.card] += g.core_percent
                gpu_mem[p.node, g.card] += g.memory_mib
    for k, u in used.items():
        for node in np.flatnonzero(u > getattr(table, k)):
            out.append(f"{dc.name}/{table.names[node]}: {k} {u[node]} > capacity {getattr(table, k)[node]}")
    for what, u, cap in (("core %", gpu_core, table.gpu_core_percent), ("memory MiB", gpu_mem, table.gpu_memory_mib)):
        for node, card in zip(*np.nonzero(u > cap), strict=True):
            out.append(f"{dc.name}/{table.names[node]} card {card}: GPU {what} {u[node, card]} > {cap[node, card]}")
    return out


def allowed_states(rec: Record, preempted: bool = False) -> set[int]:
    """What an acknowledged outcome may legitimately have become by now (`preempted`: its record says it was
    evicted since — by a drain — so it may wait in the queue again)."""
    if rec.release_acked:  # RELEASED, or a task that had finished first (a Release of it is a no-op)
        return {rec.release_state}
    if rec.state == pb.TASK_STATE_REJECTED:
        return {pb.TASK_STATE_REJECTED}
    ok = {*ON_NODES, *FINISHED} if rec.state == pb.TASK_STATE_PLACED else {pb.TASK_STATE_DEFERRED, *ON_NODES, *FINISHED}
    if preempted:
        ok |= {pb.TASK_STATE_PREEMPTED, pb.TASK_STATE_DEFERRED}
    if rec.release_attempted:
        ok.add(pb.TASK_STATE_RELEASED)
    return ok


@dataclasses.dataclass
class Audit:
    checked: int  # acknowledged Submits checked
    lost: dict[str, str]  # task id -> why
    double: dict[str, str]  # finding key -> what
    leaked: dict[str, str]  # task id -> ledger still holding it after an acknowledged Release
    unreachable: int = 0  # Gets that never got an answer (gateway down): not audited


async def get_all(stub, task_ids: list[str], concurrency: int = 32, budget_s: float = 60.0) -> dict[str, object]:
    """task id -> Task, or the status code name of the final error (retrying UNAVAILABLE within the budget)."""
    gate, out = asyncio.Semaphore(concurrency), {}
    deadline = time.monotonic() + budget_s

    async def one(task_id: str) -> None:
        async with gate:
            while True:
                try:
                    out[task_id] = await stub.Get(gateway_pb2.GetRequest(task_id=task_id), timeout=10)
                    return
                except grpc.aio.AioRpcError as exc:
                    if exc.code() not in RETRY or time.monotonic() > deadline:
                        out[task_id] = exc.code().name
                        return
                await asyncio.sleep(0.5)

    await asyncio.gather(*(one(t) for t in task_ids))
    return out


async def audit(stack: Stack, records: list[Record]) -> Audit:
    acked = [r for r in records if r.task_id]
    keys = Keys(stack.config.prefix)
    redis = connect(stack.redis_url)
    try:
        async with grpc.aio.insecure_channel(stack.gateway, options=CHANNEL_OPTIONS) as channel:
            got = await get_all(gateway_pb2_grpc.GatewayStub(channel), [r.task_id for r in acked])
        stream = TaskStore(redis, keys.tasks)
        await stream.load()
        ledgers = {dc.name: await fold_ledger(redis, keys.ledger(dc.name), dc) for dc in stack.fleet.datacenters}
    finally:
        await redis.aclose()
    result = Audit(len(acked), {}, {}, {})
    missing: dict[str, dict[str, tuple[Part, ...]]] = {dc: {} for dc in ledgers}  # acknowledged, lost by the ledger
    def lose(task_id: str, why: str) -> None:
        result.lost[task_id] = f"{result.lost[task_id]}; {why}" if task_id in result.lost else why

    for rec in acked:
        g, s = got.get(rec.task_id), stream.tasks.get(rec.task_id)
        preempted = any(x is not None and not isinstance(x, str) and x.preemptions for x in (g, s))
        ok = allowed_states(rec, preempted)
        if isinstance(g, str):
            if g == "NOT_FOUND":
                lose(rec.task_id, "gateway Get: NOT_FOUND")
            else:
                result.unreachable += 1
        elif g.state not in ok:
            lose(rec.task_id, f"gateway Get: {state_name(g.state)}, acknowledged {state_name(rec.state)}"
                 + (", released" if rec.release_acked else ""))
        if s is None:
            lose(rec.task_id, "task stream: missing")
        elif s.state not in ok:
            lose(rec.task_id, f"task stream: {state_name(s.state)}, acknowledged "
                                                f"{state_name(rec.state)}")
        # the ledger must hold what the client was told is placed and has not released
        now = g if not isinstance(g, str) else s
        if rec.release_attempted or rec.state == pb.TASK_STATE_REJECTED:
            if rec.release_acked:
                for dc, view in ledgers.items():
                    if rec.task_id in view.live or rec.task_id in view.queue:
                        result.leaked[rec.task_id] = f"{dc} still holds it after an acknowledged Release"
            continue
        if now is not None and now.state in FINISHED:
            continue
        on_nodes = now is not None and now.state in ON_NODES
        placed = on_nodes if preempted else (rec.state == pb.TASK_STATE_PLACED or on_nodes)  # evicted: may wait
        dc = rec.datacenter if rec.state == pb.TASK_STATE_PLACED else (now.datacenter if now else rec.datacenter)
        view = ledgers.get(dc)
        if view is None:
            lose(rec.task_id, f"placed at {dc!r}, which is not a data center of the fleet")
        elif placed and rec.task_id not in view.live and rec.task_id not in view.finished:
            # (a task that finished after the gateway's Get answered is not lost: the ledger ran it to an end)
            lose(rec.task_id, f"ledger: {dc} does not hold it (acknowledged PLACED, not released)")
            assignments = rec.assignments if rec.state == pb.TASK_STATE_PLACED and not preempted \
                else list(now.assignments)
            missing[dc][rec.task_id] = parts_from_pb(assignments)
        elif not placed and rec.task_id not in view.live and rec.task_id not in view.queue:
            lose(rec.task_id, f"ledger: {dc} neither queues nor holds it (acknowledged "
                              f"{'PLACED, then evicted' if preempted else 'DEFERRED'})")
    holders: dict[str, list[str]] = {}
    for dc_name, view in ledgers.items():
        for task_id in view.live:
            holders.setdefault(task_id, []).append(dc_name)
        for finding in view.refused:
            result.double[finding] = finding
        dc = next(d for d in stack.fleet.datacenters if d.name == dc_name)
        # the ledger's allocations plus those it lost: what the tasks that believe they hold resources hold
        for finding in over_capacity(dc, view.state.table, {**view.live, **missing[dc_name]}):
            result.double[finding] = finding
    for task_id, dcs in holders.items():
        if len(dcs) > 1:
            result.double[f"two DCs: {task_id}"] = f"task {task_id} is held in {len(dcs)} data centers: {dcs}"
    return result


# -- phases ------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Phase:
    fault: str
    injected: Injected | None = None
    skipped: str = ""
    acknowledged: int = 0
    lost: dict[str, str] = dataclasses.field(default_factory=dict)  # new since the previous audit
    double: dict[str, str] = dataclasses.field(default_factory=dict)
    leaked: dict[str, str] = dataclasses.field(default_factory=dict)
    first_ok_s: float | None = None
    failed_after: int = 0
    rejected_after: int = 0
    submits_after: int = 0
    rejected_before: int = 0
    submits_before: int = 0
    unhealed: list[str] = dataclasses.field(default_factory=list)
    errors_after: dict[str, int] = dataclasses.field(default_factory=dict)
    after_repair: tuple[int, int] = (0, 0)  # (Submits, of which PLACED or DEFERRED) in the load after a repair


REPAIRED = "+repaired"  # phase label suffix of the load that runs after the bench repaired the stack


class Auditor:
    """Per-phase audits; each phase is charged with the findings that are new since the previous one."""

    def __init__(self) -> None:
        self.lost: dict[str, str] = {}
        self.double: dict[str, str] = {}
        self.leaked: dict[str, str] = {}

    async def charge(self, stack: Stack, records: list[Record], phase: Phase) -> Audit:
        result = await audit(stack, records)
        for mine, seen, new in ((phase.lost, self.lost, result.lost), (phase.double, self.double, result.double),
                                (phase.leaked, self.leaked, result.leaked)):
            for k, v in new.items():
                if k not in seen:
                    mine[k] = seen[k] = v
        return result


def summarize(phase: Phase, records: list[Record]) -> None:
    labels = (phase.fault, phase.fault + REPAIRED)
    phase.acknowledged = (sum(1 for r in records if r.phase in labels and r.task_id)
                          + sum(1 for r in records if r.release_phase in labels))
    repaired = [r for r in records if r.phase == phase.fault + REPAIRED]
    phase.after_repair = (len(repaired), sum(1 for r in repaired if r.state in HOLDING))
    mine = [r for r in records if r.phase == phase.fault]
    inj = phase.injected
    if inj is None:
        return
    before = [r for r in mine if r.t_start < inj.t_fault]
    phase.submits_before = len(before)
    phase.rejected_before = sum(1 for r in before if r.state == pb.TASK_STATE_REJECTED)
    after = [r for r in mine if r.t_end >= inj.t_fault]
    phase.submits_after = len(after)
    phase.failed_after = sum(1 for r in after if r.error)
    phase.rejected_after = sum(1 for r in after if r.state == pb.TASK_STATE_REJECTED)
    for r in after:
        if r.error:
            phase.errors_after[r.error] = phase.errors_after.get(r.error, 0) + 1
    good = [r.t_end - inj.t_fault for r in mine if r.t_start >= inj.t_fault and r.state in HOLDING]
    phase.first_ok_s = min(good) if good else None


async def run_phase(stack: Stack, client: Client, auditor: Auditor, fault: str, opts) -> Phase:
    phase = Phase(fault)
    if fault == "kill-redis-master" and not replicated(stack):
        phase.skipped = ("needs `--redis-replicas 1` and a stack that supports it (StackConfig.redis_replicas, "
                         "stack.redis.kill_master)" + ("" if hasattr(StackConfig, "__dataclass_fields__")
                                                       and "redis_replicas" in StackConfig.__dataclass_fields__
                                                       else "; this stack has no redis_replicas"))
        return phase
    log(f"[{fault}] load at {opts.rate:g}/s for {opts.pre_s:g} s, then the fault")
    stop = asyncio.Event()
    load = asyncio.create_task(client.run(fault, stop))
    try:
        await asyncio.sleep(opts.pre_s)
        t = time.monotonic()
        try:
            phase.injected = await in_fault_thread(inject, fault, stack, client, opts)
        except Exception as exc:  # noqa: BLE001 - a fault the stack could not take is a result, not a crash
            phase.injected = Injected(t, fault, "failed", [f"injecting or recovering failed: {exc}"])
        log(f"[{fault}] {phase.injected.target}: recovered by {phase.injected.recovered_by}; load for "
            f"{opts.post_s:g} s more")
        remaining = opts.post_s - (time.monotonic() - phase.injected.t_fault)
        await asyncio.sleep(max(0.0, remaining))
    finally:
        stop.set()
        await load
    phase.unhealed = await in_fault_thread(check_and_repair, stack)
    if phase.unhealed and opts.after_repair_s > 0:
        # what the repaired stack does next is this fault's consequence too (e.g. placers rebuilt from a wiped
        # ledger handing out held resources again): load it before the audit, not in the next phase
        log(f"[{fault}] not healed: {phase.unhealed}; repaired; load for {opts.after_repair_s:g} s")
        stop = asyncio.Event()
        load = asyncio.create_task(client.run(fault + REPAIRED, stop))
        await asyncio.sleep(opts.after_repair_s)
        stop.set()
        await load
    await asyncio.sleep(opts.settle_s)  # background releases of abandoned placements, group commits
    summarize(phase, client.records)
    await auditor.charge(stack, client.records, phase)
    log(f"[{fault}] acknowledged {phase.acknowledged}, lost {len(phase.lost)}, double-allocated "
        f"{len(phase.double)}" + (f"; not healed: {phase.unhealed}" if phase.unhealed else ""))
    return phase


async def finish(stack: Stack, client: Client, auditor: Auditor, opts) -> Phase:
    """Release the kept tasks and audit once more (everything acknowledged, the kept ones RELEASED)."""
    phase = Phase("final: kept tasks released")
    kept = [r for r in client.records if r.keeper and not r.release_attempted]
    await asyncio.gather(*(client.release(r, phase.fault) for r in kept))
    await asyncio.sleep(opts.settle_s)
    phase.acknowledged = sum(1 for r in kept if r.release_acked)
    await auditor.charge(stack, client.records, phase)
    return phase


# -- report ------------------------------------------------------------------------------------------------------


def report(phases: list[Phase], final: Phase, records: list[Record], auditor: Auditor, opts, stack: Stack) -> int:
    print(f"\n## chaos bench: {len(stack.fleet.datacenters)} DCs ({opts.fleet or 'default fleet'}), "
          f"{opts.rate:g} Submits/s, {opts.pre_s:g} s before and {opts.post_s:g} s after each fault, seed {opts.seed}"
          f", supervisor {'on' if supervised(stack) else 'absent'}, Redis replicas "
          f"{getattr(stack.config, 'redis_replicas', 0) or 0}\n")
    print("| fault | target | recovered by | acknowledged | lost | double-allocated | first good Submit after "
          "the fault (s) | Submits failed meanwhile | rejected meanwhile (before the fault) | not healed |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---|")
    for p in phases:
        if p.skipped:
            print(f"| {p.fault} | - | - | - | - | - | - | - | - | skipped: {p.skipped} |")
            continue
        first = f"{p.first_ok_s:.2f}" if p.first_ok_s is not None else "never"
        errors = ", ".join(f"{k} {v}" for k, v in sorted(p.errors_after.items()))
        print(f"| {p.fault} | {p.injected.target} | {p.injected.recovered_by} | {p.acknowledged} | {len(p.lost)} "
              f"| {len(p.double)} | {first} | {p.failed_after} of {p.submits_after}" + (f" ({errors})" if errors else "")
              + f" | {p.rejected_after} ({p.rejected_before} of {p.submits_before}) | "
              f"{'; '.join(p.unhealed) or '-'} |")
    print(f"| {final.fault} | - | - | {final.acknowledged} | {len(final.lost)} | {len(final.double)} | - | - | - | - |")
    acked = sum(1 for r in records if r.task_id) + sum(1 for r in records if r.release_acked)
    failed = sum(1 for r in records if r.error)
    print(f"| **total** | | | **{acked}** | **{len(auditor.lost)}** | **{len(auditor.double)}** | | {failed} of "
          f"{len(records)} | {sum(1 for r in records if r.state == pb.TASK_STATE_REJECTED)} | |")
    print(f"\nacknowledged = Submits that returned a task + acknowledged Releases; {len(auditor.leaked)} tasks still "
          "held by a ledger after an acknowledged Release (leaks, not counted as lost).")
    for p in [*phases, final]:
        notes = list(p.injected.notes if p.injected else [])
        if p.after_repair[0]:
            notes.append(f"after the bench's repair: {p.after_repair[1]} of {p.after_repair[0]} Submits placed or "
                         "deferred")
        if p.lost:
            by_check: dict[str, int] = {}
            for why in p.lost.values():
                for check in {part.split(":")[0].strip() for part in why.split("; ")}:
                    by_check[check] = by_check.get(check, 0) + 1
            notes.append("lost by check: " + ", ".join(f"{k} {v}" for k, v in sorted(by_check.items())))
        groups = ([f"lost {k}: {v}" for k, v in p.lost.items()], list(p.double.values()),
                  [f"leaked {k}: {v}" for k, v in p.leaked.items()])
        if notes or any(groups):
            print(f"\n**{p.fault}**: " + "; ".join(notes))
            for findings in groups:  # the first few of each kind
                for f in findings[:opts.show]:
                    print(f"- {f}")
                if len(findings) > opts.show:
                    print(f"- ... and {len(findings) - opts.show} more like it")
    bad = bool(auditor.lost or auditor.double)
    print(f"\n{'FAIL' if bad else 'PASS'}: {len(auditor.lost)} acknowledged tasks lost, {len(auditor.double)} "
          "double allocations (or placements on cordoned nodes)")
    return 1 if bad else 0


# -- main --------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small fleet (tests/fleets/small.yaml), shorter phases")
    p.add_argument("--fleet", help="fleet YAML (default: the built-in 11-DC fleet; --quick: the small test fleet)")
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, in order; of {', '.join(FAULTS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate", type=float, help="Submits per second (default 30; --quick 15)")
    p.add_argument("--pre-s", type=float, help="load before each fault, s (default 5; --quick 3)")
    p.add_argument("--post-s", type=float, help="load after each fault, s (default 20; --quick 10)")
    p.add_argument("--settle-s", type=float, default=2.0, help="quiet time before each audit, s")
    p.add_argument("--after-repair-s", type=float, default=5.0,
                   help="load after the bench repaired what a fault left broken, before the audit, s")
    p.add_argument("--keepers", type=int, help="placed tasks per phase held to the end (default 10; --quick 5)")
    p.add_argument("--tasks", type=int, default=2000, help="openb trace tasks to cycle through")
    p.add_argument("--budget-s", type=float, default=30.0, help="a Submit's or Release's retries end after this")
    p.add_argument("--call-timeout-s", type=float, default=10.0, help="deadline of one call")
    p.add_argument("--max-inflight", type=int, default=200, help="Submits in flight at most (arrivals beyond wait)")
    p.add_argument("--restart-after", type=float, default=3.0,
                   help="restart a killed service after this long if no supervisor did (s)")
    p.add_argument("--redis-replicas", type=int, default=0, help="run Redis with replicas + Sentinel (if supported)")
    p.add_argument("--no-supervise", action="store_true", help="do not turn on the stack's supervisor")
    p.add_argument("--policy", default="bestfit")
    p.add_argument("--placer-processes", type=int, default=0,
                   help="host the placers in this many processes (`hsched up --placer-processes`; 0 = one per DC)")
    p.add_argument("--log-dir", help="service logs (default: a temporary directory, printed)")
    p.add_argument("--show", type=int, default=8, help="findings of each kind printed per phase")
    opts = p.parse_args(argv)
    faults = [f.strip() for f in opts.faults.split(",") if f.strip()]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown or not faults:
        p.error(f"--faults: {', '.join(unknown) or 'none given'} not among {', '.join(FAULTS)}")
    opts.faults = faults
    quick = opts.quick
    opts.fleet = opts.fleet or (str(SMALL_FLEET) if quick else None)
    for name, full, short in (("rate", 30.0, 15.0), ("pre_s", 5.0, 3.0), ("post_s", 20.0, 10.0), ("keepers", 10, 5)):
        if getattr(opts, name) is None:
            setattr(opts, name, short if quick else full)
    for name in ("rate", "budget_s", "call_timeout_s"):
        if getattr(opts, name) <= 0:
            p.error(f"--{name.replace('_', '-')}: must be > 0, got {getattr(opts, name)}")
    if opts.fleet and not Path(opts.fleet).is_file():
        p.error(f"--fleet: no such file: {opts.fleet}")
    if opts.redis_replicas < 0:
        p.error(f"--redis-replicas: must be >= 0, got {opts.redis_replicas}")
    return opts


def make_stack(opts) -> Stack:
    fields = getattr(StackConfig, "__dataclass_fields__", {})
    extra = {}
    if "supervise" in fields and not opts.no_supervise:
        extra["supervise"] = True
    if "fresh" in fields:  # a stack that keeps its Redis data between runs: this run's audit starts from nothing
        extra["fresh"] = True
    if opts.redis_replicas:
        if "redis_replicas" in fields:
            extra["redis_replicas"] = opts.redis_replicas
        else:
            log("--redis-replicas: this stack cannot run Redis replicas yet (no StackConfig.redis_replicas); "
                "running a single redis-server")
    config = StackConfig(fleet_path=opts.fleet, redis_url=None, prefix=PREFIX, policy=opts.policy, metrics=False,
                         gateway_port=free_port(), log_dir=opts.log_dir,
                         placer_processes=getattr(opts, "placer_processes", 0), **extra)
    return Stack(config)


def workload(stack: Stack, opts) -> list:
    return [t.spec for t in with_locations(load_trace("openb", opts.tasks), stack.fleet, opts.seed)]


async def run(stack: Stack, opts) -> int:
    async with Client(stack.gateway, workload(stack, opts), opts) as client:
        auditor = Auditor()
        phases = [await run_phase(stack, client, auditor, fault, opts) for fault in opts.faults]
        final = await finish(stack, client, auditor, opts)
    return report(phases, final, client.records, auditor, opts, stack)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    stack = make_stack(opts)
    t0 = time.monotonic()
    log(f"starting the stack ({opts.fleet or 'default fleet'}); logs in {stack.log_dir}")
    stack.start()

    def on_term(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    rc = 1
    try:
        rc = asyncio.run(run(stack, opts))
        return rc
    finally:
        for svc in stack.services.values():  # nothing left SIGSTOPped, whatever happened
            if svc.proc and svc.proc.poll() is None:
                with contextlib.suppress(OSError):
                    os.kill(svc.proc.pid, signal.SIGCONT)
        stack.config.keep_logs = stack.config.keep_logs or rc != 0  # a failed run's logs are its evidence
        stack.stop()
        FAULT_THREAD.shutdown()
        where = (f"logs in {opts.log_dir}" if opts.log_dir else f"logs kept in {stack.logs_kept}" if stack.logs_kept
                 else "logs removed (--log-dir keeps them)")
        log(f"done in {time.monotonic() - t0:.0f} s; {where}")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        log("interrupted: everything started here was stopped")
        sys.exit(130)
