"""Slice types in the placer (paper 001 §2.1, issue 15 item 4): nodes pre-partitioned into container slices.

**The slice-types file** (`hsched slices fit`, read by `placer --slice-types FILE`) lists Q container types in
the stack's units — cpu_milli and memory_mib, smallest first — with each type's share of the slice capacity,
and how they were derived (trace, Q, the idle-vs-Q curve). `fit_catalog` derives them from the Alibaba 2018
batch trace with the simulator's own code (hsched.envs.colocation.layout_for over its job pool: the
connectivity-constrained clustering of hsched.policies.slices, in trace units scaled by a v2018 machine), then
converts the sizes with the replay's conversion (hsched.job_replay.alibaba_resources, monotone, so a type still
covers every demand of its cluster).

**Partition.** Every node of the DC is cut into slices of those types with the simulator's `partition_node`
(its CPU and memory capacity, the types' shares): `SlicedState.cut[node, type]`. A slice covers CPU and memory
only; a task's disk, bandwidth and GPUs are allocated as asked on the slice's node.

**Placement.** With a SlicedState, the planner (hsched.policies.placement.plan — the same masks, thermal
headroom and policy as without slices) gives each part of a task one free slice of the smallest type that
covers its CPU and memory (types tried in the file's order; a larger type only when no smaller one has a free
fitting slice): the part holds the slice's whole CPU and memory, so the slack inside it (the fragmentation
paper 001 accepts) is held too, and the ledger's alloc events carry those amounts. Slices of one type on one
node are interchangeable, so occupancy is a count: a part on node n whose (cpu_milli, memory_mib) is type k's
size occupies a type-k slice there. `SlicedState._delta` keeps `used[n, k]` with every change of the free
arrays — the ledger's fold, a release, the planner's and preemption's tentative changes, an undo — so a placer
that folds the ledger after a restart has exactly the occupancy it had, and the planner never lets
`used[n, k]` pass `cut[n, k]` (two tasks never share a slice) nor a node's free amounts go below zero.

**Tasks no slice type fits** (a part larger than every type, or fitting only types no node of the DC is cut
into) are refused as UNSCHEDULABLE — never deferred: the partition is fixed, so waiting cannot help. The reason
names the part's demand and the slice types. A task whose types exist but are all taken now is NO_ROOM
(deferred when the caller allows it), like any other.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

import numpy as np
import yaml

from hsched import yamlfile
from hsched.domain.cluster import ClusterState, Part
from hsched.domain.errors import ValidationError
from hsched.domain.fleet import DataCenter, NodeTable
from hsched.domain.resources import Resources
from hsched.policies.slices import QCurve, partition_node, q_curve, type_shares

FORMAT = "hsched-slice-types/1"


@dataclass(frozen=True)
class SliceCatalog:
    """Q slice types: sizes in the stack's units, smallest first, with their shares of the slice capacity."""

    cpu_milli: tuple[int, ...]
    memory_mib: tuple[int, ...]
    shares: tuple[float, ...]
    source: dict = field(default_factory=dict, compare=False)  # provenance (trace, Q, curve): carried, not read

    @property
    def q(self) -> int:
        return len(self.cpu_milli)

    def describe(self, k: int) -> str:
        return f"type {k} ({self.cpu_milli[k]}m cpu, {self.memory_mib[k]} MiB)"

    def listing(self) -> str:
        return ", ".join(f"{c}m/{m}MiB" for c, m in zip(self.cpu_milli, self.memory_mib, strict=True))

    def cut(self, cpu_milli: int, memory_mib: int) -> tuple[int, ...]:
        """Slices of each type cut from a node of this CPU and memory (the simulator's partition_node)."""
        return _cut(self, int(cpu_milli), int(memory_mib))

    def fitting(self, demand: Resources) -> list[int]:
        """The types covering the demand's CPU and memory, in the file's (smallest first) order."""
        return [k for k in range(self.q)
                if self.cpu_milli[k] >= demand.cpu_milli and self.memory_mib[k] >= demand.memory_mib]

    # -- file ------------------------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {"format": FORMAT,
                "types": [{"cpu_milli": c, "memory_mib": m, "share": round(s, 6)}
                          for c, m, s in zip(self.cpu_milli, self.memory_mib, self.shares, strict=True)],
                "source": self.source}

    def save(self, path: str | Path) -> None:
        """Written whole (a temporary file renamed over the target): a reader never sees half a file."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        text = json.dumps(self.to_dict(), indent=1) if path.suffix == ".json" else \
            yaml.dump(self.to_dict(), Dumper=yamlfile.YamlDumper, sort_keys=False, width=120)  # load() reads it back
        tmp.write_text(text)
        tmp.replace(path)

    @staticmethod
    def from_dict(data: object) -> SliceCatalog:
        """Validate a parsed file; ValidationError names the field and the rule."""
        if not isinstance(data, dict):
            raise ValidationError("slice types", "must be a mapping with a 'types' list")
        for key in data:
            if key not in ("format", "types", "source"):
                raise ValidationError(str(key), "is not a slice-types field (one of: format, types, source)")
        if data.get("format", FORMAT) != FORMAT:
            raise ValidationError("format", f"must be {FORMAT!r}", data.get("format"))
        types = data.get("types")
        if not isinstance(types, list) or not types:
            raise ValidationError("types", "must be a non-empty list of {cpu_milli, memory_mib, share}", types)
        cpu, mem, shares = [], [], []
        for i, t in enumerate(types):
            if not isinstance(t, dict):
                raise ValidationError(f"types[{i}]", "must be a mapping {cpu_milli, memory_mib, share}", t)
            for key in t:
                if key not in ("cpu_milli", "memory_mib", "share"):
                    raise ValidationError(f"types[{i}].{key}", "is not a slice type field (one of: cpu_milli, "
                                          "memory_mib, share)")
            for name, out in (("cpu_milli", cpu), ("memory_mib", mem)):
                v = t.get(name)
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ValidationError(f"types[{i}].{name}", "must be an integer >= 1", v)
                out.append(v)
            s = t.get("share", 1.0)
            if isinstance(s, bool) or not isinstance(s, int | float) or not math.isfinite(s) or s < 0:
                raise ValidationError(f"types[{i}].share", "must be a finite number >= 0", s)
            shares.append(float(s))
        if sum(shares) <= 0:
            raise ValidationError("types[].share", "must not all be 0", shares)
        seen: dict[tuple[int, int], int] = {}
        for i, size in enumerate(zip(cpu, mem, strict=True)):
            if size in seen:  # occupancy is read from a part's size: two types of one size would be one
                raise ValidationError(f"types[{i}]", f"has the same cpu_milli and memory_mib as types[{seen[size]}]",
                                      list(size))
            seen[size] = i
        source = data.get("source", {})
        if not isinstance(source, dict):
            raise ValidationError("source", "must be a mapping", source)
        return SliceCatalog(tuple(cpu), tuple(mem), tuple(shares), source)

    @staticmethod
    def load(path: str | Path) -> SliceCatalog:
        """Read a slice-types file (YAML or JSON; numbers as JSON reads them, so the share save() writes as `1e-06` in
        JSON is a number); ValidationError names the file and the field (the file alone when it is not YAML)."""
        try:
            text = yamlfile.read_text(path)
        except OSError as exc:
            raise ValidationError("--slice-types", f"cannot read {path}: {exc.strerror or exc}") from None
        data = yamlfile.document(text, str(path))
        try:
            return SliceCatalog.from_dict(data)
        except ValidationError as exc:
            raise ValidationError(f"{path}: {exc.field}", exc.rule, exc.value) from None


@lru_cache(maxsize=256)
def _cut(catalog: SliceCatalog, cpu_milli: int, memory_mib: int) -> tuple[int, ...]:
    sizes = np.array([catalog.cpu_milli, catalog.memory_mib], dtype=np.float64).T
    return tuple(partition_node((cpu_milli, memory_mib), sizes, catalog.shares))


class SlicedState(ClusterState):
    """A DC's allocation state whose nodes are cut into slices of `catalog`'s types (module docstring)."""

    def __init__(self, dc: DataCenter, catalog: SliceCatalog, table: NodeTable | None = None) -> None:
        self.catalog = catalog
        super().__init__(dc, table)
        t = self.table
        self.cut = np.array([catalog.cut(c, m) for c, m in zip(t.cpu_milli, t.memory_mib, strict=True)],
                            dtype=np.int64).reshape(len(t), catalog.q)
        self.used = np.zeros_like(self.cut)
        self._type_of = {size: k for k, size in enumerate(zip(catalog.cpu_milli, catalog.memory_mib, strict=True))}

    def slice_type(self, p: Part) -> int | None:
        return self._type_of.get((p.cpu_milli, p.memory_mib))

    def _delta(self, parts: tuple[Part, ...], sign: int) -> None:
        super()._delta(parts, sign)
        for p in parts:
            k = self._type_of.get((p.cpu_milli, p.memory_mib))
            if k is not None:
                self.used[p.node, k] -= sign  # sign -1 takes resources: one more slice in use

    # -- the planner's hooks (hsched.policies.placement.plan) ------------------------------------------------

    def slice_options(self, demand: Resources) -> list[tuple[Resources, np.ndarray]]:
        """Per type covering `demand`, smallest first: the demand as that slice's size and the nodes with a
        free slice of that type."""
        c = self.catalog
        return [(replace(demand, cpu_milli=c.cpu_milli[k], memory_mib=c.memory_mib[k]), self.used[:, k] < self.cut[:, k])
                for k in c.fitting(demand)]

    def slice_never_fits(self, demand: Resources) -> str | None:
        """Why no slice could ever hold `demand` in this DC (None: some could, once freed)."""
        c = self.catalog
        fitting = c.fitting(demand)
        ask = f"{demand.cpu_milli}m cpu / {demand.memory_mib} MiB"
        if not fitting:
            return f"{ask} fits no slice type (types: {c.listing()}); slice types are fixed, so it is not queued"
        if not self.cut[:, fitting].any():
            return (f"{ask} fits only slice types no node of {self.dc.name} is cut into "
                    f"({', '.join(c.describe(k) for k in fitting)}; types: {c.listing()})")
        return None

    def no_room_reason(self, demand: Resources) -> str:
        c = self.catalog
        fitting = c.fitting(demand)
        return (f"no free slice of {', '.join(c.describe(k) for k in fitting)} for "
                f"{demand.cpu_milli}m cpu / {demand.memory_mib} MiB now")

    def occupancy(self) -> dict:
        """Per type: its size, slices cut in the DC, slices in use (the placer's summary)."""
        c = self.catalog
        return {"cpu_milli": list(c.cpu_milli), "memory_mib": list(c.memory_mib),
                "cut": [int(v) for v in self.cut.sum(axis=0)], "used": [int(v) for v in self.used.sum(axis=0)]}


def state_factory(catalog: SliceCatalog | None):
    """`factory(dc, table=None)`: a SlicedState over `catalog`, or a plain ClusterState without one."""
    if catalog is None:
        return ClusterState
    return lambda dc, table=None: SlicedState(dc, catalog, table)


# -- fitting a catalog to a trace ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Fit:
    catalog: SliceCatalog
    curve: QCurve


def fit_catalog(q: int | None = None, *, q_max: int = 12, min_gain: float = 0.01, max_instances: int = 200,
                min_tasks: int = 2, machine_memory_gib: float | None = None) -> Fit:
    """Slice types of the Alibaba 2018 batch trace (module docstring): Q = `q`, or the knee of the idle-vs-Q
    curve (hsched.policies.slices.choose_q) when None. The curve is always computed and recorded."""
    from hsched.envs.colocation import ColocationConfig, job_pool, layout_for, pool_demands
    from hsched.job_replay import ALIBABA_MACHINE_MEMORY_GIB, alibaba_resources

    gib = ALIBABA_MACHINE_MEMORY_GIB if machine_memory_gib is None else machine_memory_gib
    if not (gib > 0 and math.isfinite(gib)):
        raise ValidationError("--machine-memory-gib", "must be a finite number > 0", machine_memory_gib)
    cfg = ColocationConfig(workload="alibaba", max_instances=max_instances, min_tasks=min_tasks).validate()
    pool = job_pool(cfg)
    if not pool:
        raise ValidationError("--min-tasks/--max-instances", "leave no job of the trace to fit", [min_tasks, max_instances])
    demands, weights = pool_demands(pool)
    scale = np.asarray(cfg.node_capacity, dtype=np.float64)
    curve = q_curve(demands, weights, scale=scale, q_max=q_max, min_gain=min_gain)
    chosen = curve.chosen_q if q is None else q
    types, per_machine = layout_for(pool, replace(cfg, q=chosen))
    shares = type_shares(types, demands, weights, scale)
    stack = [alibaba_resources(float(c), float(m), gib) for c, m in types.sizes]
    source = {
        "trace": "alibaba2018", "jobs": len(pool), "tasks": len(demands),
        "distinct_demands": len(types.demands), "filter": {"max_instances": max_instances, "min_tasks": min_tasks},
        "method": "connectivity-constrained hierarchical clustering (paper 001 §2.1, hsched.policies.slices)",
        "machine": {"cpu_cores": float(cfg.node_capacity[0]), "memory_percent": float(cfg.node_capacity[1]),
                    "memory_gib": gib},
        "q": chosen, "q_choice": "auto: knee of the idle curve" if q is None else "given",
        "min_gain": min_gain, "created_sizes": types.created,
        "trace_sizes": [[float(c), float(m)] for c, m in types.sizes],
        "slices_per_trace_machine": list(per_machine),
        "idle_vs_q": [{"q": k, "constrained": round(c, 4), "plain": round(p, 4)}
                      for k, c, p in zip(curve.qs, curve.constrained, curve.unconstrained, strict=True)],
        "idle_uniform": round(curve.uniform, 4),
    }
    catalog = SliceCatalog(tuple(c for c, _ in stack), tuple(m for _, m in stack),
                           tuple(float(s) for s in shares / shares.sum()), source)
    return Fit(SliceCatalog.from_dict(catalog.to_dict()), curve)  # as a reader of the file will see it


def cut_summary(catalog: SliceCatalog, capacities: Sequence[tuple[int, int]]) -> list[tuple[int, int, tuple[int, ...]]]:
    """For each distinct (cpu_milli, memory_mib) node capacity: the slices of each type cut from it."""
    return [(c, m, catalog.cut(c, m)) for c, m in sorted(set(capacities))]
