"""The placer's --dag-policy (hsched.policies.dagqueue): which DAG job's stage the deferred queue serves first,
in-process on a real Redis ledger (tests/test_preemption.py's engine), and the observation/mask it builds.

- sjf-cp: of two jobs waiting in the same band, the one with less remaining work and the shorter critical path is
  started first, even though it arrived last; fifo (the default) keeps arrival order;
- the band never crosses a class, tenant or priority: an online task, or another tenant below its share, still
  goes first;
- ba3c (the shipped model): for random queues the chosen stage is always one whose task fits (the mask), and
  what the engine places from the queue is always a placement the planner made.
"""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hsched.cli import build_parser
from hsched.domain.cluster import ClusterState
from hsched.domain.errors import ValidationError
from hsched.domain.fleet import parse_fleet
from hsched.domain.resources import MILLI, Resources
from hsched.domain.task import TaskSpec, task_from_dict, task_to_dict
from hsched.engine.placer import PlacerEngine
from hsched.envs.dag import CF, NF
from hsched.jobs import stage_queue_hints
from hsched.policies.dagqueue import (
    DAG_POLICIES,
    QueuedStage,
    choose_stage,
    dag_observation,
    job_of_task,
    load_dag_queue_policy,
)
from hsched.policies.heuristics import make_policy
from hsched.state.keys import Keys
from hsched.state.redis import connect
from hsched.v1 import common_pb2 as pb
from tests.test_engine import SMALL_FLEET, cheap, running

GIB = 1024


@pytest.fixture
async def redis(redis_url):
    client = connect(redis_url)
    yield client
    await client.aclose()


def engine(redis, prefix: str, dag_policy: str) -> PlacerEngine:
    return PlacerEngine(cheap(), redis, Keys(prefix), make_policy("firstfit"), "p1",
                        dag_policy=load_dag_queue_policy(dag_policy))


def dag_task(job: str, stage: str, path_s: float, work_s: float, cores: float = 24, tenant: str = "team-a",
             cls: str = "", priority: int = 0) -> TaskSpec:
    return TaskSpec(Resources(round(cores * MILLI), 2 * GIB), runtime_s=10.0, tenant=tenant, priority_class=cls,
                    priority=priority, job_id=job, stage=stage, stage_path_s=path_s, job_work_s=work_s)


async def fill_and_queue(e: PlacerEngine, queued: list[tuple[str, TaskSpec]]) -> None:
    for i in range(4):  # the whole DC held by team-x's online tasks (never evicted)
        assert (await e.place(f"x{i}", TaskSpec(Resources(24 * MILLI, 2 * GIB), 10.0, tenant="team-x",
                                                priority_class="online"))
                ).outcome == "placed"
    for name, t in queued:
        assert (await e.place(name, t)).outcome == "deferred"


@pytest.mark.parametrize(("policy", "first"), [("sjf-cp", "short.s0.0"), ("tetris", "short.s0.0"),
                                               ("fifo", "long.s0.0")])
async def test_sjf_cp_starts_the_job_with_the_shorter_remaining_critical_path_first(redis, prefix, policy, first):
    p = f"{prefix}:{policy}"
    async with running(engine(redis, p, policy)) as e:
        # "long" arrives first: 3 stages left (critical path 300 s, work 900 s); "short": one stage (10 s, 10 s)
        await fill_and_queue(e, [("long.s0.0", dag_task("long", "s0", 300, 900)),
                                 ("short.s0.0", dag_task("short", "s0", 10, 10))])
        placed = [t for t, _ in (await e.release("x0")).placed_from_queue]
        assert placed == [first]
        assert e.dag_decisions == (0 if policy == "fifo" else 1)


