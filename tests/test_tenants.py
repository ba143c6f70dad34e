"""Authenticated tenants at the gateway, through real processes: a stack (`Stack(auth=True)`, as `hsched up
--auth`) on the small fleet, tenants alice and bob with tokens from the tokens file, and the stack's admin token.
Tenant A's task is invisible to tenant B for every method (NOT_FOUND / not listed / not streamed), the `tenant`
field cannot impersonate, idempotency keys are per authenticated tenant (also after a kill -9 of the gateway),
and credentials come from tokens the gateway re-reads when the file changes."""

from __future__ import annotations

import datetime as dt
import os
import socket
import stat
import time

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hsched import cli
from hsched.domain.errors import ValidationError
from hsched.security import tokens as tk
from hsched.security.client import client_credentials
from hsched.security.principals import principal_of_identity
from hsched.stack import Stack, StackConfig
from hsched.v1 import common_pb2 as pb
from hsched.v1 import gateway_pb2, gateway_pb2_grpc
from tests.conftest import SMALL_FLEET, delete_prefix

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(redis_url):
    prefix = f"test-tenants-{int(time.time() * 1000)}"
    config = StackConfig(fleet_path=SMALL_FLEET, redis_url=redis_url, prefix=prefix, gateway_port=0,
                         log_level="INFO", auth=True)
    with Stack(config) as s:
        yield s
    delete_prefix(redis_url, prefix)


@pytest.fixture(scope="module")
def creds(stack):
    """{who: token}: the stack's admin token, and tenant tokens added to its tokens file while it runs."""
    alice, _ = tk.create_token(stack.tokens_file, "alice", name="alice")
    bob, _ = tk.create_token(stack.tokens_file, "bob", name="bob")
    return {"admin": stack.admin_token_file.read_text().strip(), "alice": alice, "bob": bob}


@pytest.fixture(scope="module")
def channel(stack):
    with grpc.insecure_channel(stack.gateway) as ch:
        yield ch


class Client:
    """The gateway as one caller sees it: every call with `token` (None: no credentials)."""

    def __init__(self, channel, token: str | None) -> None:
        self.stub = gateway_pb2_grpc.GatewayStub(channel)
        self.md = (("authorization", f"Bearer {token}"),) if token is not None else ()

    def submit(self, spec: pb.TaskSpec) -> gateway_pb2.SubmitResponse:
        return self.stub.Submit(gateway_pb2.SubmitRequest(task=spec), timeout=20, metadata=self.md)

    def get(self, task_id: str) -> pb.Task:
        return self.stub.Get(gateway_pb2.GetRequest(task_id=task_id), timeout=10, metadata=self.md)

    def release(self, task_id: str) -> pb.Task:
        return self.stub.Release(gateway_pb2.ReleaseRequest(task_id=task_id), timeout=20, metadata=self.md).task

    def list(self, tenant: str = "") -> list[str]:
        ids, token = [], ""
        while True:
            reply = self.stub.List(gateway_pb2.ListRequest(tenant=tenant, limit=1000, page_token=token), timeout=10,
                                   metadata=self.md)
            ids += [t.task_id for t in reply.tasks]
            if not (token := reply.next_page_token):
                return ids

    def watch(self, task_id: str = "", tenant: str = "", after: str = "0"):
        return self.stub.Watch(gateway_pb2.WatchRequest(task_id=task_id, tenant=tenant, after_event_id=after),
                               timeout=30, metadata=self.md)


@pytest.fixture(scope="module")
def gw(channel, creds):
    return {who: Client(channel, token) for who, token in creds.items()}


def spec(cores: float = 1, tenant: str = "", **kw) -> pb.TaskSpec:
    return pb.TaskSpec(resources=pb.Resources(cpu_milli=int(cores * 1000), memory_mib=1024), runtime_s=3600,
                       tenant=tenant, **kw)


def refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        result = call()
        if hasattr(result, "__next__"):  # a stream: the status comes with the first read
            next(result)
    return err.value


def not_found_like_a_missing_task(call, task_id: str, missing_call) -> None:
    """`call` is refused exactly as a call for a task id that does not exist is (no existence leak)."""
    hidden, missing = refused(call), refused(missing_call)
    assert hidden.code() == missing.code() == grpc.StatusCode.NOT_FOUND
    assert hidden.details() == missing.details().replace("t-does-not-exist", task_id)


# -- each method: A's task is invisible to B, visible to A and admin -------------------------------------------------


