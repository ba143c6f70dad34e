"""`hsched`: run the local stack, submit and follow tasks, replay real traces."""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import re
import signal
import sys
import threading
from collections import Counter

import grpc

from hsched.domain.errors import ValidationError
from hsched.domain.limits import INT32_MAX, INT64_MAX, LIST_DEFAULT, LIST_MAX
from hsched.security.client import ClientCredentials, client_credentials
from hsched.v1 import common_pb2 as pb
from hsched.v1 import gateway_pb2, gateway_pb2_grpc


def _running_stack(gateway: str | None = None) -> dict:
    """The stack `hsched up` runs (hsched.localstate: one private file per stack, keyed by the gateway), so the
    other commands reach it — including its embedded Redis on a random port — without flags: the one on
    `gateway` / HSCHED_GATEWAY, else the only live one; several and no choice is a LocalStateError."""
    from hsched.localstate import pick_stack

    return pick_stack(gateway or os.environ.get("HSCHED_GATEWAY"))


FALLBACK_GATEWAY = "127.0.0.1:50051"
_JOB_ID = re.compile(r"j[0-9a-f]{20}")  # hsched.jobs.new_job_id's (a job's task ids add .<stage>.<i>)
PREFIX = "hsched"  # `hsched up --prefix`'s default (hsched.state.keys.Keys')
STACK_DEFAULT = "default: the running stack's, as `hsched up` recorded it"  # the flags _from_stack resolves
PREFIX_HELP = f"the stack's Redis key prefix ({STACK_DEFAULT}, else {PREFIX})"
GATEWAY_HELP = ("gateway address (default: $HSCHED_GATEWAY, else the stack `hsched up` runs — the only one, or "
                "name it when several run — else 127.0.0.1:50051)")
LINKS_MAXLEN = 10_000  # link metric updates kept on the links stream (approximately; probes re-publish)


def _redis_url(gateway: str | None = None) -> str | None:
    """REDIS_URL, else the running stack's Redis (its password from its password file; for a TLS Redis, its CA and
    client certificate paths go to this process' HSCHED_REDIS_TLS_* unless set, for the clients connect() makes)."""
    from hsched.localstate import stack_redis_url
    from hsched.state.redis import RedisTls

    if url := os.environ.get("REDIS_URL"):
        from hsched.state.redis import SENTINEL_SCHEME, redact_url

        scheme, sep, _ = url.partition("://")
        if not sep or scheme not in ("redis", "rediss", "unix", SENTINEL_SCHEME):
            raise ValidationError("REDIS_URL", "must be a redis://, rediss://, unix:// or redis+sentinel:// URL",
                                  redact_url(url))
        return url
    stack = _running_stack(gateway)
    for name in RedisTls.ENV:
        if stack.get(_stack_key(name)):
            os.environ.setdefault(name, stack[_stack_key(name)])
    return stack_redis_url(stack)


def _from_stack(args, name: str, fallback=None):
    """`args.<name>` when the flag was given, else what `hsched up` recorded for the running stack (the one on
    --gateway where the command has that flag, else the only one), else `fallback`. The commands that act on a
    stack's Redis (link, replay, thermal replay) take its fleet, key prefix and time factor this way, as they take
    its Redis URL: another value would check against another WAN, or write keys the stack never reads."""
    value = getattr(args, name)
    if value is None:
        value = _running_stack(getattr(args, "gateway", None)).get(name)
    return fallback if value is None else value


def _stack_key(env_name: str) -> str:
    """The stack file's key of a Redis TLS file: HSCHED_REDIS_TLS_CA -> redis_tls_ca (written by cmd_up)."""
    return env_name.lower().removeprefix("hsched_")


def _credentials(args) -> ClientCredentials:
    """The token and TLS settings for `args.gateway` (hsched.security.client); the running stack's token file
    and CA only for that stack's own gateway: its whole target or any one of its gateways' addresses
    (localstate.pick_stack)."""
    from hsched.localstate import pick_stack

    stack = pick_stack(args.gateway) if args.gateway else {}
    return client_credentials(getattr(args, "token_file", None), getattr(args, "tls_ca", None), stack)


class _WithCredentials:
    """A Gateway stub whose every call carries the credentials' metadata (the bearer token)."""

    def __init__(self, stub: gateway_pb2_grpc.GatewayStub, metadata) -> None:
        self._stub, self._metadata = stub, metadata

    def __getattr__(self, method: str):
        return functools.partial(getattr(self._stub, method), metadata=self._metadata)


def _stub(args) -> gateway_pb2_grpc.GatewayStub:
    credentials = _credentials(args)
    return _WithCredentials(gateway_pb2_grpc.GatewayStub(credentials.channel(args.gateway)), credentials.metadata)


def _emit(args, message, text) -> None:
    """`message` as `-o json|yaml` (hsched.views.dump), else the table/line `text()` makes."""
    from hsched import views

    print(text() if args.output == "table" else views.dump(message, args.output))


def _print_page(args, reply, field: str, line) -> None:
    """A page of a List/ListJobs reply (its items in `field`): the reply itself with -o json|yaml (an empty page
    with its empty list, not `{}`), else a line per item and the next page."""
    if args.output != "table":
        from hsched import views

        _emit(args, {field: [], **views.as_dict(reply)}, None)
        return
    for item in getattr(reply, field):
        print(line(item))
    if reply.next_page_token:
        print(f"(more: --page-token {reply.next_page_token})")


def _names(enum, prefix: str) -> list[str]:
    """An enum's values as the --state flags spell them (TASK_STATE_PLACED -> placed), without UNSPECIFIED."""
    return [enum.Name(v).removeprefix(prefix).lower() for v in enum.values() if v]


# `hsched up --placer-processes`: every DC's placer in one process. bench/placer_groups.py on the default fleet:
# stack RSS 1,366 -> 388 MiB, placer CPU per Submit no higher, Submit/s within the shared machine's noise
# (docs/operations.md). Compose and Kubernetes keep one placer per DC.
PLACER_PROCESSES = 1
FORMATS = ("table", "json", "yaml")  # -o; hsched.views.FORMATS (not imported: every command would load it)
STATES = _names(pb.TaskState, "TASK_STATE_")
JOB_STATES = _names(pb.JobState, "JOB_STATE_")
# states a task never leaves: hsched.state.tasks.TERMINAL (test_cli checks), not imported so that every command
# does not load the ledger and numpy
FINAL = (pb.TASK_STATE_REJECTED, pb.TASK_STATE_RELEASED, pb.TASK_STATE_SUCCEEDED, pb.TASK_STATE_FAILED,
         pb.TASK_STATE_EXPIRED)
ENDED_WELL = (pb.TASK_STATE_SUCCEEDED, pb.TASK_STATE_RELEASED)  # a watch of one task ending otherwise exits 1
# a job's final states by the kind of its event that records them (a job event carries no state):
# hsched.state.tasks.JOB_TERMINAL and JOB_STATE_OF_KIND (test_cli checks), not imported for the same reason
JOB_FINAL = {"job_succeeded": pb.JOB_STATE_SUCCEEDED, "job_failed": pb.JOB_STATE_FAILED,
             "job_cancelled": pb.JOB_STATE_CANCELLED}


def _state_name(state: int) -> str:
    return pb.TaskState.Name(state).removeprefix("TASK_STATE_")


def _task_line(t: pb.Task) -> str:
    nodes = sorted({a.node for a in t.assignments})
    where = f"{t.datacenter} {','.join(nodes[:3])}{'…' if len(nodes) > 3 else ''}".strip()
    # wall seconds: with `--time-factor F` a task of runtime_s R runs R / F of them
    ran = f"ran {(t.finished_unix_ms - t.started_unix_ms) / 1000:g} s wall" \
        if t.started_unix_ms and t.finished_unix_ms else ""
    extra = "  ".join(x for x in (ran, f"preempted {t.preemptions}x" if t.preemptions else "", t.reason) if x)
    return f"{t.task_id}  {_state_name(t.state):<9} {where}  {extra}".rstrip()


# -- up ---------------------------------------------------------------------------------------------------------


