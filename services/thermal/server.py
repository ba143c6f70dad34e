"""Thermal service: the CFD-surrogate room model of every data center, driven by the placers' ledgers."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import re

import numpy as np

from hsched import rpc
from hsched.cancel import cancel_and_wait
from hsched.domain.errors import ValidationError
from hsched.domain.fleet import Fleet, load_fleet
from hsched.domain.resources import MILLI
from hsched.runtime import (
    common_args,
    exit_if_lost,
    guard_epoch,
    metrics_server,
    reflection_on,
    run,
    serve_until_stopped,
    tls_files,
)
from hsched.state.follow import LedgerFollower, follow
from hsched.state.keys import Keys
from hsched.state.ledger import StateLost
from hsched.state.redis import connect
from hsched.telemetry import MetricsServer
from hsched.telemetry import metrics as m
from hsched.thermal import RoomModel, ThermalState, rack_outlet_mean
from hsched.thermal.datacenter import load_arrays, room_for
from hsched.thermal.guard import LoadDelta, newly_hot, shifted
from hsched.thermal.online import RecalibrationConfig, Recalibrator, SensorEmitter
from hsched.thermal.published import ModelFollower, Published, ScanAssembler
from hsched.thermal.refit import HOLDOUT_EVERY, MAX_CONDITION, MIN_GAIN, MIN_SCANS, MIN_T, PRIOR_WEIGHT
from hsched.v1 import thermal_pb2 as pb
from hsched.v1 import thermal_pb2_grpc

log = logging.getLogger("hsched.thermal")


LEDGER_ID = re.compile(r"\d{1,20}-\d{1,20}")  # a Redis stream entry id
MAX_GPU_BUSY = 1 << 20  # whole-card equivalents one delta may move: far above any node, far below float overflow

class Room:
    """One DC's room model over the fold of its ledger, with the derived values cached per ledger version."""

    def __init__(self, model: RoomModel, follower: LedgerFollower, servers_per_rack: int) -> None:
        self.model = model
        self.default = model  # version 0: the fleet geometry's model
        self.version = 0  # the published model version served (hsched.thermal.published)
        self.follower = follower
        self.servers_per_rack = servers_per_rack
        self._cache: dict[tuple, tuple[int, object]] = {}
        self._rise = None  # RiseTracker, built on first use

    def set_model(self, published: Published, dc) -> None:
        """Serve a published version from now on (the caches belong to the old model)."""
        self.model = room_for(dc, published.model) if published.model is not None else self.default
        self.version = published.version
        self._cache.clear()
        self._rise = None

    def _cached(self, key: str, compute):
        key = (key, self.version)
        version = self.follower.version
        hit = self._cache.get(key)
        if hit is None or hit[0] != version:
            hit = (version, compute())
            self._cache[key] = hit
        return hit[1]

    def _tracker(self):
        """The room's rise ``D @ P`` at the ledger's version, moved by the servers whose power changed since."""
        def sync():
            power = self.model.power(*load_arrays(self.follower.state))
            if self._rise is None:
                self._rise = self.model.tracker(power)
            else:
                self._rise.set_power(power)
            return self._rise
        return self._cached("tracker", sync)

    def state(self) -> ThermalState:
        def compute():
            t = self._tracker()
            return self.model.state_from(t.power.copy(), t.rise())
        return self._cached("state", compute)

    def headroom(self) -> np.ndarray:
        return self._cached("headroom", lambda: self._tracker().headroom(self.model.rise_limit_k))


