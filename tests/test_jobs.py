"""DAG jobs (hsched.jobs): validation names the field and the rule, job files, the choice of the job's DC, and
the job state machine as a fold of the task stream — driven through a real gateway servicer, selector and
placers on a real Redis. Task completions are recorded here the way the gateway's ledger follower records
them (a `succeeded` record on the task stream, then the transition callback)."""

from __future__ import annotations

import asyncio
import graphlib
import itertools
import json
import re
from collections import Counter
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from hsched.convert import task_from_pb
from hsched.domain.errors import ValidationError
from hsched.domain.fleet import load_fleet
from hsched.domain.limits import STAGE_MAX_TASKS
from hsched.domain.task import MAX_RUNTIME_S
from hsched.engine.selector import DcSelector
from hsched.jobs import (
    ShapeRequest,
    choose_datacenter,
    decide,
    selection_requests,
    stage_statuses,
    task_id_of,
    validate_job,
)
from hsched.rpc import Unavailable
from hsched.state.keys import Keys
from hsched.state.redis import NotReplicated, ReplicaSet, connect
from hsched.state.tasks import TaskStore, now_ms, step
from hsched.taskfile import load_submit_file
from hsched.v1 import common_pb2 as pb
from hsched.v1 import placer_pb2_grpc, selector_pb2, selector_pb2_grpc
from services.gateway.server import GatewayServicer
from tests.conftest import ROOT, SMALL_FLEET
from tests.test_gateway_failures import backends

EXAMPLE = ROOT / "examples" / "job.yaml"


def stage(name: str, tasks: int = 1, parents: tuple[str, ...] = (), cores: int = 1, runtime_s: float = 10.0
          ) -> pb.StageSpec:
    return pb.StageSpec(name=name, tasks=tasks, parents=list(parents), runtime_s=runtime_s,
                        resources=pb.Resources(cpu_milli=cores * 1000, memory_mib=1024))


def job(*stages: pb.StageSpec, **fields) -> pb.JobSpec:
    return pb.JobSpec(name="j", stages=list(stages), **fields)


def field_of(spec: pb.JobSpec) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        validate_job(spec)
    return info.value


# -- validation ----------------------------------------------------------------------------------------------


def test_a_valid_dag_passes_and_the_example_file_is_one():
    validate_job(job(stage("a", 3), stage("b", 2, ("a",)), stage("c", 1, ("a", "b"))))
    example = load_submit_file(EXAMPLE).job
    validate_job(example)
    assert [s.name for s in example.stages] == ["extract", "transform", "report"]


def test_each_rule_names_its_field():
    assert field_of(job()).field == "job.stages"
    assert field_of(job(stage("a", 0))).field == "job.stages[0].tasks"
    assert field_of(job(stage("a", STAGE_MAX_TASKS + 1))).field == "job.stages[0].tasks"
    assert field_of(job(stage("a"), stage("a"))).field == "job.stages[1].name"
    assert field_of(job(stage("A.b"))).field == "job.stages[0].name"
    assert field_of(job(stage("a", parents=("x",)))).field == "job.stages[0].parents[0]"
    assert field_of(job(stage("a", parents=("a",)))).field == "job.stages[0].parents[0]"
    assert field_of(job(stage("a"), stage("b", parents=("a", "a")))).field == "job.stages[1].parents[1]"
    assert field_of(job(stage("a", runtime_s=0))).field == "job.stages[0].runtime_s"  # a task's 0 is not a stage's
    assert "must finish" in field_of(job(stage("a", runtime_s=0))).rule
    assert field_of(job(stage("a", runtime_s=-1))).field == "job.stages[0].runtime_s"
    assert field_of(job(stage("a", cores=0))).field.startswith("job.stages[0].resources")
    assert field_of(job(stage("a"), tenant="Not A Label")).field == "job.tenant"
    assert field_of(job(stage("a"), priority_class="batch")).field == "job.priority_class"
    assert field_of(job(*(stage(f"s{i}") for i in range(300)))).field == "job.stages"  # the deserializer's limit
    assert field_of(job(*(stage(f"s{i}", STAGE_MAX_TASKS) for i in range(11)))).field == "job.stages"