def test_get_of_another_tenants_task_is_not_found(gw):
    task = gw["alice"].submit(spec()).task
    assert task.spec.tenant == "alice"
    assert gw["alice"].get(task.task_id).task_id == task.task_id
    assert gw["admin"].get(task.task_id).spec.tenant == "alice"
    not_found_like_a_missing_task(lambda: gw["bob"].get(task.task_id), task.task_id,
                                  lambda: gw["bob"].get("t-does-not-exist"))
    gw["alice"].release(task.task_id)


def test_release_of_another_tenants_task_is_not_found_and_changes_nothing(gw):
    task = gw["alice"].submit(spec(cores=2)).task
    assert task.state == pb.TASK_STATE_PLACED
    not_found_like_a_missing_task(lambda: gw["bob"].release(task.task_id), task.task_id,
                                  lambda: gw["bob"].release("t-does-not-exist"))
    assert gw["alice"].get(task.task_id).state == pb.TASK_STATE_PLACED  # still held
    assert gw["alice"].release(task.task_id).state == pb.TASK_STATE_RELEASED
    other = gw["alice"].submit(spec(cores=2)).task
    assert gw["admin"].release(other.task_id).state == pb.TASK_STATE_RELEASED  # an admin acts on any tenant's


def test_list_shows_a_tenant_only_its_own_tasks_whatever_filter_it_sends(gw):
    mine = gw["alice"].submit(spec()).task.task_id
    theirs = gw["bob"].submit(spec()).task.task_id
    for tenant in ("", "alice", "bob"):
        seen_by_bob = gw["bob"].list(tenant)
        assert mine not in seen_by_bob and theirs in seen_by_bob
        assert all(gw["admin"].get(t).spec.tenant == "bob" for t in seen_by_bob)
    assert mine in gw["alice"].list() and theirs not in gw["alice"].list()
    everyone = gw["admin"].list()
    assert mine in everyone and theirs in everyone
    assert gw["admin"].list("alice") == [t for t in everyone if gw["admin"].get(t).spec.tenant == "alice"]
    for who, t in (("alice", mine), ("bob", theirs)):
        gw[who].release(t)


def test_watch_streams_a_tenant_only_its_own_events(gw):
    hidden = gw["alice"].submit(spec()).task.task_id
    not_found_like_a_missing_task(lambda: gw["bob"].watch(task_id=hidden), hidden,
                                  lambda: gw["bob"].watch(task_id="t-does-not-exist"))
    # A Watch of every tenant, or of alice's by name, from the start of the stream: alice's events come before
    # bob's next task in the stream, so if any leaked it would arrive before bob's own event does.
    streams = [gw["bob"].watch(), gw["bob"].watch(tenant="alice")]
    marker = gw["bob"].submit(spec()).task.task_id
    for stream in streams:
        seen = []
        for event in stream:
            seen.append(event)
            if event.task_id == marker and event.kind == "placed":
                break
        stream.cancel()
        assert {e.tenant for e in seen} == {"bob"} and hidden not in {e.task_id for e in seen}
    for who in ("alice", "admin"):
        stream = gw[who].watch(task_id=hidden)
        first = next(stream)
        stream.cancel()
        assert first.task_id == hidden and first.tenant == "alice"
    gw["alice"].release(hidden)
    gw["bob"].release(marker)


# -- the tenant field and idempotency -----------------------------------------------------------------------------


def test_tenants_view_shows_a_tenant_only_its_own_share_and_an_admin_every_tenants(gw):
    """ListDatacenters(include_tenants) — `hsched tenants`: a tenant sees its own fair-share rows only (another
    tenant's name is not leaked), an admin every tenant's; what a tenant holds is what its tasks hold."""
    held = {who: gw[who].submit(spec(2)).task for who in ("alice", "bob")}
    try:
        def rows(who: str) -> dict[tuple[str, str], object]:
            reply = gw[who].stub.ListDatacenters(gateway_pb2.ListDatacentersRequest(include_tenants=True),
                                                 timeout=15, metadata=gw[who].md)
            return {(v.datacenter, t.tenant): t for v in reply.datacenters for t in v.tenants}
        for who, task in held.items():
            assert task.state == pb.TASK_STATE_PLACED, task
            mine = rows(who)
            assert {tenant for _, tenant in mine} == {who}, mine
            share = mine[(task.datacenter, who)]
            assert share.running_tasks >= 1 and share.allocated.cpu_milli >= 2000 and share.weight == 1.0
        everyone = {tenant for _, tenant in rows("admin")}
        assert {"alice", "bob"} <= everyone
        plain = gw["admin"].stub.ListDatacenters(gateway_pb2.ListDatacentersRequest(), timeout=15,
                                                 metadata=gw["admin"].md)
        assert not any(v.tenants for v in plain.datacenters)  # only when asked for
    finally:
        for who, task in held.items():
            gw[who].release(task.task_id)


