"""The thermal model at scale: dense recirculation matrix vs the served zonal operator (hsched.thermal.zonal).

For the default CPU room (chicago: 16 racks × 42 servers in 2 rows) scaled to 672, 5,000 and 10,000 servers
(racks of the same height added in its rows, as bench/engine_cpu.py --servers does), prints per model:

- memory (MiB) of the operator (dense: the n × n float64 matrix; zonal: all its arrays) and its build time;
- time per incremental update (one placement: one server's power changes; dense: the column ``D[:, k] dP``
  added to the rise, O(n); zonal: ``RiseTracker.add``, O(M), the per-server rise then read in O(n) on demand);
- time per batch: the full product ``D @ P`` (what the guard, the thermal service and Double DQN did per call);
- time per headroom check: the exact headroom of every server from the current rise (dense: the algorithm
  the guard used, O(n^2); zonal: ``RiseTracker.headroom``, O(n + R*M));
- time of the placer guard's ``RoomGuard.check`` on a batch of 8 placements (zonal, all of the above in one);

and the fit error of the zonal model vs the dense one, max and mean |ΔT_inlet| (K), at random loads (every
server 100-300 W), the hottest uniform load, skewed loads (whole racks at random full or idle: the far field
as uneven as it gets) and, on the default room, the loads of the thermal eval's episodes (Thunder jobs,
`hsched.eval.thermal`, seeds 0-2, round robin, the room's power every 25 decisions); with the headroom
ratio zonal / dense. For the served model (reach 6 m, tail folded in) and two variants with a 3.6 m reach
(tail folded, or kept as a room-wide term), so the fit shows on the default room too (it is within 6 m). Dense at 10,000 (775 MiB) is built only with --dense-max-mib >= 775 (default 1024, the issue's
1 GiB).

    python bench/thermal_scale.py [--sizes 672,5000,10000] [--repeat 200] [--eval-seeds 0,1,2] [--dense-max-mib 1024]

Run with one BLAS thread (OPENBLAS_NUM_THREADS=1, as the services do) for the per-core figures.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import asyncio
import time

import numpy as np

MIB = 2**20
# the served model and two shorter-reach variants (reach m, far-field treatment), fitted on each room
VARIANTS = {"served": (None, "fold"), "fold 3.6 m": (3.6, "fold"), "mean 3.6 m": (3.6, "mean")}


def per_call_s(fn, repeat: int) -> float:
    """Median of 5 rounds of `repeat` calls, seconds per call."""
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        rounds.append((time.perf_counter() - t0) / repeat)
    return float(np.median(rounds))


def dense_from(op) -> np.ndarray:
    """The dense matrix of a full-reach zonal operator, built in place (peak ~ one n × n array)."""
    full = op._full if op._full is not None else op._full_coupling()
    d = full[op.zone][:, op.zone]
    d += op.m[op.zone][:, None]
    d *= op.a[:, None]
    d *= op.b[None, :]
    return d


def dense_headroom(d: np.ndarray, rise: np.ndarray, limit: float) -> np.ndarray:
    """The guard's former exact headroom (RoomModel.headroom_for_rise before the zonal model), O(n^2)."""
    slack = limit - rise
    hot = slack <= 0
    scaled = d[~hot] if hot.any() else d
    with np.errstate(divide="ignore"):
        out = 1.0 / (scaled * (1.0 / slack[~hot])[:, None]).max(axis=0, initial=0.0)
    if hot.any():
        dh = d[hot]
        with np.errstate(divide="ignore", invalid="ignore"):
            out = np.minimum(out, np.where(dh > 0, slack[hot, None] / dh, np.inf).min(axis=0))
    return out


def op_mib(op) -> float:
    return sum(v.nbytes for v in vars(op).values() if isinstance(v, np.ndarray)) / MIB


def skewed_loads(geometry, n: int, rng: np.random.Generator, count: int = 10) -> np.ndarray:
    """Whole racks at random either full (300 W) or idle (100 W): the far field as uneven as it gets."""
    rack = np.arange(n) // geometry.servers_per_rack
    return np.where(rng.random((count, geometry.n_racks))[:, rack] < 0.5, 300.0, 100.0)


def errors(op, d: np.ndarray, loads: np.ndarray) -> tuple[float, float]:
    err = np.abs(np.array([op.matvec(p) for p in loads]) - loads @ d.T)
    return float(err.max()), float(err.mean())