def test_a_cycle_is_named():
    err = field_of(job(stage("a", parents=("c",)), stage("b", parents=("a",)), stage("c", parents=("b",)),
                       stage("d", parents=("a",))))
    assert err.field.startswith("job.stages[") and err.field.endswith("].parents")
    cycle = err.rule.rpartition(": ")[2].split(" -> ")
    assert cycle[0] == cycle[-1] and set(cycle) == {"a", "b", "c"}, err.rule
    names = ["a", "b", "c", "d"]
    parents = {"a": {"c"}, "b": {"a"}, "c": {"b"}}
    for parent, child in itertools.pairwise(cycle):  # each named step is a real edge, parent first
        assert parent in parents[child], (parent, child)
    assert int(err.field.split("[")[1].split("]")[0]) in [names.index(n) for n in cycle]


def mostly(draw, good, bad):
    """A valid value 19 times in 20: most drawn jobs break at most one rule, so each rule gets tested alone."""
    return draw(st.sampled_from(bad)) if draw(st.integers(0, 19)) == 0 else draw(good)


@st.composite
def dags(draw):
    n = draw(st.integers(0, 6))
    names = [f"s{i}" for i in range(n)]
    stages = []
    for i in range(n):
        name = mostly(draw, st.just(names[i]), ["", "x.y", "B", "-a", "a" * 60, names[0]])
        earlier = draw(st.lists(st.sampled_from(names[:i]), unique=True, max_size=3)) if i else []
        # a broken parent list: unknown, itself, twice, or a later stage (which may close a cycle)
        parents = mostly(draw, st.just(earlier), [[*earlier, "zz"], [*earlier, names[i]], earlier * 2,
                                                  [*earlier, names[-1]], [*earlier, names[(i + 1) % n]]])
        stages.append(pb.StageSpec(
            name=name, tasks=mostly(draw, st.integers(1, 5), [0, STAGE_MAX_TASKS + 1]),
            runtime_s=mostly(draw, st.floats(0.5, 100), [0.0, -1.0, float("nan"), float("inf")]),
            resources=pb.Resources(cpu_milli=mostly(draw, st.integers(100, 4000), [0]), memory_mib=512),
            parents=parents))
    return pb.JobSpec(name="j", stages=stages)


def oracle_valid(spec: pb.JobSpec) -> bool:
    """An independent statement of the rules (graphlib for cycles)."""
    seen = [s.name for s in spec.stages]
    if not seen or len(set(seen)) != len(seen):
        return False
    for s in spec.stages:
        if not re.fullmatch(r"s[0-9]|a-1", s.name) or not 1 <= s.tasks <= STAGE_MAX_TASKS:
            return False
        if not 0 < s.runtime_s < float("inf") or s.resources.cpu_milli == 0 or len(set(s.parents)) != len(s.parents):
            return False
        if any(p not in seen or p == s.name for p in s.parents):
            return False
    try:
        graphlib.TopologicalSorter({s.name: set(s.parents) for s in spec.stages}).prepare()
    except graphlib.CycleError:
        return False
    return True


@settings(max_examples=400, deadline=None)
@given(dags())
def test_random_dags_are_accepted_exactly_when_valid_and_refused_with_a_named_field(spec):
    event(f"valid: {oracle_valid(spec)}")
    try:
        validate_job(spec)
    except ValidationError as exc:  # never any other exception
        assert exc.field.startswith("job.") and exc.rule, exc
        assert not oracle_valid(spec), f"refused a valid job: {exc}"
    else:
        assert oracle_valid(spec)


