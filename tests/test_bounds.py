"""Bounded inputs: the field-limit table, capped error echoes, and a fuzz of the real gateway (hostile
messages and raw garbage) that must answer only with the allowed codes and leave Redis and its own memory
where they were."""

from __future__ import annotations

import math
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import redis as redis_sync
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hsched.domain.errors import MAX_ECHO, ValidationError
from hsched.domain.limits import REPEATED_LIMITS, STRING_LIMITS, check_message
from hsched.domain.resources import Resources
from hsched.domain.task import TaskSpec
from hsched.rpc import Rejected, checked_deserializer
from hsched.stack import Stack, StackConfig
from hsched.v1 import common_pb2 as pb
from hsched.v1 import gateway_pb2, gateway_pb2_grpc
from tests.conftest import SMALL_FLEET, delete_prefix

MAX_ERROR = 400  # characters: any over-limit error stays this short, whatever the value


# ------------------------------------------------------------------------------------------------------------
# the limits


def _submit_with(field: str, value) -> gateway_pb2.SubmitRequest:
    req = gateway_pb2.SubmitRequest(task=pb.TaskSpec(tenant="team-a", runtime_s=10))
    if field == "selector_method":
        req.selector_method = value
    elif field == "gpu_models":
        req.task.gpu_models.extend(value)
    else:
        setattr(req.task, field, value)
    return req


TASK_STRINGS = ["request_id", "tenant", "name", "entry_vertex", "selector_method"]


@given(field=st.sampled_from(TASK_STRINGS), extra=st.integers(1, 200_000), char=st.characters(codec="utf-8"))
def test_any_over_limit_string_is_named_with_its_limit_and_not_echoed(field, extra, char) -> None:
    limit = STRING_LIMITS[field]
    with pytest.raises(ValidationError) as err:
        check_message(_submit_with(field, char * (limit + extra)))
    path = field if field == "selector_method" else f"task.{field}"
    assert err.value.field == path and f"at most {limit}" in str(err.value)
    assert len(str(err.value)) <= MAX_ERROR


@given(count=st.integers(1, 50_000), entry_extra=st.integers(0, 1000))
def test_over_limit_gpu_models_count_or_entry_is_named(count, entry_extra) -> None:
    n = REPEATED_LIMITS["gpu_models"]
    with pytest.raises(ValidationError) as err:
        check_message(_submit_with("gpu_models", ["A100"] * (n + count)))
    assert err.value.field == "task.gpu_models" and f"at most {n} entries" in str(err.value)
    with pytest.raises(ValidationError) as err:
        check_message(_submit_with("gpu_models", ["A100", "x" * (STRING_LIMITS["gpu_models"] + 1 + entry_extra)]))
    assert err.value.field == "task.gpu_models[1]" and len(str(err.value)) <= MAX_ERROR


@given(field=st.sampled_from(["request_id", "tenant", "name", "entry_vertex"]), extra=st.integers(1, 100_000))
def test_task_spec_validate_checks_the_same_limits_first(field, extra) -> None:
    value = "a" * (STRING_LIMITS[field] + extra)
    spec = TaskSpec(Resources(-1, -1), runtime_s=math.nan, **{field: value})  # other fields bad too: sizes first
    with pytest.raises(ValidationError) as err:
        spec.validate()
    assert err.value.field == field and len(str(err.value)) <= MAX_ERROR


def test_within_limits_passes_and_other_messages_use_the_defaults() -> None:
    check_message(_submit_with("name", "n" * STRING_LIMITS["name"]))
    check_message(gateway_pb2.ListRequest(page_token="t" * STRING_LIMITS["page_token"]))
    with pytest.raises(ValidationError, match="page_token: must be at most"):
        check_message(gateway_pb2.ListRequest(page_token="t" * (STRING_LIMITS["page_token"] + 1)))


@given(value=st.one_of(st.text(), st.binary(), st.lists(st.text())))
def test_validation_errors_echo_at_most_max_echo_characters_of_the_value(value) -> None:
    err = ValidationError("f", "must be right", value)
    assert len(str(err)) <= len("f: must be right (got ") + MAX_ECHO + len("... (999999 characters))")


