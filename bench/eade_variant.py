"""Train one EADE-DDPG variant (the shipped seed and budget, some hyper-parameters changed) and compare it with
the Utilization heuristic on the validation seeds (never the held-out evaluation seeds).

    python bench/eade_variant.py deploy_bonus=30            # any field of hsched.rl.ddpg.Config
    python bench/eade_variant.py --out /tmp/eade expert_fit_weight=6 bc_weight=0.5

Prints a markdown row for the trained actor and one for its target actor (the Polyak average of its weights):
tasks deployed on validation seeds 40 000-40 049, the paired difference to Utilization (mean ± standard
error; seeds better / equal / worse) and the training time. The model and its
metadata (with the held-out paired comparison that `hsched train` writes) go to --out. ~15-20 min on one
core; two variants can run side by side on this 2-core machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch

from hsched.rl import checkpoint, ddpg
from hsched.rl.training import TrainArgs


def parse_overrides(items: list[str]) -> dict:
    types = {f.name: f.type for f in dataclasses.fields(ddpg.Config)}
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in types:
            raise SystemExit(f"{item!r}: expected field=value with a field of hsched.rl.ddpg.Config "
                             f"({', '.join(types)})")
        out[key] = int(value) if types[key] in ("int", int) else float(value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("overrides", nargs="+", help="field=value of hsched.rl.ddpg.Config")
    ap.add_argument("--out", default="runs/eade-variants", help="directory for the variant's model")
    opts = ap.parse_args()
    overrides = parse_overrides(opts.overrides)
    cfg = dataclasses.replace(ddpg.Config(), **overrides)
    name = "_".join(f"{k}{v:g}" for k, v in overrides.items())
    out = Path(opts.out) / f"eade_{name}.pt"
    t0 = time.perf_counter()
    result = ddpg.train(cfg, TrainArgs(out=out, progress=True), "eade-ddpg", "eade_ddpg_gpu")
    actor, _ = ddpg.load_actor(out)
    # Also the target actor (the Polyak average of the actor's weights, eq.25): an average of recent policies
    # sometimes serves better than the last one.
    polyak = ddpg.Actor(cfg.embed, cfg.heads)
    state = checkpoint.load_state(ddpg.training_path(out))
    polyak.load_state_dict(state["actor_target"])
    rows = []
    for label, served in (("actor", actor), ("target actor", polyak)):
        paired = ddpg.paired_comparison(lambda view, a=served: ddpg.ActorPolicy(a, "eade-ddpg", view), cfg,
                                        seeds=ddpg.VALIDATION_SEEDS)
        rows.append((label, paired["mean"]["deployed"], paired["vs"]["Utilization"]["deployed"]))
    print("\n| variant | served | deployed (validation) | vs Utilization | better/equal/worse | train s (wall) "
          "| total s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for label, deployed, vs in rows:
        b, e, w = vs["better/equal/worse"]
        print(f"| {' '.join(opts.overrides)} | {label} | {deployed:.2f} | {vs['diff']:+.2f} ± {vs['se']:.2f} "
              f"| {b}/{e}/{w} | {result['train_seconds']:.0f} | {time.perf_counter() - t0:.0f} |")
    print(f"\nthe actor's critic term at the end, mean |Q(s, softmax π(s))| over {Q_ROWS} online rows: "
          f"{critic_scale(state, cfg):.1f} (the actor loss divides by it; the BC term is a cross-entropy)")


Q_ROWS = 1024


def critic_scale(state: dict, cfg: ddpg.Config) -> float:
    """Mean |Q| of the trained critic at the actor's action (`ddpg.policy_q`) over rows of the online pool (its
    newest, until it wraps)."""
    env = ddpg.make_env(cfg)
    codec = ddpg.Codec(env.view.hosts, env.view.host_cluster)
    actor, critic = ddpg.Actor(cfg.embed, cfg.heads), ddpg.Critic(cfg.embed, cfg.heads)
    actor.load_state_dict(state["actor"])
    critic.load_state_dict(state["critic"])
    online = state["online"]
    rows = torch.from_numpy(online["obs"][max(0, online["size"] - Q_ROWS):online["size"]])
    items, task, mask = codec.decode(rows)
    with torch.no_grad():
        return float(ddpg.policy_q(actor(items, task), critic(items, task), mask).abs().mean())

if __name__ == "__main__":
    main()
