"""hsched.costs against hand-computed values (paper 003 eq.1-3, paper 002 path metrics)."""

from __future__ import annotations

import itertools
import math

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hsched.costs import (
    Candidate,
    DijkstraPathFinder,
    PathFinder,
    PathMetrics,
    RandomPathFinder,
    WanGraph,
    network_cost,
    rank_datacenters,
    resource_cost,
)
from hsched.domain.errors import ValidationError
from hsched.domain.fleet import DataCenter, Link, NodePool, Prices, RoomLayout, Wan
from hsched.domain.resources import Resources
from hsched.domain.task import NetworkRequirements, TaskSpec

# ------------------------------------------------------------------------------------------------------------
# fixtures built inline


def make_wan(links: list[Link], extra_vertices: tuple[str, ...] = (), scheduler: str = "s") -> Wan:
    names = dict.fromkeys([*(v for link in links for v in (link.a, link.b)), *extra_vertices])
    return Wan(vertices={v: (0.0, float(i)) for i, v in enumerate(names)}, links=tuple(links),
               scheduler_vertex=scheduler, entry_vertices=(scheduler,))


def make_dc(name: str, vertex: str, cpu_core_hour: float = 1.0) -> DataCenter:
    """A DC that charges only for CPU, so resource cost = cores × hours × cpu_core_hour."""
    p = Prices(cpu_core_hour=cpu_core_hour, memory_gib_hour=0.0, disk_gib_hour=0.0, bandwidth_mbps_hour=0.0)
    return DataCenter(name=name, vertex=vertex, prices=p, layout=RoomLayout(),
                      pools=(NodePool("std", 1, 24_000, 65_536, 0, 10_000),))


def small_wan() -> Wan:
    """s ─10─ d directly (1 hop), s ─2─ a ─3─ d (5 ms), s ─1─ b ─1.5─ a (so s-b-a-d = 5.5 ms)."""
    return make_wan([
        Link("s", "d", distance_km=2000, latency_ms=10.0),
        Link("s", "a", distance_km=400, latency_ms=2.0, bandwidth_mbps=1000, jitter_ms=0.5, loss_percent=1.0),
        Link("a", "d", distance_km=600, latency_ms=3.0, bandwidth_mbps=155, jitter_ms=0.25, loss_percent=1.0),
        Link("s", "b", distance_km=200, latency_ms=1.0, bandwidth_mbps=10_000, jitter_ms=0.1),
        Link("b", "a", distance_km=300, latency_ms=1.5),
    ])


def one_core_task(**kw: object) -> TaskSpec:
    return TaskSpec(resources=Resources(cpu_milli=1000), runtime_s=3600.0, **kw)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------------------
# eq.1 resource cost


PRICES = Prices(cpu_core_hour=0.05, memory_gib_hour=0.01, disk_gib_hour=0.0002, bandwidth_mbps_hour=0.001,
                gpu_hour=2.0)
TASK_RES = Resources(cpu_milli=4000, memory_mib=8 * 1024, disk_mib=100 * 1024, bandwidth_mbps=200,
                     gpu_count=1, gpu_core_percent=50, gpu_memory_mib=4096)


def test_resource_cost_eq1_by_hand() -> None:
    cost = resource_cost(PRICES, TASK_RES, runtime_s=7200.0)  # t = 2 h
    assert cost.cpu == pytest.approx(0.4)  # 2 h × 4 cores × 0.05
    assert cost.memory == pytest.approx(0.16)  # 2 h × 8 GiB (8192 MiB / 1024) × 0.01
    assert cost.disk == pytest.approx(0.04)  # 2 h × 100 GiB × 0.0002
    assert cost.bandwidth == pytest.approx(0.4)  # 2 h × 200 Mbit/s × 0.001
    assert cost.gpu == pytest.approx(2.0)  # 2 h × (1 GPU × 50 % = 0.5 card) × 2.0
    assert cost.total == pytest.approx(3.0)  # 0.4 + 0.16 + 0.04 + 0.4 + 2.0


