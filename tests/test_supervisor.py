"""The stack's supervisor (hsched.stack, `StackConfig.supervise`) with real processes on a real Redis: each
service kind SIGKILLed comes back on the same port without anyone calling restart(), a hung (SIGSTOPped)
child is killed and restarted, a child that dies at once is retried on a growing back-off, a deliberately
stopped one is left alone, and a restarted selector still routes by a link update it did not see live.
Nothing here asserts a duration: every wait polls for a condition under a generous deadline."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import signal
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import redis as redis_sync
from hypothesis import given, settings
from hypothesis import strategies as st

from hsched.stack import Service, Stack, StackConfig, _health, _redis_answers
from hsched.state.lifecycle import ON_NODES
from hsched.v1 import common_pb2 as pb
from hsched.v1 import gateway_pb2, gateway_pb2_grpc
from tests.conftest import SMALL_FLEET, delete_prefix, small_fleet_stack

pytestmark = pytest.mark.slow

DEADLINE_S = 120.0  # generous: 2 cores shared with other stacks; a restarted placer waits out the dead one's lease


@pytest.fixture(scope="module")
def stack(redis_url):
    with small_fleet_stack(redis_url, "supervisor", log_level="INFO", supervise=True, unhealthy_restart_s=6.0,
                     backoff_initial_s=0.2, backoff_max_s=2.0, probe_interval_s=0.5) as s:
        yield s


def wait_for(condition, what: str, timeout_s: float = DEADLINE_S):
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(0.2)


def scrape(stack: Stack) -> dict[tuple[str, str], float]:
    """The supervisor's /metrics as {(metric name, service label): value}."""
    text = urllib.request.urlopen(stack.supervisor_metrics.url, timeout=10).read().decode()
    out = {}
    for m in re.finditer(r'^(hsched_supervisor_\w+)\{service="([^"]+)"\} (\S+)$', text, re.M):
        out[(m[1], m[2])] = float(m[3])
    return out


def restarted(stack: Stack, name: str, old_pid: int):
    """The service runs as a new process and answers SERVING on its old port."""
    svc = stack.services[name]
    return svc.proc.pid != old_pid and svc.alive and _health(svc.target) == "SERVING"


def placed_in(stack: Stack, dc: str, spec: pb.TaskSpec, release: bool = True) -> pb.Task | None:
    """Submit through the gateway; the task if it was PLACED in `dc`, else None. Released again unless it is
    wanted (`release=False` and placed in `dc`)."""
    try:
        with grpc.insecure_channel(stack.gateway) as ch:
            gw = gateway_pb2_grpc.GatewayStub(ch)
            t = gw.Submit(gateway_pb2.SubmitRequest(task=spec), timeout=10).task
            ok = t.state == pb.TASK_STATE_PLACED and t.datacenter == dc
            if t.state in (pb.TASK_STATE_PLACED, pb.TASK_STATE_DEFERRED) and (release or not ok):
                gw.Release(gateway_pb2.ReleaseRequest(task_id=t.task_id), timeout=10)
    except grpc.RpcError:
        return None
    return t if ok else None


def _get(gw: gateway_pb2_grpc.GatewayStub, task_id: str) -> pb.Task | None:
    try:
        return gw.Get(gateway_pb2.GetRequest(task_id=task_id), timeout=10)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            raise  # lost: fail at once rather than wait
        return None  # the gateway is still coming back


def small_task() -> pb.TaskSpec:
    return pb.TaskSpec(resources=pb.Resources(cpu_milli=1000, memory_mib=1024), runtime_s=600)


def supervisor_log(stack: Stack) -> str:
    return (stack.log_dir / "supervisor.log").read_text()


