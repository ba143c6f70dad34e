"""The deployment's epoch marker: proof that Redis still holds the state the services were started on.

`hsched up` (or the first service of a deployment) SETs `{prefix}:epoch` to a random id once (SET NX) and hands
it to every service (--expect-epoch / HSCHED_EPOCH). A Redis that restarted without its data (no AOF, a wiped
data dir, a replica promoted before it synced) answers without the key, or with another id — and a placer that
went on would fold an empty ledger and hand out cards that are already taken. So a service that finds the
marker missing or changed refuses to serve, at start and while it runs (one GET per second), and every ledger
append re-checks it inside its fenced Lua script, so not one write lands in a wiped Redis.
"""

from __future__ import annotations

import asyncio
import logging
import secrets

import redis as syncredis
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from hsched.state.keys import Keys
from hsched.state.ledger import StateLost
from hsched.state.redis import check_replicated, redact_url

log = logging.getLogger(__name__)

__all__ = ["EXIT_STATE_LOST", "EpochGuard", "StateLost", "claim_sync", "lost_message", "new_epoch"]

EXIT_STATE_LOST = 3  # a service's exit status when Redis lost hsched's state: restarting it cannot help


def new_epoch() -> str:
    return secrets.token_hex(8)


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def lost_message(url: str, keys: Keys, found: str | None, expected: str) -> str:
    """One line a person can act on: which Redis, which keys, what to do."""
    what = "is missing" if found is None else f"holds {found}"
    return (f"Redis at {redact_url(url)} has lost hsched's state: key {keys.epoch} {what} (expected {expected}); "
            f"the ledgers {keys.prefix}:dc:*:ledger, fences {keys.prefix}:dc:*:fence and the task stream "
            f"{keys.tasks} cannot be trusted, so hsched refuses to serve from it. Restore Redis' data dir (its "
            "appendonly.aof) or start afresh with `hsched up --fresh`")


def claim_sync(client: syncredis.Redis, keys: Keys, expected: str | None, url: str, min_replicas: int = 0,
               wait_ms: int = 10_000) -> str:
    """The deployment's epoch: `expected` when Redis holds it (else StateLost); without `expected`, the one
    Redis holds, created if there is none — and held by `min_replicas` replicas (WAIT on the same connection)
    before it counts: a failover to a replica that lacks it would otherwise read as lost state."""
    if expected:
        found = _text(client.get(keys.epoch))
        if found != expected:
            raise StateLost(lost_message(url, keys, found, expected))
        return expected
    with client.pipeline(transaction=False) as pipe:
        pipe.set(keys.epoch, new_epoch(), nx=True)
        pipe.get(keys.epoch)
        if min_replicas:
            pipe.execute_command("WAIT", min_replicas, wait_ms)
        replies = pipe.execute()
    if min_replicas:
        check_replicated(replies[2], min_replicas, "the epoch marker")
    return _text(replies[1]) or ""


class EpochGuard:
    """Claim the epoch at start and watch it while serving (cheap: one GET per interval)."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, url: str) -> None:
        self.redis, self.keys, self.url = redis, keys, url
        self.epoch: str | None = None
        self.lost: str | None = None  # the message, once the marker went missing or changed

    async def claim(self, expected: str | None) -> str:
        if expected:
            found = _text(await self.redis.get(self.keys.epoch))
            if found != expected:
                raise StateLost(lost_message(self.url, self.keys, found, expected))
            self.epoch = expected
        else:
            await self.redis.set(self.keys.epoch, new_epoch(), nx=True)
            self.epoch = _text(await self.redis.get(self.keys.epoch))
        return self.epoch or ""

    async def check(self) -> bool:
        """False (and `lost` set) when Redis answers without our epoch; a Redis that does not answer is not
        evidence of loss (the writes fail on their own), so that is True."""
        try:
            found = _text(await self.redis.get(self.keys.epoch))
        except (RedisError, OSError):
            return True
        if found != self.epoch:
            self.lost = lost_message(self.url, self.keys, found, self.epoch or "")
            return False
        return True

    async def watch(self, stop: asyncio.Event, interval_s: float = 1.0) -> None:
        """Until `stop`: when the marker vanishes or changes, log the one line and set `stop`."""
        while not stop.is_set():
            await asyncio.sleep(interval_s)
            if not await self.check():
                log.error("%s", self.lost)
                stop.set()
                return
