"""hsched.rl.dqn: the DQN / PER-DQN path agents — targets by hand, masks, learning, resume, serving."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import urllib.request
from contextlib import asynccontextmanager

import grpc
import networkx as nx
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hsched.costs import WanGraph
from hsched.costs.selection import no_longer
from hsched.domain.errors import ValidationError
from hsched.domain.fleet import Link, Wan, load_fleet
from hsched.engine.selector import DcSelector
from hsched.envs.path import PathEnv
from hsched.envs.path_features import LINK_FEATURES, GraphFeatures
from hsched.rl import checkpoint
from hsched.rl.buffers import PrioritizedReplayBuffer
from hsched.rl.checkpoint import training_path
from hsched.rl.dqn import (
    ARCHITECTURE,
    DEFAULT_FLEET,
    TRAIN_GRAPHS,
    DqnConfig,
    FeatureCache,
    ModelMismatch,
    PathPlanner,
    Trainer,
    evaluate_graph,
    greedy_tables,
    load_graph,
    load_path_finder,
    plan,
    train,
    training_graphs,
)
from hsched.rl.training import TrainArgs
from hsched.state.keys import Keys
from hsched.state.redis import connect, free_port
from hsched.v1 import common_pb2, selector_pb2, selector_pb2_grpc
from tests import inprocess
from tests.conftest import SMALL_FLEET
from tests.test_env_path import random_wans
from tests.test_rl_ddqn import Killed, kill_at_save

# a short budget that solves the 4-vertex small fleet and the 5-vertex graph below (seconds on one core)
TINY = DqnConfig(steps=3000, learning_starts=200, buffer_size=5000, eps_steps=1500, target_every=100,
                 lr_end=1e-4, lr_steps=3000, per_beta_steps=3000, eval_every=250, stop_after_solved=3,
                 curriculum_steps=0)


def five_vertex_graph() -> WanGraph:
    """s ─2─ a ─0.5─ b ─4─ s, c ─1─ a, d ─1─ c, d ─3─ b: fewest hops and lowest latency differ (s→b, s→d)."""
    links = (Link("s", "a", 1, 2.0), Link("a", "b", 1, 0.5), Link("b", "s", 1, 4.0), Link("c", "a", 1, 1.0),
             Link("d", "c", 1, 1.0), Link("d", "b", 1, 3.0))
    return WanGraph(Wan(vertices={v: (0.0, 0.0) for v in "sabcd"}, links=links, scheduler_vertex="s",
                        entry_vertices=tuple("sabcd")))


# ------------------------------------------------------------------------------------------------------------
# graph-relative features and masking


@pytest.mark.parametrize("make", [five_vertex_graph, lambda: WanGraph(load_fleet().wan)], ids=["five", "abilene"])
def test_features_have_graph_free_shapes_and_mask_exactly_the_links(make) -> None:
    graph = make()
    feats = GraphFeatures(graph)
    n, links = len(graph.vertices), graph.graph.number_of_edges()
    assert feats.edges == 2 * links  # each link both ways
    env = PathEnv(graph, list(graph.vertices), reward="latency")
    assert feats.link_x.shape == (2 * links, LINK_FEATURES)
    for i, (u, v) in enumerate(zip(feats.src, feats.dst, strict=True)):
        assert feats.link(int(u), int(v)) == i
    linked = set(zip(feats.src.tolist(), feats.dst.tolist(), strict=True))
    for u in range(n):  # every other pair has no link row
        for v in range(n):
            if (u, v) not in linked:
                with pytest.raises(KeyError):
                    feats.link(u, v)
    for u, name in enumerate(graph.vertices):
        target = graph.vertices[(u + 1) % n]
        _, info = env.reset(options={"start": name, "target": target})
        np.testing.assert_array_equal(feats.mask(u), info["action_mask"])  # the env's own mask
        assert {graph.vertices[v] for v in feats.neighbours(u)} == set(graph.graph.adj[name])


def test_features_are_relative_to_the_graph_scale() -> None:
    feats = GraphFeatures(five_vertex_graph())
    # latencies 2, 0.5, 4, 1, 1, 3 ms: median 1.5 ms is one unit; s → a (2 ms) is 4/3 units
    assert feats.scale_ms == 1.5
    s, a = feats.index["s"], feats.index["a"]
    row = feats.link_x[feats.link(s, a)]
    assert row[0] == pytest.approx(2.0 / 1.5)
    assert row[1] == 0.0  # all five vertices sit at (0, 0): no great-circle length
    # Abilene: New York – Chicago is 1 147 km great-circle = 5.73 ms; its length feature is that / scale
    abilene = GraphFeatures(WanGraph(load_fleet().wan))
    ny, chi = abilene.index["New York"], abilene.index["Chicago"]
    assert abilene.link_x[abilene.link(ny, chi), 1] == pytest.approx(5.729193857549388 / abilene.scale_ms,
                                                                          rel=1e-5)


def test_the_planner_computes_shortest_costs_by_hand() -> None:
    graph = five_vertex_graph()
    feats = GraphFeatures(graph)
    batch = FeatureCache([feats]).batch([(0, feats.index["s"])])
    cost = torch.from_numpy(feats.w * 1.5)  # the latencies in ms: C = Dijkstra distances to s in ms
    to_go = plan(cost, batch)
    # s ─2─ a ─0.5─ b ─4─ s, c ─1─ a, d ─1─ c, d ─3─ b
    expect = {"s": 0.0, "a": 2.0, "b": 2.5, "c": 3.0, "d": 4.0}
    assert {v: float(to_go[feats.index[v]]) for v in "sabcd"} == pytest.approx(expect)
    # the gradient of C(d) counts each link of d's way (d → c → a → s) once
    cost.requires_grad_(True)
    plan(cost, batch)[feats.index["d"]].backward()
    used = {(graph.vertices[u], graph.vertices[v]) for u, v, g in zip(feats.src, feats.dst, cost.grad, strict=True)
            if g > 0}
    assert used == {("d", "c"), ("c", "a"), ("a", "s")}


@settings(max_examples=25, deadline=None)
@given(wan=random_wans(), seed=st.integers(0, 2**16))
def test_the_planner_equals_dijkstra_over_any_positive_link_costs(wan: Wan, seed: int) -> None:
    graph = WanGraph(wan)
    feats = GraphFeatures(graph)
    rng = np.random.default_rng(seed)
    undirected: dict[frozenset, float] = {}  # one random cost per link, the same both ways
    costs = np.array([undirected.setdefault(frozenset((int(u), int(v))), rng.uniform(0.01, 5.0))
                      for u, v in zip(feats.src, feats.dst, strict=True)])

    g = nx.Graph()
    g.add_weighted_edges_from((int(u), int(v), c) for u, v, c in zip(feats.src, feats.dst, costs, strict=True))
    t = int(rng.integers(feats.n))
    exact = nx.single_source_dijkstra_path_length(g, t)
    to_go = plan(torch.tensor(costs, dtype=torch.float64), FeatureCache([feats]).batch([(0, t)]))
    for v in range(feats.n):
        assert float(to_go[v]) == pytest.approx(exact.get(v, 1e6), rel=1e-9)


@settings(max_examples=25, deadline=None)
@given(wan=random_wans(), seed=st.integers(0, 2**16))
def test_greedy_moves_only_follow_links(wan: Wan, seed: int) -> None:
    graph = WanGraph(wan)
    feats = GraphFeatures(graph)
    torch.manual_seed(seed)
    net = PathPlanner()
    for p in net.parameters():  # arbitrary values
        torch.nn.init.normal_(p)
    n = feats.n
    table = greedy_tables(net, FeatureCache([feats]), 0, range(n))
    for t in range(n):
        for u in range(n):
            assert feats.mask(u)[table[t, u]] == 1, (u, t)
    # any positive link costs: the greedy walk descends the planner's cost-to-go, so it never loops
    assert evaluate_graph(net, graph)["invalid"] == 0


def test_one_model_runs_on_graphs_of_different_sizes() -> None:
    torch.manual_seed(0)
    net = PathPlanner()
    for graph in (five_vertex_graph(), WanGraph(load_fleet().wan), load_graph("Uninett")):
        feats = GraphFeatures(graph)
        table = greedy_tables(net, FeatureCache([feats]), 0, range(feats.n))
        assert table.shape == (feats.n, feats.n)
        result = evaluate_graph(net, graph)
        n = len(graph.vertices)
        assert result["pairs"] == n * (n - 1)
        assert result["matched"] + result["invalid"] <= result["pairs"]


# ------------------------------------------------------------------------------------------------------------
# training


def test_the_training_graphs_hold_out_every_version_of_a_held_out_network() -> None:
    names = list(training_graphs(TRAIN_GRAPHS))
    assert names[0] == DEFAULT_FLEET and len(names) > 150  # the default WAN and the Zoo graphs of data/
    assert "Abilene" in names and "Deltacom" in names  # graphml/ and the archive
    assert not [n for n in names if n.startswith(("Uninett", "Geant", "Cernet", "Chinanet", "TataNld", "Gts"))]
    assert load_graph("TataNld").vertices.__len__() == 143  # read from the archive, largest linked part
    with pytest.raises(ValidationError, match="graph.*not a Topology Zoo graph"):
        load_graph("NoSuchNetwork")



@pytest.mark.parametrize("prioritized", [True, False], ids=["per-dqn", "dqn"])
def test_a_short_run_learns_every_dijkstra_path_of_a_five_vertex_graph(prioritized: bool) -> None:
    # no coordinates (all at 0, 0): the way must come from the learned cost-to-go, not geometry
    trainer = Trainer(dataclasses.replace(TINY, prioritized=prioritized), seed=0, graphs=[five_vertex_graph()])
    before = trainer.evaluate()
    assert before["pairs"] == 20 and before["matched"] < 20  # the untrained net does not route
    trainer.run(TINY.steps, show=False)
    after = trainer.evaluate()
    assert after["matched"] == 20 and after["invalid"] == 0
    assert trainer.solved_at is not None and trainer.solved_at <= TINY.steps
    returns = trainer.curve["return"]  # −latency/scale per link, +1 on arrival
    assert np.mean(returns[-50:]) > np.mean(returns[:50])


def test_a_short_run_on_other_graphs_improves_equality_on_a_held_out_graph() -> None:
    held_out = load_graph("Hibernia")
    config = dataclasses.replace(TINY, steps=2500, stop_after_solved=0, eval_every=10_000)
    trainer = Trainer(config, seed=0, graphs=[load_graph(g) for g in ("Abilene", "Sprint", "Garr200004")])
    before = evaluate_graph(trainer.q, held_out)
    trainer.run(config.steps, show=False)
    after = evaluate_graph(trainer.q, held_out)
    assert after["pairs"] == before["pairs"] == 15 * 14
    assert after["matched"] / after["pairs"] > before["matched"] / before["pairs"]


def test_per_buffer_gets_td_priorities() -> None:
    trainer = Trainer(dataclasses.replace(TINY, learning_starts=50), seed=0, graphs=[five_vertex_graph()])
    trainer.run(100, show=False)
    assert isinstance(trainer.buffer, PrioritizedReplayBuffer)
    leaves = np.asarray(trainer.buffer.tree.leaves[: trainer.buffer.size])
    assert len(np.unique(leaves)) > 10  # updated from TD errors, not the constant insertion priority
    assert trainer.buffer.beta > TINY.per_beta0


def small_config(**changes) -> DqnConfig:
    return dataclasses.replace(TINY, graphs=(SMALL_FLEET,), **changes)


def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path, monkeypatch) -> None:
    config = small_config(eval_every=100, stop_after_solved=0)
    train(config, TrainArgs(seed=3, steps=600, out=tmp_path / "straight.pt", progress=False))
    train(config, TrainArgs(seed=3, steps=250, out=tmp_path / "resumed.pt", progress=False))  # mid-episode
    half = checkpoint.load_state(tmp_path / "resumed.pt")
    assert half["step"] == 250
    assert checkpoint.load_metadata(tmp_path / "resumed.pt")["hyperparameters"]["steps"] == 250  # as run
    train(config, TrainArgs(seed=3, steps=600, out=tmp_path / "resumed.pt", resume=True, progress=False))
    a, b = checkpoint.load_state(tmp_path / "straight.pt"), checkpoint.load_state(tmp_path / "resumed.pt")
    assert a["step"] == b["step"] == 600
    assert checkpoint.load_metadata(tmp_path / "resumed.pt")["hyperparameters"]["steps"] == 600
    for key in ("q", "target"):
        for name, tensor in a[key].items():
            assert torch.equal(tensor, b[key][name]), (key, name)
    for field in ("obs", "actions", "rewards", "tree"):
        np.testing.assert_array_equal(a["buffer"][field], b["buffer"][field])
    # a run killed after its third periodic save (at every episode's end here) resumes from it, identically;
    # the finished model then holds the state and the periodic one is gone
    killed = TrainArgs(seed=3, steps=600, out=tmp_path / "killed.pt", progress=False, checkpoint_seconds=0)
    with monkeypatch.context() as m:
        kill_at_save(m, 3)
        with pytest.raises(Killed):
            train(config, killed)
    assert not killed.out.exists() and 0 < checkpoint.load_state(training_path(killed.out))["step"] < 600
    with pytest.raises(ValidationError, match=r"^--resume: .*killed.train.pt was trained with --seed 3; this run "
                                              r"asks --seed 4$"):
        train(config, dataclasses.replace(killed, seed=4, resume=True))
    train(config, dataclasses.replace(killed, resume=True))
    c = checkpoint.load_state(killed.out)
    assert not training_path(killed.out).exists() and c["step"] == 600
    for key in ("q", "target"):
        assert all(torch.equal(tensor, c[key][name]) for name, tensor in a[key].items()), key
    with pytest.raises(ValidationError, match=r"^--resume: nothing to resume: no training checkpoint at "
                                              r".*none.train.pt nor .*none.pt; train without --resume"):
        train(config, dataclasses.replace(killed, out=tmp_path / "none.pt", resume=True))
    assert a["curve"] == b["curve"] and a["evals"] == b["evals"] and a["envs"] == b["envs"]


def test_a_budget_that_ends_before_the_first_update_is_refused(tmp_path) -> None:
    config = small_config(learning_starts=300, train_every=1)
    with pytest.raises(ValidationError, match=r"^--steps: ends before the first gradient update, at env step 300 "
                                              r"\(learning_starts 300, train_every 1\): give --steps >= 300 \(got 299\)$"):
        train(config, TrainArgs(seed=0, steps=299, out=tmp_path / "m.pt", progress=False))
    assert not list(tmp_path.iterdir())


def test_training_writes_model_metadata_and_curve(tmp_path) -> None:
    figures = train(small_config(), TrainArgs(seed=0, out=tmp_path / "m.pt", compare=True, progress=False))
    meta = json.loads((tmp_path / "m.json").read_text())
    assert meta["agent"] == "per-dqn" and meta["seed"] == 0 and meta["architecture"] == ARCHITECTURE
    assert [g["vertices"] for g in meta["training_graphs"]] == [4]
    assert meta["hyperparameters"]["prioritized"] and meta["hyperparameters"]["steps"] == TINY.steps
    ev = meta["evaluation"]
    assert ev["paths_equal_dijkstra"] == ev["pairs"] == 12 and ev["solved_at_step"] <= TINY.steps
    assert set(meta["comparison"]) == {"per-dqn", "dqn"} and set(figures) >= {"per-dqn", "dqn", "model"}
    assert (tmp_path / "m_dijkstra.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "m_curve.png").read_bytes()[:4] == b"\x89PNG"


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("models") / "per_dqn_small.pt"
    figures = train(small_config(), TrainArgs(seed=0, out=out, progress=False))
    assert figures["per-dqn"]["paths_equal_dijkstra"] == figures["per-dqn"]["pairs"]
    return out


def test_load_path_finder_walks_the_learned_paths(small_model) -> None:
    graph = WanGraph(load_fleet(SMALL_FLEET).wan)
    finder = load_path_finder(small_model, graph)
    for src in graph.vertices:
        for dst in graph.vertices:
            assert finder.path(src, dst) == graph.dijkstra.path(src, dst)
    assert finder.path("s", "c") == ("s", "a", "b", "c")  # 1.5 ms over three links beats the 2.5 ms direct one


def test_the_model_loads_on_another_wan_and_an_old_one_hot_model_is_refused(small_model, tmp_path) -> None:
    graph = WanGraph(load_fleet().wan)  # 12 vertices; the model trained on 4: no vertex-count mismatch
    finder = load_path_finder(small_model, graph)
    for dst in graph.vertices:
        path = finder.path("scheduler", dst)
        assert path is None or (path[0], path[-1]) == ("scheduler", dst)
    old = tmp_path / "old.pt"
    torch.save({"q": {}}, old)
    old.with_suffix(".json").write_text(json.dumps({"agent": "per-dqn", "graph": {
        "source": "Topology Zoo: Abilene", "vertices": list(graph.vertices)}}))
    with pytest.raises(ModelMismatch, match="old one-hot format.*12 vertices.*retrain with `hsched train per-dqn`"):
        load_path_finder(old, graph)
    old.with_suffix(".json").write_text(json.dumps({"agent": "per-dqn", "architecture": "graph-relative-gnn-v1"}))
    with pytest.raises(ModelMismatch, match="architecture 'graph-relative-gnn-v1'.*retrain with `hsched train per-dqn`"):
        load_path_finder(old, graph)
    with pytest.raises(FileNotFoundError, match="no model at"):
        load_path_finder(tmp_path / "missing.pt", graph)


def test_the_selector_serves_the_model_on_another_wan_behind_the_guard(small_model) -> None:
    fleet = load_fleet()  # Abilene: the model never saw it
    graph = WanGraph(fleet.wan)
    finder = load_path_finder(small_model, graph)
    selector = DcSelector(fleet, graph=graph, path_finder=finder)
    for dc in fleet.datacenters:
        selector.update_summary({"datacenter": dc.name})
    ranked, _, _ = selector.select(one_core_task())
    assert ranked and selector.path_checks == len(ranked)
    for c in ranked:  # whatever the agent walked, what the selector uses is valid and as short as Dijkstra's
        best = graph.path_metrics(graph.dijkstra.path(fleet.wan.scheduler_vertex, c.vertex)).latency_ms
        assert graph.is_valid_path(c.path.vertices, fleet.wan.scheduler_vertex, c.vertex)
        assert no_longer(c.path.latency_ms, best)
        assert (c.path_source == "per-dqn") == (c.note == "")


# ------------------------------------------------------------------------------------------------------------
# serving in the selector


class Direct:
    """A path finder that takes the direct link when there is one: valid, but longer than Dijkstra's s → c."""

    name = "direct"

    def __init__(self, graph: WanGraph) -> None:
        self.graph = graph

    def path(self, src: str, dst: str) -> tuple[str, ...] | None:
        return (src, dst) if dst in self.graph.graph.adj[src] else self.graph.dijkstra.path(src, dst)


