"""Bounded candidate scoring (hsched.policies.base: `candidates`, `select`, `NodesToScore`): the sample is
only ever feasible nodes, all of them (so the best one) when the bound covers them, and a bounded policy then
decides exactly as the unbounded one; sampled scoring (`scores_at`) agrees with full scoring on the same
nodes; the learned policies' numpy forwards agree with their torch networks; a learned policy never scores
more than its `candidate_limit`; the placer and `hsched up` refuse a bad `--nodes-to-score`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hsched.domain.cluster import ClusterState
from hsched.domain.resources import Resources
from hsched.policies.base import MIN_NODES_TO_SCORE, NodesToScore, bound, candidates, select
from hsched.policies.fgd import FragmentationGradientDescent, chosen_cards
from hsched.policies.heuristics import BestFit, FirstFit, Greedy, Utilization
from hsched.rl.nets import AttentionNumpy, PooledNumpy, PooledScorer, SelfAttentionScorer
from tests.test_policies import gpu_dc, tiny_dc

NODES = 12
CPU_DC = tiny_dc([{"name": "cpu", "count": NODES, "cpu_cores": 8, "memory_gib": 32}])
GPU_DC = gpu_dc(cards=4, count=NODES)
FGD = FragmentationGradientDescent.from_tasks([Resources(1000, 1024, 0, 0, 1, 50, 4096),
                                               Resources(2000, 2048, 0, 0, 1, 100, 16384),
                                               Resources(4000, 4096, 0, 0, 2, 25, 2048)])


def gpu_state(data: st.DataObject) -> ClusterState:
    state = ClusterState(GPU_DC)
    state.free_cpu[:] = np.array(data.draw(st.lists(st.integers(0, 8), min_size=NODES, max_size=NODES))) * 1000
    state.free_memory[:] = np.array(data.draw(st.lists(st.integers(0, 64), min_size=NODES, max_size=NODES))) * 1024
    core = np.array(data.draw(st.lists(st.sampled_from([0, 25, 50, 75, 100]), min_size=4 * NODES,
                                       max_size=4 * NODES))).reshape(NODES, 4)
    state.gpu_free_core[:] = core
    state.gpu_free_memory[:] = core * 16384 // 100
    return state


demands = st.builds(Resources, st.integers(0, 8).map(lambda c: 1000 * c), st.integers(0, 32).map(lambda g: 1024 * g),
                    st.just(0), st.just(0), st.integers(0, 2), st.sampled_from([25, 50, 100]),
                    st.sampled_from([2048, 4096, 8192]))
bounds = st.one_of(st.just("all"), st.integers(1, 2 * NODES).map(str),
                   st.sampled_from(["1%", "10%", "50%", "100%"]))


def policies():
    return [BestFit(), Utilization(), Greedy(), FirstFit(), FragmentationGradientDescent(FGD.distribution)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), demands, bounds, st.integers(0, 3))
def test_candidates_are_feasible_and_all_of_them_when_the_bound_covers_them(data, demand, text, seed):
    state = gpu_state(data)
    mask = state.feasible(demand)
    nodes_to_score = NodesToScore.parse(text)
    for policy in policies():
        bounded = bound(policy, nodes_to_score, seed)
        nodes = candidates(bounded, mask)
        feasible = np.flatnonzero(mask)
        assert mask[nodes].all()  # never an infeasible node
        assert len(np.unique(nodes)) == len(nodes) == nodes_to_score.limit(len(feasible))
        choice = select(bounded, state, demand, mask)
        assert (choice is None) == (len(feasible) == 0)
        if choice is not None:
            assert mask[choice.node]
        if nodes_to_score.limit(len(feasible)) >= len(feasible):  # the sample covers every feasible node
            assert np.array_equal(nodes, feasible)
            full = bound(type(policy)() if not isinstance(policy, FragmentationGradientDescent)
                         else FragmentationGradientDescent(FGD.distribution), "all")
            unbounded = select(full, state, demand, mask)
            if choice is not None:  # the best node is in the set, so it is chosen: the unbounded decision
                scores = np.asarray(full.scores(state, demand, mask))[feasible]
                best = feasible[np.lexsort((feasible, -scores))[0]]
                assert choice.node == unbounded.node == best
                assert choice.alternatives == unbounded.alternatives


@settings(max_examples=40, deadline=None)
@given(st.data(), demands)
def test_sampled_scoring_equals_full_scoring_on_the_same_nodes(data, demand):
    state = gpu_state(data)
    mask = state.feasible(demand)
    nodes = np.flatnonzero(mask)
    if len(nodes) == 0:
        return
    nodes = nodes[:: 2] if len(nodes) > 1 else nodes
    for policy in policies():
        np.testing.assert_array_equal(policy.scores_at(state, demand, nodes), policy.scores(state, demand, mask)[nodes])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), demands)
def test_actor_inputs_of_a_sample_are_the_rows_of_every_hosts_inputs(data, demand):
    """EADE-DDPG's inputs on a sample (per-card rows by `take`) are, byte for byte, the rows of those for every
    host; one cluster's eq.16 score is 1; a resource a cluster lacks (NaN) has free share 0."""
    from hsched.envs.gpu import free_shares, host_hints, placement_scores
    from hsched.metrics import utilisation_matrix
    from hsched.rl.ddpg import PolicyInputs

    state = gpu_state(data)
    nodes = np.flatnonzero(np.array(data.draw(st.lists(st.booleans(), min_size=NODES, max_size=NODES))))
    items, task = PolicyInputs()(state, demand, nodes)
    every, task_all = PolicyInputs()(state, demand)
    assert items.tobytes() == np.concatenate([every[nodes], every[-1:]]).tobytes()
    assert task.tobytes() == task_all.tobytes()
    u = utilisation_matrix([state])
    totals = np.array([[4 * NODES * 16384, 4 * NODES * 100, 1, 1]], dtype=np.float64)
    hc = np.zeros(NODES, dtype=np.int64)
    assert host_hints(state, demand, u, totals, hc, nodes).tobytes() == \
        host_hints(state, demand, u, totals, hc)[nodes].tobytes()
    assert placement_scores(u, totals, demand).tolist() == [1.0]
    assert free_shares(np.array([[0.25, np.nan, 1.0, 0.0]])).tolist() == [[0.75, 0.0, 0.0, 1.0]]


