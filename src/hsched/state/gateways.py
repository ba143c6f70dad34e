"""Several gateways on one Redis: each one's lease, task ids that name their gateway, and request claims.

A gateway holds a lease, `{prefix}:gateway:<id>` = a token with a TTL it keeps renewing. Its task ids carry its
id, so any gateway can tell whose Submit a placement in a DC ledger belongs to: a placement with no record is
an orphan to release only when its gateway is gone (no lease) — while that gateway lives, it may still be
scheduling it. Every Submit's records are written with the lease as a fence (hsched.state.tasks): a gateway
that lost its lease (stalled past the TTL, so another may have released its placements) records nothing.

A DAG job has one owner, `{prefix}:job-owner:<job id>` = the gateway id that advances it (submits its stages'
tasks, records its steps): every such write carries that key as a fence next to the lease, so two gateways never
both advance one job, and a gateway that lost a job (stalled while another adopted it) writes nothing for it. A
job whose owner holds no lease is adopted by the first live gateway that looks (`adopt`, atomic).

A Submit with a request_id first claims `{prefix}:request:...` = its task id (SET NX): a retry on another
gateway finds the claim and waits for that task's record instead of placing a second task, and the records
are written only while the claim still holds that task id (the write deletes it: the record answers from then on). A claim whose gateway is gone is taken over.
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

# KEYS: the job's owner key. ARGV: this gateway's id, the lease key prefix ("<prefix>:gateway:").
# 1: this gateway owns it; 2: adopted now (no owner, or its owner holds no lease); 0: a live gateway owns it.
_ADOPT = """
local h = redis.call('GET', KEYS[1])
if h == ARGV[1] then return 1 end
if h and redis.call('EXISTS', ARGV[2] .. h) == 1 then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
return 2
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
        self._adopt = redis.register_script(_ADOPT)

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

    # -- DAG job owners ------------------------------------------------------------------------------------------

    def job_fences(self, job_id: str) -> tuple[tuple[str, str], ...]:
        """What a write advancing job `job_id` is fenced by: this gateway's lease and its ownership of the job."""
        return self.fence, (self.keys.job_owner(job_id), self.id)

    async def own(self, job_id: str) -> None:
        """A new job (before its first record): this gateway advances it."""
        await self.redis.set(self.keys.job_owner(job_id), self.id)

    async def adopt(self, job_id: str) -> int:
        """1 if this gateway owns `job_id`, 2 if it just adopted it (no owner, or the owner's lease is gone),
        0 if a live gateway owns it."""
        return int(await self._adopt(keys=[self.keys.job_owner(job_id)], args=[self.id, self.keys.gateway("")]))

    async def disown(self, job_id: str) -> None:
        """The job is finished: forget its owner (only if it is still this gateway)."""
        await self._drop(keys=[self.keys.job_owner(job_id)], args=[self.id])
