"""Memory of one placer process at fleet scale (issue 16: placer RSS at 10,000 servers < 300 MiB).

For each size, a real placer process (`services.placer`, its gRPC server, engine, ledger on a real Redis under a
unique key prefix, the thermal guard in-process: `--thermal-guard local`) serves the CPU room "chicago" scaled
to that many servers (racks of 42 in its 2 rows, as bench/placer_scale.py and bench/engine_cpu.py scale it).
The process' RSS is read from /proc when it serves, idle; then `--places` CPU tasks of the openb trace are
Placed over gRPC and held (one at a time, `--concurrency` in flight); then RSS again and the peak (VmHWM).

    python bench/placer_rss.py [--sizes 672,5000,10000] [--places 2000] [--policy bestfit]

REDIS_URL, when set, is used (default redis://127.0.0.1:6379/0); the prefix's keys are deleted at the end.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script: make `bench` importable here and in the child
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import asyncio
import dataclasses
import os
import secrets
import signal
import subprocess
import tempfile
import time

TARGET_MIB = 300.0


def status_mib(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM (peak RSS) of `pid` in MiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out


def child(servers: int, argv: list[str]) -> None:
    """The placer service with "chicago" scaled to `servers` in its fleet."""
    from bench.engine_cpu import scaled_room
    from hsched.domain.fleet import load_fleet
    from services.placer import server

    fleet = load_fleet(None)
    fleet = dataclasses.replace(fleet, datacenters=tuple(
        scaled_room(dc, servers) if dc.name == "chicago" else dc for dc in fleet.datacenters))
    server.load_fleet = lambda _path=None: fleet
    server.main(argv)


async def fill(target: str, places: int, concurrency: int) -> tuple[int, int]:
    """Place `places` CPU tasks of the openb trace and keep them; returns (placed, not placed)."""
    import grpc

    from bench.stack_bench import build_requests
    from hsched.v1 import gateway_pb2, placer_pb2, placer_pb2_grpc

    tasks = [t for t in (gateway_pb2.SubmitRequest.FromString(b).task for b in build_requests(None, 4000))
             if not t.resources.gpu_count]
    counts = {"placed": 0, "other": 0}
    todo = list(range(places))
    async with grpc.aio.insecure_channel(target) as channel:
        stub = placer_pb2_grpc.PlacerStub(channel)

        async def worker() -> None:
            while todo:
                i = todo.pop()
                reply = await stub.Place(placer_pb2.PlaceRequest(task_id=f"rss-{i}", task=tasks[i % len(tasks)],
                                                                 allow_defer=False), timeout=60)
                counts["placed" if reply.outcome == placer_pb2.PLACE_OUTCOME_PLACED else "other"] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return counts["placed"], counts["other"]


def measure(servers: int, opts, redis_url: str) -> dict:
    prefix = f"bench-rss-{secrets.token_hex(3)}"
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "placer.port"
        argv = ["--datacenter", "chicago", "--listen", "127.0.0.1:0", "--port-file", str(port_file),
                "--redis-url", redis_url, "--prefix", prefix, "--policy", opts.policy,
                "--thermal", "127.0.0.1:1", "--thermal-guard", "local", "--log-level", "WARNING"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, __file__, "--child", str(servers), *argv], env=env)
        try:
            deadline = time.monotonic() + 300
            while not (port_file.exists() and port_file.read_text()):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the placer for {servers} servers did not start (exit {proc.poll()})")
                time.sleep(0.2)
            time.sleep(1.0)  # settled: its first summary written, the guard's headroom computed
            idle = status_mib(proc.pid)
            placed, other = asyncio.run(fill(f"127.0.0.1:{port_file.read_text()}", opts.places, opts.concurrency))
            after = status_mib(proc.pid)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            from hsched.state.redis import connect_sync

            client = connect_sync(redis_url)
            keys = list(client.scan_iter(f"{prefix}*"))
            if keys:
                client.delete(*keys)
            client.close()
    return {"servers": servers, "idle": idle["VmRSS"], "after": after["VmRSS"], "peak": after["VmHWM"],
            "placed": placed, "other": other}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        child(int(argv[1]), argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="672,5000,10000", help="servers in the scaled room, comma-separated")
    p.add_argument("--places", type=int, default=2000, help="CPU tasks placed and held before the second reading")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--policy", default="bestfit")
    opts = p.parse_args(argv)
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    rows = [measure(int(s), opts, redis_url) for s in opts.sizes.split(",")]
    print(f"\n### placer process RSS, CPU room chicago scaled, policy {opts.policy}, thermal guard in-process\n")
    print(f"| servers | RSS serving, idle MiB | RSS after {opts.places} Places MiB | peak RSS MiB | placed | not placed |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['servers']:,} | {r['idle']:.0f} | {r['after']:.0f} | {r['peak']:.0f} | {r['placed']} | "
              f"{r['other']} |")
    largest = max(rows, key=lambda r: r["servers"])
    ok = largest["peak"] < TARGET_MIB
    print(f"\n{'PASS' if ok else 'FAIL'}  placer peak RSS at {largest['servers']:,} servers: {largest['peak']:.0f} MiB "
          f"(target < {TARGET_MIB:.0f} MiB)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