def test_bad_job_files_name_the_file_the_field_and_the_rule(tmp_path):
    bad = tmp_path / "bad.yaml"

    def refusal(text: str) -> ValidationError:
        bad.write_text(text)
        with pytest.raises(ValidationError) as info:
            load_submit_file(bad)
        assert str(info.value).startswith(f"{bad}: ")
        return info.value

    assert refusal("name: x\nstages:\n  - name: a\n    taks: 2\n").field == "job.stages[0].taks"
    # typed as a task file is: what protobuf's JSON parser took (a string, a float, hex) is refused
    for value in ('"4"', "1e1", "4.0", "true"):
        error = refusal(f"stages:\n  - name: a\n    tasks: {value}\n")
        assert error.field == "job.stages[0].tasks" and error.rule.startswith("must be an integer")
    assert refusal("stages:\n  - {name: a, tasks: 1, resources: {cpu_milli: 1000.0}}\n").field == \
        "job.stages[0].resources.cpu_milli"
    assert refusal("stages:\n  - {name: a, tasks: 1, runtime_s: '5'}\n").rule == "must be a number"
    assert refusal("stages: x\n").rule == "must be a list"
    assert refusal("stages: []\ngpu_models: T4\n").field == "job.gpu_models"
    assert refusal("stages:\n  - {name: a, parents: [3]}\n").field == "job.stages[0].parents[0]"
    # and checked by the gateway's rules before anything is sent, as a task file is
    assert refusal("stages:\n  - {name: a, tasks: 0, runtime_s: 1}\n").field == "job.stages[0].tasks"
    # the job's rule, not the wire type's (it said "must be in 0..4294967295" to -3)
    assert refusal("stages:\n  - {name: a, tasks: -3, runtime_s: 1}\n").rule == f"must be in 1..{STAGE_MAX_TASKS}"
    # a task is named <job>-<stage>: the job name's room is what the stage name leaves (it said "got 303")
    long = refusal(f"name: {'n' * 250}\nstages:\n  - {{name: stage, tasks: 1, runtime_s: 1}}\n")
    assert (long.field, long.rule) == ("job.name", "must be at most 247 characters with stage 'stage': its tasks "
                                       "are named <job name>-<stage name>, at most 253 (got 250)"), long
    assert refusal("stages:\n  - {name: a, tasks: 1, runtime_s: 1, resources: {cpu_milli: 1000, memory_mib: 64}, "
                   "parents: [b]}\n").field == "job.stages[0].parents[0]"
    example = load_submit_file(EXAMPLE).job  # what is refused above is not what a good file is read as
    assert example.stages[0].tasks == 4 and example.stages[0].resources.cpu_milli == 2000


def test_a_jobs_gpu_models_restrict_its_gpu_stages_only():
    from hsched.jobs import _stage_spec

    gpu = stage("train")
    gpu.resources.gpu_count, gpu.resources.gpu_core_percent, gpu.resources.gpu_memory_mib = 1, 100, 4096
    mixed = job(stage("prep"), gpu, stage("report", parents=("train",)))
    mixed.gpu_models.append("T4")
    validate_job(mixed)  # the CPU stages used to be refused: "gpu_models: only allowed when gpu_count > 0"
    assert [_stage_spec(mixed, s).gpu_models for s in mixed.stages] == [(), ("T4",), ()]
    assert [list(r.task.gpu_models) for r in selection_requests(mixed)] == [[], ["T4"]]  # prep+report, train
    cpu_only = job(stage("prep"))
    cpu_only.gpu_models.append("T4")
    assert field_of(cpu_only).field == "job.gpu_models"


def test_one_question_per_task_shape_carries_its_stages_task_seconds_and_the_data_moves_once():
    spec = job(stage("a", 4, cores=2, runtime_s=30), stage("b", 2, ("a",), cores=8, runtime_s=60),
               stage("c", 3, ("a",), cores=2, runtime_s=10), data_size_mb=500.0)
    requests = selection_requests(spec)
    assert [(r.stages, r.roots) for r in requests] == [(("a", "c"), True), (("b",), False)]
    first, second = (r.task for r in requests)
    assert (first.resources.cpu_milli, first.runtime_s) == (2000, 4 * 30 + 3 * 10)  # a and c: 150 task-seconds
    assert (second.resources.cpu_milli, second.runtime_s) == (8000, 2 * 60)
    assert (first.data_size_mb, second.data_size_mb) == (500.0, 0.0)  # eq.2 counted once
    assert {r.scale for r in requests} == {1.0}
    # beyond a task's runtime limit every request is divided by one factor, and the cost multiplied back
    huge = selection_requests(job(stage("a", 1000, runtime_s=MAX_RUNTIME_S / 250), data_size_mb=500.0))
    assert huge[0].scale == 4.0 and huge[0].task.runtime_s == MAX_RUNTIME_S and huge[0].task.data_size_mb == 125.0