def test_a_forged_tenant_field_is_replaced_by_the_authenticated_tenant(gw):
    forged = gw["bob"].submit(spec(tenant="alice")).task
    assert forged.spec.tenant == "bob"
    assert forged.task_id not in gw["alice"].list()
    assert refused(lambda: gw["alice"].get(forged.task_id)).code() == grpc.StatusCode.NOT_FOUND
    gw["bob"].release(forged.task_id)
    on_behalf = gw["admin"].submit(spec(tenant="alice")).task  # an admin may act for a tenant
    assert on_behalf.spec.tenant == "alice" and on_behalf.task_id in gw["alice"].list()
    gw["alice"].release(on_behalf.task_id)


def test_request_ids_are_scoped_per_authenticated_tenant_also_after_a_gateway_crash(gw, stack):
    first = gw["alice"].submit(spec(request_id="job-7")).task
    # bob reuses alice's request_id, even naming her as tenant: his own new task, not hers
    bobs = gw["bob"].submit(spec(request_id="job-7", tenant="alice"))
    assert not bobs.duplicate and bobs.task.task_id != first.task_id and bobs.task.spec.tenant == "bob"
    again = gw["alice"].submit(spec(request_id="job-7"))
    assert again.duplicate and again.task.task_id == first.task_id
    stack.kill("gateway")  # kill -9: the table and its request index come back from the task stream
    stack.restart("gateway")
    for who, task_id in (("alice", first.task_id), ("bob", bobs.task.task_id)):
        retry = gw[who].submit(spec(request_id="job-7", tenant="alice"))
        assert retry.duplicate and retry.task.task_id == task_id, who
    for who, task_id in (("alice", first.task_id), ("bob", bobs.task.task_id)):
        gw[who].release(task_id)


# -- credentials -------------------------------------------------------------------------------------------------


def test_missing_wrong_and_malformed_credentials_are_unauthenticated_health_and_reflection_stay_open(channel, gw):
    task_id = gw["alice"].submit(spec()).task.task_id
    for client in (Client(channel, None), Client(channel, "hst_" + "A" * 43), Client(channel, "")):
        for call in (lambda c=client: c.submit(spec()), lambda c=client: c.get(task_id), lambda c=client: c.list(),
                     lambda c=client: c.release(task_id), lambda c=client: c.watch()):
            err = refused(call)
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err.details()
    basic = refused(lambda: gateway_pb2_grpc.GatewayStub(channel).Get(
        gateway_pb2.GetRequest(task_id=task_id), timeout=10, metadata=(("authorization", "Basic dXNlcjpwdw=="),)))
    assert basic.code() == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in basic.details()
    gw["alice"].release(task_id)


def test_health_and_reflection_need_no_credentials(channel):
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    names = {s.name for r in replies for s in r.list_services_response.service}
    assert "hsched.v1.Gateway" in names


def test_tokens_file_changes_apply_without_a_restart_and_a_broken_edit_keeps_the_last_good_table(stack, channel, gw):
    carol, _ = tk.create_token(stack.tokens_file, "carol", name="carol")
    task_id = Client(channel, carol).submit(spec()).task.task_id  # a token added while the gateway runs
    assert gw["admin"].get(task_id).spec.tenant == "carol"
    good = open(stack.tokens_file).read()
    with open(stack.tokens_file, "w") as f:  # a broken edit: the previous table stays in force
        f.write(good.replace("role: tenant", "role: superuser", 1))
    try:
        assert Client(channel, carol).get(task_id).task_id == task_id
        log = (stack.log_dir / "gateway.log").read_text()
        assert log.count("tokens file changed but cannot be used") == 1
        assert "tokens[" in log and ".role: must be one of tenant, admin" in log
    finally:
        tk._write(tk.Path(stack.tokens_file), tk.parse_tokens(yaml.safe_load(good)))
    assert Client(channel, carol).release(task_id).state == pb.TASK_STATE_RELEASED
    tk.revoke_token(stack.tokens_file, "carol")
    assert refused(lambda: Client(channel, carol).get(task_id)).code() == grpc.StatusCode.UNAUTHENTICATED
    past = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=1)
    with pytest.raises(tk.TokensFileError, match="expires: must be in the future"):
        tk.create_token(stack.tokens_file, "dave", name="dave", expires=past)
    dave = tk.new_token()  # an entry that expired while in the file
    entries = tk.load_tokens(stack.tokens_file)
    tk._write(tk.Path(stack.tokens_file), [*entries, tk.TokenEntry("dave", "dave", "tenant", tk.token_hash(dave), past)])
    err = refused(lambda: Client(channel, dave).list())
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "expired" in err.details()


