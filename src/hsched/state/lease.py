"""Renew a placer's lease from a thread of its own, so that planning can never starve the renewal.

The placer decides a batch on its event loop: a plan of one huge task, a slow thermal check or a burst of
calls can hold the loop for longer than a renewal period, and a lease renewed by a coroutine on that loop
then lapses although the process is healthy; the placer used to be fenced for good by that. Renewing from
a daemon thread with its own synchronous Redis connection decouples the two: the thread needs the GIL for
microseconds per renewal (CPython hands it over every few ms even to a busy loop), so the lease lapses
only when the whole process stops (SIGSTOP, a crash, a partition) or Redis is unreachable — exactly when
another placer should be allowed to take over.

A thread alone would also keep a *wedged* loop leader forever, so the thread renews only while the loop
has run a callback within `max_loop_stall_s` (far above any legitimate batch); past that it lets the lease
lapse.

The thread never dies of a Redis error: it logs and retries every period. If no renewal succeeded for a
whole lease period the lease may have lapsed, so it reports the lease lost (`on_lost`), as it does when a
renewal is refused (another owner holds the lease, or the fencing token moved on).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

import redis
import redis.asyncio as aioredis

from hsched.state.ledger import RENEW_REFUSED, RENEW_SCRIPT, Ledger

log = logging.getLogger(__name__)


def sync_twin(client: aioredis.Redis) -> redis.Redis:
    """A synchronous client to the same server as the asyncio `client` (same host or socket, db, credentials).
    Only for a plain connection pool: a client that follows a Sentinel must be given to LeaseKeeper as such."""
    pool = client.connection_pool
    if type(pool) is not aioredis.ConnectionPool:
        raise ValueError(f"cannot derive a synchronous Redis client from a {type(pool).__name__}: pass one "
                         "(hsched.state.redis.connect_sync) as the lease client")
    kwargs = {k: v for k, v in pool.connection_kwargs.items() if k not in ("retry", "redis_connect_func")}
    if "path" in kwargs:
        return redis.Redis(connection_pool=redis.ConnectionPool(connection_class=redis.UnixDomainSocketConnection,
                                                                **kwargs))
    return redis.Redis(connection_pool=redis.ConnectionPool(**kwargs))


def bound_timeouts(client: redis.Redis, timeout_s: float) -> redis.Redis:
    """Socket timeouts of `timeout_s` on the client's (new) connections, so a stalled Redis delays one renewal,
    never the renewal thread for good (works for plain and Sentinel-managed pools alike)."""
    client.connection_pool.connection_kwargs.update(socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                                    health_check_interval=0)
    return client


class LeaseKeeper:
    """Renews `ledger`'s lease every `lease_ms / 3` while `hold(token)` is in force. `on_lost(token, reason)` is
    called on `loop` (thread-safe hand-over) when the lease for `token` is lost; renewal then stops until the
    next `hold`."""

    def __init__(self, ledger: Ledger, loop: asyncio.AbstractEventLoop, on_lost: Callable[[int, str], None],
                 max_loop_stall_s: float = 30.0, client: redis.Redis | None = None) -> None:
        """`client`: the thread's own synchronous Redis client (default: `sync_twin` of the ledger's)."""
        self.ledger = ledger
        self.loop = loop
        self.on_lost = on_lost
        self.max_loop_stall_s = max_loop_stall_s
        self.period_s = ledger.lease_ms / 3000
        self.client = bound_timeouts(client or sync_twin(ledger.redis), min(2.0, max(0.2, self.period_s)))
        self._renew = self.client.register_script(RENEW_SCRIPT)
        self._token: int | None = None
        self._last_ok = 0.0  # monotonic time the last successful renewal was *sent*: the lease lasts until +lease
        self._loop_seen = time.monotonic()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._main, name=f"lease-{ledger.dc}", daemon=True)
        self._thread.start()

    @property
    def token(self) -> int | None:
        """The fencing token whose lease is being renewed (None: none)."""
        return self._token

    def hold(self, token: int) -> None:
        """Renew the lease taken (just now) with fencing token `token`."""
        with self._lock:
            self._token, self._last_ok = token, time.monotonic()
        self._wake.set()

    def drop(self) -> None:
        """Stop renewing (the lease lapses after at most `lease_ms`)."""
        with self._lock:
            self._token = None

    def close(self) -> None:
        self._closed = True
        self.drop()
        self._wake.set()
        self._thread.join(timeout=5)
        self.client.close()

    def _loop_tick(self) -> None:
        self._loop_seen = time.monotonic()

    def _lost(self, token: int, reason: str) -> None:
        with self._lock:
            if self._token != token:  # dropped or re-held meanwhile: nothing to report
                return
            self._token = None
        try:
            self.loop.call_soon_threadsafe(self.on_lost, token, reason)
        except RuntimeError:  # the loop is closed: the process is exiting
            pass

    def _main(self) -> None:
        failing_since: float | None = None
        while not self._closed:
            self._wake.wait(self.period_s)
            self._wake.clear()
            if self._closed:
                return
            try:
                self.loop.call_soon_threadsafe(self._loop_tick)
            except RuntimeError:
                return
            with self._lock:
                token = self._token
            if token is None:
                continue
            now = time.monotonic()
            if now - self._loop_seen > self.max_loop_stall_s:
                self._lost(token, f"the event loop has not run for {now - self._loop_seen:.0f} s: "
                                  "letting the lease lapse")
                continue
            keys, args = self.ledger.renew_args(token)
            try:
                answer = int(self._renew(keys=keys, args=args))
            except redis.RedisError as exc:
                if failing_since is None:
                    failing_since = now
                    log.warning("placer %s: renewing the lease failed (%s); retrying", self.ledger.dc, exc)
                if time.monotonic() - self._last_ok > self.ledger.lease_ms / 1000:
                    self._lost(token, f"no renewal got through for {self.ledger.lease_ms} ms ({exc}): "
                                      "the lease may have lapsed")
                continue
            if failing_since is not None:
                log.warning("placer %s: renewing works again after %.1f s", self.ledger.dc,
                            time.monotonic() - failing_since)
                failing_since = None
            if answer == 1:
                with self._lock:
                    if self._token == token:
                        self._last_ok = now
            else:
                self._lost(token, f"renewal refused: {RENEW_REFUSED.get(answer, answer)}")
