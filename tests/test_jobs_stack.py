"""DAG jobs through the real processes (Stack on the small fleet, real Redis), the placers' clock compressed:
stages run in dependency order and the job succeeds; invalid DAGs get INVALID_ARGUMENT naming the field; a
gateway killed (SIGKILL) and restarted mid-job still finishes the job, and no stage runs twice."""

from __future__ import annotations

import json
import re
import time
from collections import Counter

import grpc
import pytest
from hypothesis import HealthCheck, given, settings

from hsched.stack import Stack, StackConfig
from hsched.state.keys import Keys
from hsched.v1 import common_pb2 as pb
from hsched.v1 import gateway_pb2, gateway_pb2_grpc, selector_pb2, selector_pb2_grpc
from tests.conftest import SMALL_FLEET, delete_prefix
from tests.test_jobs import dags, oracle_valid

TIME_FACTOR = 20.0  # task seconds per wall second


@pytest.fixture(scope="module")
def stack(redis_url):
    prefix = f"test-jobs-{int(time.time() * 1000)}"
    config = StackConfig(fleet_path=SMALL_FLEET, redis_url=redis_url, prefix=prefix, gateway_port=0,
                         thermal=False, log_level="INFO", time_factor=TIME_FACTOR)
    with Stack(config) as s:
        yield s
    delete_prefix(redis_url, prefix)


def stub(stack) -> gateway_pb2_grpc.GatewayStub:
    return gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(stack.gateway))


def stage(name: str, tasks: int, runtime_s: float, parents: tuple[str, ...] = ()) -> pb.StageSpec:
    return pb.StageSpec(name=name, tasks=tasks, runtime_s=runtime_s, parents=list(parents),
                        resources=pb.Resources(cpu_milli=2000, memory_mib=2048))


def wait_job(gw, job_id: str, timeout_s: float = 120.0) -> pb.Job:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            job = gw.GetJob(gateway_pb2.GetJobRequest(job_id=job_id), timeout=10)
            if job.state in (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED):
                return job
        except grpc.RpcError as exc:  # the gateway restarting
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise
        assert time.monotonic() < deadline, f"job {job_id} did not finish"
        time.sleep(0.1)


def tasks_by_stage(gw, job: pb.Job) -> dict[str, list[pb.Task]]:
    return {s.name: [gw.Get(gateway_pb2.GetRequest(task_id=t), timeout=10) for t in s.task_ids] for s in job.stages}


def check_dependency_order(job: pb.Job, tasks: dict[str, list[pb.Task]]) -> None:
    for s in job.spec.stages:
        assert len(tasks[s.name]) == s.tasks and all(t.state == pb.TASK_STATE_SUCCEEDED for t in tasks[s.name])
        for parent in s.parents:
            last_parent_finish = max(t.finished_unix_ms for t in tasks[parent])
            first_start = min(t.started_unix_ms for t in tasks[s.name])
            assert first_start >= last_parent_finish, (s.name, parent)


