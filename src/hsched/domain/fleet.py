"""The fleet: a WAN graph, data centers on its vertices, and inside each DC a room of racks of nodes.

A fleet is described in YAML (see docs/fleet.md and src/hsched/fleet/default.yaml) and loaded with
`load_fleet(path)`, which validates everything and raises FleetError naming the YAML path of the
first bad field. Nodes are laid out rack by rack (slot 0 at the bottom) in node-pool order, which is
what the thermal model's geometry needs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from hsched import yamlfile
from hsched.domain.errors import FleetError
from hsched.domain.resources import MIB_PER_GIB, MILLI, Resources

# Fibre propagation: light in glass covers ~200 km per ms (5 µs/km).
FIBRE_MS_PER_KM = 0.005
# one link's latency or jitter at most (a minute: no WAN link is slower), so that a path's sum stays finite and its
# costs comparable; a probe's or a fleet file's 1e308 ms made a path's latency inf and its network cost NaN
MAX_LINK_MS = 60_000.0
MAX_LINK_KM = 100_000.0  # (2.5 times around the Earth: any cable route)


@dataclass(frozen=True, slots=True)
class Prices:
    """Unit prices per hour (paper 003 eq.1 / table 3), in the fleet's currency."""

    cpu_core_hour: float
    memory_gib_hour: float
    disk_gib_hour: float
    bandwidth_mbps_hour: float
    gpu_hour: float = 0.0  # per whole-GPU equivalent (gpu_count × core% / 100)


@dataclass(frozen=True, slots=True)
class NodePool:
    name: str
    count: int
    cpu_milli: int
    memory_mib: int
    disk_mib: int
    bandwidth_mbps: int
    gpu_count: int = 0
    gpu_model: str = ""
    gpu_memory_mib: int = 0  # per card
    p_idle_w: float = 100.0
    p_full_w: float = 300.0
    gpu_idle_w: float = 0.0  # per card
    gpu_full_w: float = 0.0  # per card

    @property
    def capacity(self) -> Resources:
        return Resources(self.cpu_milli, self.memory_mib, self.disk_mib, self.bandwidth_mbps,
                         self.gpu_count, 100 if self.gpu_count else 0, self.gpu_memory_mib)


@dataclass(frozen=True, slots=True)
class RoomLayout:
    racks: int = 16
    servers_per_rack: int = 42
    rows: int = 2  # racks in rows facing hot/cold aisles

    @property
    def slots(self) -> int:
        return self.racks * self.servers_per_rack


