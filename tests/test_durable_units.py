"""The durability mechanisms one by one, on real redis-servers: the epoch check inside the ledger's fenced
append and the task store's flush, WAIT for replicas (short → not acknowledged), the embedded Redis' AOF,
pause/resume, and redis+sentinel:// URLs."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import OrderedDict

import pytest
import redis as syncredis
from hypothesis import given
from hypothesis import strategies as st

from hsched.domain.cluster import ClusterState, Part
from hsched.domain.fleet import load_fleet
from hsched.state.epoch import EpochGuard, StateLost, claim_sync
from hsched.state.keys import Keys
from hsched.state.ledger import AppendNotReplicated, Fenced, Ledger, replay
from hsched.state.redis import EmbeddedRedis, NotReplicated, ReplicaSet, connect, connect_sync, port_is_free
from hsched.state.tasks import TaskStore
from hsched.v1 import common_pb2 as pb
from tests.conftest import SMALL_FLEET


def cheap():
    return load_fleet(SMALL_FLEET).datacenter("cheap")


ALLOC = {"t": "alloc", "task": "a", "parts": [Part(0, 0, 0, 1000, 512, 0, 0).to_json()]}


@pytest.fixture
async def aredis(redis_url):
    client = connect(redis_url)
    yield client
    await client.aclose()


async def test_an_append_to_a_redis_without_the_epoch_is_refused_and_writes_nothing(aredis, redis_url, prefix):
    keys = Keys(prefix)
    guard = EpochGuard(aredis, keys, redis_url)
    epoch = await guard.claim(None)
    assert epoch and await guard.claim(None) == epoch  # adopted, not replaced (SET NX)
    ledger = Ledger(aredis, keys, "cheap", "me", epoch=epoch)
    await ledger.acquire()
    await ledger.append([ALLOC])
    await aredis.delete(keys.epoch)  # the marker is gone (as after a Redis that lost its data)
    with pytest.raises(StateLost, match="epoch"):
        await ledger.append([{"t": "free", "task": "a"}])
    assert await aredis.xlen(keys.ledger("cheap")) == 1
    assert issubclass(StateLost, Fenced)  # the placer treats it as fenced: no further writes
    assert not await guard.check() and keys.epoch in guard.lost and "is missing" in guard.lost
    with pytest.raises(StateLost, match="hsched up --fresh"):
        await EpochGuard(aredis, keys, redis_url).claim(epoch)
    await aredis.set(keys.epoch, "other")
    with pytest.raises(StateLost, match="holds other"):
        claim_sync(connect_sync(redis_url), keys, epoch, redis_url)


async def test_a_running_service_hears_of_a_changed_epoch_within_its_interval(aredis, redis_url, prefix):
    guard = EpochGuard(aredis, Keys(prefix), redis_url)
    await guard.claim(None)
    stop = asyncio.Event()
    watch = asyncio.create_task(guard.watch(stop, interval_s=0.05))
    await asyncio.sleep(0.2)
    assert not stop.is_set() and guard.lost is None
    await aredis.set(Keys(prefix).epoch, "someone-else")
    await asyncio.wait_for(stop.wait(), 30)
    await watch
    assert "holds someone-else" in guard.lost


async def test_task_flush_checks_the_epoch_in_the_same_round_trip(aredis, prefix):
    keys = Keys(prefix)
    await aredis.set(keys.epoch, "e1")
    store = TaskStore(aredis, keys.tasks, epoch_key=keys.epoch, epoch="e1")
    await store.record("submitted", pb.Task(task_id="t1"))
    await aredis.set(keys.epoch, "e2")
    with pytest.raises(StateLost):
        await store.record("submitted", pb.Task(task_id="t2"))


async def test_a_store_whose_tail_does_not_move_prunes_its_own_ids_only_when_they_double(aredis, prefix,
                                                                                         monkeypatch):
    """A TaskStore with no stream reader (its tail never moves) keeps its own entry ids; pruning them scans the
    whole set, so it must not run on every flush once the set is large (that made bench/path_floor.py's gateway
    spend milliseconds per write after ~10,000 records): the prune threshold doubles each time."""
    monkeypatch.setattr("hsched.state.tasks.OWN_PRUNE_MIN", 4)
    store = TaskStore(aredis, Keys(prefix).tasks)
    store._own_prune_at = 4
    thresholds = []
    for k in range(64):
        await store.record("submitted", pb.Task(task_id=f"t{k}"))
        assert len(store._own) == k + 1  # nothing below the tail: every id is kept, none lost
        thresholds.append(store._own_prune_at)
    assert sorted(set(thresholds)) == [4, 10, 22, 46, 94]  # pruned at 5, 11, 23, 47 ids: 4 scans, not 60


async def test_writes_that_no_replica_holds_are_not_acknowledged(prefix):
    server = EmbeddedRedis().start()  # a master without replicas: WAIT 1 answers 0
    client = connect(server.url)
    try:
        keys = Keys(prefix)
        ledger = Ledger(client, keys, "cheap", "me", min_replicas=1, wait_timeout_ms=50)
        with pytest.raises(NotReplicated, match="the lease of cheap"):  # no token either
            await ledger.acquire()
        ledger.min_replicas = 0
        await ledger.acquire()
        ledger.min_replicas = 1
        with pytest.raises(AppendNotReplicated, match="0 of the 1 Redis replicas"):
            await ledger.append([ALLOC])
        # the alloc is on the master but the placer answered "not placed": its cancellation is written first
        # by the next write (or settle), so the fold holds nothing the gateway may place elsewhere
        assert ledger.pending_undo == [{"t": "free", "task": "a"}]
        ledger.min_replicas = 0
        await ledger.settle()
        assert ledger.pending_undo == []
        state = ClusterState(cheap())
        await replay(client, keys.ledger("cheap"), state, OrderedDict())
        assert [json.loads(f[b"e"])["t"] for _, f in await client.xrange(keys.ledger("cheap"))] == ["alloc", "free"]
        assert state.allocations == {}
        store = TaskStore(client, keys.tasks, min_replicas=1, wait_timeout_ms=50)
        with pytest.raises(NotReplicated):
            await store.record("submitted", pb.Task(task_id="t1"))
    finally:
        await client.aclose()
        server.stop()


async def test_writes_wait_for_the_replica_and_survive_the_masters_death(prefix):
    rs = ReplicaSet(1).start()
    client = connect(rs.url)
    try:
        keys = Keys(prefix)
        ledger = Ledger(client, keys, "cheap", "me", min_replicas=1, wait_timeout_ms=5000)
        await ledger.acquire()
        await ledger.append([ALLOC])
        store = TaskStore(client, keys.tasks, min_replicas=1, wait_timeout_ms=5000)
        await store.record("submitted", pb.Task(task_id="t1"))
        await asyncio.to_thread(rs.kill_master, 60.0, False)  # promoted replica; no rejoin
        replica = connect_sync(rs.url)
        assert replica.xlen(keys.ledger("cheap")) == 1 and replica.xlen(keys.tasks) == 1
        with pytest.raises(NotReplicated):  # no replica left: nothing is acknowledged any more
            await store.record("released", pb.Task(task_id="t1"))
    finally:
        await client.aclose()
        rs.stop()


async def test_a_record_on_the_master_only_is_no_answer_until_the_replica_holds_it(prefix):
    """A write that failed as NotReplicated is on the master, where the table reads it back: `replicated` says
    whether it may be answered (a retry's duplicate) — not while the replica lags, yes once it caught up."""
    rs = ReplicaSet(1).start()
    client = connect(rs.url)
    replica = next(n for n in rs.nodes if n.port != rs.master().port)
    try:
        store = TaskStore(client, Keys(prefix).tasks, min_replicas=1, wait_timeout_ms=300)
        await store.record("submitted", pb.Task(task_id="kept"))
        assert await store.replicated("kept")
        replica.pause()
        with pytest.raises(NotReplicated):
            await store.record("submitted", pb.Task(task_id="doubt"))
        await store.refresh()
        assert "doubt" in store.tasks  # read back from the master
        with pytest.raises(NotReplicated):
            await store.replicated("doubt")
        replica.resume()
        for _ in range(100):  # the replica catches up
            with contextlib.suppress(NotReplicated):
                if await store.replicated("doubt"):
                    break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("the replica never confirmed the record")
        store.forget("kept")  # as after a failover that lost it: gone from the table only
        assert "kept" not in store.tasks and "doubt" in store.tasks
    finally:
        replica.resume()
        await client.aclose()
        rs.stop()


async def test_a_fencing_token_is_taken_only_once_the_replica_holds_it(prefix):
    """An unreplicated fence INCR is rolled back by a failover, and the next holder gets the same token: two
    placers would append under one token. With replicas, the lease is taken only once they hold it."""
    rs = ReplicaSet(1).start()
    client = connect(rs.url)
    replica = next(n for n in rs.nodes if n.port != rs.master().port)
    try:
        ledger = Ledger(client, Keys(prefix), "cheap", "me", min_replicas=1, wait_timeout_ms=300)
        replica.pause()
        with pytest.raises(NotReplicated, match="the lease of cheap"):
            await ledger.try_acquire()
        assert ledger.token is None  # nothing to append under
        replica.resume()
        for _ in range(100):  # the same owner takes it again once the replica is back
            with contextlib.suppress(NotReplicated):
                if (token := await ledger.try_acquire()) is not None:
                    break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("the lease was never taken")
        assert token == ledger.token == int(connect_sync(rs.url).get(Keys(prefix).fence("cheap")))
    finally:
        replica.resume()
        await client.aclose()
        rs.stop()


async def test_a_record_a_failover_lost_is_reverted_to_the_one_redis_holds(prefix):
    """A Release recorded on the master only (NotReplicated) is read back into the table; a failover to the
    lagging replica then loses it. `replicated` says so, and `revert` puts back the record Redis holds (the task
    placed), so the retried Release records it again instead of answering from the lost record."""
    rs = ReplicaSet(1).start()
    client = connect(rs.url)
    replica = next(n for n in rs.nodes if n.port != rs.master().port)
    try:
        store = TaskStore(client, Keys(prefix).tasks, min_replicas=1, wait_timeout_ms=300)
        await store.record("placed", pb.Task(task_id="t", datacenter="cheap"))
        placed_at = store.version("t")
        replica.pause()
        with pytest.raises(NotReplicated):
            await store.record("released", store.copy("t"))
        await store.refresh()
        assert store.tasks["t"].state == pb.TASK_STATE_RELEASED  # read back from the master
        released_at = store.version("t")
        # what the promoted replica holds: the stream and the versions hash without the released record
        await client.xdel(store.stream, released_at)
        await client.hset(store.versions_key, "t", placed_at)
        replica.resume()
        for _ in range(100):
            with contextlib.suppress(NotReplicated):
                durable = await store.replicated("t")
                break
            await asyncio.sleep(0.1)
        assert not durable
        await store.revert("t")
        assert store.tasks["t"].state == pb.TASK_STATE_PLACED and store.version("t") == placed_at
        await store.record("released", store.copy("t"))  # the version check passes: recorded again
        assert store.tasks["t"].state == pb.TASK_STATE_RELEASED and await store.replicated("t")
        await client.xdel(store.stream, store.version("t"))
        await client.hdel(store.versions_key, "t")
        await client.xdel(store.stream, placed_at)
        await store.revert("t")  # Redis holds no record of it at all
        assert "t" not in store.tasks
    finally:
        replica.resume()
        await client.aclose()
        rs.stop()


def test_embedded_redis_keeps_its_data_dir_across_kill_and_stop(tmp_path):
    server = EmbeddedRedis(data_dir=tmp_path / "r", appendfsync="always").start()
    try:
        connect_sync(server.url).xadd("s", {"k": "v"})
        server.kill()
        server.start()
        assert connect_sync(server.url).xlen("s") == 1
        server.pause()
        with pytest.raises(syncredis.TimeoutError):
            syncredis.Redis(port=server.port, socket_timeout=0.3).ping()
        server.resume()
        assert connect_sync(server.url).ping()
    finally:
        server.stop()
    assert (tmp_path / "r" / "appendonly.aof").exists()  # a given data dir is kept
    again = EmbeddedRedis(data_dir=tmp_path / "r").start()
    try:
        assert connect_sync(again.url).xlen("s") == 1
    finally:
        again.stop()
    temp = EmbeddedRedis().start()
    temp.stop()
    assert not temp.dir.exists()  # a temporary one is removed


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="appendfsync must be one of everysec, always"):
        EmbeddedRedis(appendfsync="no")
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        ReplicaSet(0)


