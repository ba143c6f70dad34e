"""The thermal service's online refit (hsched.thermal.refit.recalibrate) on simulated sensor scans.

For the small fleet's `cheap` room (4 servers, 2 racks) and the default fleet's first room (672 servers,
16 racks), per prior weight (the current model's weight in the fit, in scans) and window of S scans, prints:

- false publishes: of `--trials` windows of scans of a room the current model describes exactly (noise only),
  how many the refit would publish — at a steady load (every scan the same busy cores: only sensor noise
  varies) and at varied loads (every scan a new uniform random load);
- a hot rack: scans of the room whose rack 0 draws 6x its own exhaust (random loads): accepted or not, the
  held-out inlet RMSE of the current (geometry) model and of the fit, and the fit's largest error on D
  relative to D's largest entry.

Sensor noise 0.1 K on every temperature (inlet, outlet, supply); power from the energy balance (as the service
does for readings without metered power).

    python bench/thermal_refit.py [--trials 10] [--priors 0,0.01,0.1] [--windows 20,60,200]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hsched.domain.fleet import load_fleet
from hsched.thermal.datacenter import room_for
from hsched.thermal.readings import synthetic_readings
from hsched.thermal.refit import Scans, recalibrate
from hsched.thermal.zonal import ZonalRecirculation

ROOT = Path(__file__).resolve().parents[1]


def scans(room, truth: ZonalRecirculation, count: int, steady: bool, rng, noise_k: float) -> Scans:
    n = room.n
    k_per_w = 1.0 / (room.params.air_mass_flow_kg_s * room.params.cp_air)
    base = rng.uniform(0, 1, n) * room.total_cores
    supply, inlet, outlet = [], [], []
    for _ in range(count):
        power = room.power(base if steady else rng.uniform(0, 1, n) * room.total_cores)
        rs = synthetic_readings("x", "s", 20.0, 20.0 + truth.matvec(power), power, k_per_w, noise_k, rng)
        supply.append(rs[0].supply_c)
        inlet.append([r.inlet_c for r in rs])
        outlet.append([r.outlet_c for r in rs])
    return Scans.from_readings(np.array(supply), np.array(inlet), np.array(outlet), np.full((count, n), np.nan),
                               k_per_w)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--priors", default="0,0.01,0.1")
    ap.add_argument("--windows", default="20,60,200")
    ap.add_argument("--noise-k", type=float, default=0.1)
    args = ap.parse_args()
    rooms = [("cheap (small fleet)", next(d for d in load_fleet(str(ROOT / "tests/fleets/small.yaml")).datacenters
                                          if d.name == "cheap")),
             ("default fleet room 0", load_fleet(None).datacenters[0])]
    print(f"trials {args.trials}, sensor noise {args.noise_k} K; 2-core machine shared with other jobs\n")
    print("| room | servers / racks | prior (scans) | scans S | false publishes: steady load | varied loads "
          "| hot rack: published | held-out RMSE current → fit (K) | max |ΔD| / max D |")
    print("|---|---|---:|---:|---:|---:|---|---|---:|")
    t0 = time.perf_counter()
    for label, dc in rooms:
        room = room_for(dc)
        op = room.recirc
        hot = op.with_self_coupling_scaled(0, 6.0)
        for prior in (float(x) for x in args.priors.split(",")):
            for s in (int(x) for x in args.windows.split(",")):
                rng = np.random.default_rng(0)
                false_steady = sum(recalibrate(op, scans(room, op, s, True, rng, args.noise_k),
                                               prior_weight=prior).accepted for _ in range(args.trials))
                false_varied = sum(recalibrate(op, scans(room, op, s, False, rng, args.noise_k),
                                               prior_weight=prior).accepted for _ in range(args.trials))
                v = recalibrate(op, scans(room, hot, s, False, rng, args.noise_k), prior_weight=prior)
                if v.accepted:
                    d, t = v.model.to_dense(), hot.to_dense()
                    hot_cols = (f"yes | {v.rmse_current_k:.3f} → {v.rmse_new_k:.3f} | "
                                f"{np.abs(d - t).max() / t.max():.3f}")
                else:
                    hot_cols = f"no ({v.reason}) | {v.rmse_current_k:.3f} → {v.rmse_new_k:.3f} | "
                print(f"| {label} | {room.n} / {op.n_zones} | {prior:g} | {s} | {false_steady}/{args.trials} | "
                      f"{false_varied}/{args.trials} | {hot_cols} |", flush=True)
    print(f"\n{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
