"""The graph-agnostic PER-DQN path agent on WANs it never trained on: its OWN greedy paths (no guard) against
Dijkstra's, and the stage-1 cost with and without the selector's Dijkstra guard.

    python bench/path_agents.py [--model models/per_dqn_path] [--graphs held-out|train|all|NAME ...]
                                [--no-constructed]

Per graph (held-out Topology Zoo graphs by default, hsched.rl.dqn.HELD_OUT_GRAPHS, up to TataNld's 143 linked,
located PoPs, plus the CONSTRUCTED large graph: four held-out graphs chained by their nearest PoPs, 183
vertices, since no Zoo graph here has >= 150 linked, located PoPs; and the default fleet's WAN, which the
selector serves; `--graphs train` = hsched.rl.dqn.MONITOR_GRAPHS, ten of the ~200 training graphs):

- own paths, every ordered vertex pair (u, t): the deterministic greedy walk u → t (step cap 2n, a revisit is
  a loop): "= Dijkstra" when it arrives over a simple path no longer than Dijkstra's, "invalid" when it loops
  or never arrives, and the latency excess of the arriving walks over Dijkstra's;
- stage-1 cost (paper 003 eq.3, the stage-1 example task: 100 GB, 2 048 cores, 1 h) from every vertex as the
  entry: "own" picks the cheapest DC over the agent's own paths (a DC its walk cannot reach is out), "guarded"
  is the selector (hsched.costs.rank_datacenters: an invalid or longer agent path is replaced by Dijkstra's);
  the gap is the summed total against min-cost (Dijkstra) in %, and "replaced" counts the (entry, DC) paths the
  guard replaced. The DCs: on the default fleet its own 11; on another graph the same 11 DCs re-homed on 11
  spread-out vertices (farthest-point sampling from the first vertex) — a constructed placement, same prices.

Not a timed test; figures depend only on the model file.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import dataclasses
import json

import torch

from hsched.costs import WanGraph, rank_datacenters
from hsched.costs.network import network_cost
from hsched.costs.selection import no_longer
from hsched.domain.fleet import DataCenter, load_fleet
from hsched.rl import checkpoint
from hsched.rl.dqn import (
    DEFAULT_FLEET,
    HELD_OUT_GRAPHS,
    MONITOR_GRAPHS,
    constructed_graph,
    evaluate_graph,
    load_graph,
    load_net,
    load_path_finder,
)
from hsched.traces.topology_zoo import haversine_km

EXAMPLE_DATA_MB = 100_000.0  # hsched.eval.stage1.EXAMPLE_TASK's 100 GB


def spread_vertices(graph: WanGraph, k: int) -> list[str]:
    """k vertices far apart: farthest-point sampling by great-circle distance, from the first vertex."""
    coords = graph.wan.vertices
    chosen = [graph.vertices[0]]
    while len(chosen) < min(k, len(graph.vertices)):
        chosen.append(max((v for v in graph.vertices if v not in chosen),
                          key=lambda v: (min(haversine_km(coords[v], coords[c]) for c in chosen), v)))
    return chosen


def datacenters_on(graph: WanGraph) -> list[DataCenter]:
    fleet = load_fleet()
    if set(d.vertex for d in fleet.datacenters) <= set(graph.vertices):
        return list(fleet.datacenters)
    return [dataclasses.replace(dc, vertex=v)
            for dc, v in zip(fleet.datacenters, spread_vertices(graph, len(fleet.datacenters)), strict=False)]


def stage1(graph: WanGraph, model: str) -> dict[str, float]:
    from hsched.eval.stage1 import EXAMPLE_TASK

    fleet = load_fleet()
    price = fleet.network_price_per_gb_ms
    dcs = datacenters_on(graph)
    finder = load_path_finder(model, graph)
    best = own = guarded = 0.0
    replaced = pairs = own_lost = guard_invalid = 0
    for entry in graph.vertices:
        ranked, _ = rank_datacenters(EXAMPLE_TASK, dcs, graph, price, entry)
        if not ranked:
            continue
        best += ranked[0].total
        guard, _ = rank_datacenters(EXAMPLE_TASK, dcs, graph, price, entry, path_finder=finder)
        guarded += guard[0].total
        guard_invalid += sum(not graph.is_valid_path(c.path.vertices, entry, c.vertex) for c in guard)
        own_totals = []
        for c in ranked:  # every DC with the agent's own path to it (as the selector asks: entry → DC)
            pairs += 1
            path = finder.path(entry, c.vertex)
            ok = path is not None and graph.is_valid_path(path, entry, c.vertex)
            if not ok or not no_longer(graph.path_metrics(path).latency_ms, c.path.latency_ms):
                replaced += 1
            if ok:
                own_totals.append(c.resource.total + network_cost(price, EXAMPLE_DATA_MB,
                                                                  graph.path_metrics(path).latency_ms))
        if own_totals:
            own += min(own_totals)
        else:  # the agent reaches no DC from this entry: charged at the best total, counted
            own += ranked[0].total
            own_lost += 1
    return {"own_gap": 100 * (own / best - 1), "guarded_gap": 100 * (guarded / best - 1),
            "replaced": replaced, "pairs": pairs, "entries_without_dc": own_lost, "guard_invalid": guard_invalid}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="per_dqn_path", help="a model name in models/ or a .pt path")
    p.add_argument("--graphs", nargs="+", default=["held-out"],
                   help="held-out, train, all, or Topology Zoo names / GraphML paths")
    p.add_argument("--no-constructed", action="store_true", help="skip the constructed large graph")
    args = p.parse_args()
    torch.set_num_threads(1)

    names: list[str] = []
    for g in args.graphs:
        names += {"held-out": list(HELD_OUT_GRAPHS), "train": list(MONITOR_GRAPHS),
                  "all": [*HELD_OUT_GRAPHS, *MONITOR_GRAPHS]}.get(g, [g])
    if DEFAULT_FLEET not in names:
        names.append(DEFAULT_FLEET)
    net, meta = load_net(args.model)
    trained_on = {g["source"] for g in meta["training_graphs"]}
    graphs = [(n, load_graph(n)) for n in names]
    if not args.no_constructed:
        graphs.append(("constructed", constructed_graph()))
    print(f"model {checkpoint.model_path(args.model)} ({meta['architecture']}, {meta['evaluation']['steps']:,} "
          f"steps, trained on {len(trained_on)} graphs)\n")
    rows = []
    for name, graph in graphs:
        r = evaluate_graph(net, graph)
        s = stage1(graph, args.model)
        seen = "trained on" if graph.wan.source in trained_on else "held out"
        rows.append((name, seen, len(graph.vertices), r, s))
        print(f"{name}: {json.dumps({k: v for k, v in r.items()})} stage1 {json.dumps(s)}", flush=True)

    print("\n| graph | seen in training | vertices | ordered pairs | own paths = Dijkstra | own invalid "
          "(loop / no arrival) | own latency excess | stage-1 gap, own paths | stage-1 gap, guarded | "
          "(entry, DC) paths replaced by the guard | invalid after the guard |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, seen, n, r, s in rows:
        print(f"| {name} | {seen} | {n} | {r['pairs']:,} | {100 * r['matched'] / r['pairs']:.2f} % | "
              f"{100 * r['invalid'] / r['pairs']:.2f} % | {r['latency_gap_percent']:.2f} % | {s['own_gap']:.3f} % | "
              f"{s['guarded_gap']:.3f} % | {s['replaced']}/{s['pairs']} | {s['guard_invalid']} |")


if __name__ == "__main__":
    main()