@given(st.integers(max_value=-1) | st.integers(min_value=65536))
def test_port_is_free_names_a_port_outside_0_65535(port):
    with pytest.raises(ValueError, match=rf"^port {port} is not a TCP port \(0\.\.65535\)$"):  # not OverflowError
        port_is_free(port)


def test_port_is_free_for_port_0_and_not_for_a_listening_port():
    import socket

    assert port_is_free(0)  # any free port
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert not port_is_free(taken.getsockname()[1])


@given(st.text(min_size=1, max_size=20))
def test_malformed_sentinel_urls_are_refused_with_the_rule(junk):
    from hsched.state.redis import _sentinel_url

    for url in (f"redis+sentinel://{junk}", f"redis+sentinel://{junk}/m", f"redis+sentinel://h:1/{junk}"):
        try:
            hosts, name, db = _sentinel_url(url)
        except ValueError as exc:
            assert "each sentinel must be host:port" in str(exc) or "the path must be /<master-name>" in str(exc)
        else:  # accepted only when well-formed
            assert hosts and all(h and 0 < p < 65536 for h, p in hosts) and name and "/" not in name and db >= 0
    for url in ("redis+sentinel://127.0.0.1:1", "redis+sentinel://h:1/m/x", "redis+sentinel://h:0/m"):
        with pytest.raises(ValueError, match="redis url"):
            connect_sync(url)


