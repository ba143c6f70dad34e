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
