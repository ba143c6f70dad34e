"""The thermal service's online loops over one room (docs/thermal.md, "Online recalibration"):

- ``Recalibrator``: every ``period_s``, when new scans arrived, refit the recirculation model on the newest
  scans (hsched.thermal.refit) and publish it as the next version (hsched.thermal.published), or say in a log
  line and a counter why not (too few scans, ill-conditioned, no better on held-out scans).
- ``SensorEmitter``: the local stack's simulated sensors: a scan of the room the model describes at the
  ledger's load, plus Gaussian noise, onto the readings stream (off unless the service's --emit-readings).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from redis.exceptions import RedisError

from hsched.cancel import stop_if_cancelled
from hsched.state.keys import Keys
from hsched.state.ledger import StateLost

from .published import READINGS_MAXLEN, ModelStore, Published, ScanWindow
from .readings import synthetic_readings
from .refit import HOLDOUT_EVERY, MAX_CONDITION, MIN_GAIN, MIN_SCANS, MIN_T, PRIOR_WEIGHT, recalibrate
from .room import RoomModel
from .zonal import ZonalRecirculation

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecalibrationConfig:
    period_s: float = 10.0
    window: int = 500  # newest scans fitted on (held-out ones included)
    min_scans: int = MIN_SCANS
    max_condition: float = MAX_CONDITION
    min_gain: float = MIN_GAIN
    holdout_every: int = HOLDOUT_EVERY
    prior_weight: float = PRIOR_WEIGHT
    min_t: float = MIN_T


class Recalibrator:
    """One DC's refits and publications; ``on_version`` is told every version it adopts (its own or found)."""

    def __init__(self, redis, keys: Keys, dc: str, default: ZonalRecirculation, k_per_w: float,
                 config: RecalibrationConfig, epoch: str | None,
                 on_version: Callable[[Published], None] | None = None) -> None:
        self.redis, self.keys, self.dc = redis, keys, dc
        self.default, self.k_per_w, self.config = default, k_per_w, config
        self.store = ModelStore(redis, keys, dc, epoch)
        self.current = Published(0, None)
        self.on_version = on_version
        self.results: Counter[str] = Counter()  # published | ill_conditioned | not_better | too_few_scans | conflict
        self.window = ScanWindow(redis, keys, dc, default.n, k_per_w, config.window)
        self._last_reason = ""
        self._refit_due = False  # refit on the next step even without new scans (after a lost race)

    @property
    def model(self) -> ZonalRecirculation:
        return self.current.model if self.current.model is not None else self.default

    async def load(self) -> Published:
        try:
            p = await self.store.latest(self.default.n)
        except ValueError as exc:  # a layout change: the published model is not this room's
            log.error("%s: starting from the default model", exc)
            return self.current
        self._adopt(p)
        return p

    def _adopt(self, p: Published) -> None:
        if p.version > self.current.version:
            self.current = p
            if self.on_version:
                self.on_version(p)

    async def step(self) -> str | None:
        """One refit if new scans arrived; returns the result (None: nothing new)."""
        if not await self.window.refresh() and not self._refit_due:
            if int(await self.redis.hget(self.keys.model(self.dc), "version") or 0) > self.current.version:
                await self.load()  # another publisher's version: served from now on
            return None
        self._refit_due = False
        scans = self.window.scans()
        await self.load()  # another publisher's newer version is the one to beat
        c = self.config
        verdict = await asyncio.to_thread(recalibrate, self.model, scans, c.min_scans, c.max_condition, c.min_gain,
                                          c.holdout_every, prior_weight=c.prior_weight, min_t=c.min_t)
        if not verdict.accepted:
            self.results[verdict.reason] += 1
            # a warning when the reason changes; while it lasts (a steady load: ill-conditioned) an info line
            level = logging.INFO if verdict.reason in ("too_few_scans", self._last_reason) else logging.WARNING
            self._last_reason = verdict.reason
            log.log(level, "thermal model of %s: refit on %d scans rejected (%s): %s; keeping version %d", self.dc,
                    verdict.scans, verdict.reason, verdict.detail, self.current.version)
            return verdict.reason
        meta = {"fitted_unix_ms": int(time.time() * 1000), "scans": verdict.scans,
                "rmse_heldout_k": verdict.rmse_new_k, "rmse_heldout_previous_k": verdict.rmse_current_k,
                "condition": verdict.condition, "replaces": self.current.version}
        version = await self.store.publish(self.current.version, verdict.model, meta)
        if version is None:
            self.results["conflict"] += 1
            log.warning("thermal model of %s: another publisher replaced version %d first; refitting against it",
                        self.dc, self.current.version)
            self._refit_due = True
            return "conflict"
        self.results["published"] += 1
        self._last_reason = ""
        log.info("thermal model of %s: published version %d (%d scans, %s)", self.dc, version, verdict.scans,
                 verdict.detail)
        self._adopt(Published(version, verdict.model, meta))
        return "published"

    async def run(self, stop: asyncio.Event) -> None:
        down = False
        while not stop.is_set():
            stop_if_cancelled()
            try:
                await self.step()
                down = False
            except StateLost:
                raise
            except (RedisError, OSError) as exc:
                if not down:
                    log.warning("thermal model of %s: %s; refitting when Redis answers", self.dc, exc)
                down = True
            stop_if_cancelled()
            try:
                await asyncio.wait_for(stop.wait(), self.config.period_s)
            except TimeoutError:
                pass


class SensorEmitter:
    """Simulated sensors for one room: ``scan()`` writes one scan of ``truth`` at ``loads()`` (busy cores, busy
    cards per server) plus ``noise_k`` of Gaussian noise on every temperature."""

    def __init__(self, redis, keys: Keys, dc: str, truth: RoomModel,
                 loads: Callable[[], tuple[np.ndarray, np.ndarray]], noise_k: float = 0.1, seed: int = 0) -> None:
        self.redis, self.keys, self.dc, self.truth, self.loads = redis, keys, dc, truth, loads
        self.noise_k = noise_k
        self.rng = np.random.default_rng(seed)
        self.scans = 0
        self._k_per_w = 1.0 / (truth.params.air_mass_flow_kg_s * truth.params.cp_air)
        self._run = f"{int(time.time() * 1000):x}"  # scan ids of this process's run: never a replay's

    async def scan(self) -> None:
        busy, gpu = self.loads()
        state = self.truth.evaluate(busy, gpu)
        self.scans += 1
        readings = synthetic_readings(self.dc, f"sim-{self._run}-{self.scans}", state.t_supply_c, state.inlet_c,
                                      state.power_w, self._k_per_w, self.noise_k, self.rng)
        async with self.redis.pipeline(transaction=False) as pipe:
            for r in readings:
                pipe.xadd(self.keys.readings(self.dc), r.to_stream(), maxlen=READINGS_MAXLEN, approximate=True)
            await pipe.execute()

    async def run(self, stop: asyncio.Event, period_s: float) -> None:
        while not stop.is_set():
            stop_if_cancelled()
            try:
                await self.scan()
            except (RedisError, OSError) as exc:
                log.warning("simulated sensors of %s: %s", self.dc, exc)
            stop_if_cancelled()
            try:
                await asyncio.wait_for(stop.wait(), period_s)
            except TimeoutError:
                pass