def test_resource_cost_counts_replicas_through_task_total() -> None:
    task = TaskSpec(resources=TASK_RES, runtime_s=7200.0, replicas=3)
    cost = resource_cost(PRICES, task.total, task.runtime_s)
    # every part × 3; GPU: 3 slices × 50 % = 1.5 cards → 2 h × 1.5 × 2.0 = 6.0
    parts = (cost.cpu, cost.memory, cost.disk, cost.bandwidth, cost.gpu)
    assert parts == pytest.approx((1.2, 0.48, 0.12, 1.2, 6.0))
    assert cost.total == pytest.approx(9.0)  # 3 × 3.0


def test_resource_cost_rejects_bad_runtime() -> None:
    with pytest.raises(ValidationError, match="runtime_s"):
        resource_cost(PRICES, TASK_RES, -1.0)
    assert resource_cost(PRICES, TASK_RES, 0.0).total == 0.0


# ------------------------------------------------------------------------------------------------------------
# eq.2 network cost and path metrics


def test_network_cost_eq2_by_hand() -> None:
    # 0.01 per GB·ms × 2 500 MB (= 2.5 GB, decimal) × 5 ms = 0.125
    assert network_cost(0.01, 2500.0, 5.0) == pytest.approx(0.125)
    assert network_cost(0.01, 0.0, 5.0) == 0.0  # no data, no transfer cost


def test_path_metrics_compose_latency_jitter_loss_bottleneck() -> None:
    g = WanGraph(small_wan())
    m = g.path_metrics(["s", "a", "d"])
    assert m.vertices == ("s", "a", "d") and m.hops == 2
    assert m.latency_ms == pytest.approx(5.0)  # 2 + 3
    assert m.jitter_ms == pytest.approx(0.75)  # 0.5 + 0.25 (worst-case sum)
    assert m.loss_percent == pytest.approx(1.99)  # 1 − 0.99 × 0.99 = 0.0199 → 1.99 %, not 2 %
    assert m.bottleneck_bandwidth_mbps == 155  # min(1000, 155)
    assert g.path_metrics(["s", "d"]).bottleneck_bandwidth_mbps == 0  # bandwidth unknown on s–d
    assert g.path_metrics(["a"]) == PathMetrics(("a",), 0.0, 0.0, 0.0, 0.0, 0)  # DC on the entry vertex


def test_path_metrics_rejects_missing_edges_and_vertices() -> None:
    g = WanGraph(small_wan())
    with pytest.raises(ValueError, match=r"vertices\[1\].*linked to 'b'"):
        g.path_metrics(["b", "d"])
    with pytest.raises(ValueError, match=r"vertices\[0\]"):
        g.path_metrics(["nowhere", "s"])
    with pytest.raises(ValueError, match="vertices"):
        g.path_metrics([])


def test_is_valid_path() -> None:
    g = WanGraph(small_wan())
    assert g.is_valid_path(("s", "b", "a", "d"), "s", "d")
    assert g.is_valid_path(("s",), "s", "s")
    assert not g.is_valid_path(("s", "b", "d"), "s", "d")  # no b–d link
    assert not g.is_valid_path(("s", "a", "d"), "s", "a")  # wrong end
    assert not g.is_valid_path(("s", "a", "s", "d"), "s", "d")  # revisits s
    assert not g.is_valid_path((), "s", "d")
    assert not g.is_valid_path(("s", "x", "d"), "s", "d")  # unknown vertex


# ------------------------------------------------------------------------------------------------------------
# graph construction and run-time updates


@pytest.mark.parametrize("order", [1, -1])
def test_parallel_links_collapse_to_lowest_latency(order: int) -> None:
    links = [Link("s", "d", 800, latency_ms=10.0, jitter_ms=3.0, bandwidth_mbps=100),
             Link("d", "s", 800, latency_ms=4.0, jitter_ms=1.0, bandwidth_mbps=40)]
    g = WanGraph(make_wan(links[::order]))
    assert g.graph.number_of_edges() == 1
    kept = g.link("s", "d")
    # every metric comes from the 4 ms link, none mixed in from the 10 ms one
    assert (kept.latency_ms, kept.jitter_ms, kept.bandwidth_mbps) == (4.0, 1.0, 40)


