"""The CLI finds the stack `hsched up` runs, and its task commands talk to a real gateway."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hsched import cli, localstate


def test_commands_use_the_running_stack_unless_the_environment_says_otherwise(private_runtime_dir, monkeypatch):
    assert cli._redis_url() is None  # nothing running, nothing set
    path = localstate.write_stack({"gateway": "127.0.0.1:4711", "redis_url": "redis://127.0.0.1:4712/0"})
    assert cli._redis_url() == "redis://127.0.0.1:4712/0"
    monkeypatch.setenv("REDIS_URL", "redis://elsewhere:6379/1")
    assert cli._redis_url() == "redis://elsewhere:6379/1"
    path.write_text("{not json")
    monkeypatch.delenv("REDIS_URL")
    assert cli._running_stack() == {} and cli._redis_url() is None
    assert not path.exists()  # a broken file is cleaned up


def test_a_job_replay_against_a_running_stack_takes_its_time_factor_and_refuses_another(private_runtime_dir, capsys):
    """The placers' clock runs at the factor `hsched up` gave them: a replay converting wall time with another
    reported every JCT wrong (10× at 100 against a stack at 10)."""
    localstate.write_stack({"gateway": "127.0.0.1:4711", "redis_url": "redis://127.0.0.1:4712/0", "time_factor": 10.0})
    assert cli.main(["replay", "tpch", "--time-factor", "100", "--limit", "1"]) == 2
    err = capsys.readouterr().err
    assert err == "hsched: --time-factor: must be the running stack's (10, as `hsched up` started its placers): " \
                  "leave it out (got 100.0)\n", err


def test_the_password_comes_from_the_recorded_password_file_never_the_stack_file(private_runtime_dir):
    with pytest.raises(ValueError, match="password"):
        localstate.write_stack({"gateway": "127.0.0.1:4711", "redis_url": "redis://:s3cret@127.0.0.1:4712/0"})
    secret = private_runtime_dir / "redis.password"
    secret.write_text("s3cret\n")
    path = localstate.write_stack({"gateway": "127.0.0.1:4711", "redis_url": "redis://127.0.0.1:4712/0",
                                   "redis_password_file": str(secret)})
    assert "s3cret" not in path.read_text()
    assert cli._redis_url() == "redis://:s3cret@127.0.0.1:4712/0"


def test_several_stacks_need_a_choice_and_dead_ones_are_forgotten(private_runtime_dir, monkeypatch, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = localstate.write_stack({"gateway": "127.0.0.1:4799", "pid": dead.pid})
    assert localstate.read_stacks() == [] and not stale.exists()
    localstate.write_stack({"gateway": "127.0.0.1:4711", "redis_url": "redis://127.0.0.1:1/0"})
    localstate.write_stack({"gateway": "127.0.0.1:4712", "redis_url": "redis://127.0.0.1:2/0"})
    assert cli.main(["get", "t-1"]) == 2
    err = capsys.readouterr().err
    assert "127.0.0.1:4711" in err and "127.0.0.1:4712" in err and "--gateway" in err
    assert cli._redis_url("127.0.0.1:4712") == "redis://127.0.0.1:2/0"
    monkeypatch.setenv("HSCHED_GATEWAY", "127.0.0.1:4711")
    assert cli._redis_url() == "redis://127.0.0.1:1/0"


def test_the_final_states_are_the_task_stores():
    from hsched.state.tasks import JOB_STATE_OF_KIND, JOB_TERMINAL, TERMINAL

    assert sorted(cli.FINAL) == sorted(TERMINAL)
    assert cli.JOB_FINAL == {kind: s for kind, s in JOB_STATE_OF_KIND.items() if s in JOB_TERMINAL}


def test_unknown_experiment_and_bad_submit_are_refused(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["eval", "nope"])
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["submit", "--cpu", "lots"])
    assert "invalid" in capsys.readouterr().err


# -- bad arguments and failures: one line on stderr naming the flag and the rule, exit 2 (usage) or 1 (failure),
# never a traceback; every case runs the real CLI in a subprocess ----------------------------------------------

SMALL_FLEET = Path(__file__).resolve().parent / "fleets" / "small.yaml"
UNREACHABLE = "127.0.0.1:1"  # nothing listens on port 1: a gateway call would fail, so exit 2 proves no call


def run_cli(*argv: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hsched.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def assert_one_line_error(done: subprocess.CompletedProcess, code: int, *words: str) -> None:
    assert done.returncode == code, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]  # argparse prints its usage line above the error
    assert all(w in last for w in words), last


@pytest.mark.parametrize("argv, words", [
    (["submit", "--replicas", "-3"], ["--replicas", "1.."]),
    (["submit", "--replicas", "0"], ["--replicas", "1.."]),
    (["submit", "--replicas", "1000"], ["replicas", "1..256"]),
    # the gateway's rule (TaskSpec.validate), not the int32 wire range: the same words as the gateway's refusal
    (["submit", "--priority", "99999999999"], ["--priority", "must be in -1000..1000", "'99999999999'"]),
    (["submit", "--priority", "1001"], ["--priority", "must be in -1000..1000", "'1001'"]),
    (["submit", "--priority", "-1001"], ["--priority", "must be in -1000..1000", "'-1001'"]),
    (["submit", "--priority", "1.5"], ["--priority", "whole number", "'1.5'"]),
    (["submit", "--priority-class", "urgent"], ["--priority-class", "invalid choice", "'urgent'", "'online', 'offline'"]),
    (["submit", "--priority-class", ""], ["--priority-class", "invalid choice", "'online', 'offline'"]),
    (["submit", "-f", "tasks.yaml", "--priority-class", "online"], ["-f", "cannot be combined with --priority-class"]),
    (["submit", "--cpu", "nan"], ["--cpu", "finite"]),
    (["submit", "--cpu", "inf"], ["--cpu", "finite"]),
    (["submit", "--cpu", "-1"], ["--cpu", ">= 0"]),
    (["submit", "--gpus", "1", "--gpu-memory-gib", "0.0001"], ["--gpu-memory-gib", "at least 1 MiB"]),  # was 0
    (["submit", "--cpu", "0.0001"], ["--cpu", "at least 1 millicores"]),
    (["submit", "--gpu-core-percent", "50"], ["gpu_count", "must be > 0"]),
    (["submit", "--gpus", "1", "--gpu-core-percent", "150"], ["--gpu-core-percent", "1..100"]),
    (["submit", "--max-loss-percent", "500"], ["--max-loss-percent", "0..100"]),
    (["list", "--state", "bogus"], ["--state", "invalid choice"]),
    (["job", "list", "--state", "bogus"], ["--state", "invalid choice"]),
    (["list", "--limit", "-1"], ["--limit", "1.."]),
    (["list", "--limit", "100000"], ["--limit", "1..1000"]),  # the gateway's page bound, not a refusal from it
    (["job", "list", "--limit", "1001"], ["--limit", "1..1000"]),
    (["eval", "stage1", "--seeds", "0"], ["--seeds", "1.."]),
    (["replay", "nosuchtrace"], ["trace", "openb"]),
    (["replay", "openb", "--concurrency", "0"], ["--concurrency", "1.."]),
    (["replay", "openb", "--fleet", "/nonexistent/fleet.yaml"], ["--fleet", "cannot read"]),
    # amounts whose millicores / MiB overflow their int64 field (protobuf's "Value out of range" traceback)
    (["submit", "--cpu", "1e17"], ["--cpu", "0..9.223e+15", "millicores"]),
    (["submit", "--memory-gib", "1e20"], ["--memory-gib", "0..9.007e+15", "MiB"]),
    (["submit", "--disk-gib", "1e20"], ["--disk-gib", "0..9.007e+15"]),
    (["submit", "--gpus", "1", "--gpu-memory-gib", "1e20"], ["--gpu-memory-gib", "0..9.007e+15"]),
    (["replay", "tpch", "--tpch-sizes", "2g,bogus"], ["--tpch-sizes", "'bogus'", "2g, 5g, 10g, 20g, 50g, 80g, 100g"]),
    (["up", "--replay", "tpch", "--tpch-sizes", "bogus"], ["--tpch-sizes", "'bogus'", "100g"]),
    (["up", "--port", "99999"], ["--port", "0..65535"]),
    (["up", "--port", "-1"], ["--port", "0..65535"]),
    (["up", "--supervisor-metrics-port", "65536"], ["--supervisor-metrics-port", "0..65535"]),
    (["up", "--prometheus", "--prometheus-port", "99999"], ["--prometheus-port", "0..65535"]),
    (["up", "--tenant-weights", "a=0"], ["--tenant-weights[a]", "> 0"]),  # before anything starts
])
def test_bad_arguments_are_one_line_usage_errors(argv, words, tmp_path):
    gateway = [] if argv[0] in ("eval", "up") else ["--gateway", UNREACHABLE]
    assert_one_line_error(run_cli(*argv, *gateway, env={"XDG_RUNTIME_DIR": str(tmp_path)}), 2, *words)


def test_operator_mistakes_are_one_line_errors_not_tracebacks(tmp_path):
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    certs = str(tmp_path / "certs")
    assert_one_line_error(run_cli("certs", "issue", "tenant-x", "--dir", certs, "--days", "100000000", env=env), 2,
                          "--days", "1..36500")  # (an OverflowError of the date before)
    assert_one_line_error(run_cli("certs", "rotate", "--dir", certs, "--new-ca", "--drop-old-ca", env=env), 2,
                          "--drop-old-ca", "--new-ca")  # (would distrust every leaf the old CA signed at once)
    assert run_cli("certs", "init", "--dir", certs, env=env).returncode == 0
    assert_one_line_error(run_cli("certs", "issue", "tenant-Bad_Name", "--dir", certs, env=env), 2,
                          "'Bad_Name' must be lowercase")  # no gateway could map it to a tenant
    assert_one_line_error(run_cli("certs", "issue", "tenant-x", "--dir", str(tmp_path / "none"), env=env), 1,
                          "no such directory")  # the state of the directory, not the usage
    assert_one_line_error(run_cli("tokens", "create", "--file", str(tmp_path / "no" / "dir" / "t.yaml"),
                                  "--tenant", "x", env=env), 1, "hsched tokens", "No such file or directory")
    assert_one_line_error(run_cli("link", "s", "a", "--latency-ms", "3", "--fleet", str(SMALL_FLEET),
                                  env={**env, "REDIS_URL": "garbage"}), 2, "REDIS_URL", "redis://", "'garbage'")


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.integers(-1002, 1002), st.integers(-2**64, 2**64)))
def test_priority_takes_what_the_gateway_takes_and_refuses_the_rest_in_its_words(value):
    """--priority said 'must be in -2147483648..2147483647 (int32)' where the gateway's rule is -1000..1000: the
    flag now checks the gateway's own rule (TaskSpec.validate), so both refusals read the same."""
    from hsched.domain.errors import ValidationError
    from hsched.domain.resources import Resources
    from hsched.domain.task import TaskSpec

    try:
        TaskSpec(Resources(cpu_milli=1000), runtime_s=60.0, priority=value).validate()  # what the gateway runs
        gateway = None
    except ValidationError as exc:
        gateway = exc.rule
    try:
        assert cli.priority(str(value)) == value and gateway is None
    except argparse.ArgumentTypeError as exc:
        assert gateway == "must be in -1000..1000" and str(exc) == f"{gateway}, got '{value}'"
    assert (gateway is None) == (-1000 <= value <= 1000)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.floats(min_value=0, allow_nan=False, allow_infinity=False), st.floats(9e15, 1e16)),
       st.sampled_from([(cli.cores, 1000), (cli.gib, 1024)]))
