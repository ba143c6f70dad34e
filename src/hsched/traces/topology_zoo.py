"""Internet Topology Zoo WAN graphs (GraphML, data/topology_zoo/) → hsched vertices and links.

A graph is found by name (`zoo_graphml`): `graphml/<Name>.graphml`, else the member `graphml_more/<Name>.graphml`
of `graphml_more.tar.gz` (235 more Zoo graphs, read from the archive without unpacking it).

Node coordinates are decimal degrees (WGS84). The Zoo gives no latency, so each link's latency is fibre
propagation over the great-circle distance (`FIBRE_MS_PER_KM`, 5 µs/km), floored at `MIN_LATENCY_MS` because
some links join co-located nodes (0 km). Link speed, when the file has it, is `LinkSpeedRaw` in bit/s.
"""

from __future__ import annotations

import io
import math
import tarfile
from collections import Counter
from functools import cache
from itertools import pairwise
from pathlib import Path
from typing import Any

import networkx as nx

from hsched.domain.fleet import FIBRE_MS_PER_KM, Link

EARTH_RADIUS_KM = 6371.0088  # IUGG mean Earth radius
MIN_LATENCY_MS = 0.05  # floor for co-located PoPs (0 km links)
BITS_PER_MBIT = 1_000_000


def haversine_km(a: tuple[float, float], b: tuple[float, float]) -> float:
    """Great-circle distance in km between two (lat, lon) points given in decimal degrees."""
    lat1, lon1, lat2, lon2 = map(math.radians, (a[0], a[1], b[0], b[1]))
    h = math.sin((lat2 - lat1) / 2) ** 2 + math.cos(lat1) * math.cos(lat2) * math.sin((lon2 - lon1) / 2) ** 2
    return 2 * EARTH_RADIUS_KM * math.asin(min(1.0, math.sqrt(h)))


def _provenance(graph: dict[str, Any], path: Path) -> str:
    network = str(graph.get("Network") or graph.get("label") or path.stem).strip()
    details = [str(graph[k]).strip() for k in ("GeoLocation", "Type") if graph.get(k)]
    if graph.get("NetworkDate"):
        details.append(str(graph["NetworkDate"]).strip().replace("_", "-"))
    return f"Topology Zoo: {network}" + (f" ({', '.join(details)})" if details else "")


ZOO_ARCHIVE = "graphml_more.tar.gz"  # in data/topology_zoo/, members graphml_more/<Name>.graphml


def _zoo_dir() -> Path:
    from hsched.traces import data_dir

    return data_dir() / "topology_zoo"


@cache
def _archive_members() -> dict[str, bytes]:
    """{graph name: GraphML bytes} of the Zoo archive (empty when it is absent); ~5 MB, read once."""
    archive = _zoo_dir() / ZOO_ARCHIVE
    if not archive.is_file():
        return {}
    with tarfile.open(archive) as tar:
        return {Path(m.name).stem: tar.extractfile(m).read()  # type: ignore[union-attr]
                for m in tar.getmembers() if m.isfile() and m.name.endswith(".graphml")}


def zoo_names() -> list[str]:
    """Every Zoo graph name data/ holds (graphml/ and the archive), sorted."""
    loose = {p.stem for p in (_zoo_dir() / "graphml").glob("*.graphml")}
    return sorted(loose | set(_archive_members()))


def zoo_graphml(name: str) -> Path | io.BytesIO:
    """The GraphML of the Zoo graph `name`: a file of graphml/, else the archive's member (as bytes, named)."""
    loose = _zoo_dir() / "graphml" / f"{name}.graphml"
    if loose.is_file():
        return loose
    member = _archive_members().get(name)
    if member is None:
        from hsched.domain.errors import ValidationError

        raise ValidationError("graph", f"is not a Topology Zoo graph in {_zoo_dir()} (see zoo_names())", name)
    data = io.BytesIO(member)
    data.name = f"{name}.graphml"
    return data


