"""The floor of Python gRPC on this machine: client -> f1 -> f2 -> f3 -> echo (4 hops).

Every server is a separate process with its own uvloop loop, serving a generic bytes-in/bytes-out
method (`/bench.Echo/Echo`, identity serializers, ~200-byte payload like a task spec) on a free
127.0.0.1 port; forwarders pass each request on to the next hop over one channel.

    python bench/echo_chain.py [--hops 4] [--duration 5] [--client-processes 2]

Reuse: `target, stop = start_echo_chain(hops)` (or `with start_echo_chain() as chain:`) and
`measure_echo_chain(concurrency, duration_s, client_processes, rate_rps=None)`.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script: make `bench` importable here and in spawned children
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
from dataclasses import dataclass, field

from bench.loadgen import LoadResult, run_load

METHOD = "/bench.Echo/Echo"
WARMUP_S = 1.0
PAYLOAD = (b'{"task_id":"t-000000001","tenant":"acme","gpus":8,"gpu_type":"H100","mem_gb":640,'
           b'"priority":3,"deadline_s":3600,"region":"eu-west","preemptible":false,'
           b'"labels":{"team":"ml-infra","job":"pretrain-7b"}}').ljust(200)


def echo_request(i: int, method: str = METHOD):
    """`make_request` for `run_load`."""
    return method, PAYLOAD, None


@contextlib.asynccontextmanager
async def echo_twice(target: str):
    """Sequence-mode example (a step factory for `run_closed_loop`): two named calls per iteration."""
    import grpc

    async with grpc.aio.insecure_channel(target) as channel:
        echo = channel.unary_unary(METHOD)

        async def step(i, call):
            reply = await call("first", echo(PAYLOAD, timeout=10))
            await call("second", echo(reply, timeout=10))

        yield step


def spawn_server(name: str, target, *args, timeout_s: float = 30.0) -> tuple[mp.Process, int]:
    """Run `target(conn, *args)` in a spawned daemon process that sends the port it serves on over `conn`;
    returns (process, port). A server that does not report in `timeout_s` is terminated."""
    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(child_end, *args), daemon=True, name=name)
    proc.start()
    child_end.close()
    if not parent_end.poll(timeout_s):
        proc.terminate()
        raise TimeoutError(f"{name} did not start in {timeout_s} s")
    return proc, parent_end.recv()


def _serve(conn, downstream: str | None, use_uvloop: bool):
    if use_uvloop:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    else:
        runner = asyncio.Runner()
    with runner:
        runner.run(_serve_async(downstream, conn))


async def _serve_async(downstream: str | None, conn):
    import grpc

    if downstream is None:
        async def handler(request: bytes, context) -> bytes:
            return request
    else:
        forward = grpc.aio.insecure_channel(downstream).unary_unary(METHOD)

        async def handler(request: bytes, context) -> bytes:
            return await forward(request, timeout=context.time_remaining())

    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(handler)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    conn.send(port)
    conn.close()
    parent = os.getppid()
    while os.getppid() == parent:  # never outlive the process that started the chain
        await asyncio.sleep(1)
    await server.stop(None)


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM (KiB) from /proc/<pid>/status; psutil is not guaranteed."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0])
    return out


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class EchoChain:
    target: str
    procs: dict[str, mp.Process] = field(default_factory=dict)  # name -> process, entry hop first

    def stop(self):
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            proc.join(5)

    def rss(self) -> dict[str, dict[str, int]]:
        return {name: proc_status(p.pid) for name, p in self.procs.items()}

    def cpu_s(self) -> float:
        return sum(cpu_seconds(p.pid) for p in self.procs.values())

    def __iter__(self):  # `target, stop = start_echo_chain()`
        return iter((self.target, self.stop))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def start_echo_chain(hops: int = 4, use_uvloop: bool = True, timeout_s: float = 30.0) -> EchoChain:
    """Start an echo server and `hops - 1` forwarders in front of it; the target is the first hop."""
    chain = EchoChain("")
    downstream = None
    try:
        for k in [0, *range(hops - 1, 0, -1)]:  # echo first, then f3, f2, f1
            name = f"f{k}" if k else "echo"
            chain.procs[name], port = spawn_server(f"echo-chain-{name}", _serve, downstream, use_uvloop,
                                                   timeout_s=timeout_s)
            downstream = f"127.0.0.1:{port}"
    except BaseException:
        chain.stop()
        raise
    chain.procs = dict(reversed(chain.procs.items()))
    chain.target = downstream
    return chain


def measure_echo_chain(concurrency: int, duration_s: float = 5.0, client_processes: int = 1,
                       rate_rps: float | None = None, target: str | None = None, hops: int = 4,
                       warmup_s: float = WARMUP_S) -> LoadResult:
    """Load an echo chain (`target`, or a new one with `hops` hops) with `run_load`.

    With `rate_rps` the load is open-loop and `concurrency` bounds the calls in flight.
    """
    if target is None:
        with start_echo_chain(hops) as chain:
            return measure_echo_chain(concurrency, duration_s, client_processes, rate_rps, chain.target,
                                      hops, warmup_s)
    return run_load(target, "bench.echo_chain:echo_request", concurrency=concurrency, duration_s=duration_s,
                    processes=client_processes, warmup_s=warmup_s, rate_rps=rate_rps)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hops", type=int, default=4)
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per point (plus 1 s warmup)")
    ap.add_argument("--client-processes", type=int, default=1,
                    help="1 is enough for the chain: see the client CPU column")
    ap.add_argument("--concurrency", default="1,16,64,128,256", help="closed-loop points")
    ap.add_argument("--no-uvloop", action="store_true", help="servers on the default asyncio loop")
    opts = ap.parse_args()

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    log(f"starting a {opts.hops}-hop echo chain ...")
    rows = []
    with start_echo_chain(opts.hops, use_uvloop=not opts.no_uvloop) as chain:
        log(f"  target {chain.target}, server pids {[p.pid for p in chain.procs.values()]}")
        idle_rss = chain.rss()

        def point(label, concurrency, rate=None):
            log(f"{label}: concurrency {concurrency}" + (f", rate {rate:.0f}/s" if rate else "") + " ...")
            cpu0 = chain.cpu_s()
            r = measure_echo_chain(concurrency, opts.duration, opts.client_processes, rate, chain.target)
            # Server CPU over warmup + measurement, per call at the measured rate (an estimate).
            cpu_ms = (chain.cpu_s() - cpu0) * 1e3 / max(1.0, r.throughput_rps * (r.elapsed_s + WARMUP_S))
            log(f"  {r.summary()}")
            rows.append((label, concurrency, r, cpu_ms))
            return r

        for c in opts.concurrency.split(","):
            point("closed", int(c))
        _, peak_c, peak, peak_cpu = max(rows, key=lambda row: row[2].throughput_rps)
        rows.append(("**peak**", peak_c, peak, peak_cpu))
        # Open loop: in-flight bound well above the peak's, so drops would mean overload.
        point("open, half peak", max(256, 4 * peak_c), peak.throughput_rps / 2)
        rss = chain.rss()

    loop = "asyncio" if opts.no_uvloop else "uvloop"
    print(f"\n### {opts.hops}-hop grpc.aio echo chain (servers on {loop}, {opts.client_processes} client "
          f"process(es), {opts.duration:g} s per point after {WARMUP_S:g} s warmup, {os.cpu_count()} CPUs)\n")
    print("| load | concurrency | req/s | p50 ms | p90 ms | p99 ms | max ms | errors | server CPU ms/req "
          "| client CPU |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, c, r, cpu_ms in rows:
        load = f"{label} ({r.offered_rps:.0f}/s offered, {r.dropped} dropped)" if r.offered_rps else label
        print(f"| {load} | {c} | {r.throughput_rps:.0f} | {r.p50_ms:.2f} | {r.p90_ms:.2f} | {r.p99_ms:.2f} "
              f"| {r.max_ms:.2f} | {sum(r.errors.values())} | ~{cpu_ms:.2f} "
              f"| {' / '.join(f'{c:.0%}' for c in r.client_cpu)} |")
    print("\n| server process | RSS idle MiB | RSS after MiB | peak RSS MiB |")
    print("|---|---:|---:|---:|")
    for name, status in rss.items():
        print(f"| {name} | {idle_rss[name]['VmRSS'] / 1024:.1f} | {status['VmRSS'] / 1024:.1f} "
              f"| {status['VmHWM'] / 1024:.1f} |")


if __name__ == "__main__":
    main()
