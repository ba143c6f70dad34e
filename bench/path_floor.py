"""The floor of the Submit path on this machine: the stack's processes, hops and transports, none of its work.

    client ─Submit / Release (unary)─► gateway ─SelectDataCenters stream──────► selector
                                          ├─PlaceBatch / ReleaseBatch streams─► placer per DC ─XADD─► redis
                                          └─task stream (group commit)──────────────────────────────► redis

Every box is a process of its own on uvloop, as in `hsched up`, and the placers are laid out as `hsched up
--placer-processes K` lays them out (hsched.stack.placer_groups: 0 = a process per DC of the fleet; K = the
fleet's DCs in K processes, default the CLI's, 1): every DC has its own gRPC server and port and ledger, and
the DCs of one process share its event loop and one Redis connection pool. The gateway speaks the real Gateway contract
and moves its calls with the stack's own transport and durability code (hsched.batching.Coalescer,
hsched.state.tasks.TaskStore: three task-stream records per Submit, one per Release); the selector answers
every call with a canned ranking (one of --busy DCs, kansas-city, houston and indianapolis first: the real
selector sends the openb trace to those three); a placer appends one ledger entry per call (one pipelined XADD per batch) and answers
PLACED / released. No validation, cost model, placement policy, thermal check, summary, metrics or tracing.
What the stack spends beyond this floor, in CPU and in latency, is hsched's own work; what the floor itself
spends is what this design costs in Python gRPC on this machine.

    python bench/path_floor.py [--duration 10] [--concurrency 64] [--fleet PATH] [--placer-processes 1] [--busy 3]
                               [--also-rates 25,50]

Same load and method as stack_bench.py: the same client (`stack_bench.submit_release`, real openb tasks), the
closed-loop peak at --concurrency, then open-loop Poisson load at half that peak; CPU per iteration of every
floor process from /proc. Exit status 0 when the floor's Submit p99 at half its peak is <= --target-ms.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script: make `bench` importable here and in spawned children
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import asyncio
import itertools
import os
import secrets

from bench.echo_chain import WARMUP_S, cpu_seconds, spawn_server
from bench.loadgen import STEP, run_closed_loop
from bench.stack_bench import build_requests, context_switches
from hsched.cli import PLACER_PROCESSES
from hsched.state.redis import EmbeddedRedis

BUSY = ["kansas-city", "houston", "indianapolis"]  # where the real selector sends the openb trace


def busy_dcs(dcs: list[str], busy: int) -> list[str]:
    """The `busy` DCs the floor's selector answers with: those of BUSY in the fleet, then the fleet's others."""
    return ([dc for dc in BUSY if dc in dcs] + [dc for dc in dcs if dc not in BUSY])[:busy]


async def _selector(port_pipe, busy: list[str]) -> None:
    from hsched.v1 import common_pb2, selector_pb2

    answers = [selector_pb2.SelectBatchItem(response=selector_pb2.SelectResponse(
        method="min-cost", candidates=[common_pb2.DcCandidate(datacenter=dc)])) for dc in busy]
    turn = itertools.count()

    async def select_batches(batches, context):
        async for batch in batches:
            yield selector_pb2.SelectBatchResponse(results=[answers[next(turn) % len(answers)]
                                                            for _ in batch.calls])

    server, port = await _server("hsched.v1.Selector", {"SelectDataCenters": _stream(
        select_batches, selector_pb2.SelectBatchRequest, selector_pb2.SelectBatchResponse)})
    await _until_orphaned([server], port, port_pipe)


async def _placers(port_pipe, dcs: list[str], redis_url: str, prefix: str) -> None:
    """One placer process hosting `dcs`: a gRPC server and port per DC, one Redis connection pool for all, as
    services/placer/server.py `serve` hosts a group. Sends {dc: port}."""
    import redis.asyncio as aioredis

    redis = aioredis.from_url(redis_url)
    servers = {dc: await _placer(dc, redis, prefix) for dc in dcs}
    await _until_orphaned([server for server, _ in servers.values()],
                          {dc: port for dc, (_, port) in servers.items()}, port_pipe)


async def _placer(dc: str, redis, prefix: str):
    from hsched.v1 import placer_pb2

    ledger = f"{prefix}:ledger:{dc}"
    placed = placer_pb2.PlaceBatchItem(response=placer_pb2.PlaceResponse(outcome=placer_pb2.PLACE_OUTCOME_PLACED))
    released = placer_pb2.PlacerReleaseBatchItem(response=placer_pb2.PlacerReleaseResponse(released=True))

    async def append(kind: str, task_ids: list[str]) -> None:  # the ledger write before any answer
        async with redis.pipeline(transaction=False) as pipe:
            for task_id in task_ids:
                pipe.xadd(ledger, {"k": kind, "t": task_id})
            await pipe.execute()

    async def place_batches(batches, context):
        async for batch in batches:
            await append("alloc", [c.task_id for c in batch.calls])
            yield placer_pb2.PlaceBatchResponse(results=[placed] * len(batch.calls))

    async def release_batches(batches, context):
        async for batch in batches:
            await append("free", [c.task_id for c in batch.calls])
            yield placer_pb2.PlacerReleaseBatchResponse(results=[released] * len(batch.calls))

    return await _server("hsched.v1.Placer", {
        "PlaceBatch": _stream(place_batches, placer_pb2.PlaceBatchRequest, placer_pb2.PlaceBatchResponse),
        "ReleaseBatch": _stream(release_batches, placer_pb2.PlacerReleaseBatchRequest,
                                placer_pb2.PlacerReleaseBatchResponse)})


async def _gateway(port_pipe, selector: str, placers: dict[str, str], redis_url: str, prefix: str) -> None:
    import grpc
    import redis.asyncio as aioredis

    from hsched.batching import Coalescer
    from hsched.state.tasks import TaskStore, step
    from hsched.v1 import common_pb2 as pb
    from hsched.v1 import gateway_pb2, placer_pb2, placer_pb2_grpc, selector_pb2, selector_pb2_grpc
    from services.gateway.server import new_task_id

    store = TaskStore(aioredis.from_url(redis_url), f"{prefix}:tasks")
    select = Coalescer(selector_pb2_grpc.SelectorStub(grpc.aio.insecure_channel(selector)).SelectDataCenters,
                       selector_pb2.SelectBatchRequest, "floor/Select")
    stubs = {dc: placer_pb2_grpc.PlacerStub(grpc.aio.insecure_channel(t)) for dc, t in placers.items()}
    place = {dc: Coalescer(s.PlaceBatch, placer_pb2.PlaceBatchRequest, "floor/Place",
                           deadline_field="not_after_unix_ms") for dc, s in stubs.items()}
    release = {dc: Coalescer(s.ReleaseBatch, placer_pb2.PlacerReleaseBatchRequest, "floor/Release")
               for dc, s in stubs.items()}

    async def submit(request, context):
        task = pb.Task(task_id=new_task_id(), spec=request.task)
        selection = await select.call(selector_pb2.SelectRequest(task=task.spec), 2.0)
        records = [step("submitted", task)]
        task.datacenter = selection.candidates[0].datacenter
        records.append(step("dc_selected", task))
        await place[task.datacenter].call(placer_pb2.PlaceRequest(task_id=task.task_id, task=task.spec), 5.0)
        records.append(step("placed", task))
        await store.write(*records)  # one unit, as the gateway writes a Submit's records
        return gateway_pb2.SubmitResponse(task=task)

    async def release_task(request, context):
        task = store.tasks[request.task_id]
        await release[task.datacenter].call(placer_pb2.PlacerReleaseRequest(task_id=task.task_id), 5.0)
        await store.record("released", task)
        return gateway_pb2.ReleaseResponse(task=task)

    server, port = await _server("hsched.v1.Gateway", {
        "Submit": _unary(submit, gateway_pb2.SubmitRequest, gateway_pb2.SubmitResponse),
        "Release": _unary(release_task, gateway_pb2.ReleaseRequest, gateway_pb2.ReleaseResponse)})
    await _until_orphaned([server], port, port_pipe)


def _stream(handler, request, response):
    import grpc

    return grpc.stream_stream_rpc_method_handler(handler, request.FromString, response.SerializeToString)


def _unary(handler, request, response):
    import grpc

    return grpc.unary_unary_rpc_method_handler(handler, request.FromString, response.SerializeToString)


async def _server(service: str, methods: dict):
    """A started server of only `methods` of `service` (its real name and messages: the stack's stubs and client
    call it; grpc answers any other method UNIMPLEMENTED), and its port."""
    import grpc

    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service, methods)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def _until_orphaned(servers: list, ports, port_pipe) -> None:
    """Report `ports` to the parent, then serve until it is gone (never outlive the benchmark)."""
    port_pipe.send(ports)
    port_pipe.close()
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(1)
    for server in servers:
        await server.stop(None)


def _run(port_pipe, role, *args) -> None:
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(role(port_pipe, *args))


def floor_groups(fleet_path: str | None, placer_processes: int) -> dict[str, list[str]]:
    """{placer process name: its DCs} for the fleet's DCs laid out as `hsched up --placer-processes` lays them
    out (one policy: the stack_bench stack's)."""
    from hsched.domain.fleet import load_fleet
    from hsched.stack import placer_groups

    return placer_groups([dc.name for dc in load_fleet(fleet_path).datacenters], placer_processes)


class Floor:
    """The floor's processes, started leaf first; `target` is the gateway. `groups`: {process name: the DCs
    whose placers it hosts} (`floor_groups`, or a Stack's placer_groups() by name); `busy`: the DCs the
    selector answers with, in turn. Ledgers go to `<prefix>:ledger:<dc>`, the task stream to `<prefix>:tasks`."""

    def __init__(self, groups: dict[str, list[str]], busy: list[str], redis_url: str, prefix: str,
                 redis_pid: int | None) -> None:
        dcs = [dc for group in groups.values() for dc in group]
        if not busy or set(busy) - set(dcs):
            raise ValueError(f"busy: {busy} must be some of the placers' DCs {dcs}")
        self.procs: dict = {}  # name -> multiprocessing.Process
        self.redis_pid = redis_pid  # the embedded redis-server's, counted with the floor's processes
        try:
            placer_targets = {}
            for name, group in groups.items():
                ports = self._start(name, _placers, group, redis_url, prefix)
                placer_targets |= {dc: f"127.0.0.1:{port}" for dc, port in ports.items()}
            selector = f"127.0.0.1:{self._start('selector', _selector, busy)}"
            self.target = f"127.0.0.1:{self._start('gateway', _gateway, selector, placer_targets, redis_url, prefix)}"
        except BaseException:
            self.stop()
            raise

    def _start(self, name: str, role, *args):
        self.procs[name], ports = spawn_server(f"floor-{name}", _run, role, *args)
        return ports

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            proc.join(5)

    def __enter__(self) -> Floor:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def sample(self, read) -> dict[str, float]:
        pids = {name: p.pid for name, p in self.procs.items()} | ({"redis": self.redis_pid} if self.redis_pid else {})
        return {name: read(pid) for name, pid in pids.items()}



def measure_floor(requests: list[bytes], groups: dict[str, list[str]], busy: list[str], concurrency: int,
                  duration_s: float,
                  redis_url: str | None = None, also_rates=(), on_point=None,
                  log=lambda msg: print(msg, file=sys.stderr, flush=True)) -> dict[str, dict]:
    """Start the floor (an embedded Redis unless `redis_url`; keys under a prefix of its own, deleted at the
    end), load it like stack_bench: the closed-loop peak at `concurrency`, open loop at half that peak, then
    at each of `also_rates`; stop it. Returns {"peak": results, "half": results, "<rate>/s": results}, each the
    loadgen's per-call LoadResults; `on_point(label, results, cpu ms, context switches per iteration)` sees
    every point with the CPU of each floor process."""
    prefix = f"floor-{os.getpid()}-{secrets.token_hex(3)}"
    embedded = None if redis_url else EmbeddedRedis().start()
    url = redis_url or embedded.url
    points: dict[str, dict] = {}
    try:
        with Floor(groups, busy, url, prefix, embedded.proc.pid if embedded else None) as floor:
            def point(key: str, label: str, conc: int, rate: float | None = None):
                log(f"floor, {label}: concurrency {conc}" + (f", rate {rate:.0f}/s" if rate else "") + " ...")
                cpu0, sw0 = floor.sample(cpu_seconds), floor.sample(context_switches)
                res = run_closed_loop("bench.stack_bench:submit_release", (floor.target, requests),
                                      concurrency=conc, duration_s=duration_s, warmup_s=WARMUP_S, rate_rps=rate)
                cpu1, sw1 = floor.sample(cpu_seconds), floor.sample(context_switches)
                step = res[STEP]
                iters = max(1.0, step.throughput_rps * (step.elapsed_s + WARMUP_S))  # as stack_bench estimates it
                if on_point:
                    on_point(label, res, {n: (cpu1[n] - cpu0[n]) * 1e3 / iters for n in cpu1},
                             {n: (sw1[n] - sw0[n]) / iters for n in sw1})
                log(f"  Submit {res['Submit'].summary()}")
                points[key] = res

            open_c = max(256, 4 * concurrency)
            point("peak", "closed (peak)", concurrency)
            point("half", "open, half peak", open_c, points["peak"][STEP].throughput_rps / 2)
            for rate in also_rates:
                point(f"{rate:g}/s", f"open, {rate:g}/s", open_c, rate)
    finally:
        if embedded:
            embedded.stop()
        else:
            import redis

            r = redis.Redis.from_url(url)
            for key in r.scan_iter(f"{prefix}:*"):
                r.delete(key)
    return points


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per point (plus 1 s warmup)")
    ap.add_argument("--concurrency", type=int, default=64, help="closed-loop clients for the peak")
    ap.add_argument("--fleet", default=None, help="fleet YAML whose DCs get a placer (default: the embedded 11-DC fleet)")
    ap.add_argument("--placer-processes", type=int, default=PLACER_PROCESSES,
                    help="processes hosting the placers, as `hsched up --placer-processes` (0 = one per DC; "
                         f"default {PLACER_PROCESSES}, the CLI's)")
    ap.add_argument("--busy", type=int, default=3, help="DCs the selector sends tasks to")
    ap.add_argument("--tasks", type=int, default=2000, help="openb pods the client cycles through")
    ap.add_argument("--also-rates", default="", help="further open-loop points, iterations/s (e.g. 25,50,100)")
    ap.add_argument("--target-ms", type=float, default=20.0, help="issue 2's Submit p99 target at half the peak")
    opts = ap.parse_args()
    if opts.placer_processes < 0:
        ap.error("--placer-processes must be >= 0")
    groups = floor_groups(opts.fleet, opts.placer_processes)
    dcs = [dc for group in groups.values() for dc in group]
    if not 1 <= opts.busy <= len(dcs):
        ap.error(f"--busy must be between 1 and the fleet's {len(dcs)} DCs")

    requests = build_requests(None, opts.tasks)
    rows: list[tuple] = []  # (label, results, CPU ms, context switches per iteration) per point
    points = measure_floor(requests, groups, busy_dcs(dcs, opts.busy), opts.concurrency, opts.duration,
                           os.environ.get("REDIS_URL"), also_rates=[float(r) for r in opts.also_rates.split(",")
                                                                    if r.strip()],
                           on_point=lambda *row: rows.append(row))
    half = points["half"]

    print(f"\n### Submit-path floor: gateway + selector + {len(dcs)} placers ({opts.busy} busy) in {len(groups)} "
          f"process(es) + redis, "
          f"{os.cpu_count()} CPUs, {opts.duration:g} s per point after {WARMUP_S:g} s warmup\n")
    print("| load | call | done/s | p50 ms | p90 ms | p99 ms | max ms | errors | CPU ms/iteration, all processes "
          "| context switches/iteration |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, res, cpu, switches in rows:
        for call in ("Submit", "Release"):
            r = res[call]
            print(f"| {label} | {call} | {r.throughput_rps:.0f} | {r.p50_ms:.2f} | {r.p90_ms:.2f} | {r.p99_ms:.2f} "
                  f"| {r.max_ms:.2f} | {sum(r.errors.values())} | {sum(cpu.values()):.2f} "
                  f"| {sum(switches.values()):.0f} |")
    (_, _, cpu_peak, _), (_, _, cpu_half, sw_half) = rows[:2]
    print("\n| process | CPU ms/iteration, peak | CPU ms/iteration, half peak | context switches/iteration, half peak |")
    print("|---|---:|---:|---:|")
    for name in sorted(cpu_half, key=cpu_half.get, reverse=True):
        print(f"| {name} | {cpu_peak[name]:.3f} | {cpu_half[name]:.3f} | {sw_half[name]:.1f} |")
    p99 = half["Submit"].p99_ms
    ok = p99 <= opts.target_ms
    print(f"\n{'PASS' if ok else 'FAIL'}  floor Submit p99 at half its peak: {p99:.1f} ms at "
          f"{half[STEP].offered_rps:.0f}/s offered (target <= {opts.target_ms:g} ms)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