def test_garbage_bytes_become_a_rejection_not_an_exception() -> None:
    deserialize = checked_deserializer(gateway_pb2.SubmitRequest)
    got = deserialize(b"\xff\xff\xff\xff")
    assert isinstance(got, Rejected) and got.message == "request is not a valid hsched.v1.SubmitRequest"
    assert isinstance(deserialize(_submit_with("name", "x" * 1000).SerializeToString()), Rejected)
    assert deserialize(b"").task.name == ""  # the empty message is valid protobuf


# ------------------------------------------------------------------------------------------------------------
# the fuzz, through a real stack

ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
           grpc.StatusCode.ALREADY_EXISTS}  # (a fuzzed request_id reused for another spec)
PER_EXAMPLE, EXAMPLES = 220, 48  # >= 10,000 messages in all
WARM_UP = 24  # examples before the footprint is measured: allocator arenas and gRPC buffers at working size
METHODS = ["Submit", "Get", "List", "Watch", "Release"]
REQUEST_OF = {"Submit": gateway_pb2.SubmitRequest, "Get": gateway_pb2.GetRequest, "List": gateway_pb2.ListRequest,
              "Watch": gateway_pb2.WatchRequest, "Release": gateway_pb2.ReleaseRequest}

huge_sizes = st.sampled_from([63, 64, 65, 128, 129, 253, 254, 4096, 100_000, 1_000_000])
hostile_str = st.one_of(st.text(max_size=12), st.sampled_from(["", "0", "$", "t0", "-", "0-0", "9" * 30, "a-b"]),
                        st.builds(lambda c, n: c * n, st.sampled_from(["a", "é", "\x00", "-"]), huge_sizes))
nums = st.one_of(st.integers(-(2 ** 31), 2 ** 31 - 1), st.sampled_from([0, 1, 500, 2000, 24_000]))
big = st.one_of(st.integers(-(2 ** 63), 2 ** 63 - 1), st.sampled_from([0, 100, 1024, 4096]))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1.0, 30.0, -1.0]))
models = st.one_of(st.lists(st.sampled_from(["A100", "V100", "T4", "", "x" * 70]), max_size=4),
                   st.builds(lambda n: ["A100"] * n, st.sampled_from([17, 1000, 100_000])))
resources = st.builds(pb.Resources, cpu_milli=big, memory_mib=big, disk_mib=big, bandwidth_mbps=big,
                      gpu_count=nums, gpu_core_percent=nums, gpu_memory_mib=big)
sane_resources = st.builds(pb.Resources, cpu_milli=st.sampled_from([500, 1000, 4000]),
                           memory_mib=st.sampled_from([256, 1024]), gpu_count=st.sampled_from([0, 0, 1]),
                           gpu_core_percent=st.sampled_from([0, 50]), gpu_memory_mib=st.sampled_from([0, 2048]))
specs = st.builds(
    pb.TaskSpec, request_id=st.one_of(st.just(""), hostile_str), tenant=st.one_of(st.just("team-a"), hostile_str),
    name=hostile_str, priority=nums, resources=st.one_of(sane_resources, resources),
    replicas=st.integers(0, 2 ** 32 - 1) | st.sampled_from([0, 1, 2]), runtime_s=floats | st.just(30.0),
    data_size_mb=floats, entry_vertex=st.one_of(st.just(""), hostile_str),
    network=st.builds(pb.NetworkRequirements, max_latency_ms=floats, max_jitter_ms=floats,
                      max_loss_percent=floats),
    gpu_models=models)
valid_specs = st.builds(  # valid-ish: these get scheduled (and exercise placement, the ledger, the task stream)
    pb.TaskSpec, tenant=st.sampled_from(["team-a", "team-b"]), name=st.sampled_from(["job", "etl"]),
    request_id=st.one_of(st.just(""), st.text("abc123", min_size=1, max_size=6)),
    resources=st.builds(pb.Resources, cpu_milli=st.sampled_from([500, 1000, 4000]),
                        memory_mib=st.sampled_from([256, 1024])),
    replicas=st.sampled_from([0, 1, 2]), runtime_s=st.sampled_from([1.0, 30.0]))