@pytest.mark.parametrize("name", ["thermal", "selector", "placer-cheap", "gateway"])
def test_a_killed_service_is_restarted_on_its_port_and_serves(stack, name):
    svc = stack.services[name]
    old_pid, port, metrics_port = svc.proc.pid, svc.port, svc.metrics_port
    before = scrape(stack)[("hsched_supervisor_restarts_total", name)]
    held = wait_for(lambda: placed_in(stack, "cheap", small_task(), release=False), "a task held in cheap")
    stack.kill(name)  # a crash: nobody calls restart()
    wait_for(lambda: restarted(stack, name, old_pid), f"{name} restarted by the supervisor")
    assert (svc.port, svc.metrics_port) == (port, metrics_port)
    # nothing acknowledged is lost: the task held before the crash is still held, where it was
    with grpc.insecure_channel(stack.gateway) as ch:
        gw = gateway_pb2_grpc.GatewayStub(ch)
        again = wait_for(lambda: _get(gw, held.task_id), f"Get {held.task_id} after the restart")
        assert again.state in ON_NODES and list(again.assignments) == list(held.assignments)
        gw.Release(gateway_pb2.ReleaseRequest(task_id=held.task_id), timeout=10)
    # cheap is everyone's first choice: a task placed there went through gateway, selector and cheap's placer
    assert wait_for(lambda: placed_in(stack, "cheap", small_task()), "a Submit placed in cheap")
    metrics = wait_for(lambda: (m := scrape(stack))[("hsched_supervisor_service_up", name)] == 1 and m,
                       f"{name} up on the supervisor's /metrics")
    assert metrics[("hsched_supervisor_restarts_total", name)] == before + 1
    assert metrics[("hsched_supervisor_last_exit_code", name)] == -signal.SIGKILL
    assert f"{name} (pid {old_pid}) died: killed by SIGKILL (SIGKILL by Stack.kill)" in supervisor_log(stack)
    assert re.search(rf"{name}: restarted by the supervisor as pid {svc.proc.pid} on port {port}\b",
                     supervisor_log(stack))


def test_a_hung_child_is_killed_and_restarted(stack):
    svc = stack.services["selector"]
    old_pid = svc.proc.pid
    os.killpg(old_pid, signal.SIGSTOP)  # alive, but its health never answers
    try:
        wait_for(lambda: restarted(stack, "selector", old_pid), "the hung selector replaced")
    finally:
        if svc.proc.pid == old_pid:  # the test failed: do not leave a stopped process behind
            os.killpg(old_pid, signal.SIGCONT)
    log = supervisor_log(stack)
    assert "selector: health unanswered (DEADLINE_EXCEEDED)" in log
    assert re.search(rf"selector \(pid {old_pid}\) died: killed by SIGKILL \(SIGKILL by the supervisor: "
                     r"health unanswered \(DEADLINE_EXCEEDED\) for \d+ s\)", log)
    assert wait_for(lambda: placed_in(stack, "cheap", small_task()), "a Submit placed in cheap")


