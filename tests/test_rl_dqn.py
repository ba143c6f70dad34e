"""hsched.rl.dqn: the DQN / PER-DQN path agents — targets by hand, masks, learning, resume, serving."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import urllib.request
from contextlib import asynccontextmanager

import grpc
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from hsched.costs import WanGraph
from hsched.domain.fleet import Link, Wan, load_fleet
from hsched.engine.selector import DcSelector
from hsched.rl import checkpoint
from hsched.rl.buffers import PrioritizedReplayBuffer
from hsched.rl.dqn import (
    DqnConfig,
    ModelMismatch,
    Trainer,
    adjacency,
    greedy_table,
    load_path_finder,
    q_network,
    td_target,
    train,
)
from hsched.rl.schedules import epsilon_greedy
from hsched.rl.training import TrainArgs
from hsched.state.keys import Keys
from hsched.state.redis import connect, free_port
from hsched.v1 import common_pb2, selector_pb2, selector_pb2_grpc
from tests import inprocess
from tests.conftest import SMALL_FLEET
from tests.test_env_path import random_wans

# a short budget that solves the 4-vertex small fleet and the 5-vertex graph below (seconds on one core)
TINY = DqnConfig(steps=3000, learning_starts=200, buffer_size=5000, eps_steps=1500, target_every=100,
                 lr_end=1e-4, lr_steps=3000, per_beta_steps=3000, eval_every=250, stop_after_solved=3)


class Table(nn.Module):
    """Q(s, ·) = table[current vertex of s]: a 'network' whose values are set by hand."""

    def __init__(self, table: list[list[float]]) -> None:
        super().__init__()
        self.table = torch.tensor(table)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        n = self.table.shape[0]
        return obs[:, :n] @ self.table


def one_hot_obs(current: int, target: int, n: int) -> list[float]:
    obs = [0.0] * (2 * n)
    obs[current] = obs[n + target] = 1.0
    return obs


def test_double_and_plain_dqn_targets_on_a_hand_made_batch() -> None:
    # path graph 0 — 1 — 2: at vertex 1 the valid moves are 0 and 2, at vertex 0 only 1
    adj = torch.tensor([[0, 1, 0], [1, 0, 1], [0, 1, 0]], dtype=torch.bool)
    online = Table([[9.0, 2.0, 7.0], [1.0, 100.0, 3.0], [0.0, 0.0, 0.0]])
    target = Table([[8.0, -1.0, 6.0], [4.0, 50.0, 0.5], [0.0, 0.0, 0.0]])
    rewards = torch.tensor([-0.2, 1.0, 0.1])
    dones = torch.tensor([0.0, 1.0, 0.0])
    next_obs = torch.tensor([one_hot_obs(1, 2, 3), one_hot_obs(2, 2, 3), one_hot_obs(0, 2, 3)])
    # Double: a* = argmax of the ONLINE net over valid moves (vertex 1: move 2, 3.0 > 1.0; the masked 100 is
    # ignored), valued by the target net (0.5): −0.2 + 0.5 = 0.3. Done row: r only. Vertex 0: only move 1,
    # target value −1: 0.1 + 1 · (−1) = −0.9.
    double = td_target(rewards, dones, next_obs, online, target, adj, gamma=1.0, double=True)
    torch.testing.assert_close(double, torch.tensor([0.3, 1.0, -0.9]))
    # plain DQN: max of the TARGET net over valid moves (vertex 1: max(4.0, 0.5) = 4.0; the masked 50 ignored)
    plain = td_target(rewards, dones, next_obs, online, target, adj, gamma=1.0, double=False)
    torch.testing.assert_close(plain, torch.tensor([3.8, 1.0, -0.9]))
    half = td_target(rewards, dones, next_obs, online, target, adj, gamma=0.5, double=True)
    torch.testing.assert_close(half, torch.tensor([-0.2 + 0.25, 1.0, 0.1 - 0.5]))


@settings(max_examples=30, deadline=None)
@given(wan=random_wans(), seed=st.integers(0, 2**16), epsilon=st.floats(0.0, 1.0))
def test_masked_moves_are_never_chosen(wan: Wan, seed: int, epsilon: float) -> None:
    graph = WanGraph(wan)
    n = len(graph.vertices)
    adj = adjacency(graph)
    torch.manual_seed(seed)
    net = q_network(n)
    table = greedy_table(net, n, adj)  # what serving follows
    for t in range(n):
        for u in range(n):
            assert adj[u, table[t, u]], (u, t)
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        q = net(torch.eye(2 * n)[:n] + torch.eye(2 * n)[n:]).numpy()  # vertex u with target u: any Q row
    for u in range(n):
        for _ in range(10):  # what training follows: ε-greedy over the env's action mask
            assert adj[u, epsilon_greedy(q[u], epsilon, rng, mask=adj[u].numpy())]


def five_vertex_graph() -> WanGraph:
    """s ─2─ a ─0.5─ b ─4─ s, c ─1─ a, d ─1─ c, d ─3─ b: fewest hops and lowest latency differ (s→b, s→d)."""
    links = (Link("s", "a", 1, 2.0), Link("a", "b", 1, 0.5), Link("b", "s", 1, 4.0), Link("c", "a", 1, 1.0),
             Link("d", "c", 1, 1.0), Link("d", "b", 1, 3.0))
    return WanGraph(Wan(vertices={v: (0.0, 0.0) for v in "sabcd"}, links=links, scheduler_vertex="s",
                        entry_vertices=tuple("sabcd")))


@pytest.mark.parametrize("prioritized", [True, False], ids=["per-dqn", "dqn"])
def test_a_short_run_learns_every_dijkstra_path_of_a_five_vertex_graph(prioritized: bool) -> None:
    trainer = Trainer(dataclasses.replace(TINY, prioritized=prioritized), seed=0, graph=five_vertex_graph())
    before = trainer.evaluate()
    assert before["pairs"] == 20 and before["matched"] < 20  # the untrained net does not route
    trainer.run(TINY.steps, show=False)
    after = trainer.evaluate()
    assert after["matched"] == 20, after["misses"]
    assert trainer.solved_at is not None and trainer.solved_at <= TINY.steps
    # the curve: returns at the end beat those at the start (−latency/ref + 1 on arrival)
    returns = trainer.curve["return"]
    assert np.mean(returns[-50:]) > np.mean(returns[:50]) + 0.5


def test_per_buffer_gets_td_priorities() -> None:
    trainer = Trainer(dataclasses.replace(TINY, learning_starts=50), seed=0, graph=five_vertex_graph())
    trainer.run(100, show=False)
    assert isinstance(trainer.buffer, PrioritizedReplayBuffer)
    leaves = np.asarray(trainer.buffer.tree.leaves[: trainer.buffer.size])
    assert len(np.unique(leaves)) > 10  # updated from TD errors, not the constant insertion priority
    assert trainer.buffer.beta > TINY.per_beta0


def small_config(**changes) -> DqnConfig:
    return dataclasses.replace(TINY, graph=SMALL_FLEET, **changes)


def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path) -> None:
    config = small_config(eval_every=100, stop_after_solved=0)
    train(config, TrainArgs(seed=3, steps=600, out=tmp_path / "straight.pt", progress=False))
    train(config, TrainArgs(seed=3, steps=250, out=tmp_path / "resumed.pt", progress=False))  # mid-episode
    half = checkpoint.load_state(tmp_path / "resumed.pt")
    assert half["step"] == 250
    train(config, TrainArgs(seed=3, steps=600, out=tmp_path / "resumed.pt", resume=True, progress=False))
    a, b = checkpoint.load_state(tmp_path / "straight.pt"), checkpoint.load_state(tmp_path / "resumed.pt")
    assert a["step"] == b["step"] == 600
    for key in ("q", "target"):
        for name, tensor in a[key].items():
            assert torch.equal(tensor, b[key][name]), (key, name)
    for field in ("obs", "actions", "rewards", "tree"):
        np.testing.assert_array_equal(a["buffer"][field], b["buffer"][field])
    assert a["curve"] == b["curve"] and a["evals"] == b["evals"] and a["env"] == b["env"]


def test_training_writes_model_metadata_and_curve(tmp_path) -> None:
    figures = train(small_config(), TrainArgs(seed=0, out=tmp_path / "m.pt", compare=True, progress=False))
    meta = json.loads((tmp_path / "m.json").read_text())
    assert meta["agent"] == "per-dqn" and meta["seed"] == 0 and meta["graph"]["vertices"] == ["s", "a", "b", "c"]
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


def test_load_path_finder_refuses_another_wan_or_no_model(small_model, tmp_path) -> None:
    with pytest.raises(ModelMismatch, match="trained on 4 vertices"):
        load_path_finder(small_model, WanGraph(load_fleet().wan))
    with pytest.raises(FileNotFoundError, match="no model at"):
        load_path_finder(tmp_path / "missing.pt", WanGraph(load_fleet(SMALL_FLEET).wan))


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
    ranked, _ = selector.select(one_core_task())
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
