"""Mutual TLS between the services (issue 14, item 1): the local CA (hsched.security.pki), real services
serving TLS with per-method authorization by caller identity (hsched.security.authz), certificate rotation
without restarts, reflection switched off, and the whole stack over TLS (Stack and `hsched up --tls`)."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import shutil
import socket
import ssl
import stat
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from hypothesis import given
from hypothesis import strategies as st

from hsched import stack as stack_module
from hsched.security import authz, pki
from hsched.security.tls import ReloadingChannel, TlsFiles, channel_credentials
from hsched.stack import Stack, StackConfig
from hsched.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    placer_pb2,
    placer_pb2_grpc,
    thermal_pb2,
    thermal_pb2_grpc,
)
from tests import inprocess
from tests.conftest import ROOT, SMALL_FLEET, delete_prefix

# -- pki: hand-checkable facts ---------------------------------------------------------------------------------


def leaf(d: Path, name: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate((d / f"{name}.crt").read_bytes())


def test_init_writes_a_private_dir_with_one_verified_leaf_per_identity(tmp_path):
    d = pki.init_dir(tmp_path / "tls")
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    ca = x509.load_pem_x509_certificate((d / "ca.crt").read_bytes())
    assert stat.S_IMODE(os.stat(d / "ca.key").st_mode) == 0o600
    expected = {
        "gateway": "spiffe://hsched.local/service/gateway", "selector": "spiffe://hsched.local/service/selector",
        "placer": "spiffe://hsched.local/service/placer", "thermal": "spiffe://hsched.local/service/thermal",
        "supervisor": "spiffe://hsched.local/service/supervisor", "redis": "spiffe://hsched.local/service/redis",
        "admin": "spiffe://hsched.local/admin/admin"}
    assert sorted(p.name for p in d.iterdir()) == sorted(["ca.crt", "ca.key", *(f"{n}.{e}" for n in expected
                                                                                 for e in ("crt", "key"))])
    now = dt.datetime.now(dt.UTC)
    for name, uri in expected.items():
        assert stat.S_IMODE(os.stat(d / f"{name}.key").st_mode) == 0o600
        cert = leaf(d, name)
        cert.verify_directly_issued_by(ca)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [uri]
        assert "localhost" in sans.get_values_for_type(x509.DNSName)
        assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usage)
        assert cert.not_valid_before_utc <= now < cert.not_valid_after_utc
        # 90 days from 5 minutes ago (clock skew allowance)
        assert cert.not_valid_after_utc - cert.not_valid_before_utc == dt.timedelta(days=90, minutes=5)
    assert not any(p.name.startswith(".") for p in d.iterdir()), "a temporary file was left behind"


def test_a_symlink_is_refused_never_followed(tmp_path):
    d = pki.init_dir(tmp_path / "tls")
    outside = tmp_path / "outside.key"
    outside.write_bytes(b"precious")
    (d / "gateway.key").unlink()
    (d / "gateway.key").symlink_to(outside)
    with pytest.raises(pki.PkiError, match="symbolic link"):
        pki.issue(d, "gateway")
    assert outside.read_bytes() == b"precious"
    (tmp_path / "linked").symlink_to(d)
    with pytest.raises(pki.PkiError, match="symbolic link"):
        pki.init_dir(tmp_path / "linked", force=True)
    (d / "ca.key").rename(tmp_path / "real-ca.key")
    (d / "ca.key").symlink_to(tmp_path / "real-ca.key")
    with pytest.raises(pki.PkiError, match="symbolic link"):
        pki.CertificateAuthority.load(d)


def test_a_directory_others_can_read_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(pki.PkiError, match="mode 0755"):
        pki.init_dir(shared)
    assert not list(shared.iterdir())
    with pytest.raises(pki.PkiError, match="no such directory"):
        pki.rotate(tmp_path / "missing")
    assert not (tmp_path / "missing").exists()


def test_rotate_reissues_same_identities_and_rolls_the_ca_over(tmp_path):
    d = pki.init_dir(tmp_path / "tls")
    pki.issue(d, "tenant-acme")
    before = {n: leaf(d, n) for n in pki.leaf_names(d)}
    ca_before = (d / "ca.crt").read_bytes()
    assert pki.rotate(d) == sorted(before)
    assert (d / "ca.crt").read_bytes() == ca_before  # same CA
    ca = x509.load_pem_x509_certificate(ca_before)
    for name, old in before.items():
        new = leaf(d, name)
        new.verify_directly_issued_by(ca)
        assert new.serial_number != old.serial_number and new.public_key() != old.public_key()
        assert pki.uri_sans(new.public_bytes(pki.serialization.Encoding.PEM)) == \
            pki.uri_sans(old.public_bytes(pki.serialization.Encoding.PEM))
    assert pki.uri_sans((d / "tenant-acme.crt").read_bytes()) == ["spiffe://hsched.local/tenant/acme"]

    pki.rotate(d, new_ca=True)
    bundle = pki.load_bundle(d / "ca.crt")
    assert len(bundle) == 2 and bundle[1] == ca  # the old CA is still trusted during the roll-over
    leaf(d, "gateway").verify_directly_issued_by(bundle[0])
    assert pki.CertificateAuthority.load(d).cert == bundle[0]
    pki.rotate(d, drop_old_cas=True)
    assert pki.load_bundle(d / "ca.crt") == [bundle[0]]


def test_a_stack_keeps_its_ca_and_renews_a_leaf_near_expiry(tmp_path):
    config = StackConfig(fleet_path=SMALL_FLEET, state_dir=str(tmp_path / "state"), tls=True)

    def prepare() -> None:  # what Stack.start does first about TLS, without starting anything
        stack = Stack(config)
        stack._prepare_tls()
        shutil.rmtree(stack.run_dir)

    prepare()
    d = tmp_path / "state" / "tls"
    ca, placer = (d / "ca.crt").read_bytes(), (d / "placer.crt").read_bytes()
    now = dt.datetime.now(dt.UTC)
    pki.CertificateAuthority.load(d).issue("gateway", not_before=now - dt.timedelta(days=80),
                                           not_after=now + dt.timedelta(days=2)).write(d, "gateway")
    (d / "thermal.crt").unlink()
    assert pki.expiring(d, dt.timedelta(days=7)) == ["gateway"]
    prepare()  # the next `hsched up --tls` on this state dir
    assert (d / "ca.crt").read_bytes() == ca and (d / "placer.crt").read_bytes() == placer
    assert pki.expiring(d, dt.timedelta(days=7)) == [] and (d / "thermal.crt").exists()
    assert leaf(d, "gateway").not_valid_after_utc > now + dt.timedelta(days=80)


@given(st.text(min_size=0, max_size=20))
def test_a_leaf_name_is_an_identity_in_the_trust_domain_or_refused(name):
    try:
        uri = pki.identity_for(name)
    except pki.PkiError as exc:
        assert repr(name) in str(exc)
        return
    assert uri.startswith("spiffe://hsched.local/") and "/" not in uri.removeprefix("spiffe://hsched.local/") \
        .split("/", 1)[1]
    assert pki.paths("/d", name)[0] == Path("/d") / f"{name}.crt"  # the name is one plain file name


def test_the_cli_refuses_malformed_tls_files_in_one_line_naming_the_file(tmp_path, monkeypatch, capfd):
    """A CA that is no PEM certificate (or is a key), a client key that is no key or not the certificate's:
    one line naming the variable/flag and the file, exit 2, before any connection (it was gRPC's handshake
    failure: a dozen lines of C-core log, then UNAVAILABLE, exit 1)."""
    from hsched import cli

    d = pki.init_dir(tmp_path / "tls")
    pki.issue(d, "tenant-acme")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # no running stack
    for name in ("HSCHED_TOKEN", "HSCHED_TOKEN_FILE", "HSCHED_TLS_CA", "HSCHED_TLS_CERT", "HSCHED_TLS_KEY"):
        monkeypatch.delenv(name, raising=False)
    junk = tmp_path / "junk.crt"
    junk.write_text("not a certificate\n")
    crt, key, other_key = d / "tenant-acme.crt", d / "tenant-acme.key", d / "admin.key"
    cases = [
        ({"HSCHED_TLS_CA": junk}, [], f"HSCHED_TLS_CA: {junk} is not a PEM certificate file: it must hold"),
        ({}, ["--tls-ca", str(key)], f"--tls-ca: {key} is not a PEM certificate file (it holds a private key)"),
        ({"HSCHED_TLS_CA": d / "ca.crt", "HSCHED_TLS_CERT": crt, "HSCHED_TLS_KEY": other_key}, [],
         f"HSCHED_TLS_KEY: {other_key} is not the private key of the certificate {crt} (HSCHED_TLS_CERT)"),
        ({"HSCHED_TLS_CERT": crt, "HSCHED_TLS_KEY": crt}, [],
         f"HSCHED_TLS_KEY: {crt} is not a PEM private key (it holds a certificate)"),
        ({"HSCHED_TLS_CERT": junk, "HSCHED_TLS_KEY": key}, [], f"HSCHED_TLS_CERT: {junk} is not a PEM certificate"),
    ]
    for env, flags, expected in cases:
        for name in ("HSCHED_TLS_CA", "HSCHED_TLS_CERT", "HSCHED_TLS_KEY"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, str(value))
        assert cli.main(["list", "--gateway", "127.0.0.1:1", *flags]) == 2, expected
        err = capfd.readouterr().err
        assert err.startswith(f"hsched: {expected}") and err.count("\n") == 1, err
    monkeypatch.setenv("HSCHED_TLS_CA", str(d / "ca.crt"))  # good files: on to the (absent) gateway
    monkeypatch.setenv("HSCHED_TLS_CERT", str(crt))
    monkeypatch.setenv("HSCHED_TLS_KEY", str(key))
    assert cli.main(["list", "--gateway", "127.0.0.1:1"]) == 1
    assert "UNAVAILABLE" in capfd.readouterr().err


def test_authorization_table_is_default_deny():
    assert authz.allowed("/hsched.v1.Placer/Place", "spiffe://hsched.local/service/gateway")
    for who in ("selector", "thermal", "placer", "supervisor"):
        assert not authz.allowed("/hsched.v1.Placer/Place", f"spiffe://hsched.local/service/{who}")
    assert not authz.allowed("/hsched.v1.Placer/Place", "spiffe://hsched.local/admin/admin")
    assert not authz.allowed("/hsched.v1.Placer/Place", "spiffe://other.domain/service/gateway")
    assert not authz.allowed("/hsched.v1.Placer/NewMethod", "spiffe://hsched.local/service/gateway")
    assert authz.allowed("/grpc.health.v1.Health/Check", "spiffe://hsched.local/tenant/acme")
    # every gateway method (DAG jobs and fleet views too) is for any CA identity: the tenant rules decide the rest
    for method in gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].methods:
        assert authz.allowed(f"/hsched.v1.Gateway/{method.name}", "spiffe://hsched.local/tenant/acme"), method.name


# -- real services over TLS -------------------------------------------------------------------------------------


@pytest.fixture
def tls_dir(tmp_path):
    d = pki.init_dir(tmp_path / "tls")
    pki.issue(d, "tenant-acme")
    ca = pki.CertificateAuthority.load(d)
    now = dt.datetime.now(dt.UTC)
    expired = ca.issue("gateway", not_before=now - dt.timedelta(days=10), not_after=now - dt.timedelta(days=1))
    expired.write(_private(tmp_path / "expired"), "gateway")
    foreign = pki.CertificateAuthority.create("another CA")
    foreign.issue("gateway").write(_private(tmp_path / "foreign"), "gateway")
    return d


def _private(d: Path) -> Path:
    d.mkdir(mode=0o700, exist_ok=True)
    return d


def creds(d: Path, name: str | None, ca_dir: Path | None = None) -> grpc.ChannelCredentials:
    """`name`'s certificate from `d`, trusting the CA of `ca_dir` (default `d`); name None: no client cert."""
    ca = ((ca_dir or d) / "ca.crt").read_bytes()
    if name is None:
        return grpc.ssl_channel_credentials(ca)
    return grpc.ssl_channel_credentials(ca, (d / f"{name}.key").read_bytes(), (d / f"{name}.crt").read_bytes())


