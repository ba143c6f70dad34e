"""Decima TPC-H DAG loader against values checked by hand in the raw lists (data/decima_tpch/)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hsched.domain.errors import ValidationError
from hsched.domain.resources import Resources
from hsched.domain.task import MAX_REPLICAS
from hsched.traces import data_dir
from hsched.traces.decima import (
    DEFAULT_MEMORY_MIB_PER_TASK,
    FIRST_WAVE,
    FRESH,
    REST_WAVE,
    TPCH_QUERIES,
    TPCH_SIZES,
    WARMUP_DELAY_S,
    DagJob,
    DagStage,
    WaveDurations,
    critical_path_s,
    dag_job_to_tasks,
    dag_stage_to_task,
    executor_key,
    load_tpch_dags,
    make_dag_job,
    topological_order,
    total_work_s,
)

DECIMA = data_dir() / "decima_tpch"
FILE = DECIMA / "tpch_dags.json.gz"


def _one(size: str, query: int) -> DagJob:
    (job,) = load_tpch_dags(sizes=[size], queries=[query])
    return job


# --- the shipped file ---------------------------------------------------------------------------------------


def test_shipped_file_is_small_and_documented() -> None:
    assert (DECIMA / "README.md").is_file()
    assert FILE.stat().st_size < 2 * 1024 * 1024


def test_totals_22_queries_times_7_sizes() -> None:
    jobs = load_tpch_dags()
    assert len(jobs) == len(TPCH_QUERIES) * len(TPCH_SIZES) == 22 * 7 == 154
    assert [(j.size, j.query) for j in jobs] == [(s, q) for s in TPCH_SIZES for q in range(1, 23)]
    assert sum(len(j.stages) for j in jobs) == 1414
    assert sum(len(j.edges) for j in jobs) == 1309
    # Task counts per size from the source README (decima-sim's counting rule on the original .npy files).
    per_size = {s: sum(j.num_tasks for j in jobs if j.size == s) for s in TPCH_SIZES}
    assert per_size == {"2g": 20065, "5g": 20479, "10g": 21188, "20g": 22684, "50g": 27157, "80g": 31657,
                        "100g": 34660}


def test_every_dag_is_acyclic_and_consistent() -> None:
    for job in load_tpch_dags():
        order = topological_order(job)
        assert sorted(order) == list(range(len(job.stages)))
        position = {stage: k for k, stage in enumerate(order)}
        for parent, child in job.edges:
            assert parent != child and position[parent] < position[child], (job.name, parent, child)
        for stage in job.stages:
            assert stage.num_tasks >= 1 and stage.task_duration_s > 0
            assert all(stage.index in job.stages[p].children for p in stage.parents)
        cp, work = critical_path_s(job), total_work_s(job)
        assert max(s.task_duration_s for s in job.stages) <= cp <= work + 1e-9


def test_units_are_seconds() -> None:
    # The raw durations span 3 ms … 39,608 ms, so every mean lies in [0.003 s, 39.608 s]: converted exactly once.
    durations = [s.task_duration_s for j in load_tpch_dags() for s in j.stages]
    assert 0.003 <= min(durations) and max(durations) <= 39.608
    assert max(durations) > 1  # ≈ 4.96 s; a second ÷1000 would leave at most 0.04 s


# --- 2g/q14, checked by hand --------------------------------------------------------------------------------


def test_2g_q14_hand_checked() -> None:
    """Raw lists from decima-sim spark_env/tpch/2g/{adj_mat,task_duration}_14.npy (same values in our JSON).

    adj_mat_14 = [[0,0,1,0],[0,0,1,0],[0,0,0,1],[0,0,0,0]]  → 4 stages, edges 0→2, 1→2, 2→3.
    Executor keys in the file's order: 2, 100, 5, 40, 10, 80, 50, 20, 60 (first key = 2).

    Stage 0: first_wave 2:[2159,2166] 100:[2163,2204] 5:[2209,2230] 40:[2665,2222] 10:[2205,2079]
      80:[2015,2322] 50:[2162,2201] 20:[2128,2168] 60:[2072,2726]; fresh_durations = the same 18 values;
      rest_wave all empty. num_tasks = 2 + 0 = 2. Removing the fresh ones empties every first wave (and there
      is nothing lower to borrow), so the mean is over the 18 fresh values:
      4325+4367+4439+4887+4284+4337+4363+4296+4798 = 40096 ms / 18 = 2227.556 ms = 2.227556 s.
    Stage 1: first_wave has 89 values (sum 326979), fresh 83 (sum 313518), rest_wave 19 (sum 32515);
      rest_wave[2] has 10, first_wave[2] 2 → num_tasks = 12. Fresh removed, first waves keep 2:[2067,2058]
      5:[2271,2453] 10:[2287,2325] and are empty for 20…100, which borrow 10's list (6 more copies).
      Decima's mean = (2067+2058+2271+2453 + 7×(2287+2325) + 313518 + 32515) / (4 + 14 + 83 + 19)
      = (41133 + 313518 + 32515) / 120 = 387166 / 120 = 3226.383 ms. (A plain pooled mean would give
      (326979+32515)/108 = 3328.65 ms.)
    Stage 2: first_wave 2:[333,319], rest_wave[2] has 198 → num_tasks = 200. Fresh ⊂ first wave and no first
      wave empties, so the mean is all first (367 values, 460406) + all rest (1433 values, 43586) =
      503992 ms / 1800 = 279.9956 ms.
    Stage 3: first_wave 2:[169] 100:[395] 5:[189] 40:[499] 10:[239] 80:[406] 50:[403] 20:[237] 60:[405];
      no rest, no fresh. num_tasks = 1; mean = 2942 / 9 = 326.889 ms.
    Critical path = max(stage 0, stage 1) + stage 2 + stage 3 = 3226.383 + 279.996 + 326.889 = 3833.268 ms.
    Total work = 2×2227.556 + 12×3226.383 + 200×279.9956 + 1×326.889
               = 4455.11 + 38716.6 + 55999.11 + 326.889 = 99497.71 ms.
    """
    job = _one("2g", 14)
    assert job.name == "tpch-2g-q14" and job.query == 14 and job.size == "2g"
    assert len(job.stages) == 4
    assert job.edges == ((0, 2), (1, 2), (2, 3))
    assert [s.num_tasks for s in job.stages] == [2, 12, 200, 1]
    assert job.num_tasks == 215
    assert job.stages[2] == DagStage(index=2, num_tasks=200, task_duration_s=pytest.approx(503992 / 1800 / 1000),
                                     parents=(0, 1), children=(3,))
    assert job.stages[0].task_duration_s == pytest.approx(2.227556, abs=1e-6)
    assert job.stages[0].task_duration_s == pytest.approx(40096 / 18 / 1000)
    assert job.stages[1].task_duration_s == pytest.approx(387166 / 120 / 1000)
    assert job.stages[3].task_duration_s == pytest.approx(2942 / 9 / 1000)
    assert job.stages[0].parents == () and job.stages[3].children == ()
    assert topological_order(job) == (0, 1, 2, 3)
    assert critical_path_s(job) == pytest.approx(3.833268, abs=1e-6)
    assert total_work_s(job) == pytest.approx(99.49771, abs=1e-5)


def test_2g_q1_is_a_chain() -> None:
    # adj_mat_1 (2g): 0→1→2→3, 417 tasks. The critical path of a chain is the sum of its stage durations.
    job = _one("2g", 1)
    assert job.edges == ((0, 1), (1, 2), (2, 3))
    assert job.num_tasks == 417
    assert critical_path_s(job) == pytest.approx(sum(s.task_duration_s for s in job.stages))


def test_task_count_uses_the_first_executor_key() -> None:
    # 2g/q15 stage 6: first_wave 2:[113,173] 100:[278] 5:[159] 40:[274] 10:[183] 80:[307] 50:[243]
    # 20:[149,165] 60:[234], no rest/fresh. The first key (2) has 2 tasks although most keys have 1.
    # Mean = (113+173+278+159+274+183+307+243+149+165+234) / 11 = 2278 / 11 = 207.09 ms.
    stage = _one("2g", 15).stages[6]
    assert stage.num_tasks == 2
    assert stage.task_duration_s == pytest.approx(2278 / 11 / 1000)


def test_waves_are_the_lists_decima_sim_samples_from() -> None:
    """2g/q14 (see above): stage 1's first waves lose their fresh values and 20…100 borrow 10's list
    (decima-sim's pre_process_task_duration); stage 2's rest wave at key 2 has the 198 later tasks."""
    job = _one("2g", 14)
    w1 = job.stages[1].waves
    assert sorted(w1.first) == [2, 5, 10, 20, 40, 50, 60, 80, 100]
    assert sorted(w1.first[2] * 1000) == [2058, 2067] and sorted(w1.first[10] * 1000) == [2287, 2325]
    assert all(np.array_equal(w1.first[k], w1.first[10]) for k in (20, 40, 50, 60, 80, 100))
    assert sum(len(v) for v in w1.fresh.values()) == 83 and sum(len(v) for v in w1.rest.values()) == 19
    assert len(job.stages[2].waves.rest[2]) == 198
    # every listed duration (s) lies between the stage's shortest draw and the longest value
    assert job.stages[3].min_task_duration_s == pytest.approx(0.169)
    assert critical_path_s(job, shortest=True) <= critical_path_s(job)
    assert total_work_s(job, shortest=True) <= total_work_s(job)


def test_executor_key_follows_decima_sim() -> None:
    rng = np.random.default_rng(0)
    assert [executor_key(n, rng) for n in (1, 3, 5, 10, 20, 40, 100, 120)] == [5, 5, 5, 10, 20, 40, 100, 100]
    # between l = 10 and r = 20: l with probability (n − l) / (r − l) — decima-sim's rule as written
    draws = [executor_key(19, rng) for _ in range(2000)]
    assert set(draws) == {10, 20} and draws.count(10) > 1600
    draws = [executor_key(11, rng) for _ in range(2000)]
    assert draws.count(20) > 1600


TOY = WaveDurations(first={5: np.array([1.0]), 20: np.array([2.0])}, rest={5: np.array([0.25]), 20: np.zeros(0)},
                    fresh={5: np.array([1.5]), 20: np.zeros(0)})


def test_sample_picks_the_list_by_kind_and_key() -> None:
    rng = np.random.default_rng(0)
    assert [TOY.sample(kind, 3, rng) for kind in (FRESH, FIRST_WAVE, REST_WAVE)] == [1.5, 1.0, 0.25]
    # key 20 has no fresh and no rest record: first wave + the warm-up, and the first wave
    assert [TOY.sample(kind, 20, rng) for kind in (FRESH, FIRST_WAVE, REST_WAVE)] == [2.0 + WARMUP_DELAY_S, 2.0, 2.0]
    # 40 executors: key 40 not measured for this stage → its largest key (20)
    assert TOY.sample(FIRST_WAVE, 40, rng) == 2.0
    assert TOY.minimum_s() == 0.25


@settings(max_examples=30, deadline=None)
@given(query=st.integers(1, 22), size=st.sampled_from(["2g", "20g", "100g"]), n=st.integers(1, 120),
       kind=st.sampled_from([FRESH, FIRST_WAVE, REST_WAVE]), seed=st.integers(0, 2**16))
def test_every_draw_is_a_measured_value_no_shorter_than_the_minimum(query, size, n, kind, seed) -> None:
    rng = np.random.default_rng(seed)
    for stage in _one(size, query).stages:
        d = stage.waves.sample(kind, n, rng)
        assert d >= stage.min_task_duration_s
        values = {float(v) for wave in (stage.waves.first, stage.waves.rest, stage.waves.fresh)
                  for arr in wave.values() for v in arr}
        assert d in values or round(d - WARMUP_DELAY_S, 9) in {round(v, 9) for v in values}


# --- selection and errors -----------------------------------------------------------------------------------


def test_selection_by_size_name_or_number() -> None:
    jobs = load_tpch_dags(sizes=[100, "2g"], queries=[9, 1, 9])
    assert [(j.size, j.query) for j in jobs] == [("2g", 1), ("2g", 9), ("100g", 1), ("100g", 9)]
    assert len(load_tpch_dags(sizes=["2g", "5g", "10g", "20g", "50g", "100g"])) == 22 * 6  # seed 004's sizes
    assert load_tpch_dags(sizes=["2g"], queries=[3])[0] is load_tpch_dags(sizes=["2g"], queries=[3])[0]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"sizes": ["3g"]}, "unknown TPC-H size"),
    ({"sizes": [7]}, "unknown TPC-H size"),
    ({"queries": [0]}, "unknown TPC-H query"),
    ({"queries": [23]}, "unknown TPC-H query"),
])
def test_unknown_selection_raises(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_tpch_dags(**kwargs)


def _write(path: Path, dags: dict) -> Path:
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        json.dump(dags, fh)
    return path


def _raw(num_nodes: int, edges: list[list[int]], ms: float = 500.0) -> dict:
    stage = {"first_wave": {"2": [ms, ms]}, "rest_wave": {"2": [ms]}, "fresh_durations": {"2": []}}
    return {"num_nodes": num_nodes, "edges": edges, "task_duration_ms": [stage] * num_nodes}


def test_custom_file_and_cycle_detection(tmp_path: Path) -> None:
    good = _write(tmp_path / "good.json.gz", {"5g/q2": _raw(2, [[0, 1]])})
    (job,) = load_tpch_dags(good, sizes=["5g"], queries=[2])
    assert [s.num_tasks for s in job.stages] == [3, 3]  # 2 first-wave + 1 later-wave task
    assert job.stages[0].task_duration_s == 0.5
    with pytest.raises(ValueError, match=r"no DAG 5g/q3"):
        load_tpch_dags(good, sizes=["5g"], queries=[3])
    cyclic = _write(tmp_path / "cyclic.json.gz", {"2g/q7": _raw(3, [[0, 1], [1, 2], [2, 1]])})
    with pytest.raises(ValueError, match=r"tpch-2g-q7: the stage graph has a cycle \(stages \[1, 2\]"):
        load_tpch_dags(cyclic, sizes=["2g"], queries=[7])


def test_topological_order_names_the_cyclic_job() -> None:
    job = make_dag_job(4, "10g", [1, 1, 1], [1.0, 2.0, 3.0], [(0, 1), (1, 0), (0, 2)])
    with pytest.raises(ValueError, match="tpch-10g-q4: the stage graph has a cycle"):
        topological_order(job)
    with pytest.raises(ValueError, match="tpch-10g-q4"):
        critical_path_s(job)


def test_dag_job_checks_its_edges() -> None:
    with pytest.raises(ValueError, match="outside 0..1"):
        make_dag_job(1, "2g", [1, 1], [1.0, 1.0], [(0, 2)])
    with pytest.raises(ValueError, match="disagree with the edges"):
        DagJob(1, "2g", (DagStage(0, 1, 1.0), DagStage(1, 1, 1.0)), ((0, 1),))
    with pytest.raises(ValueError, match=r"stages\[0\] has index 1"):
        DagJob(1, "2g", (DagStage(1, 1, 1.0),), ())


def test_diamond_critical_path() -> None:
    # 0 → {1, 2} → 3 with durations 1, 5, 2, 1 s: the long branch is 0-1-3 = 1 + 5 + 1 = 7 s.
    job = make_dag_job(1, "2g", [4, 1, 3, 2], [1.0, 5.0, 2.0, 1.0], [(0, 1), (0, 2), (1, 3), (2, 3)])
    assert critical_path_s(job) == 7.0
    assert total_work_s(job) == 4 * 1.0 + 5.0 + 3 * 2.0 + 2 * 1.0 == 17.0
    assert topological_order(job) == (0, 1, 2, 3)


# --- TaskSpec conversion ------------------------------------------------------------------------------------


def test_stage_to_task_hand_checked() -> None:
    stage = _one("2g", 14).stages[2]  # 200 tasks of 279.9956 ms
    task = dag_stage_to_task(stage, name="tpch-2g-q14-s2")
    task.validate()
    assert task.replicas == 200
    assert task.runtime_s == stage.task_duration_s == pytest.approx(0.2799956, abs=1e-7)
    assert task.resources == Resources(cpu_milli=1000, memory_mib=DEFAULT_MEMORY_MIB_PER_TASK)
    assert task.tenant == "tpch" and task.name == "tpch-2g-q14-s2"
    custom = dag_stage_to_task(stage, cpu_per_task_milli=2000, memory_mib_per_task=4096, tenant="spark", priority=5)
    custom.validate()
    assert custom.total == Resources(cpu_milli=400_000, memory_mib=819_200)
    assert custom.priority == 5 and custom.tenant == "spark"


def test_every_stage_converts_to_a_valid_task() -> None:
    capped = 0
    for job in load_tpch_dags():
        for stage in job.stages:
            task = dag_stage_to_task(stage)
            task.validate()
            assert task.replicas == min(stage.num_tasks, MAX_REPLICAS)
            assert task.replicas * task.runtime_s == pytest.approx(stage.work_s)  # executor-seconds kept
            if stage.num_tasks > MAX_REPLICAS:
                capped += 1
                assert task.runtime_s > stage.task_duration_s
            else:
                assert task.runtime_s == stage.task_duration_s
    assert capped == 63


def test_stage_to_task_cap_and_bad_cap() -> None:
    stage = DagStage(index=0, num_tasks=10, task_duration_s=2.0)
    task = dag_stage_to_task(stage, max_replicas=4)
    assert (task.replicas, task.runtime_s) == (4, 5.0)  # 10 × 2 s of work on 4 replicas
    with pytest.raises(ValueError, match="max_replicas"):
        dag_stage_to_task(stage, max_replicas=MAX_REPLICAS + 1)
    with pytest.raises(ValidationError, match="tenant"):
        dag_stage_to_task(stage, tenant="Not A Label").validate()


def test_dag_job_to_tasks_in_topological_order() -> None:
    job = _one("2g", 14)
    pairs = dag_job_to_tasks(job)
    assert [stage.index for stage, _ in pairs] == [0, 1, 2, 3]
    assert [task.name for _, task in pairs] == [f"tpch-2g-q14-s{i}" for i in range(4)]
    assert [task.replicas for _, task in pairs] == [2, 12, 200, 1]
    for _, task in pairs:
        task.validate()
