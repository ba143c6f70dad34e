"""The chaos bench (bench/chaos.py) on a tiny stack: one fault phase (a placer SIGKILLed under load) yields a
computed row, and the audit catches what it exists to catch — written into the ledgers by hand: an allocation
over a node's capacity, a task live in two data centers, a placement on a cordoned node, an acknowledged task
freed from its ledger, and an acknowledged task the gateway does not know. Real processes, a real redis-server, real gRPC."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` is not an installed package

from bench import chaos
from hsched.domain.cluster import ClusterState, Part
from hsched.state.keys import Keys
from hsched.state.redis import connect_sync
from hsched.v1 import common_pb2 as pb


@pytest.fixture(scope="module")
def bench_stack():
    opts = chaos.parse_args(["--quick", "--faults", "kill-placer", "--rate", "10", "--pre-s", "2", "--post-s", "6",
                             "--keepers", "8", "--settle-s", "1"])
    stack = chaos.make_stack(opts)
    stack.start()
    try:
        yield stack, opts
    finally:
        stack.stop()


def append(stack, dc: str, event: dict) -> None:
    """Write a ledger event behind the placer's back (no fencing): the corruption the audit must find."""
    r = connect_sync(stack.redis_url)
    try:
        r.xadd(Keys(stack.config.prefix).ledger(dc), {"e": json.dumps(event)})
    finally:
        r.close()


async def _phase_then_corrupt(stack, opts):
    async with chaos.Client(stack.gateway, chaos.workload(stack, opts), opts) as client:
        auditor = chaos.Auditor()
        phase = await chaos.run_phase(stack, client, auditor, "kill-placer", opts)
        clean = await chaos.audit(stack, client.records)
        kept = [r for r in client.records if r.keeper and r.state == pb.TASK_STATE_PLACED]
        assert len(kept) >= 3, "too few kept placed tasks to corrupt"
        over, twice, freed = kept[:3]
        dcs = {dc.name: dc for dc in stack.fleet.datacenters}
        # 1. an allocation filling the whole node that `over` already uses: over capacity there
        node = over.assignments[0].node_index
        table = ClusterState(dcs[over.datacenter]).table
        part = Part(0, 0, node, int(table.cpu_milli[node]), int(table.memory_mib[node]), 0, 0)
        append(stack, over.datacenter, {"t": "alloc", "task": "t-bogus-over", "parts": [part.to_json()]})
        # 2. `twice` also live in another DC's ledger
        other = next(name for name in dcs if name != twice.datacenter)
        append(stack, other, {"t": "alloc", "task": twice.task_id, "parts": [Part(0, 0, 0, 1, 1, 0, 0).to_json()]})
        # 3. `freed` gone from its ledger although the client never released it
        append(stack, freed.datacenter, {"t": "free", "task": freed.task_id})
        # 4. a placement on a node an operator had cordoned (a tiny one: over no capacity)
        fenced_off = (node + 1) % len(table)
        append(stack, over.datacenter, {"t": "cordon", "task": "", "node": table.names[fenced_off], "on": True})
        append(stack, over.datacenter, {"t": "alloc", "task": "t-bogus-cordoned",
                                        "parts": [Part(0, 0, fenced_off, 1, 1, 0, 0).to_json()]})
        # 5. an acknowledgement the gateway has no record of
        ghost = chaos.Record("ghost", "test", 0.0, task_id="t000000000000deadbeef", state=pb.TASK_STATE_PLACED,
                             datacenter=over.datacenter)
        broken = await chaos.audit(stack, [*client.records, ghost])
    return phase, clean, broken, (over, twice, freed, ghost, table.names[node]), client.records


