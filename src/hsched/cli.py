"""`hsched`: run the local stack, submit and follow tasks, replay real traces."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading

import grpc
from google.protobuf.json_format import MessageToDict

from hsched.v1 import common_pb2 as pb
from hsched.v1 import gateway_pb2, gateway_pb2_grpc


def _running_stack_file() -> str:
    """Where `hsched up` leaves the addresses of the stack it runs (removed when it stops), so the other
    commands reach that stack — including its embedded Redis on a random port — without flags."""
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"hsched-stack-{os.getuid()}.json")


def _running_stack() -> dict:
    try:
        with open(_running_stack_file()) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


DEFAULT_GATEWAY = os.environ.get("HSCHED_GATEWAY") or _running_stack().get("gateway", "127.0.0.1:50051")
LINKS_MAXLEN = 10_000  # link metric updates kept on the links stream (approximately; probes re-publish)


def _redis_url() -> str | None:
    return os.environ.get("REDIS_URL") or _running_stack().get("redis_url")


def _stub(args) -> gateway_pb2_grpc.GatewayStub:
    return gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(args.gateway))


def _print(message, as_json: bool = True) -> None:
    print(json.dumps(MessageToDict(message, preserving_proto_field_name=True), indent=2))


STATES = [pb.TaskState.Name(v).removeprefix("TASK_STATE_").lower() for v in pb.TaskState.values() if v]
# states a task never leaves (hsched.state.tasks.TERMINAL, without importing the Redis side here)
FINAL = (pb.TASK_STATE_REJECTED, pb.TASK_STATE_RELEASED, pb.TASK_STATE_SUCCEEDED, pb.TASK_STATE_FAILED,
         pb.TASK_STATE_EXPIRED)


def _state_name(state: int) -> str:
    return pb.TaskState.Name(state).removeprefix("TASK_STATE_")


def _task_line(t: pb.Task) -> str:
    nodes = sorted({a.node for a in t.assignments})
    where = f"{t.datacenter} {','.join(nodes[:3])}{'…' if len(nodes) > 3 else ''}".strip()
    ran = f"ran {(t.finished_unix_ms - t.started_unix_ms) / 1000:g} s" if t.started_unix_ms and t.finished_unix_ms \
        else ""
    extra = "  ".join(x for x in (ran, f"preempted {t.preemptions}x" if t.preemptions else "", t.reason) if x)
    return f"{t.task_id}  {_state_name(t.state):<9} {where}  {extra}".rstrip()


# -- up ---------------------------------------------------------------------------------------------------------


def cmd_up(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from hsched.stack import Stack, StackConfig, default_state_dir
    from hsched.state.epoch import StateLost

    console = Console(width=max(Console().width, 112))  # the summary table needs ~110 columns
    if args.redis_replicas < 0:
        print("--redis-replicas must be >= 0", file=sys.stderr)
        return 2
    config = StackConfig(fleet_path=args.fleet, redis_url=os.environ.get("REDIS_URL") or None, prefix=args.prefix,
                         policy=args.policy, gpu_policy=args.gpu_policy, path_finder=args.path_finder,
                         thermal=not args.no_thermal, traces=args.traces,
                         gateway_port=args.port, log_dir=args.log_dir, log_level=args.log_level,
                         state_dir=str(args.state_dir or default_state_dir(args.prefix)), fresh=args.fresh,
                         redis_appendfsync=args.redis_appendfsync, redis_replicas=args.redis_replicas,
                         supervise=not args.no_supervise, unhealthy_restart_s=args.unhealthy_restart_s,
                         supervisor_metrics_port=args.supervisor_metrics_port, time_factor=args.time_factor)
    _log_supervision_to(console)
    stack = Stack(config)
    try:
        with console.status(f"starting Redis, thermal, selector, {len(stack.fleet.datacenters)} placers and the "
                            "gateway"):
            stack.start()
    except StateLost as exc:
        print(f"hsched up: {exc}", file=sys.stderr)
        return 1
    with open(_running_stack_file(), "w") as f:
        json.dump({"gateway": stack.gateway, "redis_url": stack.redis_url, "prefix": args.prefix, "pid": os.getpid()}, f)
    table = Table(title=f"hsched stack — fleet {stack.fleet.name} ({stack.fleet.wan.source or 'inline WAN'})")
    for col in ("service", "gRPC", "metrics", "RSS MiB"):
        table.add_column(col)
    rss = stack.rss_mib()
    for name, svc in stack.services.items():
        table.add_row(name, svc.target, f"http://127.0.0.1:{svc.metrics_port}/metrics" if svc.metrics_port else "-",
                      f"{rss.get(name, 0):.0f}")
    redis_rss = sum(v for k, v in rss.items() if k.startswith("redis"))
    table.add_row("redis", stack.redis_url, "-", f"{redis_rss:.0f}")
    if stack.supervisor_metrics:
        table.add_row("supervisor", "-", stack.supervisor_metrics.url, "-")
    console.print(table)
    console.print(f"logs: {stack.log_dir}; state (Redis AOF, epoch {stack.epoch}): {stack.state_dir}")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        if args.replay:
            run_replay(console, stack.gateway, stack.fleet, args, stack.redis_url, args.prefix)
            if not args.keep_running:
                return 0
        console.print(f"[bold]gateway on {stack.gateway}[/] — try: hsched submit --cpu 4 --memory-gib 8; "
                      "Ctrl-C stops everything")
        while not stop.wait(1):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        with console.status("stopping"):
            stack.stop()
        if _running_stack().get("pid") == os.getpid():
            os.remove(_running_stack_file())
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


def run_replay(console, gateway: str, fleet, args, redis_url: str | None, prefix: str) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from hsched.replay import dc_summaries, load_trace, replay, summary_rows, with_locations

    tasks = with_locations(load_trace(args.replay, args.limit, args.skip), fleet, args.seed)
    console.print(f"replaying {len(tasks)} tasks of trace [bold]{args.replay}[/] over ~{args.duration:g} s "
                  f"(time-compressed), {args.concurrency} in flight")
    with Progress(TextColumn("submit"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as bar:
        job = bar.add_task("submit", total=len(tasks))
        stats = asyncio.run(replay(gateway, tasks, args.duration, args.concurrency,
                                   progress=lambda done, total: bar.update(job, completed=done)))
    lat = sorted(stats.latencies_s)
    p = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1000) if lat else (lambda q: 0.0)
    console.print(f"{stats.submitted} submitted in {stats.elapsed_s:.1f} s: "
                  + ", ".join(f"{k} {v}" for k, v in sorted(stats.outcomes.items()))
                  + f"; {stats.released} released; Submit latency p50 {p(0.5):.1f} ms, p99 {p(0.99):.1f} ms"
                  + (f"; errors {dict(stats.errors)}" if stats.errors else ""))
    summaries = asyncio.run(dc_summaries(redis_url, prefix, fleet)) if redis_url else {}
    table = Table(title=f"replay summary — {args.replay}: final task states per data center")
    for col in ("DC", "placed", "deferred", "released", "rejected", "cost/task", "CPU", "GPU", "PUE", "inlet°C"):
        table.add_column(col, justify="right" if col != "DC" else "left", no_wrap=True)

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    for r in summary_rows(stats, summaries):
        table.add_row(r["datacenter"], str(r["placed"]), str(r["deferred"]), str(r["released"]), str(r["rejected"]),
                      fmt(r["mean_total_cost"], ".3f"), fmt(r["cpu_util"], ".1%"), fmt(r["gpu_util"], ".1%"),
                      fmt(r["pue"], ".3f"), fmt(r["max_inlet_c"], ".1f"))
    console.print(table)


def cmd_replay(args) -> int:
    from rich.console import Console

    from hsched.domain.fleet import load_fleet

    run_replay(Console(width=max(Console().width, 112)), args.gateway, load_fleet(args.fleet), args, _redis_url(), args.prefix)
    return 0


# -- task commands ----------------------------------------------------------------------------------------------


def cmd_submit(args) -> int:
    spec = pb.TaskSpec(
        request_id=args.request_id, tenant=args.tenant, name=args.name, priority=args.priority,
        resources=pb.Resources(cpu_milli=round(args.cpu * 1000), memory_mib=round(args.memory_gib * 1024),
                               disk_mib=round(args.disk_gib * 1024), bandwidth_mbps=args.bandwidth_mbps,
                               gpu_count=args.gpus, gpu_core_percent=args.gpu_core_percent if args.gpus else 0,
                               gpu_memory_mib=round(args.gpu_memory_gib * 1024) if args.gpus else 0),
        replicas=args.replicas, runtime_s=args.runtime_s, data_size_mb=args.data_mb, entry_vertex=args.entry,
        network=pb.NetworkRequirements(max_latency_ms=args.max_latency_ms, max_jitter_ms=args.max_jitter_ms,
                                       max_loss_percent=args.max_loss_percent),
        gpu_models=args.gpu_model or [])
    reply = _stub(args).Submit(gateway_pb2.SubmitRequest(task=spec, selector_method=args.method), timeout=30)
    _print(reply) if args.json else print(_task_line(reply.task) + ("  (duplicate)" if reply.duplicate else ""))
    return 0


def cmd_get(args) -> int:
    _print(_stub(args).Get(gateway_pb2.GetRequest(task_id=args.task_id), timeout=10))
    return 0


def cmd_list(args) -> int:
    state = pb.TaskState.Value(f"TASK_STATE_{args.state.upper()}") if args.state else 0  # a choice of STATES
    reply = _stub(args).List(gateway_pb2.ListRequest(tenant=args.tenant, state=state, datacenter=args.datacenter,
                                                     limit=args.limit, page_token=args.page_token), timeout=10)
    if args.json:
        _print(reply)
    else:
        for t in reply.tasks:
            print(_task_line(t))
        if reply.next_page_token:
            print(f"(more: --page-token {reply.next_page_token})")
    return 0


def cmd_watch(args) -> int:
    """Stream events. Watching one task: its events from the start (unless --after), ending once it reaches a
    final state; a task already finished prints that final state and exits at once."""
    stub = _stub(args)
    after = args.after
    if args.task_id:
        task = stub.Get(gateway_pb2.GetRequest(task_id=args.task_id), timeout=10)
        if task.state in FINAL:
            print(_task_line(task))
            return 0
        after = after or "0"  # it may finish between the Get and the Watch: its past events come too
    try:
        for ev in stub.Watch(gateway_pb2.WatchRequest(task_id=args.task_id, tenant=args.tenant, after_event_id=after)):
            print(f"{ev.event_id}  {ev.task_id}  {ev.kind:<11} {_state_name(ev.state):<9} {ev.datacenter}  "
                  f"{ev.detail}", flush=True)
            if args.task_id and ev.state in FINAL:
                return 0
    except KeyboardInterrupt:
        pass
    return 0


def cmd_release(args) -> int:
    reply = _stub(args).Release(gateway_pb2.ReleaseRequest(task_id=args.task_id), timeout=30)
    _print(reply) if args.json else print(_task_line(reply.task))
    return 0


def cmd_eval(args) -> int:
    """Run paper experiments: markdown to stdout (and report.md), PNG plots beside it."""
    from rich.console import Console

    from hsched.eval import EXPERIMENTS

    console = Console(stderr=True)
    for name in list(EXPERIMENTS) if args.experiment == "all" else [args.experiment]:
        _run_experiment(name, args, console)
    return 0


def _run_experiment(name: str, args, console) -> None:
    import importlib
    from pathlib import Path

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from hsched.eval import EXPERIMENTS
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

        report = run(EvalContext(seeds=list(range(args.seeds)), out_dir=out, quick=args.quick, progress=progress))
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(f"# {name}: {about}\n\n{report}\n")
    print(f"# {name}: {about}\n\n{report}\n")
    console.print(f"[bold]{name}[/]: report and plots in {out}/")


def cmd_train(args) -> int:
    """Train one agent from scratch (or resume it); print the figures it evaluated."""
    from pathlib import Path

    from hsched.rl.training import TrainArgs, trainer

    run = trainer(args.agent)
    figures = run(TrainArgs(seed=args.seed, steps=args.steps, out=Path(args.out) if args.out else None,
                            resume=args.resume, compare=args.compare, progress=not args.quiet))
    print(json.dumps(figures, indent=2, sort_keys=True, default=str))
    return 0


def cmd_link(args) -> int:
    """Publish a WAN link metric update (what a network probe does) on the links stream."""
    from hsched.state.keys import Keys
    from hsched.state.redis import connect_sync

    update = {"a": args.a, "b": args.b}
    for name in ("latency_ms", "jitter_ms", "loss_percent", "bandwidth_mbps"):
        if getattr(args, name) is not None:
            update[name] = getattr(args, name)
    redis = connect_sync(_redis_url() or "redis://127.0.0.1:6379/0")
    # bounded (docs/operations.md, Retention): the selector folds the stream, only recent updates matter
    print(redis.xadd(Keys(args.prefix).links, {"m": json.dumps(update)}, maxlen=LINKS_MAXLEN, approximate=True).decode())
    return 0


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hsched", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    def replay_flags(sp):
        sp.add_argument("--limit", type=int, default=1000, help="trace rows to replay")
        sp.add_argument("--skip", type=int, default=None,
                        help="trace rows to skip first (default: openb 3000, a window of steady arrivals; others 0)")
        sp.add_argument("--duration", type=float, default=30.0, help="wall-clock seconds the slice is compressed to")
        sp.add_argument("--concurrency", type=int, default=64, help="gRPC calls in flight at most")
        sp.add_argument("--seed", type=int, default=0, help="seed for the entry vertices drawn per task")

    up = sub.add_parser("up", help="run Redis (embedded unless REDIS_URL is set), thermal, selector, one placer "
                                   "per DC and the gateway as local processes")
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
    up.add_argument("--port", type=int, default=50051, help="gateway port")
    up.add_argument("--prefix", default="hsched", help="Redis key prefix")
    up.add_argument("--traces", default="none", choices=["none", "console", "otlp"])
    up.add_argument("--log-dir", default=None)
    up.add_argument("--state-dir", default=None,
                    help="where the embedded Redis keeps its append-only file (redis/) and the epoch marker; reused "
                         "by the next `hsched up` (default: $XDG_STATE_HOME/hsched/<prefix>, else "
                         "~/.local/state/hsched/<prefix>)")
    up.add_argument("--fresh", action="store_true", help="wipe the state dir first: a new, empty deployment")
    up.add_argument("--redis-appendfsync", default="everysec", choices=["everysec", "always"],
                    help="fsync the AOF once a second (a crash of the machine may lose ~1 s) or before every reply")
    up.add_argument("--redis-replicas", type=int, default=0,
                    help="run this many Redis replicas and a Sentinel; services follow the Sentinel's master and "
                         "ledger/task writes wait (WAIT) for every replica before they are acknowledged")
    up.add_argument("--log-level", default="INFO")
    up.add_argument("--time-factor", type=_positive_float, default=None,
                    help="run tasks time-compressed: F task seconds per wall second (a task runs runtime_s / F "
                         "seconds; default: HSCHED_TIME_FACTOR or 1 = real time)")
    up.add_argument("--replay", default="", help="replay a trace once the stack is up: openb, thunder, kth, ...")
    up.add_argument("--keep-running", action="store_true", help="keep the stack up after the replay")
    up.add_argument("--no-supervise", action="store_true",
                    help="do not restart dead or hung services (default: restart them with back-off)")
    up.add_argument("--unhealthy-restart-s", type=_positive_float, default=60.0,
                    help="restart a service whose gRPC health is NOT_SERVING or unanswered this long (seconds)")
    up.add_argument("--supervisor-metrics-port", type=int, default=0,
                    help="port of the supervisor's Prometheus /metrics (0: a free port, shown in the table)")
    replay_flags(up)
    up.set_defaults(fn=cmd_up)

    rp = sub.add_parser("replay", help="replay a real trace through a running gateway")
    rp.add_argument("replay", help="trace: openb, openb-gpuspec33, thunder, kth")
    rp.add_argument("--gateway", default=DEFAULT_GATEWAY)
    rp.add_argument("--fleet", default=None)
    rp.add_argument("--prefix", default="hsched")
    replay_flags(rp)
    rp.set_defaults(fn=cmd_replay)

    def gw(sp):
        sp.add_argument("--gateway", default=DEFAULT_GATEWAY)
        sp.add_argument("--json", action="store_true")
        return sp

    s = gw(sub.add_parser("submit", help="submit one task"))
    s.add_argument("--cpu", type=float, default=1.0, help="cores per replica")
    s.add_argument("--memory-gib", type=float, default=1.0)
    s.add_argument("--disk-gib", type=float, default=0.0)
    s.add_argument("--bandwidth-mbps", type=int, default=0)
    s.add_argument("--gpus", type=int, default=0, help="GPU slices per replica")
    s.add_argument("--gpu-core-percent", type=int, default=100)
    s.add_argument("--gpu-memory-gib", type=float, default=0.0)
    s.add_argument("--gpu-model", action="append", help="allowed GPU model (repeatable)")
    s.add_argument("--replicas", type=int, default=1)
    s.add_argument("--runtime-s", type=float, default=3600.0)
    s.add_argument("--data-mb", type=float, default=0.0)
    s.add_argument("--entry", default="", help="entry vertex (default: the fleet's scheduler vertex)")
    s.add_argument("--max-latency-ms", type=float, default=0.0)
    s.add_argument("--max-jitter-ms", type=float, default=0.0)
    s.add_argument("--max-loss-percent", type=float, default=0.0)
    s.add_argument("--tenant", default="default")
    s.add_argument("--name", default="")
    s.add_argument("--priority", type=int, default=0)
    s.add_argument("--request-id", default="", help="idempotency key")
    s.add_argument("--method", default="", help="selector method: min-cost (default), crf, spf")
    s.set_defaults(fn=cmd_submit)

    g = gw(sub.add_parser("get", help="show one task"))
    g.add_argument("task_id")
    g.set_defaults(fn=cmd_get)

    ls = gw(sub.add_parser("list", help="list tasks"))
    ls.add_argument("--tenant", default="")
    ls.add_argument("--state", default="", choices=["", *STATES], metavar="STATE", help=" ".join(STATES))
    ls.add_argument("--datacenter", default="")
    ls.add_argument("--limit", type=int, default=100)
    ls.add_argument("--page-token", default="")
    ls.set_defaults(fn=cmd_list)

    w = gw(sub.add_parser("watch", help="stream task events (of one task: until it reaches a final state)"))
    w.add_argument("task_id", nargs="?", default="")
    w.add_argument("--tenant", default="")
    w.add_argument("--after", default="", help="event id to resume after; 0 = from the start")
    w.set_defaults(fn=cmd_watch)

    r = gw(sub.add_parser("release", help="release a task's resources"))
    r.add_argument("task_id")
    r.set_defaults(fn=cmd_release)

    from hsched.eval import EXPERIMENTS

    ev = sub.add_parser("eval", help="run a paper experiment: markdown table + PNG plots")
    ev.add_argument("experiment", choices=[*EXPERIMENTS, "all"])
    ev.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1; tables show mean ± std")
    ev.add_argument("--out", default="reports", help="directory for report.md and the PNGs")
    ev.add_argument("--quick", action="store_true", help="small slices (smoke test), said in the report")
    ev.set_defaults(fn=cmd_eval)

    from hsched.rl.training import TRAINERS

    tr = sub.add_parser("train", help="train a learned policy; checkpoint + metadata + learning-curve PNG",
                        description="agents: " + "; ".join(f"{k}: {h}" for k, (_, h) in TRAINERS.items()))
    tr.add_argument("agent", choices=list(TRAINERS))
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--steps", type=int, help="environment steps (default: the budget the shipped model used)")
    tr.add_argument("--out", help="checkpoint path (default: models/<agent's model>.pt, the shipped one)")
    tr.add_argument("--resume", action="store_true", help="continue the training checkpoint at --out")
    tr.add_argument("--compare", action="store_true",
                    help="also train the paper's comparison runs (DQN vs PER-DQN; expert ratio 0/10/100 %%) "
                         "and plot them in one learning curve")
    tr.add_argument("--quiet", action="store_true", help="no progress bar")
    tr.set_defaults(fn=cmd_train)

    lk = sub.add_parser("link", help="publish a WAN link metric update (as a network probe would)")
    lk.add_argument("a")
    lk.add_argument("b")
    lk.add_argument("--latency-ms", type=float)
    lk.add_argument("--jitter-ms", type=float)
    lk.add_argument("--loss-percent", type=float)
    lk.add_argument("--bandwidth-mbps", type=float)
    lk.add_argument("--prefix", default="hsched")
    lk.set_defaults(fn=cmd_link)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except grpc.RpcError as exc:
        print(f"hsched: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
