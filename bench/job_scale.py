"""A DAG job's size against the gateway's work: how long until a job of `--stages` × `--tasks` short tasks
is SUCCEEDED at the gateway, and the gateway's CPU for it, per size.

The local stack (`hsched.stack.Stack`: the small fleet, no thermal service, placers' clock at `--time-factor`, an
embedded redis-server unless REDIS_URL is set) gets one job per size: independent stages of tasks of 100m CPU
and 64 MiB, `--runtime-s` task seconds each (the "cheap" room holds ~960 at once). Printed per size: wall
seconds from SubmitJob to the job's SUCCEEDED (GetJob polled every 0.1 s), the gateway's CPU seconds
(/proc/<pid>/stat) and per task, and the placers' for comparison. The jobs run one after another.

    python bench/job_scale.py [--sizes 1000,2000,4000] [--stages 2] [--time-factor 10] [--runtime-s 1]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import os
import secrets
import time

ROOT = Path(__file__).resolve().parents[1]
SMALL_FLEET = ROOT / "tests" / "fleets" / "small.yaml"


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1000,2000,4000", help="tasks per job, comma-separated")
    p.add_argument("--stages", type=int, default=2,
                   help="independent stages the tasks are split over (more where a stage would pass its task limit)")
    p.add_argument("--time-factor", type=float, default=10.0)
    p.add_argument("--runtime-s", type=float, default=1.0, help="task seconds of each task")
    p.add_argument("--timeout-s", type=float, default=900.0, help="give up on a job after this many wall seconds")
    opts = p.parse_args(argv)
    try:
        sizes = [int(s) for s in opts.sizes.split(",") if s]
    except ValueError:
        p.error(f"--sizes: {opts.sizes!r} must be comma-separated task counts")
    if not sizes or min(sizes) < opts.stages or opts.stages < 1:
        p.error("--sizes must each hold at least --stages tasks, --stages >= 1")

    import grpc

    from hsched.domain.limits import STAGE_MAX_TASKS
    from hsched.stack import Stack, StackConfig
    from hsched.v1 import common_pb2 as pb
    from hsched.v1 import gateway_pb2, gateway_pb2_grpc

    prefix = f"bench-jobs-{secrets.token_hex(4)}"
    config = StackConfig(fleet_path=str(SMALL_FLEET), redis_url=os.environ.get("REDIS_URL"), prefix=prefix,
                         gateway_port=0, thermal=False, time_factor=opts.time_factor)
    print(f"small fleet, time factor {opts.time_factor:g}, tasks of 100m CPU / 64 MiB / {opts.runtime_s:g} task s, "
          f"{opts.stages} independent stages per job")
    print(f"{'tasks':>7}{'wall s':>9}{'gateway CPU s':>15}{'gateway ms/task':>17}{'placers CPU s':>15}  state")
    with Stack(config) as stack:
        gw = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(stack.gateway))
        gateway_pid = stack.services[stack.gateway_names[0]].proc.pid
        placer_pids = [s.proc.pid for name, s in stack.services.items() if name.startswith("placer")]
        for size in sizes:
            n = max(opts.stages, -(-size // STAGE_MAX_TASKS))
            per, extra = divmod(size, n)
            stages = [pb.StageSpec(name=f"s{i}", tasks=per + (i < extra), runtime_s=opts.runtime_s,
                                   resources=pb.Resources(cpu_milli=100, memory_mib=64)) for i in range(n)]
            g0, p0 = cpu_s(gateway_pid), sum(cpu_s(pid) for pid in placer_pids)
            t0 = time.monotonic()
            job = gw.SubmitJob(gateway_pb2.SubmitJobRequest(job=pb.JobSpec(name=f"wide{size}", stages=stages)),
                               timeout=60).job
            while True:
                job = gw.GetJob(gateway_pb2.GetJobRequest(job_id=job.job_id), timeout=60)
                done = job.state in (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED)
                if done or time.monotonic() - t0 > opts.timeout_s:
                    break
                time.sleep(0.1)
            wall = time.monotonic() - t0
            g = cpu_s(gateway_pid) - g0
            placers = sum(cpu_s(pid) for pid in placer_pids) - p0
            print(f"{size:>7}{wall:>9.1f}{g:>15.1f}{1000 * g / size:>17.2f}{placers:>15.1f}  "
                  f"{pb.JobState.Name(job.state)}{'' if done else ' (timed out)'}", flush=True)


if __name__ == "__main__":
    main()