class ThermalServicer(thermal_pb2_grpc.ThermalServicer):
    def __init__(self, rooms: dict[str, Room]) -> None:
        self.rooms = rooms

    def _room(self, name: str) -> Room:
        try:
            return self.rooms[name]
        except KeyError:
            raise LookupError(f"datacenter {name!r} is not in this fleet (known: {', '.join(self.rooms)})") from None

    @rpc.grpc_errors
    async def Predict(self, request: pb.PredictRequest, context) -> pb.PredictResponse:
        room = self._room(request.datacenter)
        if request.min_ledger_id and not LEDGER_ID.fullmatch(request.min_ledger_id):
            raise ValidationError("min_ledger_id", "must be a ledger entry id (<ms>-<seq>) or empty",
                                  request.min_ledger_id)
        for i, d in enumerate(request.deltas):  # (a NaN or 1e308 reached the model: INTERNAL and a traceback)
            if not math.isfinite(d.gpu_busy) or abs(d.gpu_busy) > MAX_GPU_BUSY:
                raise ValidationError(f"deltas[{i}].gpu_busy", f"must be a finite number of cards within "
                                      f"±{MAX_GPU_BUSY}", d.gpu_busy)
        try:
            await room.follower.wait_for(request.min_ledger_id)
        except TimeoutError:
            raise rpc.Unavailable(f"thermal model of {request.datacenter} has not caught up with ledger entry "
                                  f"{request.min_ledger_id} yet") from None
        before = room.state()
        n = room.model.n
        deltas = [LoadDelta(d.node_index, d.cpu_milli, d.gpu_busy) for d in request.deltas]
        for d in deltas:
            if d.node >= n:
                raise ValidationError("deltas.node_index", f"must be < {n} for {request.datacenter}", d.node)
        cpu_milli, gpu_percent = shifted(room.follower.state.busy_cpu(), room.follower.state.busy_gpu_percent(),
                                         deltas)
        busy, gpu = cpu_milli / MILLI, gpu_percent / 100.0
        try:
            after = room.model.evaluate(busy, gpu) if deltas else before
        except ValueError as exc:  # a change that over- or under-runs a server's capacity
            raise ValidationError("deltas", str(exc)) from None
        worse = newly_hot(before, after)
        return pb.PredictResponse(
            max_inlet_before_c=before.max_inlet_c, max_inlet_after_c=after.max_inlet_c, pue_before=before.pue,
            pue_after=after.pue, t_supply_c=after.t_supply_c, redline_c=room.model.params.redline_c,
            nodes_over_redline=worse, headroom_w=self._headroom(room, request, busy, gpu),
            ledger_id=room.follower.last_id, model_version=room.version)

    @staticmethod
    def _headroom(room: Room, request: pb.PredictRequest, busy: np.ndarray, gpu: np.ndarray) -> list[float]:
        if not request.want_headroom:
            return []
        return (room.model.headroom_w(busy, gpu) if request.deltas else room.headroom()).tolist()

    @rpc.grpc_errors
    async def GetState(self, request: pb.ThermalStateRequest, context) -> pb.RoomState:
        room = self._room(request.datacenter)
        s = room.state()
        out = pb.RoomState(
            datacenter=request.datacenter, it_power_w=s.it_power_w, cooling_power_w=s.cooling_power_w,
            other_power_w=s.other_power_w, pue=s.pue, t_supply_c=s.t_supply_c, max_inlet_c=s.max_inlet_c,
            mean_outlet_c=float(np.mean(s.outlet_c)), ledger_id=room.follower.last_id,
            redline_c=room.model.params.redline_c,
            rack_outlet_mean_c=_rack_means(s, room).tolist())
        if request.include_nodes:
            out.inlet_c.extend(s.inlet_c.tolist())
            out.outlet_c.extend(s.outlet_c.tolist())
            out.power_w.extend(s.power_w.tolist())
        return out


def _rack_means(state: ThermalState, room: Room) -> np.ndarray:
    n, per = len(state.outlet_c), room.servers_per_rack
    if n % per == 0:
        return rack_outlet_mean(state, per)
    rack = np.arange(n) // per  # a partly filled last rack
    return np.bincount(rack, weights=state.outlet_c) / np.bincount(rack)


async def publish_telemetry(redis, keys: Keys, rooms: dict[str, Room], period_s: float = 1.0) -> None:
    """Thermal telemetry per DC on its stream (one writer: this service), when the load changed."""
    seen: dict[str, int] = {}
    while True:
        for name, room in rooms.items():
            if seen.get(name) == room.follower.version:
                continue
            seen[name] = room.follower.version
            s = room.state()
            await redis.xadd(keys.thermal(name), {"s": json.dumps({
                "pue": s.pue, "it_power_w": s.it_power_w, "cooling_power_w": s.cooling_power_w,
                "t_supply_c": s.t_supply_c, "max_inlet_c": s.max_inlet_c, "mean_outlet_c": float(np.mean(s.outlet_c)),
                "ledger_id": room.follower.last_id})}, maxlen=1000, approximate=True)
        await asyncio.sleep(period_s)


