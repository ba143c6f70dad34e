"""bench/ghz_load.py drives a real gateway with the real ghz, by reflection, and counts the Submits' outcomes
by task state (ghz itself calls every OK reply a success). Skipped where ghz is not installed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` is not an installed package

from bench import ghz_load
from tests.conftest import SMALL_FLEET, small_fleet_stack


@pytest.mark.skipif(ghz_load.find_ghz(None) is None, reason="ghz is not installed")
def test_a_short_ghz_load_counts_outcomes_by_task_state_and_releases_its_tasks(redis_url, capsys):
    with small_fleet_stack(redis_url, "ghz") as stack:
        assert ghz_load.main(["--gateway", stack.gateway, "--fleet", SMALL_FLEET, "-n", "60", "-c", "4",
                              "--mix", "20", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        phases = {r["phase"]: r for r in report["phases"]}
        assert phases["Submit"]["calls"] == phases["Submit"]["ok"] == 60
        # a request id per call: 60 tasks, each counted once by its state (ghz says only "OK")
        assert report["tasks_created"] == 60 == sum(report["submit_outcomes"].values())
        assert set(report["submit_outcomes"]) <= {ghz_load.pb.TaskState.Name(v).removeprefix("TASK_STATE_")
                                                  for v in ghz_load.pb.TaskState.values()}
        assert phases["Get"]["ok"] == phases["Get"]["calls"] == 240 and not phases["Get"]["errors"]
        assert phases["List"]["ok"] == 500 and phases["Watch"]["errors"] == {}
        assert phases["Watch"]["ended_by_deadline"] + phases["Watch"]["ok"] == phases["Watch"]["calls"]
        # every task it created and held is released again
        stub = ghz_load.gateway_pb2_grpc.GatewayStub(ghz_load.grpc.insecure_channel(stack.gateway))
        held = [t for t in ghz_load.tasks_of(stub, report["tenant"], None)
                if t.state in (ghz_load.pb.TASK_STATE_PLACED, ghz_load.pb.TASK_STATE_RUNNING,
                               ghz_load.pb.TASK_STATE_DEFERRED)]
        assert held == []


def test_the_committed_configs_are_what_the_generator_writes(tmp_path, monkeypatch):
    committed = {p.name: p.read_text() for p in ghz_load.CONFIGS.glob("*.json")}
    monkeypatch.setattr(ghz_load, "CONFIGS", tmp_path)
    ghz_load.write_configs("openb", 200)
    assert {p.name: p.read_text() for p in tmp_path.glob("*.json")} == committed