async def test_a_restarted_placer_orders_its_queue_the_same(redis, prefix):
    async with running(engine(redis, prefix, "sjf-cp")) as e:
        await fill_and_queue(e, [("long.s0.0", dag_task("long", "s0", 300, 900)),
                                 ("short.s0.0", dag_task("short", "s0", 10, 10))])
    async with running(engine(redis, prefix, "sjf-cp")) as e:  # the hints come back from the ledger's defers
        assert e.queue["short.s0.0"] == dag_task("short", "s0", 10, 10)
        assert [t for t, _ in (await e.release("x0")).placed_from_queue] == ["short.s0.0"]


async def test_the_dag_policy_stays_inside_the_class_and_tenant_band(redis, prefix):
    async with running(engine(redis, prefix, "sjf-cp")) as e:
        # the short job would win sjf-cp, but its tasks have a lower priority; the online task goes first anyway
        await fill_and_queue(e, [("online1", dag_task("on", "s0", 500, 500, cls="online")),
                                 ("long.s0.0", dag_task("long", "s0", 300, 900)),
                                 ("short.s0.0", dag_task("short", "s0", 10, 10, priority=-1))])
        order = []
        for i in range(3):
            order += [t for t, _ in (await e.release(f"x{i}")).placed_from_queue]
        # online first whatever its path; then priority 0 before -1 (the DAG policy never crosses priorities)
        assert order == ["online1", "long.s0.0", "short.s0.0"]
        assert e.dag_decisions == 0


def test_the_dag_fields_survive_the_ledger_dict_and_are_validated():
    t = dag_task("j1", "s0", 12.5, 40.0)
    assert task_from_dict(task_to_dict(t)) == t
    plain = TaskSpec(Resources(MILLI, GIB), 1.0)
    assert "job" not in task_to_dict(plain) and task_from_dict(task_to_dict(plain)) == plain
    with pytest.raises(ValidationError, match="stage_path_s"):
        TaskSpec(Resources(MILLI, GIB), 1.0, stage_path_s=float("nan")).validate()
    with pytest.raises(ValidationError, match="--dag-policy"):
        load_dag_queue_policy("decima")
    # `hsched up --dag-policy` offers what the placer accepts (the CLI spells them out: no gymnasium at start-up)
    up = next(a for a in build_parser()._subparsers._group_actions[0].choices["up"]._actions
              if a.dest == "dag_policy")
    assert tuple(up.choices) == DAG_POLICIES


def test_stage_queue_hints_are_the_critical_path_below_and_the_work_not_upstream():
    # a -> b -> d, a -> c -> d; runtimes a 1, b 5, c 2, d 3; tasks 2 each
    stages = [pb.StageSpec(name="a", tasks=2, runtime_s=1), pb.StageSpec(name="b", tasks=2, runtime_s=5, parents=["a"]),
              pb.StageSpec(name="c", tasks=2, runtime_s=2, parents=["a"]),
              pb.StageSpec(name="d", tasks=2, runtime_s=3, parents=["b", "c"])]
    spec = pb.JobSpec(name="j", stages=stages)
    assert stage_queue_hints(spec, "a") == (9.0, 22.0)
    assert stage_queue_hints(spec, "b") == (8.0, 20.0)  # b, c, d left (c may have progressed: an upper bound)
    assert stage_queue_hints(spec, "d") == (3.0, 6.0)
    assert job_of_task("abc123.s0.7") == ("abc123", "s0") and job_of_task("plain-task") is None


def test_copies_within_counts_the_free_resources_and_cards_by_hand():
    room = ClusterState(cheap())  # 4 nodes of 24 cores, 96 GiB
    five = Resources(5 * MILLI, 2 * GIB)
    assert room.copies_within(room.free_totals(), five) == 96 // 5  # CPU binds: 19 (memory holds 192)
    room.free_cpu[:] = [24 * MILLI, 3 * MILLI, 0, 10 * MILLI]
    # 37 free cores hold 7 five-core tasks: an upper bound (one node at a time they are 4 + 2 = 6)
    assert room.copies_within(room.free_totals(), five) == 7
    gpus = ClusterState(parse_fleet(yaml.safe_load(SMALL_FLEET.read_text())).datacenter("gpu"))  # 4 × 2 T4 16 GiB
    half = Resources(2 * MILLI, 4 * GIB, 0, 0, 1, 50, 8 * GIB)
    assert gpus.copies_within(gpus.free_totals(), half) == 8  # one per card (a card holding two counts once)
    gpus.gpu_free_core[0, :] = 40  # host 0's cards are too busy for a 50 % slice
    assert gpus.copies_within(gpus.free_totals(), half) == 6
    assert gpus.copies_within(gpus.free_totals(), Resources(2 * MILLI, 4 * GIB, 0, 0, 2, 50, 8 * GIB)) == 3