def test_a_gpu_stage_then_a_wide_cpu_stage_is_feasible_where_each_fits():
    """The feasibility question used to be one made-up task of every stage's largest resources (2 GPUs and 100
    cores) that no node holds: a valid GPU-then-CPU pipeline was refused."""
    fleet = load_fleet(SMALL_FLEET)
    selector = DcSelector(fleet)
    for dc in fleet.datacenters:  # every placer heard from (what is free does not matter to the ranking)
        selector.update_summary({"datacenter": dc.name, "fencing_token": 1, "free": [0] * 7})
    train = pb.StageSpec(name="train", tasks=2, runtime_s=20, resources=pb.Resources(
        cpu_milli=1000, memory_mib=4096, gpu_count=2, gpu_core_percent=100, gpu_memory_mib=16384))
    agg = pb.StageSpec(name="agg", tasks=1, runtime_s=20, parents=["train"],
                       resources=pb.Resources(cpu_milli=30000, memory_mib=4096))
    spec = job(train, agg, gpu_models=["T4"])
    requests = selection_requests(spec)
    answers = []
    for r in requests:
        ranked, excluded, unserved = selector.select(task_from_pb(r.task))
        answers.append(selector_pb2.SelectResponse(
            candidates=[pb.DcCandidate(datacenter=c.datacenter, total_cost=c.total) for c in ranked],
            excluded=[pb.Exclusion(datacenter=d, reason=why, unavailable=d in unserved) for d, why in excluded]))
    dc, why = choose_datacenter(requests, answers)
    assert dc == "gpu", why


def test_the_cli_knows_a_job_id_from_a_task_id():
    from hsched.cli import _JOB_ID
    from hsched.jobs import new_job_id

    job_id = new_job_id()
    assert _JOB_ID.fullmatch(job_id) and not _JOB_ID.fullmatch(task_id_of(job_id, "a", 0))


def test_stage_counts_tell_cancelled_from_failed_and_nothing_stays_pending_once_the_job_ended():
    spec = job(stage("a", 4), stage("b", 2, ("a",)))
    j = pb.Job(job_id="j1", spec=spec, state=pb.JOB_STATE_RUNNING)
    tasks = {task_id_of("j1", "a", i): pb.Task(task_id=task_id_of("j1", "a", i), state=state) for i, state in
             enumerate((pb.TASK_STATE_SUCCEEDED, pb.TASK_STATE_FAILED, pb.TASK_STATE_RELEASED, pb.TASK_STATE_RUNNING))}
    counts = lambda: [(s.pending, s.running, s.succeeded, s.failed, s.cancelled) for s in stage_statuses(j, tasks)]  # noqa: E731
    assert counts() == [(0, 1, 1, 1, 1), (2, 0, 0, 0, 0)]
    j.state = pb.JOB_STATE_FAILED  # the running one is released next; b never starts
    tasks[task_id_of("j1", "a", 3)].state = pb.TASK_STATE_RELEASED
    assert counts() == [(0, 0, 1, 1, 2), (0, 0, 0, 0, 2)]


def answer(*candidates: str, excluded=(), full: dict[str, int] | None = None, step: float = 1.0
           ) -> selector_pb2.SelectResponse:
    """A selector's answer: `candidates` in rank order at costs 1, 1 + step, …, each with room now unless in `full`
    (DC: tasks queued)."""
    full = full or {}
    return selector_pb2.SelectResponse(
        candidates=[pb.DcCandidate(datacenter=d, total_cost=1.0 + i * step, room_now=d not in full,
                                   queued_tasks=full.get(d, 0)) for i, d in enumerate(candidates)],
        excluded=[pb.Exclusion(datacenter=d, reason=r, unavailable=u) for d, r, u in excluded])


def shapes(*roots: bool) -> list[ShapeRequest]:
    return [ShapeRequest((f"s{i}",), root, pb.TaskSpec()) for i, root in enumerate(roots)]


def test_a_job_goes_to_the_cheapest_dc_with_room_now_else_queues_at_the_cheapest():
    """As Karmada filters member clusters by an estimate of the free room: a job commits to one DC, so a full
    cheaper one would hold it while another sits idle. Costs add up over the shapes."""
    one = shapes(True)
    dc, why = choose_datacenter(one, [answer("cheap", "near", "gpu", full={"cheap": 3})])
    assert dc == "near", why
    assert why == ("near: cheapest of 3 data centers able to hold every stage's tasks with room for them now, at "
                   "a total job cost of 2.0000; cheaper but full now: cheap (3 tasks queued)")
    dc, why = choose_datacenter(one, [answer("cheap", "near", full={"cheap": 0, "near": 2})])
    assert dc == "cheap" and why.endswith("no data center has room for them now: its stages queue there"), why
    dc, why = choose_datacenter(one, [answer("cheap", "near", full={"near": 0})])
    assert (dc, why.count("full")) == ("cheap", 0), why  # the cheapest has room: cost alone decides
    # two shapes: near is 1 + 6 = 7, cheap 2 + 1 = 3, gpu holds only the first; a later stage's shape having no
    # room now does not matter, the first stages' does
    two = shapes(True, False)
    dc, why = choose_datacenter(two, [answer("near", "cheap", "gpu"), answer("cheap", "near", step=5.0,
                                                                             full={"cheap": 1})])
    assert dc == "cheap" and why.endswith("with room for them now, at a total job cost of 3.0000"), why
    dc, why = choose_datacenter(two, [answer("near", "cheap", full={"cheap": 1}), answer("cheap", "near", step=5.0)])
    assert dc == "near" and why.endswith("cost of 7.0000; cheaper but full now: cheap (1 tasks queued)"), why


