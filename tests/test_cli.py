"""The CLI finds the stack `hsched up` runs, and its task commands talk to a real gateway."""

from __future__ import annotations

import json

import pytest

from hsched import cli


def test_commands_use_the_running_stack_unless_the_environment_says_otherwise(tmp_path, monkeypatch):
    state = tmp_path / "stack.json"
    monkeypatch.setattr(cli, "_running_stack_file", lambda: str(state))
    monkeypatch.delenv("REDIS_URL", raising=False)
    assert cli._redis_url() is None  # nothing running, nothing set
    state.write_text(json.dumps({"gateway": "127.0.0.1:4711", "redis_url": "redis://127.0.0.1:4712/0"}))
    assert cli._redis_url() == "redis://127.0.0.1:4712/0"
    monkeypatch.setenv("REDIS_URL", "redis://elsewhere:6379/1")
    assert cli._redis_url() == "redis://elsewhere:6379/1"
    state.write_text("{not json")
    monkeypatch.delenv("REDIS_URL")
    assert cli._running_stack() == {} and cli._redis_url() is None


def test_unknown_experiment_and_bad_submit_are_refused(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["eval", "nope"])
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["submit", "--cpu", "lots"])
    assert "invalid" in capsys.readouterr().err
