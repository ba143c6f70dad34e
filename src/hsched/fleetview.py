"""The gateway's fleet views (ListDatacenters, GetDatacenter, DescribeTask): each placer's live state
(Placer.GetState), each DC's lease as Redis holds it, and a task's events on the task stream.

A placer that does not answer is a view of its own (status standby / fenced / unreachable with the reason),
never an error: an operator looks at the fleet exactly when part of it is down.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import grpc

from hsched.convert import resources_to_pb
from hsched.domain.fleet import DataCenter
from hsched.state.keys import Keys
from hsched.state.tasks import event_of
from hsched.v1 import common_pb2 as pb
from hsched.v1 import gateway_pb2, placer_pb2, placer_pb2_grpc

STATUS_METADATA = "hsched-placer-status"  # the placer's trailing metadata on GetState's UNAVAILABLE
HISTORY_SCAN = 20_000  # task-stream entries DescribeTask reads after a task's creation, at most
HISTORY_EVENTS = 1_000  # events of one task it returns, at most
# entries read past the window for a final event written late, at most: the gateway stamps a catch-up step (a
# completion it learns from a ledger after a placer outage) with the ledger's time, and writes it later
HISTORY_LAG_SCAN = 10_000


def kind_of(dc: DataCenter) -> str:
    return "gpu" if any(p.gpu_count for p in dc.pools) else "cpu"


def gpu_models(nodes: Iterable[placer_pb2.NodeState]) -> list[gateway_pb2.GpuModelCapacity]:
    """Per card model: cards, idle cards, free core % and memory summed over the cards (sorted by model)."""
    out: dict[str, gateway_pb2.GpuModelCapacity] = {}
    for node in nodes:
        for card in node.gpus:
            m = out.setdefault(card.model, gateway_pb2.GpuModelCapacity(model=card.model))
            m.cards += 1
            m.cards_idle += card.core_percent_free == 100 and card.memory_mib_free == card.memory_mib_capacity
            m.core_percent_free += card.core_percent_free
            m.memory_mib_free += card.memory_mib_free
            m.memory_mib_capacity += card.memory_mib_capacity
    return [out[k] for k in sorted(out)]


async def lease_of(redis, keys: Keys, dc: str) -> gateway_pb2.PlacerLease:
    async with redis.pipeline(transaction=False) as pipe:
        holder, ttl, fence = await pipe.get(keys.lease(dc)).pttl(keys.lease(dc)).get(keys.fence(dc)).execute()
    if isinstance(holder, bytes):
        holder = holder.decode()
    return gateway_pb2.PlacerLease(holder=holder or "", ttl_ms=max(int(ttl), 0), fencing_token=int(fence or 0))


def _status(exc: grpc.aio.AioRpcError) -> str:
    for key, value in exc.trailing_metadata() or ():
        if key == STATUS_METADATA:
            return value
    return "unreachable"


async def datacenter_view(dc: DataCenter, stub: placer_pb2_grpc.PlacerStub | None, redis, keys: Keys,
                          timeout_s: float, include_nodes: bool = False, gpu_model: str = "",
                          include_tenants: bool = False) -> gateway_pb2.DatacenterView:
    """One DC's view, asking its placer with `timeout_s`; with `include_nodes`, its nodes (those with a card of
    `gpu_model`, if given); with `include_tenants`, its tenants' fair shares."""
    view = gateway_pb2.DatacenterView(datacenter=dc.name, vertex=dc.vertex, kind=kind_of(dc))
    lease = asyncio.ensure_future(lease_of(redis, keys, dc.name))
    try:
        if stub is None:
            view.status, view.reason = "unreachable", "the gateway has no address for this placer (--placers)"
        else:
            try:
                # the nodes of a GPU DC give its per-model totals; a CPU room's are sent only when asked for
                nodes = include_nodes or view.kind == "gpu"
                state = await stub.GetState(placer_pb2.PlacerStateRequest(
                    include_nodes=nodes, include_tenants=include_tenants), timeout=timeout_s)
            except grpc.aio.AioRpcError as exc:
                view.status, view.reason = _status(exc), f"{exc.code().name}: {exc.details()}"
            else:
                view.status, view.policy = "serving", state.policy
                view.summary.CopyFrom(state.summary)
                view.thermal.CopyFrom(state.thermal)
                view.tenants.extend(state.tenants)
                shown = [n for n in state.nodes if not gpu_model or any(c.model == gpu_model for c in n.gpus)]
                view.gpus.extend(gpu_models(shown))  # the totals of the nodes asked for
                if include_nodes:
                    view.nodes.extend(shown)
    finally:
        view.lease.CopyFrom(await lease)
    if view.status == "serving" and view.summary.fencing_token != view.lease.fencing_token:
        # a placer that has not yet learnt it lost the lease (it stalled, another took over) still answers
        view.status = "fenced"
        view.reason = (f"it serves with fencing token {view.summary.fencing_token}, the DC's lease is at "
                       f"{view.lease.fencing_token} (held by {view.lease.holder or 'nobody'})")
    if view.status != "serving":  # what the fleet file says it has; nothing about what is free
        view.summary.datacenter, view.summary.nodes = dc.name, dc.node_count
        view.summary.capacity.CopyFrom(resources_to_pb(dc.capacity_total()))
        view.summary.gpu_models.extend(sorted({p.gpu_model for p in dc.pools if p.gpu_count}))
    return view


