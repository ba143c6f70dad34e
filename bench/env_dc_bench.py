"""Steps/s of hsched.envs.dc.DcPlacementEnv with the thermal surrogate in the loop, on one core.

    python bench/env_dc_bench.py [--steps 5000] [--repeat 3] [--scales 1,10] [--warmup-jobs 2000]

Rooms: the paper's (default fleet "chicago", 16 racks × 42 1U servers = 672) and the same room scaled to
`scale` × 16 racks (10× = 160 racks × 42 = 6 720 servers, D 6 720² built from the geometry: ~10 s, ~1 GiB).
Jobs: LLNL Thunder, `--warmup-jobs` placed by round robin at the first reset (not timed), then the "train"
phase (jobs 2000-4999 → ~13 000 subtasks; an episode that ends is reset, inside the timing).

Runners (each timed over `--steps` steps after 200 untimed ones; median of `--repeat` runs):
- random: a uniformly random feasible server from info["action_mask"] (action 0 only when none fits);
- greedy: `env.policy_action(Greedy)`, i.e. the placer's `plan()` → `select()` code, then `env.step`.

Columns: wall-clock and CPU-time (process_time) rates — the machine is shared, so the CPU-time rate is the
one to compare; the env.step share of the CPU time; the slow-down against paper scale next to the linear
expectation (scale×). Target: ≥ 5 000 steps/s (CPU time) at paper scale with random masked actions.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import dataclasses
import os
import statistics
import time

import gymnasium as gym
import numpy as np

from hsched.domain.fleet import DataCenter, RoomLayout, load_fleet
from hsched.envs.dc import DEFAULT_DC, ENV_ID, PAPER_SPLIT
from hsched.policies.heuristics import make_policy

TARGET_STEPS_S = 5000
UNTIMED_STEPS = 200


def scaled_room(scale: int) -> DataCenter:
    """The default CPU room with scale × its racks (same rack height, same rows)."""
    dc = load_fleet().datacenter(DEFAULT_DC)
    if scale == 1:
        return dc
    pool = dc.pools[0]
    layout = RoomLayout(dc.layout.racks * scale, dc.layout.servers_per_rack, dc.layout.rows)
    return dataclasses.replace(
        dc, layout=layout, pools=(dataclasses.replace(pool, count=pool.count * scale),)
    )


def measure(env: gym.Env, runner: str, steps: int, seed: int) -> dict[str, float]:
    base = env.unwrapped
    rng = np.random.default_rng(seed)
    greedy = make_policy("greedy")
    _, info = env.reset(seed=seed)
    in_step = 0.0
    cpu0 = wall0 = 0.0
    for i in range(UNTIMED_STEPS + steps):
        if i == UNTIMED_STEPS:
            in_step, cpu0, wall0 = 0.0, time.process_time(), time.perf_counter()
        if runner == "random":
            feasible = np.flatnonzero(info["action_mask"][1:])
            action = int(feasible[rng.integers(len(feasible))]) + 1 if len(feasible) else 0
        else:
            action = base.policy_action(greedy)
        t = time.process_time()
        _, _, terminated, truncated, info = env.step(action)
        in_step += time.process_time() - t
        if terminated or truncated:
            _, info = env.reset()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return {"wall": steps / wall, "cpu": steps / cpu, "us": cpu / steps * 1e6, "share": in_step / cpu}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--scales", default="1,10")
    ap.add_argument("--warmup-jobs", type=int, default=PAPER_SPLIT[0])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    scales = [int(s) for s in args.scales.split(",")]

    rows, base_us = [], {}
    load_before = os.getloadavg()[0]
    for scale in scales:
        t0 = time.perf_counter()
        env = gym.make(
            ENV_ID, dc=scaled_room(scale), phase="train", split=(args.warmup_jobs, PAPER_SPLIT[1], 0)
        )
        env.reset(seed=args.seed)  # builds the warm-up state (cached for the later resets)
        n = env.unwrapped.n
        print(f"scale {scale}: {n} servers, room + warm-up {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        for runner in ("random", "greedy"):
            runs = []
            for r in range(args.repeat):
                runs.append(measure(env, runner, args.steps, args.seed + r))
                print(f"  {runner} run {r + 1}: {runs[-1]['cpu']:.0f} steps/s CPU", file=sys.stderr)
            med = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
            base_us.setdefault(runner, med["us"])
            slow = med["us"] / base_us[runner]
            rows.append((f"{scale}×", n, runner, med, slow, scale))
        env.close()
    load_after = os.getloadavg()[0]

    print(
        "| scale | servers | runner | wall steps/s | CPU steps/s | µs/step (CPU) | in env.step | "
        "slow-down vs 1× | linear | slow-down / linear |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for scale, n, runner, med, slow, s in rows:
        print(
            f"| {scale} | {n} | {runner} | {med['wall']:,.0f} | {med['cpu']:,.0f} | {med['us']:.0f} | "
            f"{med['share']:.0%} | {slow:.2f}× | {s}× | {slow / s:.2f} |"
        )
    print()
    print(
        f"{args.steps} timed steps per run, median of {args.repeat}; 1-min load average {load_before:.1f} before, "
        f"{load_after:.1f} after (2 cores; other processes share them, hence the CPU-time rates)."
    )
    paper = next((r for r in rows if r[0] == "1×" and r[2] == "random"), None)
    if paper is not None:
        ok = paper[3]["cpu"] >= TARGET_STEPS_S
        print(
            f"Target ≥ {TARGET_STEPS_S} steps/s at paper scale, random masked actions: "
            f"{'PASS' if ok else 'FAIL'} ({paper[3]['cpu']:,.0f} CPU steps/s)"
        )
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