def test_a_three_stage_dag_runs_its_stages_in_dependency_order_and_succeeds(stack):
    gw = stub(stack)
    spec = pb.JobSpec(name="etl", request_id="three-stage", stages=[
        stage("extract", 3, 10.0), stage("transform", 2, 10.0, ("extract",)), stage("report", 1, 5.0, ("transform",))])
    reply = gw.SubmitJob(gateway_pb2.SubmitJobRequest(job=spec), timeout=30)
    assert not reply.duplicate and reply.job.datacenter
    job = wait_job(gw, reply.job.job_id)
    assert job.state == pb.JOB_STATE_SUCCEEDED, job.reason
    assert [(s.name, s.succeeded) for s in job.stages] == [("extract", 3), ("transform", 2), ("report", 1)]
    tasks = tasks_by_stage(gw, job)
    check_dependency_order(job, tasks)
    assert {t.datacenter for ts in tasks.values() for t in ts} == {job.datacenter}
    # a task's run took its runtime on the placers' clock (at least; overheads come before the start)
    for ts in tasks.values():
        for t in ts:
            assert (t.finished_unix_ms - t.started_unix_ms) * TIME_FACTOR / 1000 >= t.spec.runtime_s * 0.95
    again = gw.SubmitJob(gateway_pb2.SubmitJobRequest(job=spec), timeout=30)
    assert again.duplicate and again.job.job_id == job.job_id
    edited = pb.JobSpec()
    edited.CopyFrom(spec)
    edited.stages[0].tasks = 5  # another job under the same request_id: refused, not answered with the first
    with pytest.raises(grpc.RpcError) as err:
        gw.SubmitJob(gateway_pb2.SubmitJobRequest(job=edited), timeout=30)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS and "stages differ" in err.value.details()
    events = gw.Watch(gateway_pb2.WatchRequest(job_id=job.job_id, after_event_id="0"), timeout=5)
    seen: list[pb.TaskEvent] = []
    try:
        for ev in events:
            seen.append(ev)
            if ev.kind == "job_succeeded":
                break
    finally:
        events.cancel()
    assert seen[0].kind == "job_submitted" and all(ev.job_id == job.job_id for ev in seen)
    assert Counter(ev.kind for ev in seen)["succeeded"] == 6
    listed = gw.ListJobs(gateway_pb2.ListJobsRequest(state=pb.JOB_STATE_SUCCEEDED), timeout=10)
    assert job.job_id in [j.job_id for j in listed.jobs]
    import urllib.request
    port = stack.services["gateway"].metrics_port
    scraped = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert f'hsched_jobs{{datacenter="{job.datacenter}",state="succeeded"}}' in scraped or \
        f'hsched_jobs{{state="succeeded",datacenter="{job.datacenter}"}}' in scraped, scraped[-2000:]


def test_a_job_skips_the_cheapest_dc_while_it_is_full_and_runs_where_there_is_room(stack):
    """cheap (the cheapest for CPU work) filled by tasks that run until released: a job goes to a DC with room,
    the reason names cheap as full (it would have queued there while other rooms sat idle)."""
    gw = stub(stack)
    filler = pb.TaskSpec(resources=pb.Resources(cpu_milli=24000, memory_mib=1024), runtime_s=0, tenant="filler")
    fillers = [gw.Submit(gateway_pb2.SubmitRequest(task=filler), timeout=30).task for _ in range(4)]
    try:
        assert [f.datacenter for f in fillers] == ["cheap"] * 4, [f.datacenter for f in fillers]
        # until the selector has cheap's summary with the fillers (a placer publishes it after its write)
        sel = selector_pb2_grpc.SelectorStub(grpc.insecure_channel(stack.services["selector"].target))
        probe = pb.TaskSpec(resources=pb.Resources(cpu_milli=2000, memory_mib=2048), runtime_s=5)

        def cheap_seen_full() -> bool:
            answer = sel.SelectDataCenter(selector_pb2.SelectRequest(task=probe, include_room=True), timeout=10)
            return any(c.datacenter == "cheap" and not c.room_now for c in answer.candidates)
        plain = sel.SelectDataCenter(selector_pb2.SelectRequest(task=probe), timeout=10)
        assert not any(c.room_now for c in plain.candidates)  # not asked for: a task's Submit does not pay for it
        deadline = time.monotonic() + 30
        while not cheap_seen_full():
            assert time.monotonic() < deadline, "the selector never saw cheap full"
            time.sleep(0.1)
        spec = pb.JobSpec(name="etl", request_id="cheap-is-full", stages=[stage("a", 2, 5.0)])
        reply = gw.SubmitJob(gateway_pb2.SubmitJobRequest(job=spec), timeout=30)
        assert reply.job.datacenter not in ("", "cheap"), reply.job
        events = gw.Watch(gateway_pb2.WatchRequest(job_id=reply.job.job_id, after_event_id="0"), timeout=10)
        first = next(iter(events))
        events.cancel()
        assert first.kind == "job_submitted" and "cheaper but full now: cheap" in first.detail, first.detail
        assert wait_job(gw, reply.job.job_id).state == pb.JOB_STATE_SUCCEEDED
    finally:
        for f in fillers:
            gw.Release(gateway_pb2.ReleaseRequest(task_id=f.task_id), timeout=30)


