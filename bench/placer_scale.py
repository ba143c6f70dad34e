"""Placement decisions at fleet scale, per policy: CPU per placement, placements/s per core, p99 decision
latency — and what scoring a bounded candidate set costs in quality against scoring every node.

Speed. For each room size and policy, `PlacerEngine.place` / `release` in-process (no gRPC) with the
in-process thermal guard and the ledger on a real Redis (a unique key prefix, deleted at the end), one BLAS
thread and one torch thread, as `bench/engine_cpu.py`: rounds of `--hold` Places of the first openb trace
tasks from 8 coroutines, each round followed by its Releases. CPU rooms: "chicago" scaled to 672 / 5,000 /
10,000 servers (racks of 42 in its 2 rows, zonal thermal model) with the CPU-only tasks; GPU clusters:
"kansas-city" (150 hosts, its machine mix) scaled to 5,000 hosts (racks of 10 in 2 rows) with every task.
Printed per row: CPU µs per Place of this process (all threads; Redis's own CPU not counted) and
placements/s per core (= 1e6 / that), and the p50 / p99 of one decision — the `plan()` call that filters
(feasibility and thermal masks), samples the candidates and scores them — in CPU time of the thread (the
machine is shared: wall time would measure the neighbours) and in wall time.

Quality. The same policies with the bound vs scoring every feasible node (a learned policy's own
`candidate_limit` lifted too), through the evaluations' own code: `hsched.envs.dc.eval_env` +
`hsched.envs.dc.run_policy` (CPU room "chicago", 672 servers, the paper split: 2,000 warm-up and 500
evaluation Thunder jobs per seed, both CRAC modes: placed tasks, mean overloads, mean PUE) and
`hsched.envs.gpu`'s "default fleet GPU DCs" setting of `hsched eval gpu` (340 hosts, `--gpu-tasks` openb
tasks per seed, 1,800 as the eval: tasks deployed). Differences are (bounded − full) / full in %, per seed,
then averaged; the full runs' own means are printed next to them.

    python bench/placer_scale.py [--nodes-to-score 256] [--places 600] [--hold 300] [--seeds 2]
                                 [--cpu-sizes 672,5000,10000] [--gpu-sizes 150,5000] [--skip-quality]
                                 [--fill 0.8] [--policies bestfit,firstfit,...]

`--fill F` first places and holds trace tasks (not measured) until a share F of the room's GPU core (CPU
rooms: CPU) is allocated, so the measured Places decide in a loaded room.
`firstfit` (speed rows only, when named in --policies) scores a node by its index: its decision is the filter,
the sample and the card choice alone, so its CPU per Place is the engine's floor around any decision.

Targets (issue 16): ≥ 1,600 placements/s per core at 5,000 for every policy, p99 decision ≤ 5 ms at 10,000,
quality within 1 %. REDIS_URL, when set, is used (default redis://127.0.0.1:6379/0).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if not __package__:  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hsched.threads import BLAS_THREAD_VARS

os.environ.update(dict.fromkeys(BLAS_THREAD_VARS, "1"))  # before numpy loads OpenBLAS

import argparse
import asyncio
import dataclasses
import math
import secrets
import time

import numpy as np

CPU_POLICIES = ("bestfit", "utilization", "double-dqn")
GPU_POLICIES = ("bestfit", "utilization", "fgd", "eade-ddpg")
# speed rows only, when named in --policies: the engine's floor (the decision is the filter, sample and card choice)
FLOOR_POLICIES = ("firstfit",)


def scaled_gpu_room(dc, hosts: int):
    """The GPU DC `dc` with its machine mix scaled to about `hosts` hosts, in racks of its height and rows."""
    from hsched.domain.fleet import RoomLayout

    total = sum(p.count for p in dc.pools)
    pools = tuple(dataclasses.replace(p, count=max(1, round(p.count * hosts / total))) for p in dc.pools)
    n = sum(p.count for p in pools)
    per_rack, rows = dc.layout.servers_per_rack, dc.layout.rows
    racks = rows * math.ceil(n / per_rack / rows)
    return dataclasses.replace(dc, pools=pools, layout=RoomLayout(racks, per_rack, rows))


async def speed(kind: str, size: int, policy_name: str, nodes_to_score: str, opts) -> dict:
    import hsched.engine.placer as placer_mod
    from bench.engine_cpu import scaled_room
    from bench.stack_bench import build_requests
    from hsched.convert import task_from_pb
    from hsched.domain.fleet import load_fleet
    from hsched.engine.placer import PlacerEngine
    from hsched.policies.heuristics import make_policy
    from hsched.state.keys import Keys
    from hsched.state.redis import connect
    from hsched.thermal.datacenter import room_for
    from hsched.v1 import gateway_pb2

    fleet = load_fleet(None)
    specs = [task_from_pb(gateway_pb2.SubmitRequest.FromString(b).task) for b in build_requests(None, 2000, 0)]
    if kind == "cpu":
        dc = scaled_room(fleet.datacenter("chicago"), size)
        specs = [s for s in specs if not s.resources.gpu_count]
    else:
        dc = scaled_gpu_room(fleet.datacenter("kansas-city"), size)
    policy = make_policy(policy_name, 0, dc, nodes_to_score)
    redis = connect(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    prefix = f"bench-scale-{secrets.token_hex(3)}"
    engine = PlacerEngine(dc, redis, Keys(prefix), policy, "bench", room_for(dc))
    cpu_ns: list[int] = []
    wall_ns: list[int] = []
    real_plan = placer_mod.plan

    def timed_plan(*a, **k):  # one decision: filter, sample, score (the engine's own call)
        c, w = time.thread_time_ns(), time.perf_counter_ns()
        try:
            return real_plan(*a, **k)
        finally:
            cpu_ns.append(time.thread_time_ns() - c)
            wall_ns.append(time.perf_counter_ns() - w)

    placer_mod.plan = timed_plan
    await engine.start()
    place_cpu, placed, calls = 0.0, 0, 0
    try:
        if opts.fill:  # a loaded room first: the trace's tasks placed and held (not measured) up to the GPU share
            misses, i = 0, 0
            while engine.state.utilisation()["gpu_core" if kind == "gpu" else "cpu"] < opts.fill and misses < 200:
                placed_now = (await engine.place(f"fill-{i}", specs[i % len(specs)], False)).outcome == "placed"
                misses, i = 0 if placed_now else misses + 1, i + 1
            cpu_ns.clear()
            wall_ns.clear()
        for r in range(max(1, opts.places // opts.hold)):
            held: list[str] = []

            async def place(k: int, r: int = r, held: list[str] = held) -> None:
                nonlocal placed, calls
                for i in range(k, opts.hold, 8):
                    task_id = f"r{r}-{i}"
                    calls += 1
                    if (await engine.place(task_id, specs[(r * opts.hold + i) % len(specs)], False)).outcome \
                            == "placed":
                        held.append(task_id)
                        placed += 1

            c0 = time.process_time()
            await asyncio.gather(*(place(k) for k in range(8)))
            place_cpu += time.process_time() - c0
            await asyncio.gather(*(engine.release(t) for t in held))
    finally:
        placer_mod.plan = real_plan
        await engine.stop()
        keys = [k async for k in redis.scan_iter(f"{prefix}*")]
        if keys:
            await redis.delete(*keys)
        await redis.aclose()
    us = 1e6 * place_cpu / max(1, calls)
    return {"kind": kind, "n": engine.state.n, "policy": policy_name, "served": getattr(policy, "name", policy_name),
            "calls": calls, "placed": placed, "us": us, "per_s": 1e6 / us,
            "p50_cpu_ms": np.percentile(cpu_ns, 50) / 1e6, "p99_cpu_ms": np.percentile(cpu_ns, 99) / 1e6,
            "p99_wall_ms": np.percentile(wall_ns, 99) / 1e6}


def _unbounded(policy):
    """`policy` scoring every feasible node: no sampler, and a learned policy's own limit lifted."""
    from hsched.policies.base import bound

    inner = getattr(policy, "policy", policy)  # a Fallback's heuristic
    for p in {id(policy): policy, id(inner): inner}.values():
        if getattr(p, "candidate_limit", None):
            p.candidate_limit = None
    return bound(policy, "all")


