"""GPU-aware DC choice: GPU tasks deferred while CPU-only tasks strand idle GPUs, before and after.

Replays a mixed slice of the Alibaba openb trace (GPU and CPU-only pods) through the selector's ranking and
the placers' planner in-process (`hsched.eval.stranding`: the stack's decision path without the transport)
with the GPU-aware DC choice off (paper 003's eq.3 and plain bestfit placers), with each half alone, and on
(the stranding term in the selector and the GPU-host reserve in the placers, docs/gpu_stranding.md).

`--hold` keeps every placed task (a load test's burst of Submits that fills the fleet, as the ghz load test
that found the problem); without it tasks end after their trace runtime.

    python bench/gpu_stranding.py [--fleet PATH] [--trace openb] [--tasks 6000] [--skip 0] [--hold]
                                  [--share 1.0] [--policy bestfit]
"""

from __future__ import annotations

import argparse
import time

from hsched.costs.stranding import StrandingConfig
from hsched.domain.fleet import load_fleet
from hsched.eval.report import markdown_table
from hsched.eval.stranding import HEADERS, compare
from hsched.traces.catalog import resolve_trace, trace_jobs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fleet")
    p.add_argument("--trace", default="openb")
    p.add_argument("--tasks", type=int, default=6000)
    p.add_argument("--skip", type=int, default=0)
    p.add_argument("--hold", action="store_true")
    p.add_argument("--share", type=float, default=1.0)
    p.add_argument("--policy", default="bestfit")
    args = p.parse_args()
    fleet = load_fleet(args.fleet)
    ref = resolve_trace(args.trace)
    jobs = trace_jobs(ref, limit=args.tasks, skip=args.skip)
    t0 = time.perf_counter()
    runs = compare(fleet, jobs, StrandingConfig(share=args.share), args.policy, args.hold)
    print(f"fleet {fleet.name}, {len(jobs)} tasks of {ref.label} from #{args.skip}, placers {args.policy}, "
          f"share {args.share:g}, {'held (never released)' if args.hold else 'released after their runtime'}; "
          f"{time.perf_counter() - t0:.1f} s\n")
    print(markdown_table(["GPU-aware DC choice", *HEADERS], [[k, *v.row()] for k, v in runs.items()]))
    for k, v in runs.items():
        if v.examples:
            print(f"\n{k}: e.g. {'; '.join(v.examples)}")


if __name__ == "__main__":
    main()