def test_wan_links_must_name_vertices() -> None:
    wan = Wan(vertices={"s": (0, 0)}, links=(Link("s", "x", 1, 1.0),), scheduler_vertex="s",
              entry_vertices=("s",))
    with pytest.raises(ValidationError, match=r"wan.links\[0\].b"):
        WanGraph(wan)


def test_a_reset_puts_the_fleet_files_metrics_back() -> None:
    """(A probe's old override beat the fleet file for ever: the links stream is replayed at every start.)"""
    g = WanGraph(small_wan())
    filed = g.link("s", "a")
    assert g.update_link("s", "a", latency_ms=0.5, loss_percent=2.0) and g.link("s", "a").latency_ms == 0.5
    version = g.version
    assert g.update_link("a", "s", reset=True) and g.version == version + 1  # either direction names the link
    assert g.link("s", "a") == filed
    assert not g.update_link("s", "a", reset=True)  # nothing to change
    with pytest.raises(ValidationError, match="^reset: takes no metric with it"):
        g.update_link("s", "a", latency_ms=1.0, reset=True)


def test_update_link_validates_and_names_the_argument() -> None:
    g = WanGraph(small_wan())
    with pytest.raises(ValueError, match="^a: "):
        g.update_link("x", "s", latency_ms=1.0)
    with pytest.raises(ValueError, match="^b: "):
        g.update_link("s", "x", latency_ms=1.0)
    with pytest.raises(ValueError, match="^b: .*no b–d link"):
        g.update_link("b", "d", latency_ms=1.0)
    for arg in ("latency_ms", "jitter_ms", "loss_percent", "bandwidth_mbps"):
        with pytest.raises(ValueError, match=f"^{arg}: "):
            g.update_link("s", "a", **{arg: -0.5})
    with pytest.raises(ValueError, match="^loss_percent: must be <= 100"):
        g.update_link("s", "a", loss_percent=101.0)
    for arg in ("latency_ms", "jitter_ms"):
        with pytest.raises(ValueError, match=f"^{arg}: must be <= 60000"):
            g.update_link("s", "a", **{arg: 1e308})
    with pytest.raises(ValueError, match="^latency_ms: "):
        g.update_link("s", "a", latency_ms=math.nan)
    with pytest.raises(ValueError, match="^jitter_ms: "):  # nothing half-written: latency was valid
        g.update_link("s", "a", latency_ms=7.0, jitter_ms=-1.0)
    assert g.link("s", "a").latency_ms == 2.0 and g.version == 0


def test_update_link_bumps_version_only_on_change() -> None:
    g = WanGraph(small_wan())
    assert g.update_link("a", "s", jitter_ms=0.5) is False  # same value (either direction): caches survive
    assert g.version == 0
    assert g.update_link("a", "s", jitter_ms=0.9, loss_percent=2.0) is True
    assert g.version == 1
    assert (g.link("s", "a").jitter_ms, g.link("s", "a").loss_percent) == (0.9, 2.0)
    # path metrics cached before the update are not served after it
    assert g.path_metrics(["s", "a"]).jitter_ms == 0.9


# ------------------------------------------------------------------------------------------------------------
# path finders


def test_dijkstra_prefers_lower_latency_over_fewer_hops() -> None:
    g = WanGraph(small_wan())
    finder = DijkstraPathFinder(g)
    assert isinstance(finder, PathFinder)
    # candidates s→d: s-d = 10 ms (1 hop), s-a-d = 2 + 3 = 5 ms, s-b-a-d = 1 + 1.5 + 3 = 5.5 ms
    assert finder.path("s", "d") == ("s", "a", "d")
    assert finder.path("s", "s") == ("s",)
    with pytest.raises(ValueError, match="^dst: "):
        finder.path("s", "nowhere")
    with pytest.raises(ValueError, match="^src: "):
        finder.path("nowhere", "s")