@settings(max_examples=40, deadline=None)
@given(st.data(), demands.filter(lambda d: d.gpu_count > 0))
def test_vectorised_card_choice_is_choose_cards(data, demand):
    state = gpu_state(data)
    nodes = np.flatnonzero(state.feasible(demand))
    if len(nodes) == 0:
        return
    rows, cards = chosen_cards(state.gpu_free_core[nodes], state.gpu_free_memory[nodes], demand)
    for i, node in enumerate(nodes):
        expected = sorted(s.card for s in state.choose_cards(int(node), demand))
        assert sorted(cards[rows == i].tolist()) == expected


def test_nodes_to_score_parse_and_limit():
    assert NodesToScore.parse("all").limit(5000) == 5000
    assert NodesToScore.parse(None).limit(7) == 7
    assert NodesToScore.parse("256").limit(5000) == 256 and NodesToScore.parse("256").limit(100) == 100
    assert NodesToScore.parse("10%").limit(5000) == 500  # ceil(10 % of 5 000)
    assert NodesToScore.parse("10%").limit(300) == MIN_NODES_TO_SCORE == 100  # kube's floor of 100 nodes
    assert NodesToScore.parse("10%").limit(40) == 40
    assert str(NodesToScore.parse("100%")) == "all" and str(NodesToScore.parse(" 12 ")) == "12"
    for bad in ("0", "0%", "101%", "-3", "x", "1.5"):
        with pytest.raises(ValueError, match="nodes_to_score: .* must be 'all', a node count >= 1 or a percentage"):
            NodesToScore.parse(bad)


def test_a_sample_is_uniform_over_the_feasible_nodes_and_reproducible():
    state = ClusterState(CPU_DC)
    state.free_cpu[3] = 0  # node 3 cannot take the demand
    demand = Resources(2000, 1024)
    mask = state.feasible(demand)
    draws = [candidates(bound(BestFit(), "4", seed=1), mask) for _ in range(2)]
    assert np.array_equal(draws[0], draws[1])  # same seed, same first sample
    sampler = bound(BestFit(), "4", seed=1)
    counts = np.bincount(np.concatenate([candidates(sampler, mask) for _ in range(2200)]), minlength=NODES)
    assert counts[3] == 0
    share = counts[mask] / counts.sum()  # each of the 11 feasible nodes in 4/11 of the samples
    assert np.all(np.abs(share - 1 / 11) < 0.02)


class _Spy:
    """A learned-like policy with a fixed input size that records how many nodes it scored."""

    name = "spy"
    candidate_limit = 5

    def __init__(self) -> None:
        self.seen: list[int] = []

    def scores(self, state, demand, mask):
        self.seen.append(int(mask.sum()))
        return np.zeros(state.n)

    def scores_at(self, state, demand, nodes):
        self.seen.append(len(nodes))
        return -np.asarray(nodes, dtype=np.float64)

    def placed(self, node):
        pass


