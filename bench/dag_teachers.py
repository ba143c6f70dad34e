"""Could a better DAgger teacher, or more DAgger rounds, put the learned DAG schedulers below Tetris*? (issue 15)

1. `teachers`: Tetris* (`hsched.envs.dag.TetrisStar`) with two additions, on `hsched eval dag`'s settings (51-job
   episodes, 60 s mean interarrival) at 15 and 20 executors: a per-job parallelism limit (a job holds at most
   `limit` × N executors, Decima's lesson that spreading a stage wider draws slower waves) and executor locality
   (+`locality` to the score of stages whose job has free executors that served it, which pay no moving delay).
   `--eps-scale` also scales Tetris*'s own ε (its weight of shortness against packing). Printed per variant:
   mean average JCT ÷ Tetris*'s per count and the seeds where the variant is faster.
2. `clone`: BA3C cloned from a teacher with `--rounds` DAgger rounds (`hsched.rl.ba3c.Config.dagger_rounds`)
   and `--episodes` RL episodes (the trainer's validation after cloning and at the end picks the weights), then
   evaluated greedily with FIFO, SJF-CP, Tetris* and Tetris*+limit on `--seeds`: paired policy − Tetris*, mean ±
   s.e., seeds won. `evaluate` prints the same for trained models.
The residual experiment (BA3C's heads as a learned residual over Tetris*+limit) is commit bb46adf's `residual`
subcommand, reverted after it measured worse (docs/dag_scheduling.md).

    python bench/dag_teachers.py teachers [--seeds 60000:60020] [--limits none,0.3,0.4,0.5] [--locality 0,0.3]
                                          [--eps-scale 0.01,4]
    python bench/dag_teachers.py clone --rounds 3 [--teacher tetris|tetris-limited] [--episodes 8] [--seeds 0:20]
                                       [--out runs/ba3c-clone.pt]
    python bench/dag_teachers.py evaluate --model models/ba3c_dag.pt [--model …] [--seeds 0:20]

Seeds: validation seeds are 40 000-40 007 (`hsched.rl.ba3c.VALIDATION_SEEDS`), `hsched eval dag`'s are 0, 1, …;
pick a teacher on other seeds (60 000 up) before looking at the evaluation's.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import dataclasses

import numpy as np

from hsched.envs.dag import DagSchedulingEnv, Fifo, SjfCp, TetrisLimited, TetrisStar, run_dag_policy

COUNTS = (15, 20)


def seed_range(text: str) -> range:
    a, b = text.split(":")
    return range(int(a), int(b))


def jct(make, n: int, seeds) -> np.ndarray:
    env = DagSchedulingEnv(n, num_init_jobs=1, num_stream_jobs=50, interarrival_s=60.0)
    return np.array([run_dag_policy(env, make(), seed=s).metrics["avg_jct_s"] for s in seeds])


def teachers(args) -> None:
    seeds = seed_range(args.seeds)
    base = {n: jct(TetrisStar, n, seeds) for n in COUNTS}
    print(f"Tetris* mean average JCT: {', '.join(f'{base[n].mean():.2f} s at {n}' for n in COUNTS)}; seeds {args.seeds}")
    print("| limit × N | locality | ε × | " + " | ".join(f"÷ Tetris* at {n} (seeds faster)" for n in COUNTS) + " |")
    print("|---|---|---|" + "---|" * len(COUNTS))
    variants = [(None if v == "none" else float(v), float(loc), 1.0) for v in args.limits.split(",")
                for loc in args.locality.split(",")]
    variants += [(None, 0.0, float(e)) for e in args.eps_scale.split(",") if e]
    for limit, locality, eps in variants:
        cells = []
        for n in COUNTS:
            mine = jct(lambda v=(limit, locality, eps): TetrisLimited(*v), n, seeds)
            cells.append(f"{(mine / base[n]).mean():.4f} ({int((mine < base[n]).sum())}/{len(seeds)})")
        print(f"| {limit} | {locality} | {eps:g} | " + " | ".join(cells) + " |", flush=True)


def paired_against_tetris(learned: dict, seeds) -> None:
    """Per count: FIFO, SJF-CP, Tetris*+limit and each of `learned` (label → DagPolicy) minus Tetris*, paired."""
    for n in COUNTS:
        rows = {"FIFO": Fifo, "SJF-CP": SjfCp, "Tetris*+limit": TetrisLimited,
                **{label: (lambda p=p: p) for label, p in learned.items()}}
        base = jct(TetrisStar, n, seeds)
        for label, make in rows.items():
            d = jct(make, n, seeds) - base
            print(f"{n} executors, {label} − Tetris*: {d.mean():+.2f} ± {d.std(ddof=1) / np.sqrt(len(d)):.2f} s "
                  f"(faster on {int((d < 0).sum())}/{len(d)} seeds; Tetris* {base.mean():.2f} s)", flush=True)


def clone(args) -> None:
    from hsched.rl import ba3c
    from hsched.rl.training import TrainArgs

    cfg = dataclasses.replace(ba3c.Config(), expert=args.teacher, dagger_rounds=args.rounds, episodes=args.episodes)
    out = Path(args.out)
    figures = ba3c.train(cfg, TrainArgs(seed=0, steps=args.episodes, out=out, progress=False), "ba3c", "ba3c_dag",
                         branching=True)
    print({k: figures[k] for k in ("train_cpu_seconds", "selected_episode", "validation_jct_over_tetris_per_count")})
    paired_against_tetris({"clone": ba3c.load_dag_policy(out)}, seed_range(args.seeds))


def evaluate(args) -> None:
    from hsched.rl import ba3c
    from hsched.rl.checkpoint import serve_on_one_thread

    serve_on_one_thread()  # as the placer serves them; torch's default threads took a second core
    paired_against_tetris({Path(m).stem: ba3c.load_dag_policy(m) for m in args.model}, seed_range(args.seeds))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("teachers")
    t.add_argument("--seeds", default="60000:60020")
    t.add_argument("--limits", default="none,0.3,0.4,0.5", help="limit × N per job; 'none' for no limit")
    t.add_argument("--locality", default="0,0.3")
    t.add_argument("--eps-scale", default="0.01,4", help="Tetris*'s ε scaled by these (no limit, no locality)")
    c = sub.add_parser("clone")
    c.add_argument("--rounds", type=int, default=3)
    c.add_argument("--teacher", choices=("tetris", "tetris-limited"), default="tetris")
    c.add_argument("--episodes", type=int, default=8)
    c.add_argument("--seeds", default="0:20")
    c.add_argument("--out", default="runs/ba3c-clone.pt")
    e = sub.add_parser("evaluate")
    e.add_argument("--model", action="append", required=True, help="a ba3c / a3c checkpoint (repeatable)")
    e.add_argument("--seeds", default="0:20")
    args = p.parse_args()
    {"teachers": teachers, "clone": clone, "evaluate": evaluate}[args.what](args)


if __name__ == "__main__":
    main()
