"""Per-tenant fair share of one data center (Volcano's `proportion` plugin) and the deferred queue's order.

Deserved share (Volcano proportion, water-filling). Each tenant t has a weight w_t (default 1: equal) and a
request R_t = what it holds + what it waits for, a vector over DIMENSIONS. In each dimension, starting from
deserved D_t = 0 and remaining = the DC's capacity C, repeat while some tenant is not met (R_t > D_t):

    D_t <- min(D_t + remaining * w_t / (sum of the weights of the tenants not met), R_t)
    remaining <- remaining - (total increase of the D_t)

until remaining is empty or every tenant is met. A tenant never deserves more than it asks for, what a met
tenant does not need is shared again among the others by weight, and nothing is left idle that someone asks
for (weighted max-min fairness per dimension: the fixed point of Volcano's vector loop).

Share (Volcano's `share`): s_t = max over dimensions d of A_t[d] / D_t[d], with A_t what the tenant holds now
(a dimension it deserves nothing of counts 0 if it holds none of it, else 1). s_t < 1: the tenant is under its
deserved share.

Queue order (the deferred queue, when freed resources let waiting tasks in): online before offline; within a
class the tenant with the lowest share first; within a tenant higher `priority` first, then arrival. The share
is updated as each task is placed, so a tenant that just got resources yields to one further below its share
(Volcano re-sorts its queues the same way after every allocation).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from hsched import yamlfile
from hsched.domain.errors import ValidationError
from hsched.domain.fleet import NodeTable
from hsched.domain.resources import Resources
from hsched.domain.task import NAME_RE, ONLINE

# What a share is measured on: CPU, memory and GPU (core percent summed over cards; 100 = one whole card),
# in the order of hsched.domain.cluster.usage_vector (what the DC's fold keeps per tenant).
DIMENSIONS = ("cpu_milli", "memory_mib", "gpu_core_percent")
_EPS = 1e-9


def demand_vector(r: Resources, replicas: int = 1) -> np.ndarray:
    """What a task asks for (per-replica `r` times `replicas`), over DIMENSIONS."""
    return np.array([r.cpu_milli * replicas, r.memory_mib * replicas, r.gpu_count * r.gpu_core_percent * replicas],
                    dtype=np.float64)


def capacity_vector(table: NodeTable) -> np.ndarray:
    """The data center's capacity, over DIMENSIONS."""
    return np.array([table.cpu_milli.sum(), table.memory_mib.sum(), table.gpu_core_percent.sum()], dtype=np.float64)


def dominant_share(v: Sequence[float], capacity: Sequence[float]) -> float:
    """The largest fraction of the DC's capacity `v` takes in any dimension (DRF's dominant share)."""
    return max((float(a) / float(c) for a, c in zip(v, capacity, strict=True) if c > 0), default=0.0)


@dataclass(frozen=True)
class TenantWeights:
    """Weights of the tenants' deserved shares; a tenant not listed has `default`."""

    weights: Mapping[str, float] = field(default_factory=dict)
    default: float = 1.0

    def of(self, tenant: str) -> float:
        return self.weights.get(tenant, self.default)

    @staticmethod
    def parse(text: str, what: str = "--tenant-weights") -> TenantWeights:
        """From `tenant=weight,...` or the path of a YAML/JSON file `{tenant: weight, ...}` (optionally under a
        top-level `tenants:` key, with `default:` for the unlisted ones); ValidationError naming the entry."""
        text = text.strip()
        if not text:
            return TenantWeights()
        if os.path.exists(text):
            try:  # YAML 1.1 numbers: a tenant key such as `1e5` stays a name; a weight is read with float() anyway
                raw = yamlfile.document(yamlfile.read_text(text), text, json_numbers=False)
            except OSError as exc:
                raise ValidationError(what, f"cannot read the weights file: {exc}", text) from None
            except yamlfile.YamlFileError as exc:
                raise ValidationError(f"{what} {text}", exc.rule) from None
            if raw is None:
                return TenantWeights()
            if not isinstance(raw, dict):
                raise ValidationError(what, "the weights file must be a mapping tenant: weight", text)
            default = raw.get("default", 1.0) if "tenants" in raw else 1.0
            entries = raw["tenants"] if "tenants" in raw else raw
            if not isinstance(entries, dict):
                raise ValidationError(f"{what}.tenants", "must be a mapping tenant: weight", entries)
            pairs = list(entries.items())
        else:
            default, pairs = 1.0, []
            for item in text.split(","):
                name, sep, value = item.partition("=")
                if not sep:
                    raise ValidationError(what, "must be tenant=weight[,tenant=weight...] or an existing file", item)
                pairs.append((name.strip(), value.strip()))
        weights = {}
        for name, value in pairs:
            if not isinstance(name, str) or not NAME_RE.match(name):  # else it could never match a task's tenant
                raise ValidationError(what, "tenant names must be lowercase letters, digits, '.', '_' or '-' "
                                      "(a task's tenant rule)", repr(name))
            if name in weights:
                raise ValidationError(f"{what}[{name}]", "is given twice", value)
            weights[name] = _weight(f"{what}[{name}]", value)
        return TenantWeights(weights, _weight(f"{what}.default", default))

    def to_json(self) -> str:
        return json.dumps({"tenants": dict(self.weights), "default": self.default})