def test_the_selector_checks_every_agent_path_and_counts_agreement() -> None:
    fleet = load_fleet(SMALL_FLEET)
    graph = WanGraph(fleet.wan)
    selector = DcSelector(fleet, graph=graph, path_finder=Direct(graph))
    for dc in fleet.datacenters:
        selector.update_summary({"datacenter": dc.name})
    ranked, _, _ = selector.select(one_core_task())
    source = {c.datacenter: c.path_source for c in ranked}
    # s → b and s → a: the direct links are the shortest paths; s → c direct (2.5 ms) is longer than s-a-b-c
    assert source == {"cheap": "direct", "near": "direct", "gpu": "dijkstra"}
    gpu = next(c for c in ranked if c.datacenter == "gpu")
    assert gpu.path.vertices == ("s", "a", "b", "c") and "direct path 2.5 ms > dijkstra 1.5 ms" in gpu.note
    assert (selector.path_checks, selector.path_agreed) == (3, 2)
    selector.select(one_core_task(), "crf")  # crf's random paths are not the agent's: not counted
    assert (selector.path_checks, selector.path_agreed) == (3, 2)


def one_core_task():
    from hsched.domain.resources import Resources
    from hsched.domain.task import TaskSpec

    return TaskSpec(resources=Resources(cpu_milli=1000, memory_mib=1024), runtime_s=60.0, data_size_mb=100.0)