def test_dijkstra_caches_per_source_and_invalidates_on_update() -> None:
    g = WanGraph(small_wan())
    finder = DijkstraPathFinder(g)
    for dst in ("a", "b", "d", "d"):
        finder.path("s", dst)
    assert finder.runs == 1  # one run per source vertex, every later request is a lookup
    finder.path("d", "s")
    assert finder.runs == 2
    g.update_link("s", "a", latency_ms=4.0)
    # now s-a-d = 4 + 3 = 7 ms, s-b-a-d = 1 + 1.5 + 3 = 5.5 ms, s-d = 10 ms
    assert finder.path("s", "d") == ("s", "b", "a", "d")
    assert finder.runs == 3
    g.update_link("s", "d", latency_ms=5.0)  # the direct link now wins: 5 < 5.5
    assert finder.path("s", "d") == ("s", "d")


def test_unreachable_vertex_has_no_path() -> None:
    g = WanGraph(make_wan(small_wan().links, extra_vertices=("island",)))
    assert g.dijkstra.path("s", "island") is None
    assert RandomPathFinder(g, seed=1).path("s", "island") is None


def test_random_path_is_simple_valid_and_seeded() -> None:
    g = WanGraph(small_wan())
    first = [RandomPathFinder(g, seed=7).path("s", "d") for _ in range(3)]
    assert len(set(first)) == 1  # same seed, same first draw
    finder = RandomPathFinder(g, seed=7)
    drawn = {finder.path("s", "d") for _ in range(200)}
    # the simple s→d paths are s-d, s-a-d and s-b-a-d; 200 draws must not all pick the same one
    assert len(drawn) >= 2
    assert all(p is not None and g.is_valid_path(p, "s", "d") for p in drawn)
    assert drawn <= {tuple(p) for p in nx.all_simple_paths(g.graph, "s", "d")}
    assert finder.path("b", "b") == ("b",)


def test_random_path_falls_back_to_dijkstra() -> None:
    g = WanGraph(small_wan())
    finder = RandomPathFinder(g, seed=0, max_attempts=0)
    assert finder.path("s", "d") == ("s", "a", "d")
    assert finder.fallbacks == 1


# ------------------------------------------------------------------------------------------------------------
# ranking (eq.3, CRF, SPF) and network-requirement filtering


def three_dc_fleet() -> tuple[WanGraph, list[DataCenter]]:
    """Entry e; DC A at x (1 ms), B at y (5 ms), C at z (20 ms direct, or 1 + 30 via x)."""
    wan = make_wan([Link("e", "x", 200, 1.0), Link("e", "y", 1000, 5.0), Link("e", "z", 4000, 20.0),
                    Link("x", "z", 6000, 30.0)], scheduler="e")
    return WanGraph(wan), [make_dc("A", "x", 100.0), make_dc("B", "y", 60.0), make_dc("C", "z", 10.0)]


def test_min_cost_crf_spf_disagree_on_hand_made_fleet() -> None:
    g, dcs = three_dc_fleet()
    task = one_core_task(data_size_mb=1000.0)  # 1 core × 1 h; 1 000 MB = 1 GB
    price = 5.0  # per GB·ms → network cost = 5 × 1 GB × latency = 5 × latency

    def rank(method: str) -> list[Candidate]:
        ranked, excluded = rank_datacenters(task, dcs, g, price, "e", method=method)
        assert excluded == []
        return ranked

    # resource: A 100, B 60, C 10 (1 core-hour × price); network: A 5×1 = 5, B 5×5 = 25, C 5×20 = 100
    # eq.3 totals: A 105, B 85, C 110
    best = rank("min-cost")
    assert [c.datacenter for c in best] == ["B", "A", "C"]
    assert [c.total for c in best] == pytest.approx([85.0, 105.0, 110.0])
    assert [c.network_cost for c in best] == pytest.approx([25.0, 5.0, 100.0])
    assert best[0].resource.cpu == pytest.approx(60.0) and best[0].path.vertices == ("e", "y")
    # CRF: cheapest compute first: C 10 < B 60 < A 100, whatever random path it drew
    crf = rank("crf")
    assert [c.datacenter for c in crf] == ["C", "B", "A"]
    assert all(c.path_source == "random" for c in crf)
    # C's random path is e-z (20 ms → 10 + 100 = 110) or e-x-z (31 ms → 10 + 155 = 165)
    expected_c_total = {("e", "z"): 110.0, ("e", "x", "z"): 165.0}[crf[0].path.vertices]
    assert crf[0].total == pytest.approx(expected_c_total)
    # SPF: nearest first: A 1 ms < B 5 ms < C 20 ms
    assert [c.datacenter for c in rank("spf")] == ["A", "B", "C"]