def eval_loads(seeds: list[int], every: int = 25) -> np.ndarray:
    """The room's power vectors along the thermal eval's episodes (fixed supply), round robin deciding."""
    from hsched.envs.dc import eval_env, run_policy
    from hsched.policies.heuristics import make_policy

    out: list[np.ndarray] = []
    for seed in seeds:
        env = eval_env("fixed", seed)
        sampler = _Sampler(env, out, every)
        env.policy_action = sampler  # sample the load at every `every`-th decision
        run_policy(env, make_policy("rr", seed, env.dc), seed=seed)
    return np.array(out)


class _Sampler:
    """Stands in for `env.policy_action`: records the room's power every `every` decisions."""

    def __init__(self, env, out: list[np.ndarray], every: int) -> None:
        self.env, self.out, self.every, self.steps = env, out, every, 0
        self.decide = env.policy_action

    def __call__(self, policy) -> int:
        self.steps += 1
        if self.steps % self.every == 0:
            self.out.append(self.env.state.power_w.copy())
        return self.decide(policy)


def guard_check_s(room, dc, repeat: int) -> float:
    """RoomGuard.check on a batch of 8 placements of 4 cores each (the check alone; placed and released in turn)."""
    from hsched.domain.cluster import ClusterState, Part
    from hsched.domain.resources import MILLI
    from hsched.thermal.guard import LoadDelta, RoomGuard

    state = ClusterState(dc)
    guard = RoomGuard(room, state)
    rng = np.random.default_rng(1)
    nodes = rng.choice(state.n, size=(repeat, 8))
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(guard.check([]))  # the first call builds the tracker
        spent = 0.0
        for r in range(repeat):
            deltas = []
            for j, k in enumerate(nodes[r]):
                state.apply(f"b{r}-{j}", (Part(0, 0, int(k), 4 * MILLI, 0, 0, 0, ()),))
                deltas.append(LoadDelta(int(k), 4 * MILLI, 0.0))
            t0 = time.perf_counter()
            loop.run_until_complete(guard.check(deltas))
            spent += time.perf_counter() - t0
            for j in range(len(deltas)):
                state.release(f"b{r}-{j}")
        return spent / repeat
    finally:
        loop.close()