def _weight(where: str, value: object) -> float:
    try:
        w = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValidationError(where, "must be a number > 0", value) from None
    if isinstance(value, bool) or not math.isfinite(w) or w <= 0:
        raise ValidationError(where, "must be a finite number > 0", value)
    return w


def deserved(capacity: np.ndarray, requests: Mapping[str, np.ndarray], weights: TenantWeights) -> dict[str, np.ndarray]:
    """Each tenant's deserved share of `capacity`: the module's water-filling, dimension by dimension. Volcano's
    loop approaches this only geometrically (a tenant met in one dimension but not another still takes part
    in every round); computed exactly here, each round either meets a tenant or hands out all that is left."""
    out = {t: np.zeros(len(capacity), dtype=np.float64) for t in requests}
    for k, cap in enumerate(np.asarray(capacity, dtype=np.float64)):
        left = float(cap)
        active = {t for t, r in requests.items() if r[k] > _EPS}
        while active and left > _EPS:
            total_weight = sum(weights.of(t) for t in active)
            met = {t for t in active if requests[t][k] - out[t][k] <= left * weights.of(t) / total_weight + _EPS}
            if not met:  # nobody is met by a proportional split of what is left: split it all
                for t in active:
                    out[t][k] += left * weights.of(t) / total_weight
                break
            for t in met:  # met tenants take only what they ask; the rest is split again among the others
                left -= float(requests[t][k] - out[t][k])
                out[t][k] = float(requests[t][k])
            active -= met
    return out


def share(allocated: np.ndarray, deserved_: np.ndarray) -> float:
    """max over dimensions of allocated / deserved (Volcano's share; a dimension deserved 0 counts 0 or 1)."""
    s = 0.0
    for a, d in zip(allocated, deserved_, strict=True):
        s = max(s, (0.0 if a <= _EPS else 1.0) if d <= _EPS else a / d)
    return s


@dataclass(frozen=True)
class Waiting:
    """A task in the deferred queue, as the order sees it. `arrival` orders tasks of equal priority (lower first)."""

    task_id: str
    tenant: str
    priority_class: str  # online | offline
    priority: int
    arrival: int
    demand: np.ndarray = field(compare=False)


class FairQueue:
    """The deferred queue's order for one pass (module docstring): iterate it; call `placed(w)` after placing
    the task last yielded so its tenant's share grows before the next pick. Tasks that do not fit are simply
    passed over (they stay in the queue) and do not count toward their tenant's share."""

    def __init__(self, waiting: Iterable[Waiting], held: Mapping[str, np.ndarray], capacity: np.ndarray,
                 weights: TenantWeights, pick: Callable[[list[Waiting]], Waiting] | None = None) -> None:
        """`pick(band)`: which offline task of the chosen lane's band (its tasks of the best priority, best
        last) goes next (the placer's --dag-policy); it must return one of them. None: the last (arrival)."""
        self.pick = pick
        self._lanes: dict[tuple[str, str], list[Waiting]] = {}
        pending: dict[str, np.ndarray] = {}
        for w in waiting:
            self._lanes.setdefault((w.priority_class, w.tenant), []).append(w)
            pending[w.tenant] = pending.get(w.tenant, 0.0) + w.demand
        for lane in self._lanes.values():  # popped from the end: the best last
            lane.sort(key=lambda w: (w.priority, -w.arrival))
        zero = np.zeros(len(DIMENSIONS))
        self.held = {t: np.asarray(held.get(t, zero), dtype=np.float64).copy() for t in {*pending, *held}}
        # what each tenant asks for: what it holds and what it waits for (read by the placer's tenant view too)
        self.requested = {t: self.held[t] + pending.get(t, zero) for t in self.held}
        self.deserved = deserved(capacity, self.requested, weights)

    def share(self, tenant: str) -> float:
        return share(self.held[tenant], self.deserved[tenant])

    def __iter__(self) -> Iterator[Waiting]:
        while self._lanes:
            key, lane = min(self._lanes.items(), key=lambda kl: (class_rank(kl[0][0]), self.share(kl[0][1]),
                                                                 -kl[1][-1].priority, kl[1][-1].arrival))
            w = lane[-1]
            if self.pick is not None and w.priority_class != ONLINE and len(lane) > 1:
                start = len(lane) - 1  # the band: the lane's tail of w's priority
                while start > 0 and lane[start - 1].priority == w.priority:
                    start -= 1
                if start < len(lane) - 1:
                    w = self.pick(lane[start:])
            if w is lane[-1]:
                lane.pop()
            else:  # a pick from the band, found by identity (list.remove would compare field by field from the head)
                i = len(lane) - 1
                while lane[i] is not w:
                    i -= 1
                del lane[i]
            if not lane:
                del self._lanes[key]
            yield w

    def placed(self, w: Waiting) -> None:
        """`w` (the task last yielded) was placed: its demand now counts toward its tenant's share."""
        self.held[w.tenant] = self.held[w.tenant] + w.demand

    def evicted(self, tenant: str, usage: np.ndarray) -> None:
        """A task of `tenant` holding `usage` was preempted during the pass: its share shrinks by that."""
        if tenant in self.held:
            self.held[tenant] = self.held[tenant] - usage


def class_rank(priority_class: str) -> int:
    """Online tasks before offline ones ("" is offline, as on the wire)."""
    return 0 if priority_class == ONLINE else 1