@dataclass(frozen=True)
class NodeTable:
    """Per-node capacities as arrays (index = node id inside the DC), the shape placers and envs use."""

    names: tuple[str, ...]
    pool: np.ndarray  # int, index into DataCenter.pools
    rack: np.ndarray
    slot: np.ndarray
    cpu_milli: np.ndarray
    memory_mib: np.ndarray
    disk_mib: np.ndarray
    bandwidth_mbps: np.ndarray
    gpu_count: np.ndarray
    gpu_memory_mib: np.ndarray  # [n, max_gpus], 0 where the card does not exist
    gpu_core_percent: np.ndarray  # [n, max_gpus], 100 for existing cards, 0 otherwise
    gpu_model: tuple[str, ...]
    p_idle_w: np.ndarray
    p_full_w: np.ndarray
    gpu_idle_w: np.ndarray
    gpu_full_w: np.ndarray

    def __len__(self) -> int:
        return len(self.names)

    # Derived from the (never mutated) arrays and read by every decision: computed once per table.
    @cached_property
    def totals(self) -> dict[str, int]:
        """The room's total of each resource."""
        return {"cpu": int(self.cpu_milli.sum()), "memory": int(self.memory_mib.sum()),
                "gpu_core": int(self.gpu_core_percent.sum()), "gpu_memory": int(self.gpu_memory_mib.sum())}

    @cached_property
    def gpu_core_per_node(self) -> np.ndarray:
        """GPU core percent per node over its cards (100 = one card)."""
        return self.gpu_core_percent.sum(axis=1)

    @cached_property
    def gpu_capacity_floor1(self) -> tuple[np.ndarray, np.ndarray]:
        """Per node, GPU core percent and GPU memory over its cards, at least 1 (a safe denominator)."""
        return np.maximum(self.gpu_core_per_node, 1), np.maximum(self.gpu_memory_mib.sum(axis=1), 1)

    @cached_property
    def cpu_watts(self) -> dict[int, np.ndarray]:
        """Memo of hsched.policies.placement.part_power_w's CPU term over every node, per demanded cpu_milli (a
        trace repeats a few dozen values), filled by the decisions that ask."""
        return {}

    @cached_property
    def power_slopes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per node: cores as float64, cores > 0, eq.5's P_full − P_idle, the GPU's full − idle watts."""
        cores = np.asarray(self.cpu_milli, dtype=np.float64)
        return cores, cores > 0, np.asarray(self.p_full_w - self.p_idle_w, dtype=np.float64), \
            self.gpu_full_w - self.gpu_idle_w


@dataclass(frozen=True)
class DataCenter:
    name: str
    vertex: str
    prices: Prices
    layout: RoomLayout
    pools: tuple[NodePool, ...]
    thermal: Mapping[str, Any] = field(default_factory=dict)  # ThermalParams fields (hsched.thermal)
    room: Mapping[str, Any] = field(default_factory=dict)  # ROOM_FIELDS of RoomGeometry: the recirculation model
    split_threshold_milli: int = 0  # paper 003: CPU tasks above this are split; 0 = the largest node
    split_chunk_milli: int = 8 * MILLI  # paper 003: subtasks of <= 8 cores

    @property
    def node_count(self) -> int:
        return sum(p.count for p in self.pools)

    @property
    def effective_split_threshold_milli(self) -> int:
        return self.split_threshold_milli or max(p.cpu_milli for p in self.pools)

    def capacity_total(self) -> Resources:
        total = Resources()
        for p in self.pools:
            c = p.capacity
            total = Resources(total.cpu_milli + c.cpu_milli * p.count, total.memory_mib + c.memory_mib * p.count,
                              total.disk_mib + c.disk_mib * p.count,
                              total.bandwidth_mbps + c.bandwidth_mbps * p.count,
                              total.gpu_count + c.gpu_count * p.count, 0, 0)
        return total

    def node_table(self) -> NodeTable:
        n = self.node_count
        max_gpus = max((p.gpu_count for p in self.pools), default=0)
        pool_idx = np.repeat(np.arange(len(self.pools)), [p.count for p in self.pools])
        ids = np.arange(n)

        def per_node(attr: str, dtype: type = np.int64) -> np.ndarray:
            return np.array([getattr(p, attr) for p in self.pools], dtype=dtype)[pool_idx]

        gpu_count = per_node("gpu_count")
        card = np.arange(max(max_gpus, 1))[None, :] < gpu_count[:, None]
        return NodeTable(
            names=tuple(f"{self.name}-r{i // self.layout.servers_per_rack:02d}-s{i % self.layout.servers_per_rack:02d}"
                        for i in range(n)),
            pool=pool_idx,
            rack=ids // self.layout.servers_per_rack,
            slot=ids % self.layout.servers_per_rack,
            cpu_milli=per_node("cpu_milli"),
            memory_mib=per_node("memory_mib"),
            disk_mib=per_node("disk_mib"),
            bandwidth_mbps=per_node("bandwidth_mbps"),
            gpu_count=gpu_count,
            gpu_memory_mib=np.where(card, per_node("gpu_memory_mib")[:, None], 0),
            gpu_core_percent=np.where(card, 100, 0),
            gpu_model=tuple(self.pools[i].gpu_model for i in pool_idx),
            p_idle_w=per_node("p_idle_w", np.float64),
            p_full_w=per_node("p_full_w", np.float64),
            gpu_idle_w=per_node("gpu_idle_w", np.float64),
            gpu_full_w=per_node("gpu_full_w", np.float64),
        )


@dataclass(frozen=True, slots=True)
class Link:
    """An undirected WAN link. Latency defaults to fibre propagation over the great-circle distance."""

    a: str
    b: str
    distance_km: float
    latency_ms: float
    bandwidth_mbps: float = 0.0  # 0 = unknown / unconstrained
    jitter_ms: float = 0.0
    loss_percent: float = 0.0


@dataclass(frozen=True)
class Wan:
    vertices: Mapping[str, tuple[float, float]]  # name -> (lat, lon), degrees
    links: tuple[Link, ...]
    scheduler_vertex: str  # the paper's vertex s: where tasks enter when they name no entry vertex
    entry_vertices: tuple[str, ...]  # vertices that may submit tasks (user gateways)
    source: str = ""  # provenance, e.g. "Topology Zoo: Abilene"
    pruned: tuple[str, ...] = ()  # vertices dropped by wan.prune_disconnected (cut off from the scheduler)


@dataclass(frozen=True)
class Fleet:
    name: str
    wan: Wan
    datacenters: tuple[DataCenter, ...]
    network_price_per_gb_ms: float  # paper 003 eq.2: cost per GB moved per ms of path latency

    def datacenter(self, name: str) -> DataCenter:
        for dc in self.datacenters:
            if dc.name == name:
                return dc
        raise KeyError(name)


# ---------------------------------------------------------------------------------------------------------------
# YAML loading and validation


class _Reader:
    """Reads typed values out of a YAML mapping, raising FleetError with the full YAML path."""

    def __init__(self, data: Any, path: str) -> None:
        if not isinstance(data, Mapping):
            raise FleetError(path or "<root>", "must be a mapping", type(data).__name__)
        self.data = data
        self.path = path
        self.used: set[str] = set()

    def _p(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def raw(self, key: str, default: Any = ...) -> Any:
        self.used.add(key)
        if key not in self.data:
            if default is ...:
                raise FleetError(self._p(key), "is required")
            return default
        return self.data[key]

    def str(self, key: str, default: Any = ...) -> str:
        value = self.raw(key, default)
        if not isinstance(value, str) or not value:
            raise FleetError(self._p(key), "must be a non-empty string", value)
        return value

    def num(self, key: str, default: Any = ..., *, min_: float | None = None, gt: float | None = None,
            max_: float | None = None) -> float:
        value = self.raw(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise FleetError(self._p(key), "must be a finite number", value)
        if min_ is not None and value < min_:
            raise FleetError(self._p(key), f"must be >= {min_}", value)
        if max_ is not None and value > max_:
            raise FleetError(self._p(key), f"must be <= {max_}", value)
        if gt is not None and value <= gt:
            raise FleetError(self._p(key), f"must be > {gt}", value)
        return float(value)

    def int(self, key: str, default: Any = ..., *, min_: int = 0) -> int:
        value = self.raw(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise FleetError(self._p(key), "must be an integer", value)
        if value < min_:
            raise FleetError(self._p(key), f"must be >= {min_}", value)
        return value

    def list(self, key: str, default: Any = ...) -> list[Any]:
        value = self.raw(key, default)
        if not isinstance(value, list):
            raise FleetError(self._p(key), "must be a list", value)
        return value

    def sub(self, key: str, default: Any = ...) -> _Reader:
        return _Reader(self.raw(key, default), self._p(key))

    def done(self) -> None:
        unknown = sorted(set(map(str, self.data)) - self.used)
        if unknown:
            raise FleetError(self._p(unknown[0]), "is not a known field (typo?)")


def _load_pool(r: _Reader) -> NodePool:
    gpus = r.sub("gpus", {})
    pool = NodePool(
        name=r.str("name"),
        count=r.int("count", min_=1),
        cpu_milli=round(r.num("cpu_cores", gt=0) * MILLI),
        memory_mib=round(r.num("memory_gib", min_=0) * MIB_PER_GIB),
        disk_mib=round(r.num("disk_gib", 0, min_=0) * MIB_PER_GIB),
        bandwidth_mbps=r.int("bandwidth_mbps", 10_000),
        # a gpus: block describes cards: at least one, of a model named by a string
        gpu_count=gpus.int("count", min_=1) if gpus.data else 0,
        gpu_model=gpus.str("model") if gpus.data else "",
        gpu_memory_mib=round(gpus.num("memory_gib", 0, min_=0) * MIB_PER_GIB),
        p_idle_w=r.num("p_idle_w", 100.0, min_=0),
        p_full_w=r.num("p_full_w", 300.0, min_=0),
        gpu_idle_w=gpus.num("idle_w", 0.0, min_=0),
        gpu_full_w=gpus.num("full_w", 0.0, min_=0),
    )
    gpus.done()
    r.done()
    if pool.p_full_w < pool.p_idle_w:
        raise FleetError(f"{r.path}.p_full_w", "must be >= p_idle_w", pool.p_full_w)
    if pool.gpu_full_w < pool.gpu_idle_w:
        raise FleetError(f"{r.path}.gpus.full_w", "must be >= gpus.idle_w", pool.gpu_full_w)
    if pool.gpu_count and pool.gpu_memory_mib <= 0:
        raise FleetError(f"{r.path}.gpus.memory_gib", "must be > 0 when gpus.count > 0", pool.gpu_memory_mib)
    return pool


def _load_datacenter(r: _Reader, vertices: Mapping[str, Any], pruned: tuple[str, ...] = ()) -> DataCenter:
    name = r.str("name")
    vertex = r.str("vertex")
    if vertex in pruned:
        raise FleetError(f"{r.path}.vertex", "is cut off from wan.scheduler_vertex (dropped by "
                         "wan.prune_disconnected): no task could reach this DC", vertex)
    if vertex not in vertices:
        raise FleetError(f"{r.path}.vertex", f"must name a vertex of wan ({_names(sorted(vertices))})", vertex)
    pr = r.sub("prices")
    prices = Prices(
        cpu_core_hour=pr.num("cpu_core_hour", min_=0),
        memory_gib_hour=pr.num("memory_gib_hour", min_=0),
        disk_gib_hour=pr.num("disk_gib_hour", 0.0, min_=0),
        bandwidth_mbps_hour=pr.num("bandwidth_mbps_hour", 0.0, min_=0),
        gpu_hour=pr.num("gpu_hour", 0.0, min_=0),
    )
    pr.done()
    lr = r.sub("layout", {})
    layout = RoomLayout(racks=lr.int("racks", 16, min_=1), servers_per_rack=lr.int("servers_per_rack", 42, min_=1),
                        rows=lr.int("rows", 2, min_=1))
    lr.done()
    if layout.racks % layout.rows:
        raise FleetError(f"{r.path}.layout.rows", "must divide layout.racks", layout.rows)
    pool_list = r.list("node_pools")
    if not pool_list:
        raise FleetError(f"{r.path}.node_pools", "must list at least one node pool")
    pools = tuple(_load_pool(_Reader(p, f"{r.path}.node_pools[{i}]")) for i, p in enumerate(pool_list))
    names = [p.name for p in pools]
    if len(set(names)) != len(names):
        raise FleetError(f"{r.path}.node_pools", "pool names must be unique", names)
    total = sum(p.count for p in pools)
    if total > layout.slots:
        raise FleetError(f"{r.path}.node_pools", f"hold {total} nodes but layout has only "
                         f"{layout.racks}×{layout.servers_per_rack} = {layout.slots} slots", total)
    thermal = r.raw("thermal", {})
    if not isinstance(thermal, Mapping):
        raise FleetError(f"{r.path}.thermal", "must be a mapping", thermal)
    room = r.raw("room", {})
    if not isinstance(room, Mapping):
        raise FleetError(f"{r.path}.room", "must be a mapping", room)
    sr = r.sub("split", {})
    split_threshold = round(sr.num("threshold_cores", 0, min_=0) * MILLI)
    split_chunk = round(sr.num("chunk_cores", 8, gt=0) * MILLI)
    sr.done()
    r.done()
    dc = DataCenter(name=name, vertex=vertex, prices=prices, layout=layout, pools=pools, thermal=dict(thermal),
                    room=dict(room), split_threshold_milli=split_threshold, split_chunk_milli=split_chunk)
    from hsched.thermal import ThermalParams  # local: the thermal package imports domain types
    from hsched.thermal.recirculation import ROOM_FIELDS, RoomGeometry

    _check_params(ThermalParams, dc.thermal, f"{r.path}.thermal", text={"supply_mode"})
    _check_params(RoomGeometry, dc.room, f"{r.path}.room", known=set(ROOM_FIELDS))
    return dc


def _check_params(cls: Any, given: Mapping[str, Any], path: str, known: AbstractSet[str] | None = None,
                  text: AbstractSet[str] = frozenset()) -> None:
    """`given` must be fields of the dataclass `cls` (those in `known` when given), numbers (the `text` fields
    aside) that `cls` accepts; else a FleetError naming the field (cls's ValueErrors start with its name)."""
    if known is None:
        known = {f.name for f in fields(cls)}
    for key, value in given.items():
        if key not in known:
            raise FleetError(f"{path}.{key}", "is not a known field (typo?)")
        if key not in text and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise FleetError(f"{path}.{key}", "must be a finite number", value)
    try:
        cls(**given)
    except ValueError as exc:
        name, _, rule = str(exc).partition(" ")
        raise FleetError(f"{path}.{name}", rule) if name in known else FleetError(path, str(exc)) from None


def _load_wan(r: _Reader, base: Path) -> Wan:
    vertices: dict[str, tuple[float, float]] = {}
    links: list[Link] = []
    source = ""
    if "graphml" in r.data:
        from hsched.traces.topology_zoo import load_graphml

        rel = r.str("graphml")
        gpath = base / rel
        if not gpath.is_file():  # the shipped graphs live in the data dir (hsched.traces.data_dir)
            from hsched.traces import data_dir

            gpath = data_dir() / rel
        if not gpath.is_file():
            raise FleetError(f"{r.path}.graphml", "file not found next to the fleet file nor in the data dir", rel)
        vertices, links, source = load_graphml(gpath)
    for i, v in enumerate(r.list("vertices", [])):
        vr = _Reader(v, f"{r.path}.vertices[{i}]")
        vname = vr.str("name")
        if vname in vertices:
            raise FleetError(f"{vr.path}.name", "duplicates another vertex", vname)
        vertices[vname] = (vr.num("lat", min_=-90, max_=90), vr.num("lon", min_=-180, max_=180))
        vr.done()
    for i, link in enumerate(r.list("links", [])):
        lr = _Reader(link, f"{r.path}.links[{i}]")
        a, b = lr.str("a"), lr.str("b")
        for end, key in ((a, "a"), (b, "b")):
            if end not in vertices:
                raise FleetError(f"{lr.path}.{key}", f"must name a vertex ({_names(sorted(vertices))})", end)
        if a == b:
            raise FleetError(f"{lr.path}.b", "must differ from a (no self-loops)", b)
        if "distance_km" in link:
            dist = lr.num("distance_km", min_=0, max_=MAX_LINK_KM)
        else:
            from hsched.traces.topology_zoo import haversine_km

            dist = haversine_km(vertices[a], vertices[b])
        links.append(Link(a, b, dist,
                          latency_ms=lr.num("latency_ms", max(dist * FIBRE_MS_PER_KM, 0.05), gt=0, max_=MAX_LINK_MS),
                          bandwidth_mbps=lr.num("bandwidth_mbps", 0.0, min_=0),
                          jitter_ms=lr.num("jitter_ms", 0.0, min_=0, max_=MAX_LINK_MS),
                          loss_percent=lr.num("loss_percent", 0.0, min_=0, max_=100)))
        lr.done()
    if not vertices:
        raise FleetError(f"{r.path}.vertices", "the WAN needs vertices (inline or from graphml)")
    scheduler = r.str("scheduler_vertex")
    if scheduler not in vertices:
        raise FleetError(f"{r.path}.scheduler_vertex", f"must name a vertex ({_names(sorted(vertices))})", scheduler)
    prune = r.raw("prune_disconnected", False)
    if not isinstance(prune, bool):
        raise FleetError(f"{r.path}.prune_disconnected", "must be true or false", prune)
    explicit_entries = r.raw("entry_vertices", "all") != "all"
    off = _outside_component(vertices, links, scheduler)
    if off and prune:  # explicitly asked: drop what the scheduler vertex cannot reach (and its links)
        vertices = {v: ll for v, ll in vertices.items() if v not in off}
        links = [lk for lk in links if lk.a not in off and lk.b not in off]
    entries = r.raw("entry_vertices", "all")
    if entries == "all":
        entries = list(vertices)
    if not isinstance(entries, list):
        raise FleetError(f"{r.path}.entry_vertices", "must be a list of vertex names or 'all'", entries)
    for i, e in enumerate(entries):
        if e not in vertices:
            why = ("is cut off from scheduler_vertex and was pruned" if e in off
                   else f"must name a vertex ({_names(sorted(vertices))})")
            raise FleetError(f"{r.path}.entry_vertices[{i}]", why, e)
    if off and not prune:
        unreachable = [v for v in vertices if v in off]
        bad_entries = [v for v in entries if v in off] if explicit_entries else []
        raise FleetError(f"{r.path}.links", f"the WAN is disconnected: {len(unreachable)} vertices cannot reach "
                         f"scheduler_vertex {scheduler!r}: {_names(unreachable)}"
                         + (f" (entry vertices among them: {_names(bad_entries)})" if bad_entries else "")
                         + "; link them, or set wan.prune_disconnected: true to drop them")
    r.done()
    return Wan(vertices=vertices, links=tuple(links), scheduler_vertex=scheduler,
               entry_vertices=tuple(dict.fromkeys([scheduler, *entries])), source=source,
               pruned=tuple(sorted(off)) if prune else ())


def _outside_component(vertices: Mapping[str, Any], links: list[Link], root: str) -> set[str]:
    """The vertices no path of links joins to `root` (links are undirected)."""
    adj: dict[str, list[str]] = {v: [] for v in vertices}
    for lk in links:
        adj[lk.a].append(lk.b)
        adj[lk.b].append(lk.a)
    seen, todo = {root}, [root]
    while todo:
        for n in adj[todo.pop()]:
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return set(vertices) - seen


def _names(names: list[str], shown: int = 8) -> str:
    more = f", +{len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(repr(n) for n in names[:shown]) + more


def parse_fleet(data: Any, base: Path = Path(".")) -> Fleet:
    if isinstance(data, Mapping):  # YAML anchors live under x-* keys (as in Compose files)
        data = {k: v for k, v in data.items() if not str(k).startswith("x-")}
    r = _Reader(data, "")
    version = r.int("version", min_=1)
    if version != 1:
        raise FleetError("version", "must be 1", version)
    name = r.str("name")
    wan = _load_wan(r.sub("wan"), base)
    dc_list = r.list("datacenters")
    if not dc_list:
        raise FleetError("datacenters", "must list at least one data center")
    dcs = tuple(_load_datacenter(_Reader(d, f"datacenters[{i}]"), wan.vertices, wan.pruned) for i, d in enumerate(dc_list))
    names = [d.name for d in dcs]
    for i, n in enumerate(names):
        if names.index(n) != i:
            raise FleetError(f"datacenters[{i}].name", "duplicates another data center", n)
    price = r.num("network_price_per_gb_ms", min_=0)
    r.done()
    return Fleet(name=name, wan=wan, datacenters=dcs, network_price_per_gb_ms=price)


def load_fleet(path: str | Path | None = None) -> Fleet:
    """Load and validate a fleet YAML; None loads the embedded default fleet."""
    p = Path(path) if path else default_fleet_path()
    try:
        data = yamlfile.document(yamlfile.read_text(p), str(p))
    except yamlfile.YamlFileError as exc:  # the field is the file's YAML; callers name the file (--fleet PATH)
        raise FleetError("<yaml>", exc.rule) from None
    return parse_fleet(data, p.parent)


def default_fleet_path() -> Path:
    return Path(__file__).resolve().parent.parent / "fleet" / "default.yaml"