@asynccontextmanager
async def tls_services(redis_url: str, prefix: str, tmp_path: Path, tls_dir: Path, *extra: str):
    """A real placer (DC cheap of the small fleet) and thermal service, in-process, serving mutual TLS."""
    from services.placer import server as placer_server
    from services.thermal import server as thermal_server

    common = ["--fleet", SMALL_FLEET, "--redis-url", redis_url, "--prefix", prefix, "--tls-dir", str(tls_dir), *extra]
    async with inprocess.service(thermal_server, common, tmp_path / "thermal.port") as thermal, \
            inprocess.service(placer_server, [*common, "--datacenter", "cheap"], tmp_path / "placer.port") as placer:
        yield placer, thermal


def place_request(task_id: str) -> placer_pb2.PlaceRequest:
    return placer_pb2.PlaceRequest(task_id=task_id, task=common_pb2.TaskSpec(
        resources=common_pb2.Resources(cpu_milli=1000, memory_mib=1024), runtime_s=60))


async def call(target: str, credentials: grpc.ChannelCredentials, method):
    async with grpc.aio.secure_channel(target, credentials) as ch:
        return await method(ch)


async def status_of(target: str, credentials: grpc.ChannelCredentials, method) -> tuple[grpc.StatusCode, str]:
    try:
        await call(target, credentials, method)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