def test_an_open_watch_ends_unauthenticated_once_its_token_is_revoked(stack, channel, gw):
    """A leaked token revoked while its Watch streams: the stream ends with UNAUTHENTICATED at its next event
    (it went on streaming every new event of the tenant). Events are its own tenant's tasks, submitted by the
    admin in its name."""
    erin, _ = tk.create_token(stack.tokens_file, "erin", name="erin")
    stream = Client(channel, erin).watch(tenant="erin", after="$")
    first = gw["admin"].submit(spec(tenant="erin")).task
    assert next(stream).task_id == first.task_id  # streaming
    time.sleep(1.5)  # past the gateway's re-check interval (WATCH_REAUTH_S)
    tk.revoke_token(stack.tokens_file, "erin")
    second = gw["admin"].submit(spec(tenant="erin")).task
    with pytest.raises(grpc.RpcError) as err:
        for event in stream:
            assert event.task_id != second.task_id, "an event of a task created after the revocation"
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "revoked" in err.value.details()
    for t in (first, second):
        gw["admin"].release(t.task_id)


def test_a_revoked_token_stays_refused_when_a_broken_edit_follows_before_any_call(stack, channel, gw):
    """`tokens revoke ci-d`, then a broken edit, then a call with ci-d's token to a gateway that got no call in
    between (so it never read the revoking version): refused. It was accepted, the gateway keeping its previous
    table (ci-d in it) because the edit was broken. Tokens still in the broken file keep working."""
    cid, _ = tk.create_token(stack.tokens_file, "cid", name="ci-d")
    cie, _ = tk.create_token(stack.tokens_file, "cie", name="ci-e")
    assert Client(channel, cid).list() == [] and Client(channel, cie).list() == []  # both in the gateway's table
    assert cli.main(["tokens", "revoke", "--file", str(stack.tokens_file), "ci-d"]) == 0
    revoked = open(stack.tokens_file).read()
    with open(stack.tokens_file, "a") as f:
        f.write("  - {name: broken\n")
    try:
        assert refused(lambda: Client(channel, cid).list()).code() == grpc.StatusCode.UNAUTHENTICATED
        assert Client(channel, cie).list() == []  # its hash is still in the (broken) file
        log = (stack.log_dir / "gateway.log").read_text()
        assert "(dropped 1 whose hash the file no longer holds)" in log
    finally:
        with open(stack.tokens_file, "w") as f:
            f.write(revoked)
    assert refused(lambda: Client(channel, cid).list()).code() == grpc.StatusCode.UNAUTHENTICATED
    tk.revoke_token(stack.tokens_file, "ci-e")


def test_refusals_are_logged_without_the_token_and_no_token_is_on_a_command_line(stack, channel, gw):
    wrong = "hst_" + "Z" * 43
    refused(lambda: Client(channel, wrong).list())
    logs = "".join(p.read_text(errors="replace") for p in stack.log_dir.glob("*.log"))
    assert "unauthenticated call from" in logs
    for token in (wrong, *gw_tokens(gw)):
        assert token not in logs
    for svc in stack.services.values():
        argv = " ".join(svc.proc.args)
        assert "hst_" not in argv and all(t not in argv for t in gw_tokens(gw))  # the file's path may show
    for path in (stack.tokens_file, stack.admin_token_file):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert all(t not in open(stack.tokens_file).read() for t in gw_tokens(gw))


def gw_tokens(gw) -> list[str]:
    return [c.md[0][1].removeprefix("Bearer ") for c in gw.values()]


# -- the CLI -----------------------------------------------------------------------------------------------------


