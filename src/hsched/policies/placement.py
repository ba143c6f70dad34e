"""Turn a task into parts and parts into node choices — the same code for the placer, simulators, trainers.

Splitting (paper 003 §1.2.1): a CPU-only replica larger than the DC's split threshold (by default
the largest node) becomes subtasks of at most `split_chunk` cores, each on a single server.
Replicas are placed one by one with the state updated in between (paper 002), so two replicas
never count the same free core twice. GPU replicas are never split: a slice cannot span nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from hsched.domain.cluster import ClusterState, Part
from hsched.domain.fleet import DataCenter
from hsched.domain.resources import Resources
from hsched.domain.task import TaskSpec
from hsched.policies.base import NodePolicy, select


class Outcome(Enum):
    PLACED = "placed"
    NO_ROOM = "no_room"  # fits this DC's nodes, not now
    UNSCHEDULABLE = "unschedulable"  # no node of this DC could ever hold a part


@dataclass(frozen=True, slots=True)
class PartDemand:
    replica: int
    part: int
    demand: Resources


@dataclass
class Plan:
    outcome: Outcome
    parts: tuple[Part, ...] = ()
    alternatives: tuple[tuple[int, float], ...] = ()  # for the first part
    reason: str = ""
    notes: list[str] = field(default_factory=list)
    thermal_limited: bool = False  # refused because of the redline, not for lack of resources
    # with a headroom: per part, the extra IT power on its node (part_power_w's; the placer's batch uses it)
    part_power_w: tuple[float, ...] = ()


def split_task(task: TaskSpec, dc: DataCenter) -> list[PartDemand]:
    r = task.resources
    threshold, chunk = dc.effective_split_threshold_milli, dc.split_chunk_milli
    out: list[PartDemand] = []
    for replica in range(task.replicas):
        if r.gpu_count or r.cpu_milli <= threshold:
            out.append(PartDemand(replica, 0, r))
            continue
        n = -(-r.cpu_milli // chunk)  # ceil
        for i in range(n):
            out.append(PartDemand(replica, i, Resources(
                _share(r.cpu_milli, chunk, r.cpu_milli, i, n), _share(r.memory_mib, chunk, r.cpu_milli, i, n),
                _share(r.disk_mib, chunk, r.cpu_milli, i, n), _share(r.bandwidth_mbps, chunk, r.cpu_milli, i, n))))
    return out


def _share(total: int, chunk: int, cpu: int, i: int, n: int) -> int:
    """Part i's share of `total` when `cpu` is cut into chunks: proportional, the remainder on the last part,
    so the parts sum to `total` exactly."""
    base = total * chunk // cpu
    return base if i < n - 1 else total - base * (n - 1)


CPU_WATTS_KEPT = 64  # part_power_w's memo: at most this many cpu_milli values per table (~80 KiB each at 10,000 nodes)


def part_power_w(state: ClusterState, demand: Resources, node: int | None = None) -> np.ndarray:
    """Extra IT power if `demand` ran on each node — or on `node` only (eq.5's busy-core term above idle,
    plus the GPU term). `server_power(demand.cpu_milli, cores, 0.0, P_full − P_idle)` over
    NodeTable.power_slopes: the same floats (tests/test_candidates.py). Every node's CPU term is memoised per
    cpu_milli on the table (`NodeTable.cpu_watts`; the array returned for a CPU-only demand is that memo, read-only)."""
    table = state.table
    cores, has_cores, slope, gpu_slope = table.power_slopes
    if node is not None:
        idx = slice(node, node + 1)
        watts = _cpu_watts(demand.cpu_milli, cores[idx], has_cores[idx], slope[idx])
        gpu_slope = gpu_slope[idx]
    else:
        memo = table.cpu_watts
        watts = memo.get(demand.cpu_milli)
        if watts is None:
            if len(memo) >= CPU_WATTS_KEPT:
                memo.clear()
            watts = memo[demand.cpu_milli] = _cpu_watts(demand.cpu_milli, cores, has_cores, slope)
            watts.flags.writeable = False
    if demand.gpu_count:
        watts = watts + demand.gpu_units * gpu_slope
    return watts


def _cpu_watts(cpu_milli: int, cores: np.ndarray, has_cores: np.ndarray, slope: np.ndarray) -> np.ndarray:
    util = np.divide(float(cpu_milli), cores, out=np.zeros(len(cores)), where=has_cores)
    return 0.0 + (slope - 0.0) * util  # server_power's p_idle + (p_full - p_idle) * util with p_idle = 0.0


RESERVE_NOTE = "took GPU hosts' reserved CPU/memory: a job's stage runs in its job's data center"


def plan(state: ClusterState, task: TaskSpec, policy: NodePolicy, headroom_w: np.ndarray | None = None) -> Plan:
    """Choose nodes (and GPU cards) for every part of `task`, or say why not. Leaves `state` unchanged.

    `headroom_w[k]` is the extra IT power node k may take before some inlet passes the redline (from
    the thermal model); nodes whose part power exceeds it are masked out, as are nodes without room.
    """
    parts: list[Part] = []
    watts: list[float] = []
    first_alternatives: tuple[tuple[int, float], ...] = ()
    # the caller's array, copied before the first change (only a task of several parts needs one)
    headroom = None if headroom_w is None else np.asarray(headroom_w, dtype=np.float64)
    headroom_copied = False
    demands = split_task(task, state.dc)
    notes = [f"split into {len(demands)} parts of <= {state.dc.split_chunk_milli // 1000} cores (paper 003)"] \
        if len(demands) > task.replicas else []
    sliced = getattr(state, "slice_options", None)  # a SlicedState (hsched.engine.slices): one slice per part
    reserved = hasattr(policy, "narrow_mask")  # hsched.costs.stranding.GpuReservePolicy
    try:
        for d in demands:
            if sliced is not None and (never := state.slice_never_fits(d.demand)) is not None:
                return Plan(Outcome.UNSCHEDULABLE, reason=f"replica {d.replica} part {d.part}: {never}", notes=notes)
            # without slices the part itself; with them, the slice sizes covering it, smallest first
            options = sliced(d.demand) if sliced is not None else [(d.demand, None)]
            choice, too_hot, reserve_held = None, False, False
            for demand, free_slice in options:
                mask = state.feasible(demand, task.gpu_models)
                if free_slice is not None:
                    mask &= free_slice
                power = None
                if headroom is not None:
                    power = part_power_w(state, demand)
                    cool = mask & (power <= headroom)
                    too_hot |= bool(not cool.any() and mask.any())
                    mask = cool
                choice = select(policy, state, demand, mask)
                if choice is None and reserved and mask.any():  # only the GPU hosts' reserve stands in the way
                    reserve_held = True
                    if task.job_id:  # a job's stage is pinned to its job's DC: nowhere else to go, so it may take it
                        choice = select(policy, state, demand, mask, narrow=False)
                        if choice is not None and RESERVE_NOTE not in notes:
                            notes.append(RESERVE_NOTE)
                if choice is not None:
                    break
            if choice is None:
                if too_hot:
                    return Plan(Outcome.NO_ROOM, reason="every node with room would push an inlet past the "
                                "thermal redline", notes=notes, thermal_limited=True)
                if not state.could_ever_fit(d.demand, task.gpu_models).any():
                    return Plan(Outcome.UNSCHEDULABLE, reason=never_fits_reason(state, d.demand, task), notes=notes)
                if reserve_held:
                    return Plan(Outcome.NO_ROOM, reason=f"replica {d.replica} part {d.part}: only GPU hosts have room "
                                "now, and their CPU and memory are kept for their idle GPUs (--gpu-reserve)",
                                notes=notes)
                if held_off := state.cordoned_with_room(d.demand, task.gpu_models):
                    names = ", ".join(state.table.names[i] for i in held_off[:3]) + (", ..." if len(held_off) > 3 else "")
                    return Plan(Outcome.NO_ROOM, reason=f"replica {d.replica} part {d.part}: only cordoned nodes have "
                                f"room now ({names}; hsched uncordon)", notes=notes)
                if sliced is not None:
                    return Plan(Outcome.NO_ROOM, reason=f"replica {d.replica} part {d.part}: "
                                f"{state.no_room_reason(d.demand)}", notes=notes)
                return Plan(Outcome.NO_ROOM, reason=f"no node has room for replica {d.replica} part {d.part} now",
                            notes=notes)
            if not parts:
                first_alternatives = choice.alternatives
            node = choice.node
            part = Part(d.replica, d.part, node, demand.cpu_milli, demand.memory_mib, demand.disk_mib,
                        demand.bandwidth_mbps, state.choose_cards(node, demand))
            state._delta((part,), -1)  # tentative: later parts see this one (paper 002)
            parts.append(part)
            if headroom is not None and power is not None:
                if not headroom_copied:
                    headroom, headroom_copied = headroom.copy(), True
                headroom[node] -= power[node]
                watts.append(float(power[node]))
    finally:
        state._delta(tuple(parts), +1)
    return Plan(Outcome.PLACED, tuple(parts), first_alternatives, notes=notes, part_power_w=tuple(watts))


def never_fits_reason(state: ClusterState, demand: Resources, task: TaskSpec) -> str:
    t = state.table
    if demand.gpu_count:
        allowed = (t.gpu_count > 0) & state.model_mask(task.gpu_models)
        models = f" {'/'.join(task.gpu_models)}" if task.gpu_models else ""
        if task.gpu_models and not allowed.any():
            return f"no node of {state.dc.name} has GPU model {'/'.join(task.gpu_models)}"
        most = int(t.gpu_count[allowed].max(initial=0))
        if most < demand.gpu_count:
            return f"no node of {state.dc.name} has {demand.gpu_count}{models} GPUs (max {most})"
        card_mib = int(t.gpu_memory_mib[allowed].max(initial=0))
        if demand.gpu_memory_mib > card_mib:
            return (f"gpu_memory_mib {demand.gpu_memory_mib} per card exceeds the largest{models} card of "
                    f"{state.dc.name} ({card_mib} MiB)")
    for name, need, cap in (("cpu_milli", demand.cpu_milli, t.cpu_milli), ("memory_mib", demand.memory_mib, t.memory_mib),
                            ("disk_mib", demand.disk_mib, t.disk_mib),
                            ("bandwidth_mbps", demand.bandwidth_mbps, t.bandwidth_mbps)):
        if need > int(cap.max()):
            return f"{name} {need} per node exceeds the largest node of {state.dc.name} ({int(cap.max())})"
    return f"no single node of {state.dc.name} can hold one part of this task"