def test_free_executors_are_the_most_tasks_of_one_fitting_stage_that_fit_now():
    stages = [QueuedStage("a", "s0", 5, 1.0, 1.0, 5.0, 0, 0.0, True, 3),    # 5 queued, 3 fit: 3
              QueuedStage("b", "s0", 2, 1.0, 1.0, 2.0, 1, 0.0, True, 10),   # 2 queued, 10 would fit: 2
              QueuedStage("c", "s0", 50, 1.0, 1.0, 50.0, 2, 0.0, False, 0)]  # does not fit: not counted
    obs, mask = dag_observation(stages, {"a": 1}, 4)
    assert obs["cluster"][CF["free_executors"]] == 3 and obs["cluster"][CF["executors"]] == 3 + 4
    assert mask.tolist() == [True, True, False]


stage_st = st.builds(lambda job, stage, queued, rt, path, work, arrival, fits, fit_now: QueuedStage(
    f"j{job}", f"s{stage}", queued, rt, path, work, arrival, 0.0, fits, fit_now if fits else 0),
    st.integers(0, 5), st.integers(0, 6), st.integers(1, 20), st.floats(0.1, 100), st.floats(0.1, 1000),
    st.floats(0, 5000), st.integers(0, 1000), st.booleans(), st.integers(1, 40))


@pytest.fixture(scope="module", params=["ba3c", "sjf-cp", "tetris"])
def queue_policy(request):
    return load_dag_queue_policy(request.param)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(stage_st, min_size=1, max_size=24, unique_by=lambda s: (s.job_id, s.stage)),
       st.integers(0, 40))
def test_every_policy_chooses_only_stages_that_fit(queue_policy, stages, dc_running):
    running = {s.job_id: dc_running for s in stages}
    chosen = choose_stage(queue_policy, stages, running, dc_running)
    if not any(s.fits for s in stages):
        assert chosen is None
        return
    assert chosen is not None and chosen.fits
    # the policy itself answers inside the mask (no fallback needed)
    obs, mask = dag_observation(stages, running, dc_running)
    flat, _ = queue_policy.choose(obs, mask)
    assert mask[flat]
    assert np.array_equal(obs["stages"][..., NF["schedulable"]].reshape(-1) > 0, mask)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2), st.sampled_from([6, 12, 24]),
                          st.floats(1, 500)), min_size=2, max_size=8))
async def test_ba3c_in_the_engine_places_only_what_the_planner_places(redis, prefix, queue):
    import uuid

    p = f"{prefix}:{uuid.uuid4().hex[:6]}"
    async with running(engine(redis, p, "ba3c")) as e:
        await fill_and_queue(e, [(f"j{j}.s{s}.{i}", dag_task(f"j{j}", f"s{s}", path, path * 3, cores))
                                 for i, (j, s, cores, path) in enumerate(queue)])
        placed = []
        for i in range(4):
            placed += [t for t, _ in (await e.release(f"x{i}")).placed_from_queue]
        # nothing placed that the planner would refuse: no node over its capacity, each task placed once
        assert (e.state.free_cpu >= 0).all()
        assert len(placed) == len(set(placed)) and set(e.queue).isdisjoint(e.state.allocations)
        # work-conserving as fifo: a task waits only if it fits nowhere now
        for spec in e.queue.values():
            assert spec.resources.cpu_milli > int(e.state.free_cpu.max())
