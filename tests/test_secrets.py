"""No secret on a command line, in a log or in the running-stack file (issue 14, item 3), through real processes:
`hsched up` with its embedded Redis (which requires a generated password), the CLI finding that stack through
its private stack file, and the Stack's private run/log directories."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from redis.connection import parse_url

from hsched import localstate
from hsched.runtime import common_args
from hsched.stack import Stack, StackConfig
from hsched.state.redis import (
    RedisUnavailable,
    _sentinel_auth,
    free_port,
    redact_url,
    url_with_password,
    url_without_password,
)
from hsched.v1 import common_pb2 as pb
from hsched.v1 import gateway_pb2, gateway_pb2_grpc
from tests.conftest import ROOT, SMALL_FLEET, delete_prefix

pytestmark = pytest.mark.slow


def _descendants(root: int) -> list[int]:
    """Every live process below `root` (services run in their own sessions, but stay its children)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _files_holding(root: Path, secret: bytes) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and secret in p.read_bytes())


def _cli(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hsched.cli", *argv], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "tls"])
def test_hsched_up_keeps_the_redis_password_off_command_lines_logs_and_its_stack_file(tls, tmp_path, monkeypatch):
    runtime, state, logs = tmp_path / "xdg", tmp_path / "state", tmp_path / "logs"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "HSCHED_GATEWAY")}
    env.update(XDG_RUNTIME_DIR=str(runtime), PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    port, prefix = free_port(), f"test-secrets-{uuid.uuid4().hex[:8]}"
    out_path = tmp_path / "up.out"
    with open(out_path, "w") as out:
        up = subprocess.Popen([sys.executable, "-m", "hsched.cli", "up", "--fleet", SMALL_FLEET, "--port", str(port),
                               "--prefix", prefix, "--state-dir", str(state), "--log-dir", str(logs),
                               "--log-level", "INFO", "--no-thermal", "--auth",
                               *(["--tls"] if tls else [])],
                              env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not localstate.read_stacks():
            assert up.poll() is None, out_path.read_text()
            assert time.monotonic() < deadline, f"hsched up did not start: {out_path.read_text()}"
            time.sleep(0.2)
        password = (state / "redis.password").read_text().strip()
        assert len(password) >= 32 and stat.S_IMODE((state / "redis.password").stat().st_mode) == 0o600
        secrets = {"redis.password": password, "admin.token": (state / "admin.token").read_text().strip()}
        assert stat.S_IMODE((state / "admin.token").stat().st_mode) == 0o600

        # the stack file: private, in the runtime dir, no secret — yet enough for the CLI to reach the stack
        [info] = localstate.read_stacks()
        stack_file = localstate.stack_file(f"127.0.0.1:{port}")
        assert stack_file.parent == runtime / "hsched" and stack_file.exists()
        assert stat.S_IMODE(stack_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(stack_file.parent.stat().st_mode) == 0o700
        assert info["gateway"] == f"127.0.0.1:{port}"
        assert not [name for name, secret in secrets.items() if secret in stack_file.read_text()]
        assert info["token_file"] == str(state / "admin.token")  # a path, which the CLI reads
        if tls:  # every hop on TLS, Redis too (an ACL user; the CLI finds the CA and certificate by their paths)
            assert info["redis_url"].startswith("rediss://hsched@") and info["tls_ca"] == str(state / "tls" / "ca.crt")
            assert info["redis_tls_ca"] == info["tls_ca"] and info["redis_tls_key"] == str(state / "tls" / "redis.key")

        submitted = _cli("submit", "--cpu", "2", "--memory-gib", "2", env=env)  # no --gateway: the running stack
        assert submitted.returncode == 0 and "PLACED" in submitted.stdout, submitted.stderr
        task_id = submitted.stdout.split()[0]
        released = _cli("release", task_id, env=env)
        assert released.returncode == 0 and "RELEASED" in released.stdout, released.stderr
        linked = _cli("link", "a", "b", "--latency-ms", "3", "--prefix", prefix, env=env)  # Redis via the stack file
        assert linked.returncode == 0 and "-" in linked.stdout, linked.stderr

        pids = _descendants(up.pid)
        names = " ".join(_cmdline(p) for p in pids)
        assert "services.gateway" in names and "services.placer" in names and "redis-server" in names, names
        assert "services.selector" in names
        for pid in [up.pid, *pids]:
            assert not [name for name, secret in secrets.items() if secret in _cmdline(pid)], _cmdline(pid)
            assert "--redis-url" not in _cmdline(pid)
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait(10)
    output = out_path.read_text()
    assert up.returncode == 0, output
    assert not [name for name, secret in secrets.items() if secret in output]
    assert ":***@127.0.0.1" in output  # the table shows the Redis URL, redacted
    assert not stack_file.exists()  # removed by its `hsched up` on the way out
    assert stat.S_IMODE(logs.stat().st_mode) == 0o700 and (logs / "gateway.log").exists()  # the user's: kept
    for name, secret in secrets.items():
        assert _files_holding(logs, secret.encode()) == [], name
        # the only files with a secret: its own file (and the redis-server's config), 0600 in 0700 dirs
        holding = _files_holding(state, secret.encode())
        allowed = {name, "redis/redis.conf"} if name == "redis.password" else {name}
        assert {p.relative_to(state).as_posix() for p in holding} == allowed
        for p in holding:
            assert stat.S_IMODE(p.stat().st_mode) == 0o600 and stat.S_IMODE(p.parent.stat().st_mode) == 0o700


def test_the_stack_file_refuses_a_planted_symlink_and_two_stacks_keep_two_files(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    planted = localstate.stack_file("127.0.0.1:4711")
    planted.symlink_to(victim)
    with pytest.raises(localstate.LocalStateError, match="symlink"):
        localstate.write_stack({"gateway": "127.0.0.1:4711"})
    assert victim.read_text() == "precious\n" and planted.is_symlink()
    assert not list(planted.parent.glob(".*.tmp"))  # nothing left behind either
    planted.unlink()

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # a second live `hsched up`
    try:
        first = localstate.write_stack({"gateway": "127.0.0.1:4711"})
        second = localstate.write_stack({"gateway": "127.0.0.1:4712", "pid": other.pid})
        assert first != second and first.exists() and second.exists()
        assert sorted(s["gateway"] for s in localstate.read_stacks()) == ["127.0.0.1:4711", "127.0.0.1:4712"]
        with pytest.raises(localstate.LocalStateError, match="127.0.0.1:4711.*127.0.0.1:4712"):
            localstate.pick_stack()
        assert localstate.pick_stack("127.0.0.1:4712")["pid"] == other.pid
    finally:
        other.kill()
        other.wait()
    assert [s["gateway"] for s in localstate.read_stacks()] == ["127.0.0.1:4711"]  # the dead one's is cleaned
    assert not second.exists()


def test_a_stack_of_several_gateways_is_picked_by_any_one_of_their_addresses(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    localstate.write_stack({"gateway": "ipv4:127.0.0.1:4711,127.0.0.1:4713", "token": "t"})
    for asked in ("ipv4:127.0.0.1:4711,127.0.0.1:4713", "127.0.0.1:4711", "127.0.0.1:4713"):
        assert localstate.pick_stack(asked)["token"] == "t", asked
    assert localstate.pick_stack("127.0.0.1:4712") == {}  # not one of its gateways
    assert localstate.pick_stack("127.0.0.1:471") == {}  # a prefix of an address is not the address


def test_a_runtime_dir_that_is_a_symlink_or_someone_elses_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / f"hsched-{os.getuid()}").symlink_to(elsewhere)
    with pytest.raises(localstate.LocalStateError, match="not a directory"):
        localstate.write_stack({"gateway": "127.0.0.1:4711"})
    assert list(elsewhere.iterdir()) == []
    (tmp_path / f"hsched-{os.getuid()}").unlink()
    loose = tmp_path / f"hsched-{os.getuid()}"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    localstate.write_stack({"gateway": "127.0.0.1:4711"})
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700  # ours but open: closed before use


def test_the_redis_url_can_come_from_a_file(tmp_path):
    url_file = tmp_path / "redis-url"
    url_file.write_text("redis://:s3cret@127.0.0.1:6390/2\n")
    args = common_args("t").parse_args(["--redis-url-file", str(url_file)])
    assert args.redis_url == "redis://:s3cret@127.0.0.1:6390/2"
    with pytest.raises(SystemExit):
        common_args("t").parse_args(["--redis-url-file", str(tmp_path / "missing")])


BASES = ["redis://127.0.0.1:6379/0", "rediss://hsched@redis.example:6380/2", "redis+sentinel://127.0.0.1:26379/m/0",
         "redis+sentinel://u@h1:1,h2:2/m"]


@given(st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=6, max_size=40), st.sampled_from(BASES))
def test_a_redacted_url_never_shows_its_password_and_the_password_round_trips(password, base):
    from urllib.parse import quote

    assume(password not in base and quote(password, safe="") not in base)
    url = url_with_password(base, password)
    for shown in (redact_url(url), url_without_password(url), redact_url(f"{base}?password={quote(password)}")):
        assert password not in shown and quote(password, safe="") not in shown
    assert ":***@" in redact_url(url)
    if base.startswith("redis+sentinel"):
        assert _sentinel_auth(url)["password"] == password
    else:  # what the services' client reads back from the URL
        assert parse_url(url)["password"] == password and parse_url(url_without_password(url)).get("password") is None


def _place_one(stack: Stack) -> None:
    with grpc.insecure_channel(stack.gateway) as ch:
        reply = gateway_pb2_grpc.GatewayStub(ch).Submit(gateway_pb2.SubmitRequest(task=pb.TaskSpec(
            tenant="t", replicas=1, runtime_s=3600, resources=pb.Resources(cpu_milli=1000, memory_mib=1024))),
            timeout=60)
    assert reply.task.state == pb.TASK_STATE_PLACED, reply


def test_the_run_dir_is_private_and_removed_on_a_clean_stop_unless_kept(redis_url, tmp_path):
    prefix = f"test-logs-{uuid.uuid4().hex[:8]}"
    base = dict(fleet_path=SMALL_FLEET, redis_url=redis_url, prefix=prefix, gateway_port=0, thermal=False,
                metrics=False)
    kept_dirs: list[Path] = []
    try:
        with Stack(StackConfig(**base)) as stack:
            _place_one(stack)
            assert stat.S_IMODE(stack.run_dir.stat().st_mode) == 0o700
            assert stat.S_IMODE((stack.log_dir / "gateway.log").stat().st_mode) == 0o600
        assert not stack.run_dir.exists() and stack.logs_kept is None

        with Stack(StackConfig(**base, keep_logs=True)) as kept:
            kept_dirs.append(kept.run_dir)
        assert kept.logs_kept == kept.run_dir and (kept.run_dir / "gateway.log").exists()

        mine = tmp_path / "my-logs"
        with Stack(StackConfig(**base, log_dir=str(mine))) as given:
            pass
        assert (mine / "gateway.log").exists() and not given.run_dir.exists()  # the port files go, the logs stay

        failed = Stack(StackConfig(**base, policy="no-such-policy"))
        kept_dirs.append(failed.run_dir)
        with pytest.raises(RuntimeError, match="exited"):
            failed.start(timeout_s=120)
        # the placer that exited first says why; the others may be stopped before they logged anything
        assert failed.logs_kept == failed.run_dir and any(
            "no-such-policy" in log.read_text() for log in failed.run_dir.glob("placer-*.log"))
    finally:
        delete_prefix(redis_url, prefix)
        for run_dir in kept_dirs:  # what the test made the stacks keep
            shutil.rmtree(run_dir, ignore_errors=True)


def test_a_redis_password_file_others_could_read_is_refused_in_one_line(tmp_path):
    (tmp_path / "redis.password").write_text("guessable\n")
    os.chmod(tmp_path / "redis.password", 0o644)
    stack = Stack(StackConfig(fleet_path=SMALL_FLEET, state_dir=str(tmp_path), gateway_port=0))
    with pytest.raises(RedisUnavailable, match=r"redis.password: must be a 0600 file") as caught:
        stack.start()
    assert "\n" not in str(caught.value) and "guessable" not in str(caught.value)
    assert stack.redis is None and not stack.run_dir.exists()  # nothing started, nothing left behind