@pytest.fixture
def no_running_stack(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # a private runtime dir with no stack files in it
    for name in ("HSCHED_TOKEN", "HSCHED_TOKEN_FILE", "HSCHED_TLS_CA", "HSCHED_TLS_CERT", "HSCHED_TLS_KEY"):
        monkeypatch.delenv(name, raising=False)


def test_cli_sends_the_token_from_the_environment_or_a_file(stack, creds, gw, tmp_path, monkeypatch, capsys,
                                                            no_running_stack):
    task_id = gw["alice"].submit(spec()).task.task_id
    get = ["get", "--gateway", stack.gateway, task_id]
    assert cli.main(get) == 1  # no token
    err = capsys.readouterr().err.strip()
    assert err.startswith("hsched: UNAUTHENTICATED:") and "\n" not in err
    monkeypatch.setenv("HSCHED_TOKEN", creds["alice"])
    assert cli.main(get) == 0 and task_id in capsys.readouterr().out
    monkeypatch.setenv("HSCHED_TOKEN", creds["bob"])
    assert cli.main(get) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"hsched: NOT_FOUND: task {task_id} not found"
    assert cli.main(["list", "--gateway", stack.gateway]) == 0
    assert task_id not in capsys.readouterr().out
    monkeypatch.delenv("HSCHED_TOKEN")
    token_file = tmp_path / "alice.token"
    token_file.write_text(creds["alice"] + "\n")
    assert cli.main([*get, "--token-file", str(token_file)]) == 0
    capsys.readouterr()
    monkeypatch.setenv("HSCHED_TOKEN_FILE", str(token_file))
    assert cli.main(["release", "--gateway", stack.gateway, task_id]) == 0
    assert "RELEASED" in capsys.readouterr().out
    monkeypatch.setenv("HSCHED_TOKEN", "hst_wrong")
    assert cli.main(get) == 1 and "UNAUTHENTICATED" in capsys.readouterr().err
    monkeypatch.delenv("HSCHED_TOKEN")
    assert cli.main([*get, "--token-file", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hsched: --token-file: cannot read the token file") and "\n" not in err


def test_cli_uses_the_running_stacks_admin_token_only_for_that_stacks_gateway(stack, gw, tmp_path, monkeypatch,
                                                                               capsys, no_running_stack):
    from hsched.localstate import write_stack

    write_stack({"gateway": stack.gateway, "token_file": str(stack.admin_token_file)})
    task_id = gw["alice"].submit(spec()).task.task_id
    assert cli.main(["get", "--gateway", stack.gateway, task_id]) == 0
    capsys.readouterr()
    other = stack.gateway.replace("127.0.0.1", "localhost")  # the same server under another name: no token sent
    assert cli.main(["get", "--gateway", other, task_id]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    # HSCHED_TOKEN set but empty (cleared, or `HSCHED_TOKEN=$(cat lost.token)`): no token, never the stack's admin
    monkeypatch.setenv("HSCHED_TOKEN", "")
    assert cli.main(["get", "--gateway", stack.gateway, task_id]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    monkeypatch.setenv("HSCHED_TOKEN_FILE", str(stack.admin_token_file))  # a token given beside the cleared one
    assert cli.main(["get", "--gateway", stack.gateway, task_id]) == 0
    capsys.readouterr()
    monkeypatch.delenv("HSCHED_TOKEN")
    monkeypatch.delenv("HSCHED_TOKEN_FILE")
    gw["alice"].release(task_id)


def test_cli_finds_a_multi_gateway_stacks_token_by_one_of_its_addresses(stack, gw, monkeypatch, capsys,
                                                                        no_running_stack):
    """`--gateway 127.0.0.1:P`, P one of the stack's gateways (its target `ipv4:A,B`): the stack's admin token
    goes with the call (it went without one: UNAUTHENTICATED), as docs/operations.md says."""
    from hsched.localstate import write_stack

    with socket.socket() as s:  # a second address of the target, with no gateway behind it
        s.bind(("127.0.0.1", 0))
        spare = f"127.0.0.1:{s.getsockname()[1]}"
    write_stack({"gateway": f"ipv4:{stack.gateway},{spare}", "token_file": str(stack.admin_token_file)})
    task_id = gw["alice"].submit(spec()).task.task_id
    assert cli.main(["get", "--gateway", stack.gateway, task_id]) == 0, capsys.readouterr().err
    assert task_id in capsys.readouterr().out
    assert cli.main(["get", "--gateway", spare, task_id]) == 1  # the other address: no gateway there
    assert "UNAVAILABLE" in capsys.readouterr().err
    gw["alice"].release(task_id)


def test_tokens_commands_print_the_token_once_and_store_only_its_hash(tmp_path, capsys):
    path = tmp_path / "tokens.yaml"
    assert cli.main(["tokens", "create", "--file", str(path), "--tenant", "team-a", "--name", "ci"]) == 0
    out, err = capsys.readouterr()
    token = out.strip()
    assert token.startswith("hst_") and len(token) == 4 + 43 and token not in err
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and token not in path.read_text()
    assert tk.TokenTable(tk.load_tokens(path)).match(token).tenant == "team-a"
    assert cli.main(["tokens", "create", "--file", str(path), "--role", "admin", "--name", "ops"]) == 0
    capsys.readouterr()
    assert cli.main(["tokens", "list", "--file", str(path)]) == 0
    listed = capsys.readouterr().out
    assert "ci" in listed and "ops" in listed and token not in listed
    assert cli.main(["tokens", "create", "--file", str(path), "--tenant", "team-a", "--name", "ci"]) == 2
    assert "already" in capsys.readouterr().err
    assert cli.main(["tokens", "create", "--file", str(path)]) == 2  # role tenant needs --tenant
    assert "--tenant" in capsys.readouterr().err
    assert cli.main(["tokens", "create", "--file", str(path), "--tenant", "Team A"]) == 2
    assert capsys.readouterr().err.startswith("hsched: --tenant: must be a DNS-1123 label")
    assert cli.main(["tokens", "create", "--file", str(path), "--tenant", "a", "--expires", "soon"]) == 2
    assert capsys.readouterr().err.startswith("hsched: --expires: must be an ISO 8601 time")
    before = path.read_text()
    assert cli.main(["tokens", "create", "--file", str(path), "--tenant", "a", "--expires", "2020-01-01T00:00:00Z"]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", "hsched: --expires: must be in the future (a token past it is refused) "
                              "(got '2020-01-01T00:00:00Z')\n")
    assert path.read_text() == before  # nothing written
    assert cli.main(["tokens", "create", "--file", str(path), "--tenant", "a", "--expires", "2999-01-01"]) == 0
    capsys.readouterr()
    assert cli.main(["tokens", "revoke", "--file", str(path), "ci"]) == 0
    assert tk.TokenTable(tk.load_tokens(path)).match(token) is None
    assert cli.main(["tokens", "revoke", "--file", str(path), "ci"]) == 2


# -- the tokens file and certificate identities (no processes) ----------------------------------------------------


def _valid_entry(i: int) -> dict:
    return {"name": f"n{i}", "tenant": f"t{i}", "role": "tenant", "sha256": tk.token_hash(f"token-{i}")}


_junk = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=80),
                  st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))
# (field, a value that breaks its rule): each must be refused naming tokens[i].<field>
_BAD = {
    "name": st.one_of(_junk.filter(lambda v: not (isinstance(v, str) and tk.NAME_RE.match(v))), st.just("UPPER")),
    "role": _junk.filter(lambda v: v not in tk.ROLES),
    "tenant": st.one_of(st.just("Not A Label"), st.just("-x"), st.integers(), st.lists(st.integers(), min_size=1)),
    "sha256": _junk.filter(lambda v: not (isinstance(v, str) and len(v) == 64)) | st.just("hst_" + "a" * 43),
    "expires": st.one_of(st.just("next tuesday"), st.integers(), st.booleans(), st.lists(st.integers(), min_size=1)),
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 3), st.integers(0, 3), st.sampled_from(sorted(_BAD)), st.data())
def test_any_malformed_tokens_entry_is_refused_naming_the_field(count, bad_at, field, data):
    entries = [_valid_entry(i) for i in range(count + 1)]
    bad_at = min(bad_at, count)
    entries[bad_at][field] = data.draw(_BAD[field])
    with pytest.raises(tk.TokensFileError) as err:
        tk.parse_tokens({"version": 1, "tokens": entries})
    assert err.value.field == f"tokens[{bad_at}].{field}"
    assert str(err.value).startswith(f"tokens[{bad_at}].{field}: ")
    if field == "sha256":
        assert "hst_" not in str(err.value)  # a pasted token is never repeated


@settings(max_examples=200, deadline=None)
@given(st.recursive(_junk, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                    st.dictionaries(st.sampled_from(["version", "tokens", "name",
                                                                                     "role", "x"]), inner,
                                                                    max_size=3)), max_leaves=8))
