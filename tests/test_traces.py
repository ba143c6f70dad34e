"""Trace loaders against rows checked by hand in data/ (each raw line is quoted next to its assertions)."""

from __future__ import annotations

import gzip
import itertools
from collections import Counter
from pathlib import Path

import pytest

from hsched.domain.fleet import Link
from hsched.domain.resources import Resources
from hsched.traces import data_dir
from hsched.traces.openb import (
    DEFAULT_RUNTIME_S,
    OpenbNode,
    OpenbPod,
    load_openb_nodes,
    load_openb_pods,
    openb_pod_to_task,
)
from hsched.traces.pai import PaiMachine, load_pai_machines, pai_machine_configs
from hsched.traces.swf import SwfJob, load_swf, swf_header, swf_job_to_task
from hsched.traces.topology_zoo import haversine_km, join_graphs, largest_component, load_graphml

DATA = data_dir()
THUNDER = DATA / "pwa_swf" / "LLNL-Thunder-2007-1.1-cln.swf.gz"
KTH = DATA / "pwa_swf" / "KTH-SP2-1996-2.1-cln.swf.gz"
OPENB = DATA / "alibaba_openb_gpu_2023"
PAI = DATA / "alibaba_pai_gpu_2020" / "pai_machine_spec.csv"
ZOO = DATA / "topology_zoo" / "graphml"


# --- data_dir -----------------------------------------------------------------------------------------------


def test_data_dir_is_the_repo_data_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HSCHED_DATA", raising=False)
    assert data_dir() == Path(__file__).resolve().parents[1] / "data"


def test_data_dir_env_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HSCHED_DATA", str(tmp_path))
    assert data_dir() == tmp_path
    monkeypatch.setenv("HSCHED_DATA", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="HSCHED_DATA"):
        data_dir()


def test_every_shipped_dataset_has_a_readme() -> None:
    for name in ("topology_zoo", "pwa_swf", "alibaba_openb_gpu_2023", "alibaba_pai_gpu_2020", "decima_tpch"):
        assert (DATA / name / "README.md").is_file()
    assert len(list(ZOO.glob("*.graphml"))) == 12


# --- Topology Zoo ---------------------------------------------------------------------------------------------


def test_haversine_hand_computed() -> None:
    # One degree of longitude on the equator is 2πR/360 = 2π·6371.0088/360 = 111.19508 km.
    assert haversine_km((0.0, 0.0), (0.0, 1.0)) == pytest.approx(111.19508, abs=1e-4)
    # Equator to pole is a quarter circle: πR/2 = 10007.5572 km.
    assert haversine_km((0.0, 0.0), (90.0, 0.0)) == pytest.approx(10007.5572, abs=1e-3)
    assert haversine_km((10.0, 20.0), (10.0, 20.0)) == 0.0
    assert haversine_km((41.85, -87.65), (39.77, -86.16)) == haversine_km((39.77, -86.16), (41.85, -87.65))


def test_abilene() -> None:
    vertices, links, source = load_graphml(ZOO / "Abilene.graphml")
    assert source == "Topology Zoo: Abilene (US, REN, 2005-02)"
    assert len(vertices) == 11 and len(links) == 14
    # <node id="1"> Latitude 41.85003, Longitude -87.65005, label Chicago
    assert vertices["Chicago"] == (41.85003, -87.65005)
    assert vertices["Indianapolis"] == (39.76838, -86.15804)
    by_pair = {frozenset((link.a, link.b)): link for link in links}
    chi_ind = by_pair[frozenset(("Chicago", "Indianapolis"))]  # <edge source="1" target="10">
    la_hou = by_pair[frozenset(("Los Angeles", "Houston"))]  # <edge source="5" target="8">
    # README: shortest link Chicago–Indianapolis 263 km, longest Los Angeles–Houston 2207 km.
    assert chi_ind.distance_km == pytest.approx(263.3, abs=0.1)
    assert la_hou.distance_km == pytest.approx(2206.8, abs=0.1)
    assert min(link.distance_km for link in links) == chi_ind.distance_km
    assert max(link.distance_km for link in links) == la_hou.distance_km
    for link in links:
        assert link.latency_ms == pytest.approx(link.distance_km * 0.005)
        assert link.bandwidth_mbps == 0.0  # Abilene has no LinkSpeedRaw (OC-192 only in LinkType)


