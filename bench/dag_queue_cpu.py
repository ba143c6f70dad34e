"""CPU cost of the placer's --dag-policy (hsched.policies.dagqueue), two ways:

1. one decision, in isolation: `choose_stage` over a band of `--stages` queued stages of `--jobs` DAG jobs
   (observation built from the band, the policy's `choose`), CPU ms of this process per decision, for sjf-cp, tetris and
   ba3c (the shipped models/ba3c_dag.pt, torch on one thread as the placer serves it);
2. in the engine (real Redis ledger, no gRPC): a data center of the small fleet is held by online tasks, `--queued`
   offline DAG tasks (of `--jobs` jobs, random stages, paths and sizes) wait; releasing one node drains the
   queue. CPU ms of the release (the drain's plans, the policy's picks and the append), per --dag-policy,
   median over `--rounds`.

    python bench/dag_queue_cpu.py [--jobs 8] [--stages 24] [--queued 64] [--rounds 5]

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
import random
import secrets
import statistics
import time

ROOT = Path(__file__).resolve().parents[1]


def one_decision(opts) -> None:
    from hsched.policies.dagqueue import QueuedStage, choose_stage, load_dag_queue_policy

    rng = random.Random(opts.seed)

    def queued(k: int) -> QueuedStage:
        """Stage k of a random band: 70 % fit now, with 1-16 of its tasks room for."""
        job, queued, runtime = f"j{rng.randrange(opts.jobs)}", rng.randint(1, 16), rng.uniform(1, 60)
        path, work, waited, fits = rng.uniform(5, 600), rng.uniform(10, 5000), rng.uniform(0, 100), rng.random() < 0.7
        return QueuedStage(job, f"s{k}", queued, runtime, path, work, k, waited, fits, rng.randint(1, 16) if fits else 0)

    bands = [[queued(k) for k in range(opts.stages)] for _ in range(opts.decisions)]
    for name in ("sjf-cp", "tetris", "ba3c"):
        policy = load_dag_queue_policy(name)
        choose_stage(policy, bands[0], {}, 0)  # warm-up (first torch call)
        per = []
        for stages in bands:
            t0 = time.process_time()
            choose_stage(policy, stages, {}, 8)
            per.append((time.process_time() - t0) * 1000)
        per.sort()
        print(f"decision  {name:7s} band of {opts.stages} stages / {opts.jobs} jobs: CPU ms p50 "
              f"{statistics.median(per):.3f}  p95 {per[int(0.95 * (len(per) - 1))]:.3f}  max {per[-1]:.3f}")


async def drain(opts) -> None:
    import yaml

    from bench.stack_bench import delete_prefix
    from hsched.domain.fleet import parse_fleet
    from hsched.domain.resources import MILLI, Resources
    from hsched.domain.task import TaskSpec
    from hsched.engine.placer import PlacerEngine
    from hsched.policies.dagqueue import load_dag_queue_policy
    from hsched.policies.heuristics import make_policy
    from hsched.state.keys import Keys
    from hsched.state.redis import connect

    dc = parse_fleet(yaml.safe_load((ROOT / "tests/fleets/small.yaml").read_text())).datacenter("cheap")
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    redis = connect(redis_url)
    prefix = f"bench-dagq-{secrets.token_hex(3)}"
    try:
        for name in ("fifo", "sjf-cp", "tetris", "ba3c"):
            per, placed = [], []
            for r in range(opts.rounds):
                rng = random.Random(opts.seed + r)
                e = PlacerEngine(dc, redis, Keys(f"{prefix}:{name}:{r}"), make_policy("firstfit"), "bench",
                                 dag_policy=load_dag_queue_policy(name))
                await e.start()
                try:
                    for i in range(4):  # cheap: 4 nodes of 24 cores, all held by online tasks
                        await e.place(f"x{i}", TaskSpec(Resources(24 * MILLI, 2048), 10.0, tenant="team-x",
                                                        priority_class="online"))
                    for i in range(opts.queued):
                        j, s = rng.randrange(opts.jobs), rng.randrange(6)
                        path = rng.uniform(5, 600)
                        await e.place(f"j{j}.s{s}.{i}", TaskSpec(
                            Resources(rng.choice([1, 2, 4, 8]) * MILLI, 2048), rng.uniform(1, 60), tenant="team-a",
                            job_id=f"j{j}", stage=f"s{s}", stage_path_s=path, job_work_s=path * rng.uniform(1, 5)))
                    t0 = time.process_time()
                    result = await e.release("x0")
                    per.append((time.process_time() - t0) * 1000)
                    placed.append(len(result.placed_from_queue))
                finally:
                    await e.stop()
            print(f"drain     {name:7s} {opts.queued} queued DAG tasks, one 24-core node freed: CPU ms median "
                  f"{statistics.median(per):.2f} (min {min(per):.2f}, max {max(per):.2f}), placed "
                  f"{statistics.median(placed):.0f} per drain")
    finally:
        await redis.aclose()
        delete_prefix(redis_url, prefix)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--stages", type=int, default=24, help="stages per band (decision bench; the placer caps 32)")
    p.add_argument("--decisions", type=int, default=300)
    p.add_argument("--queued", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    opts = p.parse_args()
    one_decision(opts)
    asyncio.run(drain(opts))


if __name__ == "__main__":
    main()
