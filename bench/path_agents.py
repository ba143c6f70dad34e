"""PER-DQN vs uniform-replay DQN path agents (paper 003 §2.1, fig.5) on real WANs: do their greedy paths
equal Dijkstra's, and after how many environment steps?

    python bench/path_agents.py [--seeds 0 1 2] [--graphs abilene Sprint AttMpls Geant2012] [--budget 60000]
                                [--zoo-targets hub|all]

Per graph and seed, both agents train with the same hyper-parameters (hsched.rl.dqn.DqnConfig: latency
reward, γ = 1, Double-DQN targets, masked moves), the same seed and the same budget. Every `eval_every`
(500) steps the greedy masked policy walks from every start to every target; "solved" is the first check at
which every walk arrives over a simple path no longer than Dijkstra's (a run stops there, or at the budget).
Targets: on the default fleet's WAN (Abilene + the scheduler vertex) every entry vertex, i.e. all 132
ordered pairs — what the selector serves; on the other Topology Zoo graphs the paper's setting: one target,
the best-connected PoP (the scheduler sits at a hub), from every other vertex, or with `--zoo-targets all`
every vertex as a target (all ordered pairs, much harder). Not a timed test.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import dataclasses
import statistics
import time

from hsched.rl.dqn import DqnConfig, Trainer, load_graph
from hsched.traces import data_dir

ZOO = ("Sprint", "AttMpls", "Geant2012")


def config_for(graph: str, budget: int, zoo_targets: str = "hub") -> DqnConfig:
    base = DqnConfig(steps=budget, stop_after_solved=1)
    if graph == "abilene":
        return base  # the default fleet, every entry vertex a target (the shipped model's setting)
    source = str(data_dir() / "topology_zoo" / "graphml" / f"{graph}.graphml")
    g = load_graph(source)
    hub = max(g.vertices, key=lambda v: (len(g.graph.adj[v]), v))
    return dataclasses.replace(base, graph=source, targets=(hub,) if zoo_targets == "hub" else g.vertices)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--graphs", nargs="+", default=["abilene", *ZOO], help="abilene and/or Topology Zoo names")
    p.add_argument("--budget", type=int, default=60_000, help="env steps per run at most")
    p.add_argument("--zoo-targets", choices=["hub", "all"], default="hub",
                   help="Topology Zoo graphs: the hub as the one target (paper) or every vertex")
    args = p.parse_args()

    rows = []
    for graph in args.graphs:
        config = config_for(graph, args.budget, args.zoo_targets)
        for seed in args.seeds:
            result = {}
            for prioritized in (True, False):
                c = dataclasses.replace(config, prioritized=prioritized)
                trainer = Trainer(c, seed)
                t0 = time.perf_counter()
                trainer.run(c.steps, show=False)
                final = trainer.evaluate(record=False)
                result[c.agent] = (trainer.solved_at, final, time.perf_counter() - t0)
            env = trainer.env
            target = f"all {len(env.targets)} vertices" if len(env.targets) > 1 else env.targets[0]
            rows.append((graph, len(env.vertices), target, seed, result))
            per, dqn = result["per-dqn"], result["dqn"]
            print(f"{graph} seed {seed}: PER-DQN solved at {per[0]} ({per[1]['matched']}/{per[1]['pairs']}, "
                  f"{per[2]:.0f} s), DQN at {dqn[0]} ({dqn[1]['matched']}/{dqn[1]['pairs']}, {dqn[2]:.0f} s)",
                  flush=True)

    def cell(r: tuple) -> str:
        solved, final, _ = r
        return f"{solved:,}" if solved is not None else f"not by {args.budget:,} ({final['matched']}/{final['pairs']})"

    print("\n| graph | vertices | target | pairs | seed | PER-DQN: all paths = Dijkstra at step | "
          "DQN: all paths = Dijkstra at step |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for graph, n, target, seed, result in rows:
        print(f"| {graph} | {n} | {target} | {result['per-dqn'][1]['pairs']} | {seed} | {cell(result['per-dqn'])} | "
              f"{cell(result['dqn'])} |")
    print("\nMedian steps to all-Dijkstra per graph (unsolved runs count as the budget):")
    for graph in args.graphs:
        med = {agent: statistics.median(r[4][agent][0] or args.budget for r in rows if r[0] == graph)
               for agent in ("per-dqn", "dqn")}
        print(f"  {graph}: PER-DQN {med['per-dqn']:,.0f}, DQN {med['dqn']:,.0f}")


if __name__ == "__main__":
    main()