def test_geant2012_drops_nodes_without_coordinates() -> None:
    vertices, links, _ = load_graphml(ZOO / "Geant2012.graphml")
    # Nodes 10 "UA", 11 "MD", 19 "BY" have no Latitude/Longitude: 40 → 37 nodes, 61 → 58 links.
    assert len(vertices) == 37 and len(links) == 58
    assert not {"UA", "MD", "BY"} & set(vertices)
    assert all(link.a in vertices and link.b in vertices for link in links)
    assert sum(link.bandwidth_mbps > 0 for link in links) == 36


def test_cernet_multigraph_keeps_parallel_links_and_renames_shared_labels() -> None:
    vertices, links, _ = load_graphml(ZOO / "Cernet.graphml")
    # 41 nodes, 4 without coordinates (Japan, Europe, N.A, Korea); 59 edges, 4 of them to those placeholders.
    assert len(vertices) == 37 and len(links) == 55
    assert not {"Japan", "Europe", "N.A", "Korea"} & set(vertices)
    # Graph note: "We assume there are two links between Beijing and Xi'an" — edges 21–37 keys 0 and 1, both
    # LinkSpeedRaw 155000000.0 bit/s.
    pair = [link for link in links if {link.a, link.b} == {"Beijing", "Xi'an"}]
    assert len(pair) == 2
    assert all(link.bandwidth_mbps == 155.0 for link in pair)
    assert pair[0].distance_km == pair[1].distance_km == pytest.approx(
        haversine_km((39.9075, 116.39723), (34.25833, 108.92861)))
    # Nodes 12 and 22 are both labelled "Shijiazhuang".
    assert {"Shijiazhuang #12", "Shijiazhuang #22"} <= set(vertices) and "Shijiazhuang" not in vertices


def test_colocated_nodes_get_the_latency_floor() -> None:
    _, links, _ = load_graphml(ZOO / "Aarnet.graphml")
    # Nodes 0 "Sydney1" and 3 "Sydney2" share coordinates.
    sydney = next(link for link in links if {link.a, link.b} == {"Sydney1", "Sydney2"})
    assert sydney.distance_km == 0.0 and sydney.latency_ms == 0.05


def test_all_zoo_graphs_load_with_positive_latencies() -> None:
    for path in ZOO.glob("*.graphml"):
        vertices, links, source = load_graphml(path)
        assert source.startswith("Topology Zoo: ")
        assert all(link.a != link.b and link.latency_ms > 0 for link in links)
        assert all(-90 <= lat <= 90 and -180 <= lon <= 180 for lat, lon in vertices.values())


def test_largest_component_drops_the_unlinked_pops_of_uninett() -> None:
    vertices, links, _ = load_graphml(ZOO / "Uninett.graphml")
    kept, kept_links, dropped = largest_component(vertices, links)
    assert len(vertices) == 74 and len(kept) == 71 and len(kept_links) == len(links) == 97
    assert dropped == ("HSM Kristiansun", "HSM Molde", "HiAK Kjeller")  # no link in the file


def test_join_graphs_bridges_the_nearest_pops_with_distinct_ends() -> None:
    # two 2-PoP "networks" on the equator: left at lon 0 and 1, right at lon 2 and 5 (1° = 111.195 km)
    left = ({"a": (0.0, 0.0), "b": (0.0, 1.0)}, [Link("a", "b", 111.195, 0.556)])
    right = ({"c": (0.0, 2.0), "d": (0.0, 5.0)}, [Link("c", "d", 333.585, 1.668)])
    vertices, links = join_graphs([("L", *left), ("R", *right)], bridges=2)
    assert set(vertices) == {"L/a", "L/b", "R/c", "R/d"}
    bridges = [(x.a, x.b, round(x.distance_km, 1)) for x in links[2:]]
    # nearest pair b–c (1°); the next with unused ends is a–d (5°), not b–d or a–c (b and c are taken)
    assert bridges == [("L/b", "R/c", 111.2), ("L/a", "R/d", 556.0)]
    assert links[3].latency_ms == pytest.approx(556.0 * 0.005, rel=1e-3)


# --- SWF ----------------------------------------------------------------------------------------------------


def test_thunder_first_jobs() -> None:
    first, second, third = load_swf(THUNDER, limit=3)
    #     1        0     -1  34616  472     -1    -1  156     -1    -1  0  16  -1  64 -1  1 -1 -1
    assert first == SwfJob(job_id=1, submit_s=0.0, wait_s=None, runtime_s=34616.0, procs=156,
                           requested_time_s=None, status=0, user_id=16, partition=1)
    assert second.job_id == 2 and second.procs == 384  # "2 0 -1 34616 472 -1 -1 384 ..."
    #     3   207147     -1  42010   24     -1    -1   24     -1    -1  5   7  -1   7 -1  1 -1 -1
    assert third == SwfJob(job_id=3, submit_s=207147.0, wait_s=None, runtime_s=42010.0, procs=24,
                           requested_time_s=None, status=5, user_id=7, partition=1)
    task = swf_job_to_task(first)
    task.validate()
    assert task.resources == Resources(cpu_milli=156_000, memory_mib=156 * 1024)
    assert task.runtime_s == 34616.0 and task.name == "swf-1" and task.tenant == "swf"
    assert swf_job_to_task(third, cores_per_proc=2).resources == Resources(cpu_milli=48_000, memory_mib=48 * 1024)


