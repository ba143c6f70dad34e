"""Alibaba 2018 batch DAG jobs through the real processes (Stack on the small fleet, real Redis, placers serving
the shipped BA3C model for their DAG queue: `--dag-policy ba3c`): `hsched replay alibaba2018` runs them to
completion and ends with the summary; and the trace → JobSpec mapping (hsched.job_replay) on its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from hsched.job_replay import alibaba_jobs, alibaba_to_job_spec
from hsched.jobs import validate_job
from hsched.traces.alibaba2018 import critical_path_s, load_alibaba_jobs
from tests.conftest import small_fleet_stack
from tests.test_jobs_stack import assert_every_job_succeeded

TIME_FACTOR = 60.0  # task seconds per wall second


@pytest.fixture(scope="module")
def stack(redis_url):
    with small_fleet_stack(redis_url, "alibaba", thermal=False, log_level="INFO", time_factor=TIME_FACTOR,
                     dag_policy="ba3c") as s:
        yield s


def test_the_alibaba_replay_runs_dag_jobs_to_completion_and_summarises(stack, redis_url, monkeypatch, capsys):
    from hsched import cli

    placers = [svc for name, svc in stack.services.items() if name.startswith("placer-")]
    pids = [svc.proc.pid for svc in placers]
    for svc in placers:  # hsched up --dag-policy reaches every placer process
        cmdline = Path(f"/proc/{svc.proc.pid}/cmdline").read_bytes().split(b"\0")
        assert b"--dag-policy" in cmdline and cmdline[cmdline.index(b"--dag-policy") + 1] == b"ba3c"
    monkeypatch.setenv("REDIS_URL", redis_url)
    code = cli.main(["replay", "alibaba2018", "--gateway", stack.gateway, "--prefix", stack.config.prefix,
                     "--limit", "4", "--job-interval-s", "5", "--job-max-tasks", "4", "--alibaba-max-instances",
                     "30", "--time-factor", str(TIME_FACTOR)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "replaying 4 Alibaba 2018 batch DAG jobs" in out and "Alibaba 2018 batch DAG replay" in out
    assert_every_job_succeeded(out, 4)
    # serving the model took no placer down (none died or was restarted by the supervisor)
    assert all(svc.alive for svc in placers) and [svc.proc.pid for svc in placers] == pids


def test_the_mapping_keeps_the_dag_the_requests_and_the_instance_seconds():
    job = next(j for j in load_alibaba_jobs(max_instances=5000, min_tasks=3) if max(t.instances for t in j.tasks) > 8)
    folded = alibaba_to_job_spec(job, max_tasks_per_stage=8)
    validate_job(folded)
    for i, (t, s) in enumerate(zip(job.tasks, folded.stages, strict=True)):
        assert s.name == f"t{i}" and list(s.parents) == [f"t{p}" for p in job.parents(i)]
        assert s.tasks == min(t.instances, 8)
        assert s.tasks * s.runtime_s == pytest.approx(t.instances * t.duration_s)  # instance-seconds kept
        assert s.resources.cpu_milli == round(t.cpu_cores * 1000)
        assert s.resources.memory_mib == round(t.memory / 100 * 384 * 1024)
    unfolded = alibaba_to_job_spec(job)
    assert [s.tasks for s in unfolded.stages] == [t.instances for t in job.tasks]
    # unfolded, the bound is the loader's critical path; folding only lengthens tasks
    [trace_job] = [j for j in alibaba_jobs(limit=0, max_tasks_per_stage=0, max_instances=5000, min_tasks=3)
                   if j.name == job.name]
    assert trace_job.critical_path_s == pytest.approx(critical_path_s(job))
    a, b = alibaba_jobs(limit=5, seed=7), alibaba_jobs(limit=5, seed=7)
    assert [(j.name, j.arrival_s) for j in a] == [(j.name, j.arrival_s) for j in b]  # seeded
    assert all(len(j.spec.stages) >= 2 for j in a)
