"""Which offline tasks an online task evicts when it cannot be placed otherwise (paper 001's co-location).

Paper 001 aborts offline tasks at random until the online task fits; here the victims are chosen to lose the
least work. Lost work of a victim = the task time it has run (0 for a task PLACED but not started yet) times
its size, the dominant share of the data center it holds (hsched.policies.fairshare.dominant_share): one
"DC-second" is the whole DC busy for a second. Restarting it from scratch repeats exactly that work.

The victims all sit on ONE node (a task with parts on several nodes counts for each of them and frees all its
parts): for every node holding offline tasks, the cheapest set of them that lets the online task in is found by
an exact branch-and-bound search, and the cheapest node wins (ties: fewer victims; then the first found).
Whether a set "lets the task in" is the caller's `fits` — the placer asks the same planner, masks and thermal
headroom as for any placement — and must be monotone (evicting more never makes it not fit), which holding
resources and heat are. The search asks `fits` at most `max_checks` times; past that it keeps the best set found
so far, or, with none yet, evicts greedily cheapest first and drops the victims that turn out not to be needed.
Online tasks are never candidates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from hsched.domain.cluster import Part, usage_of
from hsched.policies.fairshare import dominant_share

MAX_CHECKS = 1024


@dataclass(frozen=True)
class Candidate:
    """An offline task that may be evicted: the nodes its parts occupy and the work lost by evicting it."""

    task_id: str
    nodes: frozenset[int]
    lost_work: float


@dataclass(frozen=True)
class Eviction:
    node: int
    victims: tuple[str, ...]
    lost_work: float


def lost_work(parts: Iterable[Part], started_ms: int, now_ms: int, capacity: np.ndarray,
              time_factor: float = 1.0) -> float:
    """Task seconds run so far (wall time × `time_factor`; 0 when not started) × dominant share of the DC."""
    if started_ms <= 0 or now_ms <= started_ms:
        return 0.0
    return (now_ms - started_ms) / 1000.0 * time_factor * dominant_share(usage_of(tuple(parts)), capacity)


def candidate(task_id: str, parts: Iterable[Part], lost: float) -> Candidate:
    return Candidate(task_id, frozenset(p.node for p in parts), lost)


def choose_victims(candidates: Iterable[Candidate], fits: Callable[[tuple[str, ...]], bool],
                   max_checks: int = MAX_CHECKS,
                   min_victims: Callable[[int, list[Candidate]], int] | None = None) -> Eviction | None:
    """The cheapest single-node eviction that makes `fits(victim ids)` true, or None if no node's offline tasks
    would be enough even all evicted. `min_victims(node, its candidates)`, if given, is a lower bound on how
    many of them any set that fits needs (more than there are: none does); nodes whose cheapest sets of that
    size cannot beat the best found are not searched."""
    by_node: dict[int, list[Candidate]] = {}
    for c in candidates:
        for n in c.nodes:
            by_node.setdefault(n, []).append(c)
    checks = [max_checks]
    memo: dict[frozenset[str], bool] = {}

    def ok(ids: Iterable[str]) -> bool:
        key = frozenset(ids)
        if key not in memo:
            checks[0] -= 1
            memo[key] = fits(tuple(sorted(key)))
        return memo[key]

    best: tuple[float, int, int, tuple[str, ...]] | None = None  # (lost work, victims, node, ids)
    ranked = {n: sorted(cs, key=lambda c: (c.lost_work, c.task_id)) for n, cs in by_node.items()}
    bounds = {}  # node -> (lowest lost work, fewest victims) any set of its candidates that fits can have
    for n, cands in ranked.items():
        m = max(1, min_victims(n, cands)) if min_victims is not None else 1
        if m <= len(cands):
            bounds[n] = (sum(c.lost_work for c in cands[:m]), m)
    # nodes with the lowest bound first: a good set found early bounds the search on the others
    for node in sorted(bounds, key=lambda n: (bounds[n], n)):
        cands = ranked[node]
        if best is not None and bounds[node] >= best[:2]:
            continue  # even its cheapest sets of the fewest victims cannot beat the best set found
        found = _search(cands, ok, checks, None if best is None else best[:2])
        if found is None and checks[0] <= 0 and best is None:
            found = _greedy(cands, ok)  # out of checks before any set was confirmed
        if found is None:  # nothing here beats the best node so far
            continue
        cost, ids = found
        key = (cost, len(ids), node, ids)
        if best is None or key < best:
            best = key
    if best is None:
        return None
    return Eviction(best[2], best[3], best[0])


def _search(cands: list[Candidate], ok: Callable[[Iterable[str]], bool], checks: list[int],
            bound: tuple[float, int] | None) -> tuple[float, tuple[str, ...]] | None:
    """Branch and bound over subsets of `cands` (sorted by lost work): the cheapest set (then the smallest) that
    fits and beats `bound`; None when none beats it (or the checks ran out before one was found)."""
    best: list = [bound, None]  # [(cost, count) to beat, ids]
    suffix_all = [tuple(c.task_id for c in cands[i:]) for i in range(len(cands) + 1)]

    def better(cost: float, count: int) -> bool:
        return best[0] is None or (cost, count) < best[0]

    def visit(i: int, chosen: tuple[str, ...], cost: float) -> None:
        if checks[0] <= 0:
            return
        if chosen:
            if not better(cost, len(chosen)):
                return  # neither it nor a superset (more lost work or victims) can beat the best
            if ok(chosen):
                best[0], best[1] = (cost, len(chosen)), chosen
                return
        if i == len(cands) or not better(cost + cands[i].lost_work, len(chosen) + 1):
            return  # cands are sorted: any extension costs at least cands[i].lost_work more
        if not ok(chosen + suffix_all[i]):
            return  # even all the rest would not be enough (fits is monotone)
        visit(i + 1, (*chosen, cands[i].task_id), cost + cands[i].lost_work)
        visit(i + 1, chosen, cost)

    visit(0, (), 0.0)
    if best[1] is None:
        return None
    return best[0][0], tuple(sorted(best[1]))


def _greedy(cands: list[Candidate], ok: Callable[[Iterable[str]], bool]) -> tuple[float, tuple[str, ...]] | None:
    chosen: list[Candidate] = []
    for c in cands:
        chosen.append(c)
        if ok(x.task_id for x in chosen):
            break
    else:
        return None  # even all of them are not enough
    for c in sorted(chosen, key=lambda c: -c.lost_work):  # the most expensive first: drop it if not needed
        rest = [x for x in chosen if x is not c]
        if rest and ok(x.task_id for x in rest):
            chosen = rest
    return sum(c.lost_work for c in chosen), tuple(sorted(c.task_id for c in chosen))