def test_a_child_that_dies_at_once_is_retried_on_a_growing_backoff(stack):
    name = "placer-near"
    svc = stack.services[name]
    good_args = list(svc.args)
    svc.args += ["--policy", "no-such-policy"]  # argparse: the last --policy wins, and exits with code 2
    first = len(svc.delays)
    try:
        stack.kill(name)
        wait_for(lambda: len(svc.delays) >= first + 6, "six restarts of the failing placer")
    finally:
        svc.args[:] = good_args
    # 0.2 s doubling, capped at 2 s: the schedule the supervisor recorded, not a measured time
    assert svc.delays[first:first + 6] == [0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    assert svc.last_exit_code == 2
    log = supervisor_log(stack)
    assert f"{name} (pid " in log and "died: exit code 2" in log and "invalid choice: 'no-such-policy'" in log
    # with its arguments repaired, the next restart serves again
    wait_for(lambda: svc.alive and _health(svc.target) == "SERVING", f"{name} serving again")
    metrics = scrape(stack)
    assert metrics[("hsched_supervisor_restarts_total", name)] >= 6


def test_a_deliberately_stopped_service_stays_down_until_restarted(stack):
    name = "placer-near"
    wait_for(lambda: stack.services[name].alive and _health(stack.services[name].target) == "SERVING",
             f"{name} serving")
    restarts = stack.services[name].restarts
    stack.stop_service(name)
    time.sleep(3)  # several supervisor rounds and probe periods (0.5 s): it must not bring the placer back
    svc = stack.services[name]
    assert not svc.alive and svc.restarts == restarts and svc.restart_at is None
    assert scrape(stack)[("hsched_supervisor_service_up", name)] == 0
    assert f"{name} (pid {svc.proc.pid}) stopped: exit code 0" in supervisor_log(stack)
    stack.restart(name)
    assert svc.alive and svc.restarts == restarts + 1 and _health(svc.target) == "SERVING"


def test_a_restarted_selector_routes_by_a_link_update_it_did_not_see_live(stack, redis_url):
    client = redis_sync.Redis.from_url(redis_url)
    links = f"{stack.config.prefix}:links"

    def cheap_path() -> list[str] | None:
        try:
            with grpc.insecure_channel(stack.gateway) as ch:
                gw = gateway_pb2_grpc.GatewayStub(ch)
                t = gw.Submit(gateway_pb2.SubmitRequest(task=small_task()), timeout=10).task
                gw.Release(gateway_pb2.ReleaseRequest(task_id=t.task_id), timeout=10)
        except grpc.RpcError:
            return None
        return next((list(c.path.vertices) for c in t.explanation.ranking if c.datacenter == "cheap"), None)

    assert wait_for(cheap_path, "a Submit") == ["s", "a", "b"]
    client.xadd(links, {"m": json.dumps({"a": "a", "b": "b", "latency_ms": 50.0})})
    wait_for(lambda: cheap_path() == ["s", "c", "b"], "the live selector rerouting")  # 3 ms beats 0.5 + 50 ms
    try:
        old_pid = stack.services["selector"].proc.pid
        stack.kill("selector")
        wait_for(lambda: restarted(stack, "selector", old_pid), "the selector restarted")
        # the first answer of the new selector already holds the update: it replays the links before serving
        assert wait_for(cheap_path, "a Submit through the restarted selector") == ["s", "c", "b"]
    finally:
        client.xadd(links, {"m": json.dumps({"a": "a", "b": "b", "latency_ms": 0.5})})
    wait_for(lambda: cheap_path() == ["s", "a", "b"], "the route back once the link recovered")


def test_a_dead_embedded_redis_is_started_again_on_its_port():
    config = StackConfig(fleet_path=SMALL_FLEET, redis_url=None, prefix="sup", gateway_port=0, thermal=False,
                         supervise=True, backoff_initial_s=0.2, probe_interval_s=0.5)
    with Stack(config) as stack:
        old = stack.redis.proc
        os.killpg(old.pid, signal.SIGKILL)
        old.wait(10)
        wait_for(lambda: stack.redis.proc is not old and _redis_answers(stack.redis.url),
                 "redis answering again")
        assert re.search(rf"redis \(pid {old.pid}, port {stack.redis.port}\) died: killed by SIGKILL",
                         supervisor_log(stack))
        metrics = wait_for(lambda: (m := scrape(stack))[("hsched_supervisor_service_up", "redis")] == 1 and m,
                           "redis up on the supervisor's /metrics")
        assert metrics[("hsched_supervisor_restarts_total", "redis")] == 1
        assert metrics[("hsched_supervisor_last_exit_code", "redis")] == -signal.SIGKILL


def test_a_hung_embedded_redis_is_restarted_and_its_outage_restarts_no_service():
    """SIGSTOP of the embedded redis-server: the supervisor says it is down (/metrics), does not SIGKILL the
    placers that go NOT_SERVING meanwhile (Redis' outage, not theirs: restarted, they only crash-looped), and
    SIGKILLs and restarts Redis once it has not answered PING for unhealthy_restart_s; then all serve again."""
    config = StackConfig(fleet_path=SMALL_FLEET, redis_url=None, prefix="hung", gateway_port=0, thermal=False,
                         supervise=True, backoff_initial_s=0.2, probe_interval_s=0.5, unhealthy_restart_s=6.0)
    with Stack(config) as stack:
        old = stack.redis.proc
        os.kill(old.pid, signal.SIGSTOP)
        try:
            wait_for(lambda: scrape(stack)[("hsched_supervisor_service_up", "redis")] == 0, "redis shown down")
            wait_for(lambda: old.poll() is not None, "the hung redis-server killed", timeout_s=30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(old.pid, signal.SIGCONT)
        wait_for(lambda: stack.redis.proc is not old and _redis_answers(stack.redis.url), "redis answering again")
        log = supervisor_log(stack)
        assert "no answer to PING for" in log and "SIGKILL (its AOF is kept)" in log, log
        metrics = wait_for(lambda: (m := scrape(stack))[("hsched_supervisor_service_up", "redis")] == 1
                           and all(m[("hsched_supervisor_service_up", n)] == 1 for n in stack.services) and m,
                           "every service serving again", timeout_s=60)
        assert metrics[("hsched_supervisor_restarts_total", "redis")] == 1
        assert all(metrics[("hsched_supervisor_restarts_total", n)] == 0 for n in stack.services), metrics


@functools.cache
def unstarted_stack(initial: float, cap: float) -> Stack:
    stack = Stack(StackConfig(fleet_path=SMALL_FLEET, backoff_initial_s=initial, backoff_max_s=cap,
                              healthy_reset_s=60.0))
    shutil.rmtree(stack.run_dir)  # never started, so never stopped: its (empty) run dir would stay behind
    return stack


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.just("death"), st.floats(0, 200)), max_size=30),
       st.sampled_from([0.1, 0.5, 1.0]), st.sampled_from([2.0, 30.0]))
