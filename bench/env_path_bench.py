"""Step throughput of the path environment (hsched.envs.path, paper 003 §2.1) at paper scale and beyond.

    python bench/env_path_bench.py [--steps 200000] [--repeats 3] [--cpu 0] [--seed 0]

Each point runs a random VALID policy (a uniform choice among the current vertex's neighbours, read from
`info["path"]`; ~0.3 µs of the step time) with resets included, on one core (the process is pinned with
`sched_setaffinity`), and reports the median of `--repeats` runs. Graphs:

- paper scale: the default fleet's WAN (Abilene + the scheduler vertex, 12 vertices);
- the two largest Topology Zoo WANs shipped in data/ (Chinanet 38, Geant2012 37 vertices, ~3×);
- 10× scale: ten copies of the default WAN (120 vertices) joined in a ring (copy k's New York – copy k+1's
  Seattle, 20 ms) with chords (copy k's Houston – copy k+3's Chicago, 15 ms); target = copy 0's scheduler.

Also: the raw env vs `gymnasium.make` (adds the passive checker and order-enforcing wrappers), and
`gymnasium.make_vec(..., num_envs=8, vectorization_mode="sync")` (env steps/s = 8 × batch steps/s).
Targets (issue): ≥ 20 000 steps/s at paper scale on one core; 10× scale no worse than linear slow-down.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import os
import random
import statistics
import time

import gymnasium
import numpy as np

from hsched.costs import WanGraph
from hsched.domain.fleet import Link, Wan, load_fleet
from hsched.envs.path import ENV_ID, PathEnv
from hsched.traces import data_dir

TARGET_STEPS_PER_S = 20_000


def replicated_wan(copies: int = 10) -> Wan:
    """`copies` copies of the default WAN in a ring with chords (see the module docstring)."""
    base = load_fleet().wan
    vertices: dict[str, tuple[float, float]] = {}
    links: list[Link] = []
    for k in range(copies):
        vertices.update({f"{v} #{k}": pos for v, pos in base.vertices.items()})
        links += [Link(f"{ln.a} #{k}", f"{ln.b} #{k}", ln.distance_km, ln.latency_ms) for ln in base.links]
    for k in range(copies):
        links.append(Link(f"New York #{k}", f"Seattle #{(k + 1) % copies}", 4000.0, 20.0))
        links.append(Link(f"Houston #{k}", f"Chicago #{(k + 3) % copies}", 3000.0, 15.0))
    scheduler = f"{base.scheduler_vertex} #0"
    return Wan(vertices=vertices, links=tuple(links), scheduler_vertex=scheduler, entry_vertices=(scheduler,),
               source=f"{copies} × {base.source or 'default WAN'}")


def zoo(name: str) -> Path:
    return data_dir() / "topology_zoo" / "graphml" / f"{name}.graphml"


def run_single(env: gymnasium.Env, steps: int, seed: int) -> tuple[float, int]:
    """steps/s and episodes for `steps` random valid steps (resets included)."""
    core = env.unwrapped
    neighbours = {v: [core.index[u] for u in core.graph.graph.adj[v]] for v in core.vertices}
    choice = random.Random(seed).choice
    _, info = env.reset(seed=seed)
    episodes = 0
    t0 = time.perf_counter()
    for _ in range(steps):
        _, _, term, trunc, info = env.step(choice(neighbours[info["path"][-1]]))
        if term or trunc:
            episodes += 1
            _, info = env.reset()
    return steps / (time.perf_counter() - t0), episodes


def run_vector(graph: WanGraph, target: str | None, num_envs: int, steps: int, seed: int) -> float:
    """Env steps/s of a sync vector env (random valid actions from the batched masks)."""
    envs = gymnasium.make_vec(ENV_ID, num_envs=num_envs, vectorization_mode="sync", graph=graph, target=target)
    rng = np.random.default_rng(seed)
    _, infos = envs.reset(seed=seed)
    batches = max(1, steps // num_envs)
    t0 = time.perf_counter()
    for _ in range(batches):
        actions = (rng.random(infos["action_mask"].shape) * infos["action_mask"]).argmax(axis=1)
        _, _, _, _, infos = envs.step(actions)
    elapsed = time.perf_counter() - t0
    envs.close()
    return batches * num_envs / elapsed


def median_of(repeats: int, fn) -> tuple[float, list[float]]:
    values = [fn() for _ in range(repeats)]
    return statistics.median(values), values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cpu", type=int, default=0, help="pin to this core (-1: do not pin)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.cpu >= 0 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.cpu})

    default = WanGraph(load_fleet().wan)
    points = [
        ("paper scale: default WAN (Abilene + scheduler)", default, None),
        ("Topology Zoo: Chinanet", PathEnv(zoo("Chinanet")).graph, None),
        ("Topology Zoo: Geant2012", PathEnv(zoo("Geant2012")).graph, None),
        ("10× scale: 10 default WANs, ring + chords", WanGraph(replicated_wan(10)), None),
    ]
    rows = []
    base_rate = base_n = None
    for label, graph, target in points:
        env = PathEnv(graph, target)
        print(f"… {label}: {env.n} vertices", file=sys.stderr)
        rate, _ = median_of(args.repeats, lambda env=env: run_single(env, args.steps, args.seed)[0])
        _, episodes = run_single(env, args.steps // 10, args.seed)
        wrapped = gymnasium.make(ENV_ID, graph=graph, target=target)
        wrapped_rate, _ = median_of(args.repeats, lambda w=wrapped: run_single(w, args.steps, args.seed)[0])
        vec_rate, _ = median_of(args.repeats, lambda g=graph, t=target: run_vector(g, t, 8, args.steps, args.seed))
        if base_rate is None:
            base_rate, base_n = rate, env.n
        slowdown = base_rate / rate
        linear = env.n / base_n
        rows.append((label, env.n, graph.graph.number_of_edges(), rate, 1e6 / rate, wrapped_rate, vec_rate,
                     (args.steps // 10) / max(episodes, 1), slowdown, linear))

    print(f"\nPathEnv step throughput, one core (pinned to CPU {args.cpu}), random valid actions, resets "
          f"included; median of {args.repeats} × {args.steps} steps. Load average before: "
          f"{os.getloadavg()[0]:.2f}.\n")
    print("| graph | vertices | links | raw env steps/s | µs/step | gymnasium.make steps/s | "
          "make_vec sync ×8 env-steps/s | steps/episode | slow-down vs paper scale | linear bound |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, n, m, rate, us, wrapped, vec, spe, slow, lin in rows:
        print(f"| {label} | {n} | {m} | {rate:,.0f} | {us:.2f} | {wrapped:,.0f} | {vec:,.0f} | {spe:.1f} | "
              f"{slow:.2f}× | {lin:.1f}× |")
    paper, ten = rows[0], rows[-1]
    print()
    print(f"- target ≥ {TARGET_STEPS_PER_S:,} steps/s at paper scale (raw env): {paper[3]:,.0f} → "
          f"{'PASS' if paper[3] >= TARGET_STEPS_PER_S else 'FAIL'}; through gymnasium.make: {paper[5]:,.0f} → "
          f"{'PASS' if paper[5] >= TARGET_STEPS_PER_S else 'FAIL'}")
    print(f"- 10× scale ({ten[1]} vertices): slow-down {ten[8]:.2f}× vs linear {ten[9]:.1f}× → "
          f"{'PASS' if ten[8] <= ten[9] else 'FAIL'} (ratio to linear: {ten[8] / ten[9]:.2f})")


if __name__ == "__main__":
    main()