def register_metrics(metrics: MetricsServer, rooms: dict[str, Room]) -> None:
    def per_dc(fn):
        return lambda: [((name,), float(fn(room.state()))) for name, room in rooms.items()]

    metrics.register_gauge_family(*m.HSCHED_DC_PUE,
                                  per_dc(lambda s: s.pue))
    metrics.register_gauge_family(*m.HSCHED_DC_MAX_INLET_CELSIUS,
                                  per_dc(lambda s: s.max_inlet_c))
    metrics.register_gauge_family(*m.HSCHED_DC_IT_POWER_WATTS,
                                  per_dc(lambda s: s.it_power_w))
    metrics.register_gauge_family(*m.HSCHED_DC_COOLING_POWER_WATTS,
                                  per_dc(lambda s: s.cooling_power_w))
    metrics.register_gauge_family(*m.HSCHED_DC_SUPPLY_CELSIUS,
                                  per_dc(lambda s: s.t_supply_c))
    metrics.register_gauge_family(*m.HSCHED_DC_REDLINE_CELSIUS,
                                  lambda: [((name,), float(room.model.params.redline_c)) for name, room in rooms.items()])


async def _fatal_on_lost(loop, guard, stop: asyncio.Event) -> None:
    """Run `loop()`: a background writer that found Redis without this deployment's epoch stops the service (exit 3)."""
    try:
        await loop()
    except StateLost as exc:
        log.error("%s", exc)
        guard.lost = str(exc)
        stop.set()


def recalibration_config(args) -> RecalibrationConfig:
    return RecalibrationConfig(period_s=args.recalibrate_period_s, window=args.recalibrate_window,
                               min_scans=args.recalibrate_min_scans, max_condition=args.recalibrate_max_condition,
                               min_gain=args.recalibrate_min_gain, holdout_every=args.recalibrate_holdout_every,
                               prior_weight=args.recalibrate_prior_weight, min_t=args.recalibrate_min_t)


async def serve(args, stop: asyncio.Event, fleet: Fleet | None = None) -> None:
    fleet = fleet or load_fleet(args.fleet)
    keys = Keys(args.prefix)
    redis = connect(args.redis_url)
    guard, epoch_watch = await guard_epoch(redis, keys, args, stop)  # it writes model versions now
    rooms: dict[str, Room] = {}
    tasks = [epoch_watch]
    recals: dict[str, Recalibrator] = {}
    assemblers: dict[str, ScanAssembler] = {}
    for dc in fleet.datacenters:
        follower = LedgerFollower(redis, keys.ledger(dc.name), dc)
        await follower.load()
        room = rooms[dc.name] = Room(room_for(dc), follower, dc.layout.servers_per_rack)
        if args.recalibrate:
            k_per_w = 1.0 / (room.model.params.air_mass_flow_kg_s * room.model.params.cp_air)
            recal = recals[dc.name] = Recalibrator(
                redis, keys, dc.name, room.default.recirc, k_per_w, recalibration_config(args), guard.epoch,
                on_version=lambda p, room=room, dc=dc: room.set_model(p, dc))
            await recal.load()
            log.info("thermal %s: serving model version %d%s", dc.name, room.version,
                     "" if room.version else " (the default model: none published)")
            assemblers[dc.name] = ScanAssembler(redis, keys, dc.name, room.model.n, guard.epoch,
                                                args.recalibrate_incomplete_timeout_s)
            tasks.append(asyncio.create_task(_fatal_on_lost(lambda a=assemblers[dc.name]: a.run(stop), guard, stop)))
            tasks.append(asyncio.create_task(_fatal_on_lost(lambda r=recal: r.run(stop), guard, stop)))
        else:  # serve what another (the recalibrating) thermal service publishes
            models = ModelFollower(redis, keys, dc.name, room.model.n,
                                   lambda p, room=room, dc=dc: room.set_model(p, dc))
            await models.load()
            tasks.append(asyncio.create_task(models.run()))
        if args.emit_readings:
            emitter = SensorEmitter(redis, keys, dc.name, room.default,
                                    lambda f=follower: load_arrays(f.state), args.emit_noise_k,
                                    args.seed + len(rooms))  # each room its own noise
            tasks.append(asyncio.create_task(emitter.run(stop, args.emit_period_s)))
    tasks.append(asyncio.create_task(follow(redis, [room.follower for room in rooms.values()])))
    tasks.append(asyncio.create_task(publish_telemetry(redis, keys, rooms)))
    metrics = metrics_server(args)
    if metrics:
        register_metrics(metrics, rooms)
        register_recalibration_metrics(metrics, rooms, recals, assemblers)
    try:
        server, port, _ = await rpc.start_server(
            lambda s: thermal_pb2_grpc.add_ThermalServicer_to_server(ThermalServicer(rooms), s),
            [pb.DESCRIPTOR.services_by_name["Thermal"].full_name], args.listen, metrics,
            tls=tls_files(args, "thermal"), reflection=reflection_on(args))
    except BaseException:  # (a bad --tls-dir): the background loops stop with it
        await cancel_and_wait(tasks)
        await redis.aclose()
        if metrics:
            metrics.close()
        raise
    log.info("thermal serving %d rooms on port %d", len(rooms), port)
    await serve_until_stopped(stop, server, port, args, tasks=tasks, metrics=metrics, cleanup=[redis.aclose])
    exit_if_lost(guard)


