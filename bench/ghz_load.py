"""ghz load against a running gateway, by reflection, with outcomes counted by task state.

ghz counts any OK reply as a success, and a DEFERRED or REJECTED Submit is an OK reply; so after the Submit load
this script lists the tasks the load created (they carry a tenant of this run's own) and counts them by state.
The configurations are in bench/ghz/ (ghz's own JSON config format, usable without this script:
`ghz --config bench/ghz/submit.json 127.0.0.1:50051`); `--write-configs` regenerates them from the trace.

    python bench/ghz_load.py [--gateway HOST:PORT] [-n 2000] [-c 16] [--trace openb] [--ghz PATH]

Phases: Submit (a mix of the trace's first `--mix` tasks, round-robin, each call with its own request_id from
ghz's per-call {{.UUID}}), Get (of the created tasks), List (the run's tenant), Watch (of created tasks; a watch
is a stream that ends only with the task, so each call is closed by ghz's deadline, `--watch-s`, and that
DeadlineExceeded is its normal end, counted apart from errors). The created tasks are released at the end.
With tenant authentication on, the token comes from HSCHED_TOKEN (written to a 0600 metadata file for ghz,
never to a command line). Plaintext only: for TLS use ghz's --cacert with the configs by hand.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from hsched.convert import task_to_pb  # noqa: E402
from hsched.domain.fleet import load_fleet  # noqa: E402
from hsched.replay import load_trace, with_locations  # noqa: E402
from hsched.v1 import common_pb2 as pb  # noqa: E402
from hsched.v1 import gateway_pb2, gateway_pb2_grpc  # noqa: E402

CONFIGS = ROOT / "bench" / "ghz"
TENANT = "ghz"  # the committed configs' tenant; a run replaces it with one of its own
SHARED_GHZ = ROOT.parent / "shared" / "tools" / "bin" / "ghz"  # this workplace's build (users install ghz)


def find_ghz(given: str | None) -> str | None:
    if given:
        return given if Path(given).is_file() else None
    return shutil.which("ghz") or (str(SHARED_GHZ) if SHARED_GHZ.is_file() else None)


def submit_config(trace: str, mix: int, fleet_path: str | None, tenant: str = TENANT) -> dict:
    """ghz config: Submit with the trace's first `mix` tasks (entry vertices of the fleet), round-robin; every call
    its own request_id (ghz renders {{.UUID}} per call)."""
    tasks = with_locations(load_trace(trace, mix), load_fleet(fleet_path), seed=0)
    data = []
    for t in tasks:
        task = MessageToDict(task_to_pb(t.spec), preserving_proto_field_name=True)
        task.update(tenant=tenant, request_id="ghz-{{.UUID}}")
        data.append({"task": task})
    return {"call": "hsched.v1.Gateway/Submit", "insecure": True, "total": 2000, "concurrency": 16, "data": data}


STATIC_CONFIGS = {
    "list.json": {"call": "hsched.v1.Gateway/List", "insecure": True, "total": 500, "concurrency": 8,
                  "data": {"tenant": TENANT, "limit": 100}},
}


def write_configs(trace: str, mix: int) -> list[Path]:
    CONFIGS.mkdir(exist_ok=True)
    out = []
    for name, config in {"submit.json": submit_config(trace, mix, None), **STATIC_CONFIGS}.items():
        path = CONFIGS / name
        path.write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
        out.append(path)
    return out


def run_ghz(ghz: str, config: dict, gateway: str, workdir: Path, metadata: Path | None, *extra: str) -> dict:
    """One ghz run from `config`; its JSON report."""
    path = workdir / f"{uuid.uuid4().hex}.json"
    path.write_text(json.dumps(config))
    argv = [ghz, "--config", str(path), "--format", "json", *extra]
    if metadata:
        argv += ["--metadata-file", str(metadata)]
    done = subprocess.run([*argv, gateway], capture_output=True, text=True, timeout=3600)
    if not done.stdout.strip().startswith("{"):
        raise SystemExit(f"ghz failed (exit {done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
    return json.loads(done.stdout)


def tasks_of(stub, tenant: str, metadata) -> list:
    out, token = [], ""
    while True:
        reply = stub.List(gateway_pb2.ListRequest(tenant=tenant, limit=1000, page_token=token), timeout=30,
                          metadata=metadata)
        out.extend(reply.tasks)
        token = reply.next_page_token
        if not token:
            return out


def row(name: str, report: dict, expected_end: str = "") -> dict:
    codes = dict(report.get("statusCodeDistribution") or {})
    ended = codes.pop(expected_end, 0) if expected_end else 0
    lat = {d["percentage"]: d["latency"] / 1e6 for d in report.get("latencyDistribution") or []}
    return {"phase": name, "calls": report["count"], "rps": round(report["rps"], 1), "ok": codes.pop("OK", 0),
            "ended_by_deadline": ended, "errors": codes, "p50_ms": lat.get(50), "p99_ms": lat.get(99)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gateway", help="default: $HSCHED_GATEWAY, else the stack `hsched up` runs")
    p.add_argument("--fleet", help="the stack's fleet (default: the running stack's, else the default fleet)")
    p.add_argument("-n", "--total", type=int, default=2000, help="Submit calls")
    p.add_argument("-c", "--concurrency", type=int, default=16)
    p.add_argument("--trace", default="openb")
    p.add_argument("--mix", type=int, default=200, help="distinct trace tasks in the Submit mix")
    p.add_argument("--watch-s", type=float, default=1.0, help="how long each Watch call streams")
    p.add_argument("--ghz", help="the ghz binary (default: on PATH)")
    p.add_argument("--write-configs", action="store_true", help="regenerate bench/ghz/*.json and exit")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    for flag in ("total", "concurrency", "mix"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')}: must be >= 1")
    if args.write_configs:
        print("\n".join(map(str, write_configs(args.trace, args.mix))))
        return 0
    ghz = find_ghz(args.ghz)
    if not ghz:
        print("ghz_load: ghz not found (install it: https://ghz.sh/docs/install, or pass --ghz)", file=sys.stderr)
        return 1
    from hsched.localstate import pick_stack

    stack = pick_stack(args.gateway or os.environ.get("HSCHED_GATEWAY"))
    gateway = args.gateway or stack.get("gateway") or "127.0.0.1:50051"
    tenant = f"ghz-{uuid.uuid4().hex[:8]}"  # this run's tasks, to count and release them
    token = os.environ.get("HSCHED_TOKEN")
    metadata = [("authorization", f"Bearer {token}")] if token else None
    channel = grpc.insecure_channel(gateway)
    stub = gateway_pb2_grpc.GatewayStub(channel)
    rows, states = [], collections.Counter()
    with tempfile.TemporaryDirectory(prefix="ghz-load-") as tmp:  # 0700: the metadata file holds the token
        work = Path(tmp)
        md = None
        if token:
            md = work / "metadata.json"
            md.touch(mode=0o600)
            md.write_text(json.dumps({"authorization": f"Bearer {token}"}))
        config = submit_config(args.trace, args.mix, args.fleet or stack.get("fleet"), tenant)
        config.update(total=args.total, concurrency=args.concurrency)
        rows.append(row("Submit", run_ghz(ghz, config, gateway, work, md)))
        created = tasks_of(stub, tenant, metadata)
        states.update(pb.TaskState.Name(t.state).removeprefix("TASK_STATE_") for t in created)
        ids = [{"task_id": t.task_id} for t in created[:500]]
        if ids:
            rows.append(row("Get", run_ghz(ghz, {"call": "hsched.v1.Gateway/Get", "insecure": True, "data": ids,
                                                 "total": 4 * len(ids), "concurrency": args.concurrency},
                                           gateway, work, md)))
            rows.append(row("Watch", run_ghz(ghz, {"call": "hsched.v1.Gateway/Watch", "insecure": True,
                                                   "data": ids[:50], "total": min(100, 2 * len(ids)),
                                                   "concurrency": min(args.concurrency, 8)},
                                             gateway, work, md, "--timeout", f"{args.watch_s}s"),
                            expected_end="DeadlineExceeded"))
        rows.append(row("List", run_ghz(ghz, {**STATIC_CONFIGS["list.json"], "data": {"tenant": tenant, "limit": 100}},
                                        gateway, work, md)))
    for t in created:  # leave the fleet as it was
        if t.state in (pb.TASK_STATE_PLACED, pb.TASK_STATE_RUNNING, pb.TASK_STATE_DEFERRED):
            stub.Release(gateway_pb2.ReleaseRequest(task_id=t.task_id), timeout=30, metadata=metadata)
    channel.close()
    report = {"gateway": gateway, "tenant": tenant, "phases": rows, "submit_outcomes": dict(sorted(states.items())),
              "tasks_created": len(created)}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"ghz load on {gateway} (tenant {tenant}): {len(created)} tasks created by {rows[0]['calls']} Submits")
        print("Submit outcomes by task state: " + ", ".join(f"{k} {v}" for k, v in sorted(states.items())))
        print(f"{'phase':<7} {'calls':>6} {'rps':>8} {'ok':>6} {'deadline':>8} {'p50 ms':>8} {'p99 ms':>8}  errors")
        for r in rows:
            print(f"{r['phase']:<7} {r['calls']:>6} {r['rps']:>8} {r['ok']:>6} {r['ended_by_deadline']:>8} "
                  f"{r['p50_ms'] or 0:>8.1f} {r['p99_ms'] or 0:>8.1f}  {r['errors'] or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
