"""What the CLI prints for the fleet views and `-o table|json|yaml` (hsched dcs / nodes / describe, get, list, watch,
job). json and yaml are the gateway's reply as protobuf's JSON mapping (field names as in the .proto); the tables
are columns separated by at least two spaces, kubectl-style, with units in the headers."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict

from hsched.v1 import common_pb2 as pb
from hsched.v1 import gateway_pb2

FORMATS = ("table", "json", "yaml")
GIB = 1024  # MiB


_INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
          FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}


def as_dict(message) -> dict:
    """The message as protobuf's JSON mapping, but 64-bit integers as numbers (the mapping writes them as
    strings, which `hsched submit -f` rightly refuses: what `-o yaml` prints must read back as printed)."""
    return _int64_as_numbers(message, MessageToDict(message, preserving_proto_field_name=True))


def _int64_as_numbers(message, d: dict) -> dict:
    for f in message.DESCRIPTOR.fields:
        if f.name not in d or (f.message_type is not None and f.message_type.GetOptions().map_entry):
            continue
        value = getattr(message, f.name)
        if f.message_type is not None:
            if f.is_repeated:
                for item, out in zip(value, d[f.name], strict=True):
                    _int64_as_numbers(item, out)
            else:
                _int64_as_numbers(value, d[f.name])
        elif f.type in _INT64:
            d[f.name] = list(value) if f.is_repeated else value
    return d


def dump(document, fmt: str) -> str:
    """A document (a message or plain data) as json or yaml text."""
    if not isinstance(document, (dict, list)):
        document = as_dict(document)
    if fmt == "yaml":
        import yaml

        from hsched.yamlfile import YamlDumper  # what `submit -f` reads back as it was printed

        return yaml.dump(document, Dumper=YamlDumper, sort_keys=False, allow_unicode=True).rstrip("\n")
    return json.dumps(document, indent=2, ensure_ascii=False)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns, two spaces apart; the last column is not padded."""
    cells = [list(map(str, headers)), *([str(c) for c in r] for r in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) if i < len(r) - 1 else c for i, (c, w) in enumerate(zip(r, widths, strict=True)))
                     .rstrip() for r in cells)


def _num(x: float, digits: int = 1) -> str:
    return f"{x:.{digits}f}".rstrip("0").rstrip(".") if x != int(x) else str(int(x))


def cores(milli: int) -> str:
    return _num(milli / 1000, 3)  # to the millicore: 250m is 0.25, not 0.2


def gib(mib: int) -> str:
    return _num(round(mib / GIB, 1))


def _pct(ratio: float) -> str:
    return f"{100 * ratio:.1f}%"


# -- hsched dcs ---------------------------------------------------------------------------------------------------

DCS_HEADERS = ("NAME", "KIND", "STATUS", "NODES", "CPU(FREE/TOTAL)", "MEM_GIB(FREE/TOTAL)", "GPUS(IDLE/TOTAL)",
               "CPU%", "MEM%", "GPU%", "PUE", "INLET_C", "QUEUED", "POLICY", "LEASE")


def gpus_cell(view: gateway_pb2.DatacenterView) -> str:
    if view.status != "serving":
        return ",".join(f"{m} -/?" for m in view.summary.gpu_models) or "-"
    return ",".join(f"{g.model} {g.cards_idle}/{g.cards}" for g in view.gpus) or "-"


def lease_cell(lease: gateway_pb2.PlacerLease) -> str:
    if not lease.holder:
        return f"none (token {lease.fencing_token})" if lease.fencing_token else "none"
    return f"{lease.holder} token {lease.fencing_token} ttl {lease.ttl_ms / 1000:.1f}s"


def dcs_rows(reply: gateway_pb2.ListDatacentersResponse) -> list[list[str]]:
    rows = []
    for v in reply.datacenters:
        s, live = v.summary, v.status == "serving"
        dash = "-"
        gpu = _pct(s.gpu_core_utilisation) if live and s.capacity.gpu_count else dash
        rows.append([
            v.datacenter, v.kind, v.status, f"{s.nodes} ({s.cordoned_nodes} cordoned)" if s.cordoned_nodes else str(s.nodes),
            f"{cores(s.free.cpu_milli) if live else '?'}/{cores(s.capacity.cpu_milli)}",
            f"{gib(s.free.memory_mib) if live else '?'}/{gib(s.capacity.memory_mib)}",
            gpus_cell(v), _pct(s.cpu_utilisation) if live else dash, _pct(s.memory_utilisation) if live else dash,
            gpu, f"{v.thermal.pue_after:.3f}" if v.thermal.pue_after else dash,
            f"{v.thermal.max_inlet_after_c:.1f}" if v.thermal.max_inlet_after_c else dash,
            str(s.deferred_tasks) if live else dash, v.policy or dash, lease_cell(v.lease)])
    return rows


