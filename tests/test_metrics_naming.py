"""Every service of a real stack (small fleet; the GPU room asked for the learned `ddpg` policy with no model, so
it serves its heuristic fallback) scraped over HTTP: every hsched_* family follows the naming rules
(hsched.telemetry.naming) with label cardinality bounded by the fleet, is listed in docs/metrics.md, and the
new families say what happened: deferred queue length and age, policy served and its fallbacks, rejected
tasks under datacenter="none"."""

from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hsched.domain.fleet import load_fleet
from hsched.policies.heuristics import POLICY_NAMES
from hsched.rl.path_serving import PATH_FINDERS
from hsched.telemetry import metrics as m
from hsched.telemetry.naming import naming_problems
from hsched.v1 import common_pb2 as pb
from hsched.v1 import gateway_pb2, gateway_pb2_grpc, placer_pb2, selector_pb2, thermal_pb2
from tests.conftest import SMALL_FLEET, small_fleet_stack

pytestmark = pytest.mark.slow

DOCS = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def label_bounds(fleet, services: int) -> dict[str, int]:
    """The most distinct values each label may take on one scrape of a stack of `fleet` (docs/metrics.md)."""
    dcs = len(fleet.datacenters)
    rpcs = sum(len(s.methods) for mod in (gateway_pb2, placer_pb2, selector_pb2, thermal_pb2)
               for s in mod.DESCRIPTOR.services_by_name.values())
    return {
        "datacenter": dcs + 1,  # + "none"
        "model": len({p.gpu_model for dc in fleet.datacenters for p in dc.pools if p.gpu_model}),
        "entry_vertex": len(fleet.wan.entry_vertices),
        "state": len(pb.TaskState.keys()) + len(pb.JobState.keys()),
        "method": rpcs + 3,  # + health Check/Watch, reflection
        "code": len(grpc.StatusCode),
        "le": len(m.RPC_DURATION_BUCKETS) + 1,
        "peer": dcs + 1,  # + the selector
        "service": services + 1,  # + redis
        "tenant": 2,  # this test watches every tenant ("*") only
        "policy": len(POLICY_NAMES),
        "requested": len(POLICY_NAMES) + len(PATH_FINDERS),
        "finder": len(PATH_FINDERS),
        "outcome": 2,
        "reason": len(m.FALLBACK_REASONS),
        "result": 5,  # thermal refits: published, ill_conditioned, not_better, too_few_scans, conflict
    }


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def value(text: str, name: str, **labels: str) -> float | None:
    return samples(text).get((name, tuple(sorted(labels.items()))))


def submit(gw, cores: float, gpus: int = 0) -> pb.Task:
    spec = pb.TaskSpec(resources=pb.Resources(cpu_milli=int(cores * 1000), memory_mib=8192, gpu_count=gpus,
                                              gpu_core_percent=30 if gpus else 0, gpu_memory_mib=1024 * gpus),
                       runtime_s=3600)
    return gw.Submit(gateway_pb2.SubmitRequest(task=spec), timeout=30).task


@pytest.fixture(scope="module")
def loaded(redis_url, tmp_path_factory):
    """The stack after: a GPU task, every DC filled with whole-node tasks, one more deferred, one rejected,
    and a Watch of every tenant open; yields (stack, {service: scrape}, facts)."""
    no_models = tmp_path_factory.mktemp("no-models")
    with small_fleet_stack(redis_url, "metrics-naming", gpu_policy="ddpg", supervise=True,
                           extra_env={"HSCHED_MODELS_DIR": str(no_models)}) as stack, \
            grpc.insecure_channel(stack.gateway) as ch:
        gw = gateway_pb2_grpc.GatewayStub(ch)
        placed = [submit(gw, 2, gpus=1)]
        while (t := submit(gw, 24)).state == pb.TASK_STATE_PLACED:
            placed.append(t)
        assert t.state == pb.TASK_STATE_DEFERRED, t
        deferred_at = time.time()
        rejected = submit(gw, 10_000)
        assert rejected.state == pb.TASK_STATE_REJECTED and rejected.datacenter == ""
        watch = gw.Watch(gateway_pb2.WatchRequest(), timeout=60)
        try:
            time.sleep(1.0)  # the deferred task ages; the Watch registers
            scrapes = {name: scrape(svc.metrics_port) for name, svc in stack.services.items() if svc.metrics_port}
            scrapes["supervisor"] = scrape(stack.supervisor_metrics.port)
            facts = {"deferred_dc": t.datacenter, "waited_s": time.time() - deferred_at,
                     "gpu_placed": sum(p.datacenter == "gpu" for p in placed)}
        finally:
            watch.cancel()
        yield stack, scrapes, facts


