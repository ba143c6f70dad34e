"""How many processes should host the placers of a local stack? RSS and Submit throughput per layout.

For each `--layouts` value (`hsched up --placer-processes`: 0 = one process per data center, as compose and
Kubernetes run them; 1 = every DC's placer in one process; K = K groups), one after the other on the same
machine: start the whole local stack (`hsched.stack.Stack`, metrics on, thermal guard on, a unique Redis key
prefix), let it settle, read every process's RSS and PSS (/proc), then run bench/stack_bench.py's Submit-only
phase (rounds of `--burst` Submits of real openb tasks, closed loop at `--concurrency`, each round's tasks
released in a separate, untimed round) for `--duration` seconds of Submits. Prints one markdown row per layout:
processes, placer RSS, stack RSS, stack PSS, Submit/s, p50/p99, outcomes, CPU ms per Submit in the placers and
the whole stack, and the share of a core other processes on the machine used meanwhile (a shared machine: compare
layouts of one run, and repeat with the layouts in another order).

    python bench/placer_groups.py [--layouts 0,1,2,3] [--duration 8] [--concurrency 64] [--burst 800]

REDIS_URL, when set, is used instead of an embedded redis-server (the run's keys are deleted at the end).
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script: make `bench` importable here and in spawned children
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import os
import secrets
import time

from bench.stack_bench import (
    build_requests,
    delete_prefix,
    log,
    pss_mib,
    run_submit_only,
    stack_pids,
)


def is_placer(name: str) -> bool:
    return name.startswith(("placer-", "placers-"))


def measure(layout: int, requests: list[bytes], opts) -> dict:
    from hsched.stack import Stack, StackConfig
    from hsched.state.redis import free_port

    prefix = f"bench-groups-{os.getpid()}-{secrets.token_hex(3)}"
    redis_url = os.environ.get("REDIS_URL") or None
    stack = Stack(StackConfig(fleet_path=opts.fleet, redis_url=redis_url, prefix=prefix, policy=opts.policy,
                              traces="none", metrics=True, gateway_port=free_port(), placer_processes=layout))
    t0 = time.monotonic()
    try:
        stack.start()
        up_s = time.monotonic() - t0
        time.sleep(opts.settle)
        pids = stack_pids(stack)
        rss = stack.rss_mib()
        pss = {n: pss_mib(pid) for n, pid in pids.items()}
        log(f"layout {layout}: up in {up_s:.1f} s, {sum(is_placer(n) for n in pids)} placer processes, "
            f"placers RSS {sum(v for n, v in rss.items() if is_placer(n)):.0f} MiB")
        phase = run_submit_only(stack, requests, pids, opts, opts.duration, opts.concurrency, opts.burst)
        submit = phase.get("Submit")
        return {"layout": layout, "up_s": up_s, "processes": sum(is_placer(n) for n in pids),
                "placer_rss": sum(v for n, v in rss.items() if is_placer(n)), "stack_rss": sum(rss.values()),
                "stack_pss": sum(pss.values()), "submit_rps": submit.throughput_rps, "p50": submit.p50_ms,
                "p99": submit.p99_ms, "errors": sum(submit.errors.values()), "outcomes": phase.outcomes(),
                "placer_cpu_ms": sum(v for n, v in phase.cpu_ms_per_iter.items() if is_placer(n)),
                "stack_cpu_ms": sum(phase.cpu_ms_per_iter.values()), "foreign": phase.foreign}
    finally:
        stack.stop()
        if redis_url:
            delete_prefix(redis_url, prefix)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fleet", default=None, help="fleet YAML (default: the embedded 11-DC fleet)")
    ap.add_argument("--layouts", default="0,1,2,3",
                    help="placer process counts to compare (0 = one per DC), comma-separated")
    ap.add_argument("--duration", type=float, default=8.0, help="seconds of Submits per layout")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--burst", type=int, default=800, help="Submits per round (then released)")
    ap.add_argument("--client-processes", type=int, default=1, help="load-generator processes")
    ap.add_argument("--tasks", type=int, default=2000, help="openb pods to cycle through")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy", default="bestfit")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds idle before RSS is read")
    opts = ap.parse_args()
    try:
        layouts = [int(x) for x in opts.layouts.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--layouts {opts.layouts!r}: comma-separated integers >= 0")
    if not layouts or min(layouts) < 0:
        ap.error(f"--layouts {opts.layouts!r}: comma-separated integers >= 0")
    requests = build_requests(opts.fleet, opts.tasks, opts.seed)
    rows = [measure(layout, requests, opts) for layout in layouts]
    print(f"\n### Placer processes (fleet {opts.fleet or 'default'}, {opts.duration:g} s of Submits per layout, "
          f"concurrency {opts.concurrency})\n")
    print("| --placer-processes | placer processes | placers RSS MiB | stack RSS MiB | stack PSS MiB | Submit/s "
          "| p50 ms | p99 ms | errors | outcomes | placer CPU ms/Submit | stack CPU ms/Submit | other load | up s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(r["outcomes"].items()))
        print(f"| {r['layout']} | {r['processes']} | {r['placer_rss']:.0f} | {r['stack_rss']:.0f} | "
              f"{r['stack_pss']:.0f} | {r['submit_rps']:.0f} | {r['p50']:.1f} | {r['p99']:.1f} | {r['errors']} | "
              f"{outcomes} | {r['placer_cpu_ms']:.2f} | {r['stack_cpu_ms']:.2f} | {r['foreign']:.0%} | {r['up_s']:.1f} |")
    by_layout: dict[int, list[dict]] = {}
    for r in rows:  # a layout listed twice (e.g. --layouts 1,0,1,0 on a noisy machine): its runs' mean
        by_layout.setdefault(r["layout"], []).append(r)

    def mean(layout: int, key: str) -> float:
        return sum(r[key] for r in by_layout[layout]) / len(by_layout[layout])

    if 0 in by_layout:
        for layout in by_layout:
            if layout != 0:
                print(f"\n--placer-processes {layout} vs one per DC (means of {len(by_layout[layout])} and "
                      f"{len(by_layout[0])} runs): RSS {mean(layout, 'stack_rss') - mean(0, 'stack_rss'):+.0f} MiB "
                      f"({mean(layout, 'stack_rss') / mean(0, 'stack_rss'):.2f}x), Submit/s "
                      f"{mean(layout, 'submit_rps') / max(mean(0, 'submit_rps'), 1e-9):.2f}x, placer CPU per Submit "
                      f"{mean(layout, 'placer_cpu_ms') / max(mean(0, 'placer_cpu_ms'), 1e-9):.2f}x", end="")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
