"""`hsched up --prometheus` without a Prometheus, or with its port taken: one line naming the fix, exit 1, nothing
started; and the scrape config generator (hsched.telemetry.prometheus) on hand-written targets. The real server
against a real stack: tests/test_prometheus_stack.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from hsched.telemetry.prometheus import PrometheusMissing, prometheus_binary, scrape_config


def test_scrape_config_has_one_job_per_service_kind_and_names_every_target():
    config = scrape_config({"gateway": "127.0.0.1:1", "placer-b": "127.0.0.1:3", "placer-a": "127.0.0.1:2",
                            "supervisor": "127.0.0.1:4"}, interval_s=1.5)
    assert config["global"] == {"scrape_interval": "1500ms", "evaluation_interval": "1500ms"}
    assert config["scrape_configs"] == [
        {"job_name": "gateway", "static_configs": [{"targets": ["127.0.0.1:1"], "labels": {"hsched_service": "gateway"}}]},
        {"job_name": "placer", "static_configs": [
            {"targets": ["127.0.0.1:3"], "labels": {"hsched_service": "placer-b"}},
            {"targets": ["127.0.0.1:2"], "labels": {"hsched_service": "placer-a"}}]},
        {"job_name": "supervisor", "static_configs": [
            {"targets": ["127.0.0.1:4"], "labels": {"hsched_service": "supervisor"}}]}]
    assert scrape_config({}, 15)["global"]["scrape_interval"] == "15s"
    with pytest.raises(ValueError, match="redis"):
        scrape_config({"redis": "127.0.0.1:6379"})


def test_a_missing_binary_says_how_to_install_it(tmp_path):
    with pytest.raises(PrometheusMissing, match="apt-get install prometheus"):
        prometheus_binary({"PATH": str(tmp_path)})
    with pytest.raises(PrometheusMissing, match=f"HSCHED_PROMETHEUS_BIN={tmp_path}/nope is not an executable"):
        prometheus_binary({"PATH": os.defpath, "HSCHED_PROMETHEUS_BIN": str(tmp_path / "nope")})
    fake = tmp_path / "prometheus"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert prometheus_binary({"PATH": str(tmp_path)}) == str(fake)


def up(tmp_path, *args: str, path: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("HSCHED_PROMETHEUS_BIN", "REDIS_URL")}
    env.update(PATH=path, XDG_STATE_HOME=str(tmp_path / "state"))
    return subprocess.run([sys.executable, "-m", "hsched.cli", "up", "--port", "0", "--prometheus", *args],
                          capture_output=True, text=True, env=env, timeout=120)


def test_up_without_prometheus_fails_in_one_line_before_starting_anything(tmp_path):
    proc = up(tmp_path, path=str(tmp_path))  # no prometheus on this PATH
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("hsched up: ") and "apt-get install prometheus" in lines[0]
    assert not (tmp_path / "state").exists(), "nothing was started or written"


def test_up_with_the_prometheus_port_taken_fails_in_one_line(tmp_path):
    fake = tmp_path / "bin" / "prometheus"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = up(tmp_path, "--prometheus-port", str(port), path=f"{fake.parent}:{os.defpath}")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == (f"hsched up: --prometheus-port {port}: 127.0.0.1:{port} is already in use; stop "
                                   "what listens there or choose another --prometheus-port (0: any free port)")