messages = st.one_of(
    st.builds(lambda t: ("Submit", gateway_pb2.SubmitRequest(task=t)), valid_specs),
    st.builds(lambda t, m: ("Submit", gateway_pb2.SubmitRequest(task=t, selector_method=m)),
              specs, st.sampled_from(["", "crf", "spf", "min-cost", "nope"]) | hostile_str),
    st.builds(lambda t: ("Get", gateway_pb2.GetRequest(task_id=t)), hostile_str),
    st.builds(lambda *a: ("List", gateway_pb2.ListRequest(tenant=a[0], state=a[1], datacenter=a[2], limit=a[3],
                                                         page_token=a[4])),
              hostile_str, st.integers(0, 2 ** 31 - 1) | st.integers(0, 6), hostile_str,
              st.integers(0, 2 ** 32 - 1) | st.sampled_from([0, 5, 1000]), hostile_str),
    st.builds(lambda *a: ("Watch", gateway_pb2.WatchRequest(task_id=a[0], tenant=a[1], after_event_id=a[2])),
              hostile_str, hostile_str, hostile_str),
    st.builds(lambda t: ("Release", gateway_pb2.ReleaseRequest(task_id=t)), hostile_str),
    st.builds(lambda m, b: (m, b), st.sampled_from(METHODS), st.binary(max_size=300)),  # raw garbage
)


class Client:
    """Sends what the strategies make to the gateway: messages through their stubs, raw bytes through
    identity-serialized calls; returns each call's status code."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)])
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        self.raw = {m: (self.channel.unary_stream if m == "Watch" else self.channel.unary_unary)(
            f"/hsched.v1.Gateway/{m}") for m in METHODS}
        self.pool = ThreadPoolExecutor(32)

    def one(self, method: str, request) -> grpc.StatusCode:
        call = self.raw[method] if isinstance(request, bytes) else getattr(self.stub, method)
        try:
            if method != "Watch":
                call(request, timeout=60)
                return grpc.StatusCode.OK
            stream = call(request, timeout=60)
            timer = threading.Timer(0.3, stream.cancel)  # a valid Watch streams forever: we stop reading
            timer.start()
            try:
                for _ in stream:
                    pass
            finally:
                timer.cancel()
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            code = exc.code()
            if method == "Watch" and code == grpc.StatusCode.CANCELLED:
                return grpc.StatusCode.OK  # our own cancel of a stream that was being served
            return code

    def send(self, batch: list[tuple[str, object]]) -> list[tuple[str, grpc.StatusCode]]:
        return list(zip((m for m, _ in batch), self.pool.map(lambda mr: self.one(*mr), batch), strict=True))

    def release_everything(self) -> None:
        token = ""
        while True:
            page = self.stub.List(gateway_pb2.ListRequest(limit=1000, page_token=token), timeout=60)
            for t in page.tasks:
                if t.state in (pb.TASK_STATE_PLACED, pb.TASK_STATE_DEFERRED):
                    self.stub.Release(gateway_pb2.ReleaseRequest(task_id=t.task_id), timeout=60)
            if not page.next_page_token:
                return
            token = page.next_page_token

    def close(self) -> None:
        self.pool.shutdown()
        self.channel.close()


def prefix_memory(client: redis_sync.Redis, prefix: str) -> int:
    """Bytes Redis uses for this test's keys (the shared Redis serves others too), less the DC summary streams:
    capped by length (MAXLEN ~100) whatever the input, they fill up to it with any activity; the test asserts
    that cap separately."""
    return sum(v for k, v in key_memory(client, prefix).items() if not k.endswith(":summary"))


def key_memory(client: redis_sync.Redis, prefix: str) -> dict[str, int]:
    return {k.decode(): client.memory_usage(k, samples=0) or 0
            for k in client.scan_iter(match=f"{prefix}:*", count=1000)}


@pytest.fixture(scope="module")
def fuzz_stack(redis_url):
    prefix = f"test-fuzz-{uuid.uuid4().hex[:8]}"
    # short retention so the test sees the state shrink back: finished tasks forgotten after 2 s, ledgers
    # snapshotted every second with a 1 s margin
    env = {"HSCHED_TASK_RETENTION_S": "2", "HSCHED_TASK_PRUNE_INTERVAL_S": "1",
           "HSCHED_LEDGER_SNAPSHOT_INTERVAL_S": "1", "HSCHED_LEDGER_TRIM_MARGIN_S": "1",
           "HSCHED_LEDGER_SNAPSHOT_ENTRIES": "500"}
    config = StackConfig(fleet_path=SMALL_FLEET, redis_url=redis_url, prefix=prefix, gateway_port=0,
                         thermal=False, extra_env=env)
    try:
        with Stack(config) as stack:
            yield stack, prefix
    finally:
        delete_prefix(redis_url, prefix)


def _settle(client: Client, redis_client, prefix: str, stack: Stack, target: tuple[int, float] | None,
            deadline_s: float = 90.0) -> tuple[int, float]:
    """Release every live task, then wait (up to `deadline_s`) for retention to bring the prefix's Redis memory
    and the gateway's RSS down to within 10 % of `target` (or, without one, for them to stop shrinking)."""
    client.release_everything()
    end = time.monotonic() + deadline_s
    last = (prefix_memory(redis_client, prefix), stack.rss_mib()["gateway"])
    while time.monotonic() < end:
        time.sleep(2.0)
        now = (prefix_memory(redis_client, prefix), stack.rss_mib()["gateway"])
        if target is not None and now[0] <= 1.1 * target[0] and now[1] <= 1.1 * target[1]:
            return now
        if target is None and now[0] >= last[0] * 0.98 and time.monotonic() > end - deadline_s + 6:
            return now
        last = now
    return last