def test_thunder_placeholder_dropped_and_zero_runtime_clamped() -> None:
    #   297   283630     -1      0   32     -1    -1   32   1800    -1  1  37  -1  72 -1  2 -1 -1
    #   298   283646     -1     14   32     -1    -1   32   1800    -1  1  37  -1  78 -1  2 -1 -1
    #   299       -1     -1     -1   -1     -1    -1   -1     -1    -1  1  36  -1  66 -1  2 -1 -1   (placeholder)
    #   300   283652     -1    446    4     -1    -1    4   1800    -1  1   3  -1  49 -1  2 -1 -1
    jobs = list(load_swf(THUNDER, skip=296, limit=3))
    assert [j.job_id for j in jobs] == [297, 298, 300]
    assert jobs[0] == SwfJob(job_id=297, submit_s=283630.0, wait_s=None, runtime_s=0.0, procs=32,
                             requested_time_s=1800.0, status=1, user_id=37, partition=2)
    assert swf_job_to_task(jobs[0]).runtime_s == 1.0  # runtime 0 clamped to 1 s
    assert jobs[2].procs == 4 and jobs[2].runtime_s == 446.0 and jobs[2].user_id == 3


def test_thunder_procs_fall_back_to_allocated() -> None:
    # 13095  1896514     -1      5    4     -1    -1   -1     -1    -1  0  33  -1 224 -1  1 -1 -1
    job = next(j for j in load_swf(THUNDER, limit=20_000) if j.job_id == 13095)
    assert job == SwfJob(job_id=13095, submit_s=1896514.0, wait_s=None, runtime_s=5.0, procs=4,
                         requested_time_s=None, status=0, user_id=33, partition=1)


@pytest.mark.slow  # reads the whole 121k-record Thunder log (~2 s)
def test_thunder_whole_file() -> None:
    with gzip.open(THUNDER, "rt") as fh:
        rows = [line.split() for line in fh if line.strip() and not line.startswith(";")]
    assert len(rows) == 121_039
    placeholders = {int(r[0]) for r in rows if int(r[1]) < 0 or int(r[3]) < 0}
    assert len(placeholders) == 1190 and 299 in placeholders
    # Besides the 1190 all -1 placeholders, 1058 jobs that never ran have neither a requested nor an
    # allocated processor count, e.g. " 3457 699978 -1 0 -1 -1 -1 -1 -1 -1 0 44 -1 617 -1 2 -1 -1".
    no_procs = {int(r[0]) for r in rows if int(r[0]) not in placeholders and int(r[7]) <= 0 and int(r[4]) <= 0}
    assert len(no_procs) == 1058 and 3457 in no_procs
    jobs = list(load_swf(THUNDER))
    assert len(jobs) == 121_039 - 1190 - 1058
    ids = {j.job_id for j in jobs}
    assert not ids & (placeholders | no_procs)
    assert all(a.submit_s <= b.submit_s for a, b in itertools.pairwise(jobs))  # sorted once cleaned
    assert max(j.procs for j in jobs) == 3860
    assert all(j.wait_s is None for j in jobs)  # Thunder records no wait times


def test_thunder_header() -> None:
    header = swf_header(THUNDER)
    assert header["MaxProcs"] == 4008 and header["MaxNodes"] == 1002
    assert header["UnixStartTime"] == 1170175078 and header["MaxJobs"] == 128662
    assert header["Partition"] == ["1  pbatch", "2  pdebug"]
    assert header["TimeZoneString"] == "US/Pacific"