def not_serving(reply: gateway_pb2.ListDatacentersResponse) -> list[str]:
    """A line per DC whose placer does not answer, with why (under a fleet table)."""
    return [f"{v.datacenter}: {v.status} — {v.reason}" for v in reply.datacenters if v.status != "serving"]


def dcs_table(reply: gateway_pb2.ListDatacentersResponse) -> str:
    return "\n".join([table(DCS_HEADERS, dcs_rows(reply)), *not_serving(reply)])


# -- hsched tenants -----------------------------------------------------------------------------------------------

TENANTS_HEADERS = ("DATACENTER", "TENANT", "WEIGHT", "RUNNING", "QUEUED", "CPU(ALLOC/DESERVED/ASKED)",
                   "MEM_GIB(ALLOC/DESERVED/ASKED)", "GPUS(ALLOC/DESERVED/ASKED)", "SHARE")


def tenants_rows(reply: gateway_pb2.ListDatacentersResponse) -> list[list[str]]:
    def amounts(t, dim: str, unit) -> str:
        return "/".join(unit(getattr(getattr(t, k), dim)) for k in ("allocated", "deserved", "requested"))

    def cards(percent: float) -> str:
        return _num(percent / 100, 2)  # core percent summed over cards: 100 = one card, 25 = 0.25
    return [[v.datacenter, t.tenant, _num(t.weight), str(t.running_tasks), str(t.queued_tasks),
             amounts(t, "cpu_milli", cores), amounts(t, "memory_mib", gib), amounts(t, "gpu_core_percent", cards),
             f"{t.share:.2f}"]
            for v in reply.datacenters for t in v.tenants]


def tenants_table(reply: gateway_pb2.ListDatacentersResponse) -> str:
    """Per DC and tenant: its fair share (SHARE < 1: below what it deserves; the deferred queue serves the lowest
    first); DCs whose placer does not answer are named under the table."""
    return "\n".join([table(TENANTS_HEADERS, tenants_rows(reply)), *not_serving(reply)])


# -- hsched nodes DC ----------------------------------------------------------------------------------------------

NODES_HEADERS = ("NODE", "RACK", "STATUS", "TASKS", "CPU(FREE/TOTAL)", "MEM_GIB(FREE/TOTAL)", "GPU_MODEL",
                 "CARDS(CARD:FREE_CORE%/FREE_GIB)")


def node_status(n) -> str:
    """ok; cordoned (no new placements) while tasks still run there; drained once none does (as Slurm says)."""
    return ("cordoned" if n.tasks else "drained") if n.cordoned else "ok"


def nodes_rows(view: gateway_pb2.DatacenterView) -> list[list[str]]:
    return [[n.name, str(n.rack), node_status(n), str(n.tasks),
             f"{cores(n.free.cpu_milli)}/{cores(n.capacity.cpu_milli)}",
             f"{gib(n.free.memory_mib)}/{gib(n.capacity.memory_mib)}",
             n.gpus[0].model if n.gpus else "-",
             " ".join(f"{c.card}:{c.core_percent_free}%/{gib(c.memory_mib_free)}" for c in n.gpus) or "-"]
            for n in view.nodes]


def nodes_table(view: gateway_pb2.DatacenterView) -> str:
    head = f"{view.datacenter} ({view.kind}, vertex {view.vertex}): policy {view.policy}, {len(view.nodes)} nodes"
    totals = [f"{g.model}: {g.cards_idle}/{g.cards} cards idle, {g.core_percent_free / 100:g} card-equivalents of "
              f"cores and {gib(g.memory_mib_free)}/{gib(g.memory_mib_capacity)} GiB free" for g in view.gpus]
    cordons = [f"{n.name} {node_status(n)} since {_when(n.cordoned_unix_ms)}: {n.cordon_reason or 'no reason given'}"
               for n in view.nodes if n.cordoned]
    return "\n".join([head, *totals, table(NODES_HEADERS, nodes_rows(view)), *cordons])


# -- hsched describe TASK -----------------------------------------------------------------------------------------


def state_name(state: int) -> str:
    return pb.TaskState.Name(state).removeprefix("TASK_STATE_")


def _when(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}Z" if ms else "-"


def resources_text(r: pb.Resources) -> str:
    parts = [f"{cores(r.cpu_milli)} cores", f"{gib(r.memory_mib)} GiB memory"]
    if r.disk_mib:
        parts.append(f"{gib(r.disk_mib)} GiB disk")
    if r.bandwidth_mbps:
        parts.append(f"{r.bandwidth_mbps} Mbit/s")
    if r.gpu_count:
        parts.append(f"{r.gpu_count} GPU slices of {r.gpu_core_percent}% cores and {gib(r.gpu_memory_mib)} GiB")
    return ", ".join(parts)


def _cost(c: pb.DcCandidate) -> str:
    r = c.resource_cost
    items = [f"{k} {getattr(r, k):.4f}" for k in ("cpu", "memory", "disk", "bandwidth", "gpu") if getattr(r, k)]
    return (f"resource {r.total:.4f} ({' + '.join(items) or '0'}) + network {c.network_cost:.4f} "
            f"= {c.total_cost:.4f}")


