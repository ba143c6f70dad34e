"""What every hsched gRPC server and client shares: server start-up with health checking and reflection,
channels with deadlines and tracing, and the mapping of library errors to gRPC status codes."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, TypeVar

import grpc
import redis.asyncio.sentinel as async_sentinel
import redis.exceptions as redis_errors
import redis.sentinel as sync_sentinel
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2
from grpc_reflection.v1alpha._async import ReflectionServicer
from grpc_reflection.v1alpha._base import _file_descriptor_response, _not_found_error

from hsched.domain.errors import ResourceExhausted, ValidationError
from hsched.domain.limits import check_message
from hsched.lb import balanced
from hsched.security import authz
from hsched.security.authz import Guard
from hsched.security.principals import Unauthenticated
from hsched.security.tls import ReloadingChannel, TlsFiles, server_credentials
from hsched.state.ledger import StateLost
from hsched.state.redis import NotReplicated
from hsched.telemetry import Metrics, client_interceptors, instrumented, traced_channel
from hsched.telemetry.interceptors import WrappedGeneric

log = logging.getLogger(__name__)

REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
LIVENESS = "liveness"  # the health service name every server answers SERVING while its event loop runs

CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    # a restarted peer (a placer after a crash) is reached again within ~0.1-2 s, not gRPC's default 1-120 s
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", 32 * 1024 * 1024),
]
# A server takes its clients' 30 s keepalive pings: by default it expects >= 5 min between pings on a connection
# without data and sends GOAWAY "too_many_pings" (logged as an error) to an idle peer's channel after two
SERVER_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # no SO_REUSEPORT (gRPC's default on Linux): a second server on a taken port must fail, not share its calls
    ("grpc.so_reuseport", 0),
]


class MethodAwareReflection(ReflectionServicer):
    """Server reflection that also answers file_containing_symbol for a *method* (hsched.v1.Gateway.Submit).

    ghz and grpcurl resolve `--call pkg.Service/Method` by asking for the file that contains the method
    symbol; protobuf's descriptor pool only indexes messages, enums, services and extensions, so stock
    Python reflection answers NOT_FOUND. Methods are looked up through their service here.
    """

    def _file_containing_symbol(self, request, fully_qualified_name):
        try:
            return _file_descriptor_response(self._pool.FindFileContainingSymbol(fully_qualified_name), request)
        except KeyError:
            pass
        service_name, _, method = fully_qualified_name.rpartition(".")
        try:
            service = self._pool.FindServiceByName(service_name)
        except KeyError:
            return _not_found_error(request)
        if method not in service.methods_by_name:
            return _not_found_error(request)
        return _file_descriptor_response(service.file, request)


def add_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> None:
    """Reflection under both v1alpha (ghz, older grpcurl) and v1 (grpcurl >= 1.8.8); the two protocols
    are wire-identical, so one servicer serves both names."""
    names = [*service_names, reflection.SERVICE_NAME, REFLECTION_V1]
    servicer = MethodAwareReflection(names)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    for name in (reflection.SERVICE_NAME, REFLECTION_V1):
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": handler}),))


def listen_problem(bind: str) -> str | None:
    """Why a gRPC server could not listen on `bind` (host:port), in words: the host does not resolve, the port is
    taken, the address is not this machine's; None if a plain socket can bind it now."""
    import socket

    host, sep, port = bind.rpartition(":")
    host = host.strip("[]")
    if not sep or not port.isdigit() or int(port) > 65535:
        return "it must be host:port with a port in 0..65535"
    try:
        infos = socket.getaddrinfo(host or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"the host {host!r} does not resolve ({exc.strerror})"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC: a restart's TIME_WAIT is no problem
        try:
            probe.bind(address)
        except OSError as exc:
            return f"{exc.strerror or exc} (errno {exc.errno})"
    return None


async def start_server(register: Callable[[grpc.aio.Server], None], service_names: list[str],
                       bind: str = "127.0.0.1:0", metrics: Metrics | None = None, serving: bool = True, *,
                       tls: TlsFiles | None = None, client_auth: str = "require", reflection: bool = True,
                       ) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Start an aio server with the given servicers, gRPC health (SERVING, or NOT_SERVING if not `serving`:
    a standby placer) and reflection (unless `reflection` is off); returns the port and the health servicer
    (to change the status later). With `metrics`, every call is counted and timed
    (hsched_rpc_server_requests_total / _duration_seconds).
    With `tls`, the port serves TLS with that leaf (reloaded on change, `hsched.security.tls`); with
    client_auth "require" every caller needs a certificate of the CA and every method is authorized by the
    caller's identity (`hsched.security.authz.POLICY`), checked in the same registration wrapper."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    authorize = authz.guard_for if tls is not None and client_auth == "require" else None
    # checked (garbage and over-limit requests answered INVALID_ARGUMENT), traced and timed: wrapped at registration
    register(checked(instrumented(server, metrics=metrics), authorize))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)  # any CA identity: no guard
    if reflection:  # guarded like the services when callers are authorized (admin and supervisor only)
        add_reflection(checked(server, authorize) if authorize else server, [*service_names, health.SERVICE_NAME])
    try:
        if tls is None:
            port = server.add_insecure_port(bind)
        else:
            port = server.add_secure_port(bind, server_credentials(tls, client_auth))
    except RuntimeError:  # grpc's text only says "set GRPC_VERBOSITY=debug"
        port = 0
    if port == 0:
        raise SystemExit(f"--listen {bind}: cannot listen there: {listen_problem(bind) or 'gRPC refused it'}")
    await server.start()
    await set_health(health_servicer, service_names, serving)
    # SERVING for as long as this server answers, whatever "" says: a liveness check (Kubernetes' grpc probe)
    # that a standby placer passes while it is, rightly, NOT_SERVING (not ready)
    await health_servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    return server, port, health_servicer