def test_kth() -> None:
    jobs = list(load_swf(KTH))
    assert len(jobs) == 27_992  # header says MaxRecords 28476; the file has 27,992
    #    15   599850 192180   3477    4     -1    -1    4  53940    -1  1  12  12  -1 -1 -1 -1 -1
    assert jobs[0] == SwfJob(job_id=15, submit_s=599850.0, wait_s=192180.0, runtime_s=3477.0, procs=4,
                             requested_time_s=53940.0, status=1, user_id=12, partition=None)
    # 28490 29363618    720      8    1     -1    -1    1  30000    -1  1  98 198  -1 -1 -1 -1 -1
    assert jobs[-1] == SwfJob(job_id=28490, submit_s=29363618.0, wait_s=720.0, runtime_s=8.0, procs=1,
                              requested_time_s=30000.0, status=1, user_id=98, partition=None)
    assert swf_header(KTH)["MaxProcs"] == 100


def test_swf_memory_and_plain_file(tmp_path: Path) -> None:
    path = tmp_path / "tiny.swf"
    path.write_text("; MaxProcs: 8\n"
                    "1 10 5 100 4 -1 -1 4 200 2048 1 7 -1 -1 -1 1 -1 -1\n"  # 2048 KB/proc requested
                    "2 -1 -1 -1 -1 -1 -1 -1 -1 -1 1 7 -1 -1 -1 1 -1 -1\n"
                    "3 20 -1 50 2 -1 1500 -1 -1 -1 0 8 -1 -1 -1 1 -1 -1\n")  # used 1500 KB/proc, allocated 2
    first, third = load_swf(path)
    assert first.memory_mib_per_proc == 2 and swf_job_to_task(first).resources.memory_mib == 8
    assert third.procs == 2 and third.memory_mib_per_proc == 2  # ceil(1500 / 1024)
    assert swf_header(path) == {"MaxProcs": 8}


# --- openb ----------------------------------------------------------------------------------------------------


def test_openb_nodes() -> None:
    nodes = load_openb_nodes(OPENB / "openb_node_list_all_node.csv")
    gpu_nodes = load_openb_nodes(OPENB / "openb_node_list_gpu_node.csv")
    assert len(nodes) == 1523 and len(gpu_nodes) == 1213
    assert nodes[0] == OpenbNode("openb-node-0000", 32000, 262144, 0, "")  # openb-node-0000,32000,262144,0,
    assert gpu_nodes[0] == OpenbNode("openb-node-0000", 64000, 262144, 2, "P100")  # openb-node-0000,64000,262144,2,P100
    assert sum(n.gpu for n in nodes) == 6212 and sum(n.gpu > 0 for n in nodes) == 1213
    assert Counter(n.model for n in nodes)["G2"] == 549


def test_openb_pods_default() -> None:
    pods = load_openb_pods(OPENB / "openb_pod_list_default.csv.gz")
    assert len(pods) == 8152
    # openb-pod-0000,12000,16384,1,1000,,LS,Running,0,12537496,0
    assert pods[0] == OpenbPod("openb-pod-0000", 12000, 16384, 1, 1000, (), "LS", "Running", 0, 12537496, 0)
    task = openb_pod_to_task(pods[0])
    task.validate()
    assert task.resources == Resources(cpu_milli=12000, memory_mib=16384, gpu_count=1, gpu_core_percent=100,
                                       gpu_memory_mib=16384)
    assert (task.runtime_s, task.name, task.tenant, task.priority, task.gpu_models) == (
        12537496.0, "openb-pod-0000", "openb", 100, ())
    assert len(load_openb_pods(OPENB / "openb_pod_list_default.csv.gz", limit=5)) == 5
    for pod in pods:
        openb_pod_to_task(pod).validate()


def _pod(name: str) -> OpenbPod:
    return next(p for p in load_openb_pods(OPENB / "openb_pod_list_default.csv.gz") if p.name == name)


def test_openb_gpu_sharing_pod() -> None:
    # openb-pod-0001,6000,12288,1,460,,LS,Running,427061,12902960,427061
    pod = _pod("openb-pod-0001")
    assert pod == OpenbPod("openb-pod-0001", 6000, 12288, 1, 460, (), "LS", "Running", 427061, 12902960, 427061)
    task = openb_pod_to_task(pod)
    # 0.46 of a card: 46 % of its cores and 0.46 × 16 GiB = 7536.64 → 7537 MiB of its memory.
    assert task.resources == Resources(cpu_milli=6000, memory_mib=12288, gpu_count=1, gpu_core_percent=46,
                                       gpu_memory_mib=7537)
    assert task.runtime_s == 12902960 - 427061
    assert openb_pod_to_task(pod, gpu_memory_gib_per_full_gpu=32.0).resources.gpu_memory_mib == 15073


