"""Fleet shapes for GPU placement beyond paper 000's one fleet (issue 17 item 3): a seeded generator of random
multi-cluster GPU fleets to train on, and named held-out shapes (data/gpu_fleet_shapes.json) never trained on.

A `FleetShape` is `clusters` × `hosts_per_cluster` hosts, each drawn (seeded, with the types' `share`s as
weights) from a few `HostType`s: GPUs per host (1-8), a GPU model and its card memory (16-80 GiB), CPU cores and
memory per host (the CPU/GPU and memory/GPU ratios). `model_constrained` is the share of GPU tasks that may
only run on some of the fleet's GPU models (openb's `gpu_spec`; the default pod list has none, so
`shape_tasks` adds them, seeded).

Load. `shape_tasks_per_episode` keeps paper 000's demand/capacity ratio on any shape: 220 openb tasks per 128
GPUs (≈ 1.28 × the GPUs in GPU demand), so a shape with more or larger hosts gets proportionally more tasks.

`random_shape(seed)` draws 1-3 host types (GPUs ∈ {1, 2, 4, 8}, a model of `GPU_MODELS`, 2-32 cores and
16-256 GiB memory per GPU), 4-16 clusters and enough hosts for 64-192 GPUs. It never returns a held-out
shape's host-type set (it redraws), so the held-out shapes are never trained on.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hsched.domain.errors import ValidationError
from hsched.domain.fleet import DataCenter, parse_fleet
from hsched.domain.task import TaskSpec

# GPU model → card memory (GiB; vendor specs), the catalogue random shapes draw from.
GPU_MODELS = {"T4": 16, "P100": 16, "A10": 24, "A30": 24, "V100M32": 32, "A100-40": 40, "L40": 48,
              "A100-80": 80, "H800": 80}
HOST_GPUS = (1, 2, 4, 8)
MAX_GPUS_PER_HOST = 8
CARD_GIB = (16, 80)  # card memory range a shape may use
TASKS_PER_GPU = 220 / 128  # paper 000: 220 tasks on 128 GPUs
SHAPES_FILE = "gpu_fleet_shapes.json"


@dataclass(frozen=True)
class HostType:
    gpus: int
    model: str
    card_gib: float
    cpu_cores: float
    memory_gib: float
    share: float = 1.0  # relative weight when hosts are drawn

    def __post_init__(self) -> None:
        if not isinstance(self.gpus, int) or not 1 <= self.gpus <= MAX_GPUS_PER_HOST:
            raise ValidationError("gpus", f"must be an integer in 1..{MAX_GPUS_PER_HOST}", self.gpus)
        if not isinstance(self.model, str) or not self.model:
            raise ValidationError("model", "must be a non-empty GPU model name", self.model)
        if not CARD_GIB[0] <= self.card_gib <= CARD_GIB[1]:
            raise ValidationError("card_gib", f"must be in {CARD_GIB[0]}..{CARD_GIB[1]} GiB", self.card_gib)
        if not 1 <= self.cpu_cores <= 1024:
            raise ValidationError("cpu_cores", "must be in 1..1024", self.cpu_cores)
        if not 1 <= self.memory_gib <= 16384:
            raise ValidationError("memory_gib", "must be in 1..16384 GiB", self.memory_gib)
        if not self.share > 0:
            raise ValidationError("share", "must be > 0", self.share)


@dataclass(frozen=True)
class FleetShape:
    name: str
    clusters: int
    hosts_per_cluster: int
    host_types: tuple[HostType, ...]
    model_constrained: float = 0.3  # share of GPU tasks restricted to some of the fleet's GPU models
    note: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValidationError("name", "must be a non-empty string", self.name)
        if not isinstance(self.clusters, int) or not 1 <= self.clusters <= 64:
            raise ValidationError("clusters", "must be an integer in 1..64", self.clusters)
        if not isinstance(self.hosts_per_cluster, int) or not 1 <= self.hosts_per_cluster <= 256:
            raise ValidationError("hosts_per_cluster", "must be an integer in 1..256", self.hosts_per_cluster)
        if not self.host_types:
            raise ValidationError("host_types", "must list at least one host type", [])
        if not 0.0 <= self.model_constrained <= 1.0:
            raise ValidationError("model_constrained", "must be a share in [0, 1]", self.model_constrained)
        cards = {}
        for i, h in enumerate(self.host_types):
            if not isinstance(h, HostType):
                raise ValidationError(f"host_types[{i}]", "must be a HostType", h)
            if cards.setdefault(h.model, h.card_gib) != h.card_gib:
                raise ValidationError(f"host_types[{i}].card_gib", f"one card memory per model ({h.model}: "
                                      f"{cards[h.model]} GiB)", h.card_gib)

    @property
    def hosts(self) -> int:
        return self.clusters * self.hosts_per_cluster

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(h.model for h in self.host_types))

    def signature(self) -> frozenset:
        """The host-type set without weights (what makes two shapes the same hardware)."""
        return frozenset((h.gpus, h.model, h.card_gib, h.cpu_cores, h.memory_gib) for h in self.host_types)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "host_types": [dataclasses.asdict(h) for h in self.host_types]}

    @classmethod
    def from_dict(cls, d: dict, where: str = "shape") -> FleetShape:
        if not isinstance(d, dict):
            raise ValidationError(where, "must be a mapping", d)
        try:
            types = tuple(HostType(**h) for h in d.get("host_types") or ())
            return cls(**{**d, "host_types": types})
        except TypeError as exc:  # unknown / missing keys
            raise ValidationError(where, f"has unknown or missing fields ({exc})", sorted(d)) from None


def host_draws(shape: FleetShape, seed: int = 0) -> list[HostType]:
    """The shape's hosts, cluster by cluster: each drawn from the host types by their shares (numpy seed), and
    every host type at least once when there are enough hosts (a shape's models all exist)."""
    rng = np.random.default_rng(seed)
    p = np.array([h.share for h in shape.host_types], dtype=np.float64)
    idx = rng.choice(len(shape.host_types), size=shape.hosts, p=p / p.sum())
    if shape.hosts >= len(shape.host_types):
        missing = [k for k in range(len(shape.host_types)) if k not in set(idx.tolist())]
        slots = rng.choice(shape.hosts, size=len(missing), replace=False)
        for k, slot in zip(missing, slots, strict=True):
            idx[slot] = k
    return [shape.host_types[i] for i in idx]


def shape_datacenters(shape: FleetShape, seed: int = 0) -> tuple[DataCenter, ...]:
    """`shape` as DataCenters (cluster c = hosts c·h … c·h + h − 1 of `host_draws`), validated by parse_fleet
    like any fleet file."""
    hosts = host_draws(shape, seed)
    h = shape.hosts_per_cluster
    dcs = []
    for c in range(shape.clusters):
        pools: dict[HostType, int] = {}
        for t in hosts[c * h:(c + 1) * h]:
            pools[t] = pools.get(t, 0) + 1
        dcs.append({
            "name": f"c{c:02d}", "vertex": "v", "prices": {"cpu_core_hour": 0.0, "memory_gib_hour": 0.0},
            "layout": {"racks": 1, "servers_per_rack": h, "rows": 1},
            "node_pools": [{"name": f"{t.model.lower()}-{t.gpus}g-{i}", "count": n, "cpu_cores": t.cpu_cores,
                            "memory_gib": t.memory_gib, "bandwidth_mbps": 0,
                            "gpus": {"count": t.gpus, "model": t.model, "memory_gib": t.card_gib}}
                           for i, (t, n) in enumerate(pools.items())],
        })
    fleet = parse_fleet({"version": 1, "name": shape.name, "network_price_per_gb_ms": 0.0,
                         "wan": {"vertices": [{"name": "v", "lat": 0.0, "lon": 0.0}], "scheduler_vertex": "v"},
                         "datacenters": dcs})
    return fleet.datacenters


def shape_gpus(dcs: Sequence[DataCenter]) -> int:
    return sum(dc.capacity_total().gpu_count for dc in dcs)


def shape_tasks_per_episode(dcs: Sequence[DataCenter]) -> int:
    """Paper 000's demand/capacity ratio on these DCs: 220 tasks per 128 GPUs."""
    return max(20, round(TASKS_PER_GPU * shape_gpus(dcs)))


def shape_tasks(shape: FleetShape, pool: Sequence[TaskSpec], seed: int = 0) -> tuple[TaskSpec, ...]:
    """`pool` with model constraints: each GPU task independently (numpy seed) with probability
    `shape.model_constrained` may only run on one or two of the shape's GPU models, drawn among the models
    that have a host type with enough GPUs for it (a task no model could ever host stays unconstrained).
    Tasks that already name models keep them."""
    if shape.model_constrained <= 0 or len(shape.models) < 2:
        return tuple(pool)
    rng = np.random.default_rng(seed)
    most = {m: max(h.gpus for h in shape.host_types if h.model == m) for m in shape.models}
    out = []
    for t in pool:
        k = t.resources.gpu_count
        if k and not t.gpu_models and rng.random() < shape.model_constrained:
            able = [m for m in shape.models if most[m] >= k]
            if able:
                n = min(len(able), int(rng.integers(1, 3)))
                t = dataclasses.replace(t, gpu_models=tuple(rng.choice(able, size=n, replace=False).tolist()))
        out.append(t)
    return tuple(out)


def random_shape(seed: int, held_out: Sequence[FleetShape] = (), max_hosts: int = 256) -> FleetShape:
    """A random shape (numpy seed): 1-3 host types of 1/2/4/8 GPUs of models from GPU_MODELS, 2-32 CPU cores and
    16-256 GiB memory per GPU, 4-16 clusters, 64-192 GPUs in all (fewer where more than `max_hosts` hosts would be
    needed), 0-50 % model-constrained GPU tasks. Redraws
    (same stream) while its host-type set equals a `held_out` shape's."""
    rng = np.random.default_rng(seed)
    avoid = {s.signature() for s in held_out}
    while True:
        types = []
        for _ in range(int(rng.integers(1, 4))):
            gpus = int(rng.choice(HOST_GPUS))
            model = str(rng.choice(list(GPU_MODELS)))
            cores_per_gpu = float(rng.choice([2, 4, 6, 8, 12, 16, 24, 32]))
            mem_per_gpu = float(rng.choice([16, 32, 64, 128, 256]))
            types.append(HostType(gpus, model, float(GPU_MODELS[model]), max(8.0, cores_per_gpu * gpus),
                                  max(32.0, mem_per_gpu * gpus), float(rng.uniform(0.5, 2.0))))
        total = int(rng.integers(64, 193))
        clusters = int(rng.integers(4, 17))
        mean = sum(t.gpus * t.share for t in types) / sum(t.share for t in types)
        clusters = min(clusters, max_hosts)
        per = max(1, min(round(total / (clusters * mean)), max_hosts // clusters))
        shape = FleetShape(f"random-{seed}", clusters, per, tuple(types),
                           round(float(rng.uniform(0.0, 0.5)), 2))
        if shape.signature() not in avoid:
            return shape


def load_shapes(path: str | Path | None = None) -> dict[str, FleetShape]:
    """The named shapes of a shapes file (default: data/gpu_fleet_shapes.json, the held-out shapes)."""
    if path is None:
        from hsched.traces import data_dir

        path = data_dir() / SHAPES_FILE
    raw = json.loads(Path(path).read_text())
    shapes = raw.get("shapes") if isinstance(raw, dict) else None
    if not isinstance(shapes, list) or not shapes:
        raise ValidationError("shapes", "must be a non-empty list of fleet shapes", type(shapes).__name__)
    out: dict[str, FleetShape] = {}
    for i, d in enumerate(shapes):
        s = FleetShape.from_dict(d, f"shapes[{i}]")
        if s.name in out:
            raise ValidationError(f"shapes[{i}].name", "must be unique", s.name)
        out[s.name] = s
    return out


def shape_env(shape: FleetShape, seed: int = 0, trace: str | Path | None = None, n_tasks: int | None = None):
    """A GpuClusterEnv on `shape` (hosts drawn with `seed`), its tasks drawn from the openb pod list `trace`
    (default pod list) with `shape_tasks`' model constraints (seed `seed`), `shape_tasks_per_episode` tasks."""
    from hsched.envs.gpu import GpuClusterEnv
    from hsched.policies.fgd import openb_tasks

    dcs = shape_datacenters(shape, seed)
    return GpuClusterEnv(dcs, n_tasks=n_tasks or shape_tasks_per_episode(dcs),
                         trace=shape_tasks(shape, openb_tasks(trace), seed))
