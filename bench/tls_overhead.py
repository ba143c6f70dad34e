"""What mutual TLS on every hop costs: the local stack plaintext vs `--tls`, Submit+Release through the gateway.

The two stacks run one after the other, never at the same time, in the order plain, tls, tls, plain, ...
(`--rounds` pairs, ABBA so that a drift of the shared machine's speed hits both alike). For each stack:
a closed-loop peak at `--concurrency` (Submit+Release iterations/s), then an open-loop point at `--rate`
iterations/s (Poisson arrivals) for latency at a load both modes sustain, with the CPU the services (not
Redis, which stays plaintext) used per iteration meanwhile — the figure other load on a shared machine
moves least. The workload is
`bench.stack_bench.submit_release` (real openb tasks, each released right away), over TLS as the stack's
admin when the stack runs TLS; each service then serves mutual TLS and dials its peers over it (gateway ->
selector / placers, placer -> thermal with --thermal-guard service).

Prints a markdown table per mode (medians over rounds) and the TLS / plaintext ratios.

    python bench/tls_overhead.py [--fleet tests/fleets/small.yaml] [--duration 5] [--concurrency 16]
                                 [--rate 40] [--rounds 2]

REDIS_URL, when set, is used instead of an embedded redis-server (the run's keys are deleted at the end).
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script: make `bench` importable here and in spawned children
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import contextlib
import os
import secrets
import statistics
import time

from bench.echo_chain import WARMUP_S, cpu_seconds
from bench.loadgen import LoadResult, run_closed_loop
from bench.stack_bench import build_requests, stack_pids

ROOT = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def measure(tls: bool, opts, requests: list[bytes]) -> dict[str, LoadResult]:
    from hsched.stack import Stack, StackConfig
    from hsched.state.redis import connect_sync, free_port

    prefix = f"bench-tls-{os.getpid()}-{secrets.token_hex(3)}"
    redis_url = os.environ.get("REDIS_URL") or None
    stack = Stack(StackConfig(fleet_path=opts.fleet, redis_url=redis_url, prefix=prefix, traces="none",
                              metrics=False, gateway_port=free_port(), tls=tls, redis_tls=False,  # gRPC only
                              extra_env={"HSCHED_THERMAL_GUARD": "service"}))
    try:
        stack.start()
        pids = {n: p for n, p in stack_pids(stack).items() if n != "redis"}  # the services (Redis is plaintext)
        args = (stack.gateway, requests, 10.0, str(stack.tls_dir) if tls else None)
        factory = "bench.stack_bench:submit_release"
        peak = run_closed_loop(factory, args, concurrency=opts.concurrency, duration_s=opts.duration)
        cpu0 = sum(cpu_seconds(p) for p in pids.values())
        steady = run_closed_loop(factory, args, concurrency=max(64, 4 * opts.concurrency), duration_s=opts.duration,
                                 rate_rps=opts.rate)
        cpu = sum(cpu_seconds(p) for p in pids.values()) - cpu0
        # the CPU counters also cover the warmup: per iteration over everything the loop sent
        iterations = steady["Submit"].throughput_rps * (steady["Submit"].elapsed_s + WARMUP_S)
        return {"peak": peak["Submit"], "open": steady["Submit"], "open_release": steady["Release"],
                "cpu_ms": cpu * 1e3 / max(1.0, iterations)}
    finally:
        stack.stop()
        if redis_url:
            with contextlib.suppress(Exception):
                r = connect_sync(redis_url)
                keys = list(r.scan_iter(match=f"{prefix}:*", count=1000))
                if keys:
                    r.delete(*keys)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fleet", default=str(ROOT / "tests" / "fleets" / "small.yaml"))
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per point")
    ap.add_argument("--concurrency", type=int, default=16, help="closed-loop in-flight iterations")
    ap.add_argument("--rate", type=float, default=40.0, help="open-loop Submit+Release iterations/s")
    ap.add_argument("--rounds", type=int, default=2, help="plain/tls pairs (ABBA order)")
    ap.add_argument("--tasks", type=int, default=2000, help="openb pods to cycle through")
    opts = ap.parse_args()
    requests = build_requests(opts.fleet, opts.tasks)
    results: dict[bool, list[dict[str, LoadResult]]] = {False: [], True: []}
    order = [m for k in range(opts.rounds) for m in ((False, True) if k % 2 == 0 else (True, False))]
    for tls in order:
        t0 = time.monotonic()
        log(f"{'tls' if tls else 'plaintext'}: starting the stack and measuring ...")
        r = measure(tls, opts, requests)
        results[tls].append(r)
        log(f"  peak Submit {r['peak'].summary()}\n  open Submit {r['open'].summary()}\n  services' CPU "
            f"{r['cpu_ms']:.2f} ms per Submit+Release at {opts.rate:g} it/s  ({time.monotonic() - t0:.0f} s)")

    def med(tls: bool, point: str, attr: str | None = None) -> float:
        return statistics.median(getattr(r[point], attr) if attr else r[point] for r in results[tls])

    print(f"\n## TLS overhead — fleet {Path(opts.fleet).name}, {opts.rounds} round(s) per mode (medians), "
          f"{opts.duration:g} s per point\n")
    print(f"| mode | peak Submit/s (closed, c={opts.concurrency}) | Submit p50 / p99 ms at peak "
          f"| Submit p50 / p99 ms at {opts.rate:g} it/s | Release p50 / p99 ms at {opts.rate:g} it/s "
          f"| services' CPU ms per Submit+Release | errors |")
    print("|---|---|---|---|---|---|---|")
    for tls in (False, True):
        errors = sum(sum(r[p].errors.values()) for r in results[tls] for p in ("peak", "open", "open_release"))
        print(f"| {'mTLS every hop' if tls else 'plaintext'} | {med(tls, 'peak', 'throughput_rps'):.0f} "
              f"| {med(tls, 'peak', 'p50_ms'):.2f} / {med(tls, 'peak', 'p99_ms'):.2f} "
              f"| {med(tls, 'open', 'p50_ms'):.2f} / {med(tls, 'open', 'p99_ms'):.2f} "
              f"| {med(tls, 'open_release', 'p50_ms'):.2f} / {med(tls, 'open_release', 'p99_ms'):.2f} "
              f"| {med(tls, 'cpu_ms'):.2f} | {errors} |")
    print(f"\nTLS / plaintext: peak Submit/s x{med(True, 'peak', 'throughput_rps') / med(False, 'peak', 'throughput_rps'):.2f}, "
          f"Submit p50 at {opts.rate:g} it/s x{med(True, 'open', 'p50_ms') / med(False, 'open', 'p50_ms'):.2f}, "
          f"p99 x{med(True, 'open', 'p99_ms') / med(False, 'open', 'p99_ms'):.2f}, "
          f"services' CPU per iteration x{med(True, 'cpu_ms') / med(False, 'cpu_ms'):.2f} (the figure least moved "
          "by other load on the machine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