def test_a_cpu_stage_after_a_gpu_stage_runs_in_the_jobs_gpu_room(stack):
    """The GPU room holds only GPU hosts, whose idle cards keep all their CPU from CPU-only tasks (--gpu-reserve);
    a job's stages are pinned to its DC, so its CPU stage takes that CPU instead of waiting for ever."""
    gw = stub(stack)
    train = stage("train", 2, 5.0)
    train.resources.gpu_count, train.resources.gpu_core_percent, train.resources.gpu_memory_mib = 1, 50, 4096
    spec = pb.JobSpec(name="mixed", stages=[train, stage("report", 1, 5.0, ("train",))], gpu_models=["T4"])
    reply = gw.SubmitJob(gateway_pb2.SubmitJobRequest(job=spec), timeout=30)
    assert reply.job.datacenter == "gpu"
    job = wait_job(gw, reply.job.job_id)
    assert job.state == pb.JOB_STATE_SUCCEEDED, job.reason
    check_dependency_order(job, tasks_by_stage(gw, job))
    # a plain CPU task gets no such pass, and a Submit cannot pose as a job's task
    with pytest.raises(grpc.RpcError) as info:
        gw.Submit(gateway_pb2.SubmitRequest(task=pb.TaskSpec(
            resources=pb.Resources(cpu_milli=1000, memory_mib=1024), runtime_s=1.0, job_id=job.job_id, stage="report")),
            timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("task.job_id:"), info.value.details()


@pytest.mark.parametrize("spec, field", [
    # either stage of the cycle is a right answer
    (pb.JobSpec(stages=[stage("a", 1, 1, ("b",)), stage("b", 1, 1, ("a",))]),
     ("job.stages[0].parents", "job.stages[1].parents")),
    (pb.JobSpec(stages=[stage("a", 1, 1, ("zz",))]), "job.stages[0].parents[0]"),
    (pb.JobSpec(stages=[stage("a", 1, 1), stage("a", 1, 1)]), "job.stages[1].name"),
    (pb.JobSpec(stages=[stage("a", 0, 1)]), "job.stages[0].tasks"),
    (pb.JobSpec(stages=[stage(f"s{i}", 1, 1) for i in range(300)]), "job.stages"),
    (pb.JobSpec(), "job.stages"),
])
def test_invalid_dags_get_invalid_argument_naming_the_field(stack, spec, field):
    with pytest.raises(grpc.RpcError) as info:
        stub(stack).SubmitJob(gateway_pb2.SubmitJobRequest(job=spec), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    fields = field if isinstance(field, tuple) else (field,)
    assert info.value.details().partition(":")[0] in fields, info.value.details()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dags())
def test_random_malformed_dags_are_refused_with_a_named_field_never_a_traceback(stack, spec):
    if oracle_valid(spec):
        return  # a valid one would be run; the property is about the malformed ones
    with pytest.raises(grpc.RpcError) as info:
        stub(stack).SubmitJob(gateway_pb2.SubmitJobRequest(job=spec), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert info.value.details().startswith("job.") and "Traceback" not in info.value.details()


def test_a_gateway_killed_mid_job_restarts_and_the_job_succeeds_with_no_stage_run_twice(stack, redis_url):
    gw = stub(stack)
    spec = pb.JobSpec(name="chain", stages=[stage("one", 2, 20.0), stage("two", 2, 20.0, ("one",)),
                                            stage("three", 2, 20.0, ("two",)), stage("four", 1, 10.0, ("three",))])
    job_id = gw.SubmitJob(gateway_pb2.SubmitJobRequest(job=spec), timeout=30).job.job_id
    deadline = time.monotonic() + 60
    while gw.GetJob(gateway_pb2.GetJobRequest(job_id=job_id), timeout=10).stages[1].running == 0:
        assert time.monotonic() < deadline, "stage two never started"
        time.sleep(0.05)
    stack.kill("gateway")
    time.sleep(1.5)  # stage two finishes while no gateway is up: the restarted one reads it from the ledger
    stack.restart("gateway")
    gw = stub(stack)
    job = wait_job(gw, job_id)
    assert job.state == pb.JOB_STATE_SUCCEEDED, job.reason
    check_dependency_order(job, tasks_by_stage(gw, job))
    import redis as redis_sync
    r = redis_sync.Redis.from_url(redis_url)
    allocs = Counter(e["task"] for _, f in r.xrange(Keys(stack.config.prefix).ledger(job.datacenter))
                     if (e := json.loads(f[b"e"]))["t"] == "alloc" and e["task"].startswith(job_id))
    runs = Counter(e["task"] for _, f in r.xrange(Keys(stack.config.prefix).ledger(job.datacenter))
                   if (e := json.loads(f[b"e"]))["t"] == "run" and e["task"].startswith(job_id))
    assert sorted(allocs) == sorted(t for s in job.stages for t in s.task_ids) and set(allocs.values()) == {1}
    assert set(runs.values()) == {1} and len(runs) == 7


# -- tenants (the issue-14 rules, as for tasks) -----------------------------------------------------------------


@pytest.fixture(scope="module")
def auth_stack(redis_url):
    from hsched.security import tokens as tk
    prefix = f"test-jobs-auth-{int(time.time() * 1000)}"
    config = StackConfig(fleet_path=SMALL_FLEET, redis_url=redis_url, prefix=prefix, gateway_port=0,
                         thermal=False, log_level="INFO", time_factor=TIME_FACTOR, auth=True)
    with Stack(config) as s:
        s.tokens = {"admin": s.admin_token_file.read_text().strip(),
                    "alice": tk.create_token(s.tokens_file, "alice", name="alice")[0],
                    "bob": tk.create_token(s.tokens_file, "bob", name="bob")[0]}
        yield s
    delete_prefix(redis_url, prefix)


def as_(stack, who: str):
    gw = stub(stack)
    md = (("authorization", f"Bearer {stack.tokens[who]}"),)

    class Caller:
        def __getattr__(self, method):
            return lambda request, **kw: getattr(gw, method)(request, metadata=md, timeout=kw.pop("timeout", 20), **kw)
    return Caller()


def not_found(call) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    return info.value.details()


def test_a_tenant_sees_only_its_own_jobs_and_its_request_ids_are_its_own(auth_stack):
    alice, bob, admin = as_(auth_stack, "alice"), as_(auth_stack, "bob"), as_(auth_stack, "admin")
    spec = pb.JobSpec(name="mine", tenant="bob", request_id="same-key", stages=[stage("only", 1, 10.0)])
    a = alice.SubmitJob(gateway_pb2.SubmitJobRequest(job=spec)).job
    assert a.spec.tenant == "alice"  # the forged tenant field is ignored
    b = bob.SubmitJob(gateway_pb2.SubmitJobRequest(job=spec))
    assert not b.duplicate and b.job.job_id != a.job_id and b.job.spec.tenant == "bob"
    again = alice.SubmitJob(gateway_pb2.SubmitJobRequest(job=spec))
    assert again.duplicate and again.job.job_id == a.job_id
    missing = not_found(lambda: bob.GetJob(gateway_pb2.GetJobRequest(job_id="j000000000000nothere")))
    hidden = not_found(lambda: bob.GetJob(gateway_pb2.GetJobRequest(job_id=a.job_id)))
    assert hidden == missing.replace("j000000000000nothere", a.job_id)  # the very answer of a job that is not there
    not_found(lambda: bob.CancelJob(gateway_pb2.CancelJobRequest(job_id=a.job_id)))
    not_found(lambda: next(iter(bob.Watch(gateway_pb2.WatchRequest(job_id=a.job_id, after_event_id="0")))))
    assert a.job_id not in [j.job_id for j in bob.ListJobs(gateway_pb2.ListJobsRequest(tenant="alice")).jobs]
    assert {a.job_id, b.job.job_id} <= {j.job_id for j in admin.ListJobs(gateway_pb2.ListJobsRequest()).jobs}
    done = wait_job(admin, a.job_id)
    assert done.state == pb.JOB_STATE_SUCCEEDED
    not_found(lambda: bob.Get(gateway_pb2.GetRequest(task_id=done.stages[0].task_ids[0])))
    assert alice.Get(gateway_pb2.GetRequest(task_id=done.stages[0].task_ids[0])).spec.tenant == "alice"


def test_the_tpch_replay_runs_dag_jobs_to_completion_and_summarises(stack, redis_url, monkeypatch, capsys):
    from hsched import cli

    monkeypatch.setenv("REDIS_URL", redis_url)
    code = cli.main(["replay", "tpch", "--gateway", stack.gateway, "--prefix", stack.config.prefix, "--limit", "3",
                     "--tpch-interval-s", "5", "--tpch-max-tasks", "4", "--time-factor", str(TIME_FACTOR)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "replaying 3 TPC-H DAG jobs" in out and "TPC-H DAG replay" in out
    assert_every_job_succeeded(out, 3)


def test_the_tpch_replay_rides_out_a_gateway_restart(stack, redis_url, monkeypatch, capsys):
    """The DAG replay retries SubmitJob and its ListJobs/List reads through UNAVAILABLE as the task replay does:
    a gateway killed mid-replay used to end it with a traceback from ListJobs (or with SubmitJob errors after
    5 tries in 7.5 s)."""
    import threading

    from hsched import cli

    monkeypatch.setenv("REDIS_URL", redis_url)
    result: dict = {}
    replaying = threading.Thread(target=lambda: result.update(code=cli.main([
        "replay", "tpch", "--gateway", stack.gateway, "--prefix", stack.config.prefix, "--limit", "3", "--seed", "1",
        "--tpch-interval-s", "5", "--tpch-max-tasks", "4", "--time-factor", str(TIME_FACTOR)])))
    replaying.start()
    try:
        time.sleep(2.0)  # the first job is submitted and polled
        stack.kill("gateway")
        time.sleep(3.0)  # the second job's SubmitJob and the polls meet no gateway
    finally:
        stack.restart("gateway")
    replaying.join(300)
    out = capsys.readouterr().out
    assert result.get("code") == 0, out
    assert re.search(r"\d+ calls retried after UNAVAILABLE/DEADLINE_EXCEEDED", out), out
    assert_every_job_succeeded(out, 3)


def replay_summary(out: str) -> list[str]:
    """The cells of a DAG replay's summary row (`hsched replay tpch|alibaba2018`): jobs, succeeded, failed,
    unfinished, avg JCT, p95 JCT, avg critical path, ..."""
    row = [line for line in out.splitlines() if line.startswith("│")][-1].strip("│ ").split("│")
    return [c.strip() for c in row]


def assert_every_job_succeeded(out: str, jobs: int) -> None:
    jobs_, succeeded, failed, unfinished, avg_jct, p95_jct, bound = replay_summary(out)[:7]
    assert (jobs_, succeeded, failed, unfinished) == (str(jobs), str(jobs), "0", "0")
    assert float(avg_jct) >= float(bound) > 0  # a critical path is a lower bound of the JCT
    assert float(p95_jct) >= float(avg_jct)


# -- failures (the placers' executor fails every task: --fail-probability 1) -------------------------------------


@pytest.fixture(scope="module")
def failing_stack(redis_url):
    prefix = f"test-jobs-fail-{int(time.time() * 1000)}"
    config = StackConfig(fleet_path=SMALL_FLEET, redis_url=redis_url, prefix=prefix, gateway_port=0,
                         thermal=False, log_level="INFO", time_factor=TIME_FACTOR,
                         extra_env={"HSCHED_FAIL_PROBABILITY": "1"})
    with Stack(config) as s:
        yield s
    delete_prefix(redis_url, prefix)


def test_a_failed_task_fails_the_job_its_other_tasks_are_released_and_no_child_stage_starts(failing_stack):
    gw = stub(failing_stack)
    spec = pb.JobSpec(name="doomed", stages=[stage("first", 3, 10.0), stage("second", 2, 10.0, ("first",))])
    job = wait_job(gw, gw.SubmitJob(gateway_pb2.SubmitJobRequest(job=spec), timeout=30).job.job_id)
    assert job.state == pb.JOB_STATE_FAILED and "of stage first failed" in job.reason, job.reason
    assert not job.stages[1].task_ids  # never submitted
    deadline = time.monotonic() + 30
    while True:  # the failed one stays FAILED; each other one failed too or was released: none holds anything
        states = {gw.Get(gateway_pb2.GetRequest(task_id=t), timeout=10).state for t in job.stages[0].task_ids}
        if states <= {pb.TASK_STATE_FAILED, pb.TASK_STATE_RELEASED}:
            break
        assert time.monotonic() < deadline, states
        time.sleep(0.1)
    assert pb.TASK_STATE_FAILED in states
    final = gw.GetJob(gateway_pb2.GetJobRequest(job_id=job.job_id), timeout=10).stages
    # the released ones are cancelled, not failed; the stage that never ran is not pending for ever
    assert final[0].failed >= 1 and final[0].failed + final[0].cancelled == 3
    assert final[0].pending == final[0].running == 0
    assert (final[1].pending, final[1].cancelled) == (0, 2)


def test_the_tpch_replay_exits_non_zero_when_jobs_fail(failing_stack, redis_url, monkeypatch, capsys):
    from hsched import cli

    monkeypatch.setenv("REDIS_URL", redis_url)
    code = cli.main(["replay", "tpch", "--gateway", failing_stack.gateway, "--prefix", failing_stack.config.prefix,
                     "--limit", "2", "--tpch-interval-s", "5", "--tpch-max-tasks", "2",
                     "--time-factor", str(TIME_FACTOR)])
    out = capsys.readouterr().out
    assert code == 1, out
    assert replay_summary(out)[:4] == ["2", "0", "2", "0"]


def test_cancel_answers_while_the_jobs_placer_is_down_and_the_releases_follow_when_it_is_back(stack):
    """CancelJob waited for the job's releases without a bound: with its placer away, every cancel (and retry)
    failed DEADLINE_EXCEEDED although the job was CANCELLED. The cancel is answered once recorded; the
    releases reach the placer when it serves again."""
    gw = stub(stack)
    spec = pb.JobSpec(name="long", stages=[stage("hold", 2, 3600.0)])
    job = gw.SubmitJob(gateway_pb2.SubmitJobRequest(job=spec), timeout=30).job
    deadline = time.monotonic() + 60
    while gw.GetJob(gateway_pb2.GetJobRequest(job_id=job.job_id), timeout=10).stages[0].running < 2:
        assert time.monotonic() < deadline, "the job's tasks never started"
        time.sleep(0.05)
    stack.stop_service(f"placer-{job.datacenter}")
    try:
        cancelled = gw.CancelJob(gateway_pb2.CancelJobRequest(job_id=job.job_id), timeout=25)
        assert cancelled.state == pb.JOB_STATE_CANCELLED
    finally:
        stack.restart(f"placer-{job.datacenter}")
    task_ids = [t for s in cancelled.stages for t in s.task_ids]
    deadline = time.monotonic() + 60
    while {gw.Get(gateway_pb2.GetRequest(task_id=t), timeout=10).state for t in task_ids} \
            != {pb.TASK_STATE_RELEASED}:
        assert time.monotonic() < deadline, "the cancelled job's tasks were never released"
        time.sleep(0.1)


def test_cli_submit_f_job_get_list_cancel(stack, tmp_path, capsys):
    from hsched import cli
    from tests.test_jobs import EXAMPLE

    gw = ["--gateway", stack.gateway]
    assert cli.main(["submit", "-f", str(EXAMPLE), *gw]) == 0
    line = capsys.readouterr().out.strip()
    job_id, state = line.split()[:2]
    assert job_id.startswith("j") and state == "PENDING", line
    assert cli.main(["submit", "-f", str(EXAMPLE), *gw]) == 0  # its request_id: the first answer again
    again = capsys.readouterr().out.strip()
    assert again.startswith(job_id) and again.endswith("(duplicate)"), again
    assert cli.main(["job", "get", job_id, *gw]) == 0
    assert "extract:" in capsys.readouterr().out
    assert cli.main(["list", "--job", job_id, "-o", "json", *gw]) == 0  # its tasks, once submitted, and no other
    listed = json.loads(capsys.readouterr().out)["tasks"]
    assert all(t["task_id"].startswith(f"{job_id}.") for t in listed), listed
    assert cli.main(["get", job_id, *gw]) == 2
    assert f"is a job id: hsched job get {job_id}" in capsys.readouterr().err
    assert cli.main(["job", "list", *gw]) == 0
    assert job_id in capsys.readouterr().out
    assert cli.main(["job", "cancel", job_id, *gw]) == 0
    assert capsys.readouterr().out.split()[1] in ("CANCELLED", "SUCCEEDED")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nstages:\n  - {name: a, tasks: 1, runtime_s: 1, resources: {cpu_milli: 1000}, "
                   "parents: [b]}\n  - {name: b, tasks: 1, runtime_s: 1, resources: {cpu_milli: 1000}, parents: [a]}\n")
    assert cli.main(["submit", "-f", str(bad), *gw]) == 2  # the cycle is refused before the job is sent
    assert f"{bad}: job.stages[" in capsys.readouterr().err
    bad.write_text("name: [\n")
    assert cli.main(["submit", "-f", str(bad), *gw]) == 2
    assert str(bad) in capsys.readouterr().err
