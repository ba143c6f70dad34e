"""Choose eq.12's constants for the Double DQN on the VALIDATION slice: `python bench/ddqn_reward_selection.py`.

    python bench/ddqn_reward_selection.py [--steps 16000] [--seeds 0 1] [--out models/double_dqn_dc_selection.json]
                                          [--candidates NAME ...] [--no-progress]

For each candidate of `hsched.rl.ddqn.REWARD_CANDIDATES` (φ_T and the two penalties) and each seed it trains
a Double DQN for `--steps` env steps (a reduced budget: the shipped model trains 24 000) on the Thunder
train jobs without the validation slice (jobs 2000-4499), then plays the validation slice (jobs 4500-4999,
right after the warm-up, as an evaluation episode) with it, RR and Greedy in both CRAC modes
(`hsched.rl.ddqn.select_reward`). The held-out evaluation jobs (5000 onwards) are never read. It prints the
validation figures per candidate (mean over the seeds), the rule and the chosen constants, and writes the
record to `--out`; `hsched train double-dqn` quotes it in the model's metadata when its reward is the chosen
one (set `hsched.rl.ddqn.TRAIN_REWARD` to it). Not timed: CPU seconds are printed because the machine is shared.
Takes about 8 × 1-2 minutes with the defaults on a quiet core.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    from hsched.rl.ddqn import REWARD_CANDIDATES, SELECTION_FILE, select_reward
    from hsched.rl.training import seed_everything

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=16_000, help="env steps per candidate and seed")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--candidates", nargs="+", choices=list(REWARD_CANDIDATES), help="default: all")
    ap.add_argument("--out", default=str(ROOT / "models" / SELECTION_FILE))
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    seed_everything(0)  # one torch thread, as training and serving run
    candidates = {k: REWARD_CANDIDATES[k] for k in (args.candidates or REWARD_CANDIDATES)}
    t0, c0 = time.perf_counter(), time.process_time()
    record = select_reward(candidates, args.steps, tuple(args.seeds), show=not args.no_progress,
                           log=lambda line: print(line, file=sys.stderr, flush=True))
    record["wall_seconds"] = round(time.perf_counter() - t0, 1)
    record["cpu_seconds"] = round(time.process_time() - c0, 1)
    Path(args.out).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")

    print(f"## Double DQN reward selection on the validation slice (jobs {record['validation_jobs'][0]}-"
          f"{record['validation_jobs'][1] - 1}; trained on jobs {record['train_jobs'][0]}-"
          f"{record['train_jobs'][1] - 1}, {args.steps} steps, seeds {args.seeds}, mean over seeds)\n")
    print("| candidate | redline PUE Δ vs RR % | vs Greedy % | overloads Δ vs RR % | vs Greedy % "
          "| fixed outlet Δ vs RR °C | vs Greedy °C | train s wall / CPU |")
    print("|---|---|---|---|---|---|---|---|")
    for c in record["candidates"]:
        red, fix = c["validation"]["redline"]["deltas"], c["validation"]["fixed"]["deltas"]
        wall = sum(r["train_seconds"] for r in c["runs"])
        cpu = sum(r["train_cpu_seconds"] for r in c["runs"])
        mark = " **(chosen)**" if c["name"] == record["chosen"] else ""
        print(f"| {c['name']}{mark} | {red['mean_pue vs RR %']:+.2f} | {red['mean_pue vs Greedy %']:+.2f} "
              f"| {fix['mean_overloads vs RR %']:+.1f} | {fix['mean_overloads vs Greedy %']:+.1f} "
              f"| {fix['mean_rack_outlet_c vs RR °C']:+.3f} | {fix['mean_rack_outlet_c vs Greedy °C']:+.3f} "
              f"| {wall:.0f} / {cpu:.0f} |")
    print(f"\nRule: {record['criterion']}.\nChosen: {record['chosen']} -> {json.dumps(record['chosen_reward'])}")
    print(f"Total {record['wall_seconds']:.0f} s wall, {record['cpu_seconds']:.0f} s CPU. Record: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
