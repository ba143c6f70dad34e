"""CPU of the placer's decisions alone: `PlacerEngine.place` / `release` in-process, no gRPC.

The engine of one data center of the default fleet (its policy, its in-process thermal guard, its ledger on
a real Redis, under a unique key prefix deleted at the end) gets the first openb trace tasks from
`--concurrency` coroutines: rounds of `--hold` Places (the tasks kept, as in stack_bench's Submit-only
rounds), each followed by their Releases. It prints CPU ms per Place and per Release of this process
(Redis's own CPU is not counted) and the mean time from a Place call to its answer (with --concurrency 1,
one Place's latency inside a placer). Against stack_bench's CPU per Place of the placer processes, the
difference is what the gRPC call around a decision costs.

    python bench/engine_cpu.py [--dc kansas-city] [--places 2400] [--hold 800] [--concurrency 8]
                               [--policy bestfit]

REDIS_URL, when set, is used (default redis://127.0.0.1:6379/0).
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import asyncio
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
    from hsched.v1 import gateway_pb2

    dc = load_fleet(None).datacenter(opts.dc)
    specs = [task_from_pb(gateway_pb2.SubmitRequest.FromString(b).task) for b in build_requests(None, 2000, 0)]
    redis = connect(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    prefix = f"bench-engine-{secrets.token_hex(3)}"
    engine = PlacerEngine(dc, redis, Keys(prefix), make_policy(opts.policy, 0, dc), "bench", room_for(dc))
    await engine.start()
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
        await engine.stop()
        keys = [k async for k in redis.scan_iter(f"{prefix}*")]
        if keys:
            await redis.delete(*keys)
        await redis.aclose()
    n = opts.places // opts.hold * opts.hold
    return {"places": n, "placed": placed, "cpu_ms_per_place": 1e3 * place_cpu / n,
            "wall_ms_per_place": 1e3 * place_wall * opts.concurrency / n,
            "cpu_ms_per_release": 1e3 * release_cpu / max(1, placed)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dc", default="kansas-city")
    p.add_argument("--places", type=int, default=2400)
    p.add_argument("--hold", type=int, default=800)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--policy", default="bestfit")
    opts = p.parse_args(argv)
    try:
        import uvloop

        r = uvloop.run(measure(opts))
    except ImportError:  # pragma: no cover - uvloop is a dependency
        r = asyncio.run(measure(opts))
    print(f"{opts.dc} ({opts.policy}, in-process thermal guard): {r['places']} Places ({r['placed']} placed), "
          f"{r['cpu_ms_per_place']:.3f} ms CPU per Place, {r['cpu_ms_per_release']:.3f} ms per Release; "
          f"{r['wall_ms_per_place']:.3f} ms from a Place call to its answer (mean)")


if __name__ == "__main__":
    main()