@asynccontextmanager
async def selector_service(redis_url: str, prefix: str, tmp_path, *extra: str):
    """The selector service in-process (services/selector/server.serve) on the real Redis, with the small
    fleet's placer summaries published; yields (stub, metrics URL)."""
    from services.selector import server

    fleet = load_fleet(SMALL_FLEET)
    redis = connect(redis_url)
    for dc in fleet.datacenters:
        await redis.xadd(Keys(prefix).summary(dc.name), {"s": json.dumps({"datacenter": dc.name})})
    metrics_port = free_port()
    argv = ["--fleet", SMALL_FLEET, "--redis-url", redis_url, "--prefix", prefix, "--metrics-port", str(metrics_port),
            *extra]
    try:
        async with inprocess.service(server, argv, tmp_path / "selector.port") as target, \
                grpc.aio.insecure_channel(target) as channel:
            yield selector_pb2_grpc.SelectorStub(channel), f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        await redis.aclose()


async def select_all(stub) -> dict[str, common_pb2.DcCandidate]:
    request = selector_pb2.SelectRequest(task=common_pb2.TaskSpec(
        resources=common_pb2.Resources(cpu_milli=1000, memory_mib=1024), runtime_s=60, data_size_mb=100))
    for _ in range(100):  # the selector reads the placers' summaries in the background after it starts
        response = await stub.SelectDataCenter(request, timeout=10)
        if len(response.candidates) == 3:
            break
        await asyncio.sleep(0.05)
    return {c.datacenter: c for c in response.candidates}