async def test_only_the_gateway_may_place_and_release_on_a_placer(redis_url, prefix, tmp_path, tls_dir):
    place = lambda ch: placer_pb2_grpc.PlacerStub(ch).Place(place_request("t1"), timeout=10)  # noqa: E731
    release = lambda ch: placer_pb2_grpc.PlacerStub(ch).Release(  # noqa: E731
        placer_pb2.PlacerReleaseRequest(task_id="t1"), timeout=10)
    state = lambda ch: placer_pb2_grpc.PlacerStub(ch).GetState(placer_pb2.PlacerStateRequest(), timeout=10)  # noqa: E731
    async with tls_services(redis_url, prefix, tmp_path, tls_dir) as (placer, _):
        for method, name in ((place, "Place"), (release, "Release")):
            for who in ("selector", "thermal", "admin", "supervisor", "placer", "tenant-acme"):
                code, details = await status_of(placer, creds(tls_dir, who), method)
                assert code == grpc.StatusCode.PERMISSION_DENIED, (who, name, code)
                assert pki.identity_for(who) in details and f"/hsched.v1.Placer/{name}" in details
            # no certificate, an expired one, one from another CA: the handshake itself is refused
            for credentials in (creds(tls_dir, None), creds(tmp_path / "expired", "gateway", tls_dir),
                                creds(tmp_path / "foreign", "gateway", tls_dir)):
                assert (await status_of(placer, credentials, method))[0] == grpc.StatusCode.UNAVAILABLE
            # nothing reached the engine
            assert (await call(placer, creds(tls_dir, "admin"), state)).summary.running_tasks == 0
        placed = await call(placer, creds(tls_dir, "gateway"), place)
        assert placed.outcome == placer_pb2.PLACE_OUTCOME_PLACED
        # the issue's scenario: a direct Release by anyone but the gateway leaves the task placed
        assert (await status_of(placer, creds(tls_dir, "admin"), release))[0] == grpc.StatusCode.PERMISSION_DENIED
        assert (await call(placer, creds(tls_dir, "selector"), state)).summary.running_tasks == 1
        assert (await call(placer, creds(tls_dir, "gateway"), release)).released
        assert (await call(placer, creds(tls_dir, "supervisor"), state)).summary.running_tasks == 0
        # plaintext to a TLS port: refused too
        async with grpc.aio.insecure_channel(placer) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await placer_pb2_grpc.PlacerStub(ch).GetState(placer_pb2.PlacerStateRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_thermal_predict_for_placer_and_gateway_health_for_any_ca_identity(redis_url, prefix, tmp_path,
                                                                                 tls_dir):
    predict = lambda ch: thermal_pb2_grpc.ThermalStub(ch).Predict(  # noqa: E731
        thermal_pb2.PredictRequest(datacenter="cheap", want_headroom=True), timeout=10)
    health = lambda ch: health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)  # noqa: E731
    async with tls_services(redis_url, prefix, tmp_path, tls_dir) as (placer, thermal):
        for who in ("placer", "gateway"):
            assert len((await call(thermal, creds(tls_dir, who), predict)).headroom_w) > 0
        for who in ("selector", "admin", "tenant-acme"):
            code, details = await status_of(thermal, creds(tls_dir, who), predict)
            assert code == grpc.StatusCode.PERMISSION_DENIED and pki.identity_for(who) in details
        for target in (placer, thermal):
            for who in ("tenant-acme", "selector", "admin"):
                reply = await call(target, creds(tls_dir, who), health)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            assert (await status_of(target, creds(tmp_path / "foreign", "gateway", tls_dir), health))[0] == \
                grpc.StatusCode.UNAVAILABLE


