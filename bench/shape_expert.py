"""Choose the shape-aware expert's weights for EADE-DDPG on randomised fleets (issue 17), on training-distribution
shapes and validation seeds only — never on the held-out shapes of data/gpu_fleet_shapes.json or their seeds.

    python bench/shape_expert.py            # ~10 min on one core

Shapes: `random_shape(s)` for s in VALIDATION_SHAPES (disjoint from the training shapes' seeds); episodes: seeds
40 000+. Per expert setting (fit w, stranding s, tightness t, FGD g, cluster-Score weight c): tasks deployed
summed over shapes, and the paired difference to the best of Utilization / FGD / BestFit per (shape, seed)
and to each of them.
"""

from __future__ import annotations

import itertools
import sys

import numpy as np
import torch

from hsched.envs.gpu import run_policy
from hsched.envs.shapes import load_shapes, random_shape, shape_env
from hsched.eval import gpu
from hsched.rl.ddpg import ScoreGreedyExpert

VALIDATION_SHAPES = range(90_000, 90_006)
SEEDS = range(40_000, 40_006)
GRID = {"fit": (8.0,), "stranding": (1.0,), "tightness": (0.1, 1.0), "fgd": (0.0, 2.0, 8.0), "cluster": (1.0, 0.1)}


def main() -> None:
    torch.set_num_threads(1)
    held = list(load_shapes().values())
    settings = list(itertools.product(*GRID.values()))
    if len(sys.argv) > 1:  # explicit settings "w,s,t,g,c" …
        settings = [tuple(float(x) for x in a.split(",")) for a in sys.argv[1:]]
    results: dict[str, list[float]] = {}
    for k in VALIDATION_SHAPES:
        env = shape_env(random_shape(k, held), seed=k)
        for name in ("utilization", "fgd", "bestfit"):
            results.setdefault(name, []).extend(
                run_policy(env, gpu.policy_for(name, env, s), seed=s).metrics["deployed"] for s in SEEDS)
        for w in settings:
            pol = ScoreGreedyExpert(env.view, *w, distribution=env.distribution)
            results.setdefault(str(w), []).extend(run_policy(env, pol, seed=s).metrics["deployed"] for s in SEEDS)
        print(f"shape {k}: {env.view.hosts} hosts, {env.n_tasks} tasks", flush=True)
    base = {n: np.array(results[n]) for n in ("utilization", "fgd", "bestfit")}
    best = np.max(np.stack(list(base.values())), axis=0)
    print("\n| expert (w, s, t, g, c) | deployed | vs best baseline | vs Utilization | vs FGD | vs BestFit |\n"
          "|---|---:|---:|---:|---:|---:|")
    for label, v in results.items():
        v = np.array(v)
        print(f"| {label} | {v.mean():.2f} | {np.mean(v - best):+.2f} | " +
              " | ".join(f"{np.mean(v - base[n]):+.2f}" for n in base) + " |", flush=True)


if __name__ == "__main__":
    main()