def test_an_amount_the_cli_takes_fits_its_int64_field(amount, flag):
    """--cpu (sent as millicores) and the --*-gib flags (as MiB): what the flag takes, protobuf takes, and is not
    sent as 0 unless it is 0; the rest is refused naming the range (whose bound is itself taken) or the unit."""
    from hsched.v1 import common_pb2 as pb

    parse, unit = flag
    try:
        value = parse(repr(amount))
    except argparse.ArgumentTypeError as exc:
        if "at least 1" in str(exc):  # it would be sent as 0
            assert amount > 0 and round(amount * unit) == 0, str(exc)
        else:
            bound = str(exc).split("0..")[1].split()[0]
            assert amount > float(bound) and parse(bound) == float(bound), str(exc)
    else:
        pb.Resources(cpu_milli=round(value * unit), memory_mib=round(value * unit))
        assert (round(value * unit) == 0) == (value == 0)


def test_a_bad_fleet_file_is_the_loaders_one_line_message(tmp_path):
    bad = tmp_path / "fleet.yaml"
    bad.write_text("name: x\nwan: 3\n")
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    for argv in (["up", "--fleet", str(bad)], ["replay", "openb", "--fleet", str(bad), "--gateway", UNREACHABLE]):
        assert_one_line_error(run_cli(*argv, env=env), 2, "--fleet", str(bad), "is required")