def test_one_fault_phase_is_audited_and_injected_losses_and_double_allocations_are_found(bench_stack):
    stack, opts = bench_stack
    phase, clean, broken, (over, twice, freed, ghost, node_name), records = asyncio.run(
        _phase_then_corrupt(stack, opts))

    # the row is computed from what happened
    assert phase.injected is not None and phase.injected.target.startswith("placer-")
    assert phase.injected.recovered_by != "failed", phase.injected.notes
    acked = [r for r in records if r.task_id]
    assert phase.acknowledged >= len(acked) > 0
    assert phase.submits_after > 0 and phase.first_ok_s is not None and phase.first_ok_s >= 0
    assert clean.checked == len(acked) and clean.unreachable == 0

    # every corruption is found, each for its reason; nothing found before is forgotten
    assert set(clean.lost) <= set(broken.lost)
    assert broken.lost[freed.task_id].startswith("ledger:"), broken.lost[freed.task_id]
    assert "NOT_FOUND" in broken.lost[ghost.task_id]
    assert over.task_id not in broken.lost and twice.task_id not in broken.lost
    assert f"two DCs: {twice.task_id}" in broken.double
    assert any(k.startswith(f"{over.datacenter}/{node_name}: cpu_milli") for k in broken.double), broken.double
    assert any("t-bogus-over" in k and "refused by the fold" in k for k in broken.double), broken.double
    assert any("places t-bogus-cordoned on cordoned node(s)" in k for k in broken.double), broken.double
    new_double = set(broken.double) - set(clean.double)
    assert len(new_double) >= 4


def test_bad_flags_name_the_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        chaos.parse_args(["--faults", "kill-gateway,unplug-the-fridge"])
    assert exc.value.code == 2
    assert "--faults: unplug-the-fridge not among" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        chaos.parse_args(["--rate", "0"])
    assert "--rate: must be > 0" in capsys.readouterr().err


def test_report_prints_a_row_per_fault_and_fails_on_any_loss(bench_stack, capsys):
    stack, opts = bench_stack
    phase = chaos.Phase("kill-placer", chaos.Injected(0.0, "placer-gpu", "bench: Stack.restart (3.5 s)"),
                        acknowledged=7, first_ok_s=0.4, submits_after=5)
    skipped = chaos.Phase("kill-redis-master", skipped="needs --redis-replicas 1")
    final = chaos.Phase("final: kept tasks released")
    auditor = chaos.Auditor()
    assert chaos.report([phase, skipped], final, [], auditor, opts, stack) == 0
    out = capsys.readouterr().out
    assert "| kill-placer | placer-gpu | bench: Stack.restart (3.5 s) | 7 | 0 | 0 | 0.40 | 0 of 5 |" in out
    assert "| kill-redis-master | - |" in out and "skipped: needs --redis-replicas 1" in out
    assert "PASS" in out
    phase.double["gpu/n0: cpu_milli 2 > capacity 1"] = auditor.double["gpu/n0: cpu_milli 2 > capacity 1"] = "x"
    assert chaos.report([phase], final, [], auditor, opts, stack) == 1
    assert "| kill-placer | placer-gpu | bench: Stack.restart (3.5 s) | 7 | 0 | 1 |" in capsys.readouterr().out


async def test_the_audit_counts_a_finished_or_preempted_task_as_freed_by_its_ledger(redis, prefix):
    """Tasks run to an end now: a `done` or `preempt` event frees like `free`. Folded as still live, a finished
    task was reported as leaked after its Release and its resources as a double allocation."""
    from hsched.domain.fleet import load_fleet
    from tests.conftest import SMALL_FLEET

    dc = load_fleet(SMALL_FLEET).datacenters[0]
    stream = Keys(prefix).ledger(dc.name)
    whole = Part(0, 0, 0, int(ClusterState(dc).table.cpu_milli[0]), 1, 0, 0).to_json()  # the whole node's CPU
    for event in ({"t": "alloc", "task": "a", "parts": [whole]}, {"t": "done", "task": "a", "ok": True},
                  {"t": "alloc", "task": "b", "parts": [whole]}, {"t": "preempt", "task": "b", "by": "c"},
                  {"t": "alloc", "task": "c", "parts": [whole]}):
        await redis.xadd(stream, {"e": json.dumps(event)})
    view = await chaos.fold_ledger(redis, stream, dc)
    assert list(view.live) == ["c"] and view.finished == {"a"} and view.refused == []
    assert chaos.over_capacity(dc, view.state.table, view.live) == []


def test_a_release_acknowledged_after_the_task_finished_allows_that_final_state_only():
    rec = chaos.Record("r", "p", 0.0, task_id="t", state=pb.TASK_STATE_PLACED, release_attempted=True,
                       release_acked=True, release_state=pb.TASK_STATE_SUCCEEDED)
    assert chaos.allowed_states(rec) == {pb.TASK_STATE_SUCCEEDED}
    rec.release_state = pb.TASK_STATE_RELEASED
    assert chaos.allowed_states(rec) == {pb.TASK_STATE_RELEASED}