@pytest.mark.slow
def test_fuzzed_gateway_answers_only_allowed_codes_and_returns_to_its_footprint(fuzz_stack, redis_url) -> None:
    stack, prefix = fuzz_stack
    client = Client(stack.gateway)
    redis_client = redis_sync.Redis.from_url(redis_url)
    seen: dict[tuple[str, str], int] = {}
    bad: list[tuple[str, str]] = []
    rss: list[float] = []  # the gateway's RSS after each example (MiB), for the report

    def fuzz(examples: int):
        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(batch=st.lists(messages, min_size=PER_EXAMPLE, max_size=PER_EXAMPLE))
        def run(batch) -> None:
            for method, code in client.send(batch):
                seen[(method, code.name)] = seen.get((method, code.name), 0) + 1
                if code not in ALLOWED:
                    bad.append((method, code.name))
            # tasks are released as they would be by their users: what builds up over the fuzz is then only
            # what the gateway keeps and should not (the live set is one example's at most)
            client.release_everything()
            rss.append(round(stack.rss_mib()["gateway"], 1))

        run()

    try:
        fuzz(WARM_UP)  # warm-up: the gateway's allocator and Redis's streams reach their working size
        start = _settle(client, redis_client, prefix, stack, None)
        # The gateway's RSS swings by ~±8 % from one example to the next (pymalloc arenas, gRPC buffers): the
        # baseline is the working size the warm-up reached, its high-water mark, not one sample of the swing.
        start = (start[0], max(start[1], *rss))
        rss.clear()
        seen.clear()
        fuzz(EXAMPLES)
        sent = sum(seen.values())
        assert sent >= 10_000
        assert not bad, f"disallowed codes: {sorted(set(bad))} (all codes: {seen})"
        # the fuzz did reach the gateway's logic, not only its checks
        assert seen.get(("Submit", "OK"), 0) > 0 and seen.get(("Submit", "INVALID_ARGUMENT"), 0) > 0
        end = _settle(client, redis_client, prefix, stack, start)
        print(f"fuzz: {sent} messages, codes {seen}; prefix memory {start[0]} -> {end[0]} B, gateway RSS "
              f"{start[1]:.1f} -> {end[1]:.1f} MiB (after each example: {rss})")
        assert end[0] <= 1.1 * start[0], \
            f"Redis memory of the prefix grew: {start[0]} -> {end[0]} bytes ({key_memory(redis_client, prefix)})"
        assert end[1] <= 1.1 * start[1], f"gateway RSS grew: {start[1]:.1f} -> {end[1]:.1f} MiB"
        for dc in stack.fleet.datacenters:  # the summary streams stayed at their cap (MAXLEN ~100 per DC)
            assert redis_client.xlen(f"{prefix}:dc:{dc.name}:summary") <= 300
        log = (stack.log_dir / "gateway.log").read_text(errors="replace")
        assert "Traceback" not in log and "Exception deserializing" not in log
    finally:
        client.close()
        redis_client.close()