def test_up_on_a_busy_port_is_one_line_and_starts_nothing(private_runtime_dir):
    import socket

    tmp_path = private_runtime_dir  # the runtime dir read_stacks reads below, not one where others run stacks
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_cli("up", "--port", str(port), "--state-dir", str(tmp_path / "state"),
                       env={"XDG_RUNTIME_DIR": str(tmp_path), "REDIS_URL": ""})
    assert_one_line_error(done, 1, "--port", f"127.0.0.1:{port}", "already in use")
    assert not (tmp_path / "state").exists() and not localstate.read_stacks()


def test_a_second_up_on_a_running_stacks_state_dir_is_refused_in_one_line(private_runtime_dir):
    """Two stacks on one state dir (same --prefix, another --port) each started a redis-server on the same AOF and
    a placer per DC: two ledgers per DC, then a state no restart could load. The second is refused; once the
    first has stopped, the same command starts (the lock dies with its holder)."""
    from hsched.stack import Stack, StackConfig

    state = private_runtime_dir / "state"
    first = StackConfig(fleet_path=str(SMALL_FLEET), state_dir=str(state), gateway_port=0, thermal=False,
                        prefix="lock-test")
    env = {"XDG_RUNTIME_DIR": str(private_runtime_dir), "REDIS_URL": ""}
    with Stack(first):
        aof = sorted(p.name for p in (state / "redis").rglob("*"))
        up = ["up", "--fleet", str(SMALL_FLEET), "--no-thermal", "--port", "0", "--state-dir", str(state),
              "--prefix", "lock-test", "--replay", "openb", "--limit", "1"]
        done = run_cli(*up, env=env)
        assert_one_line_error(done, 1, "state dir", str(state), "in use", str(os.getpid()))
        assert sorted(p.name for p in (state / "redis").rglob("*")) == aof  # nothing of a second Redis
    done = run_cli(*up, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_up_records_the_time_factor_it_took_from_the_environment(private_runtime_dir, redis_url, prefix):
    """HSCHED_TIME_FACTOR without --time-factor: the stack file records it, so `hsched replay` paces at the clock the
    placers run (it read none and fell back to 1)."""
    import signal
    import time

    tmp_path = private_runtime_dir
    env = {**os.environ, "HSCHED_TIME_FACTOR": "7", "REDIS_URL": redis_url, "XDG_RUNTIME_DIR": str(tmp_path)}
    with open(tmp_path / "up.out", "wb") as out:
        up = subprocess.Popen([sys.executable, "-m", "hsched.cli", "up", "--fleet", str(SMALL_FLEET), "--port", "0",
                               "--no-thermal", "--prefix", prefix, "--state-dir", str(tmp_path / "state")],
                              stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120  # a deadline against a hang, not a timing assertion
        while not localstate.read_stacks():
            assert up.poll() is None and time.monotonic() < deadline, (tmp_path / "up.out").read_text()
            time.sleep(0.2)
        assert cli._from_stack(argparse.Namespace(time_factor=None, gateway=None), "time_factor", 1.0) == 7.0
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(60)


def test_up_refuses_a_bad_time_factor_from_the_environment_before_starting(private_runtime_dir):
    done = run_cli("up", "--state-dir", str(private_runtime_dir / "state"),
                   env={"HSCHED_TIME_FACTOR": "fast", "XDG_RUNTIME_DIR": str(private_runtime_dir), "REDIS_URL": ""})
    assert_one_line_error(done, 2, "HSCHED_TIME_FACTOR", "must be a number", "'fast'")
    assert not (private_runtime_dir / "state").exists() and not localstate.read_stacks()


@pytest.mark.parametrize("service", ["gateway", "selector", "placer", "thermal"])
def test_a_service_given_a_bad_fleet_file_exits_2_with_one_line(tmp_path, redis_url, prefix, service):
    bad = tmp_path / "fleet.yaml"
    bad.write_text("version: 1\nname: x\n")
    extra = ["--datacenter", "cheap"] if service == "placer" else []
    done = subprocess.run([sys.executable, "-m", f"services.{service}", "--fleet", str(bad), "--redis-url", redis_url,
                           "--prefix", prefix, *extra], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-1500:]
    assert f"--fleet {bad}: wan: is required" in done.stderr


@pytest.mark.parametrize("service", ["gateway", "selector", "placer", "thermal"])
def test_a_service_given_bad_environment_values_or_a_taken_metrics_port_says_so_in_one_line(redis_url, prefix,
                                                                                           service):
    """HSCHED_LOG_LEVEL / HSCHED_TRACES bypass argparse's choices (a default), a taken --metrics-port raised
    OSError: each was a traceback."""
    import socket

    extra = ["--datacenter", "cheap"] if service == "placer" else []
    argv = [sys.executable, "-m", f"services.{service}", "--fleet", str(SMALL_FLEET), "--redis-url", redis_url,
            "--prefix", prefix, *extra]
    root = Path(__file__).resolve().parents[1]
    for env, code, words in ((("HSCHED_LOG_LEVEL", "LOUD"), 2, ["--log-level (HSCHED_LOG_LEVEL): 'LOUD'"]),
                             (("HSCHED_TRACES", "jaeger"), 2, ["--traces (HSCHED_TRACES): 'jaeger'"]),
                             (("HSCHED_REDIS_WAIT_MS", "soon"), 2, ["--redis-wait-ms", "'soon'"])):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=root,
                              env={**os.environ, env[0]: env[1]})
        assert_one_line_error(done, code, *words)
    if service == "selector":
        for env, words in ((("HSCHED_GPU_RESERVE", "2"), ["--gpu-reserve: must be a number in 0..1"]),
                           (("HSCHED_STRANDING_WEIGHT", "abc"), ["--stranding-weight", "'abc'"])):
            done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=root,
                                  env={**os.environ, env[0]: env[1]})
            assert_one_line_error(done, 2, *words)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([*argv, "--metrics-port", str(port)], capture_output=True, text=True, timeout=120,
                              cwd=root)
    assert_one_line_error(done, 1, f"--metrics-port {port} on 127.0.0.1: cannot listen")