def test_a_policy_with_a_candidate_limit_never_scores_more_nodes():
    state = ClusterState(CPU_DC)
    spy = _Spy()
    demand = Resources(1000, 1024)
    choice = select(spy, state, demand, state.feasible(demand))
    assert spy.seen == [5] and choice is not None
    bound(spy, "3")  # the tighter of the two wins
    select(spy, state, demand, state.feasible(demand))
    bound(spy, "all")
    state.free_cpu[:9] = 0  # 3 feasible nodes, under the limit: scored as without a bound (full scores)
    select(spy, state, demand, state.feasible(demand))
    assert spy.seen == [5, 3, 3]


def test_numpy_forwards_match_the_torch_networks():
    torch.manual_seed(0)
    items, task = torch.rand(1, 30, 7), torch.rand(1, 4)
    pooled = PooledScorer(7, 4, embed=16, hidden=(32, 32)).eval()
    attention = SelfAttentionScorer(7, 4, embed=16, heads=2).eval()
    with torch.no_grad():
        for net, fast in ((pooled, PooledNumpy(pooled)), (attention, AttentionNumpy(attention))):
            expected = net(items, task)[0].numpy()
            got = fast(items[0].numpy(), task[0].numpy())
            np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)
            assert np.argmax(got) == np.argmax(expected)


def test_double_dqn_scores_a_sample_with_the_network_it_was_trained_with():
    from hsched.rl.ddqn import DoubleDqnPolicy, PlacementQ

    torch.manual_seed(0)
    policy = DoubleDqnPolicy(PlacementQ(16, (32, 32)), CPU_DC)
    state = ClusterState(CPU_DC)
    state.free_cpu[:] = np.arange(NODES) % 8 * 1000
    demand = Resources(1000, 1024)
    every = np.arange(NODES)
    # the numpy path over every node = the torch network over the room (up to float32 rounding)
    np.testing.assert_allclose(policy.q_values(state, demand, every), policy.q_values(state, demand), atol=1e-5)
    assert policy.scores_at(state, demand, every[::3]).shape == (4,)
    assert DoubleDqnPolicy.candidate_limit == 672


def test_actor_scores_a_sample_with_attention_over_the_sample():
    from hsched.rl.ddpg import Actor, ActorPolicy

    torch.manual_seed(0)
    policy = ActorPolicy(Actor(16, 2), "eade-ddpg")
    state = ClusterState(GPU_DC)
    state.free_cpu[:] = (np.arange(NODES) % 8 + 1) * 1000
    demand = Resources(1000, 1024, 0, 0, 1, 50, 4096)
    every = np.arange(NODES)
    np.testing.assert_allclose(policy.scores_at(state, demand, every),
                               policy.scores(state, demand, np.ones(NODES, bool)), atol=1e-5)
    assert policy.scores_at(state, demand, every[:4]).shape == (4,)
    assert ActorPolicy.candidate_limit == 64


def test_placer_and_up_refuse_a_bad_nodes_to_score(capsys):
    from hsched.cli import main as hsched_main
    from services.placer.server import main as placer_main

    with pytest.raises(SystemExit) as exc:
        placer_main(["--datacenter", "chicago", "--nodes-to-score", "0%"])
    assert exc.value.code == 2
    assert "--nodes-to-score: '0%' must be 'all', a node count >= 1 or a percentage" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        hsched_main(["up", "--nodes-to-score", "many"])
    assert exc.value.code == 2
    assert "argument --nodes-to-score: 'many' must be" in capsys.readouterr().err


@settings(max_examples=60, deadline=None)
@given(st.data(), demands)
def test_part_power_equals_eq5_and_busy_gpu_equals_the_card_sums(data, demand):
    """The per-table cached part power is server_power's formula, bit for bit, for every node or one; the
    guard's busy GPU percent (capacity minus free, column loops) is the per-node sum over the cards; the
    utilisation from the cached capacities is the one from summing them each time."""
    from hsched.domain.fleet import load_fleet
    from hsched.policies.placement import part_power_w
    from hsched.thermal import server_power

    dc = load_fleet(None).datacenter(data.draw(st.sampled_from(["kansas-city", "chicago"])))
    state = ClusterState(dc)
    t = state.table
    want = server_power(demand.cpu_milli, t.cpu_milli, 0.0, t.p_full_w - t.p_idle_w)
    if demand.gpu_count:
        want = want + demand.gpu_units * (t.gpu_full_w - t.gpu_idle_w)
    assert part_power_w(state, demand).tobytes() == want.tobytes()
    node = data.draw(st.integers(0, state.n - 1))
    assert part_power_w(state, demand, node).tobytes() == want[node:node + 1].tobytes()
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    state.gpu_free_core[:] = (t.gpu_core_percent * rng.random(t.gpu_core_percent.shape)).astype(np.int64)
    assert np.array_equal(state.busy_gpu_percent(), (t.gpu_core_percent - state.gpu_free_core).sum(axis=1))
    state.free_cpu[:] = (t.cpu_milli * rng.random(state.n)).astype(np.int64)
    for key, free, cap in (("cpu", state.free_cpu, t.cpu_milli), ("memory", state.free_memory, t.memory_mib),
                           ("gpu_core", state.gpu_free_core, t.gpu_core_percent),
                           ("gpu_memory", state.gpu_free_memory, t.gpu_memory_mib)):
        total = int(cap.sum())  # utilisation as before capacity() cached the totals
        assert state.utilisation()[key] == (float(1 - free.sum() / total) if total else 0.0)


