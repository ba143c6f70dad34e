"""Run the whole stack as local processes: Redis (embedded unless given), thermal, selector, one placer
per data center, gateway. Used by `hsched up`, the integration tests and the benchmarks."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hsched.domain.fleet import Fleet, load_fleet
from hsched.state.epoch import claim_sync
from hsched.state.keys import Keys
from hsched.state.redis import EmbeddedRedis, ReplicaSet, connect_sync, free_port


@dataclass
class Service:
    name: str
    args: list[str]
    proc: subprocess.Popen | None = None
    port: int = 0
    metrics_port: int = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class StackConfig:
    fleet_path: str | None = None
    redis_url: str | None = None  # None: start an embedded redis-server
    prefix: str = "hsched"
    policy: str = "bestfit"
    gpu_policy: str | None = None  # policy of the DCs with GPU cards (None: `policy` everywhere)
    path_finder: str = "dijkstra"  # the selector's route source: dijkstra or per-dqn (checked against Dijkstra)
    thermal: bool = True
    traces: str = "none"
    metrics: bool = True
    gateway_port: int = 50051
    log_dir: str | None = None
    log_level: str = "WARNING"
    extra_env: dict[str, str] = field(default_factory=dict)
    # Durability (embedded Redis): AOF in <state_dir>/redis, reused by the next start unless `fresh`;
    # state_dir None = a temporary data dir removed on stop (tests). The epoch marker goes to <state_dir>/epoch.
    state_dir: str | None = None
    fresh: bool = False  # wipe <state_dir> first (a new deployment)
    redis_appendfsync: str = "everysec"  # or "always": fsync every write before it is acknowledged
    redis_replicas: int = 0  # > 0 (embedded only): a master, this many replicas and a Sentinel; writes WAIT for all


def default_state_dir(prefix: str) -> Path:
    """$XDG_STATE_HOME/hsched/<prefix>, else ~/.local/state/hsched/<prefix>."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "hsched" / prefix