def test_a_listen_address_that_cannot_work_is_explained():
    import socket

    from hsched.rpc import listen_problem

    assert listen_problem("127.0.0.1:0") is None
    assert listen_problem("bogus") == "it must be host:port with a port in 0..65535"
    assert listen_problem("no-such-host.invalid:5000").startswith("the host 'no-such-host.invalid' does not resolve")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert listen_problem(f"127.0.0.1:{taken.getsockname()[1]}") == "Address already in use (errno 98)"


async def test_a_service_refuses_a_port_a_server_already_listens_on(redis_url, prefix):
    """gRPC servers set SO_REUSEPORT by default, so a second one on a taken port would silently share its calls;
    ours refuse it, in one line naming --listen."""
    import grpc

    holder = grpc.aio.server()  # gRPC's defaults: SO_REUSEPORT on
    port = holder.add_insecure_port("127.0.0.1:0")
    await holder.start()
    try:
        done = subprocess.run([sys.executable, "-m", "services.selector", "--listen", f"127.0.0.1:{port}",
                               "--redis-url", redis_url, "--prefix", prefix], capture_output=True, text=True, timeout=120,
                              cwd=Path(__file__).resolve().parents[1])
    finally:
        await holder.stop(None)
    assert_one_line_error(done, 1, "--listen", f"127.0.0.1:{port}", "in use")