async def test_every_kind_of_handler_is_guarded_even_a_client_stream(tls_dir):
    """Default deny holds for each of the four handler kinds: a method missing from authz.POLICY is refused
    whichever kind it is (a client-streaming one was once registered unguarded)."""
    from hsched import rpc

    async def count(requests, context):
        return b"%d" % len([r async for r in requests])

    async def first(request, context):
        return request

    async def echo(request, context):
        yield request

    async def echoes(requests, context):
        async for r in requests:
            yield r

    handlers = {"Count": grpc.stream_unary_rpc_method_handler(count), "First": grpc.unary_unary_rpc_method_handler(first),
                "Echo": grpc.unary_stream_rpc_method_handler(echo),
                "Echoes": grpc.stream_stream_rpc_method_handler(echoes)}
    register = lambda server: server.add_generic_rpc_handlers(  # noqa: E731
        (grpc.method_handlers_generic_handler("hsched.v1.Unlisted", handlers),))
    server, port, _ = await rpc.start_server(register, [], tls=TlsFiles(tls_dir, "placer"), reflection=False)
    try:
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds(tls_dir, "gateway")) as ch:
            calls = {"Count": ch.stream_unary("/hsched.v1.Unlisted/Count")(iter([b"a", b"b"]), timeout=10),
                     "First": ch.unary_unary("/hsched.v1.Unlisted/First")(b"a", timeout=10),
                     "Echo": ch.unary_stream("/hsched.v1.Unlisted/Echo")(b"a", timeout=10),
                     "Echoes": ch.stream_stream("/hsched.v1.Unlisted/Echoes")(iter([b"a"]), timeout=10)}
            for name, pending in calls.items():
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    if name in ("Echo", "Echoes"):
                        _ = [r async for r in pending]
                    else:
                        await pending
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, name
                assert f"/hsched.v1.Unlisted/{name}" in err.value.details()
    finally:
        await server.stop(None)