class Stack:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.fleet: Fleet = load_fleet(config.fleet_path)
        self.redis: EmbeddedRedis | ReplicaSet | None = None
        self.redis_url = config.redis_url or ""
        self.epoch = ""
        self.state_dir = Path(config.state_dir).expanduser() if config.state_dir else None
        self.services: dict[str, Service] = {}
        self.run_dir = Path(tempfile.mkdtemp(prefix="hsched-stack-"))
        self.log_dir = Path(config.log_dir) if config.log_dir else self.run_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)

    # -- start -------------------------------------------------------------------------------------------------

    def _common(self, name: str) -> list[str]:
        c = self.config
        args = ["--redis-url", self.redis_url, "--prefix", c.prefix, "--traces", c.traces,
                "--port-file", str(self.run_dir / f"{name}.port"), "--log-level", c.log_level,
                "--expect-epoch", self.epoch]
        if isinstance(self.redis, ReplicaSet):  # an external REDIS_URL's replicas: HSCHED_REDIS_MIN_REPLICAS
            args += ["--redis-min-replicas", str(self.redis.replicas)]
        if c.fleet_path:
            args += ["--fleet", str(c.fleet_path)]
        if c.metrics:
            args += ["--metrics-port", str(free_port())]
        return args

    def _spawn(self, name: str, module: str, args: list[str]) -> Service:
        log = open(self.log_dir / f"{name}.log", "ab")
        env = {**os.environ, **self.config.extra_env, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen([sys.executable, "-m", module, *args], stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        metrics = int(args[args.index("--metrics-port") + 1]) if "--metrics-port" in args else 0
        svc = Service(name, args, proc, metrics_port=metrics)
        self.services[name] = svc
        return svc

    def _wait_ready(self, names: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = set(names)
        while pending:
            for name in sorted(pending):
                svc = self.services[name]
                if svc.proc and svc.proc.poll() is not None:
                    tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"{name} exited with {svc.proc.returncode} while starting:\n{tail}")
                port_file = self.run_dir / f"{name}.port"
                if port_file.exists() and _serving(f"127.0.0.1:{port_file.read_text().strip()}"):
                    svc.port = int(port_file.read_text())
                    pending.discard(name)
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"not ready after {timeout_s:.0f} s: {sorted(pending)} (logs in {self.log_dir})")
            time.sleep(0.05)

    def start(self, timeout_s: float = 120.0) -> Stack:
        try:
            self._start_redis()
            thermal = []
            if self.config.thermal:
                self._spawn("thermal", "services.thermal", [*self._common("thermal"), "--listen", "127.0.0.1:0"])
                thermal = ["thermal"]
            self._spawn("selector", "services.selector", [*self._common("selector"), "--listen", "127.0.0.1:0",
                                                          "--path-finder", self.config.path_finder])
            self._wait_ready([*thermal, "selector"], timeout_s)
            placers = []
            for dc in self.fleet.datacenters:
                name = f"placer-{dc.name}"
                has_gpus = dc.capacity_total().gpu_count > 0
                policy = self.config.gpu_policy if has_gpus and self.config.gpu_policy else self.config.policy
                args = [*self._common(name), "--listen", "127.0.0.1:0", "--datacenter", dc.name, "--policy", policy]
                if self.config.thermal:
                    args += ["--thermal", self.services["thermal"].target]
                self._spawn(name, "services.placer", args)
                placers.append(name)
            self._wait_ready(placers, timeout_s)
            placer_map = ",".join(f"{dc.name}={self.services[f'placer-{dc.name}'].target}"
                                  for dc in self.fleet.datacenters)
            self._spawn("gateway", "services.gateway",
                        [*self._common("gateway"), "--listen", f"127.0.0.1:{self.config.gateway_port}",
                         "--selector", self.services["selector"].target, "--placers", placer_map])
            self._wait_ready(["gateway"], timeout_s)
            return self
        except BaseException:
            self.stop()
            raise

    def _start_redis(self) -> None:
        """The embedded Redis (unless a URL was given), then the epoch marker: StateLost when Redis lacks the
        epoch this state dir recorded, before any service could fold an empty ledger."""
        c = self.config
        redis_dir = None
        if self.state_dir:
            if c.fresh and self.state_dir.exists():
                shutil.rmtree(self.state_dir)
            self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            redis_dir = self.state_dir / "redis"
        if not self.redis_url:
            if c.redis_replicas:
                self.redis = ReplicaSet(c.redis_replicas, redis_dir, c.redis_appendfsync).start()
            else:
                self.redis = EmbeddedRedis(data_dir=redis_dir, appendfsync=c.redis_appendfsync).start()
            self.redis_url = self.redis.url
        epoch_file = self.state_dir / "epoch" if self.state_dir else None
        expected = epoch_file.read_text().strip() if epoch_file and epoch_file.exists() else None
        client = connect_sync(self.redis_url)
        try:
            self.epoch = claim_sync(client, Keys(c.prefix), expected, self.redis_url)
        finally:
            client.close()
        if epoch_file and not expected:
            epoch_file.write_text(self.epoch + "\n")

    @property
    def gateway(self) -> str:
        return self.services["gateway"].target

    def placer_target(self, dc: str) -> str:
        return self.services[f"placer-{dc}"].target

    # -- stop / restart ----------------------------------------------------------------------------------------

    def kill(self, name: str) -> None:
        """SIGKILL one service (a crash, for recovery tests)."""
        svc = self.services[name]
        if svc.proc and svc.proc.poll() is None:
            os.killpg(svc.proc.pid, signal.SIGKILL)
            svc.proc.wait(10)

    def restart(self, name: str, timeout_s: float = 60.0) -> Service:
        """Start a stopped/killed service again with the same arguments (and the same gRPC port)."""
        old = self.services[name]
        args = list(old.args)
        if "--listen" in args:
            args[args.index("--listen") + 1] = f"127.0.0.1:{old.port}"
        (self.run_dir / f"{name}.port").unlink(missing_ok=True)
        module = "services." + ("placer" if name.startswith("placer-") else name)
        self._spawn(name, module, args)
        self._wait_ready([name], timeout_s)
        return self.services[name]

    def rss_mib(self) -> dict[str, float]:
        out = {}
        for name, svc in self.services.items():
            if svc.proc and svc.proc.poll() is None:
                out[name] = _rss_mib(svc.proc.pid)
        if self.redis:
            out.update({name: _rss_mib(pid) for name, pid in self.redis.pids().items()})
        return out

    def stop(self) -> None:
        order = ["gateway", *[n for n in self.services if n.startswith("placer-")], "selector", "thermal"]
        for name in order:
            svc = self.services.get(name)
            if svc and svc.proc and svc.proc.poll() is None:
                svc.proc.send_signal(signal.SIGTERM)
        for name in order:
            svc = self.services.get(name)
            if svc and svc.proc:
                try:
                    svc.proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(svc.proc.pid, signal.SIGKILL)
                    svc.proc.wait(5)
        if self.redis:
            self.redis.stop()

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _serving(target: str) -> bool:
    try:
        with grpc.insecure_channel(target) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def _rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0