def test_a_service_without_its_redis_says_so_in_one_line():
    done = subprocess.run([sys.executable, "-m", "services.selector", "--listen", "127.0.0.1:0",
                           "--redis-url", "redis://127.0.0.1:1/0"], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert_one_line_error(done, 1, "Redis at redis://127.0.0.1:1/0", "refused")


def test_replay_without_a_gateway_fails_fast(tmp_path):
    done = run_cli("replay", "openb", "--limit", "5", "--duration", "3600", "--gateway", UNREACHABLE,
                   env={"XDG_RUNTIME_DIR": str(tmp_path)})  # an hour's replay: the timeout catches a wait
    assert_one_line_error(done, 1, "no gateway reachable", UNREACHABLE)


@pytest.mark.parametrize("argv, words", [
    (["nosuch", "a"], ["a:", "vertex"]),
    (["s", "b"], ["b:", "linked"]),            # both vertices exist, but no s–b link
    (["s", "a", "--latency-ms", "-1"], ["--latency-ms", ">= 0"]),
    (["s", "a", "--loss-percent", "500"], ["--loss-percent", "0..100"]),
    (["s", "a", "--latency-ms", "1e308"], ["--latency-ms", "<= 60000"]),  # a path's sum was inf, its cost NaN
    (["s", "a"], ["--latency-ms, --jitter-ms", "at least one"]),            # an update of nothing
])
def test_link_updates_are_validated_against_the_wan_before_anything_is_written(argv, words, redis_url, prefix,
                                                                             tmp_path):
    from hsched.state.keys import Keys
    from hsched.state.redis import connect_sync

    env = {"REDIS_URL": redis_url, "XDG_RUNTIME_DIR": str(tmp_path)}
    link = ["link", *argv, "--fleet", str(SMALL_FLEET), "--prefix", prefix]
    redis = connect_sync(redis_url)
    redis.set(Keys(prefix).epoch, "e")  # the deployment's marker: link writes only where one is
    assert_one_line_error(run_cli(*link, env=env), 2, *words)
    assert redis.xlen(Keys(prefix).links) == 0
    ok = run_cli("link", "s", "a", "--latency-ms", "3", "--fleet", str(SMALL_FLEET), "--prefix", prefix, env=env)
    assert ok.returncode == 0, ok.stderr
    assert redis.xlen(Keys(prefix).links) == 1  # the same command, valid, is written


def test_link_without_a_stack_or_redis_url_writes_nowhere(redis_url, prefix, tmp_path):
    """No running stack and no REDIS_URL: exit 1 and nothing written, not a guess at 127.0.0.1:6379."""
    from hsched.state.keys import Keys
    from hsched.state.redis import connect_sync

    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "HSCHED_GATEWAY")}
    env["XDG_RUNTIME_DIR"] = str(tmp_path)  # an empty runtime dir: no stack file
    done = subprocess.run([sys.executable, "-m", "hsched.cli", "link", "s", "a", "--latency-ms", "3", "--fleet",
                           str(SMALL_FLEET), "--prefix", prefix], capture_output=True, text=True, timeout=120, env=env)
    assert_one_line_error(done, 1, "no running stack", "REDIS_URL", "nothing written")
    assert connect_sync(redis_url).xlen(Keys(prefix).links) == 0
    assert connect_sync("redis://127.0.0.1:6379/0").xlen(Keys(prefix).links) == 0


def test_link_and_thermal_replay_write_under_the_running_stacks_prefix(private_runtime_dir, redis_url, prefix):
    """`hsched up --prefix P` records P: link and thermal replay write where that stack reads (and check against
    its fleet), as they use its Redis; an explicit --prefix still wins."""
    import asyncio

    from hsched.costs import WanGraph
    from hsched.domain.fleet import load_fleet
    from hsched.engine.selector import DcSelector
    from hsched.state.keys import Keys
    from hsched.state.redis import connect_sync

    localstate.write_stack({"gateway": "127.0.0.1:4711", "redis_url": redis_url, "prefix": prefix,
                            "fleet": str(SMALL_FLEET)})
    redis = connect_sync(redis_url)
    redis.set(Keys(prefix).epoch, "e")  # the deployment's marker: thermal replay writes only where one is
    assert cli.main(["link", "s", "a", "--latency-ms", "40"]) == 0  # s and a: the small fleet's vertices
    assert redis.xlen(Keys(prefix).links) == 1
    assert cli.main(["link", "s", "a", "--reset"]) == 0  # back to the fleet file's, for a (re)started selector too
    fleet = load_fleet(SMALL_FLEET)
    selector = DcSelector(fleet)
    asyncio.run(_load_links(redis_url, Keys(prefix), selector))
    assert selector.graph.link("s", "a") == WanGraph(fleet.wan).link("s", "a")
    readings = private_runtime_dir / "r.csv"
    readings.write_text("datacenter,sample,node,inlet_c,outlet_c,supply_c\ncheap,a,0,21,28,20\ncheap,a,1,22,30,20\n")
    assert cli.main(["thermal", "replay", str(readings)]) == 0
    assert redis.xlen(Keys(prefix).readings("cheap")) == 2
    other = Keys(f"{prefix}-other")
    try:
        assert cli.main(["link", "s", "a", "--latency-ms", "41", "--prefix", other.prefix]) == 2  # no deployment
        assert redis.xlen(other.links) == 0
        redis.set(other.epoch, "e")
        assert cli.main(["link", "s", "a", "--latency-ms", "41", "--prefix", other.prefix]) == 0
        assert redis.xlen(other.links) == 1 and redis.xlen(Keys(prefix).links) == 2
    finally:
        redis.delete(other.links, other.epoch)


async def _load_links(redis_url: str, keys, selector) -> None:
    """A selector's start: the whole links stream applied (services/selector/server.py load_links)."""
    from hsched.state.redis import connect
    from services.selector.server import load_links

    redis = connect(redis_url)
    try:
        await load_links(redis, keys, selector)
    finally:
        await redis.aclose()