def test_a_job_no_dc_can_hold_fails_naming_each_stage_and_one_only_an_unserved_dc_could_is_unavailable():
    too_big = ("near", "the task needs 40 cores in all, the DC has 24 cores", False)
    assert choose_datacenter(shapes(True), [answer("cheap")]) == (
        "cheap", "cheap: cheapest of 1 data centers able to hold every stage's tasks, at a total job cost of 1.0000")
    dc, why = choose_datacenter(shapes(True, False), [answer("near"), answer(excluded=[too_big])])
    assert dc == "" and why == ("no data center can hold this job: near: the task needs 40 cores in all, the DC has "
                                "24 cores (stage s1)"), why
    down = ("gpu", "its placer's last summary is 20 s old", True)
    with pytest.raises(Unavailable, match="gpu could hold it once its placer serves again"):
        choose_datacenter(shapes(True, False), [answer(excluded=[down]), answer(excluded=[too_big, down])])


# -- the fold and the orchestrator, on the real services ---------------------------------------------------------


@asynccontextmanager
async def servicer_on(redis_url: str, prefix: str, argv: list[str], placers: dict[str, str], **store_options):
    """A gateway servicer on the prefix's task stream (as serve() builds it: load, reconcile, recover)."""
    from hsched.domain.fleet import load_fleet
    redis = connect(redis_url)
    keys = Keys(prefix)
    store = TaskStore(redis, keys.tasks, **store_options)
    await store.load()
    selector = argv[argv.index("--selector") + 1]
    channels = [grpc.aio.insecure_channel(selector), *(grpc.aio.insecure_channel(t) for t in placers.values())]
    servicer = GatewayServicer(load_fleet(SMALL_FLEET), store, selector_pb2_grpc.SelectorStub(channels[0]),
                               {dc: placer_pb2_grpc.PlacerStub(ch) for dc, ch in zip(placers, channels[1:], strict=True)})
    await servicer.reconcile(redis, keys)
    servicer.jobs.recover()
    try:
        yield servicer
    finally:
        await servicer.jobs.close()
        await servicer.close()
        for ch in channels:
            await ch.close()
        await redis.aclose()


async def until(predicate, what: str, timeout_s: float = 30.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not (value := predicate()):
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)
    return value


async def stage_submitted(servicer: GatewayServicer, job_id: str, stage_name: str, tasks: int) -> list[str]:
    """The ids of a stage's `tasks` tasks, once the gateway has submitted them all."""
    ids = [task_id_of(job_id, stage_name, i) for i in range(tasks)]
    await until(lambda: all(i in servicer.store.tasks for i in ids), f"stage {stage_name}")
    return ids


async def finish(servicer: GatewayServicer, task_id: str, ok: bool = True) -> None:
    """Record a task finished as the gateway's ledger follower does (the transitions hub tells the jobs)."""
    task = servicer.store.copy(task_id)
    task.finished_unix_ms = now_ms()
    await servicer.store.write(step("succeeded" if ok else "failed", task))


DIAMOND = job(stage("extract", 3), stage("left", 2, ("extract",)), stage("right", 1, ("extract",)),
              stage("join", 1, ("left", "right")), request_id="diamond-1")


def submitted_stages(servicer, job_id: str) -> set[str]:
    return {t.spec.stage for t in servicer.store.tasks.values() if t.spec.job_id == job_id}