@settings(max_examples=60, deadline=None)
@given(st.data(), demands)
def test_a_plan_prices_its_parts_as_the_engine_did(data, demand):
    """Plan.part_power_w (what the placer's batch takes off its headroom) is part_power_w of each part's own
    demand on its node, bit for bit: the engine priced every part again this way before plan() handed it on."""
    from hsched.domain.task import TaskSpec
    from hsched.engine.placer import _demand_of
    from hsched.policies.placement import Outcome, part_power_w, plan

    state = ClusterState(data.draw(st.sampled_from([GPU_DC, CPU_DC])))
    if not demand.cpu_milli and not demand.gpu_count:
        demand = Resources(1000, 1024)
    replicas = data.draw(st.integers(1, 3))
    headroom = np.full(state.n, data.draw(st.sampled_from([np.inf, 5e3, 400.0])))
    decision = plan(state, TaskSpec(resources=demand, runtime_s=0.0, replicas=replicas), BestFit(), headroom)
    if decision.outcome is not Outcome.PLACED:
        return
    assert len(decision.part_power_w) == len(decision.parts) >= replicas
    for p, watts in zip(decision.parts, decision.part_power_w, strict=True):
        assert np.float64(watts).tobytes() == part_power_w(state, _demand_of(p), p.node)[0].tobytes()
    assert plan(state, TaskSpec(resources=demand, runtime_s=0.0, replicas=replicas), BestFit()).part_power_w == ()


def _attention_as_first_written(fast: AttentionNumpy, items: np.ndarray, task: np.ndarray) -> np.ndarray:
    """AttentionNumpy's forward as it was first written: ndarray.mean / .max / .sum and the logits divided by √d
    (on `fast`'s weights, which must be unfolded: AttentionNumpy(net, fold=False))."""
    from hsched.rl.nets import SERVE_DECIMALS

    n, f = items.shape
    in_w, out_w, layers = fast._contiguous if n >= fast.CONTIGUOUS_ROWS else (fast.in_w, fast.out_w, fast.layers)
    h = items @ fast.embed_w[:f]
    h += task @ fast.embed_w[f:] + fast.embed_b
    np.maximum(h, 0.0, out=h)
    e = h.shape[1]
    d = e // fast.heads
    qkv = h @ in_w
    qkv += fast.in_b
    qkv = qkv.reshape(n, 3, fast.heads, d).transpose(1, 2, 0, 3)
    logits = qkv[0] @ qkv[1].transpose(0, 2, 1)
    logits /= np.float32(np.sqrt(d))
    logits -= logits.max(axis=-1, keepdims=True)
    np.exp(logits, out=logits)
    logits /= logits.sum(axis=-1, keepdims=True)
    x = (logits @ qkv[2]).transpose(1, 0, 2).reshape(n, e) @ out_w
    x += fast.out_b
    x += h
    x -= x.mean(axis=-1, keepdims=True)
    var = np.square(x).mean(axis=-1, keepdims=True)
    var += np.float32(fast.eps)
    x /= np.sqrt(var)
    x *= fast.norm_w
    x += fast.norm_b
    z = x
    for i, (w, b) in enumerate(layers):
        if i:
            np.maximum(z, 0.0, out=z)
        z = z @ w
        z += b
    return np.round(z[:, 0], SERVE_DECIMALS)


