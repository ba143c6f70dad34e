"""Cordon, drain and uncordon through real processes: `hsched drain|cordon|uncordon` against a stack with tenant
authentication (`hsched up --auth`): only an admin may; a drain's evicted offline tasks are requeued and placed on
other nodes, as the gateway's records say; the cordon survives a kill -9 of the DC's placer (it is in the ledger);
bad node and DC names are one-line INVALID_ARGUMENT errors. The engine's side is in tests/test_cordon.py."""

from __future__ import annotations

import json
import time

import grpc
import pytest

from hsched.security import tokens as tk
from hsched.stack import Stack, StackConfig
from hsched.v1 import common_pb2 as pb
from hsched.v1 import gateway_pb2, gateway_pb2_grpc
from tests.conftest import SMALL_FLEET, delete_prefix
from tests.test_cli import assert_one_line_error, run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(redis_url):
    prefix = f"test-cordon-{int(time.time() * 1000)}"
    config = StackConfig(fleet_path=SMALL_FLEET, redis_url=redis_url, prefix=prefix, gateway_port=0, auth=True,
                         extra_env={"HSCHED_GPU_RESERVE": "0"})
    with Stack(config) as s:
        yield s
    delete_prefix(redis_url, prefix)


def cli(stack, tmp_path, *argv: str, token: str | None = None):
    env = {"XDG_RUNTIME_DIR": str(tmp_path), "HSCHED_TOKEN_FILE": str(stack.admin_token_file)}
    if token is not None:
        env = {"XDG_RUNTIME_DIR": str(tmp_path), "HSCHED_TOKEN": token}
    return run_cli(*argv, "--gateway", stack.gateway, env=env)


def until(check, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (value := check()) is not None:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def test_only_an_admin_drains_and_the_cordon_outlives_a_killed_placer(stack, tmp_path) -> None:
    alice, _ = tk.create_token(stack.tokens_file, "alice", name="alice-cordon")
    md = (("authorization", f"Bearer {alice}"),)
    with grpc.insecure_channel(stack.gateway) as ch:
        gw = gateway_pb2_grpc.GatewayStub(ch)
        spec = pb.TaskSpec(resources=pb.Resources(cpu_milli=4000, memory_mib=4096))  # offline, runs until released
        tasks = [gw.Submit(gateway_pb2.SubmitRequest(task=spec), timeout=20, metadata=md).task for _ in range(2)]
        assert all(t.state == pb.TASK_STATE_PLACED for t in tasks), tasks
        dc, node = tasks[0].datacenter, tasks[0].assignments[0].node
        on_node = sorted(t.task_id for t in tasks if t.datacenter == dc and t.assignments[0].node == node)

        refused = cli(stack, tmp_path, "drain", dc, node, token=alice)
        assert_one_line_error(refused, 1, "PERMISSION_DENIED", "admin")

        done = cli(stack, tmp_path, "drain", dc, node, "--reason", "disk swap", "-o", "json")
        assert done.returncode == 0, done.stderr
        reply = json.loads(done.stdout)
        assert reply["changed"] == [node] and sorted(reply["evicted_task_ids"]) == on_node, reply

        def moved(task_id: str):
            t = gw.Get(gateway_pb2.GetRequest(task_id=task_id), timeout=10, metadata=md)
            return t if t.state == pb.TASK_STATE_PLACED and t.preemptions == 1 else None
        for task_id in on_node:  # the gateway's record follows the ledger: preempted, requeued, placed elsewhere
            t = until(lambda task_id=task_id: moved(task_id), f"{task_id} placed again")
            assert t.datacenter == dc and node not in {a.node for a in t.assignments}, t

        placer = stack.placer_service(dc)
        stack.kill(placer)  # kill -9: what it knew of the cordon is only what the ledger holds
        stack.restart(placer)

        def cordoned():
            shown = cli(stack, tmp_path, "nodes", dc, "-o", "json")
            if shown.returncode != 0:  # the restarted placer is taking the lease over
                return None
            return next(n for n in json.loads(shown.stdout)["nodes"] if n["name"] == node)
        view = until(cordoned, f"{dc}'s placer back")
        assert view.get("cordoned") and view["cordon_reason"] == "disk swap", view
        table = cli(stack, tmp_path, "nodes", dc)
        assert "drained since" in table.stdout and "disk swap" in table.stdout, table.stdout

        bad = cli(stack, tmp_path, "cordon", dc, "no-such-node")
        assert_one_line_error(bad, 1, "INVALID_ARGUMENT", "nodes[0]", "no-such-node")
        bad_dc = cli(stack, tmp_path, "uncordon", "atlantis", node)
        assert_one_line_error(bad_dc, 1, "INVALID_ARGUMENT", "datacenter", "atlantis")

        back = cli(stack, tmp_path, "uncordon", dc, node)
        assert back.returncode == 0 and f"uncordoned {node}" in back.stdout, back.stdout + back.stderr
        shown = json.loads(cli(stack, tmp_path, "nodes", dc, "-o", "json").stdout)
        assert not next(n for n in shown["nodes"] if n["name"] == node).get("cordoned")
        for t in tasks:
            gw.Release(gateway_pb2.ReleaseRequest(task_id=t.task_id), timeout=10, metadata=md)
