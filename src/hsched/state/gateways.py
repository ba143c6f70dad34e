"""Several gateways on one Redis: each one's lease, task ids that name their gateway, and request claims.

A gateway holds a lease, `{prefix}:gateway:<id>` = a token with a TTL it keeps renewing. Its task ids carry its
id, so any gateway can tell whose Submit a placement in a DC ledger belongs to: a placement with no record is
an orphan to release only when its gateway is gone (no lease) — while that gateway lives, it may still be
scheduling it. Every Submit's records are written with the lease as a fence (hsched.state.tasks): a gateway
that lost its lease (stalled past the TTL, so another may have released its placements) records nothing.

A Submit with a request_id first claims `{prefix}:request:...` = its task id (SET NX): a retry on another
gateway finds the claim and waits for that task's record instead of placing a second task, and the records
are written only while the claim still holds that task id. A claim whose gateway is gone is taken over.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets

import redis.asyncio as aioredis

from hsched.state.keys import Keys

log = logging.getLogger(__name__)

_TASK_ID = re.compile(r"t[0-9a-f]{12}([0-9a-f]{6})[0-9a-f]{8}")
CLAIM_TTL_MS = 3_600_000  # a claim outlives any Submit; an abandoned one is taken over when its gateway is gone
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_DROP = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
_TAKE_OVER = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) return 1 end
return 0
"""


def new_gateway_id() -> str:
    return secrets.token_hex(3)


def task_id_of(gateway_id: str, now_ms: int) -> str:
    """Time-ordered (ms, hex), then the gateway, then random: ids sort by submission time (List pages rely on it)."""
    return f"t{now_ms:012x}{gateway_id}{secrets.token_hex(4)}"


def owner_of(task_id: str) -> str | None:
    """The gateway a Submit's task id names; None for ids that name none (a DAG job's tasks, older ids)."""
    m = _TASK_ID.fullmatch(task_id)
    return m[1] if m else None


class GatewayLease:
    """This gateway's lease: `fence` is what its Submits' records are written under (see the module doc)."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, ttl_ms: int = 5000, gateway_id: str | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.id = gateway_id or new_gateway_id()
        self.key = keys.gateway(self.id)
        self.ttl_ms = ttl_ms
        self.token = ""
        self._renew = redis.register_script(_RENEW)
        self._drop = redis.register_script(_DROP)
        self._take_over = redis.register_script(_TAKE_OVER)

    @property
    def fence(self) -> tuple[str, str]:
        return self.key, self.token

    async def acquire(self) -> None:
        token = secrets.token_hex(8)
        await self.redis.set(self.key, token, px=self.ttl_ms)
        self.token = token

    async def keep(self) -> None:
        """Renew every ttl/5 until cancelled. A lease that lapsed (a stall longer than the TTL) is taken anew
        under a new token: Submits begun under the old one then fail their write (and release what they hold)."""
        while True:
            await asyncio.sleep(self.ttl_ms / 5000)
            try:
                if not await self._renew(keys=[self.key], args=[self.token, self.ttl_ms]):
                    log.warning("gateway %s: its lease lapsed (Redis stalled or away for more than %d ms); Submits "
                                "under way will not be recorded, taking a new one", self.id, self.ttl_ms)
                    await self.acquire()
            except Exception as exc:  # noqa: BLE001 - Redis away: retried; the fence keeps writes safe meanwhile
                log.warning("gateway %s: cannot renew its lease (%s: %s)", self.id, type(exc).__name__, exc)

    async def release(self) -> None:
        """Give the lease up on a clean stop (another gateway settles what is left at once, not after the TTL)."""
        try:
            await self._drop(keys=[self.key], args=[self.token])
        except Exception as exc:  # noqa: BLE001 - Redis away: the lease lapses by itself
            log.warning("gateway %s: cannot give its lease up (%s: %s); it lapses in %d ms", self.id,
                        type(exc).__name__, exc, self.ttl_ms)

    async def alive(self, gateway_ids: set[str]) -> set[str]:
        """Which of these gateways hold a lease now (this one always)."""
        others = sorted(gateway_ids - {self.id})
        if not others:
            return gateway_ids & {self.id}
        async with self.redis.pipeline(transaction=False) as pipe:
            for g in others:
                pipe.exists(self.keys.gateway(g))
            found = await pipe.execute()
        return {g for g, n in zip(others, found, strict=True) if n} | (gateway_ids & {self.id})

    # -- request claims ------------------------------------------------------------------------------------------

    async def claim(self, key: str, task_id: str) -> str | None:
        """Claim request `key` for `task_id`: None when claimed, else the task id that holds it."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(key, task_id, nx=True, px=CLAIM_TTL_MS)
            pipe.get(key)
            won, holder = await pipe.execute()
        if won:
            return None
        return holder.decode() if holder is not None else ""

    async def take_over(self, key: str, holder: str, task_id: str) -> bool:
        """Claim `key` for `task_id` if `holder` (whose gateway is gone) still holds it."""
        return bool(await self._take_over(keys=[key], args=[holder, task_id, CLAIM_TTL_MS]))

    async def unclaim(self, key: str, task_id: str) -> None:
        await self._drop(keys=[key], args=[task_id])