def test_link_to_a_redis_that_is_down_is_one_line_and_exit_1(tmp_path):
    from hsched.state.redis import port_is_free

    port = next(p for p in range(47000, 47100) if port_is_free(p))
    env = {"REDIS_URL": f"redis://127.0.0.1:{port}/0", "XDG_RUNTIME_DIR": str(tmp_path)}
    done = run_cli("link", "s", "a", "--latency-ms", "3", "--fleet", str(SMALL_FLEET), env=env)
    assert_one_line_error(done, 1, "hsched link:", f"127.0.0.1:{port}", "nothing written")


@pytest.fixture(scope="module")
def small_stack(redis_url):
    from tests.conftest import small_fleet_stack

    with small_fleet_stack(redis_url, "cli") as s:
        yield s


def test_a_rejected_submit_exits_1_and_prints_its_state(small_stack, tmp_path):
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    gw = ["--gateway", small_stack.gateway]
    rejected = run_cli("submit", "--cpu", "8", "--gpus", "4", "--gpu-memory-gib", "8", *gw, env=env)  # no node has 4
    assert rejected.returncode == 1 and "REJECTED" in rejected.stdout and "Traceback" not in rejected.stderr
    # short, with units: the DCs without GPUs grouped under one reason, the GPU DC's own reason after it
    assert "2 DCs (cheap, near): the task needs 4 GPUs in all, the DC has 0 GPUs; gpu: no node of gpu has 4 GPUs " \
           "(max 2)" in rejected.stdout, rejected.stdout
    placed = run_cli("submit", "--cpu", "1", *gw, env=env)
    assert placed.returncode == 0 and "PLACED" in placed.stdout, placed.stdout + placed.stderr
    task_id = placed.stdout.split()[0]
    line = run_cli("get", task_id, *gw, env=env)  # one line by default, the whole record with --json
    assert line.returncode == 0 and len(line.stdout.splitlines()) == 1 and line.stdout.split()[0] == task_id
    record = run_cli("get", task_id, "--json", *gw, env=env)
    assert json.loads(record.stdout)["task_id"] == task_id


def test_submit_priority_class_reaches_the_gateway(small_stack, tmp_path):
    """--priority-class: an online task without -f FILE; the flag's value is the spec's field as the gateway keeps
    it (offline without the flag: the wire's "")."""
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    gw = ["--gateway", small_stack.gateway, "--json"]
    for argv, expected in ([["--priority-class", "online", "--priority", "7"], ("online", 7)],
                           [["--priority-class", "offline"], ("offline", 0)], [[], ("", 0)]):
        done = run_cli("submit", "--cpu", "1", "--runtime-s", "0", *argv, *gw, env=env)
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stdout + done.stderr
        task_id = json.loads(done.stdout)["task"]["task_id"]
        spec = json.loads(run_cli("get", task_id, *gw, env=env).stdout)["spec"]
        assert (spec.get("priority_class", ""), spec.get("priority", 0)) == expected, spec
        assert run_cli("release", task_id, *gw, env=env).returncode == 0