@pytest.mark.slow
def test_garbage_bytes_get_invalid_argument_on_every_method_of_every_service(redis_url) -> None:
    from hsched.v1 import placer_pb2, selector_pb2, thermal_pb2

    prefix = f"test-garbage-{uuid.uuid4().hex[:8]}"
    config = StackConfig(fleet_path=SMALL_FLEET, redis_url=redis_url, prefix=prefix, gateway_port=0)
    garbage = [b"\xff\xff\xff\xff", b"\x0a\x05ab", b"\x12\x80\x80\x80\x80\x10"]
    try:
        with Stack(config) as stack:
            targets = {"gateway": stack.gateway, "selector": stack.services["selector"].target,
                       "placer-cheap": stack.placer_target("cheap"), "thermal": stack.services["thermal"].target}
            services = {"gateway": gateway_pb2.DESCRIPTOR.services_by_name["Gateway"],
                        "selector": selector_pb2.DESCRIPTOR.services_by_name["Selector"],
                        "placer-cheap": placer_pb2.DESCRIPTOR.services_by_name["Placer"],
                        "thermal": thermal_pb2.DESCRIPTOR.services_by_name["Thermal"]}
            checked = 0
            for name, service in services.items():
                with grpc.insecure_channel(targets[name]) as channel:
                    for method in service.methods:
                        path = f"/{service.full_name}/{method.name}"
                        kind = ("stream_stream" if method.client_streaming else
                                "unary_stream" if method.server_streaming else "unary_unary")
                        call = getattr(channel, kind)(path)
                        for data in garbage:
                            with pytest.raises(grpc.RpcError) as err:
                                if kind == "stream_stream":
                                    list(call(iter([data]), timeout=30))
                                elif kind == "unary_stream":
                                    list(call(data, timeout=30))
                                else:
                                    call(data, timeout=30)
                            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (path, err.value)
                            assert err.value.details() == f"request is not a valid {method.input_type.full_name}"
                            checked += 1
            assert checked == 3 * sum(len(s.methods) for s in services.values())
            for name in targets:
                log = (stack.log_dir / f"{name}.log").read_text(errors="replace")
                assert "Traceback" not in log and "Exception deserializing" not in log, name
    finally:
        delete_prefix(redis_url, prefix)


def test_servers_take_their_clients_keepalive_pings():
    """A server whose accepted ping interval is longer than its clients' keepalive answers their pings on an
    idle connection with GOAWAY "too_many_pings" (an error line in every service's log, a reconnect)."""
    from hsched.rpc import CHANNEL_OPTIONS, SERVER_OPTIONS

    client, server = dict(CHANNEL_OPTIONS), dict(SERVER_OPTIONS)
    assert server["grpc.http2.min_ping_interval_without_data_ms"] <= client["grpc.keepalive_time_ms"]
    assert server["grpc.keepalive_permit_without_calls"] == 1 and server["grpc.so_reuseport"] == 0