def test_a_task_that_runs_until_released_is_ranked_by_an_hour_of_its_price() -> None:
    g, dcs = three_dc_fleet()
    task = one_core_task(data_size_mb=1000.0)
    released = TaskSpec(resources=Resources(cpu_milli=1000), runtime_s=0.0, data_size_mb=1000.0)
    hour, _ = rank_datacenters(task, dcs, g, 5.0, "e")
    ranked, _ = rank_datacenters(released, dcs, g, 5.0, "e")
    # as the 1-hour task above: B 60 + 25, A 100 + 5, C 10 + 100 (not the network cost alone: A, B, C)
    assert [(c.datacenter, c.total) for c in ranked] == [(c.datacenter, c.total) for c in hour]
    assert [c.total for c in ranked] == pytest.approx([85.0, 105.0, 110.0])


def test_crf_random_paths_vary_with_a_long_lived_finder() -> None:
    g, dcs = three_dc_fleet()
    finder = RandomPathFinder(g, seed=3)
    seen = set()
    for _ in range(50):
        ranked, _ = rank_datacenters(one_core_task(data_size_mb=1000.0), dcs, g, 5.0, "e", method="crf",
                                     random_path_finder=finder)
        seen.add(ranked[0].path.vertices)  # C
    assert seen == {("e", "z"), ("e", "x", "z")}


def test_ties_break_by_name() -> None:
    g, _ = three_dc_fleet()
    dcs = [make_dc("zeta", "x", 1.0), make_dc("alpha", "x", 1.0)]
    ranked, _ = rank_datacenters(one_core_task(), dcs, g, 1.0, "e")
    assert [c.datacenter for c in ranked] == ["alpha", "zeta"]


def test_network_requirements_exclude_with_reasons() -> None:
    g = WanGraph(make_wan(small_wan().links, extra_vertices=("island",)))
    dcs = [make_dc("dc-a", "a"), make_dc("dc-b", "b"), make_dc("dc-d", "d"), make_dc("dc-s", "s"),
           make_dc("dc-island", "island"), make_dc("dc-ghost", "ghost")]
    # paths from s: a = s-a (2 ms, jitter 0.5, loss 1 %, 1000 Mbit/s), b = s-b (1 ms), s = (s,) (0 ms),
    # d = s-a-d (5 ms, jitter 0.75, loss 1.99 %, bottleneck 155 Mbit/s)
    task = TaskSpec(resources=Resources(cpu_milli=1000, bandwidth_mbps=100), runtime_s=3600.0, replicas=2,
                    network=NetworkRequirements(max_latency_ms=4.0, max_jitter_ms=0.6, max_loss_percent=1.5))
    ranked, excluded = rank_datacenters(task, dcs, g, 0.01, "s")
    assert sorted(c.datacenter for c in ranked) == ["dc-a", "dc-b", "dc-s"]
    assert dict(excluded) == {
        # requested bandwidth is the total: 2 replicas × 100 Mbit/s = 200 > 155
        "dc-d": "path latency 5 ms > max_latency_ms 4; path jitter 0.75 ms > max_jitter_ms 0.6; "
                "path loss 1.99 % > max_loss_percent 1.5; bottleneck bandwidth 155 Mbit/s < requested 200",
        "dc-island": "unreachable from s",
        "dc-ghost": "vertex 'ghost' is not in the WAN",
    }
    # 0 means no bound: with no requirements and no bandwidth only the unreachable ones go
    ranked, excluded = rank_datacenters(one_core_task(), dcs, g, 0.01, "s")
    assert len(ranked) == 4 and [name for name, _ in excluded] == ["dc-island", "dc-ghost"]


