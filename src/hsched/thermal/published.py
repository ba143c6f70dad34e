"""The room model as the thermal service publishes it, and the sensor scans it is fitted on (Redis side).

- ``ScanAssembler``: the thermal service's consumer of a DC's readings stream (consumer group ``thermal``).
  Readings are assembled into scans (one reading per server, one ``sample`` id); a complete scan is appended
  to the DC's scans stream, its id recorded and its readings acknowledged in ONE Lua script: a kill -9 at any
  point leaves the readings pending (re-read from the group's pending list at start) or the scan recorded and
  acknowledged, never half; a scan id seen before is acknowledged without being counted again.
- ``ModelStore``: the latest published version ``{version, params, meta}`` (a hash) and the stream of versions,
  written by one Lua script that checks the deployment's epoch (hsched.state.epoch, as the ledger's appends)
  and the version it replaces (a monotonic counter: a publisher that lost a race publishes nothing).
- ``ModelFollower``: a placer's view of the latest version — read at start, then followed (XREAD on the
  versions stream); version 0 is the fleet's default model (nothing published).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
from redis.exceptions import RedisError, ResponseError

from hsched.cancel import stop_if_cancelled
from hsched.domain.errors import ValidationError
from hsched.state.keys import Keys
from hsched.state.ledger import StateLost

from .readings import Reading, reading_from_stream
from .refit import Scans, from_json, to_json
from .zonal import ZonalRecirculation

log = logging.getLogger(__name__)

GROUP = "thermal"
CONSUMER = "thermal"  # one recalibrating thermal service per deployment (docs/thermal.md)
READINGS_MAXLEN = 1_000_000  # approximate: sensors' backlog the service has not read yet
SCANS_MAXLEN = 2_000  # the fit's window is at most this many scans
APPLIED_KEEP = 100_000  # scan ids remembered against replays
VERSIONS_MAXLEN = 1_000

_APPLY_SCAN = """
if ARGV[1] ~= '' and redis.call('GET', KEYS[4]) ~= ARGV[1] then return redis.error_reply('STATELOST') end
local applied = 0
if not redis.call('ZSCORE', KEYS[3], ARGV[3]) then
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', 'id', ARGV[3], 's', ARGV[4])
  redis.call('ZADD', KEYS[3], ARGV[7], ARGV[3])
  redis.call('ZREMRANGEBYRANK', KEYS[3], 0, -(tonumber(ARGV[6]) + 1))
  applied = 1
end
for i = 8, #ARGV do redis.call('XACK', KEYS[1], ARGV[2], ARGV[i]) end
return applied
"""
# KEYS: readings, scans, applied, epoch; ARGV: epoch ('' = unchecked), group, scan id, scan JSON, scans maxlen,
# applied ids kept, now ms, reading ids...

_PUBLISH = """
if ARGV[1] ~= '' and redis.call('GET', KEYS[3]) ~= ARGV[1] then return redis.error_reply('STATELOST') end
local cur = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
if cur ~= tonumber(ARGV[2]) then return {0, cur} end
local v = cur + 1
redis.call('HSET', KEYS[1], 'version', v, 'params', ARGV[3], 'meta', ARGV[4])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', 'version', v, 'meta', ARGV[4])
return {1, v}
"""
# KEYS: model hash, versions stream, epoch; ARGV: epoch, the version replaced, params JSON, meta JSON, maxlen


def _text(v: bytes | str | None) -> str | None:
    return v.decode() if isinstance(v, bytes) else v


def _state_lost(exc: ResponseError, what: str) -> None:
    if "STATELOST" in str(exc):
        raise StateLost(f"thermal service: Redis no longer holds this deployment's epoch; {what} not written") from None


@dataclass
class Published:
    version: int  # 0 = nothing published: the fleet's default model
    model: ZonalRecirculation | None  # None for version 0
    meta: dict = field(default_factory=dict)


class ModelStore:
    """A DC's published model versions (module docstring)."""

    def __init__(self, redis, keys: Keys, dc: str, epoch: str | None = None) -> None:
        self.redis, self.keys, self.dc, self.epoch = redis, keys, dc, epoch
        self._publish = redis.register_script(_PUBLISH)

    async def latest(self, n: int | None = None) -> Published:
        """The latest version (version 0 when none; ValueError when the stored one is not a model for ``n``)."""
        h = await self.redis.hgetall(self.keys.model(self.dc))
        if not h:
            return Published(0, None)
        version = int(h[b"version"])
        model = from_json(h[b"params"])
        if n is not None and model.n != n:
            raise ValueError(f"published thermal model version {version} of {self.dc} has {model.n} servers, the "
                             f"fleet's room {n}")
        return Published(version, model, json.loads(h.get(b"meta") or b"{}"))

    async def publish(self, replaces: int, model: ZonalRecirculation, meta: dict) -> int | None:
        """Publish the version after ``replaces``; None when another publisher got there first."""
        try:
            ok, version = await self._publish(keys=[self.keys.model(self.dc), self.keys.model_versions(self.dc),
                                                    self.keys.epoch],
                                              args=[self.epoch or "", replaces, to_json(model),
                                                    json.dumps(meta, separators=(",", ":")), VERSIONS_MAXLEN])
        except ResponseError as exc:
            _state_lost(exc, f"model version {replaces + 1} of {self.dc}")
            raise
        return int(version) if ok else None