async def list_services(target: str, credentials: grpc.ChannelCredentials) -> list[str]:
    async with grpc.aio.secure_channel(target, credentials) as ch:
        stream = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        async for reply in stream:
            return [s.name for s in reply.list_services_response.service]
    return []


async def test_reflection_is_for_admin_and_supervisor_and_can_be_switched_off(redis_url, prefix, tmp_path, tls_dir):
    async with tls_services(redis_url, prefix, tmp_path, tls_dir) as (placer, _):
        for who in ("admin", "supervisor"):
            assert "hsched.v1.Placer" in await list_services(placer, creds(tls_dir, who))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await list_services(placer, creds(tls_dir, "gateway"))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    async with tls_services(redis_url, prefix, _private(tmp_path / "off"), tls_dir, "--reflection", "off") as (placer, _):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await list_services(placer, creds(tls_dir, "admin"))
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_gateway_asks_for_no_client_certificate_unless_required(redis_url, prefix, tmp_path, tls_dir):
    """--client-auth optional (default): TLS, a client with only the CA gets in; require: a CA certificate is
    needed (any identity of the CA), none or a foreign one fails the handshake."""
    from services.gateway import server as gateway_server

    list_tasks = lambda ch: gateway_pb2_grpc.GatewayStub(ch).List(gateway_pb2.ListRequest(), timeout=10)  # noqa: E731
    common = ["--fleet", SMALL_FLEET, "--redis-url", redis_url, "--prefix", prefix, "--tls-dir", str(tls_dir)]
    async with inprocess.service(gateway_server, common, _private(tmp_path / "opt") / "gateway.port") as gw:
        assert (await status_of(gw, creds(tls_dir, None), list_tasks))[0] == grpc.StatusCode.OK
        async with grpc.aio.insecure_channel(gw) as plain:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await list_tasks(plain)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    async with inprocess.service(gateway_server, [*common, "--client-auth", "require"],
                                 _private(tmp_path / "req") / "gateway.port") as gw:
        for who in ("tenant-acme", "admin"):
            assert (await status_of(gw, creds(tls_dir, who), list_tasks))[0] == grpc.StatusCode.OK
        for credentials in (creds(tls_dir, None), creds(tmp_path / "foreign", "gateway", tls_dir)):
            assert (await status_of(gw, credentials, list_tasks))[0] == grpc.StatusCode.UNAVAILABLE
        assert "hsched.v1.Gateway" in await list_services(gw, creds(tls_dir, "admin"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await list_services(gw, creds(tls_dir, "tenant-acme"))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_the_cli_says_when_it_and_the_gateway_disagree_on_tls(redis_url, prefix, tmp_path, tls_dir,
                                                                     monkeypatch, capfd):
    """gRPC says only "Socket closed" to a plaintext client of a TLS port, and WRONG_VERSION_NUMBER to a TLS client
    of a plaintext one: the CLI's line says which setting to change."""
    from hsched import cli
    from services.gateway import server as gateway_server

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # no running stack
    for name in ("HSCHED_TOKEN", "HSCHED_TOKEN_FILE", "HSCHED_TLS_CA", "HSCHED_TLS_CERT", "HSCHED_TLS_KEY"):
        monkeypatch.delenv(name, raising=False)
    common = ["--fleet", SMALL_FLEET, "--redis-url", redis_url, "--prefix", prefix]

    async def cli_list(gw: str, *flags: str) -> str:
        assert await asyncio.to_thread(cli.main, ["list", "--gateway", gw, *flags]) == 1
        err = capfd.readouterr().err.splitlines()[-1]  # (before it: the in-process gateway's handshake log)
        assert err.startswith("hsched: UNAVAILABLE"), err
        return err

    async with inprocess.service(gateway_server, [*common, "--tls-dir", str(tls_dir)],
                                 _private(tmp_path / "tls-gw") / "gateway.port") as gw:
        assert f"(if {gw} serves TLS, give its CA: --tls-ca FILE or HSCHED_TLS_CA" in await cli_list(gw)
    async with inprocess.service(gateway_server, common, _private(tmp_path / "plain-gw") / "gateway.port") as gw:
        assert f"({gw} does not speak TLS: drop --tls-ca" in await cli_list(gw, "--tls-ca", str(tls_dir / "ca.crt"))
    assert "TLS" not in await cli_list("127.0.0.1:1")  # nothing listens: no hint about TLS


def presented_serial(target: str, tls_dir: Path) -> int:
    """The serial number of the certificate the server presents to a new TLS connection."""
    ctx = ssl.create_default_context(cafile=str(tls_dir / "ca.crt"))
    ctx.load_cert_chain(tls_dir / "admin.crt", tls_dir / "admin.key")
    ctx.set_alpn_protocols(["h2"])
    host, port = target.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname=host) as tls:
        return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number


async def test_rotation_reaches_servers_and_clients_without_restart(redis_url, prefix, tmp_path, tls_dir):
    state = lambda ch: placer_pb2_grpc.PlacerStub(ch).GetState(placer_pb2.PlacerStateRequest(), timeout=10)  # noqa: E731
    async with tls_services(redis_url, prefix, tmp_path, tls_dir) as (placer, _):
        first = await asyncio.to_thread(presented_serial, placer, tls_dir)
        assert first == leaf(tls_dir, "placer").serial_number
        old_gateway = creds(tls_dir, "gateway")
        files = TlsFiles(tls_dir, "gateway")
        reloading = ReloadingChannel(files, lambda c: grpc.aio.secure_channel(placer, c), check_interval_s=0)
        stub = placer_pb2_grpc.PlacerStub(reloading)
        await stub.GetState(placer_pb2.PlacerStateRequest(), timeout=10)

        pki.rotate(tls_dir)  # same CA, new leaves
        second = await asyncio.to_thread(presented_serial, placer, tls_dir)
        assert second == leaf(tls_dir, "placer").serial_number != first
        await stub.GetState(placer_pb2.PlacerStateRequest(), timeout=10)
        assert reloading.generation == 1

        # a new CA, then the old one dropped: the server trusts only the new CA, so a client still holding
        # the old certificate is refused on a new connection while the reloading client follows the files
        pki.rotate(tls_dir, new_ca=True)
        pki.rotate(tls_dir, drop_old_cas=True)
        assert (await status_of(placer, old_gateway, state))[0] == grpc.StatusCode.UNAVAILABLE
        await stub.GetState(placer_pb2.PlacerStateRequest(), timeout=10)
        assert reloading.generation >= 2
        assert (await call(placer, creds(tls_dir, "gateway"), state)).summary.capacity.cpu_milli > 0
        await reloading.close()


async def test_a_half_written_pair_is_not_served(redis_url, prefix, tmp_path, tls_dir):
    """The key of a new certificate written, the certificate not yet: the server keeps the last good pair (a
    mismatched pair would fail every handshake), and takes the new one once it is complete."""
    health = lambda ch: health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)  # noqa: E731
    async with tls_services(redis_url, prefix, tmp_path, tls_dir) as (placer, _):
        first = await asyncio.to_thread(presented_serial, placer, tls_dir)
        new = pki.CertificateAuthority.load(tls_dir).issue("placer")
        pki.write_private(tls_dir, "placer.key", new.key_pem)
        with pytest.raises(pki.PkiError, match="does not belong"):
            TlsFiles(tls_dir, "placer").read()
        assert await asyncio.to_thread(presented_serial, placer, tls_dir) == first
        assert (await call(placer, creds(tls_dir, "gateway"), health)).status == health_pb2.HealthCheckResponse.SERVING
        pki.write_private(tls_dir, "placer.crt", new.cert_pem, 0o644)
        assert await asyncio.to_thread(presented_serial, placer, tls_dir) == \
            x509.load_pem_x509_certificate(new.cert_pem).serial_number != first