def test_every_hsched_family_of_every_service_follows_the_naming_rules(loaded):
    stack, scrapes, _ = loaded
    bounds = label_bounds(load_fleet(SMALL_FLEET), len(stack.services))
    assert {"gateway", "selector", "thermal", "placer-gpu", "supervisor"} <= set(scrapes)
    problems = [f"{name}: {p}" for name, text in scrapes.items() for p in naming_problems(text, bounds)]
    assert problems == []
    # the default exposition has no per-card series
    for name, text in scrapes.items():
        assert not re.search(r'\b(card|node|deviceidx|task_id)="', text), name


def test_every_exposed_family_is_documented(loaded):
    _, scrapes, _ = loaded
    documented = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", DOCS.read_text()))
    exposed = {f.name + ("_total" if f.type == "counter" else "")
               for text in scrapes.values() for f in text_string_to_metric_families(text)
               if f.name.startswith("hsched_") or f.name in m.PAPER_002_ALIASES}
    assert exposed - documented == set()


def test_the_new_families_say_what_happened(loaded):
    _, scrapes, facts = loaded
    gpu, gateway = scrapes["placer-gpu"], scrapes["gateway"]
    deferred = scrapes[f"placer-{facts['deferred_dc']}"]
    dc = {"datacenter": facts["deferred_dc"]}
    assert value(deferred, "hsched_deferred_tasks", **dc) == 1.0
    assert 0 < value(deferred, "hsched_deferred_oldest_age_seconds", **dc) <= facts["waited_s"] + 0.01
    # the GPU room serves bestfit in ddpg's place: said by the info gauge, counted per decision
    assert value(gpu, "hsched_placer_policy_info", datacenter="gpu", policy="bestfit", requested="ddpg") == 1.0
    fallbacks = value(gpu, "hsched_placer_policy_fallbacks_total", datacenter="gpu", policy="ddpg",
                      reason="model_missing")
    assert fallbacks >= facts["gpu_placed"] >= 1
    assert value(scrapes["placer-cheap"], "hsched_placer_policy_info", datacenter="cheap", policy="bestfit",
                 requested="bestfit") == 1.0
    assert "hsched_placer_policy_fallbacks" not in scrapes["placer-cheap"]
    assert value(gpu, "hsched_placer_lease_held", datacenter="gpu") == 1.0
    # the room model the placer's guard checks with (none published here: the default), the redline to alert on
    assert value(gpu, "hsched_placer_thermal_model_version", datacenter="gpu") == 0.0
    assert value(scrapes["thermal"], "hsched_dc_redline_celsius", datacenter="gpu") == 27.0  # tests/fleets/small.yaml
    assert value(gpu, "hsched_placer_fencing_token", datacenter="gpu") >= 1
    # per GPU model: 4 nodes x 2 T4 of 16 GiB, one 30 % / 1 GiB slice on them
    model = {"datacenter": "gpu", "model": "T4"}
    assert value(gpu, "hsched_gpu_cards", **model) == 8.0
    assert value(gpu, "hsched_gpu_memory_capacity_bytes", **model) == 8 * 16 * 2**30
    assert value(gpu, "hsched_gpu_memory_allocated_bytes", **model) == 2**30
    assert value(gpu, "hsched_gpu_slices", **model) == 1.0
    assert value(gpu, "hsched_gpu_core_allocated_ratio", **model) == pytest.approx(0.30 / 8)
    assert value(gpu, "ClusterGPUCorePercentage", datacenter="gpu") == pytest.approx(100 * 0.30 / 8)
    # the rejected task: datacenter="none", never ""
    assert value(gateway, "hsched_tasks", state="rejected", datacenter=m.NO_DATACENTER) == 1.0
    # a state no task is in reads 0 rather than vanishing (an alert on it would see "no data")
    assert value(gateway, "hsched_tasks", state="failed", datacenter="near") == 0.0
    assert value(gateway, "hsched_jobs", state="cancelled", datacenter="gpu") == 0.0
    assert value(gateway, "hsched_gateway_watches", tenant=m.ALL_TENANTS) == 1.0
    assert value(scrapes["selector"], "hsched_selector_path_finder_info", finder="dijkstra",
                 requested="dijkstra") == 1.0
