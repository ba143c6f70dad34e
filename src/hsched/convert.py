"""Protobuf ⇄ domain conversions, in one place for every service and client."""

from __future__ import annotations

from collections.abc import Sequence

from hsched.domain.cluster import GpuShare, Part
from hsched.domain.fleet import NodeTable
from hsched.domain.resources import Resources
from hsched.domain.task import NetworkRequirements, TaskSpec
from hsched.v1 import common_pb2 as pb

RESOURCE_FIELDS = ("cpu_milli", "memory_mib", "disk_mib", "bandwidth_mbps", "gpu_count", "gpu_core_percent",
                   "gpu_memory_mib")


def resources_from_pb(m: pb.Resources) -> Resources:
    return Resources(*(int(getattr(m, f)) for f in RESOURCE_FIELDS))


def resources_to_pb(r: Resources | Sequence[int]) -> pb.Resources:
    values = [getattr(r, f) for f in RESOURCE_FIELDS] if isinstance(r, Resources) else list(r)
    return pb.Resources(**dict(zip(RESOURCE_FIELDS, values, strict=True)))


def task_from_pb(m: pb.TaskSpec) -> TaskSpec:
    """Wire defaults: replicas 0 → 1, tenant "" → "default". Validation is the caller's (TaskSpec.validate)."""
    return TaskSpec(
        resources=resources_from_pb(m.resources), runtime_s=m.runtime_s, tenant=m.tenant or "default", name=m.name,
        request_id=m.request_id, priority=m.priority, replicas=m.replicas or 1, data_size_mb=m.data_size_mb,
        entry_vertex=m.entry_vertex,
        network=NetworkRequirements(m.network.max_latency_ms, m.network.max_jitter_ms, m.network.max_loss_percent),
        gpu_models=tuple(m.gpu_models), priority_class=m.priority_class, queue_timeout_s=m.queue_timeout_s,
        job_id=m.job_id, stage=m.stage, stage_path_s=m.stage_path_s, job_work_s=m.job_work_s)


def task_to_pb(t: TaskSpec) -> pb.TaskSpec:
    n = t.network
    return pb.TaskSpec(
        request_id=t.request_id, tenant=t.tenant, name=t.name, priority=t.priority,
        resources=resources_to_pb(t.resources), replicas=t.replicas, runtime_s=t.runtime_s,
        data_size_mb=t.data_size_mb, entry_vertex=t.entry_vertex,
        network=pb.NetworkRequirements(max_latency_ms=n.max_latency_ms, max_jitter_ms=n.max_jitter_ms,
                                       max_loss_percent=n.max_loss_percent),
        gpu_models=list(t.gpu_models), priority_class=t.priority_class, queue_timeout_s=t.queue_timeout_s,
        job_id=t.job_id, stage=t.stage, stage_path_s=t.stage_path_s, job_work_s=t.job_work_s)


def parts_to_pb(parts: Sequence[Part], table: NodeTable) -> list[pb.Assignment]:
    return [pb.Assignment(
        replica=p.replica, part=p.part, node=table.names[p.node], node_index=p.node, rack=int(table.rack[p.node]),
        resources=pb.Resources(cpu_milli=p.cpu_milli, memory_mib=p.memory_mib, disk_mib=p.disk_mib,
                               bandwidth_mbps=p.bandwidth_mbps, gpu_count=len(p.gpus),
                               gpu_core_percent=p.gpus[0].core_percent if p.gpus else 0,
                               gpu_memory_mib=p.gpus[0].memory_mib if p.gpus else 0),
        gpus=[pb.GpuSlice(card=g.card, core_percent=g.core_percent, memory_mib=g.memory_mib,
                          model=table.gpu_model[p.node]) for g in p.gpus],
    ) for p in parts]


def parts_from_pb(assignments: Sequence[pb.Assignment]) -> tuple[Part, ...]:
    """The ledger's parts of a task as a gateway reply shows them (the inverse of `parts_to_pb`)."""
    return tuple(Part(a.replica, a.part, a.node_index, a.resources.cpu_milli, a.resources.memory_mib,
                      a.resources.disk_mib, a.resources.bandwidth_mbps,
                      tuple(GpuShare(g.card, g.core_percent, g.memory_mib) for g in a.gpus))
                 for a in assignments)
