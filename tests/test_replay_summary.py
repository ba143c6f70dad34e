"""The task-trace replay's summary (`hsched replay openb`): per data center, the tasks by the final state the
gateway answers at the end — the lifecycle's running / succeeded / failed / expired next to placed / deferred /
released / rejected — and the preemptions they went through; the same rows in its JSON."""

from __future__ import annotations

import json

from hsched.replay import STATE_COLUMNS, ReplayStats, summary_document, summary_rows
from hsched.v1 import common_pb2 as pb


def task(task_id: str, dc: str, state: int, preemptions: int = 0) -> pb.Task:
    return pb.Task(task_id=task_id, datacenter=dc, state=state, preemptions=preemptions)


def test_rows_count_every_final_state_and_the_preemptions_per_data_center() -> None:
    final = [task("a", "cheap", pb.TASK_STATE_SUCCEEDED, 1), task("b", "cheap", pb.TASK_STATE_SUCCEEDED),
             task("c", "cheap", pb.TASK_STATE_RUNNING, 2), task("d", "cheap", pb.TASK_STATE_FAILED),
             task("e", "cheap", pb.TASK_STATE_PREEMPTED, 1),  # caught between its preemption and its requeue
             task("f", "gpu", pb.TASK_STATE_EXPIRED), task("g", "gpu", pb.TASK_STATE_DEFERRED),
             task("h", "gpu", pb.TASK_STATE_RELEASED), task("i", "gpu", pb.TASK_STATE_PLACED),
             task("j", "", pb.TASK_STATE_REJECTED)]
    stats = ReplayStats(submitted=10, final={t.task_id: t for t in final})
    rows = {r["datacenter"]: r for r in summary_rows(stats, {"cheap": {}, "gpu": {}})}
    counts = {dc: {k: r[k] for k in (*STATE_COLUMNS, "preempted")} for dc, r in rows.items()}
    zero = dict.fromkeys((*STATE_COLUMNS, "preempted"), 0)
    assert counts == {
        "cheap": {**zero, "succeeded": 2, "running": 1, "failed": 1, "deferred": 1, "preempted": 4},
        "gpu": {**zero, "expired": 1, "deferred": 1, "released": 1, "placed": 1},
        "-": {**zero, "rejected": 1},
    }
    doc = json.loads(json.dumps(summary_document("openb", stats, list(rows.values()))))
    assert doc["trace"] == "openb" and doc["submitted"] == 10
    assert [r["succeeded"] for r in doc["datacenters"]] == [2, 0, 0]


def test_json_is_refused_for_the_dag_job_replays_naming_the_flag(capsys) -> None:
    from hsched import cli

    assert cli.main(["replay", "tpch", "--json", "--gateway", "127.0.0.1:1"]) == 2
    assert "--json" in capsys.readouterr().err


async def test_the_dag_replays_utilisation_sample_is_skipped_while_redis_is_away():
    """A Redis restart or failover mid-replay ended `hsched up --replay tpch` (and stopped the stack) with a
    ConnectionError from this sample."""
    from hsched.job_replay import _utilisation
    from hsched.state.redis import connect, port_is_free

    port = next(p for p in range(47100, 47200) if port_is_free(p))
    redis = connect(f"redis://127.0.0.1:{port}/0")
    try:
        assert await _utilisation(redis, "nowhere", {"cheap", "near"}) == []
    finally:
        await redis.aclose()
