"""GpuClusterEnv (`hsched/GpuCluster-v0`) steps/s at paper 000's scale and at 10×.

    python bench/env_gpu_bench.py [--steps 20000] [--repeats 3] [--no-pin]

Points (each: median of `--repeats` runs of `--steps` steps, on one pinned core unless --no-pin):

- paper scale: 16 clusters × 4 hosts (64 hosts), 220 openb tasks per episode;
- 10× hosts: the same 16 clusters with every node pool × 10 (640 hosts), 2 200 tasks;
- 10× clusters: 160 clusters × 4 hosts (640 hosts, openb 2-GPU machines drawn with replacement), 2 200 tasks;
- default fleet: the default fleet's 3 GPU DCs (340 hosts, 1 316 GPUs), 2 200 tasks.

Modes: "raw" = the env object, the agent picks a uniformly random allowed action from info["action_mask"]
(so the episode has the real mix of placements and delays); "make" = through `gymnasium.make` (its
wrappers: order enforcing, passive checker); "make_vec ×8" = `gymnasium.make_vec(..., num_envs=8, "sync")`,
steps counted per sub-env (8 per call). Resets (a new task sample every episode) are included.
Also "run_policy bestfit": decisions/s of `run_policy` (the placer's mask + select + BestFit scores).
Rates are per CPU second of this process (time.process_time; `--wall` for wall-clock): the 2-core machines
are shared, and CPU time per step is what stays comparable while other jobs run.
Prints a markdown table; progress on stderr.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import os
import statistics
import time

import gymnasium
import numpy as np

from hsched.envs.gpu import ENV_ID, GpuClusterEnv, paper000_datacenters, run_policy, scaled_datacenters
from hsched.policies.heuristics import make_policy

CLOCK = time.process_time  # set by --wall: the machines are shared, CPU time per step is the stable figure


def points() -> list[tuple[str, object, int]]:
    base = paper000_datacenters()
    return [("paper scale (16×4 = 64 hosts)", base, 220),
            ("10× hosts (16×40 = 640 hosts)", scaled_datacenters(base, 10), 2200),
            ("10× clusters (160×4 = 640 hosts)", paper000_datacenters(160, 4, replace=True), 2200),
            ("default fleet (3 DCs, 340 hosts)", "default", 2200)]


def raw_steps(env: gymnasium.Env, steps: int, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    _, info = env.reset(seed=seed)
    t0 = CLOCK()
    for _ in range(steps):
        allowed = np.flatnonzero(info["action_mask"])
        _, _, terminated, truncated, info = env.step(int(allowed[rng.integers(len(allowed))]))
        if terminated or truncated:
            _, info = env.reset()
    return steps / (CLOCK() - t0)


def vec_steps(dcs: object, n_tasks: int, steps: int, num_envs: int = 8, seed: int = 0) -> float:
    venv = gymnasium.make_vec(ENV_ID, num_envs=num_envs, vectorization_mode="sync",
                              datacenters=dcs, n_tasks=n_tasks)
    rng = np.random.default_rng(seed)
    _, info = venv.reset(seed=seed)
    calls = max(1, steps // num_envs)
    t0 = CLOCK()
    for _ in range(calls):
        # a sub-env that just ended has an all-zero mask; its next step is the autoreset (action ignored)
        actions = [int(a[rng.integers(len(a))]) if len(a := np.flatnonzero(m)) else 0
                   for m in info["action_mask"]]
        _, _, _, _, info = venv.step(actions)
    rate = calls * num_envs / (CLOCK() - t0)
    venv.close()
    return rate


def policy_steps(env: GpuClusterEnv, episodes: int = 3) -> float:
    steps, t0 = 0, CLOCK()
    for seed in range(episodes):
        steps += run_policy(env, make_policy("bestfit"), seed=seed).steps
    return steps / (CLOCK() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-pin", action="store_true", help="do not pin the process to one core")
    ap.add_argument("--wall", action="store_true",
                    help="rates per wall-clock second instead of per CPU second")
    args = ap.parse_args()
    global CLOCK
    if args.wall:
        CLOCK = time.perf_counter
    if not args.no_pin and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    rows = []
    base_rate = None
    for label, dcs, n_tasks in points():
        print(f"{label} …", file=sys.stderr, flush=True)
        env = GpuClusterEnv(dcs, n_tasks=n_tasks)
        wrapped = gymnasium.make(ENV_ID, datacenters=dcs, n_tasks=n_tasks)
        raw = statistics.median(raw_steps(env, args.steps, seed=i) for i in range(args.repeats))
        made = statistics.median(raw_steps(wrapped, args.steps, seed=i) for i in range(args.repeats))
        vec = statistics.median(vec_steps(dcs, n_tasks, args.steps, seed=i) for i in range(args.repeats))
        pol = statistics.median(policy_steps(env) for _ in range(args.repeats))
        base_rate = base_rate or raw
        rows.append((label, env.view.hosts, len(env.clusters), raw, made, vec, pol, base_rate / raw))
    print("| point | hosts | clusters | raw steps/s | make steps/s | make_vec ×8 steps/s | "
          "run_policy bestfit decisions/s | raw time per step vs paper scale |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for label, hosts, clusters, raw, made, vec, pol, ratio in rows:
        print(f"| {label} | {hosts} | {clusters} | {raw:,.0f} | {made:,.0f} | {vec:,.0f} | {pol:,.0f} "
              f"| {ratio:.2f}× |")


if __name__ == "__main__":
    main()