async def scrape(url: str) -> str:
    return (await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())).decode()


async def test_the_selector_service_routes_on_the_agent_and_exposes_agreement(small_model, redis_url, prefix,
                                                                              tmp_path) -> None:
    async with selector_service(redis_url, prefix, tmp_path, "--path-finder", "per-dqn",
                                "--path-model", str(small_model)) as (stub, metrics_url):
        by_dc = await select_all(stub)
        assert {dc: c.path.finder for dc, c in by_dc.items()} == dict.fromkeys(("cheap", "near", "gpu"), "per-dqn")
        assert list(by_dc["gpu"].path.vertices) == ["s", "a", "b", "c"]  # the agent's path = Dijkstra's
        await select_all(stub)
        text = await scrape(metrics_url)
    assert 'hsched_selector_path_agreement_ratio{finder="per-dqn"} 1.0' in text
    assert 'hsched_selector_path_checks_total{finder="per-dqn",outcome="used"} ' in text  # 6 or more (retries)
    assert 'hsched_selector_path_checks_total{finder="per-dqn",outcome="replaced"} 0.0' in text
    assert 'hsched_selector_path_finder_info{finder="per-dqn",requested="per-dqn"} 1.0' in text


async def test_the_selector_service_falls_back_to_dijkstra_without_a_model(redis_url, prefix, tmp_path,
                                                                           caplog) -> None:
    missing = tmp_path / "missing.pt"
    with caplog.at_level(logging.WARNING, logger="hsched.selector"):
        async with selector_service(redis_url, prefix, tmp_path, "--path-finder", "per-dqn",
                                    "--path-model", str(missing)) as (stub, metrics_url):
            by_dc = await select_all(stub)
            text = await scrape(metrics_url)
    assert {c.path.finder for c in by_dc.values()} == {"dijkstra"}
    assert list(by_dc["gpu"].path.vertices) == ["s", "a", "b", "c"]
    assert f"path finder per-dqn: no model at {missing}; routing on dijkstra instead" in caplog.text
    assert "hsched_selector_path_agreement" not in text
    assert 'hsched_selector_path_finder_info{finder="dijkstra",requested="per-dqn"} 1.0' in text