def load_graphml(path: str | Path | io.BytesIO) -> tuple[dict[str, tuple[float, float]], list[Link], str]:
    """Read a Topology Zoo GraphML file.

    Returns `(vertices, links, provenance)`:
    - vertices: name → (lat, lon) in degrees. The name is the node's `label` (the node id when it has none);
      nodes sharing a label are all renamed `"<label> #<node id>"`. Nodes without `Latitude`/`Longitude`
      (placeholders such as "Europe" or "International Link 1") are dropped together with their links.
    - links: one `Link` per GraphML edge, parallel edges of multigraphs kept, self-loops dropped;
      `distance_km` is the haversine distance, `latency_ms = max(distance_km × FIBRE_MS_PER_KM, MIN_LATENCY_MS)`,
      `bandwidth_mbps = LinkSpeedRaw / 1e6` when present, else 0 (unknown).
    - provenance: e.g. "Topology Zoo: Abilene (US, REN, 2005-02)".
    """
    g = nx.read_graphml(path)
    path = Path(getattr(path, "name", path))  # a named BytesIO (zoo_graphml) or a path
    located = {n: d for n, d in g.nodes(data=True) if "Latitude" in d and "Longitude" in d}
    labels = {n: str(d.get("label") or n) for n, d in located.items()}
    shared = {label for label, k in Counter(labels.values()).items() if k > 1}
    names = {n: f"{label} #{n}" if label in shared else label for n, label in labels.items()}

    vertices = {names[n]: (float(d["Latitude"]), float(d["Longitude"])) for n, d in located.items()}
    links: list[Link] = []
    for u, v, d in g.edges(data=True):
        if u == v or u not in names or v not in names:
            continue
        a, b = names[u], names[v]
        dist = haversine_km(vertices[a], vertices[b])
        speed = d.get("LinkSpeedRaw")
        links.append(Link(a, b, distance_km=dist, latency_ms=max(dist * FIBRE_MS_PER_KM, MIN_LATENCY_MS),
                          bandwidth_mbps=float(speed) / BITS_PER_MBIT if speed else 0.0))
    return vertices, links, _provenance(g.graph, path)


def largest_component(vertices: dict[str, tuple[float, float]], links: list[Link]
                      ) -> tuple[dict[str, tuple[float, float]], list[Link], tuple[str, ...]]:
    """Keep the largest connected part of a graph (ties: the one with the alphabetically first vertex).

    Some Zoo files have PoPs without links (Uninett: 3 of 74); a path agent is trained and evaluated on
    what can reach what. Returns (vertices, links, dropped vertex names)."""
    g = nx.Graph()
    g.add_nodes_from(vertices)
    g.add_edges_from((link.a, link.b) for link in links)
    parts = sorted(nx.connected_components(g), key=lambda c: (-len(c), min(c)))
    keep = parts[0] if parts else set()
    return ({v: xy for v, xy in vertices.items() if v in keep}, [x for x in links if x.a in keep],
            tuple(sorted(v for v in vertices if v not in keep)))


def join_graphs(parts: list[tuple[str, dict[str, tuple[float, float]], list[Link]]], bridges: int = 2
                ) -> tuple[dict[str, tuple[float, float]], list[Link]]:
    """A CONSTRUCTED larger WAN: real graphs `(name, vertices, links)` chained in the given order, each joined
    to the next by its `bridges` shortest cross links between PoPs (haversine distance, distinct endpoints),
    with the same fibre latency model as every Zoo link. Vertices are renamed "<name>/<vertex>".

    Not a Topology Zoo network: the PoPs and their links are real, the bridges are made up (nearest PoPs)."""
    vertices: dict[str, tuple[float, float]] = {}
    links: list[Link] = []
    names: list[list[str]] = []
    for name, vs, ls in parts:
        names.append([f"{name}/{v}" for v in vs])
        vertices.update({f"{name}/{v}": xy for v, xy in vs.items()})
        links += [Link(f"{name}/{x.a}", f"{name}/{x.b}", x.distance_km, x.latency_ms, x.bandwidth_mbps)
                  for x in ls]
    for left, right in pairwise(names):
        pairs = sorted((haversine_km(vertices[a], vertices[b]), a, b) for a in left for b in right)
        used: set[str] = set()
        added = 0
        for dist, a, b in pairs:
            if added == bridges:
                break
            if a in used or b in used:
                continue
            used |= {a, b}
            links.append(Link(a, b, distance_km=dist, latency_ms=max(dist * FIBRE_MS_PER_KM, MIN_LATENCY_MS)))
            added += 1
    return vertices, links
