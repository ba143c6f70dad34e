"""The CLI finds the stack `hsched up` runs, and its task commands talk to a real gateway."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hsched import cli, localstate


def test_commands_use_the_running_stack_unless_the_environment_says_otherwise(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("HSCHED_GATEWAY", raising=False)
    assert cli._redis_url() is None  # nothing running, nothing set
    path = localstate.write_stack({"gateway": "127.0.0.1:4711", "redis_url": "redis://127.0.0.1:4712/0"})
    assert cli._redis_url() == "redis://127.0.0.1:4712/0"
    monkeypatch.setenv("REDIS_URL", "redis://elsewhere:6379/1")
    assert cli._redis_url() == "redis://elsewhere:6379/1"
    path.write_text("{not json")
    monkeypatch.delenv("REDIS_URL")
    assert cli._running_stack() == {} and cli._redis_url() is None
    assert not path.exists()  # a broken file is cleaned up


def test_the_password_comes_from_the_recorded_password_file_never_the_stack_file(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("HSCHED_GATEWAY", raising=False)
    with pytest.raises(ValueError, match="password"):
        localstate.write_stack({"gateway": "127.0.0.1:4711", "redis_url": "redis://:s3cret@127.0.0.1:4712/0"})
    secret = tmp_path / "redis.password"
    secret.write_text("s3cret\n")
    path = localstate.write_stack({"gateway": "127.0.0.1:4711", "redis_url": "redis://127.0.0.1:4712/0",
                                   "redis_password_file": str(secret)})
    assert "s3cret" not in path.read_text()
    assert cli._redis_url() == "redis://:s3cret@127.0.0.1:4712/0"


def test_several_stacks_need_a_choice_and_dead_ones_are_forgotten(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("HSCHED_GATEWAY", raising=False)
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


def test_unknown_experiment_and_bad_submit_are_refused(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["eval", "nope"])
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["submit", "--cpu", "lots"])
    assert "invalid" in capsys.readouterr().err