def quality_thermal(names, nodes_to_score: str, seeds) -> list[tuple]:
    from hsched.envs.dc import PAPER_SPLIT, eval_env, run_policy
    from hsched.eval.thermal import POLICY_FACTORIES
    from hsched.policies.base import bound
    from hsched.policies.heuristics import make_policy

    def make(name, seed):
        if name == "double-dqn":
            factory = POLICY_FACTORIES.get("Double DQN")
            return factory(seed) if factory else None
        return make_policy(name, seed)

    rows = []
    for mode in ("fixed", "redline"):
        for name in names:
            diffs: dict[str, list[float]] = {"placed": [], "mean_overloads": [], "mean_pue": []}
            fulls: dict[str, list[float]] = {k: [] for k in diffs}
            for seed in seeds:
                full_p, bounded_p = make(name, seed), make(name, seed)
                if full_p is None:
                    break
                full = run_policy(eval_env(mode, seed, PAPER_SPLIT), _unbounded(full_p), seed=seed)
                part = run_policy(eval_env(mode, seed, PAPER_SPLIT), bound(bounded_p, nodes_to_score, seed), seed=seed)
                for key in diffs:
                    diffs[key].append(_pct(part[key], full[key]))
                    fulls[key].append(full[key])
            if diffs["placed"]:
                rows.append((f"thermal {mode}", name, diffs["placed"], float(np.mean(diffs["mean_overloads"])),
                             float(np.mean(diffs["mean_pue"])),
                             " / ".join(f"{np.mean(fulls[k]):.{d}f}" for k, d in
                                        (("placed", 0), ("mean_overloads", 1), ("mean_pue", 4)))))
    return rows