def measure(n_req: int, base, opts, rng: np.random.Generator):
    """(servers, zonal operator, zonal timings, dense timings or None, fit errors) for the room of ~n_req servers."""
    from bench.engine_cpu import scaled_room
    from hsched.thermal import recirculation_from_geometry
    from hsched.thermal.datacenter import geometry_for, room_for
    from hsched.thermal.zonal import ZonalRecirculation

    dc = base if n_req == base.node_table().cpu_milli.size else scaled_room(base, n_req)
    geometry = geometry_for(dc)
    t0 = time.perf_counter()
    room = room_for(dc)
    build_zonal = time.perf_counter() - t0
    op, n = room.recirc, room.n
    limit = room.rise_limit_k
    power = rng.uniform(100.0, 300.0, n)
    tracker = op.tracker(power)
    ks = rng.integers(n, size=opts.repeat)
    dps = rng.uniform(-50.0, 50.0, size=opts.repeat)
    it = iter(range(10**9))

    def z_update():
        i = next(it) % opts.repeat
        tracker.add(int(ks[i]), float(dps[i]))  # the zone state; the per-server rise is O(n) on demand

    z = {"mib": op_mib(op), "build_s": build_zonal,
         "update_us": 1e6 * per_call_s(z_update, opts.repeat),
         "batch_ms": 1e3 * per_call_s(lambda: op.matvec(power), max(1, opts.repeat // 4)),
         "headroom_ms": 1e3 * per_call_s(lambda: tracker.headroom(limit), max(1, opts.repeat // 4)),
         "guard_ms": 1e3 * guard_check_s(room, dc, max(1, opts.repeat // 4))}
    dense_mib = n * n * 8 / MIB
    dn = None
    fit = {}
    if dense_mib <= opts.dense_max_mib:
        t0 = time.perf_counter()
        d = dense_from(ZonalRecirculation.from_geometry(geometry, reach_m=1e9).head(n)) if n > 1000 else \
            recirculation_from_geometry(geometry)[:n, :n]
        build_dense = time.perf_counter() - t0
        rise = d @ power
        it2 = iter(range(10**9))

        def d_update():
            i = next(it2) % opts.repeat
            rise.__iadd__(d[:, int(ks[i])] * dps[i])

        reps = max(1, opts.repeat // 20) if n > 1000 else max(1, opts.repeat // 4)
        dn = {"mib": d.nbytes / MIB, "build_s": build_dense,
              "update_us": 1e6 * per_call_s(d_update, opts.repeat),
              "batch_ms": 1e3 * per_call_s(lambda: d @ power, reps),
              "headroom_ms": 1e3 * per_call_s(lambda: dense_headroom(d, d @ power, limit), reps),
              "guard_ms": float("nan")}
        loads = {"random": rng.uniform(100.0, 300.0, (20, n)), "full": np.full((1, n), 300.0),
                 "skewed": skewed_loads(geometry, n, rng)}
        if n == base.node_table().cpu_milli.size and opts.eval_seeds:
            loads["eval"] = eval_loads([int(s) for s in opts.eval_seeds.split(",")])
            fit["eval_samples"] = len(loads["eval"])
            fit["eval_span_k"] = float((loads["eval"] @ d.T).max())
        p_h = loads["random"][0]
        limit_h = float((d @ p_h).max()) + 0.5  # nothing hot: where headroom is a number, not a refusal
        hd = dense_headroom(d, d @ p_h, limit_h)
        for variant, (reach, far) in VARIANTS.items():
            v = op if variant == "served" else ZonalRecirculation.from_geometry(geometry, reach, far).head(n)
            fit[variant] = {key: errors(v, d, x) for key, x in loads.items()}
            ratio = v.headroom(v.matvec(p_h), limit_h) / hd
            fit[variant]["headroom"] = (float(ratio.min()), float(ratio.max()))
        del d, rise
    return n, op, z, dn, fit


def main(argv: list[str] | None = None) -> None:
    from hsched.domain.fleet import load_fleet
    from hsched.thermal import RoomGeometry
    from hsched.thermal.zonal import REACH_DECAY_LENGTHS
    from hsched.threads import openblas_threads

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="672,5000,10000")
    p.add_argument("--repeat", type=int, default=200)
    p.add_argument("--eval-seeds", default="0,1,2", help="thermal eval seeds whose loads the fit is checked on ('' = none)")
    p.add_argument("--dense-max-mib", type=float, default=1024.0)
    opts = p.parse_args(argv)
    sizes = [int(x) for x in opts.sizes.split(",") if x]
    if not sizes or min(sizes) < 1 or opts.repeat < 1:
        p.error("--sizes must be positive integers and --repeat >= 1")
    print(f"BLAS threads: {openblas_threads()}")

    base = load_fleet(None).datacenter("chicago")
    rng = np.random.default_rng(0)
    rows = [measure(n, base, opts, rng) for n in sizes]
    print()
    print("| servers | model | memory MiB | build s | update µs | batch D@P ms | headroom ms | guard check ms |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for n, op, z, dn, _ in rows:
        for name, r in (("dense", dn), (f"zonal (R={op.n_zones}, M={op.nbr.shape[1]})", z)):
            if r is None:
                print(f"| {n:,} | dense | {n * n * 8 / MIB:.0f} (not built) | | | | | |")
                continue
            guard = "" if np.isnan(r["guard_ms"]) else f"{r['guard_ms']:.3f}"
            print(f"| {n:,} | {name} | {r['mib']:.2f} | {r['build_s']:.2f} | {r['update_us']:.1f} | "
                  f"{r['batch_ms']:.3f} | {r['headroom_ms']:.3f} | {guard} |")
    print()
    reach = REACH_DECAY_LENGTHS * RoomGeometry().horizontal_decay_m
    print("Fit: |ΔT_inlet| of the zonal model vs the dense one, K, max / mean over servers and loads; headroom")
    print("ratio zonal / dense (min-max over servers) at a random load with no inlet hot")
    print()
    print("| servers | model | random | full | skewed | eval loads | headroom ratio |")
    print("|---:|---|---|---|---|---|---|")
    for n, _, _, _, fit in rows:
        for variant in VARIANTS:
            if variant not in fit:
                continue
            f = fit[variant]
            name = f"served (fold, {reach:.1f} m)" if variant == "served" else variant
            cells = [f"{f[k][0]:.4f} / {f[k][1]:.5f}" if k in f else "" for k in ("random", "full", "skewed", "eval")]
            print(f"| {n:,} | {name} | {' | '.join(cells)} | {f['headroom'][0]:.3f}-{f['headroom'][1]:.3f} |")
    for n, _, _, _, fit in rows:
        if "eval_samples" in fit:
            print(f"\neval loads: {fit['eval_samples']} load vectors of the {n}-server room, hottest dense rise "
                  f"{fit['eval_span_k']:.2f} K")

if __name__ == "__main__":
    main()