class ModelFollower:
    """Follow a DC's published versions: ``on_version(published)`` for every newer one (module docstring)."""

    def __init__(self, redis, keys: Keys, dc: str, n: int,
                 on_version: Callable[[Published], Awaitable[None] | None], block_ms: int = 2000) -> None:
        self.store = ModelStore(redis, keys, dc)
        self.redis, self.keys, self.dc, self.n = redis, keys, dc, n
        self.on_version = on_version
        self.block_ms = block_ms
        self.version = 0
        self._last_id = b"0-0"

    async def load(self) -> Published:
        """The latest version now (the versions stream's position first: nothing published after it is missed)."""
        last = await self.redis.xrevrange(self.keys.model_versions(self.dc), count=1)
        if last:
            self._last_id = last[0][0]
        return await self._refresh()

    async def _refresh(self) -> Published:
        try:
            p = await self.store.latest(self.n)
        except ValueError as exc:
            log.error("%s: keeping thermal model version %d", exc, self.version)
            return Published(self.version, None)
        if p.version > self.version:
            self.version = p.version
            result = self.on_version(p)
            if asyncio.iscoroutine(result):
                await result
        return p

    async def run(self) -> None:
        """Until cancelled; a Redis that does not answer keeps the current version (logged once per outage)."""
        down = False
        while True:
            stop_if_cancelled()
            try:
                got = await self.redis.xread({self.keys.model_versions(self.dc): self._last_id}, block=self.block_ms,
                                             count=100)
                if got:
                    self._last_id = got[0][1][-1][0]
                if got or down:
                    await self._refresh()
                if down:
                    log.info("thermal model versions of %s: Redis answers again (version %d)", self.dc, self.version)
                down = False
            except (RedisError, OSError) as exc:
                if not down:
                    log.warning("thermal model versions of %s: %s; keeping version %d", self.dc, exc, self.version)
                down = True
                stop_if_cancelled()
                await asyncio.sleep(1.0)


@dataclass
class _Pending:
    ids: list[bytes] = field(default_factory=list)
    rows: dict[int, Reading] = field(default_factory=dict)
    since: float = field(default_factory=time.monotonic)


@dataclass
class AssemblerCounts:
    readings: int = 0
    invalid: int = 0
    applied: int = 0  # scans recorded
    duplicate: int = 0  # scans seen before (a replay): acknowledged only
    dropped: int = 0  # scans never completed within the timeout


