"""Redis over TLS with an ACL user (issue 14, item 4): a real redis-server listening on TLS only, client
certificates required, the default user unusable and an hsched user confined to one key prefix; certificates
from hsched.security.pki. A whole stack runs on it; the user can touch nothing outside its prefix; plaintext
and wrong passwords are refused."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import grpc
import pytest
import redis

from hsched.security import pki
from hsched.stack import Stack, StackConfig
from hsched.state.redis import EmbeddedRedis, RedisTls, RedisUnavailable, ServerTls, connect_sync, redact_url
from hsched.v1 import common_pb2 as pb
from hsched.v1 import gateway_pb2, gateway_pb2_grpc
from tests.conftest import ROOT, SMALL_FLEET

pytestmark = pytest.mark.slow

USER = "hsched-svc"


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    d = pki.init_dir(tmp_path_factory.mktemp("tls") / "tls")
    prefix = f"tls-{uuid.uuid4().hex[:8]}"
    server = EmbeddedRedis(tls=ServerTls(cert=str(d / "redis.crt"), key=str(d / "redis.key"), ca=str(d / "ca.crt")),
                           acl_user=USER, acl_prefix=prefix).start()
    try:
        yield server, prefix, RedisTls(str(d / "ca.crt"), str(d / "redis.crt"), str(d / "redis.key")), d
    finally:
        server.stop()


def test_the_server_listens_on_tls_only_with_its_settings_in_a_private_file(tls_redis):
    server = tls_redis[0]
    assert server.url.startswith(f"rediss://{USER}:") and redact_url(server.url).startswith(f"rediss://{USER}:***@")
    cmdline = open(f"/proc/{server.proc.pid}/cmdline", "rb").read()
    assert server.password.encode() not in cmdline
    assert oct(os.stat(server.config_path).st_mode & 0o777) == "0o600"


def test_a_stack_over_rediss_with_the_acl_user_places_and_releases_a_task(tls_redis):
    server, prefix, tls, _ = tls_redis
    config = StackConfig(fleet_path=SMALL_FLEET, redis_url=server.url, prefix=prefix, gateway_port=0,
                         metrics=False, extra_env=tls.env())
    with Stack(config) as stack:
        with grpc.insecure_channel(stack.gateway) as ch:
            gw = gateway_pb2_grpc.GatewayStub(ch)
            placed = gw.Submit(gateway_pb2.SubmitRequest(task=pb.TaskSpec(
                tenant="t", replicas=1, runtime_s=3600, resources=pb.Resources(cpu_milli=2000, memory_mib=2048))),
                timeout=60).task
            assert placed.state == pb.TASK_STATE_PLACED, placed
            released = gw.Release(gateway_pb2.ReleaseRequest(task_id=placed.task_id), timeout=60).task
            assert released.state == pb.TASK_STATE_RELEASED
    client = server.client()
    assert client.xlen(f"{prefix}:tasks") >= 2  # the task's events went through the ACL user, over TLS
    ledger = f"{prefix}:dc:{placed.datacenter}:ledger"
    assert client.exists(ledger) or client.exists(f"{prefix}:dc:{placed.datacenter}:snapshot")


def test_the_acl_user_cannot_touch_keys_outside_its_prefix(tls_redis):
    server, prefix, _, _ = tls_redis
    client = server.client()
    client.set(f"{prefix}:probe", "ok")
    assert client.get(f"{prefix}:probe") == b"ok"
    for call in (lambda: client.set("other:probe", "x"), lambda: client.get("hsched:epoch"),
                 lambda: client.xadd("other:stream", {"k": "v"}),
                 lambda: client.eval("return redis.call('GET', KEYS[1])", 1, "other:probe"),
                 lambda: client.keys("*"), lambda: client.flushall(), lambda: client.config_get("*"),
                 lambda: client.execute_command("ACL", "LIST")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            call()
    client.delete(f"{prefix}:probe")


def test_plaintext_and_certificate_less_clients_are_refused(tls_redis):
    server, _, tls, _ = tls_redis
    plain = redis.Redis(host="127.0.0.1", port=server.port, username=USER, password=server.password,
                        socket_timeout=5)
    with pytest.raises(redis.ConnectionError):
        plain.ping()
    no_cert = connect_sync(server.url, RedisTls(ca=tls.ca), socket_timeout=5)  # the CA, but no client cert
    with pytest.raises(redis.ConnectionError):
        no_cert.ping()
    default_user = connect_sync(server.url.replace(f"{USER}:{server.password}@", ""), tls, socket_timeout=5)
    with pytest.raises(redis.exceptions.AuthenticationError):  # the default user's password is nobody's
        default_user.ping()


def test_the_acl_users_transactions_survive_a_restart(tls_redis, tmp_path):
    """The append-only file is replayed as the default user, whose ACL Redis checks again at each EXEC: with the
    default user off, a restart kept the plain writes and silently dropped every MULTI/EXEC (redis/redis#14541)."""
    _, prefix, _, d = tls_redis
    server = EmbeddedRedis(data_dir=tmp_path / "redis", acl_user=USER, acl_prefix=prefix,
                           tls=ServerTls(cert=str(d / "redis.crt"), key=str(d / "redis.key"), ca=str(d / "ca.crt")))
    server.start()
    try:
        client = server.client()
        client.set(f"{prefix}:plain", "1")
        with client.pipeline(transaction=True) as pipe:
            pipe.set(f"{prefix}:in-multi", "2").incr(f"{prefix}:fence").xadd(f"{prefix}:ledger", {"e": "{}"})
            pipe.execute()
        client.close()
        server.stop()  # SIGTERM: the append-only file is fsynced
        server.start()
        client = server.client()
        assert client.get(f"{prefix}:plain") == b"1" and client.get(f"{prefix}:in-multi") == b"2"
        assert client.get(f"{prefix}:fence") == b"1" and client.xlen(f"{prefix}:ledger") == 1
        client.close()
    finally:
        server.stop()


def test_a_wrong_password_is_refused_with_one_clear_line(tls_redis, tmp_path):
    server, prefix, tls, _ = tls_redis
    wrong = server.url.replace(server.password, "not-the-password")
    stack = Stack(StackConfig(fleet_path=SMALL_FLEET, redis_url=wrong, prefix=prefix, gateway_port=0,
                              metrics=False, extra_env=tls.env()))
    with pytest.raises(RedisUnavailable) as caught:
        stack.start()
    message = str(caught.value)
    assert "\n" not in message and "authentication failed" in message and "not-the-password" not in message
    assert f"rediss://{USER}:***@127.0.0.1:{server.port}/0" in message

    # a service started on its own says the same in one log line and exits 1, no traceback
    env = {**os.environ, **tls.env(), "REDIS_URL": wrong,
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    run = subprocess.run([sys.executable, "-m", "services.selector", "--fleet", SMALL_FLEET, "--prefix", prefix],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr
    assert "authentication failed" in run.stderr and "Traceback" not in run.stderr
    assert "not-the-password" not in run.stderr + run.stdout


def test_a_stack_with_tls_runs_its_embedded_redis_on_tls_with_an_acl_user(tmp_path):
    from hsched.security.tls import TlsFiles, channel_credentials
    from hsched.stack import EMBEDDED_ACL_USER

    prefix = f"tls-up-{uuid.uuid4().hex[:8]}"
    config = StackConfig(fleet_path=SMALL_FLEET, prefix=prefix, gateway_port=0, metrics=False, thermal=False,
                         state_dir=str(tmp_path / "state"), tls=True)
    with Stack(config) as stack:
        assert stack.redis_url.startswith(f"rediss://{EMBEDDED_ACL_USER}:")
        assert stack.redis.password == (tmp_path / "state" / "redis.password").read_text().strip()
        admin = channel_credentials(TlsFiles(stack.tls_dir, "admin"))
        with grpc.secure_channel(stack.gateway, admin) as ch:
            placed = gateway_pb2_grpc.GatewayStub(ch).Submit(gateway_pb2.SubmitRequest(task=pb.TaskSpec(
                tenant="t", replicas=1, runtime_s=3600, resources=pb.Resources(cpu_milli=1000, memory_mib=1024))),
                timeout=60).task
        assert placed.state == pb.TASK_STATE_PLACED, placed
        plain = redis.Redis(port=stack.redis.port, password=stack.redis.password, socket_timeout=5)
        with pytest.raises(redis.ConnectionError):
            plain.ping()
        with pytest.raises(redis.exceptions.NoPermissionError):
            stack.redis.client().get("elsewhere:key")


# ---- certificate rotation reaches the running redis-server (hsched certs rotate; docs/security.md) ------------

def _tls_server(d, **kwargs) -> EmbeddedRedis:
    return EmbeddedRedis(tls=ServerTls(cert=str(d / "redis.crt"), key=str(d / "redis.key"), ca=str(d / "ca.crt")),
                         acl_user=USER, **kwargs).start()


def _served_serial(port: int, d) -> int:
    """The serial of the certificate the server presents to a new TLS connection (verified against D's ca.crt)."""
    import socket
    import ssl

    from cryptography import x509

    ctx = ssl.create_default_context(cafile=str(d / "ca.crt"))
    ctx.load_cert_chain(d / "admin.crt", d / "admin.key")
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number


def _serial(path) -> int:
    return pki.load_bundle(path)[0].serial_number


def _pings(server: EmbeddedRedis, ca, cert, key) -> bool:
    client = connect_sync(server.url, RedisTls(str(ca), str(cert), str(key)), socket_timeout=5)
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False
    finally:
        client.close()


def _keep_leaf(d, name, into):
    """A copy of D's leaf `name` (a peer that has not picked up its rotated certificate yet)."""
    into.mkdir(exist_ok=True)
    for suffix in ("crt", "key"):
        (into / f"{name}.{suffix}").write_bytes((d / f"{name}.{suffix}").read_bytes())
    return into / f"{name}.crt", into / f"{name}.key"


def test_a_plain_rotation_reaches_redis_once_it_reloads_its_files(tmp_path):
    d = pki.init_dir(tmp_path / "tls")
    server = _tls_server(d)
    try:
        first = _serial(d / "redis.crt")
        assert _served_serial(server.port, d) == first and not server.tls_changed()
        pki.rotate(d)
        assert server.tls_changed()
        assert _served_serial(server.port, d) == first  # redis-server reads its files only at start ...
        server.reload_tls()  # ... and on CONFIG SET of the same paths
        assert not server.tls_changed()
        assert _served_serial(server.port, d) == _serial(d / "redis.crt") != first
        assert _pings(server, d / "ca.crt", d / "redis.crt", d / "redis.key")
    finally:
        server.stop()


def test_a_ca_roll_over_trusts_both_cas_then_only_the_new_one(tmp_path):
    d = pki.init_dir(tmp_path / "tls")
    server = _tls_server(d)
    try:
        old_leaf = _keep_leaf(d, "admin", tmp_path / "old")
        pki.rotate(d, new_ca=True)
        assert not _pings(server, d / "ca.crt", d / "admin.crt", d / "admin.key")  # the bug: not yet reloaded
        server.reload_tls()
        assert _pings(server, d / "ca.crt", d / "admin.crt", d / "admin.key")  # a new CA's leaf
        assert _pings(server, d / "ca.crt", *old_leaf)  # and an old one, during the roll-over
        pki.rotate(d, drop_old_cas=True)
        server.reload_tls()
        assert _pings(server, d / "ca.crt", d / "admin.crt", d / "admin.key")
        assert not _pings(server, d / "ca.crt", *old_leaf)  # the old CA is no longer trusted
        assert _served_serial(server.port, d) == _serial(d / "redis.crt")
    finally:
        server.stop()


def test_a_half_written_rotation_is_refused_and_the_server_keeps_its_files(tmp_path):
    d = pki.init_dir(tmp_path / "tls")
    server = _tls_server(d)
    try:
        served = _served_serial(server.port, d)
        (d / "redis.key").write_bytes((d / "admin.key").read_bytes())  # a key whose certificate is not written yet
        with pytest.raises(redis.RedisError):
            server.reload_tls()
        assert server.tls_changed()  # so the supervisor tries again
        assert _served_serial(server.port, d) == served
        assert _pings(server, d / "ca.crt", d / "admin.crt", d / "admin.key")
        pki.rotate(d)  # the rotation completes
        server.reload_tls()
        assert _served_serial(server.port, d) == _serial(d / "redis.crt") != served
    finally:
        server.stop()


def test_the_reload_user_may_only_reload(tmp_path):
    from hsched.state.redis import RELOAD_USER

    d = pki.init_dir(tmp_path / "tls")
    server = _tls_server(d, data_dir=tmp_path / "r")
    try:
        assert oct(os.stat(server.reload_socket).st_mode & 0o777) == "0o700"
        assert server._reload_password.encode() not in open(f"/proc/{server.proc.pid}/cmdline", "rb").read()
        admin = redis.Redis(unix_socket_path=str(server.reload_socket), username=RELOAD_USER,
                            password=server._reload_password, socket_timeout=5)
        assert admin.ping()
        for call in (lambda: admin.get("hsched:epoch"), lambda: admin.config_get("*"), lambda: admin.flushall(),
                     lambda: admin.execute_command("ACL", "LIST")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                call()
        admin.close()
        # the services' user may not reload: CONFIG stays out of hsched_acl_rules
        with pytest.raises(redis.exceptions.NoPermissionError):
            server.client().config_set("tls-cert-file", str(d / "redis.crt"))
    finally:
        server.stop()


def test_a_service_client_reconnects_with_the_rotated_files_after_a_roll_over(tmp_path):
    """redis-py's asyncio TLS connection keeps the SSLContext of its first connect: reconnecting after a roll-over
    it offered the old CA's leaf and trusted only the old CA (hsched.state.redis.connect re-reads them)."""
    import asyncio

    from hsched.state.redis import connect

    d = pki.init_dir(tmp_path / "tls")
    server = _tls_server(d)

    async def across_a_roll_over():
        client = connect(server.url, RedisTls(str(d / "ca.crt"), str(d / "redis.crt"), str(d / "redis.key")))
        try:
            assert await client.ping()
            pki.rotate(d, new_ca=True)
            server.reload_tls()
            pki.rotate(d, drop_old_cas=True)
            server.reload_tls()
            await client.connection_pool.disconnect()  # a dropped connection: the pool reconnects the same object
            return await client.ping()
        finally:
            await client.aclose()

    try:
        assert asyncio.run(across_a_roll_over())
    finally:
        server.stop()


def test_a_supervised_stack_with_tls_keeps_serving_across_a_ca_roll_over(tmp_path):
    """`hsched certs rotate --new-ca` then `--drop-old-ca` on a running `hsched up --tls`: the supervisor has the
    embedded Redis load the new files, so Submits go on and a gateway restarted after the roll-over comes up
    (it exited ~2 s after each restart: Redis still served the old CA's certificate)."""
    import time

    from hsched.security.tls import TlsFiles, channel_credentials
    from tests.test_supervisor import supervisor_log

    prefix = f"tls-rot-{uuid.uuid4().hex[:8]}"
    config = StackConfig(fleet_path=SMALL_FLEET, prefix=prefix, gateway_port=0, metrics=False, thermal=False,
                         state_dir=str(tmp_path / "state"), tls=True, supervise=True, tls_reload_interval_s=0.5)

    def submit(stack) -> pb.Task:
        with grpc.secure_channel(stack.gateway, channel_credentials(TlsFiles(stack.tls_dir, "admin"))) as ch:
            return gateway_pb2_grpc.GatewayStub(ch).Submit(gateway_pb2.SubmitRequest(task=pb.TaskSpec(
                tenant="t", replicas=1, runtime_s=3600, resources=pb.Resources(cpu_milli=100, memory_mib=128))),
                timeout=30).task

    def eventually(check, what, timeout_s=120.0):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if check():
                    return
            except (grpc.RpcError, OSError, redis.RedisError):
                pass
            assert time.monotonic() < deadline, what
            time.sleep(0.5)

    with Stack(config) as stack:
        d = stack.tls_dir
        assert submit(stack).state == pb.TASK_STATE_PLACED
        pki.rotate(d, new_ca=True)
        eventually(lambda: _served_serial(stack.redis.port, d) == _serial(d / "redis.crt"),
                   "Redis did not load the new CA's certificate")
        assert submit(stack).state == pb.TASK_STATE_PLACED
        pki.rotate(d, drop_old_cas=True)
        eventually(lambda: _served_serial(stack.redis.port, d) == _serial(d / "redis.crt") and
                   not stack.redis.tls_changed(), "Redis did not load the rotation that dropped the old CA")
        assert submit(stack).state == pb.TASK_STATE_PLACED
        stack.kill("gateway")  # a gateway started now has only the new CA's leaf and trusts only the new CA
        eventually(lambda: stack.services["gateway"].restarts >= 1 and
                   submit(stack).state == pb.TASK_STATE_PLACED, "no Submit through the restarted gateway")
        # stays up: the bug's restarted gateway exited again ~2 s later
        eventually(lambda: stack.services["gateway"].ever_served, "the restarted gateway never served")
        time.sleep(5)
        assert stack.services["gateway"].alive and stack.services["gateway"].restarts == 1
        assert submit(stack).state == pb.TASK_STATE_PLACED
        log = supervisor_log(stack)
        assert log.count("redis: loaded its rotated TLS files") >= 2, log
        assert "1 CA trusted" in log and "2 CAs trusted" in log, log
        assert stack.redis.password not in log and stack.redis._reload_password not in log