async def task_history(redis, stream: str, task: pb.Task) -> tuple[list[pb.TaskEvent], bool]:
    """The task's events, oldest first, read between its creation and its last update (task ids and stream ids
    are both ms-ordered; 1 s of margin for the clock): half of HISTORY_SCAN entries forward from the creation,
    then, if the window holds more, half backward from the last update, so a task among many others (a large
    job's) shows its first and its last events; at most HISTORY_EVENTS events. A final event written more than the
    margin after its time (a catch-up step) is looked for past the window, at most HISTORY_LAG_SCAN entries.
    Returns (events, truncated)."""
    needle = task.task_id.encode()
    budget = HISTORY_SCAN // 2
    lo = f"{max(task.created_unix_ms - 1000, 0)}-0"
    hi = f"{task.updated_unix_ms + 1000}" if task.updated_unix_ms else "+"
    final = False  # whether the entry of the record `task` is (its last one) was read

    def mine(page, into: list[pb.TaskEvent]) -> None:
        nonlocal final
        for entry_id, fields in page:
            if needle not in fields.get(b"t", b""):  # cheap: most entries are other tasks', left unparsed
                continue
            event = event_of(entry_id.decode() if isinstance(entry_id, bytes) else entry_id, fields)
            if event.task_id == task.task_id:
                final = final or pb.Task.FromString(fields[b"t"]) == task
                if len(into) < HISTORY_EVENTS:
                    into.append(event)

    def entry(page) -> tuple[int, int]:
        ms, _, seq = (page[-1][0].decode() if isinstance(page[-1][0], bytes) else page[-1][0]).partition("-")
        return int(ms), int(seq)

    async def window() -> tuple[list[pb.TaskEvent], bool]:
        first: list[pb.TaskEvent] = []
        scanned, start = 0, lo
        while scanned < budget:
            page = await redis.xrange(stream, min=start, max=hi, count=min(1000, budget - scanned))
            if not page:
                return first, False
            scanned += len(page)
            mine(page, first)
            if len(first) == HISTORY_EVENTS:
                return first, True
            ms, seq = entry(page)
            start = f"{ms}-{seq + 1}"
        # more than the budget after the creation: the newest part of the window, back to where the forward scan
        # ended
        newest: list[pb.TaskEvent] = []
        scanned, end = 0, hi
        while scanned < budget:
            page = await redis.xrevrange(stream, max=end, min=start, count=min(1000, budget - scanned))
            if not page:
                return first + newest[::-1], False
            scanned += len(page)
            mine(page, newest)
            if len(first) + len(newest) >= HISTORY_EVENTS:
                break
            ms, seq = entry(page)
            if seq == 0 and ms == 0:
                break
            end = f"{ms}-{seq - 1}" if seq else f"{ms - 1}-18446744073709551615"
        return (first + newest[::-1])[:HISTORY_EVENTS], True

    events, truncated = await window()
    if final or hi == "+":
        return events, truncated
    # the final event's entry is later than the window (written late): read on until it, within a budget
    late: list[pb.TaskEvent] = []
    scanned, start = 0, f"{task.updated_unix_ms + 1001}-0"
    while not final:
        if scanned >= HISTORY_LAG_SCAN:
            truncated = True  # it may be further on: say so rather than pass the history off as whole
            break
        page = await redis.xrange(stream, min=start, max="+", count=min(1000, HISTORY_LAG_SCAN - scanned))
        if not page:
            break  # the stream's end: there is nothing more of the task to show
        scanned += len(page)
        mine(page, late)
        ms, seq = entry(page)
        start = f"{ms}-{seq + 1}"
    if len(events) + len(late) > HISTORY_EVENTS:  # the last events stay (the final one above all)
        events, truncated = events[:max(HISTORY_EVENTS - len(late), 0)], True
    return events + late[-HISTORY_EVENTS:], truncated