async def test_stages_are_submitted_only_after_their_parents_succeeded_and_the_job_succeeds(redis_url, prefix,
                                                                                            tmp_path):
    async with backends(redis_url, prefix, tmp_path) as (argv, placers), \
            servicer_on(redis_url, prefix, argv, placers) as gw:
        first, duplicate = await gw.jobs.submit(DIAMOND)
        assert not duplicate and first.state == pb.JOB_STATE_PENDING and first.datacenter
        again, duplicate = await gw.jobs.submit(DIAMOND)
        assert duplicate and again.job_id == first.job_id
        job_id = first.job_id
        parents = {s.name: set(s.parents) for s in DIAMOND.stages}
        done: set[str] = set()
        for wave in (["extract"], ["left", "right"], ["join"]):
            expected = {s for s in parents if parents[s] <= done}
            await until(lambda expected=expected: len([t for t in gw.store.tasks.values() if t.spec.job_id == job_id])
                        == sum(s.tasks for s in DIAMOND.stages if s.name in expected), f"stages {wave}")
            await asyncio.sleep(0.2)  # nothing more comes: no stage runs before its parents succeeded
            assert submitted_stages(gw, job_id) == expected
            for t in [t for t in gw.store.tasks.values() if t.spec.job_id == job_id and t.spec.stage in wave]:
                assert t.state == pb.TASK_STATE_PLACED and t.datacenter == first.datacenter
                assert t.task_id.startswith(f"{job_id}.{t.spec.stage}.")
                await finish(gw, t.task_id)
            done |= set(wave)
        final = await until(lambda: gw.store.jobs[job_id].state == pb.JOB_STATE_SUCCEEDED and gw.jobs.get(job_id),
                            "the job to succeed")
        assert [(s.name, s.succeeded) for s in final.stages] == [(s.name, s.tasks) for s in DIAMOND.stages]


async def test_a_wide_stage_goes_out_a_bounded_number_of_submits_at_a_time(redis_url, prefix, tmp_path):
    """A thousand Places sent at once passed their deadlines and were retried; the stage's tasks are submitted
    at most SUBMITS_IN_FLIGHT at a time, and every one of them exactly once."""
    async with backends(redis_url, prefix, tmp_path) as (argv, placers), \
            servicer_on(redis_url, prefix, argv, placers) as gw:
        gw.jobs.SUBMITS_IN_FLIGHT = 8
        submit, in_flight, most = gw.jobs.ports.submit_task, [0], [0]

        async def counted(*args):
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
            try:
                return await submit(*args)
            finally:
                in_flight[0] -= 1

        gw.jobs.ports.submit_task = counted
        first, _ = await gw.jobs.submit(job(stage("wide", 60)))
        ids = await stage_submitted(gw, first.job_id, "wide", 60)
        assert 1 < most[0] <= 8 and len(set(ids)) == 60


async def test_a_failed_task_fails_the_job_and_releases_its_other_tasks(redis_url, prefix, tmp_path):
    async with backends(redis_url, prefix, tmp_path) as (argv, placers), \
            servicer_on(redis_url, prefix, argv, placers) as gw:
        first, _ = await gw.jobs.submit(job(stage("a", 3), stage("b", 1, ("a",))))
        ids = await stage_submitted(gw, first.job_id, "a", 3)
        await finish(gw, ids[0], ok=False)
        await until(lambda: gw.store.jobs[first.job_id].state == pb.JOB_STATE_FAILED, "the job to fail")
        await until(lambda: all(gw.store.tasks[i].state == pb.TASK_STATE_RELEASED for i in ids[1:]), "releases")
        assert ids[0] in gw.store.jobs[first.job_id].reason
        assert submitted_stages(gw, first.job_id) == {"a"}


async def test_cancel_releases_the_jobs_tasks(redis_url, prefix, tmp_path):
    async with backends(redis_url, prefix, tmp_path) as (argv, placers), \
            servicer_on(redis_url, prefix, argv, placers) as gw:
        first, _ = await gw.jobs.submit(job(stage("a", 2), stage("b", 1, ("a",))))
        ids = await stage_submitted(gw, first.job_id, "a", 2)
        cancelled = await gw.jobs.cancel(first.job_id)
        assert cancelled.state == pb.JOB_STATE_CANCELLED
        await until(lambda: all(gw.store.tasks[i].state == pb.TASK_STATE_RELEASED for i in ids), "releases")
        assert (await gw.jobs.cancel(first.job_id)).state == pb.JOB_STATE_CANCELLED  # again: as it is


