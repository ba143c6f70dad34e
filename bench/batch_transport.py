"""What one request/response exchange costs over grpc.aio: a unary call vs a message pair on an open stream.

The gateway sends its selector and placer calls in batches on one long-lived bidirectional stream per peer
(`hsched.batching`) instead of one unary batch RPC per batch. This measures why, with nothing else in the
way: a server process (uvloop, like the services) answers a ~600-byte message either as a unary method or
as a bidirectional stream that answers each message in order; the client sends `--calls` exchanges one after
the other, and both processes' CPU (from /proc) and the wall time are divided by the exchanges. The two
transports alternate for `--rounds` rounds, so drift of a shared machine hits both alike.

    python bench/batch_transport.py [--calls 3000] [--rounds 3]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import os
import statistics
import subprocess
import time

from bench.echo_chain import cpu_seconds

METHOD_UNARY = "/bench.Batch/Unary"
METHOD_STREAM = "/bench.Batch/Stream"
PAYLOAD = b"x" * 600  # about a PlaceRequest with its task spec


async def serve() -> None:
    import grpc

    async def unary(request: bytes, context) -> bytes:
        return request

    async def stream(requests, context):
        async for request in requests:
            yield request

    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Batch", {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.stream_stream_rpc_method_handler(stream)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


async def measure(port: int, server_pid: int, transport: str, calls: int) -> dict[str, float]:
    """Per exchange: client CPU, server CPU and wall time, in microseconds."""
    import grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        if transport == "unary":
            call = channel.unary_unary(METHOD_UNARY)

            async def exchange() -> None:
                await call(PAYLOAD, timeout=10)
        else:
            stream = channel.stream_stream(METHOD_STREAM)()

            async def exchange() -> None:
                await stream.write(PAYLOAD)
                await stream.read()

        for _ in range(200):  # warm up: connection, stream, caches
            await exchange()
        c0, s0, t0 = time.process_time(), cpu_seconds(server_pid), time.perf_counter()
        for _ in range(calls):
            await exchange()
        out = {"client": time.process_time() - c0, "server": cpu_seconds(server_pid) - s0,
               "wall": time.perf_counter() - t0}
        if transport == "stream":
            stream.cancel()
    return {k: v / calls * 1e6 for k, v in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000, help="exchanges per transport and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the server process
    opts = ap.parse_args()
    import uvloop

    if opts.serve:
        uvloop.run(serve())
        return 0
    server = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        results: dict[str, list[dict[str, float]]] = {"unary": [], "stream": []}
        for r in range(opts.rounds):
            for transport in results:
                results[transport].append(uvloop.run(measure(port, server.pid, transport, opts.calls)))
                print(f"round {r + 1} {transport:6s} " + "  ".join(
                    f"{k} {v:.0f} us" for k, v in results[transport][-1].items()), file=sys.stderr)
    finally:
        server.kill()
    print(f"\n### One exchange over grpc.aio, {opts.calls} one after the other, median of {opts.rounds} rounds "
          f"({os.cpu_count()} CPUs)\n")
    print("| transport | client CPU us | server CPU us | wall us |")
    print("|---|---:|---:|---:|")
    med = {t: {k: statistics.median(r[k] for r in rs) for k in ("client", "server", "wall")}
           for t, rs in results.items()}
    for transport, m in med.items():
        print(f"| {'unary call' if transport == 'unary' else 'message pair on an open stream'} | "
              f"{m['client']:.0f} | {m['server']:.0f} | {m['wall']:.0f} |")
    u, s = med["unary"], med["stream"]
    print(f"\nstream / unary: client CPU {s['client'] / u['client']:.2f}x, server CPU {s['server'] / u['server']:.2f}x, "
          f"wall {s['wall'] / u['wall']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