def quality_gpu(names, nodes_to_score: str, seeds, n_tasks: int) -> list[tuple]:
    from hsched.envs.gpu import GpuClusterEnv, fleet_gpu_datacenters, run_policy
    from hsched.eval.gpu import LEARNED_POLICIES, policy_for
    from hsched.policies.base import bound

    env = GpuClusterEnv(fleet_gpu_datacenters(), n_tasks=n_tasks)

    def make(name, seed):
        if name == "eade-ddpg":
            factory = LEARNED_POLICIES.get("EADE-DDPG")
            return factory(env.view, seed) if factory else None
        return policy_for(name, env, seed)

    rows = []
    for name in names:
        diffs: list[float] = []
        fulls: list[float] = []
        for seed in seeds:
            full_p, bounded_p = make(name, seed), make(name, seed)
            if full_p is None:
                break
            full = run_policy(env, _unbounded(full_p), seed=seed).metrics["deployed"]
            part = run_policy(env, bound(bounded_p, nodes_to_score, seed), seed=seed).metrics["deployed"]
            diffs.append(_pct(part, full))
            fulls.append(full)
        if diffs:
            rows.append(("gpu 340 hosts", name, diffs, None, None,
                         f"{np.mean(fulls):.1f} deployed of {n_tasks}"))
    return rows


def _mean_se(values: list[float]) -> str:
    """mean ± standard error over the seeds (the mean alone for one seed)."""
    m = float(np.mean(values))
    if len(values) < 2:
        return f"{m:+.2f}"
    return f"{m:+.2f} ± {float(np.std(values, ddof=1)) / math.sqrt(len(values)):.2f}"


