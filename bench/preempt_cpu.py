"""CPU of one preemption decision in the placer engine, in-process (no gRPC): a data center of the default fleet is
filled with offline tasks (`--cores` each, all running under the simulated executor), then `--online` online
tasks of `--online-cores` arrive one by one, each finding no room and evicting the offline tasks of one node that
lose the least work (hsched.policies.preemption). Prints the offline tasks held, the nodes, and per online task
the victims, the lost work and the CPU ms of this process for the decision (Redis's own CPU not counted).

With `--waiting N`, N online tasks that no one-node eviction can let in (two replicas of a whole node each, each a
different shape) then wait in the queue, and the CPU of queue passes is measured: after an offline task is
released (each waiting online task is searched again: `queue_eviction_searches` per pass, the rest in passes right
after), after a pass with nothing freed since (no search), and with `queue_eviction_searches` 0 (the rule before:
waiting online tasks never evict). Their searches mostly end at a cheap per-node count (no one-node eviction could
hold their parts); `--spanning` first places one offline task across two nodes, which turns that count off: the
worst case, every waiting task searched in full.

    python bench/preempt_cpu.py [--dc kansas-city] [--cores 4] [--online 5] [--online-cores 8] [--waiting 0]
    python bench/preempt_cpu.py --online 3 --waiting 16 [--spanning]

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
        if opts.spanning:  # larger than any node: split across nodes (DataCenter.split_chunk_milli)
            big = int(engine.state.table.cpu_milli.max()) + 1000
            r = await engine.place("spanning", TaskSpec(Resources(big, 2048), runtime_s=36_000), allow_defer=False)
            assert len({p.node for p in r.parts}) > 1, r
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
                                                      runtime_s=36_000, priority_class="online"),
                               allow_defer=False)
            cpu_ms.append(1000 * (time.process_time() - t0))
            note = next((x for x in r.notes if x.startswith("preempted")), "no preemption")
            print(f"  online {i}: {r.outcome}, {note}; {cpu_ms[-1]:.1f} ms CPU")
        print(f"median CPU per preemption decision: {statistics.median(cpu_ms):.1f} ms "
              f"(min {min(cpu_ms):.1f}, max {max(cpu_ms):.1f}); preemptions written: {engine.preemptions_total}")
        if opts.waiting:
            await measure_queue_passes(engine, opts.waiting)
    finally:
        await engine.stop()
        await redis.aclose()
        delete_prefix(redis_url, prefix)


async def measure_queue_passes(engine, waiting: int) -> None:
    from hsched.domain.resources import Resources
    from hsched.domain.task import TaskSpec
    from hsched.engine.executor import Report

    table = engine.state.table
    cores = int(sorted(table.cpu_milli)[-2])  # two nodes at least this large: the task fits an empty DC
    for i in range(waiting):
        spec = TaskSpec(Resources(cores, 1024 + i), runtime_s=60, priority_class="online", replicas=2)
        r = await engine.place(f"wait{i}", spec)
        assert r.outcome == "deferred", r
    offline = [t for t, c in engine.state.clocks.items() if c.priority_class != "online"]

    async def settled() -> float:
        """CPU ms until the engine is idle (the budget's further passes done)."""
        t0 = time.process_time()
        while True:
            await asyncio.sleep(0.05)
            if engine._ops.empty() and not engine._writing.locked():
                await asyncio.sleep(0.05)
                if engine._ops.empty() and not engine._writing.locked():
                    break
        return 1000 * (time.process_time() - t0)

    print(f"{waiting} online tasks wait (2 x {cores} milli-CPU each; no one-node eviction lets them in), "
          f"{engine.queue_eviction_searches} searches per pass:")
    rows = []
    for label, searches, freeing in (("release (room freed)", engine.queue_eviction_searches, True),
                                     ("pass, nothing freed since", engine.queue_eviction_searches, False),
                                     ("release, searches off (old rule)", 0, True)):
        engine.queue_eviction_searches = searches
        cpu, n = [], 0
        for _ in range(3):
            t0, n0 = time.process_time(), engine.queue_eviction_searches_total
            if freeing:
                await engine.release(offline.pop())
            else:
                engine._on_report(Report("drain", "", 0, 0))
            first = 1000 * (time.process_time() - t0)
            cpu.append(first + await settled())
            n += engine.queue_eviction_searches_total - n0
        rows.append((label, statistics.median(cpu), n / 3))
    for label, ms, n in rows:
        print(f"  {label:34s}: {ms:8.1f} ms CPU (median of 3, all its passes), {n:.0f} searches"
              + (f", {ms / n:.2f} ms each" if n else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dc", default="kansas-city")
    p.add_argument("--policy", default="bestfit")
    p.add_argument("--cores", type=int, default=4)
    p.add_argument("--online", type=int, default=5)
    p.add_argument("--online-cores", type=int, default=8)
    p.add_argument("--waiting", type=int, default=0, help="online tasks waiting in the queue (queue pass CPU)")
    p.add_argument("--spanning", action="store_true", help="an offline task across two nodes (no cheap count)")
    asyncio.run(measure(p.parse_args()))


if __name__ == "__main__":
    main()