def test_any_document_is_either_loaded_or_refused_with_a_field_never_a_traceback(document):
    try:
        entries = tk.parse_tokens(document)
    except tk.TokensFileError as exc:
        assert exc.field and str(exc).startswith(exc.field[:128])
    else:
        assert all(isinstance(e, tk.TokenEntry) for e in entries)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.binary(max_size=200), st.text(alphabet="tokens:-[]{}: \n\tnamerolsha256x!&*|>'\"#", max_size=120)
                 .map(str.encode)))
def test_any_file_content_is_either_loaded_or_refused_naming_the_file(tmp_path, content):
    path = tmp_path / "tokens.yaml"
    path.write_bytes(content)
    try:
        tk.load_tokens(path)
    except tk.TokensFileError as exc:
        assert str(exc).startswith(str(path))


def test_a_broken_tokens_file_keeps_only_the_previous_tokens_it_still_holds(tmp_path):
    """TokensFile on real files: a broken version keeps the last good table less the tokens whose hash left the
    file; a missing file keeps none; the next good version is the table again."""
    path = tmp_path / "tokens.yaml"
    a, _ = tk.create_token(path, "a", name="a")
    b, _ = tk.create_token(path, "b", name="b")
    tokens = tk.TokensFile(path)
    assert tokens.table().match(a) and tokens.table().match(b)
    tk.revoke_token(path, "a")
    with open(path, "a") as f:
        f.write("  - {name: broken\n")
    assert tokens.table().match(a) is None and tokens.table().match(b).name == "b"
    broken = path.read_text()
    path.unlink()
    assert tokens.table().match(b) is None  # unreadable: no token kept
    path.write_text(broken)  # broken again: nothing to keep from an empty table
    assert tokens.table().match(b) is None
    tk._write(path, [])
    c, _ = tk.create_token(path, "c", name="c")
    assert tokens.table().match(c).name == "c" and tokens.table().match(b) is None