class Rejected:
    """What a request deserializer returns instead of a message for bytes that are not a valid request (not
    protobuf, or a field over its limit): the handler answers INVALID_ARGUMENT with `message`. A deserializer
    that raised would make grpc log a traceback per message and answer INTERNAL."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


def checked_deserializer(cls: Any) -> Callable[[bytes], Any]:
    """`cls.FromString` that returns `Rejected` for bytes that do not parse as `cls` or a message with a field
    over its limit (`hsched.domain.limits`) — checked before any handler code sees the request."""
    invalid = f"request is not a valid {cls.DESCRIPTOR.full_name}"
    parse = cls.FromString

    def deserialize(data: bytes) -> Any:
        try:
            message = parse(data)
        except DecodeError:
            return Rejected(invalid)
        try:
            check_message(message)
        except ValidationError as exc:
            return Rejected(str(exc))
        return message

    return deserialize


async def _reject(context: grpc.aio.ServicerContext, request: Rejected) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


async def _valid(requests, context: grpc.aio.ServicerContext):
    """A request stream that ends the call with INVALID_ARGUMENT at its first rejected message."""
    async for request in requests:
        if type(request) is Rejected:
            await _reject(context, request)
        yield request


def checked_handler(handler: Any, guard: Guard | None = None) -> Any:
    """`handler` with a `checked_deserializer` and a behaviour that answers a `Rejected` request with
    INVALID_ARGUMENT (for request streams: ends the stream at the first rejected message). With `guard`
    (`hsched.security.authz.guard_for`), the caller is authorized before anything else."""
    cls = getattr(handler.request_deserializer, "__self__", None)
    if cls is None or not hasattr(cls, "DESCRIPTOR"):
        if guard is None:
            return handler  # not a generated protobuf handler: left as it is
    else:
        handler = handler._replace(request_deserializer=checked_deserializer(cls))
    if handler.request_streaming and handler.response_streaming:
        behavior = handler.stream_stream

        async def stream_stream(requests, context):
            if guard is not None:
                await guard(context)
            async for response in behavior(_valid(requests, context), context):
                yield response

        return handler._replace(stream_stream=stream_stream)
    if handler.request_streaming:  # client streaming: none in hsched's protos, but never left unguarded
        behavior = handler.stream_unary

        async def stream_unary(requests, context):
            if guard is not None:
                await guard(context)
            return await behavior(_valid(requests, context), context)

        return handler._replace(stream_unary=stream_unary)
    if handler.response_streaming:
        behavior = handler.unary_stream

        async def unary_stream(request, context):
            if guard is not None:
                await guard(context)
            if type(request) is Rejected:
                await _reject(context, request)
            async for response in behavior(request, context):
                yield response

        return handler._replace(unary_stream=unary_stream)
    behavior = handler.unary_unary

    async def unary_unary(request, context):
        if guard is not None:
            await guard(context)
        if type(request) is Rejected:
            await _reject(context, request)
        return await behavior(request, context)

    return handler._replace(unary_unary=unary_unary)


class _Checked:
    """What ``add_*Servicer_to_server`` sees instead of the server: every handler `checked_handler`ed (and
    guarded by `authorize(method)` when given)."""

    def __init__(self, server: Any, authorize: Callable[[str], Guard | None] | None = None) -> None:
        self._server = server
        self._authorize = authorize or (lambda _method: None)

    def _wrap(self, handler: Any, method: str) -> Any:
        return checked_handler(handler, self._authorize(method))

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self._server.add_registered_method_handlers(
            service, {m: self._wrap(h, f"/{service}/{m}") for m, h in handlers.items()})

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self._server.add_generic_rpc_handlers(tuple(WrappedGeneric(h, self._wrap) for h in handlers))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


def checked(server: Any, authorize: Callable[[str], Guard | None] | None = None) -> Any:
    """Register servicers on the returned object instead of `server` to have every request deserialized by
    `checked_deserializer`: garbage bytes and over-limit fields get INVALID_ARGUMENT, with no traceback.
    With `authorize` (method -> guard or None), each method's guard runs before its handler."""
    return _Checked(server, authorize)


