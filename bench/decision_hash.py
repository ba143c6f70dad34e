"""A hash of every decision of `bench/placer_scale.py`'s speed run, to show that a change to a hot path leaves
the decisions as they were: the outcome, the parts (nodes, cards) and the alternatives with their scores of
each `plan()` call, in order, over `--places` Places (a real engine, guard on, a Redis ledger under a unique
prefix). Run it on the version before and after a change; the digests must be equal.

    python bench/decision_hash.py --room gpu --nodes 5000 --policy eade-ddpg [--places 900]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
import types
from pathlib import Path

if not __package__:  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench.placer_scale as scale  # sets the BLAS threads to 1 before numpy loads


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--room", choices=("cpu", "gpu"), required=True)
    p.add_argument("--nodes", type=int, required=True, help="room size, as placer_scale's sizes")
    p.add_argument("--policy", required=True)
    p.add_argument("--places", type=int, default=900)
    p.add_argument("--nodes-to-score", default="256")
    opts = p.parse_args(argv)
    if opts.places < 1 or opts.nodes < 1:
        p.error("--places and --nodes must be >= 1")
    import torch

    import hsched.engine.placer as placer_mod

    torch.set_num_threads(1)
    digest, calls = hashlib.sha256(), 0
    real_plan = placer_mod.plan

    def hashed_plan(*a, **k):
        nonlocal calls
        decision = real_plan(*a, **k)
        digest.update(repr((decision.outcome, decision.parts, decision.alternatives)).encode())
        calls += 1
        return decision

    placer_mod.plan = hashed_plan  # speed() wraps whatever placer_mod.plan is when it starts
    try:
        r = asyncio.run(scale.speed(opts.room, opts.nodes, opts.policy, opts.nodes_to_score,
                                    types.SimpleNamespace(places=opts.places, hold=300, fill=0.0)))
    finally:
        placer_mod.plan = real_plan
    print(f"{opts.policy} {opts.room} {r['n']} nodes: {calls} decisions, {r['placed']} placed, "
          f"sha256 {digest.hexdigest()[:16]}")


if __name__ == "__main__":
    main()