async def test_cancel_drops_the_queued_tasks_before_freeing_room_they_would_take(redis_url, prefix, tmp_path):
    """A stage of six 20-core tasks in a DC of four nodes: four placed, two queued. Cancelled, the queued two
    are dropped first: the room the others free is never allocated to a task of the cancelled job."""
    async with backends(redis_url, prefix, tmp_path) as (argv, placers), \
            servicer_on(redis_url, prefix, argv, placers) as gw:
        first, _ = await gw.jobs.submit(job(stage("wide", 6, cores=20, runtime_s=3600)))
        ids = await stage_submitted(gw, first.job_id, "wide", 6)
        queued_or_on = (pb.TASK_STATE_DEFERRED, pb.TASK_STATE_PLACED, pb.TASK_STATE_RUNNING)
        await until(lambda: [gw.store.tasks[i].state for i in ids].count(pb.TASK_STATE_DEFERRED) == 2
                    and all(gw.store.tasks[i].state in queued_or_on for i in ids), "four placed, two queued")
        queued = [i for i in ids if gw.store.tasks[i].state == pb.TASK_STATE_DEFERRED]
        await gw.jobs.cancel(first.job_id)
        await until(lambda: all(gw.store.tasks[i].state == pb.TASK_STATE_RELEASED for i in ids), "releases")
        client = connect(redis_url)
        try:
            events = [json.loads(f[b"e"]) for _, f in await client.xrange(Keys(prefix).ledger(first.datacenter))]
        finally:
            await client.aclose()
        assert [e["t"] for e in events if e["task"] in queued] == ["defer", "defer", "drop", "drop"]


async def test_a_restarted_gateway_rebuilds_the_job_and_continues_without_submitting_a_task_twice(
        redis_url, prefix, tmp_path):
    async with backends(redis_url, prefix, tmp_path) as (argv, placers):
        async with servicer_on(redis_url, prefix, argv, placers) as gw:
            first, _ = await gw.jobs.submit(DIAMOND)
            job_id = first.job_id
            ids = await stage_submitted(gw, job_id, "extract", 3)
            for i in ids[:2]:
                await finish(gw, i)
        # the gateway is gone; its last extract task finishes meanwhile (the next one's follower records it)
        async with servicer_on(redis_url, prefix, argv, placers) as gw:
            assert gw.store.jobs[job_id].spec.request_id == "diamond-1"
            again, duplicate = await gw.jobs.submit(DIAMOND)
            assert duplicate and again.job_id == job_id  # the idempotency key survived the restart
            await finish(gw, ids[2])
            for wave in (["left", "right"], ["join"]):
                await until(lambda wave=wave: {t.spec.stage for t in gw.store.tasks.values()
                                               if t.spec.job_id == job_id} >= set(wave), f"stages {wave}")
                for t in [t for t in gw.store.tasks.values() if t.spec.job_id == job_id and t.spec.stage in wave]:
                    await until(lambda t=t: gw.store.tasks[t.task_id].state in (pb.TASK_STATE_PLACED,
                                                                                  pb.TASK_STATE_RUNNING), "placed")
                    await finish(gw, t.task_id)
            await until(lambda: gw.store.jobs[job_id].state == pb.JOB_STATE_SUCCEEDED, "the job to succeed")
        redis = connect(redis_url)
        try:
            kinds = Counter(f[b"t"] and (f[b"k"].decode(), pb.Task.FromString(f[b"t"]).task_id)
                            for _, f in await redis.xrange(Keys(prefix).tasks) if not f[b"k"].startswith(b"job_"))
        finally:
            await redis.aclose()
        submitted = {tid: n for (k, tid), n in kinds.items() if k == "submitted"}
        assert len(submitted) == sum(s.tasks for s in DIAMOND.stages) and set(submitted.values()) == {1}


def test_example_path_exists():
    assert Path(EXAMPLE).exists()


