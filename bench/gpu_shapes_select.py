"""How much a per-fleet choice of heuristic would gain on the held-out shapes (issue 17 item 3, a next step for the
expert): for each shape, pick among Utilization, FGD, BestFit and the shapes expert the one deploying most on
calibration episodes (seeds 60 000-60 004: the workload's distribution, never the evaluation seeds), then report
its paired difference to each baseline on the evaluation seeds 0-19 (rows from bench/gpu_shapes.py's --cache).

    python bench/gpu_shapes.py ... --cache runs/shapes_cache.json && python bench/gpu_shapes_select.py runs/shapes_cache.json
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch

from hsched.envs.gpu import run_policy
from hsched.envs.shapes import load_shapes, shape_env
from hsched.eval import gpu
from hsched.rl.ddpg import ScoreGreedyExpert, paired_difference

CALIBRATION = range(60_000, 60_005)
EXPERT = "8,0,1,0,0.1"


def main() -> None:
    torch.set_num_threads(1)
    cache = json.loads(open(sys.argv[1]).read())
    print("| shape | chosen on calibration seeds | Δ vs Utilization | Δ vs FGD | Δ vs BestFit |\n|---|---|---:|---:|---:|")
    for name, shape in load_shapes().items():
        env = shape_env(shape)
        makers = {"Utilization": lambda s, env=env: gpu.policy_for("utilization", env, s),
                  "FGD": lambda s, env=env: gpu.policy_for("fgd", env, s), "BestFit": lambda s, env=env: gpu.policy_for("bestfit", env, s),
                  f"expert {EXPERT}": lambda s, env=env: ScoreGreedyExpert(env.view, *map(float, EXPERT.split(",")),
                                                                 distribution=env.distribution)}
        calib = {label: np.mean([run_policy(env, make(s), seed=s).metrics["deployed"] for s in CALIBRATION])
                 for label, make in makers.items()}
        best = max(calib, key=calib.__getitem__)
        mine = np.array(cache[f"{name}|{best}|20"]["deployed"])
        cells = []
        for other in ("Utilization", "FGD", "BestFit"):
            d = paired_difference(mine, np.array(cache[f"{name}|{other}|20"]["deployed"]), True)
            cells.append(f"{d['diff']:+.2f} ± {d['se']:.2f} ({'/'.join(map(str, d['better/equal/worse']))})")
        print(f"| {name} | {best} ({', '.join(f'{k} {v:.1f}' for k, v in calib.items())}) | " + " | ".join(cells) + " |",
              flush=True)


if __name__ == "__main__":
    main()
