"""GPU placement on the held-out fleet shapes (data/gpu_fleet_shapes.json; issue 17 item 3): EADE-DDPG models
against Utilization, FGD and BestFit, paired over episode seeds, one table per shape.

    python bench/gpu_shapes.py                                 # the shipped models, seeds 0-19 (~10 min)
    python bench/gpu_shapes.py --model models/eade_ddpg_gpu_shapes.pt --seeds 20 --expert 8,1,0.1,0,1

Per shape: tasks deployed (mean ± s.e. over seeds), the paired difference of the model to each baseline (mean ±
s.e.; seeds better / equal / worse), eq.27 fragmentation and eq.28 GPU load variance (paired difference to
Utilization: lower is better). Every policy decides through `run_policy` (the placer's mask and select) on the
same tasks per seed; the held-out shapes were never trained on (random_shape redraws them) and no setting was
chosen on them. `--expert w,s,t,g,c` adds a ScoreGreedyExpert row (fit, stranding, tightness, FGD, cluster-Score
weights) — e.g. the teacher of a model, to show how much of its result is imitation.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from hsched.envs.gpu import run_policy
from hsched.envs.shapes import load_shapes, shape_env
from hsched.eval import gpu
from hsched.rl.ddpg import ActorPolicy, ScoreGreedyExpert, load_actor, paired_difference

BASELINES = (("utilization", "Utilization"), ("fgd", "FGD"), ("bestfit", "BestFit"))
KEYS = ("deployed", "fragmentation", "gpu_load_variance")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", type=Path,
                    help="a .pt actor (repeatable; default: the shipped EADE-DDPG models present)")
    ap.add_argument("--seeds", type=int, default=20, help="episode seeds 0..N-1 (default 20)")
    ap.add_argument("--shapes", type=Path, default=None, help="shapes file (default data/gpu_fleet_shapes.json)")
    ap.add_argument("--expert", action="append", default=[], help="w,s,t,g,c: also a ScoreGreedyExpert row")
    ap.add_argument("--cache", type=Path, default=None,
                    help="JSON of per-seed rows: rows found there (same shape, label, seeds) are reused, new "
                         "ones added (rerun a new model without rerunning the baselines)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from hsched.rl.checkpoint import model_path

    models = args.model or [p for p in (model_path("eade_ddpg_gpu"), model_path("eade_ddpg_gpu_shapes"))
                            if p.exists()]
    seeds = range(args.seeds)
    cache = json.loads(args.cache.read_text()) if args.cache and args.cache.exists() else {}
    print(f"held-out shapes, seeds 0..{args.seeds - 1}, the box shared with other jobs")
    summary: list[str] = []
    for name, shape in load_shapes(args.shapes).items():
        env = shape_env(shape)
        rows: dict[str, dict[str, np.ndarray]] = {}

        def run(label: str, make, env=env, name=name, rows=rows) -> None:  # called at once, in this iteration
            key = f"{name}|{label}|{args.seeds}"
            if key not in cache:
                ms = [run_policy(env, make(s), seed=s).metrics for s in seeds]
                cache[key] = {k: [m[k] for m in ms] for k in KEYS}
            rows[label] = {k: np.array(cache[key][k]) for k in KEYS}

        for key, label in BASELINES:
            run(label, lambda s, k=key, env=env: gpu.policy_for(k, env, s))
        for spec in args.expert:
            w = tuple(float(x) for x in spec.split(","))
            run(f"expert {spec}",
                lambda s, w=w, env=env: ScoreGreedyExpert(env.view, *w, distribution=env.distribution))
        learned = []
        for path in models:
            actor, state = load_actor(path)
            label = f"{state['policy']} ({Path(path).stem})"
            policy = ActorPolicy(actor, state["policy"], env.view)
            run(label, lambda s, p=policy: p)
            learned.append(label)
        if args.cache:
            args.cache.write_text(json.dumps(cache))
        print(f"\n### {name}: {shape.note} — {env.view.hosts} hosts, "
              f"{sum(d.capacity_total().gpu_count for d in env.view.datacenters)} GPUs, {env.n_tasks} tasks per seed\n")
        print("| policy | deployed ↑ | eq.27 frag ↓ | eq.28 GPU load var ↓ |\n|---|---:|---:|---:|")
        for label, r in rows.items():
            se = r["deployed"].std(ddof=1) / np.sqrt(len(seeds))
            print(f"| {label} | {r['deployed'].mean():.2f} ± {se:.2f} | {r['fragmentation'].mean():.4f} | "
                  f"{r['gpu_load_variance'].mean():.5f} |")
        for label in learned + [f"expert {s}" for s in args.expert]:
            print(f"\n{label}, paired (mine − theirs):\n\n| vs | Δ deployed | better/equal/worse | Δ eq.27 frag | "
                  "Δ eq.28 var |\n|---|---:|---:|---:|---:|")
            for _, other in BASELINES:
                d = [paired_difference(rows[label][k], rows[other][k], k == "deployed") for k in KEYS]
                b, e, w = d[0]["better/equal/worse"]
                print(f"| {other} | {d[0]['diff']:+.2f} ± {d[0]['se']:.2f} | {b}/{e}/{w} | "
                      f"{d[1]['diff']:+.4f} ± {d[1]['se']:.4f} | {d[2]['diff']:+.5f} ± {d[2]['se']:.5f} |", flush=True)
        summary.append(f"| {name} | Utilization / FGD / BestFit | " +
                       " / ".join(f"{rows[o]['deployed'].mean():.2f}" for _, o in BASELINES) + " | | | | | |")
        for label in learned + [f"expert {s}" for s in args.expert]:
            cells = []
            for _, other in BASELINES:
                d = paired_difference(rows[label]["deployed"], rows[other]["deployed"], True)
                cells.append(f"{d['diff']:+.2f} ± {d['se']:.2f} ({'/'.join(map(str, d['better/equal/worse']))})")
            fr, va = (paired_difference(rows[label][k], rows["Utilization"][k], False) for k in KEYS[1:])
            summary.append(f"| | {label} | {rows[label]['deployed'].mean():.2f} | " + " | ".join(cells) +
                           f" | {fr['diff']:+.4f} ± {fr['se']:.4f} | {va['diff']:+.5f} ± {va['se']:.5f} |")
    print("\n### summary (paired Δ mine − theirs, mean ± s.e. (better/equal/worse seeds); eq.27/28 vs "
          "Utilization, lower is better)\n\n| shape | policy | deployed | Δ vs Utilization | Δ vs FGD | Δ vs BestFit | "
          "Δ eq.27 | Δ eq.28 |\n|---|---|---:|---:|---:|---:|---:|---:|")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