async def set_health(health_servicer: health.aio.HealthServicer, service_names: list[str], serving: bool) -> None:
    """SERVING or NOT_SERVING for the server as a whole ("") and for each of `service_names`."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", *service_names):
        await health_servicer.set(name, status)


def channel(target: str, tls: TlsFiles | None = None, peer: str | None = None) -> grpc.aio.Channel:
    """A traced channel: unary-unary calls by `traced_channel` (no interceptor on the hot path), server
    streams by the client interceptor. With `tls`: mutual TLS with that leaf, rebuilt when the files change
    (`hsched.security.tls.ReloadingChannel`); `peer` (a role) is the name the server's certificate must
    carry (every leaf has DNS <name>), so a gateway only talks to a placer that holds the placer's cert."""
    streams = [i for i in client_interceptors() if isinstance(i, grpc.aio.UnaryStreamClientInterceptor)]
    if tls is None:
        return traced_channel(grpc.aio.insecure_channel(target, options=balanced(target, CHANNEL_OPTIONS),
                                                        interceptors=streams))
    options = balanced(target, [*CHANNEL_OPTIONS, *([("grpc.ssl_target_name_override", peer)] if peer else [])])
    return traced_channel(ReloadingChannel(tls, lambda creds: grpc.aio.secure_channel(
        target, creds, options=options, interceptors=streams)))


F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def status_of(exc: BaseException, where: str) -> tuple[grpc.StatusCode, str]:
    """The status a handler that raised `exc` answers with (code, a message a person can act on — never a
    traceback); unexpected errors are logged here with their traceback."""
    if isinstance(exc, ValidationError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, ResourceExhausted):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, Unauthenticated):
        return grpc.StatusCode.UNAUTHENTICATED, str(exc)
    if isinstance(exc, PermissionDenied):
        return grpc.StatusCode.PERMISSION_DENIED, str(exc)
    if isinstance(exc, AlreadyExists):
        return grpc.StatusCode.ALREADY_EXISTS, str(exc)
    if redis_outage(exc):
        why = f"{type(exc).__name__}: {redis_error_text(exc)}"
        log.warning("%s: Redis unavailable (%s)", where, why)
        return grpc.StatusCode.UNAVAILABLE, f"the state store (Redis) is unavailable ({why}); retry later"
    if isinstance(exc, LookupError):
        return grpc.StatusCode.NOT_FOUND, str(exc.args[0]) if exc.args else "not found"
    if isinstance(exc, grpc.aio.AioRpcError):  # a downstream hop failed: pass its status on, say which hop
        if exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
            return exc.code(), exc.details() or ""
        return grpc.StatusCode.UNAVAILABLE, f"downstream call failed: {exc.code().name}: {exc.details()}"
    if isinstance(exc, (Unavailable, NotReplicated, StateLost)):  # retry later / elsewhere
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, DeadlinePassed):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)
    log.error("%s failed", where, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error in {where}; see the server log"


# Replies of a Redis that is up but cannot serve writes now (out of memory, a replica, loading, failing over)
_OUTAGE_REPLIES = ("OOM", "READONLY", "LOADING", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "NOREPLICAS", "BUSY")


def redis_error_text(exc: BaseException, limit: int = 300) -> str:
    """A Redis error in one short line: redis-py's MasterNotFoundError appends every Sentinel client's repr
    (kilobytes of connection pool), which clients got in their UNAVAILABLE message."""
    text = " ".join(str(exc).split())
    if isinstance(exc, (sync_sentinel.MasterNotFoundError, async_sentinel.MasterNotFoundError)):
        text = text.split(" : ", 1)[0] + " (the Sentinel named no master)"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def redis_outage(exc: BaseException) -> bool:
    """Whether `exc` says Redis is away or cannot serve right now (a retry later may succeed), as opposed to a
    command this code got wrong."""
    if isinstance(exc, (redis_errors.ConnectionError, redis_errors.TimeoutError, redis_errors.ReadOnlyError)):
        return True
    return isinstance(exc, redis_errors.ResponseError) and str(exc).startswith(_OUTAGE_REPLIES)


def grpc_errors(fn: F) -> F:
    """Map library errors to status codes (`status_of`)."""

    @functools.wraps(fn)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        try:
            return await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - status_of maps it (and logs the unexpected)
            await context.abort(*status_of(exc, fn.__qualname__))

    return wrapper  # type: ignore[return-value]


S = TypeVar("S", bound=Callable[..., AsyncIterator[Any]])


def grpc_stream_errors(fn: S) -> S:
    """`grpc_errors` for a server-streaming handler (an async generator): an error mid-stream ends the stream
    with its mapped status."""

    @functools.wraps(fn)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        try:
            async for item in fn(self, request, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - status_of maps it (and logs the unexpected)
            await context.abort(*status_of(exc, fn.__qualname__))

    return wrapper  # type: ignore[return-value]


class DeadlinePassed(RuntimeError):
    """The caller's deadline passed before the work was done, so it was not done."""


class PermissionDenied(RuntimeError):
    """The caller is authenticated but its role may not do this (a tenant asking for an operator's action)."""


class AlreadyExists(RuntimeError):
    """What the call would create exists already, other than asked (a request_id reused for another spec)."""


class Unavailable(RuntimeError):
    """A dependency (Redis, a placer that lost its lease) is not there: the client may retry later."""
