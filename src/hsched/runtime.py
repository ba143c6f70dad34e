"""Process bootstrap shared by the four services: common flags, logging, tracing, signal handling."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable

from redis.exceptions import AuthenticationError, NoPermissionError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from hsched.cancel import cancel_and_wait
from hsched.domain.errors import FleetError
from hsched.security.pki import PkiError
from hsched.security.tls import TlsFiles
from hsched.state.epoch import EXIT_STATE_LOST, EpochGuard, StateLost
from hsched.state.ledger import LayoutConflict
from hsched.state.redis import describe_redis_error
from hsched.telemetry import MetricsServer, setup_tracing

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
TRACE_EXPORTERS = ("none", "console", "otlp")


def common_args(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--fleet", default=os.environ.get("HSCHED_FLEET") or None,
                   help="fleet YAML (default: the embedded Abilene 11-DC fleet)")
    url = p.add_mutually_exclusive_group()
    url.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
                     help="Redis URL (default: $REDIS_URL). One with a password belongs in REDIS_URL or "
                          "--redis-url-file: a command line shows in ps")
    url.add_argument("--redis-url-file", dest="redis_url", action=_ReadUrlFile, metavar="FILE",
                     help="read the Redis URL from this file (e.g. a mounted secret)")
    p.add_argument("--prefix", default=os.environ.get("HSCHED_PREFIX", "hsched"), help="Redis key prefix")
    p.add_argument("--expect-epoch", default=os.environ.get("HSCHED_EPOCH") or None,
                   help="refuse to serve unless Redis holds this epoch marker (set by `hsched up`); without it, "
                        "adopt the marker Redis holds or create one")
    # (a string default goes through `type`: a bad environment value is argparse's one-line error naming the flag)
    p.add_argument("--redis-min-replicas", type=int, default=os.environ.get("HSCHED_REDIS_MIN_REPLICAS", "0"),
                   help="Redis replicas that must hold a ledger append / task event before it is acknowledged "
                        "(WAIT); fewer in time answers UNAVAILABLE (env HSCHED_REDIS_MIN_REPLICAS)")
    p.add_argument("--redis-wait-ms", type=int, default=os.environ.get("HSCHED_REDIS_WAIT_MS", "1000"),
                   help="how long a write waits for --redis-min-replicas (env HSCHED_REDIS_WAIT_MS)")
    p.add_argument("--listen", default="127.0.0.1:0", help="gRPC address (port 0 = any free port)")
    p.add_argument("--metrics-port", type=int, default=-1, help="Prometheus /metrics port (0 = any, -1 = off)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address /metrics binds (0.0.0.0 in containers)")
    p.add_argument("--traces", default=os.environ.get("HSCHED_TRACES", "none"), choices=TRACE_EXPORTERS,
                   help="OpenTelemetry span exporter (env HSCHED_TRACES)")
    p.add_argument("--port-file", default="", help="write the bound gRPC port here once serving")
    p.add_argument("--log-level", default=os.environ.get("HSCHED_LOG_LEVEL", "INFO"), type=str.upper,
                   choices=LOG_LEVELS, help="env HSCHED_LOG_LEVEL")
    p.add_argument("--tls-dir", default=os.environ.get("HSCHED_TLS_DIR") or None,
                   help="serve TLS and dial peers over mutual TLS with this service's certificate from DIR "
                        "(`hsched certs init`); internal services then require a CA client certificate and "
                        "authorize callers per method (default: plaintext, for local development)")
    p.add_argument("--reflection", default=os.environ.get("HSCHED_REFLECTION", "on"),
                   help="on|off: serve gRPC server reflection (off in production)")
    return p


class _ReadUrlFile(argparse.Action):
    """--redis-url-file FILE: the URL is the file's first line, so a password stays off the command line."""

    def __call__(self, parser, namespace, value, option_string=None) -> None:
        try:
            with open(value) as f:
                url = f.readline().strip()
        except OSError as exc:
            parser.error(f"{option_string}: cannot read {value}: {exc.strerror}")
        if not url:
            parser.error(f"{option_string}: {value} is empty (expected a redis:// URL on its first line)")
        setattr(namespace, self.dest, url)


def tls_files(args: argparse.Namespace, role: str) -> TlsFiles | None:
    """The service's certificate (`role`) in --tls-dir, checked now so that a missing or broken file is a
    one-line exit, not a traceback at the first handshake; None without --tls-dir."""
    files = TlsFiles.of(args.tls_dir, role)
    if files is not None:
        try:
            files.read()
        except PkiError as exc:
            raise SystemExit(f"--tls-dir: {exc}") from None
    return files


