"""CPU of one preemption decision in the placer engine, in-process (no gRPC): a data center of the default fleet is
filled with offline tasks (`--cores` each, all running under the simulated executor), then `--online` online
tasks of `--online-cores` arrive one by one, each finding no room and evicting the offline tasks of one node that
lose the least work (hsched.policies.preemption). Prints the offline tasks held, the nodes, and per online task
the victims, the lost work and the CPU ms of this process for the decision (Redis's own CPU not counted).

    python bench/preempt_cpu.py [--dc kansas-city] [--cores 4] [--online 5] [--online-cores 8]

REDIS_URL, when set, is used (default redis://127.0.0.1:6379/0); keys go under a unique prefix, deleted at the end.
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
import statistics
import time


async def measure(opts) -> None:
    from bench.stack_bench import delete_prefix
    from hsched.domain.fleet import load_fleet
    from hsched.domain.resources import Resources
    from hsched.domain.task import TaskSpec
    from hsched.engine.executor import Overheads, SimulatedExecutor, Span
    from hsched.engine.placer import PlacerEngine
    from hsched.policies.heuristics import make_policy
    from hsched.state.keys import Keys
    from hsched.state.redis import connect
    from hsched.thermal.datacenter import room_for

    dc = load_fleet(Path(__file__).resolve().parents[1] / "src/hsched/fleet/default.yaml").datacenter(opts.dc)
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    redis = connect(redis_url)
    prefix = f"bench-preempt-{secrets.token_hex(4)}"
    executor = SimulatedExecutor(60.0, Overheads(Span(0, 0), Span(0, 0), Span(5, 25)))
    engine = PlacerEngine(dc, redis, Keys(prefix), make_policy(opts.policy), "bench", thermal=room_for(dc),
                          executor=executor)
    await engine.start()
    try:
        n, full = 0, False
        while not full:
            results = await asyncio.gather(*[
                engine.place(f"off{n + i}", TaskSpec(Resources(opts.cores * 1000, opts.cores * 2048), runtime_s=36_000),
                             allow_defer=False) for i in range(200)])
            n += 200
            full = any(r.outcome != "placed" for r in results)
        await asyncio.sleep(0.5)  # every offline task started (no start overheads): all have lost work
        print(f"{opts.dc}: {len(engine.state.allocations)} offline tasks of {opts.cores} cores on {engine.state.n} "
              f"nodes ({opts.policy}, in-process thermal guard)")
        cpu_ms = []
        for i in range(opts.online):
            t0 = time.process_time()
            r = await engine.place(f"on{i}", TaskSpec(Resources(opts.online_cores * 1000, opts.online_cores * 2048),
                                                      runtime_s=60, priority_class="online"), allow_defer=False)
            cpu_ms.append(1000 * (time.process_time() - t0))
            note = next((x for x in r.notes if x.startswith("preempted")), "no preemption")
            print(f"  online {i}: {r.outcome}, {note}; {cpu_ms[-1]:.1f} ms CPU")
        print(f"median CPU per preemption decision: {statistics.median(cpu_ms):.1f} ms "
              f"(min {min(cpu_ms):.1f}, max {max(cpu_ms):.1f}); preemptions written: {engine.preemptions_total}")
    finally:
        await engine.stop()
        await redis.aclose()
        delete_prefix(redis_url, prefix)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dc", default="kansas-city")
    p.add_argument("--policy", default="bestfit")
    p.add_argument("--cores", type=int, default=4)
    p.add_argument("--online", type=int, default=5)
    p.add_argument("--online-cores", type=int, default=8)
    asyncio.run(measure(p.parse_args()))


if __name__ == "__main__":
    main()