def _pct(x: float, ref: float) -> float:
    return 100.0 * (x - ref) / ref if ref else (0.0 if x == ref else math.inf)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes-to-score", default="256", help="the bound under test (all, a count, or P%%)")
    p.add_argument("--places", type=int, default=600, help="Places per row")
    p.add_argument("--hold", type=int, default=300, help="Places held per round before their Releases")
    p.add_argument("--cpu-sizes", default="672,5000,10000")
    p.add_argument("--gpu-sizes", default="150,5000")
    p.add_argument("--policies", default="",
                   help="comma-separated subset (default: every policy that applies; firstfit: speed rows only)")
    p.add_argument("--seeds", type=int, default=2, help="evaluation seeds for the quality part")
    p.add_argument("--gpu-tasks", type=int, default=1800, help="openb tasks per seed in the GPU quality eval")
    p.add_argument("--fill", type=float, default=0.0,
                   help="first place and hold trace tasks until this share of the room's GPU core (CPU rooms: CPU) "
                        "is allocated (0-1; default 0: an empty room)")
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument("--skip-speed", action="store_true")
    opts = p.parse_args(argv)
    from hsched.policies.base import NodesToScore

    try:
        nts = str(NodesToScore.parse(opts.nodes_to_score))
    except ValueError as exc:
        p.error(str(exc))
    if opts.places < 1 or opts.hold < 1 or opts.seeds < 0 or opts.gpu_tasks < 1:
        p.error("--places, --hold and --gpu-tasks must be >= 1, --seeds >= 0")
    if not 0.0 <= opts.fill < 1.0:
        p.error(f"--fill must be in [0, 1), got {opts.fill}")
    only = set(filter(None, opts.policies.split(",")))
    if unknown := only - {*CPU_POLICIES, *GPU_POLICIES, *FLOOR_POLICIES}:
        p.error(f"--policies: {', '.join(sorted(unknown))} unknown; known: "
                f"{', '.join(dict.fromkeys(CPU_POLICIES + GPU_POLICIES + FLOOR_POLICIES))}")
    import torch

    torch.set_num_threads(1)
    from hsched.threads import openblas_threads

    print(f"nodes to score: {nts}; OpenBLAS threads {openblas_threads()}, torch threads {torch.get_num_threads()}; "
          f"guard on (in-process zonal room model); {opts.places} Places per row"
          + (f"; rooms filled to {opts.fill:.0%} first" if opts.fill else ""))
    if not opts.skip_speed:
        print(f"{'room':<5}{'nodes':>7}  {'policy':<12}{'µs CPU/Place':>13}{'Places/s/core':>14}"
              f"{'p50 cpu ms':>11}{'p99 cpu ms':>11}{'p99 wall ms':>12}  placed/calls  served as")
        for kind, sizes, policies in (("cpu", opts.cpu_sizes, CPU_POLICIES + FLOOR_POLICIES),
                                      ("gpu", opts.gpu_sizes, GPU_POLICIES + FLOOR_POLICIES)):
            for size in (int(s) for s in sizes.split(",") if s):
                for name in policies:
                    if (only and name not in only) or (name in FLOOR_POLICIES and name not in only):
                        continue
                    r = asyncio.run(speed(kind, size, name, nts, opts))
                    print(f"{kind:<5}{r['n']:>7}  {name:<12}{r['us']:>13.0f}{r['per_s']:>14.0f}{r['p50_cpu_ms']:>11.2f}"
                          f"{r['p99_cpu_ms']:>11.2f}{r['p99_wall_ms']:>12.2f}  {r['placed']}/{r['calls']}  "
                          f"{r['served']}", flush=True)
    if not opts.skip_quality and opts.seeds:
        seeds = range(opts.seeds)
        print(f"\nquality, nodes to score {nts} vs all feasible nodes, mean over seeds {list(seeds)} "
              "((bounded − full) / full, %; placed/deployed: mean ± s.e. over the seeds):")
        print(f"{'eval':<18}{'policy':<13}{'placed/deployed':>16}{'overloads':>11}{'PUE':>9}   full: placed / "
              "overloads / PUE")
        cpu = [n for n in CPU_POLICIES if not only or n in only]
        gpu = [n for n in GPU_POLICIES if not only or n in only]
        t0 = time.perf_counter()
        for row in [*quality_thermal(cpu, nts, seeds), *quality_gpu(gpu, nts, seeds, opts.gpu_tasks)]:
            overloads, pue = ("-", "-") if row[3] is None else (f"{row[3]:+.2f}", f"{row[4]:+.3f}")
            print(f"{row[0]:<18}{row[1]:<13}{_mean_se(row[2]):>16}{overloads:>11}{pue:>9}   {row[5]}", flush=True)
        print(f"(quality part: {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