def test_duplicates_unknown_fields_and_broken_yaml_name_what_is_wrong(tmp_path):
    one = _valid_entry(1)
    cases = [
        ({"tokens": [one, {**_valid_entry(2), "name": "n1"}]}, "tokens[1].name"),
        ({"tokens": [one, {**_valid_entry(2), "sha256": one["sha256"]}]}, "tokens[1].sha256"),
        ({"tokens": [{**one, "secret": "x"}]}, "tokens[0].secret"),
        ({"tokens": [{**one, "tenant": ""}]}, "tokens[0].tenant"),
        ({"tokens": one}, "tokens"),
        ({"version": 2, "tokens": []}, "version"),
        ({"tokenz": []}, "tokenz"),
    ]
    for document, field in cases:
        with pytest.raises(tk.TokensFileError) as err:
            tk.parse_tokens(document)
        assert err.value.field == field, document
    path = tmp_path / "t.yaml"
    path.write_text("tokens: [ {name: a\n")
    with pytest.raises(tk.TokensFileError, match=r"t.yaml: is not valid YAML at line \d+"):
        tk.load_tokens(path)
    path.write_bytes(b"tokens: []\n\xff\xfe")
    with pytest.raises(tk.TokensFileError, match="t.yaml: is not UTF-8 text"):
        tk.load_tokens(path)
    path.write_text("!!python/object:os.system {}\n")
    with pytest.raises(tk.TokensFileError, match="t.yaml: is not valid YAML"):
        tk.load_tokens(path)
    admin = {"name": "ops", "role": "admin", "sha256": tk.token_hash("x"), "expires": "2030-01-01T00:00:00+02:00"}
    (entry,) = tk.parse_tokens({"tokens": [admin]})
    assert entry.tenant == "" and entry.expires == dt.datetime(2029, 12, 31, 22, tzinfo=dt.UTC)


def test_certificate_identities_map_to_principals():
    tenant = principal_of_identity("spiffe://hsched.local/tenant/alice")
    assert (tenant.role, tenant.tenant, tenant.admin) == ("tenant", "alice", False)
    admin = principal_of_identity("spiffe://hsched.local/admin/ops")
    assert admin.admin and admin.tenant == ""
    for uri in ("spiffe://hsched.local/service/gateway", "spiffe://other.domain/tenant/alice",
                "spiffe://hsched.local/tenant/", "spiffe://hsched.local/tenant/a/b", "spiffe://hsched.local/tenant/A",
                "https://hsched.local/tenant/alice"):
        assert principal_of_identity(uri) is None, uri


# -- a verified client certificate authenticates like a token (a real TLS server, certificates made here) ---------