def test_attention_serving_is_its_first_formula_bit_for_bit():
    """The served attention (1/√d folded into the query weights when √d is a power of two, the reductions called
    directly) gives the scores of the plain formula bit for bit, on the shipped EADE-DDPG actor and on random
    networks, across the row counts where OpenBLAS changes kernels; √d = 3 is not folded."""
    from hsched.rl.checkpoint import model_path
    from hsched.rl.ddpg import load_actor

    torch.manual_seed(0)
    shipped, _ = load_actor(model_path("eade_ddpg_gpu"))
    nets = [(shipped.scorer, True), (SelfAttentionScorer(15, 5, embed=64, heads=4).eval(), True),
            (SelfAttentionScorer(7, 4, embed=32, heads=2).eval(), True),
            (SelfAttentionScorer(7, 4, embed=18, heads=2).eval(), False)]
    rng = np.random.default_rng(0)
    for net, folds in nets:
        fast, plain = AttentionNumpy(net), AttentionNumpy(net, fold=False)
        assert fast.folded is folds and not plain.folded
        for n in (1, 5, 19, 20, 63, 64, 65, 200):
            items = rng.random((n, net.item_features), dtype=np.float32)
            task = rng.random(net.task_features, dtype=np.float32)
            want = _attention_as_first_written(plain, items, task)
            assert fast(items, task).tobytes() == want.tobytes()
            assert plain(items, task).tobytes() == want.tobytes()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), demands)
def test_utilization_fit_is_the_cosine_of_the_stacked_fractions_bit_for_bit(data, demand):
    """Utilization sums its columns left to right: the floats of np.add.reduce / .sum over the stacked [n, d]
    fractions (the formula it had)."""
    from hsched.policies.heuristics import _fractions

    state = gpu_state(data)
    nodes = np.flatnonzero(np.array(data.draw(st.lists(st.booleans(), min_size=NODES, max_size=NODES))))
    for at in (nodes, None):
        free, want = _fractions(state, demand, at)
        norm = np.sqrt(np.add.reduce(free * free, axis=1)) * np.sqrt(np.add.reduce(want * want, axis=1))
        expected = np.where(norm > 0, (free * want).sum(axis=1) / np.maximum(norm, 1e-12), 0.0)
        assert Utilization().scores_at(state, demand, at).tobytes() == expected.tobytes()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), demands)
def test_actor_inputs_written_in_place_are_items_from_the_feature_functions(data, demand):
    """PolicyInputs writes the host features and hints into its item rows: the bytes of items_from over what
    host_features and host_hints return; the task's features, memoised per demand, are demand_features' and a
    caller writing to them does not change the next decision's."""
    from hsched.envs.gpu import (
        demand_features,
        free_shares,
        host_features,
        host_hints,
        host_scale,
        task_scale,
    )
    from hsched.metrics import utilisation_matrix
    from hsched.rl.ddpg import PolicyInputs, items_from

    state = gpu_state(data)
    nodes = np.flatnonzero(np.array(data.draw(st.lists(st.booleans(), min_size=NODES, max_size=NODES))))
    inputs = PolicyInputs()
    u = utilisation_matrix([state])
    totals = np.array([[4 * NODES * 16384, 4 * NODES * 100, NODES * 8000, NODES * 64 * 1024]], dtype=np.float64)
    hc = np.zeros(NODES, dtype=np.int64)
    for rows, at in ((nodes, nodes), (slice(None), None)):
        items, task = inputs(state, demand, at)
        want = items_from(host_features(state, host_scale(state.table), rows), free_shares(u)[hc[rows]],
                          host_hints(state, demand, u, totals, hc, at))
        assert items.tobytes() == want.tobytes()
        assert task.tobytes() == demand_features([demand], task_scale(state.table))[0].tobytes()
        task[:] = 7.0
        assert inputs(state, demand, at)[1].tobytes() == demand_features([demand], task_scale(state.table))[0].tobytes()


def test_a_plan_leaves_the_callers_headroom_alone_and_the_power_memo_read_only():
    """plan() takes each part's power off its own copy of the headroom, never off the caller's; the memoised CPU power per cpu_milli cannot be written through what part_power_w returns."""
    from hsched.domain.task import TaskSpec
    from hsched.policies.placement import Outcome, part_power_w, plan

    state = ClusterState(CPU_DC)
    headroom = np.full(state.n, 1e4)
    before = headroom.copy()
    decision = plan(state, TaskSpec(resources=Resources(4000, 1024), runtime_s=0.0, replicas=3), BestFit(), headroom)
    assert decision.outcome is Outcome.PLACED and len(decision.parts) == 3
    assert headroom.tobytes() == before.tobytes()
    power = part_power_w(state, Resources(4000, 1024))
    assert power is part_power_w(state, Resources(4000, 0)) and not power.flags.writeable
    with pytest.raises(ValueError):
        power[0] = 1.0