def test_backoff_doubles_to_its_cap_and_resets_after_a_healthy_stretch(events, initial, cap):
    """Deaths and SERVING stretches (seconds) in any order: each delay doubles the previous one up to the cap,
    and is back to the initial one once the child had served `healthy_reset_s` in a row since its last death."""
    stack = unstarted_stack(initial, cap)
    svc = Service("x", "services.x", [], backoff_s=initial)
    now, expected = 0.0, initial
    for event in events:
        if event == "death":
            assert stack._backoff(svc) == expected
            expected = min(expected * 2, cap)
            svc.serving_since = None  # a new process: its serving stretch starts again
        else:
            stack._judge(svc, "SERVING", now)
            now += event
            stack._judge(svc, "SERVING", now)
            if now - svc.serving_since >= 60.0:
                expected = initial
    assert svc.delays == [d for d in svc.delays if initial <= d <= cap]


def child_pids(pid: int) -> set[int]:
    """The children of every thread of `pid` (a child spawned by a thread is listed under that thread)."""
    out = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out |= {int(c) for c in (task / "children").read_text().split()}
        except OSError:  # a thread that just ended
            pass
    return out


def test_hsched_up_supervises_by_default(redis_url, tmp_path):
    """`hsched up` itself: the supervisor's /metrics in its table, a killed child restarted and said on the
    console and in supervisor.log, and a clean stop."""
    import subprocess
    import sys

    prefix = f"test-up-{int(time.time() * 1000)}"
    env = {**os.environ, "REDIS_URL": redis_url, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp_path)}  # its running-stack file
    out = tmp_path / "up.out"
    with open(out, "wb") as f:
        up = subprocess.Popen([sys.executable, "-m", "hsched.cli", "up", "--fleet", SMALL_FLEET, "--port", "0",
                               "--no-thermal", "--prefix", prefix, "--log-dir", str(tmp_path / "logs")],
                              stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        url = wait_for(lambda: (m := re.search(r"supervisor\s+│\s+-\s+│\s+(http://\S+/metrics)", out.read_text()))
                       and m[1], "the supervisor's /metrics in the table")
        children = child_pids(up.pid)
        gateway = next(p for p in children if "services.gateway" in Path(f"/proc/{p}/cmdline").read_text())
        os.killpg(gateway, signal.SIGKILL)
        wait_for(lambda: re.search(r'hsched_supervisor_restarts_total\{service="gateway"\} 1\.0',
                                   urllib.request.urlopen(url, timeout=10).read().decode()), "a restart counted")
        assert f"gateway (pid {gateway}) died: killed by SIGKILL" in out.read_text()
        assert f"gateway (pid {gateway}) died: killed by SIGKILL" in (tmp_path / "logs" / "supervisor.log").read_text()
        children = child_pids(up.pid)  # with the restarted gateway (a child of the supervisor's thread)
        assert len(children) == 3  # selector, one process hosting the 3 placers (--placer-processes 1), gateway
        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0
        assert not [p for p in children if Path(f"/proc/{p}").exists()], "children left behind"
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
        delete_prefix(redis_url, prefix)


def running(pid: int) -> bool:
    """pid exists and is not a zombie (an orphan's zombie waits for whoever adopted it to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_sigkilled_hsched_up_takes_its_children_with_it(tmp_path):
    """`hsched up` killed with SIGKILL runs no cleanup of its own: its children (the embedded redis-server and
    every service) are sent SIGTERM by the kernel (hsched.children) and exit, instead of serving on as
    orphans with no supervisor."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # so that it embeds a redis-server
    env |= {"PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp_path)}
    out = tmp_path / "up.out"
    with open(out, "wb") as f:
        up = subprocess.Popen([sys.executable, "-m", "hsched.cli", "up", "--fleet", SMALL_FLEET, "--port", "0",
                               "--no-thermal", "--log-dir", str(tmp_path / "logs"),
                               "--state-dir", str(tmp_path / "state")],  # not the README's replay's state
                              stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    children: set[int] = set()
    try:
        wait_for(lambda: re.search(r"supervisor\s+│", out.read_text()), "the stack's table")
        children = child_pids(up.pid)
        commands = {Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode() for p in children}
        assert any("redis-server" in c for c in commands) and any("services.gateway" in c for c in commands)
        up.kill()
        assert up.wait(30) == -signal.SIGKILL
        wait_for(lambda: not [p for p in children if running(p)], "every child of the killed `hsched up` gone")
    finally:
        for pid in [up.pid, *children]:  # a failed run leaves nothing behind
            if running(pid):
                os.kill(pid, signal.SIGKILL)
