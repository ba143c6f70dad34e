"""Stage 1 for the selector service: capacity filter from the placers' summaries, then cost ranking."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from hsched.costs import WanGraph
from hsched.costs.paths import PathFinder, RandomPathFinder
from hsched.costs.selection import METHODS, Candidate, rank_datacenters
from hsched.costs.stranding import GpuHostFree, StrandingConfig, free_of
from hsched.domain.cluster import ClusterState
from hsched.domain.errors import ValidationError
from hsched.domain.fleet import DataCenter, Fleet
from hsched.domain.task import TaskSpec
from hsched.engine.placer import SUMMARY_HEARTBEAT_S
from hsched.policies.placement import never_fits_reason, split_task

# A serving placer publishes a summary at least every heartbeat; one that has missed three is fenced, a
# standby, or gone, and its DC is left out until it serves again.
SUMMARY_STALE_S = 3 * SUMMARY_HEARTBEAT_S


@dataclass
class DcSelector:
    fleet: Fleet
    graph: WanGraph = None  # type: ignore[assignment]
    summaries: dict[str, dict] = field(default_factory=dict)  # latest summary per DC (from its placer)
    summary_seen: dict[str, float] = field(default_factory=dict)  # monotonic time it was published (≈ arrived)
    fencing_tokens: dict[str, int] = field(default_factory=dict)  # highest placer token seen per DC
    stale_after_s: float = SUMMARY_STALE_S
    superseded: int = 0  # summaries ignored because a newer placer of their DC had written
    _empty: dict[str, ClusterState] = field(default_factory=dict)
    # task shape -> {DC name: structural_misfit}: one shape lookup per call, not one per DC
    _fit_cache: dict[tuple, dict[str, str]] = field(default_factory=dict)
    # the DCs with GPUs (static), and per DC (its summary, the GpuHostFree parsed from it): parsed once per summary
    _gpu_dcs: frozenset[str] = frozenset()
    _gpu_hosts: dict[str, tuple[dict, GpuHostFree | None]] = field(default_factory=dict)
    # min-cost/spf routes (None: Dijkstra). rank_datacenters checks every path it gives against Dijkstra's;
    # path_checks / path_agreed count those checks and the paths it used (valid and not longer).
    path_finder: PathFinder | None = None
    path_checks: int = 0
    path_agreed: int = 0
    # the GPU-stranding term (hsched.costs.stranding; on by default, StrandingConfig(weight=0) = off)
    stranding: StrandingConfig = field(default_factory=StrandingConfig)

    def __post_init__(self) -> None:
        self.graph = self.graph or WanGraph(self.fleet.wan)
        self.graph.dijkstra.warm(self.fleet.wan.entry_vertices)
        self._empty = {dc.name: ClusterState(dc) for dc in self.fleet.datacenters}
        self._gpu_dcs = frozenset(name for name, empty in self._empty.items() if empty.table.gpu_count.any())
        self.random_paths = RandomPathFinder(self.graph, seed=0)

    def update_summary(self, summary: dict, age_s: float = 0.0) -> bool:
        """Keep `summary` (published `age_s` ago) as its DC's latest, unless its fencing token is lower than
        the highest seen for the DC: that is a superseded placer's late write, its view is not the ledger's.
        (If the holder of the higher token has gone silent for `stale_after_s`, a lower token is taken:
        Redis lost the fence counter and tokens started again.) Returns whether it was kept."""
        dc, token, now = summary["datacenter"], int(summary.get("fencing_token", 0)), time.monotonic()
        if token < self.fencing_tokens.get(dc, 0) and now - self.summary_seen.get(dc, now) <= self.stale_after_s:
            self.superseded += 1
            return False
        self.summaries[dc] = summary
        self.summary_seen[dc] = now - age_s
        self.fencing_tokens[dc] = token
        return True

    def structural_misfit(self, task: TaskSpec, dc: DataCenter) -> str:
        """"" if every part of the task fits some node of an empty `dc`, else why not (cached per shape)."""
        return self._misfit(self._fits_of(task), task, dc)

    def _fits_of(self, task: TaskSpec) -> dict[str, str]:
        """The cache of `structural_misfit` for the task's shape: {DC name: reason}, filled as DCs are asked."""
        key = (task.resources, task.replicas, task.gpu_models)
        fits = self._fit_cache.get(key)
        if fits is None:
            if len(self._fit_cache) > 50_000:
                self._fit_cache.clear()
            fits = self._fit_cache[key] = {}
        return fits

    def _misfit(self, fits: dict[str, str], task: TaskSpec, dc: DataCenter) -> str:
        hit = fits.get(dc.name)
        if hit is not None:
            return hit
        empty = self._empty[dc.name]
        reason = ""
        total = task.total
        cap = dc.capacity_total()
        short = [(f"{need:g} {unit}", f"{have:g} {unit}") for need, have, unit in (
            (total.cpu_cores, cap.cpu_cores, "cores"), (total.memory_mib / 1024, cap.memory_mib / 1024, "GiB memory"),
            (total.gpu_count, cap.gpu_count, "GPUs")) if need > have]
        if short:  # only what is short, with units
            reason = (f"the task needs {', '.join(n for n, _ in short)} in all, the DC has "
                      f"{', '.join(h for _, h in short)}")
        else:
            parts = split_task(task, dc)
            for part in {p.demand for p in parts}:
                if not empty.could_ever_fit(part, task.gpu_models).any():
                    reason = never_fits_reason(empty, part, task)
                    break
            r = task.resources
            # replicas of one part each (a replica cut into parts spreads over nodes: no per-node bound)
            if not reason and task.replicas > 1 and len(parts) == task.replicas:
                most = empty.replicas_it_could_hold(r, task.gpu_models)
                if most < task.replicas:
                    each = (f"{r.gpu_count} card(s) of {r.gpu_core_percent}% and {r.gpu_memory_mib} MiB"
                            f"{' of ' + '/'.join(task.gpu_models) if task.gpu_models else ''}" if r.gpu_count
                            else f"{r.cpu_cores:g} cores and {r.memory_mib} MiB")
                    reason = (f"its {task.replicas} replicas do not fit even in the empty DC: its nodes hold at most "
                              f"{most} of them (each needs {each})")
        fits[dc.name] = reason
        return reason

    def room_now(self, task: TaskSpec, dc: str) -> tuple[bool, int]:
        """(whether `dc`'s latest summary has room for `task` now, with nothing queued there; how many tasks queue
        there). Room: the free totals cover the task, and per resource some open node has a replica's CPU, memory
        and whole idle cards (for a whole-card GPU task) free. A necessary condition, as Karmada's resource-fit
        estimate is — no one node need have all three — so a placer may still queue the task."""
        summary = self.summaries.get(dc)
        if summary is None or "free" not in summary:  # (a summary that says nothing of room: no room known)
            return False, int((summary or {}).get("deferred_tasks", 0))
        queued = int(summary.get("deferred_tasks", 0))
        r = task.resources
        whole = r.gpu_core_percent >= 100
        free, total = summary["free"], task.total
        largest = summary.get("largest_free") or free[:2] + free[4:5]  # (a summary from before it was published)
        fits = (free[0] >= total.cpu_milli and free[1] >= total.memory_mib and free[4] >= total.gpu_count * whole
                and largest[0] >= r.cpu_milli and largest[1] >= r.memory_mib and largest[2] >= r.gpu_count * whole)
        return fits and queued == 0, queued

    def gpu_hosts(self, dcs: list[DataCenter]) -> dict[str, GpuHostFree]:
        """Free resources by host kind per DC with GPUs: from its placer's summary (an older placer's summary
        without them: its empty DC's, so the term still applies, if less precisely)."""
        if not self.stranding.on:
            return {}
        out = {}
        for dc in dcs:
            if dc.name in self._gpu_dcs:
                summary = self.summaries.get(dc.name, {})
                cached = self._gpu_hosts.get(dc.name)
                if cached is None or cached[0] is not summary:  # a new summary (each is a new dict): parse it
                    cached = self._gpu_hosts[dc.name] = (summary, GpuHostFree.from_dict(summary.get("gpu_hosts")))
                out[dc.name] = cached[1] or free_of(self._empty[dc.name])
        return out

    def select(self, task: TaskSpec, method: str = "") -> tuple[list[Candidate], list[tuple[str, str]], set[str]]:
        """The DCs that can take `task` in rank order; the others as (name, reason); and which of those could hold
        it but have no serving placer now (`unserved`: a transient exclusion, not a verdict on the task)."""
        method = method or "min-cost"
        if method not in METHODS:
            raise ValidationError("method", f"must be one of {', '.join(METHODS)}", method)
        entry = task.entry_vertex or self.fleet.wan.scheduler_vertex
        if entry not in self.graph:
            raise ValidationError("task.entry_vertex", "must name a vertex of the fleet's WAN", entry)
        excluded: list[tuple[str, str]] = []
        eligible: list[DataCenter] = []
        now = time.monotonic()
        fits = self._fits_of(task)
        unserved: set[str] = set()
        for dc in self.fleet.datacenters:
            if reason := self._misfit(fits, task, dc):
                excluded.append((dc.name, reason))
                continue
            if dc.name not in self.summaries:
                reason = "no capacity summary from its placer yet (placer not running?)"
            elif (age := now - self.summary_seen[dc.name]) > self.stale_after_s:
                reason = (f"its placer's last summary is {age:.0f} s old (over {self.stale_after_s:g} s): the placer "
                          "is down, fenced or a standby")
            else:
                eligible.append(dc)
                continue
            excluded.append((dc.name, reason))
            unserved.add(dc.name)
        ranked, far = rank_datacenters(task, eligible, self.graph, self.fleet.network_price_per_gb_ms, entry, method,
                                       path_finder=self.path_finder, random_path_finder=self.random_paths,
                                       gpu_hosts=self.gpu_hosts(eligible), stranding=self.stranding)
        if self.path_finder is not None and method != "crf":
            self.path_checks += len(ranked)
            self.path_agreed += sum(c.path_source == self.path_finder.name for c in ranked)
        return ranked, excluded + far, unserved
