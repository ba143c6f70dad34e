"""Choose the EADE-DDPG expert's host weights (hsched.rl.ddpg.ScoreGreedyExpert) on validation seeds, never on the
held-out evaluation seeds.

    python bench/expert_weights.py            # ~3 min on one core

The expert scores a host by its cluster's eq.16 Score + w · (Utilization fit − s · gpu_stranding + t ·
card_tightness). Grid over (w, s, t) on validation seeds 40 000-40 049 (the seeds every EADE-DDPG setting is
chosen on), then the five best re-run on a second validation set, 41 000-41 049, so the choice is checked on
episodes it was not picked on. Prints, per setting, the tasks the expert deploys alone and its paired
difference to the Utilization heuristic (mean ± standard error; seeds better / equal / worse). The expert alone
is only the teacher: what ships is the actor trained on its demonstrations (`bench/eade_variant.py`).
"""

from __future__ import annotations

import itertools

import numpy as np

from hsched.envs.gpu import run_policy
from hsched.policies.heuristics import Utilization
from hsched.rl.ddpg import VALIDATION_SEEDS, Config, ScoreGreedyExpert, make_env, paired_difference

SECOND_VALIDATION_SEEDS = range(41_000, 41_050)
GRID = {"fit": (4.0, 8.0, 16.0), "stranding": (0.0, 0.5, 1.0, 2.0), "tightness": (0.0, 0.1, 0.3)}


def table(env, weights: list[tuple[float, float, float]], seeds: range, title: str) -> dict[tuple, float]:
    """Print one row per expert setting (plus the paper's expert); return setting → mean gain on Utilization."""
    def deployed(policy) -> np.ndarray:
        return np.array([run_policy(env, policy, seed=s).metrics["deployed"] for s in seeds], dtype=float)

    base = deployed(Utilization())
    print(f"\n{title} ({seeds.start}-{seeds.stop - 1}): Utilization deploys {base.mean():.2f}\n")
    print("| expert (w, s, t) | deployed | vs Utilization | better/equal/worse |\n|---|---:|---:|---:|")
    gains = {}
    for w in [None, *weights]:
        mine = deployed(ScoreGreedyExpert(env.view) if w is None else ScoreGreedyExpert(env.view, *w))
        d = paired_difference(mine, base, more_is_better=True)
        b, e, x = d["better/equal/worse"]
        label = "paper 000's (cluster Score only)" if w is None else "({:g}, {:g}, {:g})".format(*w)
        print(f"| {label} | {mine.mean():.2f} | {d['diff']:+.2f} ± {d['se']:.2f} | {b}/{e}/{x} |", flush=True)
        if w is not None:
            gains[w] = d["diff"]
    return gains


def main() -> None:
    env = make_env(Config())
    gains = table(env, list(itertools.product(*GRID.values())), VALIDATION_SEEDS, "validation seeds")
    best = sorted(gains, key=gains.__getitem__, reverse=True)[:5]
    table(env, best, SECOND_VALIDATION_SEEDS, "the five best on the second validation seeds")


if __name__ == "__main__":
    main()