def register_recalibration_metrics(metrics: MetricsServer, rooms: dict[str, Room], recals: dict[str, Recalibrator],
                                   assemblers: dict[str, ScanAssembler]) -> None:
    metrics.register_gauge_family(*m.HSCHED_THERMAL_MODEL_VERSION,
                                  lambda: [((name,), float(room.version)) for name, room in rooms.items()])
    metrics.register_counter_family(*m.HSCHED_THERMAL_REFITS, lambda: [
        ((name, result), float(n)) for name, r in recals.items() for result, n in list(r.results.items())])
    metrics.register_counter_family(*m.HSCHED_THERMAL_READINGS, lambda: [
        ((name, result), float(getattr(a.counts, attr))) for name, a in assemblers.items()
        for result, attr in (("accepted", "readings"), ("invalid", "invalid"))])
    metrics.register_counter_family(*m.HSCHED_THERMAL_SCANS, lambda: [
        ((name, result), float(getattr(a.counts, result))) for name, a in assemblers.items()
        for result in ("applied", "duplicate", "dropped")])


def parser():
    p = common_args("hsched thermal service: room models per data center")
    env = os.environ.get
    p.add_argument("--recalibrate", action=argparse.BooleanOptionalAction,
                   default=env("HSCHED_THERMAL_RECALIBRATE", "1") not in ("0", ""),
                   help="consume the sensor readings streams, refit the recirculation models and publish their "
                        "versions (docs/thermal.md) [$HSCHED_THERMAL_RECALIBRATE]")
    p.add_argument("--recalibrate-period-s", type=float, default=float(env("HSCHED_THERMAL_RECALIBRATE_PERIOD_S", 10)),
                   help="refit this often when new complete scans arrived")
    p.add_argument("--recalibrate-window", type=int, default=500, help="newest complete scans a refit uses")
    p.add_argument("--recalibrate-min-scans", type=int, default=MIN_SCANS, help="no refit on fewer complete scans")
    p.add_argument("--recalibrate-max-condition", type=float, default=MAX_CONDITION,
                   help="reject a refit whose scans' zone loads give a worse condition number (ill-conditioned)")
    p.add_argument("--recalibrate-min-gain", type=float, default=MIN_GAIN,
                   help="publish a refit only if its held-out inlet RMSE is below (1 - this) x the current model's")
    p.add_argument("--recalibrate-min-t", type=float, default=MIN_T,
                   help="publish a refit only if its per-scan held-out improvement is this many standard errors from 0")
    p.add_argument("--recalibrate-prior-weight", type=float, default=PRIOR_WEIGHT,
                   help="the current model's weight in a refit, in scans: what the scans do not determine stays")
    p.add_argument("--recalibrate-holdout-every", type=int, default=HOLDOUT_EVERY,
                   help="every N-th scan is held out of the fit and judges it")
    p.add_argument("--recalibrate-incomplete-timeout-s", type=float, default=60.0,
                   help="a scan still missing servers' readings after this is dropped (logged, counted)")
    p.add_argument("--emit-readings", action=argparse.BooleanOptionalAction,
                   default=env("HSCHED_THERMAL_EMIT_READINGS", "0") not in ("0", ""),
                   help="simulated sensors: scans of the default model at the ledger's load plus noise onto the "
                        "readings streams (the local stack's; real sensors or `hsched thermal replay` otherwise) "
                        "[$HSCHED_THERMAL_EMIT_READINGS]")
    p.add_argument("--emit-period-s", type=float, default=float(env("HSCHED_THERMAL_EMIT_PERIOD_S", 5)),
                   help="one simulated scan per DC this often")
    p.add_argument("--emit-noise-k", type=float, default=0.1, help="simulated sensors' Gaussian noise, K")
    p.add_argument("--seed", type=int, default=0, help="simulated sensors' noise seed")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    run("thermal", args, lambda stop: serve(args, stop))
