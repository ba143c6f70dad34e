"""hsched.policies.fairshare (Volcano proportion deserved shares, the deferred queue's order) and
hsched.policies.preemption (victims minimising lost work) — hand-computed cases and property tests."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hsched.domain.cluster import Part
from hsched.domain.errors import ValidationError
from hsched.policies.fairshare import (
    FairQueue,
    TenantWeights,
    Waiting,
    class_rank,
    deserved,
    dominant_share,
    share,
)
from hsched.policies.preemption import Candidate, choose_victims, lost_work


def vec(cpu: float, mem: float = 0.0, gpu: float = 0.0) -> np.ndarray:
    return np.array([cpu, mem, gpu], dtype=np.float64)


# -- deserved shares ----------------------------------------------------------------------------------------

def test_deserved_by_weight_and_redistributed_when_a_tenant_asks_for_less():
    # a (weight 3) asks for 200 cores, b (weight 1) for 10, of 100: round 1 gives a 75 and b min(25, 10) = 10
    # (b is met); the 15 left go to a alone: a 90, b 10.
    d = deserved(vec(100), {"a": vec(200), "b": vec(10)}, TenantWeights({"a": 3.0}))
    assert d["a"] == pytest.approx(vec(90))
    assert d["b"] == pytest.approx(vec(10))
    assert share(vec(45), d["a"]) == pytest.approx(0.5)


def test_deserved_equal_weights_per_dimension():
    # a asks [80 cpu, 20 mem], b [30, 90] of [100, 100]: per dimension the one that asks less gets all of it,
    # the other the rest: a -> [70, 20], b -> [30, 80] (reached by halving the remainder each round)
    d = deserved(vec(100, 100), {"a": vec(80, 20), "b": vec(30, 90)}, TenantWeights())
    assert d["a"] == pytest.approx(vec(70, 20), abs=1e-6)
    assert d["b"] == pytest.approx(vec(30, 80), abs=1e-6)


def test_share_of_a_dimension_deserved_nothing():
    assert share(vec(0, 0, 0), vec(10, 10, 0)) == 0.0
    assert share(vec(5, 0, 50), vec(10, 10, 0)) == 1.0  # holds GPU it deserves none of
    assert share(vec(5, 8, 0), vec(10, 10, 0)) == pytest.approx(0.8)


def test_dominant_share():
    assert dominant_share(vec(10, 50, 0), vec(100, 100, 0)) == pytest.approx(0.5)
    assert dominant_share(vec(10, 0, 100), vec(100, 100, 400)) == pytest.approx(0.25)


requests_st = st.dictionaries(st.sampled_from("abcde"), st.tuples(*[st.integers(0, 500)] * 3), min_size=1)


@settings(max_examples=200, deadline=None)
@given(requests_st, st.dictionaries(st.sampled_from("abcde"), st.integers(1, 5)),
       st.tuples(*[st.integers(0, 1000)] * 3))
def test_deserved_invariants(requests, weights, capacity):
    reqs = {t: np.array(r, dtype=np.float64) for t, r in requests.items()}
    cap = np.array(capacity, dtype=np.float64)
    d = deserved(cap, reqs, TenantWeights({t: float(w) for t, w in weights.items()}))
    total = sum(d.values())
    assert np.all(total <= cap + 1e-6)  # never more than the DC
    for t in reqs:
        assert np.all(d[t] <= reqs[t] + 1e-9)  # never more than asked
        assert np.all(d[t] >= 0)
    for k in range(3):  # where the DC can satisfy every request in a dimension, everyone gets it all
        if sum(r[k] for r in reqs.values()) <= cap[k]:
            for t in reqs:
                assert d[t][k] == pytest.approx(reqs[t][k], abs=1e-6)
        else:  # otherwise nothing is left idle in that dimension
            assert total[k] == pytest.approx(cap[k], rel=1e-6, abs=1e-6)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 500), st.integers(1, 5), st.integers(1, 5), st.integers(1, 1000))
def test_deserved_grows_with_weight(request, wa, wb, capacity):
    d = deserved(vec(capacity), {"a": vec(request), "b": vec(request)}, TenantWeights({"a": wa, "b": wb}))
    if wa >= wb:
        assert d["a"][0] >= d["b"][0] - 1e-9


def test_weights_parse_inline_file_and_errors(tmp_path):
    w = TenantWeights.parse("alpha=2, beta=0.5")
    assert (w.of("alpha"), w.of("beta"), w.of("other")) == (2.0, 0.5, 1.0)
    f = tmp_path / "w.yaml"
    f.write_text("tenants: {alpha: 3}\ndefault: 2\n")
    w = TenantWeights.parse(str(f))
    assert (w.of("alpha"), w.of("x")) == (3.0, 2.0)
    assert TenantWeights.parse("").of("x") == 1.0
    for bad, field in (("alpha=0", "--tenant-weights[alpha]"), ("alpha=x", "--tenant-weights[alpha]"),
                       ("alpha", "--tenant-weights"), ("alpha=inf", "--tenant-weights[alpha]"),
                       ("alpha=1,alpha=2", "--tenant-weights[alpha]"),  # given twice: not the last one silently
                       ("A_B=1", "--tenant-weights")):  # no task's tenant could match it
        with pytest.raises(ValidationError) as e:
            TenantWeights.parse(bad)
        assert e.value.field == field
    f.write_text("tenants: {alpha: -1}\n")
    with pytest.raises(ValidationError, match=r"--tenant-weights\[alpha\]"):
        TenantWeights.parse(str(f))


# -- the deferred queue's order -----------------------------------------------------------------------------

def waiting(task: str, tenant: str, cls: str = "offline", priority: int = 0, arrival: int = 0,
            cpu: int = 10) -> Waiting:
    return Waiting(task, tenant, cls, priority, arrival, vec(cpu))


def test_queue_order_class_then_share_then_priority_then_arrival():
    # a holds 60 of 100 cores and waits for 20 more, b holds nothing and waits for 20, c (online) for 10.
    # Deserved (equal weights): round 1 gives each 33.3 -> b met at 20, c at 10, a 33.3; round 2 gives a the
    # 36.7 left -> 70. Shares: a 60/70, b 0.
    q = FairQueue([waiting("a1", "a", arrival=1), waiting("a2", "a", arrival=2, priority=5),
                   waiting("b1", "b", arrival=3, priority=1), waiting("b2", "b", arrival=4, priority=1),
                   waiting("b3", "b", arrival=5, priority=2, cpu=0),
                   waiting("c1", "c", cls="online", arrival=6)],
                  {"a": vec(60)}, vec(100), TenantWeights())
    order = []
    for w in q:
        order.append(w.task_id)
        q.placed(w)
    # c1 (online); b3 (b: share 0, priority 2); b1 (share 0 still — b3 takes no cpu; priority 1, arrival 3);
    # then b's share is 10/30 < a's 60/70: b2; then b at 20/30 = 0.67 < a at 0.86: b done, a2 (priority 5), a1
    assert order == ["c1", "b3", "b1", "b2", "a2", "a1"]


def test_queue_order_a_tenant_not_placed_keeps_its_share():
    q = FairQueue([waiting("a1", "a", arrival=1), waiting("b1", "b", arrival=2), waiting("b2", "b", arrival=3)],
                  {"a": vec(10)}, vec(100), TenantWeights())
    order = [w.task_id for w in q]  # nothing placed: b (share 0) keeps going first
    assert order == ["b1", "b2", "a1"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.sampled_from(["online", "offline"]), st.integers(-2, 2),
                          st.integers(0, 50), st.booleans()), max_size=20),
       st.dictionaries(st.sampled_from("abc"), st.integers(0, 100)),
       st.dictionaries(st.sampled_from("abc"), st.integers(1, 4)))
def test_queue_order_invariants(items, held, weights):
    ws = [Waiting(f"t{i}", t, c, p, i, vec(cpu)) for i, (t, c, p, cpu, _) in enumerate(items)]
    fits = {f"t{i}": ok for i, (*_, ok) in enumerate(items)}
    q = FairQueue(ws, {t: vec(h) for t, h in held.items()}, vec(200), TenantWeights(weights))
    left = list(ws)
    order: list[Waiting] = []
    for w in q:
        # the pick: the best class left; in it, a tenant with the lowest share (before this pick); in the
        # tenant, the highest priority, then the earliest arrival
        same_class = [x for x in left if class_rank(x.priority_class) == min(class_rank(y.priority_class) for y in left)]
        assert w in same_class
        lowest = min(q.share(x.tenant) for x in same_class)
        assert q.share(w.tenant) == pytest.approx(lowest)
        lane = [x for x in same_class if x.tenant == w.tenant]
        assert (w.priority, -w.arrival) == max((x.priority, -x.arrival) for x in lane)
        left.remove(w)
        order.append(w)
        if fits[w.task_id]:
            q.placed(w)
    assert sorted(x.task_id for x in order) == sorted(x.task_id for x in ws)  # each exactly once


# -- victims ------------------------------------------------------------------------------------------------

def part(node: int, cpu: int) -> Part:
    return Part(0, 0, node, cpu, 0, 0, 0)


def test_lost_work_is_elapsed_task_time_times_dominant_share():
    cap = vec(100, 1000)
    # 20 of 100 cores, 100 of 1000 MiB for 3 s of wall time at time factor 10: 30 task-seconds × 0.2
    assert lost_work([Part(0, 0, 0, 20, 100, 0, 0)], 1_000, 4_000, cap, 10.0) == pytest.approx(6.0)
    assert lost_work([part(0, 20)], 0, 4_000, cap) == 0.0  # placed, not started: nothing lost


def test_victims_cheapest_single_node_set():
    # node 0 free 2, node 1 free 0; demand 8.
    # node 0: x (cpu 6, lost 5), y (cpu 4, lost 1), z (cpu 2, lost 0.5): {x} 5, {y, z} 1.5 (2+4+2 = 8) -> best
    # node 1: w (cpu 8, lost 2)   -> {w} 2
    free, size = {0: 2, 1: 0}, {"x": 6, "y": 4, "z": 2, "w": 8}
    where = {"x": 0, "y": 0, "z": 0, "w": 1}
    cands = [Candidate("x", frozenset({0}), 5), Candidate("y", frozenset({0}), 1),
             Candidate("z", frozenset({0}), 0.5), Candidate("w", frozenset({1}), 2)]

    def fits(ids):
        return any(free[n] + sum(size[i] for i in ids if where[i] == n) >= 8 for n in free)

    e = choose_victims(cands, fits)
    assert (e.node, e.victims, e.lost_work) == (0, ("y", "z"), pytest.approx(1.5))
    # with y gone, node 1's w (2) beats node 0's {x} (5), {x, z} (5.5)
    e = choose_victims([c for c in cands if c.task_id != "y"], fits)
    assert (e.node, e.victims) == (1, ("w",))
    assert choose_victims([Candidate("z", frozenset({0}), 0.5)], fits) is None  # not enough anywhere


def test_victims_a_free_task_is_not_evicted_for_nothing():
    # p (not started, lost 0) and q (lost 3) on node 0; q alone is enough: {q}, not {p, q}
    cands = [Candidate("p", frozenset({0}), 0.0), Candidate("q", frozenset({0}), 3.0)]
    assert choose_victims(cands, lambda ids: "q" in ids).victims == ("q",)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=3),
       st.lists(st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=2, unique=True), st.integers(1, 6),
                          st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.5, 7.0])), max_size=7),
       st.integers(1, 12), st.sampled_from([3, 10, 512]), st.booleans())
def test_victims_minimal_lost_work(free, tasks, demand, max_checks, bounded):
    """Against brute force: the victims sit on the chosen node, let the task in, and lose the least work any
    single-node set could (with a small check budget: still a set that lets it in); with a lower bound on the
    victims a node needs (here the exact fewest, by brute force), the same."""
    n = len(free)
    tasks = [([x for x in nodes if x < n] or [0], cpu, lost) for nodes, cpu, lost in tasks]
    cands = [Candidate(f"t{i}", frozenset(nodes), lost) for i, (nodes, _, lost) in enumerate(tasks)]
    cpu_of = {f"t{i}": cpu for i, (_, cpu, _) in enumerate(tasks)}
    calls = []

    def fits(ids):  # each task's cpu is on each of its nodes (a replica per node)
        calls.append(ids)
        return any(free[k] + sum(cpu_of[i] for i in ids if k in cands[int(i[1:])].nodes) >= demand
                   for k in range(n))

    if fits(()):
        return  # the placer only preempts when the task does not fit as is
    def fewest(node, on_node):  # the exact fewest victims among on_node that fit (len + 1: none do)
        for r in range(1, len(on_node) + 1):
            if any(fits(tuple(c.task_id for c in sub)) for sub in itertools.combinations(on_node, r)):
                return r
        return len(on_node) + 1

    e = choose_victims(cands, fits, max_checks=max_checks, min_victims=fewest if bounded else None)
    best = None
    for k in range(n):
        on_k = [c for c in cands if k in c.nodes]
        for r in range(1, len(on_k) + 1):
            for subset in itertools.combinations(on_k, r):
                if fits(tuple(c.task_id for c in subset)):
                    cost = sum(c.lost_work for c in subset)
                    best = cost if best is None else min(best, cost)
    if best is None:
        assert e is None
        return
    assert e is not None
    assert fits(e.victims)
    assert all(e.node in cands[int(v[1:])].nodes for v in e.victims)
    assert e.lost_work == pytest.approx(sum(cands[int(v[1:])].lost_work for v in e.victims))
    if max_checks >= 512:
        assert e.lost_work == pytest.approx(best)