async def test_retention_keeps_a_live_jobs_progress_and_forgets_finished_jobs_with_their_tasks(redis_url, prefix):
    """prune compacts the stream: a running job's finished tasks are its progress (forgetting them would run them
    again), so they stay, also across a reload; a finished job goes with its tasks once past retention."""
    from hsched.state.tasks import job_step, prune

    redis = connect(redis_url)
    try:
        store = TaskStore(redis, Keys(prefix).tasks)
        live = pb.Job(job_id="jlive", spec=job(stage("a", 1), stage("b", 1, ("a",))))
        done = pb.Job(job_id="jdone", spec=job(stage("a", 1)))
        await store.write(job_step("job_running", live), job_step("job_succeeded", done))
        for j in (live, done):
            t = pb.Task(task_id=task_id_of(j.job_id, "a", 0), spec=pb.TaskSpec(job_id=j.job_id, stage="a"))
            await store.write(step("succeeded", t))
        later = now_ms() + 10_000_000
        forgotten, _ = await prune(store, retention_ms=1000, margin_ms=0, now=later)
        assert forgotten == 1 and set(store.jobs) == {"jlive"}
        assert set(store.tasks) == {"jlive.a.0"}
        again = TaskStore(redis, Keys(prefix).tasks)
        await again.load()
        assert set(again.jobs) == {"jlive"} and set(again.tasks) == {"jlive.a.0"}
        assert [t for t, _ in decide(again.jobs["jlive"], again.tasks).submit] == ["jlive.b.0"]
    finally:
        await redis.aclose()


async def _job_records(redis, prefix: str, request_id: str) -> list[tuple[bytes, pb.Job]]:
    """The job records of `request_id` on the task stream, with their entry ids."""
    found = []
    for entry_id, fields in await redis.xrange(Keys(prefix).tasks):
        if fields[b"k"].startswith(b"job_") and (job := pb.Job.FromString(fields[b"t"])).spec.request_id == request_id:
            found.append((entry_id, job))
    return found


async def _retried(gw, spec: pb.JobSpec) -> tuple[pb.Job, bool]:
    """SubmitJob retried as a client does while it gets UNAVAILABLE."""
    for _ in range(200):
        try:
            return await gw.jobs.submit(spec)
        except Unavailable:
            await asyncio.sleep(0.1)
    pytest.fail("SubmitJob stayed UNAVAILABLE")


async def test_a_job_recorded_on_the_master_only_answers_retries_once_replicated_and_starts_or_is_forgotten(
        prefix, tmp_path):
    """A SubmitJob whose record reached the Redis master but not its replica got UNAVAILABLE; its retry used to
    be answered from the master's record (which a failover drops), or to make a second job. Now a retry gets the
    job only once the replica holds it, and the job starts then; if a failover lost it, the retry makes a fresh
    job and nothing of the lost one ever runs."""
    rs = ReplicaSet(1).start()
    replica = next(n for n in rs.nodes if n.port != rs.master().port)
    master = connect(rs.url)
    try:
        async with backends(rs.url, prefix, tmp_path) as (argv, placers), \
                servicer_on(rs.url, prefix, argv, placers, min_replicas=1, wait_timeout_ms=300) as gw:
            gw.jobs.claim_wait_s = 1.0
            doubt = job(stage("a", 2), stage("b", 1, ("a",)), request_id="doubt-1")
            replica.pause()
            with pytest.raises((Unavailable, NotReplicated)):  # both UNAVAILABLE at the gateway
                await gw.jobs.submit(doubt)
            with pytest.raises((Unavailable, NotReplicated)):  # a retry meanwhile: no answer, no second job
                await gw.jobs.submit(doubt)
            [(_, recorded)] = await _job_records(master, prefix, "doubt-1")
            assert not [t for t in gw.store.tasks.values() if t.spec.job_id == recorded.job_id]  # not started
            replica.resume()
            again, duplicate = await _retried(gw, doubt)
            assert duplicate and again.job_id == recorded.job_id
            await stage_submitted(gw, recorded.job_id, "a", 2)  # settled: the job runs

            lost = job(stage("a", 1), request_id="lost-1")
            replica.pause()
            with pytest.raises((Unavailable, NotReplicated)):
                await gw.jobs.submit(lost)
            [(entry_id, gone)] = await _job_records(master, prefix, "lost-1")
            await master.xdel(Keys(prefix).tasks, entry_id)  # what a failover to the lagging replica does to it
            replica.resume()
            fresh, duplicate = await _retried(gw, lost)
            assert not duplicate and fresh.job_id != gone.job_id
            await stage_submitted(gw, fresh.job_id, "a", 1)
            assert gone.job_id not in gw.store.jobs
            assert not [t for t in gw.store.tasks.values() if t.spec.job_id == gone.job_id]
            assert [j.job_id for _, j in await _job_records(master, prefix, "lost-1")] == [fresh.job_id]
    finally:
        replica.resume()
        await master.aclose()
        rs.stop()
