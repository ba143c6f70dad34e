"""Alibaba v2018 batch DAG loader: hand-checked rows of the shipped file, name parsing, field-naming errors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hsched.traces.alibaba2018 import (
    AlibabaTraceError,
    critical_path_s,
    load_alibaba_jobs,
    parse_row,
    parse_task_name,
    read_jobs,
    topological_order,
)

HEADER = "task_name,job_name,instance_num,status,start_time,end_time,duration,plan_cpu,plan_mem\n"


def test_shipped_file_counts_and_hand_checked_job():
    jobs = load_alibaba_jobs()
    assert len(jobs) == 6535
    assert sum(len(j.tasks) for j in jobs) == 24729
    assert sum(len(j.edges) for j in jobs) == 19432
    job = next(j for j in jobs if j.name == "j_7945")
    # rows of j_7945 in the file, read by eye
    assert [(t.name, t.instances) for t in job.tasks] == [
        ("M1", 2166), ("R2_1", 181), ("M3", 3), ("M4", 13), ("J5_3_4", 17), ("J6_2_5", 127)]
    j6 = job.tasks[5]
    assert (j6.task_id, j6.depends_on, j6.duration_s, j6.cpu_cores, j6.memory) == (6, (2, 5), 730.0, 1.0, 0.74)
    assert (j6.start_time_s, j6.end_time_s) == (194798, 195528)
    assert job.edges == ((0, 1), (1, 5), (2, 4), (3, 4), (4, 5))
    assert critical_path_s(job) == pytest.approx(7.9746075715604805 + 51.92265193370166 + 730.0)
    assert job.arrival_s == 194638
    # j_410: "R2_1,j_410,1,…,8,50,0.2" and "M1,j_410,16,…,0.6875,50,0.2"
    j410 = next(j for j in jobs if j.name == "j_410")
    assert [(t.name, t.instances, t.duration_s, t.cpu_cores) for t in j410.tasks] == [
        ("M1", 16, 0.6875, 0.5), ("R2_1", 1, 8.0, 0.5)]


def test_incomplete_jobs_are_dropped_and_filters_apply():
    jobs = load_alibaba_jobs()
    assert all(t.status == "Terminated" for j in jobs for t in j.tasks)
    assert "j_229903" not in {j.name for j in jobs}  # has Waiting tasks with empty plan_cpu
    small = load_alibaba_jobs(max_instances=10, min_tasks=2)
    assert small and all(j.num_instances <= 10 and len(j.tasks) >= 2 for j in small)


@pytest.mark.parametrize("name, parsed", [
    ("M1", (1, ())), ("J3_1_2", (3, (1, 2))), ("R2_1_Stg8", (2, (1,))), ("J10_7_9_Stg4", (10, (7, 9))),
    ("J30_4_5_", (30, (4, 5))), ("task_abc", (None, ())), ("MergeTask", (None, ())), ("J5_3_3", (5, (3,))),
])
def test_task_name_parsing(name, parsed):
    assert parse_task_name(name) == parsed


def test_parse_task_name_rejects_a_garbage_group():
    with pytest.raises(AlibabaTraceError, match="task_name"):
        parse_task_name("J3_1_x")


def _rows(*lines: str) -> list[str]:
    return (HEADER + "".join(line + "\n" for line in lines)).splitlines(keepends=True)


def test_dependencies_become_index_edges_in_topological_order():
    jobs = read_jobs(_rows("J3_1_2,j_1,2,Terminated,5,9,4,100,0.5", "M1,j_1,1,Terminated,0,2,2,50,0.2",
                           "M2,j_1,3,Terminated,0,3,3,100,0.3"))
    (job,) = jobs
    assert [t.name for t in job.tasks] == ["M1", "M2", "J3_1_2"]
    assert job.edges == ((0, 2), (1, 2))
    assert topological_order(job) == (0, 1, 2)
    assert critical_path_s(job) == 7.0  # M2 (3 s) then J3 (4 s)


@pytest.mark.parametrize("line, field", [
    ("M1,j_1,0,Terminated,0,1,1,100,0.2", "instance_num"),
    ("M1,j_1,1.5,Terminated,0,1,1,100,0.2", "instance_num"),
    ("M1,j_1,1,Terminated,0,1,1,,0.2", "plan_cpu"),
    ("M1,j_1,1,Terminated,0,1,1,100,-1", "plan_mem"),
    ("M1,j_1,1,Terminated,0,1,1,100,101", "plan_mem"),
    ("M1,j_1,1,Terminated,0,1,0,100,0.2", "duration"),
    ("M1,j_1,1,Terminated,5,1,1,100,0.2", "end_time"),
    ("M1,j_1,1,Done,0,1,1,100,0.2", "status"),
    (",j_1,1,Terminated,0,1,1,100,0.2", "task_name"),
    ("M1,,1,Terminated,0,1,1,100,0.2", "job_name"),
    ("M1_1,j_1,1,Terminated,0,1,1,100,0.2", "task_name"),       # depends on itself
    ("J2_7,j_1,1,Terminated,0,1,1,100,0.2", "task_name"),       # unknown parent
])
def test_bad_rows_name_the_field(line, field):
    with pytest.raises(AlibabaTraceError, match=f"'{field}'"):
        read_jobs(_rows(line))


def test_cycles_and_duplicate_ids_are_rejected():
    with pytest.raises(AlibabaTraceError, match="cycle"):
        read_jobs(_rows("M1_2,j_1,1,Terminated,0,1,1,100,0.2", "M2_1,j_1,1,Terminated,0,1,1,100,0.2"))
    with pytest.raises(AlibabaTraceError, match="appears twice"):
        read_jobs(_rows("M1,j_1,1,Terminated,0,1,1,100,0.2", "R1,j_1,1,Terminated,0,1,1,100,0.2"))


def test_jobs_with_unfinished_tasks_are_skipped_even_with_empty_cells():
    jobs = read_jobs(_rows("M1,j_1,1,Terminated,0,1,1,100,0.2", "M1,j_2,,Waiting,0,0,1,,",
                           "M2,j_2,1,Terminated,0,1,1,100,0.2"))
    assert [j.name for j in jobs] == ["j_1"]


@settings(max_examples=60, deadline=None)
@given(field=st.sampled_from(["instance_num", "duration", "plan_cpu", "plan_mem", "start_time"]),
       value=st.one_of(st.text(max_size=6), st.floats(allow_nan=True, allow_infinity=True).map(str)))
def test_any_bad_numeric_value_raises_naming_its_field_or_parses(field, value):
    row = {"task_name": "M1", "job_name": "j_1", "instance_num": "1", "status": "Terminated", "start_time": "0",
           "end_time": "10", "duration": "1", "plan_cpu": "100", "plan_mem": "0.2", field: value}
    try:
        task = parse_row(row)
    except AlibabaTraceError as exc:
        assert field in str(exc) or "end_time" in str(exc)
    else:  # accepted: then the value really was a valid number for that field
        assert task.instances >= 1 and task.duration_s > 0 and task.cpu_cores > 0 and 0 < task.memory <= 100
