"""CPU of the placer's decisions alone: `PlacerEngine.place` / `release` in-process, no gRPC.

The engine of one data center of the default fleet (its policy, its in-process thermal guard, its ledger on
a real Redis, under a unique key prefix deleted at the end) gets the first openb trace tasks from
`--concurrency` coroutines: rounds of `--hold` Places (the tasks kept, as in stack_bench's Submit-only
rounds), each followed by their Releases. It prints CPU ms per Place and per Release of this process
(Redis's own CPU is not counted) and the mean time from a Place call to its answer (with --concurrency 1,
one Place's latency inside a placer). Against stack_bench's CPU per Place of the placer processes, the
difference is what the gRPC call around a decision costs.

    python bench/engine_cpu.py [--dc kansas-city] [--places 2400] [--hold 800] [--concurrency 8]
                               [--policy bestfit] [--servers N] [--blas-threads K] [--batch-budget-ms B]

`--servers N`: the CPU room `--dc` (default then: chicago, 16 racks × 42 servers) scaled to N servers (racks
of the same height added in its rows; its zonal recirculation model built from the geometry, O(N): well
under 1 MiB at 10,000, docs/thermal.md) and the openb tasks without GPUs. `--blas-threads K`:
OPENBLAS/MKL/OMP_NUM_THREADS=K for this process, set before numpy is imported (default: the environment's, i.e. the library's own default
unless set; the services run with 1, hsched.threads); the thread count the loaded OpenBLAS reports is printed.
Placements/s per core = Places / CPU seconds of this process (all its threads). Also printed: the longest the
event loop went without running (a 10 ms ticker's worst lateness), which `--batch-budget-ms` bounds.

REDIS_URL, when set, is used (default redis://127.0.0.1:6379/0).
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import asyncio
import dataclasses
import math
import os
import secrets
import time


async def measure(opts) -> dict[str, float]:
    from bench.stack_bench import build_requests
    from hsched.convert import task_from_pb
    from hsched.domain.fleet import load_fleet
    from hsched.engine.placer import PlacerEngine
    from hsched.policies.heuristics import make_policy
    from hsched.state.keys import Keys
    from hsched.state.redis import connect
    from hsched.thermal.datacenter import room_for
    from hsched.threads import openblas_threads
    from hsched.v1 import gateway_pb2

    dc = load_fleet(None).datacenter(opts.dc)
    specs = [task_from_pb(gateway_pb2.SubmitRequest.FromString(b).task) for b in build_requests(None, 2000, 0)]
    if opts.servers:
        dc = scaled_room(dc, opts.servers)
        specs = [s for s in specs if not s.resources.gpu_count]
    t0 = time.perf_counter()
    room = room_for(dc)
    build_s = time.perf_counter() - t0
    redis = connect(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    prefix = f"bench-engine-{secrets.token_hex(3)}"
    engine = PlacerEngine(dc, redis, Keys(prefix), make_policy(opts.policy, 0, dc), "bench", room,
                          batch_budget_s=opts.batch_budget_ms / 1000 or None)
    await engine.start()
    stall = 0.0  # the longest the event loop went without running (what health, summaries, the watchdog see)

    async def watch_loop() -> None:
        nonlocal stall
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.01)
            stall = max(stall, time.perf_counter() - t - 0.01)

    watcher = asyncio.create_task(watch_loop())
    place_cpu = release_cpu = place_wall = 0.0
    placed = 0
    try:
        for r in range(opts.places // opts.hold):
            held: list[str] = []

            async def place(k: int, r: int = r, held: list[str] = held) -> None:
                nonlocal placed
                for i in range(k, opts.hold, opts.concurrency):
                    task_id = f"r{r}-{i}"
                    if (await engine.place(task_id, specs[(r * opts.hold + i) % len(specs)], False)).outcome \
                            == "placed":
                        held.append(task_id)
                        placed += 1

            c0, w0 = time.process_time(), time.perf_counter()
            await asyncio.gather(*(place(k) for k in range(opts.concurrency)))
            c1 = time.process_time()
            place_wall += time.perf_counter() - w0
            await asyncio.gather(*(engine.release(t) for t in held))
            place_cpu += c1 - c0
            release_cpu += time.process_time() - c1
    finally:
        watcher.cancel()
        await engine.stop()
        keys = [k async for k in redis.scan_iter(f"{prefix}*")]
        if keys:
            await redis.delete(*keys)
        await redis.aclose()
    n = opts.places // opts.hold * opts.hold
    return {"places": n, "placed": placed, "servers": engine.state.n, "room_build_s": build_s,
            "ops_per_batch": (n + placed) / max(1, engine.batches_total), "loop_stall_ms": 1e3 * stall,
            "blas_threads": openblas_threads(), "cpu_ms_per_place": 1e3 * place_cpu / n,
            "wall_ms_per_place": 1e3 * place_wall * opts.concurrency / n,
            "cpu_ms_per_release": 1e3 * release_cpu / max(1, placed)}


def scaled_room(dc, servers: int):
    """The CPU room `dc` with as many racks of its height (in its rows) as hold `servers` (rounded up)."""
    from hsched.domain.fleet import RoomLayout

    if len(dc.pools) != 1 or dc.pools[0].gpu_count:
        raise SystemExit(f"--servers scales a CPU room of one node pool; {dc.name} is not one (try --dc chicago)")
    per_rack, rows = dc.layout.servers_per_rack, dc.layout.rows
    racks = rows * math.ceil(servers / per_rack / rows)
    pool = dc.pools[0]
    return dataclasses.replace(dc, layout=RoomLayout(racks, per_rack, rows),
                               pools=(dataclasses.replace(pool, count=racks * per_rack),))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dc", default=None, help="data center (default: kansas-city; chicago with --servers)")
    p.add_argument("--places", type=int, default=2400)
    p.add_argument("--hold", type=int, default=800)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--policy", default="bestfit")
    p.add_argument("--servers", type=int, default=0, help="scale the CPU room --dc to this many servers")
    p.add_argument("--blas-threads", type=int, default=0, help="BLAS threads (0: the environment's)")
    p.add_argument("--batch-budget-ms", type=float, default=0.0,
                   help="the engine's batch time budget (0: its default, a tenth of the 3 s lease)")
    opts = p.parse_args(argv)
    if opts.servers < 0 or opts.blas_threads < 0 or opts.batch_budget_ms < 0:
        p.error("--servers, --blas-threads and --batch-budget-ms must be >= 0")
    opts.dc = opts.dc or ("chicago" if opts.servers else "kansas-city")
    if opts.blas_threads:  # read once, when numpy loads OpenBLAS: nothing above imported numpy
        from hsched.threads import BLAS_THREAD_VARS

        os.environ.update(dict.fromkeys(BLAS_THREAD_VARS, str(opts.blas_threads)))
    try:
        import uvloop

        r = uvloop.run(measure(opts))
    except ImportError:  # pragma: no cover - uvloop is a dependency
        r = asyncio.run(measure(opts))
    print(f"{opts.dc} ({r['servers']} servers, {opts.policy}, in-process thermal guard built in "
          f"{r['room_build_s']:.1f} s, OpenBLAS threads {r['blas_threads']}): {r['places']} Places "
          f"({r['placed']} placed), {r['cpu_ms_per_place']:.3f} ms CPU per Place "
          f"({1e3 / r['cpu_ms_per_place']:.0f} placements/s per core), {r['cpu_ms_per_release']:.3f} ms per "
          f"Release; {r['wall_ms_per_place']:.3f} ms from a Place call to its answer (mean); "
          f"{r['ops_per_batch']:.1f} calls per batch, the event loop stalled {r['loop_stall_ms']:.0f} ms at most")


if __name__ == "__main__":
    main()