async def test_a_service_with_a_missing_certificate_exits_with_one_line(redis_url, prefix, tls_dir):
    (tls_dir / "thermal.key").unlink()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.thermal", "--fleet", SMALL_FLEET, "--redis-url", redis_url, "--prefix",
        prefix, "--tls-dir", str(tls_dir), cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out = (await asyncio.wait_for(proc.communicate(), 60))[0].decode()
    assert proc.returncode != 0 and "thermal.key" in out and "Traceback" not in out, out


# -- the whole stack over TLS -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_stack_with_tls_places_and_releases_end_to_end(redis_url):
    prefix = f"test-tls-stack-{int(time.time() * 1000)}"
    config = StackConfig(fleet_path=SMALL_FLEET, redis_url=redis_url, prefix=prefix, gateway_port=0, tls=True,
                         extra_env={"HSCHED_THERMAL_GUARD": "service"})  # the placer -> thermal hop too
    try:
        with Stack(config) as stack:
            tls_dir = stack.tls_dir
            assert stat.S_IMODE(os.stat(tls_dir).st_mode) == 0o700
            with grpc.secure_channel(stack.gateway, channel_credentials(TlsFiles(tls_dir, "admin"))) as ch:
                gw = gateway_pb2_grpc.GatewayStub(ch)
                t = gw.Submit(gateway_pb2.SubmitRequest(task=common_pb2.TaskSpec(
                    resources=common_pb2.Resources(cpu_milli=2000, memory_mib=4096), runtime_s=3600)), timeout=30).task
                assert t.state == common_pb2.TASK_STATE_PLACED and t.explanation.thermal.redline_c > 0
                # the placer holding it refuses a Release that is not the gateway's; the gateway's goes through
                with grpc.secure_channel(stack.placer_target(t.datacenter), creds(tls_dir, "admin")) as pch:
                    with pytest.raises(grpc.RpcError) as err:
                        placer_pb2_grpc.PlacerStub(pch).Release(placer_pb2.PlacerReleaseRequest(task_id=t.task_id),
                                                                timeout=10)
                    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert gw.Get(gateway_pb2.GetRequest(task_id=t.task_id), timeout=10).state == common_pb2.TASK_STATE_PLACED
                released = gw.Release(gateway_pb2.ReleaseRequest(task_id=t.task_id), timeout=30).task
                assert released.state == common_pb2.TASK_STATE_RELEASED
                # the fleet view crosses every hop: gateway -> placer GetState (the gateway's identity may call it),
                # placer -> thermal Predict (the room now)
                dcs = gw.ListDatacenters(gateway_pb2.ListDatacentersRequest(), timeout=30).datacenters
                assert [v.status for v in dcs] == ["serving"] * 3, [(v.datacenter, v.reason) for v in dcs]
                assert all(v.thermal.redline_c > 0 and v.thermal.pue_after > 1 for v in dcs)
            with grpc.insecure_channel(stack.gateway) as plain:  # no plaintext next to TLS
                with pytest.raises(grpc.RpcError) as err:
                    gateway_pb2_grpc.GatewayStub(plain).Get(gateway_pb2.GetRequest(task_id=t.task_id), timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            for name, svc in stack.services.items():
                assert "--tls-dir" in svc.args
                # the supervisor's health probe: with its certificate SERVING, in plaintext unanswered
                assert stack_module._health(svc.target, credentials=stack.probe_credentials()) == "SERVING", name
                assert stack_module._health(svc.target).startswith("unanswered"), name
    finally:
        delete_prefix(redis_url, prefix)


@pytest.mark.slow
@pytest.mark.parametrize("gateways", [1, 2])  # 2: one round-robin target, TLS verified against its first address
def test_hsched_up_tls_replays_a_real_trace(redis_url, tmp_path, gateways):
    prefix = f"test-tls-up-{int(time.time() * 1000)}"
    env = {**os.environ, "REDIS_URL": redis_url, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp_path),
           "COLUMNS": "200"}
    try:
        up = subprocess.run([sys.executable, "-m", "hsched.cli", "up", "--fleet", SMALL_FLEET, "--port", "0",
                             "--prefix", prefix, "--state-dir", str(tmp_path / "state"), "--tls",
                             "--replay", "openb", "--limit", "40", "--duration", "2", "--concurrency", "8",
                             "--gateways", str(gateways)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        out = up.stdout + up.stderr
        assert up.returncode == 0, out
        assert "40 submitted" in out and "errors" not in out and "Traceback" not in out, out
        assert "mutual TLS on every hop" in out
        assert ("gateway-2" in out) == (gateways == 2)
        assert stat.S_IMODE(os.stat(tmp_path / "state" / "tls").st_mode) == 0o700
        assert stat.S_IMODE(os.stat(tmp_path / "state" / "tls" / "gateway.key").st_mode) == 0o600
    finally:
        delete_prefix(redis_url, prefix)