def reflection_on(args: argparse.Namespace) -> bool:
    value = str(args.reflection).strip().lower()
    if value not in ("on", "off"):
        raise SystemExit(f"--reflection (HSCHED_REFLECTION): {args.reflection!r} is not on or off")
    return value == "on"


def _check_environment_choices(args: argparse.Namespace) -> None:
    """What argparse does not check in a default taken from the environment: one line, exit 2 (it was a
    traceback from logging or the tracer)."""
    for flag, env, value, allowed in (("--log-level", "HSCHED_LOG_LEVEL", str(args.log_level).upper(), LOG_LEVELS),
                                      ("--traces", "HSCHED_TRACES", args.traces, TRACE_EXPORTERS)):
        if value not in allowed:
            print(f"{flag} ({env}): {value!r} is not one of {', '.join(allowed)}", file=sys.stderr)
            raise SystemExit(2)


def run(service_name: str, args: argparse.Namespace, serve: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run `serve(stop_event)` on uvloop until SIGINT/SIGTERM sets the event."""
    _check_environment_choices(args)
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s {service_name} %(levelname)s %(name)s: %(message)s")
    setup_tracing(service_name, exporter=args.traces)
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency; plain asyncio works too
        pass

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(stop)

    try:
        asyncio.run(main())
    # credentials a retry cannot fix, or no Redis to start from (a supervisor restarts us): one line, exit 1
    except (AuthenticationError, NoPermissionError, RedisConnectionError, RedisTimeoutError) as exc:
        logging.getLogger("hsched").error("%s", describe_redis_error(args.redis_url, exc))
        raise SystemExit(1) from None
    # a bad --fleet file, or one that moves live tasks' nodes (nothing written): one line naming it, as the CLI
    # does (a restart cannot fix it)
    except (FleetError, LayoutConflict) as exc:
        logging.getLogger("hsched").error("--fleet %s: %s", getattr(args, "fleet", None) or "(the default fleet)", exc)
        raise SystemExit(2) from None


async def serve_until_stopped(stop: asyncio.Event, server, port: int | str, args: argparse.Namespace, *,
                              tasks: list[asyncio.Task] = (), metrics: MetricsServer | None = None,
                              cleanup: list[Callable[[], Awaitable[object]]] = ()) -> None:
    """Announce the port, serve until `stop`, then shut down in order: stop taking calls (2 s grace),
    cancel background tasks, run `cleanup` (engines, channels, Redis), close the metrics endpoint. `server` may
    be a list (a placer process hosting several DCs, `port` then their dc=port,... list)."""
    write_port_file(args.port_file, port)
    await stop.wait()
    await asyncio.gather(*(s.stop(grace=2) for s in (server if isinstance(server, list) else [server])))
    await cancel_and_wait(tasks)
    for close in cleanup:
        await close()
    if metrics:
        metrics.close()


async def guard_epoch(redis, keys, args: argparse.Namespace, stop: asyncio.Event) -> tuple[EpochGuard, asyncio.Task]:
    """Claim the deployment's epoch (--expect-epoch) before serving and watch it while serving; on a Redis
    that lost hsched's state, log one line and exit with EXIT_STATE_LOST (3; no traceback). The caller adds the task to its
    background tasks and calls `exit_if_lost` once stopped."""
    guard = EpochGuard(redis, keys, args.redis_url)
    try:
        await guard.claim(args.expect_epoch)
    except StateLost as exc:
        logging.getLogger("hsched").error("%s", exc)
        raise SystemExit(EXIT_STATE_LOST) from None
    return guard, asyncio.create_task(guard.watch(stop), name="epoch-watch")


def exit_if_lost(guard: EpochGuard) -> None:
    if guard.lost:
        raise SystemExit(EXIT_STATE_LOST)


def write_port_file(path: str, port: int | str) -> None:
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(str(port))
        os.replace(tmp, path)


def metrics_server(args: argparse.Namespace) -> MetricsServer | None:
    """The service's Prometheus endpoint, or None when --metrics-port is -1. A port it cannot bind is one line,
    exit 1 (a supervisor's restart may find it free), not a traceback."""
    if args.metrics_port < 0:
        return None
    try:
        return MetricsServer(args.metrics_port, args.metrics_host)
    except OSError as exc:
        raise SystemExit(f"--metrics-port {args.metrics_port} on {args.metrics_host}: cannot listen "
                         f"({exc.strerror or exc})") from None