def cmd_up(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from hsched.localstate import remove_stack, write_stack
    from hsched.security import pki
    from hsched.stack import Stack, StackConfig, default_state_dir
    from hsched.state.epoch import EXIT_STATE_LOST, StateLost
    from hsched.state.redis import RedisUnavailable, redact_url, url_without_password

    _fleet(args.fleet)  # a bad fleet file: its one-line message (exit 2) before anything starts
    _tenant_weights(args.tenant_weights)  # the placers get it as given (a file: its absolute path)
    tenant_weights = os.path.abspath(args.tenant_weights) if os.path.exists(args.tenant_weights) else \
        args.tenant_weights
    slice_types = None
    if args.slice_types:  # a bad file: its one-line message (exit 2) before anything starts; placers get the path
        from hsched.engine.slices import SliceCatalog

        SliceCatalog.load(args.slice_types)
        slice_types = os.path.abspath(args.slice_types)
    if args.replay:
        _check_trace(args.replay)
    console = Console(width=max(Console().width, 112))  # the summary table needs ~110 columns
    if args.replay in JOB_TRACES and args.time_factor is None:
        args.time_factor = _dag_time_factor(args)  # the placers' clock must run at the replay's pace
    if args.time_factor is None:  # the placers' own default, resolved here so the stack file records it for replay
        args.time_factor = _env_time_factor()
    config = StackConfig(fleet_path=args.fleet, redis_url=os.environ.get("REDIS_URL") or None, prefix=args.prefix,
                         policy=args.policy, gpu_policy=args.gpu_policy, path_finder=args.path_finder,
                         thermal=not args.no_thermal, sensor_readings=args.sensor_readings, traces=args.traces,
                         gateway_port=args.port, log_dir=args.log_dir, keep_logs=args.keep_logs,
                         log_level=args.log_level,
                         state_dir=str(args.state_dir or default_state_dir(args.prefix)), fresh=args.fresh,
                         redis_appendfsync=args.redis_appendfsync, redis_replicas=args.redis_replicas,
                         supervise=not args.no_supervise, unhealthy_restart_s=args.unhealthy_restart_s,
                         supervisor_metrics_port=args.supervisor_metrics_port, tls=args.tls, auth=args.auth,
                         time_factor=args.time_factor, dag_policy=args.dag_policy, slice_types=slice_types,
                         tenant_weights=tenant_weights,
                         nodes_to_score=args.nodes_to_score,
                         prometheus=args.prometheus, prometheus_port=args.prometheus_port,
                         placer_processes=args.placer_processes, gateways=args.gateways)
    _log_supervision_to(console)
    stack = Stack(config)
    try:
        groups = stack.placer_groups()
        hosted = f" in {len(groups)} processes" if len(groups) < len(stack.fleet.datacenters) else ""
        gateways = f"{args.gateways} gateways" if args.gateways > 1 else "the gateway"
        with console.status(f"starting Redis, thermal, selector, {len(stack.fleet.datacenters)} placers{hosted} and "
                            f"{gateways}"):
            stack.start()
    except (StateLost, RedisUnavailable) as exc:
        print(f"hsched up: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:
        print(f"hsched up: {exc}" + (f"\nlogs kept in {stack.logs_kept}" if stack.logs_kept else ""), file=sys.stderr)
        return 1
    token_file = stack.admin_token_file
    ca = pki.ca_paths(stack.tls_dir)[0] if stack.tls_dir else None
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        write_stack({"gateway": stack.gateway, "redis_url": url_without_password(stack.redis_url),
                     "prefix": args.prefix, "time_factor": args.time_factor,
                     "fleet": os.path.abspath(args.fleet) if args.fleet else None,
                     "redis_password_file": str(stack.redis_password_file) if stack.redis_password_file else None,
                     **({"tls_ca": str(ca)} if ca else {}),
                     **({"token_file": str(token_file)} if token_file else {}),
                     **{_stack_key(name): path for name, path in (stack.redis_tls.env() if stack.redis_tls
                                                                  else {}).items()}})
        if stack.redis_tls:  # this process' own Redis clients (the replay summary) use the stack's TLS files
            os.environ.update(stack.redis_tls.env())
        table = Table(title=f"hsched stack — fleet {stack.fleet.name} ({stack.fleet.wan.source or 'inline WAN'})")
        for col in ("service", "gRPC", "metrics", "RSS MiB"):
            table.add_column(col)
        rss = stack.rss_mib()
        for name, svc in stack.services.items():
            if svc.http_health:  # Prometheus: its UI and HTTP API
                table.add_row(name, "-", f"{svc.http_health} (UI, API)", f"{rss.get(name, 0):.0f}")
                continue
            metrics_url = f"http://127.0.0.1:{svc.metrics_port}/metrics" if svc.metrics_port else "-"
            if svc.dc_ports:  # a placer process hosting several DCs: its row, then one per DC (its own port)
                table.add_row(name, f"{len(svc.dc_ports)} DCs", metrics_url, f"{rss.get(name, 0):.0f}")
                for dc in svc.dc_ports:
                    table.add_row(f"  placer-{dc}", stack.placer_target(dc), f"(in {name})", "")
                continue
            table.add_row(name, svc.target, metrics_url, f"{rss.get(name, 0):.0f}")
        redis_rss = sum(v for k, v in rss.items() if k.startswith("redis"))
        table.add_row("redis", redact_url(stack.redis_url), "-", f"{redis_rss:.0f}")
        if stack.supervisor_metrics:
            table.add_row("supervisor", "-", stack.supervisor_metrics.url, "-")
        console.print(table)
        kept = "kept" if args.log_dir or args.keep_logs else "removed on a clean stop; --keep-logs keeps them"
        console.print(f"logs: {stack.log_dir} ({kept}); state (Redis AOF, epoch {stack.epoch}): {stack.state_dir}")
        if stack.tls_dir:
            console.print(f"mutual TLS on every hop; CA and certificates in {stack.tls_dir} (clients: --tls-ca {ca}; "
                          f"rotate: hsched certs rotate --dir {stack.tls_dir})")
        if token_file:
            console.print(f"tenant authentication on: admin token in {token_file} (the CLI uses it for this stack); "
                          f"tenant tokens: hsched tokens create --file {stack.tokens_file} --tenant NAME")
        if args.replay:
            ok = run_replay(console, stack.gateway, stack.fleet, args, stack.redis_url, args.prefix,
                            stack_credentials(stack))
            if not args.keep_running:
                return 0 if ok else 1
        console.print(f"[bold]gateway on {stack.gateway}[/] — try: hsched submit --cpu 4 --memory-gib 8; "
                      "Ctrl-C stops everything")
        while not stop.wait(1):
            if stack.state_lost:  # nothing can serve any more: stop the rest rather than leave a husk running
                console.print(f"[bold red]{stack.state_lost}[/]: stopping the stack (its logs are kept); start "
                              "afresh on purpose with hsched up --fresh or a new --prefix")
                return EXIT_STATE_LOST
    except KeyboardInterrupt:
        pass
    finally:
        with console.status("stopping"):
            stack.stop()
        remove_stack(stack.gateway)
        if stack.logs_kept:
            console.print(f"logs kept in {stack.logs_kept}")
    return 0


def _log_supervision_to(console) -> None:
    """Show the stack supervisor's deaths and restarts on the `hsched up` console (they also go to
    supervisor.log in the log dir)."""
    import logging

    from rich.logging import RichHandler

    log = logging.getLogger("hsched.supervisor")
    log.addHandler(RichHandler(console=console, show_path=False, markup=False))
    log.setLevel(logging.INFO)
    log.propagate = False


# -- replay -----------------------------------------------------------------------------------------------------


def stack_credentials(stack) -> ClientCredentials:
    """The operator's credentials for a stack this process started: its admin token (`--auth`) and, with `--tls`,
    its CA and admin client certificate."""
    from hsched.security.tls import TlsFiles
    from hsched.security.tokens import read_token_file

    token = read_token_file(stack.admin_token_file) if stack.admin_token_file else None
    if stack.tls_dir is None:
        return ClientCredentials(token)
    admin = TlsFiles(stack.tls_dir, "admin")
    return ClientCredentials(token, str(admin.ca), str(admin.cert), str(admin.key))


JOB_TRACES = ("tpch", "alibaba2018")  # replayed as DAG jobs (hsched.job_replay), not as tasks
ALIBABA_DEFAULT_JOBS = 50  # of the trace's 6535 complete jobs (seeded random choice)


def _dag_jobs(args):
    """The DAG jobs of the trace `args.replay` (tpch or alibaba2018) with the replay flags."""
    from hsched.job_replay import alibaba_jobs, tpch_jobs

    if args.replay == "alibaba2018":
        limit = ALIBABA_DEFAULT_JOBS if args.limit is None else args.limit
        return alibaba_jobs(limit=limit, interval_s=args.tpch_interval_s, seed=args.seed,
                            max_tasks_per_stage=args.tpch_max_tasks, min_tasks=args.alibaba_min_tasks,
                            max_instances=args.alibaba_max_instances or None)
    return tpch_jobs(sizes=list(args.tpch_sizes), limit=args.limit or 0,
                     interval_s=args.tpch_interval_s, seed=args.seed, max_tasks_per_stage=args.tpch_max_tasks)


def _env_time_factor() -> float:
    """HSCHED_TIME_FACTOR, `hsched up`'s time factor without --time-factor (unset or empty: 1, real time), checked
    as the flag is."""
    text = os.environ.get("HSCHED_TIME_FACTOR", "")
    try:
        return positive_float(text) if text else 1.0
    except argparse.ArgumentTypeError as exc:
        raise ValidationError("HSCHED_TIME_FACTOR", str(exc)) from None


def _dag_time_factor(args) -> float:
    """Task seconds per wall second so the jobs' arrivals span --duration wall seconds."""
    jobs = _dag_jobs(args)
    span = max(j.arrival_s for j in jobs) + max(j.critical_path_s for j in jobs)
    return max(1.0, span / args.duration)


def run_job_replay(console, gateway: str, args, redis_url: str | None, prefix: str,
                   credentials: ClientCredentials | None = None) -> bool:
    """Replay TPC-H DAG jobs; print the summary table; True if every job succeeded."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from hsched.job_replay import replay_jobs

    jobs = _dag_jobs(args)
    factor = args.time_factor  # `hsched up` sets it for a DAG trace; cmd_replay takes the stack's
    tasks = sum(s.tasks for j in jobs for s in j.spec.stages)
    what = "TPC-H" if args.replay == "tpch" else "Alibaba 2018 batch"
    detail = f"sizes {','.join(args.tpch_sizes)}" if args.replay == "tpch" else "one stage per trace task, instances folded"
    console.print(f"replaying {len(jobs)} {what} DAG jobs ({tasks} tasks, {detail}) arriving over "
                  f"{max(j.arrival_s for j in jobs):.0f} trace seconds, time factor {factor:g} (the placers' clock)")
    with Progress(TextColumn("jobs finished"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as bar:
        job = bar.add_task("jobs", total=len(jobs))
        stats = asyncio.run(replay_jobs(gateway, jobs, factor, redis_url, prefix, timeout_s=args.tpch_timeout_s,
                                        progress=lambda done, total: bar.update(job, completed=done),
                                        credentials=credentials))
    s = stats.summary()
    table = Table(title=f"{what} DAG replay — JCT and critical path (the JCT bound) in trace seconds = wall × "
                        f"time factor {factor:g}; CPU util = mean over the jobs' data centers while they ran")
    for col in ("jobs", "succeeded", "failed", "unfinished", "avg JCT", "p95 JCT", "avg crit. path", "CPU util",
                "preempted", "wall s"):
        table.add_column(col, justify="right", no_wrap=True)

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    table.add_row(str(len(jobs)), str(s["succeeded"]), str(s["failed"]), str(s["unfinished"]),
                  fmt(s["avg_jct_s"], ".1f"), fmt(s["p95_jct_s"], ".1f"), fmt(s["avg_critical_path_s"], ".1f"),
                  fmt(s["mean_cpu_utilisation"], ".1%"), str(s["preemptions"]), f"{s['elapsed_s']:.1f}")
    console.print(table)
    if stats.retried:
        console.print(f"{stats.retried} calls retried after UNAVAILABLE/DEADLINE_EXCEEDED")
    if stats.errors:
        console.print(f"SubmitJob errors: {dict(stats.errors)}")
    return s["succeeded"] == len(jobs)


def run_replay(console, gateway: str, fleet, args, redis_url: str | None, prefix: str,
               credentials: ClientCredentials | None = None) -> bool:
    if args.replay in JOB_TRACES:
        return run_job_replay(console, gateway, args, redis_url, prefix, credentials)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from hsched.replay import (
        STATE_COLUMNS,
        dc_summaries,
        load_trace,
        replay,
        summary_document,
        summary_rows,
        with_locations,
    )

    limit = 1000 if args.limit is None else args.limit
    tasks = with_locations(load_trace(args.replay, limit, args.skip), fleet, args.seed)
    console.print(f"replaying {len(tasks)} tasks of trace [bold]{args.replay}[/] over ~{args.duration:g} s "
                  f"(time-compressed), {args.concurrency} in flight")
    with Progress(TextColumn("submit"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as bar:
        job = bar.add_task("submit", total=len(tasks))
        stats = asyncio.run(replay(gateway, tasks, args.duration, args.concurrency,
                                   progress=lambda done, total: bar.update(job, completed=done),
                                   credentials=credentials))
    lat = sorted(stats.latencies_s)
    p = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1000) if lat else (lambda q: 0.0)
    console.print(f"{stats.submitted} submitted in {stats.elapsed_s:.1f} s: "
                  + ", ".join(f"{k} {v}" for k, v in sorted(stats.outcomes.items()))
                  + f"; {stats.released} released; Submit latency p50 {p(0.5):.1f} ms, p99 {p(0.99):.1f} ms"
                  + (f"; {stats.retried} calls retried after UNAVAILABLE/DEADLINE_EXCEEDED" if stats.retried else "")
                  + (f"; errors {dict(stats.errors)}" if stats.errors else ""))
    summaries = asyncio.run(dc_summaries(redis_url, prefix, fleet)) if redis_url else {}
    rows = summary_rows(stats, summaries)
    if getattr(args, "json", False):
        print(json.dumps(summary_document(args.replay, stats, rows), indent=2))
        return True
    # the counts no DC has are left out (named in the caption; --json has them all): the table fits 80 columns
    counts = [k for k in (*STATE_COLUMNS, "preempted") if any(r[k] for r in rows)]
    zero = [k for k in (*STATE_COLUMNS, "preempted") if k not in counts]
    table = Table(title=f"replay summary — {args.replay}: final task states per data center (as the gateway has "
                        "them at the end; preempted = preemptions they went through)",
                  caption=f"none {', '.join(zero)}" if zero else None)
    for col in ("DC", *counts, "cost/task", "CPU", "GPU", "PUE", "inlet°C"):
        table.add_column(col, justify="right" if col != "DC" else "left", no_wrap=True)

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    for r in rows:
        table.add_row(r["datacenter"], *(str(r[k]) for k in counts),
                      fmt(r["mean_total_cost"], ".3f"), fmt(r["cpu_util"], ".1%"), fmt(r["gpu_util"], ".1%"),
                      fmt(r["pue"], ".3f"), fmt(r["max_inlet_c"], ".1f"))
    console.print(table)
    return True


GATEWAY_WAIT_S = 5.0  # how long `replay` waits for the gateway to accept a connection before giving up


def _fleet(path: str | None):
    """load_fleet with an unreadable file as a FleetError too (one line naming --fleet, exit 2 via main)."""
    from hsched.domain.errors import FleetError
    from hsched.domain.fleet import load_fleet

    try:
        return load_fleet(path)
    except FleetError as exc:  # name the file: the field path alone does not say which YAML
        raise FleetError(f"--fleet {path}: {exc.field}", exc.rule, exc.value) from None
    except OSError as exc:
        raise FleetError("--fleet", f"cannot read {path} ({exc.strerror or exc})") from None


def _check_trace(name: str) -> None:
    from hsched.replay import TRACES

    if name not in TRACES and name not in JOB_TRACES:
        raise ValidationError("trace", f"must be one of {', '.join([*TRACES, *JOB_TRACES])}", name)


def cmd_replay(args) -> int:
    """Exit codes: 0 replayed, 1 the gateway unreachable or the replay failed, 2 a bad argument."""
    from rich.console import Console

    _check_trace(args.replay)
    if args.json and args.replay in JOB_TRACES:
        raise ValidationError("--json", f"is for task traces only, not the DAG job replay {args.replay!r}")
    args.fleet, args.prefix = _from_stack(args, "fleet"), _from_stack(args, "prefix", PREFIX)
    recorded = _running_stack(args.gateway).get("time_factor")
    if recorded is not None and args.time_factor is not None and args.time_factor != recorded:
        # the placers run their clock at the factor they were started with; another would misreport every JCT
        raise ValidationError("--time-factor", f"must be the running stack's ({recorded:g}, as `hsched up` started "
                              "its placers): leave it out", args.time_factor)
    args.time_factor = _from_stack(args, "time_factor", 1.0)
    fleet = _fleet(args.fleet)
    credentials = _credentials(args)
    # fail fast: without a gateway every Submit would wait out its deadline for the replay's whole duration
    with credentials.channel(args.gateway) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=GATEWAY_WAIT_S)
        except grpc.FutureTimeoutError:
            print(f"hsched replay: no gateway reachable at {args.gateway} within {GATEWAY_WAIT_S:g} s "
                  "(start one with `hsched up`, or name it with --gateway)", file=sys.stderr)
            return 1
    ok = run_replay(Console(width=max(Console().width, 112), stderr=args.json), args.gateway, fleet, args,
                    _redis_url(args.gateway), args.prefix, credentials)
    return 0 if ok else 1


# -- task commands ----------------------------------------------------------------------------------------------


def _job_line(j: pb.Job) -> str:
    state = pb.JobState.Name(j.state).removeprefix("JOB_STATE_")
    stages = " ".join(f"{s.name}:{s.succeeded}/{s.tasks}" for s in j.stages)
    return f"{j.job_id}  {state:<9} {j.datacenter}  {stages}  {j.reason}".rstrip()


def cmd_submit_job(args, job: pb.JobSpec) -> int:
    reply = _stub(args).SubmitJob(gateway_pb2.SubmitJobRequest(job=job, selector_method=args.method), timeout=30)
    _emit(args, reply, lambda: _job_line(reply.job) + ("  (duplicate)" if reply.duplicate else ""))
    return 1 if reply.job.state == pb.JOB_STATE_FAILED else 0


def cmd_submit_file(args) -> int:
    """`hsched submit -f FILE`: a DAG job, or task specs (hsched.taskfile). Every spec is checked by the gateway's
    rules before the first is sent (a bad one: exit 2, nothing sent); then each is submitted with its request_id,
    in file order, so a second run gets every first answer back ("unchanged"). Exit 1 if any task is REJECTED or a
    call fails (the specs after a failed call are not sent; running the file again is safe)."""
    from hsched import views
    from hsched.convert import task_to_pb
    from hsched.taskfile import load_submit_file

    loaded = load_submit_file(args.file)  # a ValidationError (exit 2) names the file and the YAML path
    if loaded.job is not None:
        return cmd_submit_job(args, loaded.job)
    stub, done, failure = _stub(args), [], None
    for item in loaded.tasks:
        try:
            reply = stub.Submit(gateway_pb2.SubmitRequest(task=task_to_pb(item.spec), selector_method=args.method),
                                timeout=30)
        except grpc.RpcError as exc:
            failure = f"hsched submit -f: {item.where or 'the spec'} ({item.spec.request_id}): " \
                      f"{exc.code().name}: {exc.details()}"
            break
        done.append((item, reply))
    if args.output == "table":
        print(views.table(["SPEC", "NAME", "TASK_ID", "STATE", "DATACENTER", "RESULT", "REASON"],
                          [[item.where or "-", item.spec.name or "-", r.task.task_id, _state_name(r.task.state),
                            r.task.datacenter or "-", "unchanged" if r.duplicate else "created", r.task.reason]
                           for item, r in done]))
    else:
        print(views.dump([{"spec": item.where, "request_id": item.spec.request_id,
                           "request_id_derived": item.derived_id, "result": "unchanged" if r.duplicate else "created",
                           "task": views.as_dict(r.task)} for item, r in done], args.output))
    if failure:
        print(failure, file=sys.stderr)
        if len(done) < len(loaded.tasks):
            print(f"hsched submit -f: {len(loaded.tasks) - len(done) - 1} spec(s) after it not sent", file=sys.stderr)
    return 1 if failure or any(r.task.state == pb.TASK_STATE_REJECTED for _, r in done) else 0


def cmd_job(args) -> int:
    stub = _stub(args)
    if args.action in ("get", "cancel", "watch") and not args.job_id:
        print(f"hsched job {args.action}: a job id is required", file=sys.stderr)
        return 2
    if args.action == "get":
        job = stub.GetJob(gateway_pb2.GetJobRequest(job_id=args.job_id), timeout=10)
        _emit(args, job, lambda: _job_line(job))
    elif args.action == "cancel":
        job = stub.CancelJob(gateway_pb2.CancelJobRequest(job_id=args.job_id), timeout=30)
        _emit(args, job, lambda: _job_line(job))
    elif args.action == "list":
        state = pb.JobState.Value(f"JOB_STATE_{args.state.upper()}") if args.state else 0  # a choice of JOB_STATES
        reply = stub.ListJobs(gateway_pb2.ListJobsRequest(tenant=args.tenant, state=state, limit=args.limit,
                                                          page_token=args.page_token), timeout=10)
        _print_page(args, reply, "jobs", _job_line)
    else:  # as cmd_watch of one task: ends at the job's final state (exit 1 unless SUCCEEDED), at once if it is
        # there already and no --after asks for its history
        job = stub.GetJob(gateway_pb2.GetJobRequest(job_id=args.job_id), timeout=10)
        if job.state in JOB_FINAL.values() and not args.after:
            _event(args, job, lambda: _job_line(job))
            return 0 if job.state == pb.JOB_STATE_SUCCEEDED else 1
        try:  # from "0" at least: it may finish between the GetJob and the Watch
            for ev in _watch(stub, gateway_pb2.WatchRequest(job_id=args.job_id, after_event_id=args.after or "0")):
                _event(args, ev, lambda ev=ev: f"{ev.event_id}  {ev.task_id or ev.job_id}  {ev.kind:<13} "
                                               f"{ev.datacenter}  {ev.detail}")
                if ev.kind in JOB_FINAL:  # the job's own event (a task's kinds have no job_ prefix)
                    return 0 if JOB_FINAL[ev.kind] == pb.JOB_STATE_SUCCEEDED else 1
        except KeyboardInterrupt:
            pass
    return 0


def cmd_submit(args) -> int:
    """Exit codes: 0 placed/deferred/duplicate, 1 REJECTED (the state is printed), 2 a bad flag."""
    from hsched.convert import task_from_pb

    if args.file:
        given = [flag for dest, (flag, default) in args.spec_flags.items() if getattr(args, dest) != default]
        if given:
            raise ValidationError("-f", f"cannot be combined with {', '.join(given)}: the file holds the task "
                                  "specs (set the fields there)")
        return cmd_submit_file(args)
    spec = pb.TaskSpec(
        request_id=args.request_id, tenant=args.tenant, name=args.name, priority=args.priority,
        priority_class=args.priority_class,
        resources=pb.Resources(cpu_milli=round(args.cpu * 1000), memory_mib=round(args.memory_gib * 1024),
                               disk_mib=round(args.disk_gib * 1024), bandwidth_mbps=args.bandwidth_mbps,
                               gpu_count=args.gpus,
                               # given without --gpus they reach validate() below, which refuses them
                               gpu_core_percent=args.gpu_core_percent if args.gpu_core_percent is not None
                               else 100 if args.gpus else 0,
                               gpu_memory_mib=round((args.gpu_memory_gib or 0.0) * 1024)),
        replicas=args.replicas, runtime_s=args.runtime_s, data_size_mb=args.data_mb, entry_vertex=args.entry,
        network=pb.NetworkRequirements(max_latency_ms=args.max_latency_ms, max_jitter_ms=args.max_jitter_ms,
                                       max_loss_percent=args.max_loss_percent),
        gpu_models=args.gpu_model or [])
    task_from_pb(spec).validate()  # the gateway's own rules, before any call: a ValidationError is exit 2
    reply = _stub(args).Submit(gateway_pb2.SubmitRequest(task=spec, selector_method=args.method), timeout=30)
    _emit(args, reply, lambda: _task_line(reply.task) + ("  (duplicate)" if reply.duplicate else ""))
    return 1 if reply.task.state == pb.TASK_STATE_REJECTED else 0


def cmd_get(args) -> int:
    """One line (the task's state, where, why), or the whole record with -o json|yaml."""
    if _JOB_ID.fullmatch(args.task_id):  # (NOT_FOUND as a task otherwise, with no hint)
        raise ValidationError("TASK_ID", f"{args.task_id} is a job id: hsched job get {args.task_id}")
    task = _stub(args).Get(gateway_pb2.GetRequest(task_id=args.task_id), timeout=10)
    _emit(args, task, lambda: _task_line(task))
    return 0


def cmd_list(args) -> int:
    state = pb.TaskState.Value(f"TASK_STATE_{args.state.upper()}") if args.state else 0  # a choice of STATES
    reply = _stub(args).List(gateway_pb2.ListRequest(tenant=args.tenant, state=state, datacenter=args.datacenter,
                                                     job_id=args.job, limit=args.limit, page_token=args.page_token),
                             timeout=10)
    _print_page(args, reply, "tasks", _task_line)
    return 0


WATCH_RETRIES = 5  # a Watch cut by UNAVAILABLE is resumed up to this many times in a row: 0.25 s doubling, ~7.75 s


def _watch(stub, request: gateway_pb2.WatchRequest, sleep=None):
    """The Watch's events; when the stream breaks with UNAVAILABLE (its gateway was killed or restarted), a new
    Watch resumes after the last event received, so nothing is missed or printed twice. On a balanced target
    (`ipv4:A,B`) it goes to another gateway; on one gateway it waits out a restart. Up to WATCH_RETRIES failures
    in a row (backoff 0.25 s doubling), then the error. Before any event, it resumes from where it began
    (`--after`; a watch of new events only may then miss those of the outage). A Watch the gateway ended because
    this client fell too far behind (RESOURCE_EXHAUSTED, a burst faster than the terminal prints) is resumed the
    same way, at once: the gateway reads the missed events back from the stream."""
    import time

    sleep = sleep or time.sleep
    failures = 0
    while True:
        try:
            for ev in stub.Watch(request):
                failures = 0
                resume = gateway_pb2.WatchRequest()
                resume.CopyFrom(request)
                resume.after_event_id = ev.event_id
                request = resume
                yield ev
            return
        except grpc.RpcError as exc:
            behind = exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "fell more than" in (exc.details() or "")
            if not (behind or exc.code() == grpc.StatusCode.UNAVAILABLE) or failures >= WATCH_RETRIES:
                raise
            if not behind:
                sleep(0.25 * 2 ** failures)
            failures += 1


def cmd_watch(args) -> int:
    """Stream events. Watching one task: its events from the start (unless --after), ending once it reaches a
    final state; a task already finished prints that final state and exits at once."""
    stub = _stub(args)
    after = args.after
    if args.task_id:
        task = stub.Get(gateway_pb2.GetRequest(task_id=args.task_id), timeout=10)
        if task.state in FINAL and not after:  # as the stream's items are printed: one JSON line / YAML document
            _event(args, task, lambda: _task_line(task))
            return 0 if task.state in ENDED_WELL else 1
        after = after or "0"  # it may finish between the Get and the Watch: its past events come too
    try:
        request = gateway_pb2.WatchRequest(task_id=args.task_id, tenant=args.tenant, after_event_id=after)
        for ev in _watch(stub, request):
            _event(args, ev, lambda ev=ev: f"{ev.event_id}  {ev.task_id}  {ev.kind:<11} {_state_name(ev.state):<9} "
                                           f"{ev.datacenter}  {ev.detail}")
            if args.task_id and ev.state in FINAL:
                return 0 if ev.state in ENDED_WELL else 1
    except KeyboardInterrupt:
        pass
    return 0


def cmd_release(args) -> int:
    reply = _stub(args).Release(gateway_pb2.ReleaseRequest(task_id=args.task_id), timeout=30)
    _emit(args, reply, lambda: _task_line(reply.task))
    return 0


def _event(args, ev, line) -> None:
    """One streamed item (an event; a finished task): a line; -o json: one JSON object per line (JSON Lines); -o
    yaml: one YAML document."""
    from hsched import views

    if args.output == "json":
        print(json.dumps(views.as_dict(ev), ensure_ascii=False), flush=True)
    elif args.output == "yaml":
        print("---\n" + views.dump(ev, "yaml"), flush=True)
    else:
        print(line(), flush=True)


def cmd_dcs(args) -> int:
    """Every data center: capacity, what is free, utilisation, thermal state, placer status and lease."""
    from hsched import views

    reply = _stub(args).ListDatacenters(gateway_pb2.ListDatacentersRequest(), timeout=15)
    _emit(args, reply, lambda: views.dcs_table(reply))
    return 0


def cmd_nodes(args) -> int:
    """One data center's nodes and GPU cards with what is free on each; exit 1 if its placer does not answer."""
    from hsched import views

    view = _stub(args).GetDatacenter(gateway_pb2.GetDatacenterRequest(datacenter=args.datacenter,
                                                                      gpu_model=args.gpu_model), timeout=15)
    if view.status != "serving":  # json/yaml still print the view (its status, reason and lease)
        if args.output != "table":
            _emit(args, view, None)
        print(f"hsched nodes: the placer of {view.datacenter} is {view.status}: {view.reason}", file=sys.stderr)
        return 1
    _emit(args, view, lambda: views.nodes_table(view))
    return 0


def cmd_tenants(args) -> int:
    """Each tenant's fair share per data center: weight, tasks running and queued, allocated / deserved / asked
    for, and the share the deferred queue orders by."""
    from hsched import views

    reply = _stub(args).ListDatacenters(gateway_pb2.ListDatacentersRequest(include_tenants=True), timeout=15)
    if args.datacenter:
        keep = [v for v in reply.datacenters if v.datacenter == args.datacenter]
        if not keep:
            raise ValidationError("--datacenter", "must be one of the fleet's data centers "
                                  f"({', '.join(v.datacenter for v in reply.datacenters)})", args.datacenter)
        del reply.datacenters[:]
        reply.datacenters.extend(keep)
    _emit(args, reply, lambda: views.tenants_table(reply))
    return 0


def cmd_cordon(args) -> int:
    """cordon / drain (cordon + evict the nodes' offline tasks) / uncordon nodes of one data center."""
    schedulable = args.command == "uncordon"
    reply = _stub(args).SetNodesSchedulable(gateway_pb2.SetNodesSchedulableRequest(
        datacenter=args.datacenter, nodes=args.nodes, schedulable=schedulable, reason=getattr(args, "reason", ""),
        evict=args.command == "drain"), timeout=30)

    def text() -> str:
        done = "uncordoned" if schedulable else "cordoned"
        same = [n for n in args.nodes if n not in reply.changed]
        lines = [f"{args.datacenter}: {done} {', '.join(reply.changed)}" if reply.changed else
                 f"{args.datacenter}: nothing to change"]
        if same:
            lines.append(f"already {done}: {', '.join(same)}")
        if reply.evicted_task_ids:
            lines.append(f"evicted and requeued {len(reply.evicted_task_ids)} offline task(s): "
                         f"{', '.join(reply.evicted_task_ids)}")
        if reply.placed_from_queue:
            lines.append(f"placed from the queue: {', '.join(p.task_id for p in reply.placed_from_queue)}")
        busy = [f"{r.node} ({r.tasks})" for r in reply.remaining if r.tasks]
        if not schedulable:
            lines.append(f"still running there (they finish or are released): {', '.join(busy)}" if busy else
                         "no task left on them: drained")
        return "\n".join(lines)
    _emit(args, reply, text)
    return 0


def cmd_describe(args) -> int:
    """A task explained: where and why, cost, path, placement, thermal effect, alternatives, its events."""
    from hsched import views

    d = _stub(args).DescribeTask(gateway_pb2.GetRequest(task_id=args.task_id), timeout=15)
    _emit(args, d, lambda: views.describe_text(d))
    return 0


def cmd_certs(args) -> int:
    """`hsched certs init|issue|rotate --dir D` (hsched.security.pki); errors: one line, exit 2 for a name or
    URI outside its rule (bad usage), else 1 (the directory or a file)."""
    from hsched.security import pki

    if getattr(args, "new_ca", False) and args.drop_old_ca:  # would distrust every leaf the old CA signed at once
        raise ValidationError("--drop-old-ca", "cannot be combined with --new-ca: first rotate with --new-ca, hand "
                              "out the new certificates, then rotate again with --drop-old-ca")
    try:
        if args.certs_command == "init":
            pki.init_dir(args.dir, leaf_days=args.days, force=args.force)
            print(f"CA and certificates for {', '.join(pki.DEFAULT_NAMES)} written to {args.dir}")
        elif args.certs_command == "issue":
            crt, key = pki.issue(args.dir, args.name, uri=args.uri, leaf_days=args.days)
            print(f"{crt} ({pki.uri_sans(crt.read_bytes())[0]}) and {key}")
        else:
            names = pki.rotate(args.dir, new_ca=args.new_ca, drop_old_cas=args.drop_old_ca, leaf_days=args.days)
            print(f"re-issued {', '.join(names)} in {args.dir}"
                  + ("; a new CA signs them, the previous CA stays trusted until --drop-old-ca" if args.new_ca else "")
                  + ("; ca.crt now holds only the current CA" if args.drop_old_ca else "")
                  + "; running services present the new certificates on new connections")
    except pki.PkiError as exc:
        print(f"hsched certs {args.certs_command}: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, pki.PkiNameError) else 1
    return 0


def cmd_tokens(args) -> int:
    """Edit a tokens file (hsched.security.tokens); a new token goes to stdout only, once."""
    from hsched.security import tokens

    if not args.file:
        raise ValidationError("--file", "is required (or set HSCHED_TOKENS_FILE)")
    if args.tokens_command == "create":
        if args.role == "tenant" and not args.tenant:
            raise ValidationError("--tenant", "is required for role tenant")
        try:
            token, entry = tokens.create_token(args.file, args.tenant or "", args.role, args.name or "", args.expires)
        except tokens.TokensFileError as exc:
            if not exc.field.startswith("tokens["):  # the file itself
                raise
            raise ValidationError(f"--{exc.field.rpartition('.')[2]}", exc.rule, exc.value) from None
        print(f"created token {entry.name!r} (role {entry.role}{', tenant ' + entry.tenant if entry.tenant else ''}) "
              f"in {args.file}; it is shown only now:", file=sys.stderr)
        print(token)
    elif args.tokens_command == "list":
        for e in tokens.list_tokens(args.file):
            expires = e.expires.strftime("%Y-%m-%dT%H:%M:%SZ") if e.expires else "never"
            print(f"{e.name:<24} {e.role:<6} {e.tenant or '-':<24} expires {expires}  sha256 {e.sha256[:12]}…")
    else:
        gone = tokens.revoke_token(args.file, args.name)
        print(f"revoked {gone.name!r}: a gateway reading {args.file} refuses it from its next call")
    return 0


def cmd_eval(args) -> int:
    """Run paper experiments: markdown to stdout (and report.md), PNG plots beside it."""
    from rich.console import Console

    from hsched.eval import EXPERIMENTS

    if (failed := _check_data(args)) is not None:
        return failed
    console = Console(stderr=True)
    for name in list(EXPERIMENTS) if args.experiment == "all" else [args.experiment]:
        _run_experiment(name, args, console)
    return 0


def _check_data(args) -> int | None:
    """Load --fleet and resolve --trace before any work: a bad trace flag is usage (exit 2 via main); a fleet
    file that loads but cannot be used (e.g. a disconnected WAN) is a failure of the data: one line, exit 1."""
    from hsched.domain.errors import FleetError
    from hsched.traces.catalog import resolve_trace

    if args.trace:
        resolve_trace(args.trace, args.cores_per_proc, time_compression=args.time_compression)
    elif args.cores_per_proc != 1:
        raise ValidationError("--cores-per-proc", "scales an SWF --trace; give --trace too")
    elif args.time_compression != 1:
        raise ValidationError("--time-compression", "scales an SWF --trace; give --trace too")
    if args.fleet:
        try:
            _fleet(args.fleet)
        except FleetError as exc:
            print(f"hsched: {exc}", file=sys.stderr)
            return 1
    return None


def _run_experiment(name: str, args, console) -> None:
    import importlib
    from pathlib import Path

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from hsched.eval import DATA_AWARE, EXPERIMENTS
    from hsched.eval.report import EvalContext

    target, about = EXPERIMENTS[name]
    module, _, fn = target.partition(":")
    run = getattr(importlib.import_module(module), fn)
    out = Path(args.out) / name
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as bar:
        jobs: dict[str, int] = {}

        def progress(label: str, done: int, total: int) -> None:
            if label not in jobs:
                jobs[label] = bar.add_task(f"{name}: {label}", total=total)
            bar.update(jobs[label], completed=done, total=total)

        report = run(EvalContext(seeds=list(range(args.seeds)), out_dir=out, quick=args.quick, progress=progress,
                                 fleet_path=args.fleet, trace=args.trace, cores_per_proc=args.cores_per_proc,
                                 time_compression=args.time_compression,
                                 tasks=args.tasks))
    if (args.fleet or args.trace) and name not in DATA_AWARE:
        report = (f"Data: its own DAG workloads and clusters; --fleet / --trace apply to "
                  f"{', '.join(sorted(DATA_AWARE))} only.\n\n" + report)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(f"# {name}: {about}\n\n{report}\n")
    print(f"# {name}: {about}\n\n{report}\n")
    console.print(f"[bold]{name}[/]: report and plots in {out}/")


def cmd_train(args) -> int:
    """Train one agent from scratch (or resume it); print the figures it evaluated."""
    from pathlib import Path

    from hsched.rl.checkpoint import model_path
    from hsched.rl.training import FINE_TUNABLE, TrainArgs, new_run_dir, trainer

    if args.resume and not args.out:
        raise ValidationError("--resume", "continues the checkpoint at --out, so --out is required")
    init = model_path(args.init) if args.init else None
    if init is not None:
        if args.agent not in FINE_TUNABLE:
            raise ValidationError("--init", f"fine-tunes only {', '.join(FINE_TUNABLE)}, not {args.agent}")
        if args.resume:
            raise ValidationError("--init", "starts a new training; --resume continues one: give one of them")
        if not init.is_file():
            raise ValidationError("--init", f"no checkpoint at {init}")
    if (failed := _check_data(args)) is not None:
        return failed
    run_dir = None if args.out else new_run_dir(args.agent)
    run = trainer(args.agent)
    figures = run(TrainArgs(seed=args.seed, steps=args.steps, out=Path(args.out) if args.out else None,
                            run_dir=run_dir, resume=args.resume, compare=args.compare, progress=not args.quiet,
                            fleet=Path(args.fleet) if args.fleet else None, trace=args.trace,
                            cores_per_proc=args.cores_per_proc, time_compression=args.time_compression,
                            init=init, checkpoint_seconds=args.checkpoint_seconds))
    print(json.dumps(figures, indent=2, sort_keys=True, default=str))
    if run_dir:
        print(f"hsched train: wrote {run_dir}/ (the shipped models/ are unchanged; services started with "
              f"HSCHED_MODELS_DIR={run_dir} load their models from it)", file=sys.stderr)
    return 0


def cmd_slices(args) -> int:
    """`hsched slices fit`: paper 001's slice types of a trace, the idle-vs-Q curve, the chosen Q, and the slices
    each node size of the fleet is cut into; written to -o for `hsched up --slice-types` / `placer --slice-types`."""
    from hsched.engine.slices import SliceCatalog, cut_summary, fit_catalog

    if args.slices_command == "show":
        catalog = SliceCatalog.load(args.file)
    else:
        fit = fit_catalog(args.q, q_max=args.q_max, min_gain=args.min_gain, max_instances=args.max_instances,
                          min_tasks=args.min_tasks, machine_memory_gib=args.machine_memory_gib)
        catalog, curve, src = fit.catalog, fit.curve, fit.catalog.source
        print(f"{src['trace']}: {src['jobs']} jobs, {src['tasks']} tasks, {src['distinct_demands']} distinct demand "
              "vectors; idle fraction of the reserved slice resources against Q (paper 001 fig. 12):")
        print("   Q  constrained (paper 001)  plain hierarchical")
        con = curve.constrained
        # no step below --min-gain up to --q-max: the chosen Q is the cap, not a knee
        capped = all(con[k] - con[k + 1] >= curve.min_gain for k in range(len(con) - 1))
        for k, c, unc in zip(curve.qs, con, curve.unconstrained, strict=True):
            mark = ("  <- cap (--q-max)" if capped else "  <- knee") if k == curve.chosen_q else ""
            print(f"  {k:2d}  {c:24.4f}  {unc:18.4f}{mark}")
        print(f"  uniform (one type): {curve.uniform:.4f}")
        if capped:
            print(f"no knee up to --q-max {curve.qs[-1]} (every further type saved >= {curve.min_gain:g}): Q = "
                  f"{curve.chosen_q}, the cap; using Q = {src['q']} ({src['q_choice']})")
        else:
            print(f"knee (one more type saves < {curve.min_gain:g}): Q = {curve.chosen_q}; using Q = {src['q']} "
                  f"({src['q_choice']})")
    print(f"{catalog.q} slice types (cpu_milli / memory_mib, share of the slice capacity):")
    for k in range(catalog.q):
        print(f"  {k}: {catalog.cpu_milli[k]:6d}m  {catalog.memory_mib[k]:7d} MiB  {catalog.shares[k]:.3f}")
    fleet = _fleet(args.fleet)
    sizes = [(int(c), int(m)) for dc in fleet.datacenters for c, m in
             zip(dc.node_table().cpu_milli, dc.node_table().memory_mib, strict=True)]
    for cpu, mem, cut in cut_summary(catalog, sizes):
        print(f"a node of {cpu // 1000} cores / {mem // 1024} GiB is cut into {sum(cut)} slices: {list(cut)}")
    if args.slices_command == "fit":
        try:
            catalog.save(args.output)
        except OSError as exc:
            print(f"hsched slices fit: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
            return 1
        print(f"written to {args.output} (use: hsched up --slice-types {args.output})")
    return 0


def cmd_k8s(args) -> int:
    """`hsched k8s render`: the deployment's manifests (hsched.deploy.k8s) to stdout or a directory."""
    from pathlib import Path

    from hsched.deploy import k8s
    from hsched.domain.fleet import default_fleet_path

    options = k8s.Options(namespace=args.namespace, image=args.image, redis_url_secret=args.redis_url_secret,
                          redis_port=args.redis_port, redis_storage=args.redis_storage,
                          redis_appendfsync=args.redis_appendfsync, policy=args.policy, gpu_policy=args.gpu_policy,
                          nodes_to_score=args.nodes_to_score, dag_policy=args.dag_policy, epoch=args.epoch,
                          tenant_weights=_tenant_weights(args.tenant_weights).to_json() if args.tenant_weights else "")
    options.check()  # before the fleet: every usage error is found without reading files
    fleet = _fleet(args.fleet)
    fleet_text = Path(args.fleet or default_fleet_path()).read_text()
    objects = k8s.render(fleet, fleet_text, options, f"--fleet {args.fleet}" if args.fleet else "--fleet")
    if args.output == "-":
        sys.stdout.write(k8s.to_stream(objects))
        return 0
    try:
        written = k8s.write_dir(k8s.to_files(objects), Path(args.output))
    except OSError as exc:
        print(f"hsched k8s render: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"{len(objects)} objects in {len(written)} files under {args.output} (kubectl apply -k {args.output})",
          file=sys.stderr)
    return 0


def _tenant_weights(text: str):
    """--tenant-weights checked before anything starts (ValidationError naming the entry: exit 2)."""
    from hsched.policies.fairshare import TenantWeights

    return TenantWeights.parse(text)


def cmd_link(args) -> int:
    """Publish a WAN link metric update (what a network probe does) on the links stream, validated first by the
    selector's own rules (WanGraph.update_link on the fleet's WAN): a bad update is exit 2 and nothing is written."""
    from redis.exceptions import RedisError

    from hsched.costs.graph import WanGraph
    from hsched.state.redis import describe_redis_error

    update = {"a": args.a, "b": args.b}
    for name in ("latency_ms", "jitter_ms", "loss_percent", "bandwidth_mbps"):
        if getattr(args, name) is not None:
            update[name] = getattr(args, name)
    if args.reset:
        update["reset"] = True
    graph = WanGraph(_fleet(_from_stack(args, "fleet")).wan)
    try:  # the selector's own rules; its field names are this command's flags
        graph.update_link(**update)
    except ValidationError as exc:
        flag = f"--{exc.field.replace('_', '-')}" if exc.field in update and exc.field not in ("a", "b") else exc.field
        raise ValidationError(flag, exc.rule, exc.value) from None
    if len(update) == 2:
        raise ValidationError("--latency-ms, --jitter-ms, --loss-percent, --bandwidth-mbps",
                              "at least one is needed (an update of nothing; --reset: back to the fleet file's)")
    deployment = _deployment(args, "hsched link")
    if deployment is None:
        return 1
    redis, keys, url = deployment
    try:  # bounded (docs/operations.md, Retention): the selector folds the stream, only recent updates matter
        entry = redis.xadd(keys.links, {"m": json.dumps(update)}, maxlen=LINKS_MAXLEN, approximate=True).decode()
        link = graph.link(args.a, args.b)  # what the selectors now apply
        metrics = ", ".join(f"{k} {getattr(link, k):g}" for k in ("latency_ms", "jitter_ms", "loss_percent",
                                                                   "bandwidth_mbps") if args.reset or k in update)
        print(f"{entry}  {args.a}–{args.b}: {metrics}{' (the fleet file’s)' if args.reset else ''} "
              "(published for the selectors)")
    except RedisError as exc:
        print(f"hsched link: {describe_redis_error(url, exc).rstrip('.')}; nothing written", file=sys.stderr)
        return 1
    return 0


def _deployment(args, command: str):
    """(Redis client, Keys, URL) of the deployment that `args.prefix` (or the running stack's) names, or None once
    `command` has said on stderr why there is none to write to (no Redis known, Redis unreachable). A --prefix under
    which Redis holds no deployment is a ValidationError (exit 2): a mistyped one would write streams nobody reads."""
    from redis.exceptions import RedisError

    from hsched.state.keys import Keys
    from hsched.state.redis import connect_sync, describe_redis_error, redact_url

    url = _redis_url()
    if not url:  # never guess: a default 127.0.0.1:6379 may be somebody else's Redis
        print(f"{command}: no running stack found (hsched up) and REDIS_URL is not set: nothing written",
              file=sys.stderr)
        return None
    keys = Keys(_from_stack(args, "prefix", PREFIX))
    redis = connect_sync(url)
    try:
        deployed = redis.exists(keys.epoch)
    except RedisError as exc:
        print(f"{command}: {describe_redis_error(url, exc).rstrip('.')}; nothing written", file=sys.stderr)
        return None
    if not deployed:  # every deployment has its epoch marker from its start on (hsched.state.epoch)
        raise ValidationError("--prefix", f"must name an hsched deployment: Redis at {redact_url(url)} holds no "
                              f"{keys.epoch} (`hsched up` or a deployment's first service writes it); nothing "
                              "written", keys.prefix)
    return redis, keys, url


def cmd_thermal(args) -> int:
    """Replay a file of sensor readings (docs/thermal.md, "Sensor telemetry") onto the DCs' readings streams,
    validated first against the fleet: a bad line is exit 2 naming the line and the field, and nothing is written;
    so is a --prefix under which Redis holds no deployment (a mistyped one would write streams nobody reads)."""
    from redis.exceptions import RedisError

    from hsched.state.redis import describe_redis_error
    from hsched.thermal.published import READINGS_MAXLEN
    from hsched.thermal.readings import load_readings, write_readings

    fleet = _fleet(_from_stack(args, "fleet"))
    dcs = {dc.name: dc for dc in fleet.datacenters}

    @functools.cache  # once per DC, not per reading (a node table of 5,000 servers per line was quadratic)
    def nodes_of(name: str) -> tuple[dict[str, int], int]:
        names = dcs[name].node_table().names
        return {n: i for i, n in enumerate(names)}, len(names)

    def resolve(name: str, where: str):
        if name not in dcs:
            raise ValidationError(where, f"is not a data center of the fleet (known: {', '.join(dcs)})", name)
        return nodes_of(name)

    readings = load_readings(args.file, resolve)
    # a scan (a DC's readings of one sample time) the thermal service takes whole only: say which miss servers
    seen: dict[tuple[str, object], set[int]] = {}
    for r in readings:
        seen.setdefault((r.datacenter, r.sample), set()).add(r.node)
    short = Counter(dc for (dc, _), nodes in seen.items() if len(nodes) < nodes_of(dc)[1])

    def warn_partial() -> None:  # (after the outcome: an error stays one line)
        for dc, scans in sorted(short.items()):
            print(f"hsched thermal replay: warning: {scans} scan(s) of {dc} miss some of its {nodes_of(dc)[1]} "
                  "servers; the thermal service drops a scan it does not get whole (docs/thermal.md)", file=sys.stderr)
    if args.dry_run:
        print(f"{args.file}: {len(readings)} valid readings, {len(seen)} scans (nothing written: --dry-run)")
        warn_partial()
        return 0
    deployment = _deployment(args, "hsched thermal replay")
    if deployment is None:
        return 1
    redis, keys, url = deployment
    try:
        n = write_readings(redis, keys.readings, readings, READINGS_MAXLEN)
    except RedisError as exc:  # written in pipelined chunks: those before the failure stay
        print(f"hsched thermal replay: {describe_redis_error(url, exc).rstrip('.')}; readings before the failure "
              "may be written (replaying the file again records no scan twice)", file=sys.stderr)
        return 1
    print(f"{n} readings of {len(seen)} scans written to "
          f"{', '.join(sorted({keys.readings(r.datacenter) for r in readings}))}")
    warn_partial()
    return 0


# -- argument validators: argparse `type=`s, so a bad value is a one-line usage error (exit 2) naming the flag ---



def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def data_flags(p: argparse.ArgumentParser) -> None:
    """--fleet / --trace / --cores-per-proc of `hsched eval` and `hsched train` (docs/results.md)."""
    p.add_argument("--fleet", help="fleet YAML to run on (its WAN and DCs; default: the embedded default fleet)")
    p.add_argument("--trace", help="trace to run on: thunder, kth, openb, openb-gpuspec33, or a path to an SWF log "
                                   "(.swf[.gz]) or an openb pod list (.csv[.gz]); default: each experiment's own")
    p.add_argument("--cores-per-proc", type=positive_int, default=1,
                   help="SWF traces: cores per processor, to bring a log of small jobs to the fleet's load "
                        "(default 1)")
    p.add_argument("--time-compression", type=positive_float, default=1.0,
                   help="SWF traces: divide submit times by this (runtimes unchanged), raising the offered load "
                        "by the factor (default 1)")


def certificate_days(text: str) -> int:
    value = _int(text)
    if not 1 <= value <= 36_500:  # (a date past year 9999 overflows the certificate's validity field)
        raise argparse.ArgumentTypeError(f"must be in 1..36500 days, got {text!r}")
    return value


def positive_int(text: str) -> int:
    value = _int(text)
    if not 0 < value <= INT32_MAX:
        raise argparse.ArgumentTypeError(f"must be in 1..{INT32_MAX}, got {text!r}")
    return value


def page_limit(text: str) -> int:
    """--limit of list and job list: the gateway's page size range."""
    value = _int(text)
    if not 1 <= value <= LIST_MAX:
        raise argparse.ArgumentTypeError(f"must be in 1..{LIST_MAX} (per page; --page-token for more), got {text!r}")
    return value


def q_or_auto(text: str) -> int | None:
    """A number of slice types, or None for "auto"."""
    if text == "auto":
        return None
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be auto or a whole number in 1..{INT32_MAX}, got {text!r}") from None


def non_negative_int(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= INT32_MAX:
        raise argparse.ArgumentTypeError(f"must be in 0..{INT32_MAX}, got {text!r}")
    return value


def priority(text: str) -> int:
    """--priority: the gateway's range (TaskSpec.validate), in the gateway's words."""
    from hsched.domain.task import PRIORITY_MAX, PRIORITY_MIN

    value = _int(text)
    if not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise argparse.ArgumentTypeError(f"must be in {PRIORITY_MIN}..{PRIORITY_MAX}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def _nodes_to_score(text: str) -> str:
    from hsched.policies.base import NodesToScore

    try:
        return str(NodesToScore.parse(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("nodes_to_score: ")) from None


def non_negative_float(text: str) -> float:
    value = _finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _scaled(text: str, unit: int, what: str) -> float:
    """A non-negative amount sent as round(amount × unit) `what` in an int64 field: at most what that holds."""
    value = non_negative_float(text)
    if value * unit > INT64_MAX:  # float against int: compared exactly (and inf, which round() cannot take)
        raise argparse.ArgumentTypeError(f"must be in 0..{INT64_MAX / unit:.4g} (as {what}: int64), got {text!r}")
    if value and round(value * unit) == 0:  # sent as 0: a request of nothing, not the little asked for
        raise argparse.ArgumentTypeError(f"must be 0 or at least 1 {what} ({1 / unit:g}), got {text!r}")
    return value


def cores(text: str) -> float:
    return _scaled(text, 1000, "millicores")


def gib(text: str) -> float:
    return _scaled(text, 1024, "MiB")


def port(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in 0..65535 (0: a free one), got {text!r}")
    return value


def tpch_sizes(text: str) -> tuple[str, ...]:
    from hsched.traces.decima import tpch_size

    try:
        return tuple(tpch_size(size) for size in text.split(","))
    except ValueError as exc:  # it names the size and the known ones
        raise argparse.ArgumentTypeError(str(exc)) from None


def percent(text: str) -> float:
    value = non_negative_float(text)
    if value > 100:
        raise argparse.ArgumentTypeError(f"must be in 0..100, got {text!r}")
    return value


def core_percent(text: str) -> int:
    value = _int(text)
    if not 1 <= value <= 100:
        raise argparse.ArgumentTypeError(f"must be in 1..100 (% of one GPU's cores), got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from hsched.domain.task import PRIORITY_CLASSES, PRIORITY_MAX, PRIORITY_MIN

    p = argparse.ArgumentParser(prog="hsched", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    def replay_flags(sp):
        sp.add_argument("--limit", type=positive_int, default=None,
                        help="trace rows to replay (default 1000); DAG jobs: tpch all, alibaba2018 "
                             f"{ALIBABA_DEFAULT_JOBS}")
        sp.add_argument("--skip", type=non_negative_int, default=None,
                        help="trace rows to skip first (default: openb 3000, a window of steady arrivals; others 0)")
        sp.add_argument("--duration", type=positive_float, default=30.0,
                        help="wall-clock seconds the slice is compressed to")
        sp.add_argument("--concurrency", type=positive_int, default=64, help="gRPC calls in flight at most")
        sp.add_argument("--seed", type=int, default=0, help="seed for the entry vertices drawn per task (tpch: the "
                        "job order and arrivals)")
        sp.add_argument("--tpch-sizes", type=tpch_sizes, default="2g",
                        help="tpch: input sizes, comma-separated (2g,5g,...,100g)")
        sp.add_argument("--tpch-interval-s", "--job-interval-s", type=positive_float, default=30.0,
                        help="tpch, alibaba2018: mean gap between job arrivals, trace seconds (Poisson)")
        sp.add_argument("--tpch-max-tasks", "--job-max-tasks", type=non_negative_int, default=16,
                        help="tpch, alibaba2018: fold wider stages into this many longer tasks (same "
                             "executor-seconds; 0 = none)")
        sp.add_argument("--tpch-timeout-s", "--job-timeout-s", type=positive_float, default=600.0,
                        help="tpch, alibaba2018: wall seconds to wait for the jobs to finish")
        sp.add_argument("--alibaba-min-tasks", type=positive_int, default=2,
                        help="alibaba2018: only jobs with at least this many tasks (2 = real DAGs)")
        sp.add_argument("--alibaba-max-instances", type=non_negative_int, default=2000,
                        help="alibaba2018: only jobs with at most this many instances in all (0 = any)")

    up = sub.add_parser("up", help="run Redis (embedded unless REDIS_URL is set), thermal, selector, the DCs' "
                                   "placers and the gateway as local processes")
    up.add_argument("--fleet", default=None, help="fleet YAML (default: embedded Abilene 11-DC fleet)")
    from hsched.policies.heuristics import POLICY_NAMES

    up.add_argument("--policy", default="bestfit", choices=POLICY_NAMES,
                    help="placer policy; double-dqn, ddpg and eade-ddpg load the shipped models/ "
                         "(a heuristic stands in, said in every decision, when a model is missing or does not fit)")
    up.add_argument("--gpu-policy", choices=POLICY_NAMES,
                    help="policy of the DCs with GPU cards (default: --policy), e.g. --policy double-dqn "
                         "--gpu-policy eade-ddpg")
    up.add_argument("--path-finder", default="dijkstra", choices=["dijkstra", "per-dqn"],
                    help="the selector's routes: Dijkstra, or the shipped PER-DQN agent (every agent path is "
                         "checked against Dijkstra and used only when valid and not longer)")
    up.add_argument("--no-thermal", action="store_true", help="run without the thermal service and guard")
    up.add_argument("--sensor-readings", action="store_true",
                    help="simulated room sensors: the thermal service writes scans of its model at the ledgers' load "
                         "plus noise onto the readings streams, which it recalibrates from (docs/thermal.md); real "
                         "readings: `hsched thermal replay FILE`")
    up.add_argument("--port", type=port, default=50051,
                    help="gateway port (the first gateway's with --gateways; 0: a free one)")
    up.add_argument("--gateways", type=positive_int, default=1,
                    help="gateway processes on the one Redis (default 1); the first on --port, the others on free "
                         "ports, every client of the stack (CLI, replay) balancing round-robin over all of them "
                         "through one target ipv4:127.0.0.1:P1,127.0.0.1:P2 (docs/operations.md)")
    up.add_argument("--prefix", default=PREFIX, help=f"Redis key prefix (default {PREFIX})")
    up.add_argument("--traces", default="none", choices=["none", "console", "otlp"])
    up.add_argument("--log-dir", default=None, help="write the services' logs here (kept; default: a private run "
                                                     "dir removed on a clean stop)")
    up.add_argument("--keep-logs", action="store_true",
                    help="keep the private run dir with the logs after a clean stop (a failed start or a crash "
                         "always keeps it, and says where)")
    up.add_argument("--state-dir", default=None,
                    help="where the embedded Redis keeps its append-only file (redis/) and the epoch marker; reused "
                         "by the next `hsched up` (default: $XDG_STATE_HOME/hsched/<prefix>, else "
                         "~/.local/state/hsched/<prefix>)")
    up.add_argument("--fresh", action="store_true", help="wipe the state dir first: a new, empty deployment")
    up.add_argument("--redis-appendfsync", default="everysec", choices=["everysec", "always"],
                    help="fsync the AOF once a second (a crash of the machine may lose ~1 s) or before every reply")
    up.add_argument("--redis-replicas", type=non_negative_int, default=0,
                    help="run this many Redis replicas and a Sentinel; services follow the Sentinel's master and "
                         "ledger/task writes wait (WAIT) for every replica before they are acknowledged")
    up.add_argument("--log-level", default="INFO")
    up.add_argument("--placer-processes", type=non_negative_int, default=PLACER_PROCESSES,
                    help="host the DCs' placers in this many processes (the fleet in groups, fleet order; each DC "
                         "keeps its own engine, ledger, lease and gRPC port; ~100 MiB less per process saved); "
                         f"0 = one process per DC, as compose and Kubernetes run them (default {PLACER_PROCESSES})")
    up.add_argument("--time-factor", type=positive_float, default=None,
                    help="run tasks time-compressed: F task seconds per wall second (a task runs runtime_s / F "
                         "seconds; default: HSCHED_TIME_FACTOR or 1 = real time)")
    up.add_argument("--dag-policy", default="fifo", choices=["fifo", "sjf-cp", "tetris", "ba3c"],
                    help="the placers' order among queued DAG-job stages of one class/tenant/priority band: fifo "
                         "(arrival, default), sjf-cp (least remaining job work, then longest critical path), tetris "
                         "(Tetris*: packing + shortest remaining work) or ba3c (the shipped learned scheduler); "
                         "hsched.policies.dagqueue")
    up.add_argument("--nodes-to-score", type=_nodes_to_score, default="all",
                    help="feasible nodes one placement decision scores: all (default), a count (256) or a "
                         "percentage of the feasible nodes, at least 100 (10%%); a seeded sample when more fit "
                         "(kube-scheduler's percentageOfNodesToScore; docs/scale.md)")
    up.add_argument("--tenant-weights", default=os.environ.get("HSCHED_TENANT_WEIGHTS", ""),
                    help="the tenants' weights in the placers' fair share of their deferred queues (Volcano "
                         "proportion): tenant=weight,... or a YAML/JSON file {tenants: {tenant: weight}, default: w} "
                         "(default: HSCHED_TENANT_WEIGHTS, else every tenant weight 1)")
    up.add_argument("--slice-types", default="",
                    help="a slice-types file (`hsched slices fit`): the placers pre-partition every node into slices "
                         "of those types and place each task part in one (paper 001; default: no slices)")
    up.add_argument("--auth", action="store_true",
                    help="tenant authentication at the gateway: <state-dir>/tokens.yaml with an admin token whose "
                         "value is in <state-dir>/admin.token (0600); the CLI uses it for this stack")
    up.add_argument("--replay", default="", help="replay a trace once the stack is up: openb, thunder, kth, ..., or "
                    "tpch or alibaba2018 (DAG jobs; sets --time-factor so the arrivals span --duration unless given)")
    up.add_argument("--keep-running", action="store_true", help="keep the stack up after the replay")
    up.add_argument("--no-supervise", action="store_true",
                    help="do not restart dead or hung services (default: restart them with back-off)")
    up.add_argument("--unhealthy-restart-s", type=positive_float, default=60.0,
                    help="restart a service whose gRPC health is NOT_SERVING or unanswered this long (seconds)")
    up.add_argument("--supervisor-metrics-port", type=port, default=0,
                    help="port of the supervisor's Prometheus /metrics (0: a free port, shown in the table)")
    up.add_argument("--tls", action="store_true",
                    help="mutual TLS on every gRPC hop: a CA and per-service certificates in <state dir>/tls")
    up.add_argument("--prometheus", action="store_true",
                    help="also run a real Prometheus (the `prometheus` binary: Debian's package, or HSCHED_PROMETHEUS_BIN) "
                         "scraping every service; config generated from the stack, TSDB in <state dir>/prometheus")
    up.add_argument("--prometheus-port", type=port, default=None,
                    help="Prometheus' port on 127.0.0.1 (default: 9090 if free, else a free port; 0: a free port)")
    replay_flags(up)
    up.set_defaults(fn=cmd_up)

    ce = sub.add_parser("certs", help="a local CA and service/client certificates for --tls (hsched.security.pki)")
    ce_sub = ce.add_subparsers(dest="certs_command", required=True)
    ce_init = ce_sub.add_parser("init", help="a new CA and certificates for every service, redis and admin")
    ce_issue = ce_sub.add_parser("issue", help="issue (or re-issue) one certificate with the directory's CA")
    ce_issue.add_argument("name", help="gateway|selector|placer|thermal|supervisor|redis|admin, admin-<name> "
                                       "or tenant-<tenant>")
    ce_issue.add_argument("--uri", default=None, help="the SPIFFE ID (default: from the name)")
    ce_rotate = ce_sub.add_parser("rotate", help="re-issue every certificate (new keys), atomically")
    ce_rotate.add_argument("--new-ca", action="store_true",
                           help="sign with a new CA; the old one stays in ca.crt until --drop-old-ca")
    ce_rotate.add_argument("--drop-old-ca", action="store_true", help="ca.crt keeps only the current CA")
    ce_init.add_argument("--force", action="store_true", help="replace an existing CA")
    for sp in (ce_init, ce_issue, ce_rotate):
        sp.add_argument("--dir", required=True, help="the TLS directory (created 0700)")
        sp.add_argument("--days", type=certificate_days, default=90, help="validity of the leaf certificates "
                                                                          "(1..36500)")
    ce.set_defaults(fn=cmd_certs)

    rp = sub.add_parser("replay", help="replay a real trace through a running gateway")
    rp.add_argument("replay", help="trace: openb, openb-gpuspec33, thunder, kth, or tpch / alibaba2018 (DAG jobs)")
    rp.add_argument("--time-factor", type=positive_float, default=None,
                    help="tpch, alibaba2018: the placers' time factor, for a stack `hsched up` did not start "
                         "(else it is the stack's, and another value is refused; default 1)")
    rp.add_argument("--gateway", default=None, help=GATEWAY_HELP)
    rp.add_argument("--fleet", default=None, help=f"fleet YAML the trace's entry vertices are drawn from ({STACK_DEFAULT}, "
                    "else the embedded Abilene fleet)")
    rp.add_argument("--prefix", default=None, help=PREFIX_HELP)
    rp.add_argument("--json", action="store_true",
                    help="task traces: print the summary as JSON on stdout (progress goes to stderr)")
    replay_flags(rp)
    rp.set_defaults(fn=cmd_replay)

    def credential_flags(sp):
        sp.add_argument("--token-file", default=None,
                        help="file holding the bearer token (else env HSCHED_TOKEN, HSCHED_TOKEN_FILE, or the "
                             "running stack's admin token); never pass a token itself on the command line")
        sp.add_argument("--tls-ca", default=None, help="CA bundle that verifies the gateway's TLS certificate "
                        "(else env HSCHED_TLS_CA; client certificate: HSCHED_TLS_CERT + HSCHED_TLS_KEY)")

    credential_flags(rp)

    def gw(sp):
        sp.add_argument("--gateway", default=None, help=GATEWAY_HELP)
        sp.add_argument("-o", "--output", default="table", choices=FORMATS,
                        help="table (default), json or yaml (the gateway's reply; streamed events: JSON Lines / "
                             "one YAML document each)")
        sp.add_argument("--json", action="store_true", help="the same as -o json")
        credential_flags(sp)
        return sp

    s = gw(sub.add_parser("submit", help="submit one task, or a DAG job with -f job.yaml"))
    s.add_argument("-f", "--file", default="", help="task specs (TaskSpec fields: one, a list, or a --- stream; see "
                   "examples/tasks.yaml) or a DAG job (a `stages` key; examples/job.yaml) as YAML/JSON")
    s.add_argument("--cpu", type=cores, default=1.0, help="cores per replica")
    s.add_argument("--memory-gib", type=gib, default=1.0)
    s.add_argument("--disk-gib", type=gib, default=0.0)
    s.add_argument("--bandwidth-mbps", type=non_negative_int, default=0)
    s.add_argument("--gpus", type=non_negative_int, default=0, help="GPU slices per replica")
    s.add_argument("--gpu-core-percent", type=core_percent, default=None,
                   help="%% of one GPU's cores per slice (default 100; needs --gpus)")
    s.add_argument("--gpu-memory-gib", type=gib, default=None,
                   help="GPU memory per slice (needs --gpus; default 0: none reserved, so tasks sharing the card "
                        "may take all of its memory)")
    s.add_argument("--gpu-model", action="append", help="allowed GPU model (repeatable)")
    s.add_argument("--replicas", type=positive_int, default=1)
    s.add_argument("--runtime-s", type=non_negative_float, default=3600.0, help="task seconds (0: runs until released)")
    s.add_argument("--data-mb", type=non_negative_float, default=0.0)
    s.add_argument("--entry", default="", help="entry vertex (default: the fleet's scheduler vertex)")
    s.add_argument("--max-latency-ms", type=non_negative_float, default=0.0)
    s.add_argument("--max-jitter-ms", type=non_negative_float, default=0.0)
    s.add_argument("--max-loss-percent", type=percent, default=0.0)
    s.add_argument("--tenant", default="default")
    s.add_argument("--name", default="")
    s.add_argument("--priority-class", default="", choices=[c for c in PRIORITY_CLASSES if c],
                   help="online: may evict offline tasks when it finds no room, and is served first from the "
                        "queue; offline (the default, as the wire's \"\")")
    s.add_argument("--priority", type=priority, default=0, help="order within the priority class, higher first "
                   f"({PRIORITY_MIN}..{PRIORITY_MAX}; default 0)")
    s.add_argument("--request-id", default="", help="idempotency key")
    s.add_argument("--method", default="", help="selector method: min-cost (default), crf, spf")
    # the flags that describe the task: with -f the file does, so they are refused there rather than ignored
    spec_flags = {a.dest: (a.option_strings[-1], a.default) for a in s._actions
                  if a.option_strings and a.dest not in ("help", "file", "method", "gateway", "output", "json",
                                                         "token_file", "tls_ca")}
    s.set_defaults(fn=cmd_submit, spec_flags=spec_flags)

    g = gw(sub.add_parser("get", help="show one task"))
    g.add_argument("task_id")
    g.set_defaults(fn=cmd_get)

    ls = gw(sub.add_parser("list", help="list tasks"))
    ls.add_argument("--tenant", default="")
    ls.add_argument("--state", default="", choices=["", *STATES], metavar="STATE", help=" ".join(STATES))
    ls.add_argument("--datacenter", default="")
    ls.add_argument("--job", default="", help="only this DAG job's tasks")
    ls.add_argument("--limit", type=page_limit, default=LIST_DEFAULT)
    ls.add_argument("--page-token", default="")
    ls.set_defaults(fn=cmd_list)

    w = gw(sub.add_parser("watch", help="stream task events (of one task: until it reaches a final state)"))
    w.add_argument("task_id", nargs="?", default="")
    w.add_argument("--tenant", default="")
    w.add_argument("--after", default="", help="event id to resume after; 0 = from the start")
    w.set_defaults(fn=cmd_watch)

    jb = gw(sub.add_parser("job", help="DAG jobs: get, list, cancel or watch (until it reaches a final state; "
                                       "submit with `hsched submit -f`)"))
    jb.add_argument("action", choices=["get", "list", "cancel", "watch"])
    jb.add_argument("job_id", nargs="?", default="")
    jb.add_argument("--tenant", default="")
    jb.add_argument("--state", default="", choices=["", *JOB_STATES], metavar="STATE", help=" ".join(JOB_STATES))
    jb.add_argument("--limit", type=page_limit, default=LIST_DEFAULT)
    jb.add_argument("--page-token", default="")
    jb.add_argument("--after", default="", help="watch: event id to resume after (default: from the start; a "
                    "finished job then prints its line, --after 0 its events)")
    jb.set_defaults(fn=cmd_job)

    r = gw(sub.add_parser("release", help="release a task's resources"))
    r.add_argument("task_id")
    r.set_defaults(fn=cmd_release)

    gw(sub.add_parser("dcs", help="every data center: free/total CPU, memory and GPUs by model, utilisation, PUE, "
                                  "hottest inlet, placer status and lease")).set_defaults(fn=cmd_dcs)
    nd = gw(sub.add_parser("nodes", help="one data center's nodes and GPU cards: free cores, memory, core %% per card"))
    nd.add_argument("datacenter")
    nd.add_argument("--gpu-model", default="", help="only the nodes with cards of this model (see hsched dcs)")
    nd.set_defaults(fn=cmd_nodes)
    tn = gw(sub.add_parser("tenants", help="each tenant's fair share per data center (Volcano's proportion): "
                                           "allocated / deserved / asked for, share, tasks running and queued"))
    tn.add_argument("--datacenter", default="", help="only this data center")
    tn.set_defaults(fn=cmd_tenants)
    for name, what in (("cordon", "take nodes out of scheduling: nothing new is placed there, what runs there "
                                  "stays (hsched nodes DC shows them cordoned, then drained)"),
                       ("drain", "cordon nodes and evict their offline (preemptible) tasks, which are requeued and "
                                 "placed elsewhere; online tasks run to completion"),
                       ("uncordon", "put cordoned nodes back into scheduling")):
        co = gw(sub.add_parser(name, help=what))
        co.add_argument("datacenter")
        co.add_argument("nodes", nargs="+", metavar="NODE", help="node names, as hsched nodes DC lists them")
        if name != "uncordon":
            co.add_argument("--reason", default="", help="why (shown with the node)")
        co.set_defaults(fn=cmd_cordon)
    de = gw(sub.add_parser("describe", help="one task explained: chosen DC and why, cost, path, node/card/slice, "
                                            "thermal effect, alternatives, rejection reasons in full, its events"))
    de.add_argument("task_id")
    de.set_defaults(fn=cmd_describe)

    tk = sub.add_parser("tokens", help="create, list or revoke the gateway's bearer tokens (a tokens file)")
    tk_sub = tk.add_subparsers(dest="tokens_command", required=True)

    def tokens_file_flag(sp):
        sp.add_argument("--file", default=os.environ.get("HSCHED_TOKENS_FILE", ""),
                        help="the tokens file (default: env HSCHED_TOKENS_FILE)")
        sp.set_defaults(fn=cmd_tokens)
        return sp

    tc = tokens_file_flag(tk_sub.add_parser("create", help="add a token; prints it once (stdout)"))
    tc.add_argument("--tenant", default="", help="the tenant the token acts as (required for role tenant)")
    tc.add_argument("--role", default="tenant", choices=["tenant", "admin"])
    tc.add_argument("--name", default="", help="unique name (default: <tenant>-<4 hex>)")
    tc.add_argument("--expires", default=None, help="ISO 8601 time after which the token is refused")
    tokens_file_flag(tk_sub.add_parser("list", help="the tokens (names, roles, tenants; no secrets)"))
    tokens_file_flag(tk_sub.add_parser("revoke", help="remove a token (the gateway re-reads the file)")).add_argument(
        "name")

    from hsched.eval import EXPERIMENTS

    ev = sub.add_parser("eval", help="run a paper experiment: markdown table + PNG plots")
    ev.add_argument("experiment", choices=[*EXPERIMENTS, "all"])
    ev.add_argument("--seeds", type=positive_int, default=3, help="seeds 0..N-1; tables show mean ± std")
    ev.add_argument("--out", default="reports", help="directory for report.md and the PNGs")
    ev.add_argument("--quick", action="store_true", help="small slices (smoke test), said in the report")
    data_flags(ev)
    ev.add_argument("--tasks", type=positive_int, help="trace tasks per run where an experiment draws a fixed "
                                                       "number (stage1, gpu, node-vs-cluster; default: its own)")
    ev.set_defaults(fn=cmd_eval)

    from hsched.rl.training import CHECKPOINT_SECONDS, TRAINERS

    tr = sub.add_parser("train", help="train a learned policy; checkpoint + metadata + learning-curve PNG",
                        description="agents: " + "; ".join(f"{k}: {h}" for k, (_, h) in TRAINERS.items()))
    tr.add_argument("agent", choices=list(TRAINERS))
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--steps", type=positive_int,
                    help="environment steps (default: the budget the shipped model used; the DQN and DDPG agents "
                         "refuse one that ends before their first gradient update); episodes for ba3c "
                         "and a3c, training iterations for jobfusion and decima-colocation")
    tr.add_argument("--out", help="checkpoint path (default: a new runs/<agent>-<UTC time>/<agent>.pt; replacing a "
                                  "shipped model, which the stack serves, takes an explicit --out models/<model>.pt)")
    tr.add_argument("--resume", action="store_true", help="continue the training checkpoint at --out (required) of a "
                    "run of the same agent, data, seed and hyper-parameters, finished or killed")
    tr.add_argument("--checkpoint-seconds", type=non_negative_float, default=CHECKPOINT_SECONDS, metavar="S",
                    help="also save the resumable state at the first episode boundary after every S seconds of "
                         "training (default %(default)g; 0: every episode), so a killed run loses at most that much")
    tr.add_argument("--init", metavar="MODEL", help="start from this checkpoint's weights instead of from scratch "
                                                 "(fine-tuning; ba3c, a3c: no cloning, the RL phase only)")
    tr.add_argument("--compare", action="store_true",
                    help="also train the paper's comparison runs (DQN vs PER-DQN; expert ratio 0/10/100 %%) "
                         "and plot them in one learning curve")
    tr.add_argument("--quiet", action="store_true", help="no progress bar")
    data_flags(tr)
    tr.set_defaults(fn=cmd_train)

    lk = sub.add_parser("link", help="publish a WAN link metric update (as a network probe would)")
    lk.add_argument("a")
    lk.add_argument("b")
    lk.add_argument("--latency-ms", type=non_negative_float)
    lk.add_argument("--jitter-ms", type=non_negative_float)
    lk.add_argument("--loss-percent", type=percent)
    lk.add_argument("--bandwidth-mbps", type=non_negative_float)
    lk.add_argument("--reset", action="store_true",
                    help="every metric back to the fleet file's (earlier updates no longer apply)")
    lk.add_argument("--prefix", default=None, help=PREFIX_HELP)
    lk.add_argument("--fleet", default=None, help=f"fleet YAML whose WAN the update is checked against ({STACK_DEFAULT}, "
                    "else the embedded Abilene fleet)")
    lk.set_defaults(fn=cmd_link)

    th = sub.add_parser("thermal", help="the thermal service's sensor telemetry (docs/thermal.md)")
    th_sub = th.add_subparsers(dest="thermal_cmd", required=True)
    tr_ = th_sub.add_parser("replay", help="validate a file of inlet/outlet readings (JSON lines or CSV) against the "
                                          "fleet and write it onto the readings streams, for the thermal service's "
                                          "online recalibration")
    tr_.add_argument("file")
    tr_.add_argument("--prefix", default=None, help=PREFIX_HELP)
    tr_.add_argument("--fleet", default=None, help="fleet YAML the readings' data centers and servers are checked "
                     f"against ({STACK_DEFAULT}, else the embedded Abilene fleet)")
    tr_.add_argument("--dry-run", action="store_true", help="validate only; write nothing")
    th.set_defaults(fn=cmd_thermal)

    sl = sub.add_parser("slices", help="paper 001's slice (container) types: fit them to a trace, or show a file")
    sl_sub = sl.add_subparsers(dest="slices_command", required=True)
    fit = sl_sub.add_parser("fit", help="cluster a trace's task demand vectors into Q slice types (connectivity-"
                                        "constrained hierarchical clustering), print the idle-vs-Q curve, write FILE")
    fit.add_argument("--trace", default="alibaba2018", choices=["alibaba2018"],
                     help="the trace whose demand vectors are clustered (its batch DAG jobs)")
    fit.add_argument("--q", type=q_or_auto, default=None, metavar="{auto,Q}", help="number of slice types, or auto: the knee of the idle-vs-Q curve")
    fit.add_argument("--q-max", type=positive_int, default=12, help="the curve's largest Q")
    fit.add_argument("--min-gain", type=non_negative_float, default=0.01,
                     help="auto Q: the smallest Q from which one more type lowers the idle fraction less than this")
    fit.add_argument("--max-instances", type=positive_int, default=200,
                     help="only jobs with at most this many instances (the simulator's pool)")
    fit.add_argument("--min-tasks", type=positive_int, default=2, help="only jobs with at least this many tasks")
    fit.add_argument("--machine-memory-gib", type=positive_float, default=None,
                     help="a v2018 machine's memory in GiB (the trace normalises it to 100; default 384, as the "
                          "replay assumes)")
    fit.add_argument("-o", "--output", required=True, help="the slice-types file to write (.yaml or .json)")
    show = sl_sub.add_parser("show", help="print a slice-types file and how the fleet's nodes are cut")
    show.add_argument("file")
    for sp in (fit, show):
        sp.add_argument("--fleet", default=None, help="fleet YAML whose node sizes are shown cut (default: embedded)")
    sl.set_defaults(fn=cmd_slices)

    k8 = sub.add_parser("k8s", help="Kubernetes manifests generated from the fleet file (docs/operations.md)")
    k8_sub = k8.add_subparsers(dest="k8s_command", required=True)
    kr = k8_sub.add_parser("render", help="plain YAML for Redis (or an external one), thermal, selector, one "
                                          "placer Deployment per data center, the gateway and NetworkPolicies")
    kr.add_argument("--fleet", default=None, help="fleet YAML (default: the embedded Abilene 11-DC fleet)")
    kr.add_argument("--namespace", default="hsched", help="the namespace every object goes to (RFC 1123 label)")
    kr.add_argument("--image", default="hsched:latest", help="the hsched image (the Dockerfile's)")
    kr.add_argument("--redis-url-secret", default=None, metavar="NAME",
                    help="use an external Redis whose URL is the key redis-url of this Secret (mounted as a file, "
                         "--redis-url-file); default: an in-cluster Redis StatefulSet with its AOF on a volume")
    kr.add_argument("--redis-port", type=int, default=6379,
                    help="with --redis-url-secret: the external Redis' port, opened by the egress NetworkPolicies")
    kr.add_argument("--redis-storage", default="1Gi", help="the in-cluster Redis' volume size")
    kr.add_argument("--redis-appendfsync", default="everysec", choices=["everysec", "always"],
                    help="the in-cluster Redis' AOF fsync: once a second, or before every reply")
    kr.add_argument("--policy", default="bestfit", choices=POLICY_NAMES, help="the placers' policy")
    kr.add_argument("--gpu-policy", choices=POLICY_NAMES, help="policy of the DCs with GPU cards (default: --policy)")
    kr.add_argument("--nodes-to-score", default="all", help="the placers' --nodes-to-score (as hsched up's)")
    kr.add_argument("--dag-policy", default="fifo", help="the placers' --dag-policy (as hsched up's)")
    kr.add_argument("--tenant-weights", default="", help="the placers' fair-share weights (as hsched up's), put "
                    "beside the fleet file in its ConfigMap")
    kr.add_argument("--epoch", default="", help="once deployed: the epoch Redis holds (kubectl exec redis-0 -- "
                    "redis-cli GET hsched:epoch), given to every service as HSCHED_EPOCH, so they refuse a Redis "
                    "that lost its data instead of claiming a new epoch on it (default: the first service claims)")
    kr.add_argument("-o", "--output", default="-",
                    help="a directory (one file per component and a kustomization.yaml) or - for one multi-document "
                         "stream on stdout (default)")
    kr.set_defaults(fn=cmd_k8s)
    return p


def _transport_hint(args, exc: grpc.RpcError) -> str:
    """Why a connection may have failed when the client and the gateway disagree on TLS: gRPC itself says only
    "Socket closed" (plaintext to a TLS port) or "WRONG_VERSION_NUMBER" (TLS to a plaintext port)."""
    details = exc.details() or ""
    if exc.code() != grpc.StatusCode.UNAVAILABLE or not getattr(args, "gateway", None):
        return ""
    try:
        tls = _credentials(args).tls
    except Exception:  # noqa: BLE001 - the hint is best effort; the error itself is what matters
        return ""
    if not tls and "Socket closed" in details:
        return (f" (if {args.gateway} serves TLS, give its CA: --tls-ca FILE or HSCHED_TLS_CA; "
                "a stack started with `hsched up --tls` prints it)")
    if tls and "WRONG_VERSION_NUMBER" in details:
        return f" ({args.gateway} does not speak TLS: drop --tls-ca / HSCHED_TLS_CA for a plaintext gateway)"
    return ""


def main(argv: list[str] | None = None) -> int:
    from hsched.localstate import LocalStateError

    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "gateway", "") is None:
            args.gateway = os.environ.get("HSCHED_GATEWAY") or _running_stack().get("gateway") or FALLBACK_GATEWAY
        if getattr(args, "json", False) and hasattr(args, "output"):
            if args.output not in ("table", "json"):
                raise ValidationError("--json", f"is -o json; it cannot be combined with -o {args.output}")
            args.output = "json"
        return args.fn(args)
    except BrokenPipeError:
        # the reader left (`hsched list | head -1`): stop quietly, and keep the interpreter's final flush of
        # stdout from raising again; 141 = 128 + SIGPIPE, what a shell reports for any tool cut off this way
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except grpc.RpcError as exc:
        print(f"hsched: {exc.code().name}: {exc.details()}{_transport_hint(args, exc)}", file=sys.stderr)
        return 1
    except (LocalStateError, ValidationError) as exc:  # an ambiguous/unsafe stack file; bad credentials settings
        print(f"hsched: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file or port the command needs (a tokens file's missing directory, a port in use)
        where = f": {exc.filename}" if exc.filename else ""
        print(f"hsched {args.command}: {exc.strerror or exc}{where}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