def test_requirements_judge_the_path_actually_used() -> None:
    g, dcs = three_dc_fleet()
    task = one_core_task(network=NetworkRequirements(max_latency_ms=25.0))
    # Dijkstra reaches C in 20 ms: kept
    ranked, _ = rank_datacenters(task, dcs, g, 1.0, "e")
    assert "C" in [c.datacenter for c in ranked]

    class ViaX:
        name = "detour"

        def path(self, src: str, dst: str) -> tuple[str, ...] | None:
            return ("e", "x", "z") if dst == "z" else g.dijkstra.path(src, dst)

    # CRF with a random path e-x-z (31 ms) must exclude C even though a 20 ms path exists
    ranked, excluded = rank_datacenters(task, dcs, g, 1.0, "e", method="crf", random_path_finder=ViaX())
    assert excluded == [("C", "path latency 31 ms > max_latency_ms 25")]


def test_rank_validates_method_and_entry_vertex() -> None:
    g, dcs = three_dc_fleet()
    with pytest.raises(ValidationError, match="^method: "):
        rank_datacenters(one_core_task(), dcs, g, 1.0, "e", method="cheapest")
    with pytest.raises(ValidationError, match="^entry_vertex: "):
        rank_datacenters(one_core_task(), dcs, g, 1.0, "mars")


def test_warm_request_runs_no_dijkstra() -> None:
    g, dcs = three_dc_fleet()
    task = one_core_task(data_size_mb=10.0)
    rank_datacenters(task, dcs, g, 1.0, "e")
    runs = g.dijkstra.runs
    for method in ("min-cost", "spf", "crf"):
        rank_datacenters(task, dcs, g, 1.0, "e", method=method)
    assert g.dijkstra.runs == runs == 1
    g.update_link("e", "y", latency_ms=50.0)  # a fresh tree is built once, then cached again
    ranked, _ = rank_datacenters(task, dcs, g, 1.0, "e")
    rank_datacenters(task, dcs, g, 1.0, "e")
    assert g.dijkstra.runs == 2
    b = next(c for c in ranked if c.datacenter == "B")
    # 1 × 0.01 GB × 50 ms = 0.5; total 60 + 0.5
    assert (b.path.latency_ms, b.network_cost, b.total) == pytest.approx((50.0, 0.5, 60.5))


class Scripted:
    """A stand-in for the learned agent that answers from a table."""

    name = "per-dqn"

    def __init__(self, paths: dict[str, tuple[str, ...] | None]) -> None:
        self.paths = paths

    def path(self, src: str, dst: str) -> tuple[str, ...] | None:
        return self.paths.get(dst)


def test_agent_paths_are_checked_against_dijkstra() -> None:
    g = WanGraph(small_wan())
    dcs = [make_dc("dc-a", "a"), make_dc("dc-b", "b"), make_dc("dc-d", "d"), make_dc("dc-s", "s")]
    agent = Scripted({"a": ("s", "a"),  # optimal: used as is
                      "b": ("s", "d", "b"),  # no d–b link: invalid
                      "d": ("s", "d"),  # valid but 10 ms > 5 ms
                      "s": None})  # no answer
    ranked, _ = rank_datacenters(one_core_task(), dcs, g, 1.0, "s", path_finder=agent)
    by_name = {c.datacenter: c for c in ranked}
    assert (by_name["dc-a"].path_source, by_name["dc-a"].note) == ("per-dqn", "")
    assert by_name["dc-b"].path.vertices == ("s", "b") and by_name["dc-b"].path_source == "dijkstra"
    assert by_name["dc-b"].note == "per-dqn gave an invalid path s→d→b; used dijkstra"
    assert by_name["dc-d"].path.vertices == ("s", "a", "d")
    assert by_name["dc-d"].note == "per-dqn path 10 ms > dijkstra 5 ms; used dijkstra"
    assert by_name["dc-s"].note == "per-dqn found no path; used dijkstra"


# ------------------------------------------------------------------------------------------------------------
# property: the min-cost ranking is optimal over every simple path


Fleetish = tuple[WanGraph, list[DataCenter], float, float]  # graph, DCs, price per GB·ms, data MB