class ScanAssembler:
    """A DC's readings → complete scans (module docstring). ``n``: the DC's servers."""

    def __init__(self, redis, keys: Keys, dc: str, n: int, epoch: str | None = None,
                 incomplete_timeout_s: float = 60.0) -> None:
        self.redis, self.keys, self.dc, self.n, self.epoch = redis, keys, dc, n, epoch
        self.incomplete_timeout_s = incomplete_timeout_s
        self.pending: dict[str, _Pending] = {}
        self.counts = AssemblerCounts()
        self._apply = redis.register_script(_APPLY_SCAN)
        self.stream = keys.readings(dc)

    async def ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.stream, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def recover(self) -> None:
        """Forget memory and read this consumer's pending readings again (at start, after a Redis outage)."""
        self.pending.clear()
        await self.ensure_group()
        after = b"0"
        while True:
            got = await self.redis.xreadgroup(GROUP, CONSUMER, {self.stream: after}, count=1000)
            entries = got[0][1] if got else []
            if not entries:
                return
            await self.feed(entries)
            after = entries[-1][0]

    async def poll(self, block_ms: int = 1000) -> int:
        """Read new readings (blocking up to ``block_ms``), record the scans they complete; returns readings read."""
        got = await self.redis.xreadgroup(GROUP, CONSUMER, {self.stream: ">"}, count=2000, block=block_ms)
        entries = got[0][1] if got else []
        await self.feed(entries)
        await self.expire()
        return len(entries)

    async def feed(self, entries: list[tuple[bytes, dict]]) -> None:
        bad: list[bytes] = []
        for entry_id, fields in entries:
            if not fields:  # trimmed under the group's pending list: nothing to read
                bad.append(entry_id)
                continue
            try:
                r = reading_from_stream(self.dc, fields, self.n)
            except ValidationError as exc:
                self.counts.invalid += 1
                log.warning("thermal readings of %s: entry %s refused: %s", self.dc, _text(entry_id), exc)
                bad.append(entry_id)
                continue
            self.counts.readings += 1
            p = self.pending.setdefault(r.sample, _Pending())
            p.ids.append(entry_id)
            p.rows[r.node] = r  # a server read twice in one scan: the later reading counts
            if len(p.rows) == self.n:
                await self._record(r.sample, p)
        if bad:
            await self.redis.xack(self.stream, GROUP, *bad)

    async def _record(self, sample: str, p: _Pending) -> None:
        rows = [p.rows[i] for i in range(self.n)]
        scan = {"sample": sample, "unix_ms": max(r.unix_ms for r in rows),
                "supply_c": float(np.mean([r.supply_c for r in rows])),
                "inlet_c": [r.inlet_c for r in rows], "outlet_c": [r.outlet_c for r in rows],
                "power_w": [r.power_w for r in rows]}
        try:
            applied = await self._apply(
                keys=[self.stream, self.keys.scans(self.dc), self.keys.scans_applied(self.dc), self.keys.epoch],
                args=[self.epoch or "", GROUP, sample, json.dumps(scan, separators=(",", ":")), SCANS_MAXLEN,
                      APPLIED_KEEP, int(time.time() * 1000), *p.ids])
        except ResponseError as exc:
            _state_lost(exc, f"scan {sample} of {self.dc}")
            raise
        del self.pending[sample]
        if applied:
            self.counts.applied += 1
        else:
            self.counts.duplicate += 1
            log.info("thermal readings of %s: scan %s was recorded before (a replay): not counted again",
                     self.dc, sample)

    async def expire(self) -> None:
        """Drop scans still incomplete after the timeout (a sensor that never reported): acknowledged, logged."""
        now = time.monotonic()
        old = [s for s, p in self.pending.items() if now - p.since > self.incomplete_timeout_s]
        for s in old:
            p = self.pending.pop(s)
            await self.redis.xack(self.stream, GROUP, *p.ids)
            self.counts.dropped += 1
            missing = sorted(set(range(self.n)) - set(p.rows))
            log.warning("thermal readings of %s: scan %s dropped after %.0f s without readings of %d servers "
                        "(first: %s)", self.dc, s, self.incomplete_timeout_s, len(missing), missing[:5])

    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop``: recover, then poll; a Redis outage is waited out (recover again afterwards)."""
        down, recover = False, True
        while not stop.is_set():
            stop_if_cancelled()
            try:
                if recover:
                    await self.recover()
                    if down:
                        log.info("thermal readings of %s: Redis answers again", self.dc)
                    down = recover = False
                await self.poll()
            except StateLost:
                raise
            except (RedisError, OSError) as exc:
                if not down:
                    log.warning("thermal readings of %s: %s; retrying", self.dc, exc)
                down = recover = True
                stop_if_cancelled()
                await asyncio.sleep(1.0)


class ScanWindow:
    """The newest ``window`` scans of a DC, parsed once: each refresh reads only the scans appended since."""

    def __init__(self, redis, keys: Keys, dc: str, n: int, k_per_w: float, window: int) -> None:
        self.redis, self.keys, self.dc, self.n, self.k_per_w = redis, keys, dc, n, k_per_w
        self.rows: deque[tuple[float, list, list, list]] = deque(maxlen=window)
        self.newest: bytes | None = None

    async def refresh(self) -> bool:
        """Read the scans appended since the last call; True when there were any."""
        stream = self.keys.scans(self.dc)
        if self.newest is None:
            entries = list(reversed(await self.redis.xrevrange(stream, count=self.rows.maxlen)))
        else:
            entries = await self.redis.xrange(stream, min=b"(" + self.newest, count=10_000)
        for _, fields in entries:
            s = json.loads(fields[b"s"])
            if len(s["inlet_c"]) == self.n:  # (a scan of another layout of the room: not this model's)
                self.rows.append((s["supply_c"], s["inlet_c"], s["outlet_c"],
                                  [np.nan if p is None else p for p in s["power_w"]]))
        if entries:
            self.newest = entries[-1][0]
        return bool(entries)

    def scans(self) -> Scans:
        n = self.n
        supply = np.array([r[0] for r in self.rows], dtype=np.float64)
        inlet, outlet, metered = (np.array([r[k] for r in self.rows], dtype=np.float64).reshape(-1, n)
                                  for k in (1, 2, 3))
        return Scans.from_readings(supply, inlet, outlet, metered, self.k_per_w)