def test_replay_uses_the_running_stacks_fleet_and_prefix(small_stack, redis_url, private_runtime_dir, capsys):
    """No --fleet, no --prefix: the entry vertices are drawn from the stack's fleet (the embedded default fleet's
    are not the small fleet's: every Submit would be refused) and the utilisation read under its prefix."""
    localstate.write_stack({"gateway": small_stack.gateway, "redis_url": redis_url,
                            "prefix": small_stack.config.prefix, "fleet": str(SMALL_FLEET)})
    assert cli.main(["replay", "thunder", "--limit", "5", "--duration", "1", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert not summary["errors"] and summary["first_answers"].get("placed"), summary
    utilisation = {r["datacenter"]: r["cpu_util"] for r in summary["datacenters"] if r["datacenter"] != "-"}
    assert set(utilisation) == {"cheap", "near", "gpu"} and None not in utilisation.values(), summary


def test_job_watch_ends_at_the_jobs_final_state(small_stack, tmp_path):
    """As `hsched watch TASK`: the job's events until its final one (cancelled here), then exit 1 (it did not
    succeed: a script's `hsched job watch J && next` stops); a job already final prints its line and exits at
    once, unless --after asks for its events."""
    import select

    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    gw = ["--gateway", small_stack.gateway]
    job_file = tmp_path / "job.yaml"
    job_file.write_text("name: watched\nstages:\n  - {name: a, tasks: 1, runtime_s: 3600, resources: {cpu_milli: 100}}\n")
    submitted = run_cli("submit", "-f", str(job_file), *gw, env=env)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.split()[0]
    watch = subprocess.Popen([sys.executable, "-m", "hsched.cli", "job", "watch", job_id, *gw], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
    try:
        assert select.select([watch.stdout], [], [], 120)[0], "the watch printed nothing"  # a hang guard only
        first = watch.stdout.readline()
        assert "job_submitted" in first, first  # streaming: the job was not final when the watch began
        assert run_cli("job", "cancel", job_id, *gw, env=env).returncode == 0
        out, err = watch.communicate(timeout=120)
    finally:
        watch.kill()
    assert watch.returncode == 1 and "Traceback" not in err, err
    assert "job_cancelled" in out.strip().splitlines()[-1], out
    again = run_cli("job", "watch", job_id, *gw, env=env)
    assert again.returncode == 1 and again.stdout.split()[:2] == [job_id, "CANCELLED"], again.stdout + again.stderr
    history = run_cli("job", "watch", job_id, "--after", "0", *gw, env=env)
    lines = history.stdout.strip().splitlines()
    assert history.returncode == 1 and "job_submitted" in lines[0] and "job_cancelled" in lines[-1], history.stdout


def test_an_empty_page_prints_its_empty_list(small_stack, tmp_path):
    """protobuf's JSON mapping leaves an empty repeated field out: `{}` for no jobs, where a script reads .jobs."""
    gw, env = ["--gateway", small_stack.gateway], {"XDG_RUNTIME_DIR": str(tmp_path)}
    for argv, key in ((["list", "--tenant", "nobody"], "tasks"), (["job", "list", "--tenant", "nobody"], "jobs")):
        done = run_cli(*argv, "-o", "json", *gw, env=env)
        assert done.returncode == 0 and json.loads(done.stdout) == {key: []}, done.stdout + done.stderr


def test_a_reader_that_leaves_early_ends_the_output_quietly(small_stack, tmp_path):
    """`hsched list --json | head -1`: the pipe's reader is gone before the CLI writes (closed first here, so the
    write always meets a closed pipe): no BrokenPipeError traceback, exit 141 as for any tool cut off by SIGPIPE."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-m", "hsched.cli", "list", "--json", "--gateway", small_stack.gateway],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120,
                              env={**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)})
    finally:
        os.close(write_end)
    assert done.returncode == 141 and done.stderr == "", done.stderr


def test_train_writes_a_new_run_directory_and_never_the_shipped_model(tmp_path):
    shipped = Path(__file__).resolve().parents[1] / "models" / "per_dqn_path.pt"
    before = shipped.read_bytes()
    done = subprocess.run([sys.executable, "-m", "hsched.cli", "train", "per-dqn", "--steps", "500", "--quiet"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    [run] = (tmp_path / "runs").iterdir()
    assert run.name.startswith("per-dqn-") and (run / "per_dqn_path.pt").is_file()
    assert (run / "per_dqn_path.json").is_file() and f"wrote runs/{run.name}/" in done.stderr
    assert shipped.read_bytes() == before


def test_train_resume_needs_the_checkpoint_it_continues(tmp_path):
    done = run_cli("train", "per-dqn", "--resume", env={"XDG_RUNTIME_DIR": str(tmp_path)})
    assert_one_line_error(done, 2, "--resume", "--out is required")


def test_train_init_is_checked_before_training(tmp_path):
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    assert_one_line_error(run_cli("train", "double-dqn", "--init", "models/ba3c_dag.pt", env=env), 2, "--init",
                          "fine-tunes only ba3c, a3c")
    assert_one_line_error(run_cli("train", "ba3c", "--init", str(tmp_path / "none.pt"), env=env), 2, "--init",
                          "no checkpoint at")
    assert_one_line_error(run_cli("train", "ba3c", "--init", "models/ba3c_dag.pt", "--resume", "--out",
                                  str(tmp_path / "x.pt"), env=env), 2, "--init", "give one of them")


# -- hsched watch rides out a gateway that goes away -----------------------------------------------------------

# A stand-in gateway (real gRPC, its own process, so that a SIGKILL closes its sockets as a crash does): task t1
# is RUNNING; Watch from "0" streams events 1-0 and 2-0 of t1 and then nothing; Watch after "2-0" streams 3-0,
# t1 SUCCEEDED. Each Watch prints its after_event_id on stdout.
FAKE_GATEWAY = '''
import sys, time
from concurrent import futures
import grpc
from hsched.v1 import common_pb2 as pb, gateway_pb2_grpc

EVENTS = [("1-0", pb.TASK_STATE_PLACED), ("2-0", pb.TASK_STATE_RUNNING), ("3-0", pb.TASK_STATE_SUCCEEDED)]

class Gateway(gateway_pb2_grpc.GatewayServicer):
    def Get(self, request, context):
        return pb.Task(task_id=request.task_id, state=pb.TASK_STATE_RUNNING)

    def Watch(self, request, context):
        print("watch after", request.after_event_id, flush=True)
        for event_id, state in EVENTS[:2] if request.after_event_id == "0" else EVENTS:
            if tuple(map(int, event_id.split("-"))) > tuple(map(int, (request.after_event_id + "-0").split("-")[:2])):
                yield pb.TaskEvent(event_id=event_id, task_id="t1", kind="state", state=state)
        while context.is_active():
            time.sleep(0.05)

server = grpc.server(futures.ThreadPoolExecutor(4))
gateway_pb2_grpc.add_GatewayServicer_to_server(Gateway(), server)
port = server.add_insecure_port("127.0.0.1:0")
server.start()
print(port, flush=True)
server.wait_for_termination()
'''


def _fake_gateway(tmp_path: Path) -> tuple[subprocess.Popen, str]:
    script = tmp_path / "fake_gateway.py"
    script.write_text(FAKE_GATEWAY)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    return proc, f"127.0.0.1:{proc.stdout.readline().strip()}"


def test_watch_resumes_after_its_last_event_when_its_gateway_is_killed(tmp_path):
    """Two gateways behind one balanced target; the one streaming the Watch is killed (SIGKILL) after two events:
    the watch resumes on the other after 2-0, prints 3-0 (t1 SUCCEEDED) and exits 0, every event once. It
    exited 1 with `UNAVAILABLE: Stream removed`. With no gateway left it gives up after its retries: one line."""
    import select
    import signal

    gateways = [_fake_gateway(tmp_path) for _ in range(2)]
    try:
        env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
        target = "ipv4:" + ",".join(addr for _, addr in gateways)
        watch = subprocess.Popen([sys.executable, "-m", "hsched.cli", "watch", "t1", "--gateway", target],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        lines = []
        for _ in range(2):
            assert select.select([watch.stdout], [], [], 60)[0], "the watch printed nothing"
            lines.append(watch.stdout.readline().split()[0])
        assert lines == ["1-0", "2-0"]
        ready = select.select([p.stdout for p, _ in gateways], [], [], 10)[0]
        [streaming] = [(p, addr) for p, addr in gateways if p.stdout in ready]
        assert streaming[0].stdout.readline().strip() == "watch after 0"
        streaming[0].send_signal(signal.SIGKILL)
        out, err = watch.communicate(timeout=60)
        assert watch.returncode == 0 and err == "", err
        assert [line.split()[0] for line in out.splitlines()] == ["3-0"] and "SUCCEEDED" in out
        [other] = [p for p, _ in gateways if p is not streaming[0]]
        assert other.stdout.readline().strip() == "watch after 2-0"
        # the last gateway goes too: bounded retries (0.25 s doubling, 5 times), then one line, exit 1
        watch = subprocess.Popen([sys.executable, "-m", "hsched.cli", "watch", "t1", "--gateway",
                                  next(a for p, a in gateways if p is other)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        assert select.select([watch.stdout], [], [], 60)[0], "the watch printed nothing"
        other.send_signal(signal.SIGKILL)
        out, err = watch.communicate(timeout=60)
        assert watch.returncode == 1 and err.startswith("hsched: UNAVAILABLE:") and err.count("\n") == 1, err
    finally:
        for proc, _ in gateways:
            proc.kill()
            proc.wait()


# -- hsched train --resume: only the run it continues, also after a kill -9 ------------------------------------

SMALL_SWF = Path(__file__).resolve().parent / "traces" / "small.swf"


def test_train_resume_refuses_a_missing_checkpoint_and_another_runs(tmp_path):
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    data = ["--fleet", str(SMALL_FLEET), "--trace", str(SMALL_SWF), "--quiet"]
    assert_one_line_error(run_cli("train", "double-dqn", *data, "--steps", "2000", "--out", str(tmp_path / "x.pt"),
                                  "--resume", env=env),
                          2, "--resume: nothing to resume: no training checkpoint at", "x_resume.pt")
    assert not list(tmp_path.glob("x*"))
    done = run_cli("train", "double-dqn", *data, "--steps", "2000", "--seed", "1", "--out", str(tmp_path / "x.pt"),
                   env=env)
    assert done.returncode == 0, done.stderr
    before = (tmp_path / "x.json").read_bytes()
    done = run_cli("train", "double-dqn", "--fleet", str(SMALL_FLEET), "--trace", "kth", "--steps", "4000", "--seed",
                   "7", "--out", str(tmp_path / "x.pt"), "--resume", "--quiet", env=env)
    assert_one_line_error(done, 2, f"--resume: {tmp_path / 'x_resume.pt'} was trained with --seed 1 and --trace "
                                   f"{SMALL_SWF}; this run asks --seed 7 --trace kth")
    done = run_cli("train", "double-dqn", "--fleet", str(SMALL_FLEET.parent / "gpu_cheap.yaml"), "--trace",
                   str(SMALL_SWF), "--steps", "4000", "--seed", "1", "--out", str(tmp_path / "x.pt"), "--resume",
                   "--quiet", env=env)
    assert_one_line_error(done, 2, "--resume:", "was trained with --fleet", "this run asks --fleet",
                          "gpu_cheap.yaml")
    assert (tmp_path / "x.json").read_bytes() == before  # nothing trained, nothing written


def test_train_killed_mid_run_resumes_where_it_was_saved_and_ends_as_one_run(tmp_path):
    import signal
    import time

    from hsched.rl import checkpoint

    data = ["--fleet", str(SMALL_FLEET), "--trace", str(SMALL_SWF), "--steps", "6000", "--quiet"]
    out = tmp_path / "killed.pt"
    proc = subprocess.Popen([sys.executable, "-m", "hsched.cli", "train", "double-dqn", *data,
                             "--checkpoint-seconds", "0", "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    resume = tmp_path / "killed_resume.pt"
    deadline = time.monotonic() + 300
    while not (resume.exists() and resume.with_suffix(".json").exists()) and proc.poll() is None:
        assert time.monotonic() < deadline, "no periodic checkpoint"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, proc.stderr.read()
    assert not out.exists() and checkpoint.load_state(resume)["step"] < 6000  # killed mid-run, its state saved
    done = run_cli("train", "double-dqn", *data, "--out", str(out), "--resume")
    assert done.returncode == 0, done.stderr
    done = run_cli("train", "double-dqn", *data, "--out", str(tmp_path / "straight.pt"))
    assert done.returncode == 0, done.stderr
    a, b = checkpoint.load_state(tmp_path / "straight.pt")["q"], checkpoint.load_state(out)["q"]
    assert all((a[k] == b[k]).all() for k in a)
    assert checkpoint.load_metadata(out)["steps"] == checkpoint.load_metadata(tmp_path / "straight.pt")["steps"]