def test_openb_multi_gpu_pod() -> None:
    # openb-pod-0017,88000,327680,8,1000,,Burstable,Succeeded,9437497,10769854,9437497
    task = openb_pod_to_task(_pod("openb-pod-0017"))
    task.validate()
    assert task.resources == Resources(cpu_milli=88000, memory_mib=327680, gpu_count=8, gpu_core_percent=100,
                                       gpu_memory_mib=16384)
    assert task.runtime_s == 10769854 - 9437497 and task.priority == 50


def test_openb_cpu_only_pod() -> None:
    # openb-pod-0005,20000,65536,0,0,,LS,Running,2759674,12902960,2759676
    task = openb_pod_to_task(_pod("openb-pod-0005"))
    task.validate()
    assert task.resources == Resources(cpu_milli=20000, memory_mib=65536)
    assert task.runtime_s == 12902960 - 2759676 and task.priority == 100


def test_openb_zero_memory_and_pending_pods() -> None:
    # openb-pod-1523,14000,0,1,1000,,Burstable,Succeeded,10611842,10615828,10611842  (the one 0-MiB pod)
    zero = openb_pod_to_task(_pod("openb-pod-1523"))
    zero.validate()
    assert zero.resources.memory_mib == 0 and zero.resources.cpu_milli == 14000 and zero.runtime_s == 3986.0
    # openb-pod-0061,11908,47104,1,1000,,BE,Pending,10001278,10001403,   (never scheduled)
    pending = _pod("openb-pod-0061")
    assert pending.scheduled_s is None and pending.phase == "Pending" and pending.qos == "BE"
    task = openb_pod_to_task(pending)
    assert task.runtime_s == 10001403 - 10001278 and task.priority == 0


def test_openb_gpuspec33_deduplicates_models() -> None:
    pods = {p.name: p for p in load_openb_pods(OPENB / "openb_pod_list_gpuspec33.csv.gz")}
    assert len(pods) == 8152
    # openb-pod-0527,3152,5600,1,1000,V100M16|V100M32|V100M32,BE,Pending,10218024,10218029,
    assert pods["openb-pod-0527"].gpu_spec == ("V100M16", "V100M32")
    assert openb_pod_to_task(pods["openb-pod-0527"]).gpu_models == ("V100M16", "V100M32")
    # openb-pod-1444,...,A10|G2|P100|T4|V100M16|V100M32|V100M32,BE,Failed,10571117,10571654,10571117
    assert pods["openb-pod-1444"].gpu_spec == ("A10", "G2", "P100", "T4", "V100M16", "V100M32")


def test_openb_five_column_variant(tmp_path: Path) -> None:
    # The first rows of openb_pod_list_multigpu20.csv.gz (not shipped), which has only 5 columns.
    path = tmp_path / "multigpu.csv.gz"
    with gzip.open(path, "wt") as fh:
        fh.write("name,cpu_milli,memory_mib,num_gpu,gpu_milli\n"
                 "openb-pod-0000,12000,16384,1,1000\n"
                 "openb-pod-0001,6000,12288,1,460\n")
    pods = load_openb_pods(path)
    assert pods[1] == OpenbPod("openb-pod-0001", 6000, 12288, 1, 460)
    assert (pods[1].qos, pods[1].creation_s, pods[1].deletion_s, pods[1].scheduled_s) == ("", 0, None, None)
    task = openb_pod_to_task(pods[1])
    task.validate()
    assert task.runtime_s == DEFAULT_RUNTIME_S and task.priority == 0


# --- PAI ------------------------------------------------------------------------------------------------------


def test_pai_machines_and_configs() -> None:
    machines = load_pai_machines(PAI)
    assert len(machines) == 1897 and len({m.machine for m in machines}) == 1897
    # line 1: 7399a758eb02bae1a3621236,CPU,96,512,0
    assert machines[0] == PaiMachine("7399a758eb02bae1a3621236", "CPU", 96, 512, 0)
    # line 861: 75dd68490b1df5ee5853133a,P100,64,512,2
    assert machines[860] == PaiMachine("75dd68490b1df5ee5853133a", "P100", 64, 512, 2)
    assert (machines[860].cpu_milli, machines[860].memory_mib) == (64_000, 512 * 1024)
    assert sum(m.cap_gpu for m in machines) == 6742
    assert pai_machine_configs(machines) == [
        ("P100", 64, 512, 2, 798),
        ("T4", 96, 512, 2, 497),
        ("MISC", 96, 512, 8, 280),
        ("V100M32", 96, 384, 8, 135),
        ("CPU", 96, 512, 0, 83),
        ("V100", 96, 512, 8, 59),
        ("V100", 96, 384, 8, 45),
    ]
    explicit = load_pai_machines(PAI, PAI.with_suffix(".header"))
    assert explicit == machines