def test_sentinel_url_names_the_master_and_db():
    from hsched.state.redis import _sentinel_url

    assert _sentinel_url("redis+sentinel://a:1,b:2/mymaster/3") == ([("a", 1), ("b", 2)], "mymaster", 3)
    assert _sentinel_url("redis+sentinel://a:1/m") == ([("a", 1)], "m", 0)
    assert _sentinel_url("redis://a:1/0") is None


async def test_no_sentinel_is_one_short_unavailable_line_not_a_connection_pool_repr():
    """With the Sentinel gone, redis-py's MasterNotFoundError carries each Sentinel client's repr (kilobytes),
    which clients got as their UNAVAILABLE message."""
    import grpc
    import redis.asyncio.sentinel as aiosentinel

    from hsched.rpc import status_of

    port = next(p for p in range(47200, 47300) if port_is_free(p))
    sentinel = aiosentinel.Sentinel([("127.0.0.1", port)], socket_timeout=0.5)
    with pytest.raises(aiosentinel.MasterNotFoundError) as info:
        await sentinel.discover_master("hsched")
    assert len(str(info.value)) > 300  # what redis-py says
    code, details = status_of(info.value, "Submit")
    assert code == grpc.StatusCode.UNAVAILABLE and len(details) < 300
    assert "No master found for 'hsched' (the Sentinel named no master)" in details and "<" not in details