def describe_text(d: gateway_pb2.TaskDescription) -> str:
    t, ex = d.task, d.task.explanation
    spec = t.spec
    lines = [f"Task:         {t.task_id}", f"State:        {state_name(t.state)}"
             + (f" ({t.reason})" if t.reason else ""),
             f"Tenant:       {spec.tenant}" + (f"   Name: {spec.name}" if spec.name else "")
             + (f"   Job: {spec.job_id} stage {spec.stage}" if spec.job_id else ""),
             f"Requested:    {resources_text(spec.resources)} per replica, {spec.replicas or 1} replica(s)",
             (f"              runtime {_num(spec.runtime_s)} s" if spec.runtime_s else "              runs until released")
             + f", {_num(spec.data_size_mb)} MB of data from {spec.entry_vertex or 'the scheduler vertex'}"
             + f", class {spec.priority_class or 'offline'}, priority {spec.priority}"
             + (f", GPU models {','.join(spec.gpu_models)}" if spec.gpu_models else ""),
             f"Created:      {_when(t.created_unix_ms)}   Started: {_when(t.started_unix_ms)}   "
             f"Finished: {_when(t.finished_unix_ms)}" + (f"   Preempted: {t.preemptions}x" if t.preemptions else "")]
    chosen = next((c for c in ex.ranking if c.datacenter == t.datacenter), None)
    lines.append(f"Data center:  {t.datacenter or '-'}")
    if chosen is not None:
        rank = [c.datacenter for c in ex.ranking].index(chosen.datacenter) + 1
        why = (f"ranked {rank} of {len(ex.ranking)} by the selector ({ex.selector_method or 'min-cost'}); "
               f"total cost {chosen.total_cost:.4f}")
        if rank > 1:
            why += "; the DCs ranked above it could not place it (see Notes)"
        elif len(ex.ranking) > 1:
            runner = ex.ranking[1]
            why += f", {runner.total_cost - chosen.total_cost:.4f} below the next, {runner.datacenter}"
        lines += [f"Why:          {why}", f"Cost:         {_cost(chosen)}",
                  f"Path:         {' -> '.join(chosen.path.vertices)}  ({chosen.path.latency_ms:.2f} ms, jitter "
                  f"{chosen.path.jitter_ms:.2f} ms, loss {chosen.path.loss_percent:g}%, "
                  f"{chosen.path.finder or 'dijkstra'})"]
    if t.assignments:
        lines.append(f"Placement:    policy {ex.placer_policy or '-'}")
        lines += ["  " + row for row in table(
            ("REPLICA", "PART", "NODE", "RACK", "CPU", "MEM_GIB", "GPU_SLICES(CARD:CORE%/GIB MODEL)"),
            [[a.replica, a.part, a.node, a.rack, cores(a.resources.cpu_milli), gib(a.resources.memory_mib),
              " ".join(f"{g.card}:{g.core_percent}%/{gib(g.memory_mib)} {g.model}" for g in a.gpus) or "-"]
             for a in t.assignments]).splitlines()]
    th = ex.thermal
    if th.redline_c:
        lines.append(f"Thermal:      hottest inlet {th.max_inlet_before_c:.2f} -> {th.max_inlet_after_c:.2f} °C "
                     f"(redline {th.redline_c:g} °C, supply {th.t_supply_c:.1f} °C), PUE {th.pue_before:.4f} -> "
                     f"{th.pue_after:.4f}, room model version {th.model_version}"
                     + (" (default)" if not th.model_version else ""))
    if ex.alternatives:
        lines.append("Alternatives: " + ", ".join(f"{a.node} ({a.score:.4g})" for a in ex.alternatives)
                     + "  (nodes the policy scored, best first)")
    if ex.ranking:
        lines.append("Ranking:")
        lines += ["  " + row for row in table(
            ("DC", "RESOURCE", "NETWORK", "TOTAL", "LATENCY_MS", "PATH"),
            [[c.datacenter, f"{c.resource_cost.total:.4f}", f"{c.network_cost:.4f}", f"{c.total_cost:.4f}",
              f"{c.path.latency_ms:.2f}", " -> ".join(c.path.vertices)] for c in ex.ranking]).splitlines()]
    if ex.excluded:
        lines.append("Excluded:")
        lines += [f"  {e.datacenter}: {e.reason}" for e in ex.excluded]
    if ex.notes:
        lines.append("Notes:")
        lines += [f"  {n}" for n in ex.notes]
    lines.append("Events:" + ("  (the first and the last read; others not shown)" if d.events_truncated else ""))
    lines += ["  " + row for row in table(("TIME", "KIND", "STATE", "DC", "DETAIL"),
                                          [[_when(e.unix_ms), e.kind, state_name(e.state), e.datacenter or "-",
                                            e.detail] for e in d.events]).splitlines()]
    return "\n".join(lines)
