"""GPU-aware DC choice (hsched.costs.stranding): the stranding term by hand, the placers' reserve, and a mixed
replay in which CPU-only tasks strand idle GPUs with it off and never with it on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hsched.costs import WanGraph, rank_datacenters
from hsched.costs.stranding import (
    OFF,
    GpuHostFree,
    GpuReservePolicy,
    StrandingConfig,
    free_of,
    parse_reserve,
    reserve_mask,
    stranded_gpus,
    stranding_cost,
)
from hsched.domain.cluster import ClusterState
from hsched.domain.errors import ValidationError
from hsched.domain.fleet import load_fleet
from hsched.domain.resources import Resources
from hsched.domain.task import TaskSpec
from hsched.engine.selector import DcSelector
from hsched.eval.stranding import replay
from hsched.policies.heuristics import make_policy
from hsched.policies.placement import Outcome, plan

FLEET = Path(__file__).parent / "fleets" / "gpu_cheap.yaml"
GIB = 1024


def cpu_task(cores: int = 8, gib: int = 16, name: str = "cpu") -> TaskSpec:
    return TaskSpec(resources=Resources(cpu_milli=cores * 1000, memory_mib=gib * GIB), runtime_s=3600.0, name=name)


def gpu_task(cores: int = 4, gib: int = 8, name: str = "gpu") -> TaskSpec:
    return TaskSpec(resources=Resources(cpu_milli=cores * 1000, memory_mib=gib * GIB, gpu_count=1,
                                        gpu_core_percent=100, gpu_memory_mib=8 * GIB), runtime_s=3600.0, name=name)


def test_the_term_by_hand_on_the_empty_gpu_dc() -> None:
    gpu = load_fleet(FLEET).datacenter("gpu")
    free = free_of(ClusterState(gpu))
    # 2 hosts × 16 cores, 64 GiB, 2 T4: per GPU 8 cores and 32 GiB; 4 idle GPUs keep all of it at share 1
    assert free == GpuHostFree(32_000, 128 * GIB, 4.0, 32_000.0, 128.0 * GIB, 8_000.0, 32.0 * GIB, 0, 0)
    # 8 cores come out of the reserve: 8 / 8 = 1 GPU; 16 GiB: 16 / 32 = 0.5 GPU; the larger counts
    assert stranded_gpus(cpu_task().total, free, StrandingConfig()) == pytest.approx(1.0)
    # priced at 1.0 per GPU-hour for 1 h, weight 2
    assert stranding_cost(cpu_task().total, free, 1.0, 3600.0, StrandingConfig(weight=2.0)) == pytest.approx(2.0)
    # half the slice reserved: 8 cores fit in the 16 spare cores, 16 GiB in the 64 spare GiB
    assert stranded_gpus(cpu_task().total, free, StrandingConfig(share=0.5)) == 0.0
    # a GPU task and a switched-off config cost nothing
    assert stranded_gpus(gpu_task().total, free, StrandingConfig()) == 0.0
    assert stranded_gpus(cpu_task().total, free, OFF) == 0.0
    # never more than the idle GPUs
    assert stranded_gpus(cpu_task(cores=64, gib=512).total, free, StrandingConfig()) == pytest.approx(4.0)


def test_a_cordoned_hosts_room_is_not_in_the_free_split() -> None:
    state = ClusterState(load_fleet(FLEET).datacenter("gpu"))
    state.cordon(0, reason="maintenance")
    # one of the 2 hosts left: 16 cores, 64 GiB, 2 idle T4 (its slices 16 cores and 64 GiB); the per-GPU ratios
    # stay the fleet's (8 cores, 32 GiB per GPU)
    assert free_of(state) == GpuHostFree(16_000, 64 * GIB, 2.0, 16_000.0, 64.0 * GIB, 8_000.0, 32.0 * GIB, 0, 0)
    # an 8-core task still strands 1 GPU; a 24-core one would strand 3 but only the open host's 2 idle GPUs count
    assert stranded_gpus(cpu_task().total, free_of(state), StrandingConfig()) == pytest.approx(1.0)
    assert stranded_gpus(cpu_task(cores=24).total, free_of(state), StrandingConfig()) == pytest.approx(2.0)
    state.uncordon(0)
    assert free_of(state) == free_of(ClusterState(load_fleet(FLEET).datacenter("gpu")))


def test_min_cost_moves_cpu_work_off_the_gpu_dc_only_with_the_term() -> None:
    fleet = load_fleet(FLEET)
    graph = WanGraph(fleet.wan)
    free = {"gpu": free_of(ClusterState(fleet.datacenter("gpu")))}
    plain, _ = rank_datacenters(cpu_task(), fleet.datacenters, graph, 0.0, "s")
    aware, _ = rank_datacenters(cpu_task(), fleet.datacenters, graph, 0.0, "s", gpu_hosts=free,
                                stranding=StrandingConfig())
    assert plain[0].datacenter == "gpu" and plain[0].stranding == 0.0  # 8 × 0.02 + 16 × 0.003 = 0.208 < 0.304
    assert aware[0].datacenter == "cpu"
    by = {c.datacenter: c for c in aware}
    assert by["gpu"].stranding == pytest.approx(1.0)
    assert by["gpu"].total == pytest.approx(by["gpu"].resource.total + by["gpu"].network_cost + 1.0)


def test_the_selector_reads_the_split_from_summaries() -> None:
    fleet = load_fleet(FLEET)
    sel = DcSelector(fleet)
    busy = ClusterState(fleet.datacenter("gpu"))
    for node in range(2):  # both hosts' GPUs taken: no GPU left to strand, CPU-only work may come
        busy.gpu_free_core[node, :] = 0
    for name in ("cpu", "gpu"):
        sel.update_summary({"datacenter": name, "fencing_token": 1,
                            **({"gpu_hosts": free_of(busy).as_dict()} if name == "gpu" else {})})
    ranked, _, _ = sel.select(cpu_task())
    assert ranked[0].datacenter == "gpu" and ranked[0].stranding == 0.0
    sel.update_summary({"datacenter": "gpu", "fencing_token": 1,
                        "gpu_hosts": free_of(ClusterState(fleet.datacenter("gpu"))).as_dict()})
    assert sel.select(cpu_task())[0][0].datacenter == "cpu"
    sel.stranding = OFF
    assert sel.select(cpu_task())[0][0].datacenter == "gpu"


def test_the_placer_keeps_the_reserve_from_cpu_only_parts() -> None:
    gpu = load_fleet(FLEET).datacenter("gpu")
    state = ClusterState(gpu)
    policy = GpuReservePolicy(make_policy("bestfit"), StrandingConfig())
    assert plan(state, cpu_task(), policy).outcome is Outcome.NO_ROOM  # all 32 cores are the 4 GPUs' slices
    assert plan(state, cpu_task(), make_policy("bestfit")).outcome is Outcome.PLACED
    placed = plan(state, gpu_task(), policy)
    assert placed.outcome is Outcome.PLACED
    state.apply("g", placed.parts)
    # one card taken on that host: 4 cores (16 - 4 - 8 reserved for the other card) are free for CPU-only work
    host = placed.parts[0].node
    mask = reserve_mask(state, cpu_task(cores=4, gib=8).resources, StrandingConfig())
    assert mask.tolist() == [i == host for i in range(2)]
    assert plan(state, cpu_task(cores=4, gib=8), policy).parts[0].node == host


def test_a_jobs_stage_takes_the_reserve_only_when_nothing_else_fits() -> None:
    """A DAG job's stages are pinned to its DC: a CPU stage after its GPU parents must not wait for ever on GPU
    hosts whose idle cards keep all their CPU. A plain task waits and is told why."""
    from dataclasses import replace

    from hsched.policies.placement import RESERVE_NOTE

    state = ClusterState(load_fleet(FLEET).datacenter("gpu"))
    policy = GpuReservePolicy(make_policy("bestfit"), StrandingConfig())
    held = plan(state, cpu_task(), policy)
    assert held.outcome is Outcome.NO_ROOM and "--gpu-reserve" in held.reason
    stage = replace(cpu_task(), job_id="j1", stage="b")
    placed = plan(state, stage, policy)
    assert placed.outcome is Outcome.PLACED and RESERVE_NOTE in placed.notes
    # where the reserve leaves room, the stage is placed within it, as any task (no note)
    taken = plan(state, gpu_task(), policy)
    state.apply("g", taken.parts)
    within = plan(state, replace(cpu_task(cores=4, gib=8), job_id="j1", stage="b"), policy)
    assert within.parts[0].node == taken.parts[0].node and RESERVE_NOTE not in within.notes
    # no room even without the reserve: the usual reason
    full = plan(state, replace(cpu_task(cores=64), job_id="j1", stage="b"), policy)
    assert full.outcome is not Outcome.PLACED and "--gpu-reserve" not in full.reason


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 40), st.integers(0, 200), st.floats(0.0, 1.0), st.integers(0, 4))
def test_stranded_gpus_is_bounded_and_monotone(cores: int, gib: int, share: float, taken: int) -> None:
    gpu = load_fleet(FLEET).datacenter("gpu")
    state = ClusterState(gpu)
    state.gpu_free_core.reshape(-1)[:taken] = 0
    free, cfg = free_of(state), StrandingConfig(share=share)
    s = stranded_gpus(cpu_task(cores, gib).total, free, cfg)
    assert 0.0 <= s <= free.gpus
    assert stranded_gpus(cpu_task(cores + 1, gib + 1).total, free, cfg) >= s


def test_parse_reserve() -> None:
    assert parse_reserve("0") == StrandingConfig(weight=0.0, share=0.0)
    assert parse_reserve("0.5", 2.0) == StrandingConfig(weight=2.0, share=0.5)
    with pytest.raises(ValidationError, match="--gpu-reserve"):
        parse_reserve("8,16")
    with pytest.raises(ValidationError, match="0..1"):
        parse_reserve("1.5")


def test_mixed_replay_strands_gpus_only_with_the_choice_off() -> None:
    fleet = load_fleet(FLEET)
    # CPU-only tasks first (held), then 1-GPU tasks: off, the CPU work fills the cheap GPU hosts
    jobs = [(float(i), cpu_task(name=f"c{i}")) for i in range(4)]
    jobs += [(10.0 + i, gpu_task(name=f"g{i}")) for i in range(4)]
    off = replay(fleet, jobs, OFF, hold=True)
    on = replay(fleet, jobs, StrandingConfig(), hold=True)
    assert (off.cpu_in_gpu_dcs, off.gpu_placed, off.gpu_stranded) == (4, 0, 4)
    assert (on.cpu_in_gpu_dcs, on.gpu_placed, on.gpu_stranded) == (0, 4, 0)
    assert on.cpu_placed == off.cpu_placed == 4
    assert np.isclose(on.peak_gpu_use, 1.0)


def test_the_stack_keeps_gpu_hosts_for_gpu_tasks(redis_url: str) -> None:
    """Through the real stack (gateway, selector, placers as processes) on a fleet where CPU is cheapest in the
    GPU cluster: CPU-only Submits go to the CPU room, and then every 1-GPU Submit is placed (with the choice
    off, tests above: the CPU work fills the GPU hosts and the GPU Submits wait)."""
    import uuid

    import grpc

    from hsched.stack import Stack, StackConfig
    from hsched.v1 import common_pb2 as pb
    from hsched.v1 import gateway_pb2, gateway_pb2_grpc
    from tests.conftest import delete_prefix

    def spec(cores: int, gib: int, gpus: int = 0) -> pb.TaskSpec:
        return pb.TaskSpec(resources=pb.Resources(cpu_milli=cores * 1000, memory_mib=gib * GIB, gpu_count=gpus,
                                                  gpu_core_percent=100 if gpus else 0,
                                                  gpu_memory_mib=8 * GIB if gpus else 0), runtime_s=0)

    prefix = f"test-strand-{uuid.uuid4().hex[:10]}"
    try:
        with Stack(StackConfig(fleet_path=FLEET, redis_url=redis_url, prefix=prefix, gateway_port=0)) as stack, \
                grpc.insecure_channel(stack.gateway) as ch:
            gw = gateway_pb2_grpc.GatewayStub(ch)
            cpu = [gw.Submit(gateway_pb2.SubmitRequest(task=spec(8, 16)), timeout=20).task for _ in range(4)]
            assert [t.datacenter for t in cpu] == ["cpu"] * 4 and all(t.state == pb.TASK_STATE_PLACED for t in cpu)
            ranking = {c.datacenter: c for c in cpu[0].explanation.ranking}
            gpu_dc = ranking["gpu"]  # 8 of the GPU hosts' 32 reserved cores: 1 GPU stranded, 1.0 for 1 h
            assert gpu_dc.total_cost == pytest.approx(gpu_dc.resource_cost.total + gpu_dc.network_cost + 1.0)
            assert gpu_dc.resource_cost.total < ranking["cpu"].resource_cost.total  # eq.1 alone prefers it
            gpus = [gw.Submit(gateway_pb2.SubmitRequest(task=spec(4, 8, gpus=1)), timeout=20).task for _ in range(4)]
            assert [(t.state, t.datacenter) for t in gpus] == [(pb.TASK_STATE_PLACED, "gpu")] * 4
    finally:
        delete_prefix(redis_url, prefix)