@st.composite
def connected_fleets(draw: st.DrawFn) -> Fleetish:
    n = draw(st.integers(3, 7))
    names = [f"v{i}" for i in range(n)]
    latency = st.integers(1, 1000).map(lambda x: x / 10)  # 0.1 .. 100 ms
    # a random spanning tree keeps it connected; extra edges create alternative routes
    edges = {(names[draw(st.integers(0, i - 1))], names[i]) for i in range(1, n)}
    extra = draw(st.lists(st.tuples(st.sampled_from(names), st.sampled_from(names)), max_size=2 * n))
    edges |= {(a, b) for a, b in extra if a != b and (b, a) not in edges}
    links = [Link(a, b, 100.0, draw(latency)) for a, b in sorted(edges)]
    dcs = [make_dc(f"dc{i}", draw(st.sampled_from(names)), draw(st.integers(0, 100)) / 4)
           for i in range(draw(st.integers(1, 5)))]
    wan = Wan(vertices={v: (0.0, 0.0) for v in names}, links=tuple(links), scheduler_vertex="v0",
              entry_vertices=("v0",))
    return WanGraph(wan), dcs, draw(st.integers(0, 50)) / 10, draw(st.integers(0, 5000)) * 1.0


@settings(max_examples=150, deadline=None)
@given(connected_fleets())
def test_min_cost_is_minimal_over_all_simple_paths(fleet: Fleetish) -> None:
    g, dcs, price, data_mb = fleet
    task = one_core_task(data_size_mb=data_mb)
    ranked, excluded = rank_datacenters(task, dcs, g, price, "v0")
    assert excluded == [] and len(ranked) == len(dcs)

    def latencies(dst: str) -> list[float]:
        if dst == "v0":
            return [0.0]
        return [sum(g.graph.edges[a, b]["latency_ms"] for a, b in itertools.pairwise(p))
                for p in nx.all_simple_paths(g.graph, "v0", dst)]

    for dc in dcs:
        res = resource_cost(dc.prices, task.total, task.runtime_s).total
        for lat in latencies(dc.vertex):
            # the winner beats every DC on every route, and each DC's own path is its shortest
            assert ranked[0].total <= res + network_cost(price, data_mb, lat) + 1e-9
        mine = next(c for c in ranked if c.datacenter == dc.name)
        assert mine.path.latency_ms == pytest.approx(min(latencies(dc.vertex)))
    assert [c.total for c in ranked] == sorted(c.total for c in ranked)


def test_exclusion_summary_groups_dcs_by_reason_largest_first():
    from hsched.costs.selection import exclusion_summary

    excluded = [(dc, "the task needs 8 GPUs in all, the DC has 0 GPUs") for dc in ("ny", "chi", "dc-1", "sea", "la")]
    excluded += [(dc, f"no node of {dc} has GPU model A100") for dc in ("kc", "hou")]
    excluded += [("gpu", "no node of gpu has 4 GPUs (max 2)")]
    assert exclusion_summary(excluded) == (
        "5 DCs (ny, chi, dc-1, +2): the task needs 8 GPUs in all, the DC has 0 GPUs; "
        "2 DCs (kc, hou): no node of the DC has GPU model A100; gpu: no node of gpu has 4 GPUs (max 2)")
    assert exclusion_summary(excluded, shown_groups=1).endswith("; 2 more reason(s) in the task's explanation")
    # a DC's name inside another word is not the DC: "dc" in "dc-1" stays
    assert exclusion_summary([("dc", "dc-1 is busy"), ("x", "dc-1 is busy")]) == "2 DCs (dc, x): dc-1 is busy"


@given(st.lists(st.tuples(st.sampled_from(["a", "b-c", "d1", "ee", "f"]), st.integers(0, 3)), max_size=300))
def test_exclusion_summary_stays_short_however_many_dcs(rows):
    from hsched.costs.selection import exclusion_summary

    excluded = [(f"{name}{i}", f"reason {kind} of {name}{i}") for i, (name, kind) in enumerate(rows)]
    summary = exclusion_summary(excluded)
    assert len(summary) <= 3 * (len("999 DCs (, , , +999): reason 3 of the DC") + 3 * 8) + 60
    if excluded:  # the largest group leads, with its size
        sizes = {}
        for _, kind in rows:
            sizes[kind] = sizes.get(kind, 0) + 1
        top = max(sizes.values())
        assert summary.startswith(f"{top} DCs (") if top > 1 else summary.startswith(f"{excluded[0][0]}: ")