def _certificates():
    """A CA (PEM), and (cert PEM, key PEM) per identity, signed by it: what `hsched certs` issues."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(1).not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(ca_key, hashes.SHA256()))

    def leaf(*uris: str) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        sans = [*(x509.UniformResourceIdentifier(u) for u in uris), x509.DNSName("localhost"),
                x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                                                      # a CN is never an identity
                                                                                      "spiffe://hsched.local/admin/cn")]))
                .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName(sans), critical=False).sign(ca_key, hashes.SHA256()))
        return cert.public_bytes(serialization.Encoding.PEM), key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())

    return ca.public_bytes(serialization.Encoding.PEM), leaf


async def test_a_verified_client_certificate_identity_is_a_principal(tmp_path):
    from hsched.security.principals import GatewayAuth, Unauthenticated

    ca, leaf = _certificates()
    token, _ = tk.create_token(tmp_path / "tokens.yaml", "bob", name="bob")
    auth = GatewayAuth(tk.TokensFile(tmp_path / "tokens.yaml"), certificates=True)

    async def whoami(request: bytes, context) -> bytes:
        try:
            p = auth.authenticate(context)
        except Unauthenticated as exc:
            return f"refused: {exc}".encode()
        return f"{p.role} {p.tenant}".encode()

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "test.Who", {"Ami": grpc.unary_unary_rpc_method_handler(whoami)}),))
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
        [leaf("spiffe://hsched.local/service/gateway")[::-1]], root_certificates=ca, require_client_auth=True))
    await server.start()

    async def ask(cert: tuple[bytes, bytes], token: str | None = None) -> str:
        creds = grpc.ssl_channel_credentials(ca, cert[1], cert[0])
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds) as ch:
            md = (("authorization", f"Bearer {token}"),) if token else ()
            return (await ch.unary_unary("/test.Who/Ami")(b"", timeout=10, metadata=md)).decode()

    try:
        assert await ask(leaf("spiffe://hsched.local/tenant/alice")) == "tenant alice"
        assert await ask(leaf("spiffe://hsched.local/admin/ops")) == "admin "
        assert (await ask(leaf("spiffe://hsched.local/service/placer"))).startswith("refused")  # not a client
        assert (await ask(leaf("spiffe://other.example/tenant/alice"))).startswith("refused")
        two = leaf("spiffe://hsched.local/tenant/alice", "spiffe://hsched.local/admin/ops")
        assert (await ask(two)).startswith("refused")  # ambiguous
        alice = leaf("spiffe://hsched.local/tenant/alice")
        assert await ask(alice, token) == "tenant bob"  # a presented token decides
        assert (await ask(alice, "hst_wrong")).startswith("refused")  # ... and a wrong one is not rescued
        # what the CLI and replay build from HSCHED_TLS_CA / HSCHED_TLS_CERT / HSCHED_TLS_KEY and HSCHED_TOKEN
        for name, data in (("ca.crt", ca), ("alice.crt", alice[0]), ("alice.key", alice[1])):
            (tmp_path / name).write_bytes(data)
        env = {"HSCHED_TLS_CA": str(tmp_path / "ca.crt"), "HSCHED_TLS_CERT": str(tmp_path / "alice.crt"),
               "HSCHED_TLS_KEY": str(tmp_path / "alice.key")}
        for extra, expected in (({}, "tenant alice"), ({"HSCHED_TOKEN": token}, "tenant bob")):
            creds = client_credentials(env={**env, **extra})
            async with creds.aio_channel(f"127.0.0.1:{port}") as ch:
                assert (await ch.unary_unary("/test.Who/Ami")(b"", timeout=10, metadata=creds.metadata)).decode() \
                    == expected
        with pytest.raises(ValidationError, match="HSCHED_TLS_KEY"):
            client_credentials(env={"HSCHED_TLS_CERT": env["HSCHED_TLS_CERT"]})
        # the running stack's admin token is not added to a client certificate of the user's own: they act as
        # the certificate's tenant; an explicit token still applies
        admin, _ = tk.create_token(tmp_path / "tokens.yaml", role="admin", name="stack-admin")
        (tmp_path / "admin.token").write_text(admin + "\n")
        stack = {"token_file": str(tmp_path / "admin.token"), "tls_ca": str(tmp_path / "ca.crt")}
        for env_now, expected in ((env, "tenant alice"), ({**env, "HSCHED_TOKEN": token}, "tenant bob")):
            creds = client_credentials(stack=stack, env=env_now)
            async with creds.aio_channel(f"127.0.0.1:{port}") as ch:
                assert (await ch.unary_unary("/test.Who/Ami")(b"", timeout=10, metadata=creds.metadata)).decode() \
                    == expected
        assert client_credentials(stack=stack, env={}).token == admin  # no certificate of their own: the stack's
    finally:
        await server.stop(0)


def test_up_auth_keeps_its_admin_token_across_restarts_and_replaces_a_lost_one(tmp_path):
    tokens_file, token_file = tk.ensure_admin_token(tmp_path / "state")
    token = token_file.read_text().strip()
    assert stat.S_IMODE(os.stat(token_file).st_mode) == stat.S_IMODE(os.stat(tokens_file).st_mode) == 0o600
    assert tk.ensure_admin_token(tmp_path / "state") == (tokens_file, token_file)
    assert token_file.read_text().strip() == token  # the next `hsched up` reuses it
    tk.create_token(tokens_file, "alice", name="alice")
    token_file.unlink()  # lost: a new admin token replaces the old entry, other tokens stay
    tk.ensure_admin_token(tmp_path / "state")
    table = tk.TokenTable(tk.load_tokens(tokens_file))
    assert table.match(token) is None and table.match(token_file.read_text().strip()).role == "admin"
    assert sorted(e.name for e in table.entries) == ["admin", "alice"]
